"""On a GPU: the tensor-core forward against the float64 reference on a few shapes, one line each.

    python3 scripts/dev/mma_smoke.py

A first look before verify's suite (which says pass or fail under its rule): the largest error
of kernel="mma" and of kernel="simt" on the same inputs, and the milliseconds of one warm call.
"""
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from numba_kernels import flash_attention  # noqa: E402
from reference import attention  # noqa: E402
from reference.dtypes import torch_dtype  # noqa: E402

SHAPES = [  # (B, H, Nq, Nk, D, options)
    (1, 1, 64, 32, 64, {}),
    (2, 4, 300, 257, 128, {}),
    (2, 4, 300, 257, 64, {"causal": "top_left"}),
    (1, 2, 129, 1000, 128, {"causal": "bottom_right"}),
]


def max_error(out, truth):
    return float(np.max(np.abs(out.float().cpu().numpy().astype(np.float64) - truth)))


def one(dtype, b, h, nq, nk, d, options):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(torch_dtype(dtype)).cuda()
               for n in (nq, nk, nk))
    truth = attention(*(x.double().cpu().numpy() for x in (q, k, v)), **options)
    errors = {}
    for kernel in ("mma", "simt"):
        out = flash_attention(q, k, v, kernel=kernel, **options)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        flash_attention(q, k, v, kernel=kernel, **options)
        torch.cuda.synchronize()
        errors[kernel] = (max_error(out, truth), (time.perf_counter() - t0) * 1e3)
    print(f"{dtype:9s} {(b, h, nq, nk, d)} {options}: "
          + "  ".join(f"{k} err {e:.2e} ({ms:.2f} ms)" for k, (e, ms) in errors.items()), flush=True)


def main():
    for dtype in ("float16", "bfloat16"):
        for b, h, nq, nk, d, options in SHAPES:
            start = time.perf_counter()
            try:
                one(dtype, b, h, nq, nk, d, options)
            except Exception as e:  # a first run: report and go on
                print(f"{dtype} {(b, h, nq, nk, d)} {options}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]}", flush=True)
            print(f"   ({time.perf_counter() - start:.1f} s with compiling)", flush=True)


if __name__ == "__main__":
    main()
