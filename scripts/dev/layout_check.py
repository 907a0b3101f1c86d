"""What strided inputs cost: the kernel on contiguous tensors against the same values read
through strides, (B, N, H, D) storage seen as (B, H, N, D). On a GPU, side by side in one run.

    python scripts/dev/layout_check.py

Numba compiles a kernel version per array layout: C-contiguous arrays get addresses computed
from the shape, strided ("A") arrays from their strides (medians of CUDA events). The two
outputs must be bitwise equal.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.attention_speed import DTYPES, time_ms  # noqa: E402
from numba_kernels import flash_attention  # noqa: E402

SHAPES = [(2, 16, 4096, 128, "float32"), (4, 16, 4096, 64, "float16")]

all_same = True
print(f"{'shape':28s} {'contiguous ms':>13s} {'strided ms':>10s} {'ratio':>6s} {'same output':>11s}")
for B, H, N, D, dtype in SHAPES:
    bnhd = [torch.randn(B, N, H, D, device="cuda", dtype=DTYPES[dtype]) for _ in range(3)]
    strided = [x.permute(0, 2, 1, 3) for x in bnhd]
    contiguous = [x.contiguous() for x in strided]
    c_ms, _ = time_ms(lambda: flash_attention(*contiguous))
    s_ms, _ = time_ms(lambda: flash_attention(*strided))
    # Both layouts compute the same sums in the same order: the outputs are bitwise equal.
    same = torch.equal(flash_attention(*contiguous), flash_attention(*strided))
    all_same &= same
    print(f"{str((B, H, N, D, dtype)):28s} {c_ms:13.3f} {s_ms:10.3f} {s_ms / c_ms:6.3f} "
          f"{same!s:>11s}", flush=True)
sys.exit(0 if all_same else 1)
