"""One backward call for a profiler: python scripts/dev/profile_backward.py D [N] [dtype] [kernel].

flash_attention_backward(kernel=) twice on (256 // D, 16, N, D) inputs (N = 8192, float32 and
"tuned" unless given; D = 128: the shape of issue 16's target): the first call compiles, so
profile the second (ncu -k regex:'dkdv_kernel|dq_kernel' --launch-skip 2 --launch-count 2;
the tensor-core kernels are mma_dkdv and mma_dq).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from numba_kernels import flash_attention, flash_attention_backward  # noqa: E402

D = int(sys.argv[1])
N = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
dtype = getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "float32")
kernel = sys.argv[4] if len(sys.argv) > 4 else "tuned"
q, k, v, dout = (torch.randn(256 // D, 16, N, D, device="cuda", dtype=dtype) for _ in range(4))
out, lse = flash_attention(q, k, v, return_lse=True)
for _ in range(2):
    flash_attention_backward(q, k, v, out, lse, dout, kernel=kernel)
torch.cuda.synchronize()
print("profiled shape", tuple(q.shape), dtype)
