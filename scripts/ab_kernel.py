"""The working tree's kernel against an older flash_fwd.py, side by side on the same inputs.

    git show REV:numba_kernels/flash_fwd.py > numba_kernels/_ab_old_flash_fwd.py
    python scripts/ab_kernel.py

Medians of CUDA events (attention_speed.time_ms), alternating old and new three times.
"""
import os
import sys

import torch
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.attention_speed import DTYPES, time_ms  # noqa: E402
from numba_kernels import _ab_old_flash_fwd as old  # noqa: E402
from numba_kernels import api, choose_spec, flash_attention  # noqa: E402
from numba_kernels.flash_fwd import FASTMATH  # noqa: E402
from numba_kernels.specs import build_kernel  # noqa: E402

SHAPES = [(2, 16, 4096, 128, "float32", False), (4, 16, 4096, 64, "float16", False),
          (2, 16, 4096, 128, "float16", False), (2, 16, 4096, 128, "float32", "bottom_right")]
print(f"{'shape':44s} {'old ms':>8s} {'new ms':>8s} {'new/old':>7s}")
for B, H, N, D, dtype, causal in SHAPES:
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=DTYPES[dtype]) for _ in range(3))
    spec = choose_spec(D, D, dtype, False)
    old_kernel = cuda.jit(fastmath=FASTMATH)(old.kernel_source(spec))
    times = {"old": [], "new": []}
    for _ in range(3):
        for name in ("old", "new"):
            api.build_kernel = (lambda s: old_kernel) if name == "old" else build_kernel
            times[name].append(time_ms(lambda: flash_attention(q, k, v, causal=causal))[0])
    o, n = min(times["old"]), min(times["new"])
    print(f"{str((B, H, N, D, dtype, causal)):44s} {o:8.3f} {n:8.3f} {n / o:7.3f}", flush=True)
