"""How does mma.sync (m16n8k16, float16 in, float32 accumulators) round its sum? On the GPU
(or, for the simulator's emulation, with NUMBA_ENABLE_CUDASIM=1):

    python3 scripts/dev/mma_rounding_probe.py

Every A and B element of one warp's mma is the same float16 value a, b, so every element of
D = A B + C is c + 16 a b, whose products and sum are exact in float64. Each case puts that
sum between two float32 values and prints which one the instruction returned: round to nearest
(as numpy's float32 conversion) and toward zero give different answers. The last case's
products are 0.1 ulp of c each: an adder that cut each product to c's ulp before the sum would
return c itself. Long sums of mma results (dV over thousands of query rows) lose up to an ulp
of the accumulator a step where the accumulator rounds toward zero, always the same way.
"""
import os
import sys

import numpy as np
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from numba_kernels import warp  # noqa: E402

A = 0.75 * 2.0**-13  # 16 A b = 0.75 ulp(1) with b = 2^-14: both normal float16, exact products
CASES = [  # (c, a, b): the exact sum c + 16 a b
    (1.0, A, 2.0**-14),    # 1 + 0.75 ulp: nearest 1 + ulp, toward zero 1
    (-1.0, A, -2.0**-14),  # -(1 + 0.75 ulp): nearest -(1 + ulp), toward zero -1
    (1.0, A, -2.0**-16),   # 1 - 0.375 ulp(below 1): nearest 1, toward zero below 1
    (3.0, A, 2.0**-14),    # 3 + 0.375 ulp(3): both 3
    (1.0, 2.0**-12, 819 * 2.0**-24),  # 16 products of 0.1 ulp: nearest 1 + 2 ulp, toward
]                                     # zero 1 + ulp, each product cut first: 1


@cuda.jit
def probe(a_s, bs, cs, out):
    lane = cuda.threadIdx.x
    for i in range(cs.size):
        aw = warp.pack_f16(a_s[i], a_s[i])
        bw = warp.pack_f16(bs[i], bs[i])
        d0, _, _, _ = warp.mma_f16(aw, aw, aw, aw, bw, bw, cs[i], cs[i], cs[i], cs[i])
        if lane == 0:
            out[i] = d0


def toward_zero(x):
    f = np.float32(x)
    return np.nextafter(f, np.float32(0)) if abs(float(f)) > abs(x) else f


def main():
    cs, a_s, bs = (np.array(x, np.float32) for x in zip(*CASES))
    out = np.zeros(len(CASES), np.float32)
    probe[1, 32](a_s, bs, cs, out)
    print(f"{'c + 16 a b (exact)':>28s} {'returned':>14s} {'nearest':>14s} {'toward zero':>14s}")
    for c, a, b, d in zip(cs, a_s, bs, out):
        exact = float(c) + 16 * float(np.float16(a)) * float(np.float16(b))
        near, rz = np.float32(exact), toward_zero(exact)
        which = "nearest" if d == near and d != rz else "toward zero" if d == rz and d != near \
            else "both" if d == near else "neither"
        print(f"{exact:28.17g} {d:14.9g} {near:14.9g} {rz:14.9g}  {which}")


if __name__ == "__main__":
    main()
