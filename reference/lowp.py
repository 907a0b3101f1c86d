"""The plain same-precision implementation that error bounds are measured against.

A kernel's error is judged against the error that ordinary low-precision arithmetic makes on
the same inputs (see verify's criterion). This emulates the plainest GPU implementation: the
inputs as given (already float16 / bfloat16 / float32), scores, softmax and P @ V accumulated
in float32, P optionally rounded to the input dtype before P @ V (as kernels do to feed matrix
units), and the output rounded to the input dtype. Rounding is round-to-nearest-even, as the
hardware does; bfloat16 is derived from the float32 bit pattern, so no extra package is needed
and it runs on CuPy too.
"""
from ._xp import array_namespace, quiet
from .contract import check_attention_args, check_flag
from .dtypes import KERNEL_DTYPES
from .naive import check_rows, forward


def round_to(x, dtype):
    """x (float32) rounded to float16 / bfloat16 / float32 by round-to-nearest-even, as float32."""
    xp = array_namespace(x)
    x = xp.asarray(x, dtype="float32")
    if dtype == "float32":
        return x
    if dtype == "float16":
        with quiet(xp):  # beyond 65504 rounds to inf, as the hardware does
            return x.astype("float16").astype("float32")
    if dtype == "bfloat16":
        bits = x.view("uint32")
        # Add half an ulp of bfloat16, plus one if the kept part is odd (ties to even); NaN kept.
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        rounded = xp.where(xp.isnan(x), bits | 0x00400000, rounded).astype("uint32")
        return rounded.view("float32")
    raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype!r}")


def attention_lowp(q, k, v, *, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
                   window=None, return_lse=False, round_p=True, dtype=None, rows=None):
    """Attention as a plain float32-accumulating kernel computes it for inputs of q's dtype.

    Same arguments as reference.attention. Returns out (float32 holding values of the
    emulated dtype), and lse (float32) when return_lse. round_p rounds P to that dtype before
    P @ V. dtype: the precision to emulate, by default q's; name it when q holds, say,
    bfloat16 values in float32 arrays (CuPy has no bfloat16). rows: only these query rows
    (see reference.attention).
    """
    pb = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                              kv_lengths=kv_lengths, window=window,
                              dtypes=KERNEL_DTYPES)
    dtype = dtype or pb.dtype
    if dtype != pb.dtype:  # inputs given wider: round them as the kernel's inputs were
        q, k, v = (round_to(x, dtype) for x in (q, k, v))
    out, lse = forward(pb, q, k, v, mask, bias, kv_lengths, compute="float32",
                       p_dtype=dtype, round_fn=round_to if round_p else None,
                       rows=check_rows(rows, pb.n_q))
    out = round_to(out, dtype)
    return (out, lse) if check_flag("return_lse", return_lse) else out


def attention_backward_lowp(q, k, v, dout, *, scale=None, causal=False, mask=None, bias=None,
                            kv_lengths=None, window=None, round_p=True, dtype=None):
    """The gradients as a plain float32-accumulating kernel computes them for inputs of q's
    dtype: q, k, v and dout rounded to that dtype, P and dS rounded to it before the products
    that take them (round_p), dq, dk, dv rounded to it at the end. Same arguments as
    reference.attention_backward (no dbias); dtype as in attention_lowp. Returns (dq, dk,
    dv), float32 arrays holding values of the emulated dtype."""
    from .backward import backward, check_dout

    pb = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                              kv_lengths=kv_lengths, window=window, dtypes=KERNEL_DTYPES)
    check_dout(pb, dout)
    dtype = dtype or pb.dtype
    if dtype != pb.dtype:
        q, k, v = (round_to(x, dtype) for x in (q, k, v))
    dout = round_to(dout, dtype)
    grads = backward(pb, q, k, v, dout, mask, bias, kv_lengths, compute="float32",
                     round_fn=round_to if round_p else None, p_dtype=dtype)
    return tuple(round_to(g, dtype) for g in grads[:3])
