"""float32 on the tensor cores (float16 halves, halves.py), on the GPU, judged by verify's
rule.

    python scripts/dev/halves_check.py                 one call, forward and backward
    python scripts/dev/halves_check.py --consistency   scores in the thousands
    python scripts/dev/halves_check.py --long          gradients summed over thousands of rows
    python scripts/dev/halves_check.py --long-keys     out, lse and gradients over 16k-32k keys

The first: causal, GQA, a NaN in q, an inf in k and a NaN in v in other heads (so the
forward's careful variant takes scores_exact and pv_seen_pairs, and the backward's nonfinite
variants run), for compute-sanitizer (scripts/dev/gpu_halves_round.sh PART=sanitize).
--consistency: verify's cases where a backward whose scores differ from the forward's by a
rounding fails (pytest conformance found Nq = Nk = 1, D = 16, q and k x30), over seeds:
the worst error / bound of each, and whether dv = dout where one key is seen (P = 1).
"""
import os
import sys
from dataclasses import replace

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from numba_kernels import flash_attention, flash_attention_backward  # noqa: E402
from verify.adapters import load  # noqa: E402
from verify.cases import Case  # noqa: E402
from verify.criterion import judge, judge_backward  # noqa: E402
from verify.runner import run_case  # noqa: E402


def one_call():
    rng = np.random.default_rng(0)
    shapes = ((2, 4, 200, 72), (2, 2, 232, 72), (2, 2, 232, 72), (2, 4, 200, 72))
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    q[1, 3, 70, 5] = np.nan  # row 70 of head 3: its gradients, and the keys it sees
    k[0, 1, 100, 7] = np.inf  # key 100 of key head 1 (query heads 2, 3 of batch 0)
    v[1, 0, 150, 3] = np.nan  # key 150 of key head 0 in batch 1
    options = dict(causal="bottom_right")
    t = [torch.tensor(x, device="cuda") for x in (q, k, v, dout)]
    out, lse = flash_attention(*t[:3], return_lse=True, kernel="mma", **options)
    grads = flash_attention_backward(*t[:3], out, lse, t[3], kernel="mma", **options)
    torch.cuda.synchronize()
    fwd = judge(q, k, v, out.cpu().numpy(), lse.cpu().numpy(), dtype="float32", **options)
    host = [g.cpu().numpy() for g in grads]
    judged = judge_backward(q, k, v, dout, host, dtype="float32", **options)
    for c, g in zip(fwd + judged, [out, lse] + host):
        g = g.cpu().numpy() if hasattr(g, "cpu") else g
        print(f"{c.name}: {'pass' if c.passed else 'FAIL'} max error {c.max_abs_error:.3g} "
              f"({c.ratio:.3f} of the bound), non-finite in the wrong place "
              f"{c.nonfinite_mismatch}, nan {int(np.isnan(g).sum())}")


def consistency():
    impl = load("numba-mma-backward")
    base = Case(name="h", B=1, Hq=1, Hk=1, Nq=1, Nk=1, D=16, Dv=16, dtype="float32",
                values="large", backward=True)
    for shape in ((1, 1, 16), (2, 2, 16), (64, 64, 64), (200, 200, 128), (1, 300, 128)):
        case = replace(base, Nq=shape[0], Nk=shape[1], D=shape[2], Dv=shape[2])
        results = [run_case(impl, case, seed=seed) for seed in range(8)]
        bad = [r for r in results if r.verdict != "pass"]
        print(f"Nq={shape[0]} Nk={shape[1]} D={shape[2]} large: "
              f"{len(results) - len(bad)}/{len(results)} pass"
              + (f"; first failure: {bad[0].detail}" if bad else ""), flush=True)
    rng = np.random.default_rng(1)
    q, k, v, dout = (torch.tensor(rng.standard_normal((4, 8, 1, 16)).astype(np.float32),
                                  device="cuda") for _ in range(4))
    q, k = q * 30, k * 30
    out, lse = flash_attention(q, k, v, return_lse=True)
    dv = flash_attention_backward(q, k, v, out, lse, dout)[2]
    print("one key, q and k x30: max |dv - dout| / max |dout| =",
          float((dv - dout).abs().max() / dout.abs().max()))


def long_sums():
    """Gradients summed over many query rows (dV, dK of a key: Nq rows times the group) or
    keys (dQ): the worst error / bound of dq, dk and dv over 4 seeds, the halves beside the
    SIMT pair."""
    impls = [load("numba-mma-backward"), load("numba-tuned-backward")]
    base = Case(name="long", B=1, Hq=1, Hk=1, Nq=2047, Nk=1, D=16, Dv=16, dtype="float32",
                backward=True)
    for nq, nk, hq, d in ((256, 1, 1, 16), (2047, 1, 1, 16), (4096, 1, 1, 16),
                          (1023, 2, 3, 16), (4096, 64, 1, 16), (4096, 64, 1, 128),
                          (2048, 2048, 1, 16), (64, 4096, 1, 16)):
        case = replace(base, Nq=nq, Nk=nk, Hq=hq, D=d, Dv=d)
        line = []
        for impl in impls:
            results = [run_case(impl, case, seed=seed) for seed in range(4)]
            worst = [max((c.ratio for r in results for c in r.comparisons if c.name == g),
                         default=float("nan")) for g in ("dq", "dk", "dv")]
            line.append(f"{impl.name} {sum(r.verdict == 'pass' for r in results)}/4 pass, "
                        "dq dk dv worst " + " ".join(f"{x:.2f}" for x in worst))
        print(f"Nq={nq} Nk={nk} Hq={hq} D={d}: " + "; ".join(line), flush=True)


def long_keys():
    """The forward's O = P V summed over many keys (and dQ's dS K), where mma.sync's cut
    products add up too: the worst error / bound over 2 seeds of out and lse (a forward
    case) and of dq, dk, dv (a backward case)."""
    impl = load("numba-mma-backward")
    base = Case(name="keys", B=1, Hq=1, Hk=1, Nq=64, Nk=32768, D=128, Dv=128,
                dtype="float32")
    for nq, nk, d in ((64, 32768, 128), (256, 16384, 64), (64, 32768, 16)):
        worst, passed = [], 0
        for backward, names in ((False, ("out", "lse")), (True, ("dq", "dk", "dv"))):
            case = replace(base, Nq=nq, Nk=nk, D=d, Dv=d, backward=backward)
            results = [run_case(impl, case, seed=seed) for seed in range(2)]
            passed += sum(r.verdict == "pass" for r in results)
            worst += [max(c.ratio for r in results for c in r.comparisons if c.name == g)
                      for g in names]
        print(f"Nq={nq} Nk={nk} D={d}: {passed}/4 pass, out lse dq dk dv worst "
              + " ".join(f"{x:.2f}" for x in worst), flush=True)


if __name__ == "__main__":
    if "--long-keys" in sys.argv:
        long_keys()
    elif "--consistency" in sys.argv:
        consistency()
    elif "--long" in sys.argv:
        long_sums()
    else:
        one_call()
