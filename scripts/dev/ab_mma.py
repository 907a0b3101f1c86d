"""The working tree's tensor-core forward (or with --backward, backward) against an older copy
of the package, side by side.

    cp -r numba_kernels _ab_mma_old      # at the older commit (git worktree or checkout)
    python scripts/dev/ab_mma.py [--backward [--float32]]

Both through their own mma_attention or flash_attention_backward(kernel="mma") (each version's
whole call: checks and every launch), on the same inputs. Medians of CUDA events, each call
alone (after the last one's end) and ten back to back (the GPU's time: the host's work
overlaps the previous call), alternating old and new three times; the largest difference
between the two outputs as a sanity check; last, each version's causal speed-up (full time
over causal time), per call and back to back. --float32:
the backward shapes in float32 (the halves' kernels, after the mma forward). AB_ONLY="N:D,..."
keeps only the shapes of those Nq and head dims.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import _ab_mma_old as old  # noqa: E402
import numba_kernels as new  # noqa: E402
from benchmarks.attention_speed import DTYPES, events_ms, time_ms  # noqa: E402

# (B, H, Nq, Nk, D, dtype, causal); the last: decoding. Each causal shape follows the same
# shape without: the table ends with the causal speed-up of each version.
SHAPES = [(2, 16, 8192, 8192, 128, "float16", False), (2, 16, 8192, 8192, 128, "bfloat16", False),
          (2, 16, 8192, 8192, 128, "bfloat16", True),
          (4, 16, 8192, 8192, 64, "float16", False), (4, 16, 8192, 8192, 64, "float16", True),
          (4, 16, 8192, 8192, 64, "bfloat16", False), (4, 16, 8192, 8192, 64, "bfloat16", True),
          (2, 16, 4096, 4096, 128, "float16", False), (2, 16, 4096, 4096, 128, "float16", True),
          (2, 16, 4096, 4096, 128, "bfloat16", False), (2, 16, 4096, 4096, 128, "bfloat16", True),
          (4, 16, 4096, 4096, 64, "float16", False), (4, 16, 4096, 4096, 64, "float16", True),
          (4, 16, 4096, 4096, 64, "bfloat16", False), (4, 16, 4096, 4096, 64, "bfloat16", True),
          (2, 16, 1024, 1024, 128, "float16", False), (8, 8, 1, 32768, 128, "float16", False)]

BACKWARD_SHAPES = [(2, 16, 4096, 4096, 128, "bfloat16", False),
                   (2, 16, 4096, 4096, 128, "bfloat16", True),
                   (2, 16, 8192, 8192, 128, "float16", False),
                   (2, 16, 8192, 8192, 128, "float16", True),
                   (4, 16, 8192, 8192, 64, "bfloat16", False),
                   (4, 16, 8192, 8192, 64, "bfloat16", True),
                   (4, 16, 4096, 4096, 64, "bfloat16", False),
                   (4, 16, 4096, 4096, 64, "bfloat16", True)]


def forward_runs(q, k, v, causal):
    return {name: (lambda m=m: m.mma_attention(q, k, v, causal=causal))
            for name, m in (("old", old), ("new", new))}


def backward_runs(q, k, v, causal):
    dout = torch.randn_like(q)
    out, lse = new.flash_attention(q, k, v, causal=causal, return_lse=True, kernel="mma")
    return {name: (lambda m=m: m.flash_attention_backward(q, k, v, out, lse, dout,
                                                           causal=causal, kernel="mma"))
            for name, m in (("old", old), ("new", new))}


def compare(shapes, make_runs, flops_factor, title):
    """Old and new on each shape, alternating three times (the best of each); then, for each
    causal shape that follows the same shape without, full / causal time for both."""
    print(f"{title:52s} {'old ms':>8s} {'new ms':>8s} {'new/old':>7s} {'TF/s new':>8s} "
          f"{'x10 old':>8s} {'x10 new':>8s} {'new/old':>7s} max|diff|")
    best, back = {}, {}
    for B, H, NQ, NK, D, dtype, causal in shapes:
        q = torch.randn(B, H, NQ, D, device="cuda", dtype=DTYPES[dtype])
        k, v = (torch.randn(B, H, NK, D, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
        runs = make_runs(q, k, v, "top_left" if causal else False)
        results = [runs[name]() for name in ("old", "new")]
        results = [r if isinstance(r, tuple) else (r,) for r in results]
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(*results))
        times = {"old": [], "new": []}
        tens = {"old": [], "new": []}
        for _ in range(3):
            for name, run in runs.items():
                times[name].append(time_ms(run)[0])
                tens[name].append(events_ms(run, 10, repeats=3))
        shape = (B, H, NQ, NK, D, dtype, causal)
        o, n = best[shape] = min(times["old"]), min(times["new"])
        o10, n10 = back[shape] = min(tens["old"]), min(tens["new"])
        tf = flops_factor * 4 * B * H * NQ * NK * D / (2 if causal else 1) / n / 1e9
        print(f"{str(shape):52s} {o:8.3f} {n:8.3f} {n / o:7.3f} {tf:8.1f} {o10:8.3f} "
              f"{n10:8.3f} {n10 / o10:7.3f} {diff:.1e}", flush=True)
    for shape in best:
        full = shape[:-1] + (False,)
        if shape[-1] and full in best:
            (fo, fn), (co, cn) = best[full], best[shape]
            (bo, bn), (do, dn) = back[full], back[shape]
            print(f"causal speed-up {str(shape[:-1]):44s} per call: old {fo / co:5.2f}x  "
                  f"new {fn / cn:5.2f}x; back to back: old {bo / do:5.2f}x  new {bn / dn:5.2f}x")


ONLY = os.environ.get("AB_ONLY")  # "N:D,N:D": only the shapes of these Nq and D
if ONLY:
    keep = {tuple(map(int, x.split(":"))) for x in ONLY.split(",")}
    SHAPES = [s for s in SHAPES if (s[2], s[4]) in keep]
    BACKWARD_SHAPES = [s for s in BACKWARD_SHAPES if (s[2], s[4]) in keep]
if "--float32" in sys.argv:
    BACKWARD_SHAPES = [s[:5] + ("float32",) + s[6:] for s in BACKWARD_SHAPES]
if "--backward" in sys.argv:
    compare(BACKWARD_SHAPES, backward_runs, 2.5, "backward shape")
else:
    compare(SHAPES, forward_runs, 1, "shape")
