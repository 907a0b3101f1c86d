"""flash_attention: the contract's entry point for the Numba kernel.

Takes NumPy arrays (copied to the device and back), PyTorch CUDA tensors, CuPy arrays or Numba
device arrays (used in place through their strides, launched on the caller's current stream),
and returns the caller's array type. Outputs are fresh arrays; inputs are never written.
"""
from reference.contract import BLOCK_SIZE
from .forward import forward


def flash_attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
                    kv_lengths=None, window=None, return_lse=False, num_splits=None, spec=None,
                    kernel="auto", precision=None, block_mask=None, block_size=BLOCK_SIZE):
    """FlashAttention-2 forward on the GPU (or the CUDA simulator), per docs/contract.md;
    differentiable for torch tensors (autograd.py: gradients from the backward kernels, one
    opaque operator under torch.compile).

    q (B, Hq, Nq, D), k (B, Hk, Nk, D), v (B, Hk, Nk, Dv): float32, float16 or bfloat16, all one
    dtype, D and Dv <= 256. causal: False, "top_left" or "bottom_right"; mask: boolean,
    broadcastable to (B, Hq, Nq, Nk); bias: float, broadcastable likewise (added to the
    scaled scores; the kernel reads it as float32); kv_lengths: (B,) integers; window:
    (left, right). scale: any finite number (default 1 / sqrt(D)).
    Returns out (B, Hq, Nq, Dv) in the input dtype, and lse (B, Hq, Nq) float32 (natural log)
    when return_lse. Arithmetic is float32. D and Dv are zero-padded to one width from
    specs.HEAD_DIMS: fastest when D == Dv is one of them, and without a mask. NumPy inputs are
    copied to the device; strided torch and CuPy inputs are copied contiguous on the device
    first (so that a variant has one compiled version); other device arrays are read through
    their strides.

    num_splits: cut the keys each query tile sees (its band) into this many shares, one
    block each, merged by lse (split_kv.py; at most one share a key tile); None chooses: splits only when the query tiles alone leave the GPU's SMs
    idle (decoding). spec: a KernelSpec that forces one variant of the SIMT kernel (for
    benchmarks); by default specs.choose_spec picks it. kernel: "auto" (the default: the
    tensor-core kernel where it applies: 16-bit inputs, and float32 from 64 query rows
    without a mask or bias (plan.float32_why_not); else the SIMT one), "simt" (flash_fwd.py,
    every dtype and head dims up to 256) or "mma" (flash_mma.py: float16 and bfloat16, and
    float32 as two float16 halves a value (halves.py), whose scores
    flash_attention_backward recomputes bit for bit with the same kernel=; head dims
    multiples of 8 up to 128, float32 with a mask or bias up to 64; a ValueError says why
    where it does not apply) or "wgmma" (flash_wgmma.py: the forward on Hopper's warpgroup
    tensor cores, float16 and bfloat16, head dims as "mma"'s, a GPU of compute capability
    9.0; only by name; its gradients: flash_attention_backward(kernel="wgmma"), which
    autograd runs after it); kernel_plan tells
    which one a call gets, why, and at which precision.
    precision: how accurate float32 must be, PyTorch's names: "highest", float32's accuracy
    (the SIMT kernels, or the halves with each step's products summed apart and rounded to
    nearest in float32: docs/design/halves.md), or "high", the error of products of about
    22 bits allowed (the halves with mma.sync's own sums, faster). None (the default) takes
    torch.get_float32_matmul_precision() for torch tensors ("high" and "medium" give "high";
    its default is "highest") and "highest" for any other array. 16-bit inputs run at their
    own precision either way. The halves never trade the range: where a row of q, k or v
    lies more than 2^12 ("highest"; 2^16 "high") below its tensor's largest value, or a
    tensor's largest lies outside 2^-48 .. 2^48, the call runs the SIMT kernel
    (halves_range_why_not; kernel="mma" raises instead). The gradients through autograd
    follow the forward's choice.
    block_mask: the visible pairs as a table of blocks (FlexAttention's BlockMask in
    spirit), boolean, broadcastable to (B, Hq, ceil(Nq / block_m), ceil(Nk / block_n)),
    True where the block of block_m query rows by block_n keys is visible; block_size: an
    integer (square blocks, default 128) or (block_m, block_n). It is the boolean mask
    reference.blocks.block_mask_visible makes of it, and'ed with mask (docs/contract.md):
    the kernels skip its hidden blocks' tiles and read no mask in its kept ones, made once
    per call from the table alone where block_m and block_n are multiples of 64; other
    block sizes are written out as that boolean mask first (kernel_plan says which).
    """
    if type(q).__module__.startswith("torch") and spec is None:
        from . import autograd

        if autograd.wanted(q, k, v, bias):
            return autograd.attention(q, k, v, scale=scale, causal=causal, mask=mask,
                                      bias=bias, kv_lengths=kv_lengths, window=window,
                                      return_lse=return_lse, num_splits=num_splits,
                                      kernel=kernel, precision=precision,
                                      block_mask=block_mask, block_size=block_size)
    return forward(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                   kv_lengths=kv_lengths, window=window, return_lse=return_lse,
                   num_splits=num_splits, spec=spec, kernel=kernel, precision=precision,
                   block_mask=block_mask, block_size=block_size)
