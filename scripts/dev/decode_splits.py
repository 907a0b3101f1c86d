"""On a GPU: decoding (Nq = 1, B * H = 64, D = 128, float16) with the tensor-core kernel at a few
split counts beside PyTorch's efficient and flash backends, to choose how many splits it takes.

    python3 scripts/dev/decode_splits.py
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.attention_speed import time_ms  # noqa: E402
from numba_kernels import mma_attention  # noqa: E402

for nk in (4096, 32768):
    q = torch.randn(8, 8, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(8, 8, nk, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    row = {}
    for splits in (None, 8, 16, 32, 64, 128):
        row[f"mma/{splits or 'auto'}"] = time_ms(lambda: mma_attention(q, k, v,
                                                                        num_splits=splits))[0]
    for name, backend in (("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(backend):
            row[name] = time_ms(lambda: F.scaled_dot_product_attention(q, k, v))[0]
    print(f"Nk={nk}: " + "  ".join(f"{n} {ms:.3f} ms" for n, ms in row.items()), flush=True)
