"""flash_attention_backward: the contract's gradients from the backward kernels (flash_mma_bwd.py
on tensor cores, for 16-bit inputs; flash_bwd.py, tuned SIMT; plain_bwd.py, one thread per key
or row), with flash_attention's arguments, checks and array handling."""
import numpy as np

from reference.contract import _shape4
from reference.dtypes import dtype_name
from .api import _band, _begin, _side_inputs
from .flash_fwd import kernel_args
from .launch import launch
from .plain_bwd import (DELTA_ARGS, DELTA_THREADS, DKDV_ARGS, DQ_ARGS, plain_bwd_kernel)
from .plain_fwd import plain_tiles
from .flash_bwd import BwdSpec, bwd_width
from .flash_mma import SCAN_THREADS, ScanSpec, mma_plan, mma_width, scan_kernel
from .flash_mma import BLOCK_N as SCAN_ROWS
from .flash_mma_bwd import BLOCK as MMA_BLOCK, MmaBwdSpec, mma_bwd_kernel
from .specs import pad, tuned_bwd_kernel


def flash_attention_backward(q, k, v, out, lse, dout, *, scale=None, causal=False, mask=None,
                             bias=None, kv_lengths=None, window=None, dlse=None,
                             kernel="auto"):
    """(dq, dk, dv): the gradients of the output for incoming gradient dout, per
    docs/contract.md ("Gradients"), in q's dtype and array type.

    q, k, v and the options as for flash_attention, with the same values; out and lse are
    what flash_attention(..., return_lse=True) returned for them; dout (B, Hq, Nq, Dv) in q's
    dtype. dk and dv of a key head are summed over its group's query heads. Deterministic:
    two calls give bitwise equal gradients (no atomic adds). Arithmetic is float32.
    dlse: the gradient of lse too, (B, Hq, Nq) float32, where the loss used it: since
    d lse_i / d s_ij = P_ij, it enters as delta - dlse (dS = P * (dP - delta + dlse)).
    kernel: "auto" (the default: "mma" where it applies, else "tuned"), "mma"
    (flash_mma_bwd.py: tensor cores, float16 and bfloat16, head dims multiples of 8 up to
    128; ValueError where it does not apply), "tuned" (flash_bwd.py, register micro-tiles
    over shared-memory tiles) or "plain" (plain_bwd.py, one thread per key or row: the one
    to read first). The tensor-core kernels add every pair of a tile in one product, so a
    call whose q, k, v or dout holds a NaN or an inf runs "tuned" instead, which adds only
    the pairs that take part: that takes a check of the inputs (one pass over them, and a
    wait for its answer).
    """
    if kernel not in KERNELS and kernel != "auto":
        raise ValueError(f"kernel must be one of {sorted(KERNELS) + ['auto']}, got {kernel!r}")
    pb, io, _, _ = _begin(q, k, v, scale, causal, mask, bias, kv_lengths, window)
    _check_saved(pb, out, lse, dout)
    why_not = mma_plan(pb)
    if why_not and kernel == "mma":
        raise ValueError(f"kernel='mma': {why_not}")
    q, k, v, dout = (io.dev(x) for x in (q, k, v, dout))  # on the device, once
    if kernel in ("auto", "mma"):
        kernel = "mma" if why_not is None and _finite(io, pb, q, k, v, dout) else "tuned"
    dq = io.empty((pb.batch, pb.heads_q, pb.n_q, pb.d), pb.dtype)
    dk = io.empty((pb.batch, pb.heads_k, pb.n_k, pb.d), pb.dtype)
    dv = io.empty((pb.batch, pb.heads_k, pb.n_k, pb.dv), pb.dtype)
    if pb.batch * pb.heads_k * pb.n_k == 0 and pb.batch * pb.heads_q * pb.n_q == 0:
        return io.result(dq), io.result(dk), io.result(dv)
    width = pad(max(pb.d, pb.dv))
    has_mask = mask is not None or bias is not None
    mask_dev, bias_dev, lengths, steps = _side_inputs(io, pb, mask, bias, kv_lengths)
    named = dict(q=q, k=k, v=v, mask=mask_dev, bias=bias_dev,
                 kv_lengths=lengths, dout=dout, lse_in=io.dev(lse),
                 delta=io.empty((pb.batch, pb.heads_q, pb.n_q), "float32"), n_q=pb.n_q,
                 group=pb.group, scale=np.float32(pb.scale), **_band(pb), **steps)
    named["delta"] = io.dev(named["delta"])
    bh_q = pb.batch * pb.heads_q
    if bh_q * pb.n_q:
        launch(plain_bwd_kernel("delta", width, width, pb.dtype, False), ("delta", pb.dtype),
               (-(-pb.n_q // DELTA_THREADS), bh_q), DELTA_THREADS, io.stream,
               *_ordered(DELTA_ARGS, dict(named, out=io.dev(out))))
        if dlse is not None:
            named["delta"] = _minus(io, named["delta"], dlse)
    KERNELS[kernel](pb, io, named, dict(dq=io.dev(dq), dk=io.dev(dk), dv=io.dev(dv)),
                    width, has_mask)
    return io.result(dq), io.result(dk), io.result(dv)


def _plain(pb, io, named, grads, width, has_mask):
    """The plain dK/dV and dQ kernels (plain_bwd.py): one thread per key, one per row."""
    rows, _ = plain_tiles(width)  # rows (dq) or keys (dk, dv) a block, one thread each
    key = (width, pb.dtype, has_mask)
    if pb.batch * pb.heads_k * pb.n_k:
        launch(plain_bwd_kernel("dkdv", width, width, pb.dtype, has_mask), ("dkdv",) + key,
               (-(-pb.n_k // rows), pb.batch * pb.heads_k), rows, io.stream,
               *_ordered(DKDV_ARGS, dict(named, dk=grads["dk"], dv=grads["dv"])))
    if pb.batch * pb.heads_q * pb.n_q:
        launch(plain_bwd_kernel("dq", width, width, pb.dtype, has_mask), ("dq",) + key,
               (-(-pb.n_q // rows), pb.batch * pb.heads_q), rows, io.stream,
               *_ordered(DQ_ARGS, dict(named, dq=grads["dq"])))


def _tuned(pb, io, named, grads, width, has_mask):
    """The tuned dK/dV and dQ kernels (flash_bwd.py): register micro-tiles."""
    for part, n, heads, args, out in (("dkdv", pb.n_k, pb.heads_k, DKDV_ARGS, ("dk", "dv")),
                                      ("dq", pb.n_q, pb.heads_q, DQ_ARGS, ("dq",))):
        w = bwd_width(pb.d, pb.dv)
        spec = BwdSpec(part, w, w, pb.dtype, has_mask)
        block_m, block_n, threads_m, threads_n = spec.tiles
        rows = block_n if part == "dkdv" else block_m
        if pb.batch * heads * n:
            launch(tuned_bwd_kernel(spec), spec, (-(-n // rows), pb.batch * heads),
                   threads_m * threads_n, io.stream,
                   *_ordered(args, dict(named, **{g: grads[g] for g in out})))


def _mma(pb, io, named, grads, width, has_mask):
    """The tensor-core dK/dV and dQ kernels (flash_mma_bwd.py)."""
    for part, n, heads, args, out in (("dkdv", pb.n_k, pb.heads_k, DKDV_ARGS, ("dk", "dv")),
                                      ("dq", pb.n_q, pb.heads_q, DQ_ARGS, ("dq",))):
        spec = MmaBwdSpec(part, mma_width(pb.d), mma_width(pb.dv), pb.dtype, has_mask)
        if pb.batch * heads * n:
            launch(mma_bwd_kernel(spec), spec, (-(-n // MMA_BLOCK), pb.batch * heads),
                   4 * 32, io.stream, *_ordered(args, dict(named, **{g: grads[g] for g in out})))


KERNELS = {"plain": _plain, "tuned": _tuned, "mma": _mma}


def _finite(io, pb, *inputs):
    """Whether no input (16-bit, C-contiguous on the device, an even last dim) holds a NaN or
    an inf: flash_mma's pre-pass over each, its tile flags reduced on the device and the
    answer fetched (the one wait for the device this check costs)."""
    scan, flags = ScanSpec(pb.dtype), []
    for x in inputs:
        batch, heads, rows, width = x.shape
        if batch * heads * rows == 0:
            continue
        tiles = -(-rows // SCAN_ROWS)
        flags.append(io.scratch((batch, heads, tiles)))
        launch(scan_kernel(scan), scan, (tiles, batch * heads), SCAN_THREADS, io.stream,
               io.words(x), flags[-1], rows, width // 2)
    if hasattr(io, "torch"):
        return not any(bool(f.any()) for f in flags) if len(flags) < 2 else \
            not bool(io.torch.stack([f.any() for f in flags]).any())
    return not any(f.copy_to_host().any() for f in flags)


def _minus(io, delta, dlse):
    """delta - dlse where delta is: a torch tensor on its stream (in order with the kernels),
    else a Numba device array (through the host: the NumPy and CuPy paths)."""
    if hasattr(delta, "sub_"):
        return delta.sub_(io.torch.as_tensor(dlse, device=delta.device, dtype=delta.dtype))
    from numba import cuda

    host = np.asarray(dlse.get() if hasattr(dlse, "get") else dlse, np.float32)
    return cuda.to_device(np.ascontiguousarray(delta.copy_to_host() - host))


def _ordered(args, named):
    """The launch arguments of a kernel with descriptions `args`, from the named values."""
    names = tuple(a[0] for a in args)
    return kernel_args(names, **{n: named[n] for n in names})


def _check_saved(pb, out, lse, dout):
    """out, lse and dout as flash_attention returned and takes them, or a clear error."""
    want = {"out": (pb.batch, pb.heads_q, pb.n_q, pb.dv),
            "dout": (pb.batch, pb.heads_q, pb.n_q, pb.dv)}
    for name, x in (("out", out), ("dout", dout)):
        got = _shape4(name, x, "(B, Hq, Nq, Dv)")
        if got != want[name]:
            raise ValueError(f"{name} must have shape (B, Hq, Nq, Dv)={want[name]}, got {got}")
        if dtype_name(x) != pb.dtype:
            raise TypeError(f"{name} must have q's dtype {pb.dtype}, got {dtype_name(x)}")
    shape = tuple(getattr(lse, "shape", ()))
    if shape != want["out"][:3] or dtype_name(lse) != "float32":
        raise ValueError(f"lse must be the forward's float32 (B, Hq, Nq)={want['out'][:3]}, "
                         f"got shape {shape} dtype {dtype_name(lse) if shape else None}")
