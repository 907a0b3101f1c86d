"""Reproducer: PyTorch's efficient SDPA backend with a boolean mask of more than 2^32
elements. Prints the query rows whose output is wrong (against float64 on those rows).

    python docs/findings/mask_wrap_repro.py [N ...]      (default 65535 65552; N*N vs 2^32)
"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def wrong_rows(n, d=64):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, d, device="cuda") for _ in range(3))
    mask = torch.empty(n, n, dtype=torch.bool, device="cuda")
    for i in range(0, n, 4096):
        mask[i:i + 4096] = torch.rand(min(4096, n - i), n, device="cuda") < 0.6
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
    rows = sorted(set(range(0, n, 997)) | set(range(n - 64, n))
                  | set(range(2**32 // n - 8, min(n, 2**32 // n + 8))))
    idx = torch.tensor(rows, device="cuda")
    s = (q[0, 0, idx].double() @ k[0, 0].double().T) * d ** -0.5
    s = s.masked_fill(~mask[idx], float("-inf"))
    want = torch.softmax(s, -1) @ v[0, 0].double()
    err = (out[0, 0, idx].double() - want).abs().amax(-1)
    return [(r, float(e)) for r, e in zip(rows, err.tolist()) if e > 1e-4], len(rows)


for n in [int(x) for x in sys.argv[1:]] or [65535, 65552]:
    bad, checked = wrong_rows(n)
    print(f"N = {n}: N*N = {n * n} {'>' if n * n > 2**32 else '<'} 2^32; {len(bad)} of "
          f"{checked} checked rows wrong; first {bad[:3]}, last {bad[-2:]}; boundary row "
          f"2^32 // N = {2**32 // n}", flush=True)
