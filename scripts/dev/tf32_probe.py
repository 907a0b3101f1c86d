"""What float32 on tensor cores could reach: mma.sync m16n8k8 with TF32 operands, beside
m16n8k16 float16, on this GPU, and the accuracy of the 3xTF32 split (issue 16's float32
backward against math's).

    python scripts/dev/tf32_probe.py     # on the GPU machine, numpy < 2.5 (shared GPU.md)

Prints, for each instruction, the rate of register-only chains of mma.sync over the whole GPU
(4 independent accumulators a warp, 8 warps a block, 8 blocks an SM), then one 16 x 8 x 128
product of float32 values three ways against float64: one TF32 product, the 3xTF32 split (a =
a_hi + a_lo, each rounded to TF32 by cvt.rna; a_hi b_hi + a_hi b_lo + a_lo b_hi, three
mma.sync a k-step), and NumPy's float32 product. Last, torch's math backward in float32 at
(2, 16, N, 128) and what a deterministic 3xTF32 FlashAttention-2 backward (14 N^2 D FLOPs a
head, three products each) would take at the measured TF32 rate.

TF32 fragments of m16n8k8 (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32), lane = 4g + t:
    A (16x8, row): a0 = A[g, t]  a1 = A[g+8, t]  a2 = A[g, t+4]  a3 = A[g+8, t+4]
    B (8x8, col):  b0 = B[t, g]  b1 = B[t+4, g]
    C, D (16x8):   c0, c1 = C[g, 2t:2t+2]   c2, c3 = C[g+8, 2t:2t+2]
"""
import os
import sys
import time

import numpy as np
from llvmlite import ir
from numba import cuda
from numba.cuda.extending import intrinsic
from numba.cuda.types import UniTuple, float32, uint32

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from numba_kernels.warp import mma_f16  # noqa: E402  (m16n8k16, float16 operands)


def _asm(text, constraints, n_out, in_types, out_type):
    def codegen(context, builder, signature, args):
        ir_types = {float32: ir.FloatType(), uint32: ir.IntType(32)}
        outs = [ir_types[out_type]] * n_out
        ret = outs[0] if n_out == 1 else ir.LiteralStructType(outs)
        fn = ir.FunctionType(ret, [ir_types[t] for t in in_types])
        value = builder.call(ir.InlineAsm(fn, text, constraints, side_effect=False), args)
        if n_out == 1:
            return value
        return context.make_tuple(builder, signature.return_type,
                                  [builder.extract_value(value, i) for i in range(n_out)])
    return codegen


@intrinsic
def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A B + C, m16n8k8, TF32 operands (32-bit registers), float32 accumulators."""
    ins = [uint32] * 6 + [float32] * 4
    return UniTuple(float32, 4)(*ins), _asm(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, "
        "{$8,$9}, {$10,$11,$12,$13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", 4, ins, float32)


@intrinsic
def to_tf32(typingctx, x):
    """x rounded to TF32 (nearest, ties away), as the 32-bit pattern mma.sync takes."""
    return uint32(float32), _asm("cvt.rna.tf32.f32 $0, $1;", "=r,f", 1, [float32], uint32)


@intrinsic
def bits_float(typingctx, x):
    return float32(uint32), _asm("mov.b32 $0, $1;", "=f,r", 1, [uint32], float32)


@cuda.jit(device=True, inline=True)
def split(x):
    """x = hi + lo, both TF32: hi = rna(x), lo = rna(x - hi)."""
    hi = to_tf32(x)
    return hi, to_tf32(x - bits_float(hi))


@cuda.jit
def product(A, B, C, mode):
    """C (16, 8) = A (16, K) B (K, 8), one warp, k-steps of 8: mode 0 one TF32 product,
    mode 1 the 3xTF32 split."""
    lane = cuda.threadIdx.x
    g, t = lane // 4, lane % 4
    c0 = c1 = c2 = c3 = float32(0.0)
    for k0 in range(0, A.shape[1], 8):
        a = (A[g, k0 + t], A[g + 8, k0 + t], A[g, k0 + t + 4], A[g + 8, k0 + t + 4])
        b = (B[k0 + t, g], B[k0 + t + 4, g])
        a0h, a0l = split(a[0])
        a1h, a1l = split(a[1])
        a2h, a2l = split(a[2])
        a3h, a3l = split(a[3])
        b0h, b0l = split(b[0])
        b1h, b1l = split(b[1])
        if mode == 1:  # the small terms first
            c0, c1, c2, c3 = mma_tf32(a0l, a1l, a2l, a3l, b0h, b1h, c0, c1, c2, c3)
            c0, c1, c2, c3 = mma_tf32(a0h, a1h, a2h, a3h, b0l, b1l, c0, c1, c2, c3)
        c0, c1, c2, c3 = mma_tf32(a0h, a1h, a2h, a3h, b0h, b1h, c0, c1, c2, c3)
    C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1] = c0, c1, c2, c3


def make_peak(mma):
    @cuda.jit
    def peak(out, n):
        lane = cuda.threadIdx.x % 32
        a, b = uint32(0x3F800000 + lane), uint32(0x3F800000)
        c = cuda.local.array((4, 4), float32)
        for i in range(4):
            for j in range(4):
                c[i, j] = float32(0.0)
        for _ in range(n):
            for i in range(4):  # four independent chains
                c[i, 0], c[i, 1], c[i, 2], c[i, 3] = mma(a, b, a, b, b, a, c[i, 0], c[i, 1],
                                                         c[i, 2], c[i, 3])
        s = float32(0.0)
        for i in range(4):
            for j in range(4):
                s += c[i, j]
        out[cuda.grid(1)] = s
    return peak


def rate(name, mma, flops_per_mma, sms):
    threads, n = sms * 8 * 256, 4000
    out = cuda.device_array(threads, np.float32)
    peak = make_peak(mma)
    peak[threads // 256, 256](out, n)
    cuda.synchronize()
    best = None
    for _ in range(5):
        t = time.perf_counter()
        peak[threads // 256, 256](out, n)
        cuda.synchronize()
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    tflops = (threads // 32) * n * 4 * flops_per_mma / best / 1e12
    print(f"{name}: {tflops:.0f} TFLOP/s (best of 5, {best * 1e3:.2f} ms)", flush=True)
    return tflops


def accuracy():
    rng = np.random.default_rng(0)
    A = rng.standard_normal((16, 128)).astype(np.float32)
    B = rng.standard_normal((128, 8)).astype(np.float32)
    exact = A.astype(np.float64) @ B.astype(np.float64)
    scale = np.abs(A).astype(np.float64) @ np.abs(B).astype(np.float64)
    for mode, name in ((0, "1xTF32"), (1, "3xTF32")):
        C = np.zeros((16, 8), np.float32)
        product[1, 32](A, B, C, mode)
        err = np.abs(C - exact) / scale
        print(f"{name}: error / (|A| |B|) max {err.max():.2e}, mean {err.mean():.2e}")
    err = np.abs((A @ B) - exact) / scale
    print(f"numpy float32: error / (|A| |B|) max {err.max():.2e}, mean {err.mean():.2e}")


def math_backward(tf32_rate):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.matmul.allow_tf32 = False
    for n in (2048, 4096, 8192):
        q, k, v = (torch.randn(2, 16, n, 128, device="cuda", requires_grad=True)
                   for _ in range(3))
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v)
        dout = torch.randn_like(out)
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        ms = float(np.median(times))
        need = 3 * 14 * 2 * 16 * n * n * 128
        print(f"(2,16,{n},128) fp32: math backward {ms:.2f} ms; a 3xTF32 FA-2 backward at "
              f"the TF32 peak {need / tf32_rate * 1e3:.2f} ms; it needs "
              f"{need / ms / 1e9:.0f} TFLOP/s of TF32 mma.sync to match math", flush=True)
        del q, k, v, out, dout
        torch.cuda.empty_cache()


def main():
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    rate("mma.sync m16n8k16 f16 -> f32", mma_f16, 2 * 16 * 8 * 16, sms)
    tf32 = rate("mma.sync m16n8k8 tf32 -> f32", mma_tf32, 2 * 16 * 8 * 8, sms)
    accuracy()
    math_backward(tf32 * 1e12)


if __name__ == "__main__":
    main()
