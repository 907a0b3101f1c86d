"""Would a float32 backward on float16 tensor cores, each operand as two halves
(numba_kernels/halves.py), pass verify? On the CPU: the FlashAttention-2 backward in float32
(P from the saved lse, delta = rowsum(dO O)) with its five products (S, dP, dV, dK, dQ) made
from halves as halves.py makes them, judged by verify's rule (criterion.judge_backward, dtype
float32):

    q, k, v, dout   one power-of-two scale a tensor (max |x c| < 2^14), hi = float16(x c),
                    lo = float16(x c - hi)
    P               P 2^14, split the same way (pack_halves)
    dS              P (dP' - delta') 2^-(15 + log2 D), dP' and delta' in the scaled units
    products        hi hi + hi lo + lo hi, each exact (float64), added to a float32 sum every
                    256 terms (kinder than the hardware's float32 sum every 16)

    python scripts/dev/halves_emulation.py [--n 256,1024,4096] [--values normal,tiny,scaled,large]
    python scripts/dev/halves_emulation.py --consistency
    python scripts/dev/halves_emulation.py --toward-zero

Prints, per N and kind of values, the worst error over its bound (passes <= 1) for dq, dk, dv.
--consistency: the forward in float32 as a kernel makes it (its own scores, lse and out), and
the backward's scores three ways: from halves, from three float16 pieces (33 bits: hi hi + hi
mid + mid hi + hi lo + lo hi + mid mid), and the forward's own; the worst ratio over 20 seeds
for shapes where scores are large.
--toward-zero: sums nearer mma.sync's than one rounding to nearest (the H200 cuts each
product to the accumulator's ulp, scripts/dev/mma_rounding_probe.py; this model rounds each
step's sum toward zero instead): each 16-term step of each product added to the float32
accumulator rounding toward zero; beside
it dV with each step's three products summed from 0 and added rounding to nearest (the
kernels' halves.mma_halves_summed). dq dk dv, worst of 3 seeds, at long sums.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import reference  # noqa: E402
from verify.criterion import judge_backward  # noqa: E402

TOP = 14


def power_scale(x):
    """halves.py's c: 2^(13 - floor(log2 max|x|))."""
    top = float(np.abs(x).max())
    return np.float32(2.0 ** (TOP - 1 - np.floor(np.log2(top)))) if top > 0 else np.float32(1)


def split(x):
    """(hi, lo) of float32 x as float32 arrays holding float16 values."""
    hi = x.astype(np.float16).astype(np.float32)
    return hi, (x - hi).astype(np.float16).astype(np.float32)


def product(a, b, ca, cb):
    ah, al = split((a * ca).astype(np.float32))
    bh, bl = split((b * cb).astype(np.float32))
    acc = np.zeros(a.shape[:-1] + b.shape[-1:], np.float32)
    for k0 in range(0, a.shape[-1], 256):
        ks = slice(k0, k0 + 256)
        a_h, a_l = ah[..., ks].astype(np.float64), al[..., ks].astype(np.float64)
        step = a_h @ bh[..., ks, :] + a_h @ bl[..., ks, :] + a_l @ bh[..., ks, :]
        acc = (acc.astype(np.float64) + step).astype(np.float32)
    return acc / ca / cb


def toward_zero(x):
    """float64 x rounded to float32 toward zero."""
    f = x.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(x)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f


def product_toward_zero(a, b, ca, cb, summed=False):
    """product's sum as mma.sync makes it: 16 terms a step, the three products in the
    kernels' order (lo hi, hi lo, hi hi), each added to the accumulator rounding toward
    zero; summed: each step's three from 0, then added to the accumulator to nearest."""
    ah, al = split((a * ca).astype(np.float32))
    bh, bl = split((b * cb).astype(np.float32))
    acc = np.zeros(a.shape[:-1] + b.shape[-1:], np.float32)
    for k0 in range(0, a.shape[-1], 16):
        ks = slice(k0, k0 + 16)
        x = {"h": ah[..., ks].astype(np.float64), "l": al[..., ks].astype(np.float64)}
        y = {"h": bh[..., ks, :].astype(np.float64), "l": bl[..., ks, :].astype(np.float64)}
        step = np.zeros_like(acc) if summed else acc
        for i, j in ("lh", "hl", "hh"):
            step = toward_zero(step.astype(np.float64) + x[i] @ y[j])
        acc = acc + step if summed else step
    return acc / ca / cb


def backward(q, k, v, dout, product=product, dv_product=None):
    d = q.shape[-1]
    scale = np.float32(1 / np.sqrt(d))
    out, lse = reference.attention(q, k, v, return_lse=True)  # the forward's saved values
    out, lse = out.astype(np.float32), lse.astype(np.float32)[..., None]
    cq, ck, cv, cdo = (power_scale(x) for x in (q, k, v, dout))
    s = product(q, np.swapaxes(k, -1, -2), cq, ck) * scale
    p = np.exp(s - lse)
    dp = product(dout, np.swapaxes(v, -1, -2), cdo, cv)
    delta = (dout * out).sum(axis=-1, keepdims=True, dtype=np.float32)
    ds = p * (dp - delta)
    c_ds = np.float32(2.0 ** -(15 + int(np.log2(d)))) * cv * cdo  # dS' = dS c_v c_do 2^-(..)
    dv = (dv_product or product)(np.swapaxes(p, -1, -2), dout, np.float32(2.0**TOP), cdo)
    dk = product(np.swapaxes(ds, -1, -2), q, c_ds, cq) * scale
    dq = product(ds, k, c_ds, ck) * scale
    return dq, dk, dv


def split3(x):
    """(hi, mid, lo) of float32 x: three float16 pieces, as float64 arrays."""
    hi = x.astype(np.float16).astype(np.float32)
    mid = (x - hi).astype(np.float16).astype(np.float32)
    lo = (x - hi - mid).astype(np.float16).astype(np.float32)
    return tuple(t.astype(np.float64) for t in (hi, mid, lo))


def scores3(q, k, cq, ck):
    (qh, qm, ql), (kh, km, kl) = split3((q * cq).astype(np.float32)), \
        split3((np.swapaxes(k, -1, -2) * ck).astype(np.float32))
    s = qh @ kh + qh @ km + qm @ kh + qh @ kl + ql @ kh + qm @ km
    return s.astype(np.float32) / cq / ck


def backward_after(q, k, v, dout, scores):
    """The backward after a float32 forward (its own scores, lse and out), with the scores
    "halves", "three" (pieces) or "forward" (the forward's own)."""
    d = q.shape[-1]
    scale = np.float32(1 / np.sqrt(d))
    s32 = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    m = s32.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(s32 - m).sum(-1, keepdims=True, dtype=np.float32)))
    lse = lse.astype(np.float32)
    out = (np.exp(s32 - lse) @ v).astype(np.float32)
    cq, ck, cv, cdo = (power_scale(x) for x in (q, k, v, dout))
    s = {"forward": lambda: s32, "halves": lambda: product(q, np.swapaxes(k, -1, -2), cq, ck)
         * scale, "three": lambda: scores3(q, k, cq, ck) * scale}[scores]()
    p = np.exp(s - lse)
    dp = product(dout, np.swapaxes(v, -1, -2), cdo, cv)
    ds = p * (dp - (dout * out).sum(axis=-1, keepdims=True, dtype=np.float32))
    c_ds = np.float32(2.0 ** -(15 + int(np.log2(d)))) * cv * cdo
    dv = product(np.swapaxes(p, -1, -2), dout, np.float32(2.0**TOP), cdo)
    return (product(ds, k, c_ds, ck) * scale,
            product(np.swapaxes(ds, -1, -2), q, c_ds, cq) * scale, dv)


def forward_halves(q, k, v, pieces="halves"):
    """A float32 forward whose scores come from halves (or three pieces): (scores, out, lse),
    the scores being what a backward on the same fragments would recompute."""
    d = q.shape[-1]
    scale = np.float32(1 / np.sqrt(d))
    cq, ck = power_scale(q), power_scale(k)
    s = (product(q, np.swapaxes(k, -1, -2), cq, ck) if pieces == "halves"
         else scores3(q, k, cq, ck)) * scale
    m = s.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(-1, keepdims=True, dtype=np.float32)))
    lse = lse.astype(np.float32)
    pv = product(np.exp(s - lse).astype(np.float32), v, np.float32(2.0**TOP), power_scale(v))
    return s, pv.astype(np.float32), lse


def forward_consistency(pieces):
    """Forward and backward both on halves scores (the same ones): worst error / bound of
    out, lse and of dq, dk, dv over 20 seeds."""
    from verify.criterion import judge
    print(f"(N, D, q and k times): worst error / bound over 20 seeds, {pieces} scores in both "
          "passes: out lse | dq dk dv")
    for n, d, times in ((1, 16, 30), (2, 16, 4), (2, 16, 30), (64, 64, 30), (256, 128, 1),
                        (256, 128, 4), (256, 128, 30), (1024, 64, 4)):
        worst_f, worst_b = np.zeros(2), np.zeros(3)
        for seed in range(20):
            rng = np.random.default_rng(seed)
            q, k, v, dout = (rng.standard_normal((1, 1, n, d)) for _ in range(4))
            q, k, v, dout = (x.astype(np.float32) for x in (q * times, k * times, v, dout))
            s, out, lse = forward_halves(q, k, v, pieces)
            worst_f = np.maximum(worst_f, [c.ratio for c in judge(q, k, v, out, lse[..., 0])])
            cq, ck, cv, cdo = (power_scale(x) for x in (q, k, v, dout))
            p = np.exp(s - lse)
            dp = product(dout, np.swapaxes(v, -1, -2), cdo, cv)
            ds = p * (dp - (dout * out).sum(axis=-1, keepdims=True, dtype=np.float32))
            c_ds = np.float32(2.0 ** -(15 + int(np.log2(d)))) * cv * cdo
            scale = np.float32(1 / np.sqrt(d))
            grads = (product(ds, k, c_ds, ck) * scale,
                     product(np.swapaxes(ds, -1, -2), q, c_ds, cq) * scale,
                     product(np.swapaxes(p, -1, -2), dout, np.float32(2.0**TOP), cdo))
            worst_b = np.maximum(worst_b, [c.ratio for c in judge_backward(
                q, k, v, dout, grads, dtype="float32")])
        print(f"({n}, {d}, x{times}) " + " ".join(f"{r:.3f}" for r in worst_f) + " | "
              + " ".join(f"{r:.3f}" for r in worst_b), flush=True)


def consistency():
    print("(N, D, q and k times): worst error / bound over 20 seeds, scores from halves, "
          "three pieces, the forward's own")
    for n, d, times in ((1, 16, 30), (2, 16, 4), (64, 64, 30), (256, 128, 1), (256, 128, 4)):
        worst = dict(halves=0.0, three=0.0, forward=0.0)
        for seed in range(20):
            rng = np.random.default_rng(seed)
            q, k, v, dout = (rng.standard_normal((1, 1, n, d)) for _ in range(4))
            q, k, v, dout = (x.astype(np.float32) for x in (q * times, k * times, v, dout))
            for way in worst:
                grads = backward_after(q, k, v, dout, way)
                worst[way] = max([worst[way]] + [c.ratio for c in judge_backward(
                    q, k, v, dout, grads, dtype="float32")])
        print(f"({n}, {d}, x{times}) " + " ".join(f"{r:.3f}" for r in worst.values()),
              flush=True)


def toward_zero_sums():
    print("(Nq, Nk): worst error / bound over 3 seeds, D = 16, dq dk dv: sums rounded to "
          "nearest every 256 terms | toward zero every step | toward zero, dV summed a step")
    ways = ((product, None), (product_toward_zero, None),
            (product_toward_zero, lambda *a: product_toward_zero(*a, summed=True)))
    for nq, nk in ((4096, 64), (4096, 1), (2048, 2048), (64, 4096)):
        worst = np.zeros((len(ways), 3))
        for seed in range(3):
            rng = np.random.default_rng(seed)
            q, dout = (rng.standard_normal((1, 1, nq, 16)).astype(np.float32) for _ in "qo")
            k, v = (rng.standard_normal((1, 1, nk, 16)).astype(np.float32) for _ in "kv")
            for i, (prod, dv_prod) in enumerate(ways):
                grads = backward(q, k, v, dout, prod, dv_prod)
                worst[i] = np.maximum(worst[i], [c.ratio for c in judge_backward(
                    q, k, v, dout, grads, dtype="float32")])
        print(f"({nq}, {nk}) " + " | ".join(" ".join(f"{r:.3f}" for r in w) for w in worst),
              flush=True)


def main():
    if "--toward-zero" in sys.argv:
        return toward_zero_sums()
    if "--consistency" in sys.argv:
        return consistency()
    if "--forward" in sys.argv:
        return forward_consistency("three" if "--three" in sys.argv else "halves")
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="256,1024,4096")
    ap.add_argument("--values", default="normal,tiny,scaled,large")
    a = ap.parse_args()
    print("N     values   error / bound: dq dk dv (passes <= 1)")
    for n in (int(x) for x in a.n.split(",")):
        for values in a.values.split(","):
            rng = np.random.default_rng(0)
            q, k, v, dout = (rng.standard_normal((1, 1, n, 128)) for _ in range(4))
            if values == "tiny":
                q, k, v = q * 1e-3, k * 1e-3, v * 1e-3
            elif values == "scaled":
                q, k = q * 4, k * 4
            elif values == "large":
                q, k = q * 30, k * 30
            q, k, v, dout = (x.astype(np.float32) for x in (q, k, v, dout))
            ratios = [c.ratio for c in judge_backward(q, k, v, dout, backward(q, k, v, dout),
                                                      dtype="float32")]
            print(f"{n:5d} {values:8s} " + " ".join(f"{r:.4f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
