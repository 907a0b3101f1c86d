"""Would a float32 backward on TF32 tensor cores pass verify? On the CPU, the FlashAttention-2
backward in float32 (P from the saved lse, delta = rowsum(dO O)) with each of its five
products (S, dP, dV, dK, dQ) done three ways, judged by verify's rule (criterion.judge_backward,
dtype float32):

    float32   numpy's float32 products (the control: must pass);
    3xTF32    each operand split x = hi + lo, both rounded to TF32 (10 mantissa bits, nearest,
              ties away, as cvt.rna.tf32.f32); hi hi + hi lo + lo hi, k-steps of 8 as
              mma.sync m16n8k8 takes them, each step's three products exact, added to the
              float32 accumulator in one rounding (kinder than the hardware, which rounds
              each product's sum);
    1xTF32    hi hi alone.

    python scripts/dev/tf32_backward_emulation.py [--seeds 3]

Prints, per shape and seed, each way's worst error over its bound (passes <= 1) for dq, dk
and dv.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import reference  # noqa: E402
from verify.criterion import judge_backward  # noqa: E402


def tf32(x):
    """float32 x rounded to TF32 (nearest, ties away from zero), as float32."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def product(a, b, terms):
    """a @ b (float32, (..., m, k) @ (..., k, n)) by TF32 mma.sync k-steps of 8 with `terms`
    of the split (1 or 3), or numpy's float32 product for terms = 0."""
    if terms == 0:
        return np.matmul(a, b)
    a_hi, b_hi = tf32(a), tf32(b)
    a_lo, b_lo = tf32(a - a_hi), tf32(b - b_hi)
    acc = np.zeros(a.shape[:-1] + b.shape[-1:], np.float32)
    for k0 in range(0, a.shape[-1], 8):
        ks = slice(k0, k0 + 8)
        step = np.matmul(a_hi[..., ks].astype(np.float64), b_hi[..., ks, :].astype(np.float64))
        if terms == 3:
            step += np.matmul(a_hi[..., ks].astype(np.float64),
                              b_lo[..., ks, :].astype(np.float64))
            step += np.matmul(a_lo[..., ks].astype(np.float64),
                              b_hi[..., ks, :].astype(np.float64))
        acc = (acc.astype(np.float64) + step).astype(np.float32)
    return acc


def backward(q, k, v, dout, terms):
    """(dq, dk, dv) of full attention, float32, the five products by `product`."""
    scale = np.float32(1 / np.sqrt(q.shape[-1]))
    out, lse = reference.attention(q, k, v, return_lse=True)  # the forward's saved values
    out, lse = out.astype(np.float32), lse.astype(np.float32)[..., None]
    s = product(q, np.swapaxes(k, -1, -2), terms) * scale
    p = np.exp(s - lse)
    dp = product(dout, np.swapaxes(v, -1, -2), terms)
    delta = (dout * out).sum(axis=-1, keepdims=True, dtype=np.float32)
    ds = p * (dp - delta)
    dv = product(np.swapaxes(p, -1, -2), dout, terms)
    dk = product(np.swapaxes(ds, -1, -2), q, terms) * scale
    dq = product(ds, k, terms) * scale
    return dq, dk, dv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    ways = {"float32": 0, "3xTF32": 3, "1xTF32": 1}
    print(f"{'shape (B, H, N, D)':22s} seed  " + "  ".join(f"{w:>22s}" for w in ways)
          + "    (error / bound for dq dk dv; passes <= 1)")
    for shape in ((1, 2, 256, 64), (1, 2, 512, 128), (1, 1, 1024, 128)):
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            q, k, v, dout = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
            cells = []
            for terms in ways.values():
                grads = backward(q, k, v, dout, terms)
                ratios = [c.ratio for c in
                          judge_backward(q, k, v, dout, grads, dtype="float32")]
                cells.append(" ".join(f"{r:6.2f}" for r in ratios))
            print(f"{str(shape):22s} {seed:4d}  " + "  ".join(f"{c:>22s}" for c in cells),
                  flush=True)


if __name__ == "__main__":
    main()
