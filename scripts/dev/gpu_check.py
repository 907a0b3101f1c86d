"""What the kernel must show on a GPU, in one run: correctness on a large battery, sanitizers.

    python scripts/dev/gpu_check.py [--out DIR] [--quick] [--no-sanitize]

1. The battery: every dtype, D in {16, 40, 64, 96, 128, 256}, every mask kind, shapes up to
   8192, against the float64 reference computed on the GPU with CuPy, under the project's
   error criterion; each output buffer poisoned with NaN first (every element must be
   written), each case run twice (bitwise equal, the second time on copies of the inputs),
   after a call of the same layout on other inputs (so the launch plan is reused), inputs
   compared before and after.
2. compute-sanitizer racecheck and memcheck on small launches of several variants.
Timings are benchmarks/attention_speed.py's job.
Writes DIR/gpu_check.json and prints a short table last. Exit code 0 only if all passed.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cupy  # noqa: E402
from numba import config  # noqa: E402

config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
import torch  # noqa: E402

from numba_kernels import api, flash_attention, launch  # noqa: E402
from reference.dtypes import KERNEL_DTYPES, torch_dtype  # noqa: E402
from verify.criterion import judge  # noqa: E402

TORCH_DTYPES = {name: torch_dtype(name) for name in KERNEL_DTYPES}


def poison_outputs():
    """Every output buffer the kernel gets starts as NaN."""
    def empty(self, shape, dtype):
        return torch.full(shape, float("nan"), dtype=getattr(torch, dtype), device="cuda")

    api._TorchIO.empty = empty


def make_case(rng, B, Hq, Hk, Nq, Nk, D, Dv, dtype, kind):
    t = TORCH_DTYPES[dtype]
    q, k, v = (torch.from_numpy(rng.standard_normal(s, dtype=np.float32)).to("cuda", t)
               for s in ((B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, Dv)))
    kernel_kw, ref_kw = {}, {}
    if kind in ("top_left", "bottom_right"):
        kernel_kw = ref_kw = dict(causal=kind)
    elif kind == "window":
        kernel_kw = ref_kw = dict(window=(97, 13))
    elif kind == "kv_lengths":
        lengths = rng.integers(0, Nk + 1, B).astype(np.int32)
        lengths[0] = Nk
        kernel_kw = dict(kv_lengths=torch.from_numpy(lengths).cuda(), causal="bottom_right")
        ref_kw = dict(kv_lengths=lengths, causal="bottom_right")
    elif kind == "mask":
        m = rng.random((B, 1, Nq, Nk)) < 0.3
        m[:, :, :: max(1, Nq // 3)] = False  # fully masked rows
        kernel_kw = dict(mask=torch.from_numpy(m).cuda())
        ref_kw = dict(mask=cupy.asarray(m))
    return (q, k, v), kernel_kw, ref_kw


def bits(x):
    return x.contiguous().view(torch.int16 if x.element_size() == 2 else torch.int32)


def run_case(rng, name, dtype, shape, kind):
    B, Hq, Hk, Nq, Nk, D, Dv = shape
    # A first call on other inputs of the same layout, so that the judged call reuses its
    # launch plan (launch.py) and must take every pointer from its own arguments.
    warm, warm_kw, _ = make_case(rng, B, Hq, Hk, Nq, Nk, D, Dv, dtype, kind)
    flash_attention(*warm, return_lse=True, **warm_kw)
    (q, k, v), kernel_kw, ref_kw = make_case(rng, B, Hq, Hk, Nq, Nk, D, Dv, dtype, kind)
    before = [x.clone() for x in (q, k, v)]
    out, lse = flash_attention(q, k, v, return_lse=True, **kernel_kw)
    out2, lse2 = flash_attention(*before, return_lse=True, **kernel_kw)
    torch.cuda.synchronize()
    deterministic = bool(torch.equal(bits(out), bits(out2)) and torch.equal(bits(lse), bits(lse2)))
    untouched = all(torch.equal(bits(a), bits(b)) for a, b in zip((q, k, v), before))
    ref_inputs = [cupy.from_dlpack(x.float().contiguous()) for x in (q, k, v)]
    comps = judge(*ref_inputs, out.float().cpu().numpy(), lse.cpu().numpy(), dtype=dtype,
                  **ref_kw)
    unwritten = int(torch.isnan(out).sum() + torch.isnan(lse).sum())  # truth has no NaN here
    ok = all(c.passed for c in comps) and deterministic and untouched and unwritten == 0
    return dict(name=name, dtype=dtype, shape=shape, kind=kind, ok=ok,
                out_ratio=comps[0].ratio, lse_ratio=comps[1].ratio,
                out_err=comps[0].max_abs_error, out_plain=comps[0].plain_error,
                deterministic=deterministic, untouched=untouched, unwritten=unwritten,
                messages=[c.message() for c in comps if not c.passed])


def battery(quick):
    rng = np.random.default_rng(0)
    kinds = ["none", "top_left", "bottom_right", "window", "kv_lengths", "mask"]
    cases = []
    for dtype in TORCH_DTYPES:
        for D in (16, 40, 64, 96, 128, 256):
            for i, kind in enumerate(kinds):
                nq, nk = [(1000, 1537), (1537, 1000), (777, 777), (64, 2049), (1, 3001),
                          (513, 1)][i]
                cases.append((f"D{D}", dtype, (2, 4, 2, nq, nk, D, D), kind))
    big = [("long", "float32", (1, 2, 1, 8192, 8192, 128, 128), "none"),
           ("long-causal", "float32", (1, 2, 2, 8192, 8192, 128, 128), "bottom_right"),
           ("long-f16-mask", "float16", (1, 2, 1, 4096, 8191, 64, 64), "mask"),
           ("decode", "bfloat16", (4, 8, 1, 1, 8192, 128, 128), "kv_lengths"),
           ("dv-differs", "float16", (2, 6, 3, 300, 700, 40, 72), "top_left"),
           ("mqa-d1", "float32", (1, 5, 1, 99, 130, 1, 1), "none")]
    cases += big
    if quick:
        cases = cases[::7] + big
    rows = []
    t0 = time.time()
    for n, case in enumerate(cases):
        row = run_case(rng, *case)
        rows.append(row)
        flag = "ok" if row["ok"] else "FAIL"
        print(f"[{n + 1}/{len(cases)} {time.time() - t0:5.0f}s] {row['name']:14s} "
              f"{row['dtype']:8s} {str(row['shape']):34s} {row['kind']:12s} out/bound "
              f"{row['out_ratio']:.2f} lse/bound {row['lse_ratio']:.2f} {flag}", flush=True)
        for m in row["messages"]:
            print("   ", m.replace("\n", "\n    "))
    return rows


SANITIZE = """
import torch
from numba_kernels import flash_attention
g = torch.Generator(device="cuda").manual_seed(0)
def r(*s, dt=torch.float32):
    return torch.randn(*s, device="cuda", generator=g).to(dt)
m = torch.rand(2, 1, 200, 77, device="cuda", generator=g) < 0.5
flash_attention(r(2, 2, 200, 64), r(2, 1, 77, 64), r(2, 1, 77, 64), mask=m, causal="top_left")
flash_attention(r(1, 2, 100, 128, dt=torch.bfloat16), r(1, 2, 150, 128, dt=torch.bfloat16),
                r(1, 2, 150, 128, dt=torch.bfloat16), causal="bottom_right",
                kv_lengths=torch.tensor([111], device="cuda", dtype=torch.int32))
flash_attention(r(1, 1, 40, 256, dt=torch.float16), r(1, 1, 70, 256, dt=torch.float16),
                r(1, 1, 70, 256, dt=torch.float16), window=(9, 3), return_lse=True)
flash_attention(r(1, 3, 33, 40), r(1, 1, 65, 40), r(1, 1, 65, 24))
flash_attention(r(2, 4, 1, 64, dt=torch.float16), r(2, 4, 900, 64, dt=torch.float16),
                r(2, 4, 900, 64, dt=torch.float16), num_splits=5, causal="bottom_right")
torch.cuda.synchronize()
print("sanitize launches done")
"""


def sanitize(out_dir):
    results = {}
    path = os.path.join(out_dir, "sanitize_case.py")
    with open(path, "w") as f:
        f.write(SANITIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for tool in ("racecheck", "memcheck"):
        t0 = time.time()
        # Host API errors are cuda-bindings probing driver entry points at start-up, not
        # memory errors of any kernel: leave them out of the summary.
        run = subprocess.run(["compute-sanitizer", "--tool", tool, "--report-api-errors", "no",
                              sys.executable, path],
                             capture_output=True, text=True, env=env, timeout=240)
        text = run.stdout + run.stderr
        with open(os.path.join(out_dir, f"sanitize_{tool}.log"), "w") as f:
            f.write(text)
        summary = [ln for ln in text.splitlines() if "ERROR SUMMARY" in ln or "RACECHECK" in ln]
        results[tool] = dict(rc=run.returncode, seconds=round(time.time() - t0, 1),
                             summary=summary[-3:], done="launches done" in text)
        print(f"compute-sanitizer {tool}: rc={run.returncode} {summary[-3:]} "
              f"({results[tool]['seconds']} s)", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sanitize", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "cupy", cupy.__version__,
          flush=True)
    poison_outputs()
    report = {"device": torch.cuda.get_device_name()}
    report["battery"] = rows = battery(a.quick)
    if not a.no_sanitize:
        report["sanitize"] = sanitize(a.out)
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    failed = [r for r in rows if not r["ok"]]
    worst = max(rows, key=lambda r: max(r["out_ratio"], r["lse_ratio"]))
    print(f"\nbattery: {len(rows) - len(failed)} passed, {len(failed)} failed; worst "
          f"error/bound {max(worst['out_ratio'], worst['lse_ratio']):.2f} "
          f"({worst['name']} {worst['dtype']} {worst['kind']})")
    fast = launch.FAST_LAUNCHES[0]
    print(f"launches that reused a plan (launch.py): {fast}" + ("" if fast else
          " (FAIL: every call took Numba's launch)"))
    san_ok = all(s["rc"] == 0 and s["done"] for s in report.get("sanitize", {}).values())
    print("sanitizers:", {t: s["summary"] for t, s in report.get("sanitize", {}).items()})
    return 0 if not failed and san_ok and fast else 1


if __name__ == "__main__":
    sys.exit(main())
