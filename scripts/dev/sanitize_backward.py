"""Small calls of the tuned (SIMT) backward for compute-sanitizer (racecheck, memcheck): each
padded width's tiles (64, 128, 256; dynamic shared memory), partial query and key tiles, a
causal band, GQA, a mask with bias, kv_lengths, a NaN in a key (the slower products).

    compute-sanitizer --tool racecheck python3 scripts/dev/sanitize_backward.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from numba_kernels import flash_attention, flash_attention_backward  # noqa: E402

g = torch.Generator(device="cuda").manual_seed(0)


def r(*shape):
    return torch.randn(*shape, device="cuda", generator=g)


def backward(q, k, v, **options):
    out, lse = flash_attention(q, k, v, return_lse=True, kernel="simt", **options)
    return flash_attention_backward(q, k, v, out, lse, r(*out.shape), kernel="tuned", **options)


backward(r(2, 2, 70, 64), r(2, 1, 77, 64), r(2, 1, 77, 48), causal="top_left")
mask = torch.rand(1, 1, 130, 65, device="cuda", generator=g) < 0.6
backward(r(1, 2, 130, 128), r(1, 2, 65, 128), r(1, 2, 65, 128), mask=mask, bias=r(1, 2, 130, 65),
         causal="bottom_right")
k = r(1, 1, 100, 200)
k[0, 0, 40] = float("nan")
backward(r(1, 2, 33, 200), k, r(1, 1, 100, 256), window=(20, 5),
         kv_lengths=torch.tensor([90], device="cuda", dtype=torch.int32))
torch.cuda.synchronize()
print("sanitize launches done")
