"""The working tree's tensor-core forward (or with --backward, backward) against an older copy
of the package, side by side.

    cp -r numba_kernels _ab_mma_old      # at the older commit (git worktree or checkout)
    python scripts/dev/ab_mma.py [--backward]

Both through their own mma_attention (each version's whole call: checks, launches, the
pre-pass where a version has one), on the same inputs. Medians of CUDA events, alternating
old and new three times; the largest difference between the two outputs as a sanity check.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import _ab_mma_old as old  # noqa: E402
import numba_kernels as new  # noqa: E402
from benchmarks.attention_speed import DTYPES, time_ms  # noqa: E402

# (B, H, Nq, Nk, D, dtype, causal); the last: decoding
SHAPES = [(2, 16, 8192, 8192, 128, "float16", False), (2, 16, 8192, 8192, 128, "bfloat16", False),
          (4, 16, 4096, 4096, 64, "float16", False), (4, 16, 8192, 8192, 64, "bfloat16", False),
          (2, 16, 8192, 8192, 128, "float16", True), (2, 16, 1024, 1024, 128, "float16", False),
          (8, 8, 1, 32768, 128, "float16", False)]

BACKWARD_SHAPES = [(2, 16, 4096, 4096, 128, "bfloat16", False),
                   (2, 16, 8192, 8192, 128, "float16", False),
                   (4, 16, 4096, 4096, 64, "bfloat16", False),
                   (2, 16, 8192, 8192, 128, "bfloat16", True)]


def backward():
    """flash_attention_backward(kernel="mma") of each version on one forward's results; FLOPs
    2.5 times the forward's."""
    print(f"{'backward shape':52s} {'old ms':>8s} {'new ms':>8s} {'new/old':>7s} "
          f"{'TF/s new':>8s} max|diff|")
    for B, H, NQ, NK, D, dtype, causal in BACKWARD_SHAPES:
        q, k, v, dout = (torch.randn(B, H, n, D, device="cuda", dtype=DTYPES[dtype])
                         for n in (NQ, NK, NK, NQ))
        c = "top_left" if causal else False
        out, lse = new.flash_attention(q, k, v, causal=c, return_lse=True)
        runs = {name: (lambda m=m: m.flash_attention_backward(q, k, v, out, lse, dout,
                                                               causal=c, kernel="mma"))
                for name, m in (("old", old), ("new", new))}
        diff = max((a.float() - b.float()).abs().max().item()
                   for a, b in zip(runs["old"](), runs["new"]()))
        times = {"old": [], "new": []}
        for _ in range(3):
            for name, run in runs.items():
                times[name].append(time_ms(run)[0])
        o, n = min(times["old"]), min(times["new"])
        tf = 2.5 * 4 * B * H * NQ * NK * D / (2 if causal else 1) / n / 1e9
        print(f"{str((B, H, NQ, NK, D, dtype, causal)):52s} {o:8.3f} {n:8.3f} {n / o:7.3f} "
              f"{tf:8.1f} {diff:.1e}", flush=True)


if "--backward" in sys.argv:
    backward()
    sys.exit()
print(f"{'shape':52s} {'old ms':>8s} {'new ms':>8s} {'new/old':>7s} {'TF/s new':>8s} max|diff|")
for B, H, NQ, NK, D, dtype, causal in SHAPES:
    q = torch.randn(B, H, NQ, D, device="cuda", dtype=DTYPES[dtype])
    k, v = (torch.randn(B, H, NK, D, device="cuda", dtype=DTYPES[dtype]) for _ in range(2))
    c = "top_left" if causal else False
    runs = {"old": lambda: old.mma_attention(q, k, v, causal=c),
            "new": lambda: new.mma_attention(q, k, v, causal=c)}
    diff = (runs["old"]().float() - runs["new"]().float()).abs().max().item()
    times = {"old": [], "new": []}
    for _ in range(3):
        for name, run in runs.items():
            times[name].append(time_ms(run)[0])
    o, n = min(times["old"]), min(times["new"])
    tf = 4 * B * H * NQ * NK * D / (2 if causal else 1) / n / 1e9
    print(f"{str((B, H, NQ, NK, D, dtype, causal)):52s} {o:8.3f} {n:8.3f} {n / o:7.3f} "
          f"{tf:8.1f} {diff:.1e}", flush=True)
