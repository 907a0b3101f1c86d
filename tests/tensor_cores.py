"""How an H200's tensor cores sum (tests/test_gpu.py measured it; tests/test_halves.py checks
this model against what the GPU returned): a step's addends, the products and the
accumulator, each cut toward zero to the ulp of the largest of them, then added, the sum cut
to float32 toward zero. Not round-to-nearest: warp.mma_reference, the simulator's rule,
rounds once to nearest."""
import numpy as np


def h200_sum(addends):
    """addends (..., n) float64, exact -> their sum as the tensor cores give it, float32."""
    top = np.abs(addends).max(axis=-1, keepdims=True)
    ulp = np.ldexp(1.0, np.frexp(np.where(top > 0, top, 1.0))[1] - 24)
    total = (np.trunc(addends / ulp) * ulp).sum(axis=-1)
    out = total.astype(np.float32)
    over = np.abs(out.astype(np.float64)) > np.abs(total)
    out[over] = np.nextafter(out[over], np.float32(0))
    return out
