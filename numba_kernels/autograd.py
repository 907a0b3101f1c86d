"""flash_attention as one differentiable PyTorch operator.

flash_attention routes torch tensors here when gradients are wanted (an input requires grad
and grad mode is on), under torch.compile, and for CPU tensors. Two custom operators,
registered with torch.library so that torch.compile keeps each as one opaque node (it
traces their shapes through the fake implementations, never into Numba):

    flash_conformance::attention           (q, k, v, options) -> (out, lse)
    flash_conformance::attention_backward  (q, k, v, out, lse, dout, dlse, options)
                                           -> (dq, dk, dv)

The forward saves q, k, v, out and lse; the backward runs the backward kernels
(backward.py). A gradient flowing into lse (return_lse=True, lse used in the loss) is
folded into delta: dS = P * (dP - (delta - dlse)), since d lse_i / d s_ij = P_ij. mask,
kv_lengths and block_mask get no gradient; a bias that requires one is refused (the kernels
compute none).
CPU tensors are copied to the device and back, as NumPy arrays are (so the CUDA simulator
runs this too).
"""
from typing import Optional

import torch

from reference.contract import BLOCK_SIZE, block_pair
from .arrays import on_device
from .backward import flash_attention_backward
from .forward import forward
from .plan import BACKWARD_KERNEL, kernel_plan

Tensor = torch.Tensor


def attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
              window=None, return_lse=False, num_splits=None, kernel="auto", precision=None,
              block_mask=None, block_size=BLOCK_SIZE):
    """flash_attention's forward through the operator (same arguments and results). The
    precision and the kernel are chosen here, once (plan.kernel_plan, PyTorch's precision
    setting when None), and the backward follows them: a "simt" forward's gradients come
    from the "tuned" kernels, an "mma" forward's from the tensor cores, a "wgmma" forward's
    from the warpgroup tensor cores (plan.BACKWARD_KERNEL), whose scores are
    the forward's bit for bit (at large scores, other scores than the ones the forward's lse
    was made from give P far from exp(S - lse): docs/findings.md, bug 10)."""
    plan = kernel_plan(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                       kv_lengths=kv_lengths, window=window, num_splits=num_splits,
                       kernel=kernel, precision=precision, block_mask=block_mask,
                       block_size=block_size)  # the contract's errors first
    kernel, precision = plan.kernel, plan.precision
    if isinstance(bias, Tensor) and bias.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError("bias requires grad, but the kernels compute no gradient "
                                  "for bias (reference.attention_backward(return_dbias=True) "
                                  "does): detach it, or use another implementation")
    mask, bias, kv_lengths, block_mask = (
        None if x is None else torch.as_tensor(x, device=q.device)
        for x in (mask, bias, kv_lengths, block_mask))
    out, lse = torch.ops.flash_conformance.attention(
        q, k, v, mask, bias, kv_lengths, None if scale is None else float(scale),
        causal or "", None if window is None else [int(w) for w in window], num_splits,
        kernel, precision, block_mask,
        list(block_pair(block_size) if block_mask is not None else (BLOCK_SIZE, BLOCK_SIZE)))
    return (out, lse) if return_lse else out


def _options(mask, bias, kv_lengths, scale, causal, window, num_splits=None, kernel=None,
             precision=None, block_mask=None, block_size=(BLOCK_SIZE, BLOCK_SIZE)):
    """The operator's arguments as flash_attention's keywords."""
    return dict(mask=mask, bias=bias, kv_lengths=kv_lengths, scale=scale,
                block_mask=block_mask, block_size=tuple(block_size),
                causal=causal or False, window=None if window is None else tuple(window),
                **({} if num_splits is None else {"num_splits": num_splits}),
                **({} if kernel is None else {"kernel": kernel}),
                **({} if precision is None else {"precision": precision}))


@torch.library.custom_op("flash_conformance::attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
               kv_lengths: Optional[Tensor], scale: Optional[float], causal: str,
               window: Optional[list[int]], num_splits: Optional[int],
               kernel: str, precision: str, block_mask: Optional[Tensor],
               block_size: list[int]) -> tuple[Tensor, Tensor]:
    opts = _options(mask, bias, kv_lengths, scale, causal, window, num_splits, kernel,
                    precision, block_mask, block_size)
    return on_device(forward, (q, k, v), opts, return_lse=True)


@_attention.register_fake
def _(q, k, v, mask, bias, kv_lengths, scale, causal, window, num_splits, kernel, precision,
      block_mask, block_size):
    b, hq, nq = q.shape[:3]
    return q.new_empty((b, hq, nq, v.shape[3])), q.new_empty((b, hq, nq), dtype=torch.float32)


@torch.library.custom_op("flash_conformance::attention_backward", mutates_args=())
def _attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        dout: Tensor, dlse: Optional[Tensor], mask: Optional[Tensor],
                        bias: Optional[Tensor], kv_lengths: Optional[Tensor],
                        scale: Optional[float], causal: str,
                        window: Optional[list[int]], kernel: str, precision: str,
                        block_mask: Optional[Tensor],
                        block_size: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    opts = _options(mask, bias, kv_lengths, scale, causal, window, kernel=kernel,
                    precision=precision, block_mask=block_mask, block_size=block_size)
    return on_device(flash_attention_backward, (q, k, v, out, lse, dout.contiguous()),
                      dict(opts, dlse=dlse))


@_attention_backward.register_fake
def _(q, k, v, out, lse, dout, dlse, mask, bias, kv_lengths, scale, causal, window, kernel,
      precision, block_mask, block_size):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    (q, k, v, mask, bias, kv_lengths, scale, causal, window, _, kernel, precision, block_mask,
     block_size) = inputs
    out, lse = output
    # An output the loss does not use gets None, not zeros: a dlse of zeros would cost a
    # subtraction, and a backward with dlse is never replayed (replay.py).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, out, lse, mask, bias, kv_lengths, block_mask)
    ctx.options = (scale, causal, window, BACKWARD_KERNEL[kernel], precision)
    ctx.block_size = block_size


def _backward(ctx, dout, dlse):
    """The gradients of q, k, v for the incoming dout and dlse (None where the loss does not
    use out or lse: dout then zeros, dlse left out)."""
    q, k, v, out, lse, mask, bias, kv_lengths, block_mask = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _attention_backward(q, k, v, out, lse, dout, dlse, mask, bias, kv_lengths,
                                     *ctx.options, block_mask, ctx.block_size)
    return (dq, dk, dv) + (None,) * 11


_attention.register_autograd(_backward, setup_context=_setup_context)


def wanted(q, k, v, bias=None):
    """Whether a torch call goes through the operator: gradients wanted (of q, k, v, or of a
    bias, which is then refused), torch.compile tracing, or CPU tensors."""
    grads = [x.requires_grad for x in (q, k, v, bias) if isinstance(x, Tensor)]
    return (q.device.type == "cpu" or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and any(grads)))
