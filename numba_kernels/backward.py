"""flash_attention_backward: the contract's gradients from the backward kernels (flash_mma_bwd.py
on tensor cores, for 16-bit inputs; flash_bwd.py, tuned SIMT; plain_bwd.py, one thread per key
or row), with flash_attention's arguments, checks and array handling."""
import numpy as np

from reference.contract import _shape4
from reference.dtypes import dtype_name
from .api import _band, _begin, _halves, _plan_for, _side_inputs, resolve_precision
from .flash_fwd import kernel_args
from .launch import launch
from .plain_bwd import (DELTA_ARGS, DELTA_THREADS, DKDV_ARGS, DQ_ARGS, plain_bwd_kernel)
from .plain_fwd import plain_tiles
from .flash_bwd import BwdSpec, bwd_width
from .flash_mma import mma_width
from .flash_mma_bwd import (BLOCK as MMA_BLOCK, FLAG_ROWS, MMA_DKDV_ARGS,
                            MMA_DQ_ARGS, SCAN_THREADS, THREADS as MMA_THREADS, MmaBwdSpec,
                            ScanSpec, kv_parts, mma_bwd_kernel, scan_kernel)
from .specs import pad, tuned_bwd_kernel


def flash_attention_backward(q, k, v, out, lse, dout, *, scale=None, causal=False, mask=None,
                             bias=None, kv_lengths=None, window=None, dlse=None,
                             kernel="auto", precision=None):
    """(dq, dk, dv): the gradients of the output for incoming gradient dout, per
    docs/contract.md ("Gradients"), in q's dtype and array type.

    q, k, v and the options as for flash_attention, with the same values; out and lse are
    what flash_attention(..., return_lse=True) returned for them; dout (B, Hq, Nq, Dv) in q's
    dtype. dk and dv of a key head are summed over its group's query heads. Deterministic:
    two calls give bitwise equal gradients (no atomic adds). Arithmetic is float32.
    dlse: the gradient of lse too, (B, Hq, Nq) float32, where the loss used it: since
    d lse_i / d s_ij = P_ij, it enters as delta - dlse (dS = P * (dP - delta + dlse)).
    kernel: "auto" (the default, the same choice as flash_attention's "auto" forward at the
    same precision: "mma" where it applies, float32 too at precision "high" from 64 query
    rows without a mask or bias (api.float32_why_not), else "tuned"), "mma"
    (flash_mma_bwd.py: tensor cores, float16 and bfloat16, and float32 as two float16
    halves a value (halves.py: products of about 22 bits; PERF.md has their speed); head
    dims multiples of 8 up to 128, float32 with a
    mask or bias up to 64; ValueError where it does not apply; float32's scores are the
    forward's bit for bit when out and lse came from flash_attention(kernel="mma"): after
    the SIMT forward's take "tuned", whose scores round as that forward's do), "tuned"
    (flash_bwd.py, register micro-tiles
    over shared-memory tiles) or "plain" (plain_bwd.py, one thread per key or row: the one
    to read first). Every kernel keeps a NaN or an inf in a pair that takes no part out of
    the gradients: the tensor-core kernels flag the tiles of q, k and dout that hold one
    (one pass over each) and add only the pairs that take part in those.
    precision: as flash_attention's ("highest", "high", or None: PyTorch's float32 matmul
    precision for torch tensors, else "highest").
    """
    if kernel not in KERNELS and kernel != "auto":
        raise ValueError(f"kernel must be one of {sorted(KERNELS) + ['auto']}, got {kernel!r}")
    pb, io, _, _ = _begin(q, k, v, scale, causal, mask, bias, kv_lengths, window)
    _check_saved(pb, out, lse, dout)
    has_mask = mask is not None or bias is not None
    precision = resolve_precision(precision, q, kernel, pb.dtype)
    if kernel in ("auto", "mma"):  # the forward's choice, so that the two passes agree
        # ("mma" where it does not apply, or where the halves cannot hold the values: a
        # ValueError saying why)
        plan = _plan_for(pb, kernel, None, has_mask, precision,
                         dict(q=q, k=k, v=v, dout=dout))
        kernel = "mma" if plan.kernel == "mma" else "tuned"
    dq = io.empty((pb.batch, pb.heads_q, pb.n_q, pb.d), pb.dtype)
    dk = io.empty((pb.batch, pb.heads_k, pb.n_k, pb.d), pb.dtype)
    dv = io.empty((pb.batch, pb.heads_k, pb.n_k, pb.dv), pb.dtype)
    if pb.batch * pb.heads_k * pb.n_k == 0 and pb.batch * pb.heads_q * pb.n_q == 0:
        return io.result(dq), io.result(dk), io.result(dv)
    width = pad(max(pb.d, pb.dv))
    mask_dev, bias_dev, lengths, steps = _side_inputs(io, pb, mask, bias, kv_lengths)
    named = dict(q=io.dev(q), k=io.dev(k), v=io.dev(v), mask=mask_dev, bias=bias_dev,
                 kv_lengths=lengths, dout=io.dev(dout), lse_in=io.dev(lse),
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
        block_m, block_n = spec.tiles[:2]
        rows = block_n if part == "dkdv" else block_m
        if pb.batch * heads * n:
            launch(tuned_bwd_kernel(spec), spec, (-(-n // rows), pb.batch * heads),
                   spec.threads, io.stream,
                   *_ordered(args, dict(named, **{g: grads[g] for g in out})),
                   shared=spec.dynamic_shared_bytes)


def _mma(pb, io, named, grads, width, has_mask):
    """The tensor-core dK/dV and dQ kernels (flash_mma_bwd.py), after the pre-pass flags the
    tiles of q, dout and k that hold a NaN or an inf (and, for float32, splits q, k, v and
    dout into float16 halves): each kernel's fast variant, then its nonfinite variant for
    the blocks the fast one deferred (most often none: its blocks return at once)."""
    if pb.dtype == "float32":
        named, flags = _halves(io, named)
    else:
        flags = {f"{name}_flags": _flags(io, pb, named[name]) for name in ("q", "dout", "k")}
        flags["factors"] = io.flat(named["delta"])  # not read by the 16-bit variants
    kv = tuple((part, pb.n_k, pb.heads_k, MMA_DKDV_ARGS, ("dk", "dv"))
               for part in kv_parts(pb.dtype, mma_width(pb.d), mma_width(pb.dv), has_mask))
    for part, n, heads, args, out in kv + (("dq", pb.n_q, pb.heads_q, MMA_DQ_ARGS, ("dq",)),):
        blocks = -(-n // MMA_BLOCK)
        if pb.batch * heads * n == 0:
            continue
        values = dict(named, **flags, **{g: grads[g] for g in out},
                      deferred=io.scratch((pb.batch, heads, blocks)))
        for nonfinite in (False, True):
            spec = MmaBwdSpec(part, mma_width(pb.d), mma_width(pb.dv), pb.dtype, has_mask,
                              nonfinite)
            launch(mma_bwd_kernel(spec), spec, (blocks, pb.batch * heads), MMA_THREADS,
                   io.stream, *_ordered(args, values), shared=spec.dynamic_shared_bytes)


KERNELS = {"plain": _plain, "tuned": _tuned, "mma": _mma}


def _flags(io, pb, x):
    """(B, H, rows / FLAG_ROWS) uint8 on the device: 1 where FLAG_ROWS rows of x (16-bit,
    C-contiguous on the device, an even last dim) hold a NaN or an inf (flash_mma_bwd's
    pre-pass; no wait for it)."""
    batch, heads, rows, width = x.shape
    tiles = -(-rows // FLAG_ROWS)
    flags = io.scratch((batch, heads, max(tiles, 1)))
    if batch * heads * rows:
        scan = ScanSpec(pb.dtype)
        launch(scan_kernel(scan), scan, (tiles, batch * heads), SCAN_THREADS, io.stream,
               io.words(x), flags, rows, width // 2)
    return flags


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
