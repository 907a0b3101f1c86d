"""Seconds to compile (first launch) and to run (second launch) a few kernel variants on a GPU.

    python scripts/dev/compile_probe.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from numba_kernels import flash_attention  # noqa: E402

for D, dtype, masked in ((64, torch.float32, False), (128, torch.float16, True),
                         (256, torch.bfloat16, False)):
    q, k, v = (torch.randn(1, 2, 100, D, device="cuda", dtype=dtype) for _ in range(3))
    mask = torch.rand(100, 100, device="cuda") < 0.5 if masked else None
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        flash_attention(q, k, v, mask=mask)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print(f"D={D} {dtype} mask={masked}: first launch {times[0]:.1f} s, second {times[1]:.4f} s",
          flush=True)
