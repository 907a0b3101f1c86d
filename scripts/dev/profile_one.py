"""One launch of a kernel for a profiler:
python scripts/dev/profile_one.py D [N] [dtype] [kernel] [causal] [package].

Launches flash_attention twice on (B, 16, N, D) inputs, B * D = 256 (the benchmark's shapes):
the first launch compiles, so profile the second (ncu --launch-skip 1 --launch-count 1).
kernel: flash_attention's kernel= (simt, the default, or mma); causal: False (the default) or
an alignment (top_left); package: numba_kernels (the default) or an older copy of it
(_ab_mma_old, as scripts/dev/ab_mma.py takes).
"""
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
package = sys.argv[6] if len(sys.argv) > 6 else "numba_kernels"
flash_attention = importlib.import_module(package).flash_attention

D = int(sys.argv[1])
N = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
dtype = getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "float32")
kernel = sys.argv[4] if len(sys.argv) > 4 else "simt"
causal = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "False" else False
q, k, v = (torch.randn(256 // D, 16, N, D, device="cuda", dtype=dtype) for _ in range(3))
for _ in range(2):
    flash_attention(q, k, v, kernel=kernel, causal=causal)
torch.cuda.synchronize()
print("profiled shape", tuple(q.shape), dtype, kernel, "causal", causal, package)
