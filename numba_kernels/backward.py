"""flash_attention_backward: the contract's gradients from the backward kernels (flash_mma_bwd.py
on tensor cores, for 16-bit inputs, and flash_wgmma_bwd.py's on Hopper's; flash_bwd.py, tuned
SIMT; plain_bwd.py, one thread per key or row), with flash_attention's arguments, checks and
array handling."""
import numpy as np

from reference.contract import BLOCK_SIZE, array_dtype, shape4
from reference.memory import overlaps
from . import replay
from .arrays import (band, begin, block_table, dtype_of, is_cpu_tensor, masked, on_device,
                     side_inputs)
from .common import DELTA_ARGS, DKDV_ARGS, DQ_ARGS, kernel_args
from .flash_bwd import TUNED_DKDV_ARGS, TUNED_DQ_ARGS, BwdSpec, bwd_width
from .flash_mma_bwd import (BLOCK as MMA_BLOCK, MMA_DKDV_ARGS, MMA_DQ_ARGS, MmaBwdSpec,
                            kv_parts, mma_bwd_kernel)
from .flash_wgmma_bwd import WgmmaBwdSpec, wgmma_bwd_kernel
from .launch import launch
from .mma_parts import THREADS as MMA_THREADS, full_tiles_apply, mma_width
from .plain_bwd import DELTA_ROWS, DELTA_THREADS, plain_bwd_kernel
from .plain_fwd import plain_tiles
from .plan import backward_plan, halves_summed, resolve_precision
from .prepass import class_prepass, fit_blocks, flag_prepass, halves_prepass, list_prepass
from .specs import pad, tuned_bwd_kernel


def flash_attention_backward(q, k, v, out, lse, dout, *, scale=None, causal=False, mask=None,
                             bias=None, kv_lengths=None, window=None, dlse=None,
                             kernel="auto", precision=None, block_mask=None,
                             block_size=BLOCK_SIZE):
    """(dq, dk, dv): the gradients of the output for incoming gradient dout, per
    docs/contract.md ("Gradients"), in q's dtype and array type.

    q, k, v and the options as for flash_attention, with the same values; out and lse are
    what flash_attention(..., return_lse=True) returned for them; dout (B, Hq, Nq, Dv) in q's
    dtype. dk and dv of a key head are summed over its group's query heads. Deterministic:
    two calls give bitwise equal gradients (no atomic adds). Arithmetic is float32.
    dlse: the gradient of lse too, (B, Hq, Nq) float32, where the loss used it: since
    d lse_i / d s_ij = P_ij, it enters as delta - dlse (dS = P * (dP - delta + dlse)).
    kernel: "auto" (the default, the same choice as flash_attention's "auto" forward at the
    same precision: "mma" where it applies, float32 too from 64 query rows without a mask or
    bias (plan.float32_why_not), else "tuned"), "mma" (flash_mma_bwd.py: tensor cores,
    float16 and bfloat16, and float32 as two float16 halves a value (halves.py), summed
    apart at precision "highest"); head
    dims multiples of 8 up to 128, float32 with a
    mask or bias up to 64; ValueError where it does not apply; float32's scores are the
    forward's bit for bit when out and lse came from flash_attention(kernel="mma"): after
    the SIMT forward's take "tuned", whose scores round as that forward's do), "wgmma"
    (after flash_attention(kernel="wgmma"): "mma"'s kernels on Hopper's warpgroup tensor
    cores, flash_wgmma_bwd.py, their nonfinite variants mma's; float16 and bfloat16 on a GPU
    of compute capability 9.0; ValueError elsewhere), "tuned" (flash_bwd.py, register micro-tiles over
    shared-memory tiles) or "plain" (plain_bwd.py, one thread per key or row: the one to
    read first). Every kernel keeps a NaN or an inf in a pair that takes no part out of
    the gradients: the tensor-core kernels flag the tiles of q, k and dout that hold one
    (one pass over each) and add only the pairs that take part in those.
    precision: as flash_attention's ("highest", "high", or None: PyTorch's float32 matmul
    precision for torch tensors, else "highest"). block_mask, block_size: as
    flash_attention's (the tensor-core kernels walk its tiles; the others read the mask it
    stands for).
    A torch call of a layout seen before, without kv_lengths or dlse, 16-bit, replays that
    call's launches (replay.py).
    """
    if is_cpu_tensor(q):  # through NumPy, as flash_attention takes them
        return on_device(flash_attention_backward, (q, k, v, out, lse, dout), dict(
            scale=scale, causal=causal, mask=mask, bias=bias, kv_lengths=kv_lengths,
            window=window, dlse=dlse, kernel=kernel,
            precision=resolve_precision(precision, q), block_mask=block_mask,
            block_size=block_size))
    precision = resolve_precision(precision, q)
    inputs = (q, k, v, out, lse, dout) + tuple(x for x in (mask, bias, block_mask)
                                               if x is not None)
    key = None
    if kv_lengths is None and dlse is None and dtype_of(q) != "float32":
        # (float32: the values' range decides the kernel, as in forward)
        key = replay.call_key(inputs, ("backward", scale, causal, window, kernel, precision,
                                       mask is not None, bias is not None,
                                       None if block_mask is None else block_size))
        found = replay.find(key)
        if found is not None:
            return found.run(inputs)
    with replay.recording(key, inputs) as recorded:
        pb, io, kernel, precision = _checked(q, k, v, out, lse, dout, dlse, scale, causal,
                                             mask, bias, kv_lengths, window, kernel,
                                             precision, block_mask, block_size)
        grads = _gradients(pb, io, q, k, v, out, lse, dout, dlse, mask, bias, kv_lengths,
                           kernel, precision, blocks=block_table(io, pb, block_mask,
                                                                 block_size, mask is not None))
        if recorded is not None:
            recorded.returns(grads)
    return grads


def backward_float32(q, k, v, out, lse, dout, *, scale=None, causal=False, mask=None,
                     bias=None, kv_lengths=None, window=None, dlse=None, kernel="auto",
                     precision=None):
    """flash_attention_backward's (dq, dk, dv) before their rounding to q's dtype: float32
    for any input dtype, the same arguments. For 16-bit inputs the tensor-core kernels'
    float32_grads variants (scores recomputed as the tensor-core forward made them, bit for
    bit); where those do not apply (the plan picks another kernel), the kernels on float32
    copies of the inputs, whose scores are float32's own. Not replayed, no autograd; CPU
    tensors go through NumPy. For gradients summed over parts (distributed/ring.py): W
    parts then add no rounding of their own."""
    options = dict(scale=scale, causal=causal, mask=mask, bias=bias, kv_lengths=kv_lengths,
                   window=window, dlse=dlse, kernel=kernel)
    if is_cpu_tensor(q):
        return on_device(backward_float32, (q, k, v, out, lse, dout),
                         dict(options, precision=resolve_precision(precision, q)))
    pb, io, chosen, precision = _checked(q, k, v, out, lse, dout, dlse, scale, causal, mask,
                                         bias, kv_lengths, window, kernel, precision)
    if pb.dtype == "float32" or chosen not in ("mma", "wgmma"):  # wgmma: the mma kernels
        q, k, v, out, dout = (_float32(x) for x in (q, k, v, out, dout))
        return flash_attention_backward(q, k, v, out, lse, dout,
                                        **dict(options, precision=precision))
    return _gradients(pb, io, q, k, v, out, lse, dout, dlse, mask, bias, kv_lengths, chosen,
                      precision, float32_grads=True)


def _checked(q, k, v, out, lse, dout, dlse, scale, causal, mask, bias, kv_lengths, window,
             kernel, precision, block_mask=None, block_size=BLOCK_SIZE):
    """A call's problem and arrays (checked against the contract and the saved forward),
    the kernel backward_plan picks and the precision it runs at."""
    pb, io, _, _ = begin(q, k, v, scale, causal, mask, bias, kv_lengths, window, block_mask,
                         block_size, outputs=False, out=out, lse=lse, dout=dout, dlse=dlse)
    _check_saved(pb, dict(q=q, k=k, v=v), dict(out=out, lse=lse, dout=dout, dlse=dlse))
    precision = resolve_precision(precision, q)
    kernel = backward_plan(pb, kernel, masked(mask, bias, block_mask), precision,
                           dict(q=q, k=k, v=v, dout=dout))
    return pb, io, kernel, precision


def _float32(x):
    """x as float32 (a torch tensor, a NumPy or CuPy array), itself where it is already."""
    return x.float() if hasattr(x, "float") and callable(x.float) else x.astype(np.float32)


def _gradients(pb, io, q, k, v, out, lse, dout, dlse, mask, bias, kv_lengths, kernel,
               precision, float32_grads=False, blocks=None):
    """(dq, dk, dv) of a checked call from the backward kernel `kernel` at `precision`,
    after the delta kernel (delta = rowsum(dout * out), minus dlse); float32_grads (the
    tensor-core kernels, 16-bit inputs): stored as float32; blocks: a BlockTable or None."""
    has_mask = masked(mask, bias, blocks)
    grads_dtype = "float32" if float32_grads else pb.dtype
    dq = io.empty((pb.batch, pb.heads_q, pb.n_q, pb.d), grads_dtype)
    dk = io.empty((pb.batch, pb.heads_k, pb.n_k, pb.d), grads_dtype)
    dv = io.empty((pb.batch, pb.heads_k, pb.n_k, pb.dv), grads_dtype)
    if pb.batch * pb.heads_k * pb.n_k == 0 and pb.batch * pb.heads_q * pb.n_q == 0:
        return io.result(dq), io.result(dk), io.result(dv)
    width = pad(max(pb.d, pb.dv))
    mask_dev, bias_dev, lengths, steps = side_inputs(io, pb, mask, bias, kv_lengths)
    mask_dev, steps, blocks = fit_blocks(io, pb, mask_dev, steps, blocks, mma_tiles(
        pb, kernel == "wgmma" and not float32_grads) if (float32_grads or kernel in (
            "mma", "wgmma")) else tuned_tiles(pb) if kernel == "tuned" else ())
    # full_tiles: a block table read as it is, alone: every listed tile FULL, no mask read
    full = not float32_grads and full_tiles_apply(pb.dtype, blocks is not None,
                                                  blocks is not None and blocks.masked,
                                                  bias is not None)
    named = dict(q=io.dev(q), k=io.dev(k), v=io.dev(v), mask=mask_dev, bias=bias_dev,
                 blocks=blocks, full_tiles=full,
                 kv_lengths=lengths, dout=io.dev(dout), lse_in=io.dev(lse),
                 delta=io.empty((pb.batch, pb.heads_q, pb.n_q), "float32"), n_q=pb.n_q,
                 group=pb.group, scale=np.float32(pb.scale), **band(pb), **steps)
    named["delta"] = io.dev(named["delta"])
    bh_q = pb.batch * pb.heads_q
    if bh_q * pb.n_q:
        launch(plain_bwd_kernel("delta", width, width, pb.dtype, False), ("delta", pb.dtype),
               (-(-pb.n_q // DELTA_ROWS), bh_q), DELTA_THREADS, io.stream,
               *_ordered(DELTA_ARGS, dict(named, out=io.dev(out))))
        if dlse is not None:
            named["delta"] = _minus(io, named["delta"], dlse)
    grads = dict(dq=io.dev(dq), dk=io.dev(dk), dv=io.dev(dv))
    if float32_grads:
        _mma(pb, io, named, grads, width, has_mask, precision, float32_grads=True)
    else:
        LAUNCHES[kernel](pb, io, named, grads, width, has_mask, precision)
    return io.result(dq), io.result(dk), io.result(dv)


def _plain(pb, io, named, grads, width, has_mask, precision):
    """The plain dK/dV and dQ kernels (plain_bwd.py): one thread per key, one per row; full
    float32 at either precision."""
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


def _tuned(pb, io, named, grads, width, has_mask, precision):
    """The tuned dK/dV and dQ kernels (flash_bwd.py): register micro-tiles; full float32 at
    either precision; with a mask or bias, each walks its visible lists (class_prepass and
    list_prepass at its own tiles: dQ's by query tile, dK/dV's by key tile)."""
    for part, n, heads, args, out in (("dkdv", pb.n_k, pb.heads_k, TUNED_DKDV_ARGS,
                                       ("dk", "dv")),
                                      ("dq", pb.n_q, pb.heads_q, TUNED_DQ_ARGS, ("dq",))):
        spec = BwdSpec(part, *[bwd_width(pb.d, pb.dv)] * 2, pb.dtype, has_mask)
        block_m, block_n = spec.tiles[:2]
        rows = block_n if part == "dkdv" else block_m
        if pb.batch * heads * n:
            visible = list_prepass(io, class_prepass(
                io, pb, named["mask"], named["mask_steps"], has_mask, block_m, block_n,
                named["blocks"]), part == "dkdv")
            launch(tuned_bwd_kernel(spec), spec, (-(-n // rows), pb.batch * heads),
                   spec.threads, io.stream, *_ordered(args, dict(
                       named, visible=visible, **{g: grads[g] for g in out})),
                   shared=spec.dynamic_shared_bytes)


def _mma(pb, io, named, grads, width, has_mask, precision, float32_grads=False, wgmma=False):
    """The tensor-core dK/dV and dQ kernels (flash_mma_bwd.py), after the pre-passes: with a
    mask or bias the visible lists each kernel walks (block_sparse.py: dQ's by query tile,
    dK/dV's by key tile), and the flags of the tiles of q, dout and k that hold a NaN or an
    inf (for float32, with q, k, v and dout split into float16 halves). Each kernel's fast
    variant, then its nonfinite variant for the blocks the fast one deferred (most often
    none: its blocks return at once); float32 at precision "highest" by the variants that
    sum each step's products apart; float32_grads: the 16-bit variants that store float32;
    named["full_tiles"]: the fast variants that read no mask or bias (MmaBwdSpec.full_tiles);
    wgmma: the fast variants are flash_wgmma_bwd.py's (16-bit inputs), with lists of their
    own tiles where they differ."""
    summed = halves_summed(pb.dtype, precision)
    lists = {}  # (rows, keys, transposed) -> the visible lists at those tiles

    def visible(tiles, transposed):
        if (*tiles, transposed) not in lists:
            lists[(*tiles, transposed)] = list_prepass(io, class_prepass(
                io, pb, named["mask"], named["mask_steps"], has_mask, *tiles, named["blocks"]),
                transposed)
        return lists[(*tiles, transposed)]

    if pb.dtype == "float32":
        named, flags = halves_prepass(io, named)
    else:
        flags = {f"{name}_flags": flag_prepass(io, pb, named[name]) for name in ("q", "dout", "k")}
        flags["factors"] = io.flat(named["delta"])  # not read by the 16-bit variants
    kv = tuple((part, pb.n_k, pb.heads_k, MMA_DKDV_ARGS, ("dk", "dv"))
               for part in kv_parts(pb.dtype, mma_width(pb.d), mma_width(pb.dv), has_mask,
                                    summed))
    for part, n, heads, args, out in kv + (("dq", pb.n_q, pb.heads_q, MMA_DQ_ARGS, ("dq",)),):
        blocks = -(-n // MMA_BLOCK)
        if pb.batch * heads * n == 0:
            continue
        values = dict(named, **flags, **{g: grads[g] for g in out},
                      deferred=io.scratch((pb.batch, heads, blocks)))
        for nonfinite in (False, True):  # the nonfinite variant reads the all-true mask
            spec = MmaBwdSpec(part, mma_width(pb.d), mma_width(pb.dv), pb.dtype, has_mask,
                              nonfinite, summed, float32_grads,
                              named["full_tiles"] and not nonfinite)
            kernel = mma_bwd_kernel(spec)
            if wgmma and not nonfinite:
                spec = WgmmaBwdSpec(part, spec.d, spec.dv, spec.dtype, has_mask,
                                    spec.full_tiles)
                kernel = wgmma_bwd_kernel(spec)
            launch(kernel, spec, (blocks, pb.batch * heads), MMA_THREADS, io.stream,
                   *_ordered(args, dict(values, visible=visible(spec.tiles, part != "dq"))),
                   shared=spec.dynamic_shared_bytes)


def _wgmma(pb, io, named, grads, width, has_mask, precision):
    """_mma with the fast variants on Hopper's warpgroup tensor cores (16-bit inputs)."""
    _mma(pb, io, named, grads, width, has_mask, precision, wgmma=True)


LAUNCHES = {"plain": _plain, "tuned": _tuned, "mma": _mma,  # each backward kernel's launches
            "wgmma": _wgmma}


def mma_tiles(pb, wgmma=False):
    """The tiles (rows, keys) the tensor-core backward walks: the dQ kernel's, and the dK/dV
    kernel's (qb query rows by a block of keys); wgmma: the wgmma kernels' too (the mma.sync
    ones' nonfinite variants keep theirs)."""
    specs = [MmaBwdSpec(part, mma_width(pb.d), mma_width(pb.dv), pb.dtype, True)
             for part in ("dq", "dkdv")]
    if wgmma:
        specs += [WgmmaBwdSpec(part, mma_width(pb.d), mma_width(pb.dv), pb.dtype, True, full)
                  for part in ("dq", "dkdv") for full in (False, True)]
    return list(dict.fromkeys(s.tiles for s in specs))


def tuned_tiles(pb):
    """The tiles (rows, keys) the tuned backward walks: its dK/dV kernel's and its dQ
    kernel's (flash_bwd.TILES)."""
    return [BwdSpec(part, *[bwd_width(pb.d, pb.dv)] * 2, pb.dtype, True).tiles[:2]
            for part in ("dkdv", "dq")]


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


def _check_saved(pb, inputs, saved):
    """out, lse, dout and dlse (`saved`) as flash_attention returned and takes them, none of
    them sharing memory with q, k or v (`inputs`), or a clear error."""
    want = {"out": (pb.batch, pb.heads_q, pb.n_q, pb.dv),
            "dout": (pb.batch, pb.heads_q, pb.n_q, pb.dv)}
    for name in ("out", "dout"):
        x = saved[name]
        got = shape4(name, x, "(B, Hq, Nq, Dv)")
        if got != want[name]:
            raise ValueError(f"{name} must have shape (B, Hq, Nq, Dv)={want[name]}, got {got}")
        if array_dtype(x) != pb.dtype:
            raise TypeError(f"{name} must have q's dtype {pb.dtype}, got {array_dtype(x)}")
    for name in ("lse", "dlse"):
        x = saved[name]
        if x is None and name == "dlse":
            continue
        shape = tuple(getattr(x, "shape", ()))
        dtype = array_dtype(x) if hasattr(x, "dtype") else type(x).__name__
        if shape != want["out"][:3] or dtype != "float32":
            raise ValueError(f"{name} must be a float32 array of shape (B, Hq, Nq)="
                             f"{want['out'][:3]} (the forward's lse, or its gradient), got "
                             f"shape {shape} dtype {dtype}")
    for name, x in saved.items():
        for input_name, y in inputs.items():
            if x is not None and overlaps(x, y):
                raise ValueError(f"{name} shares memory with {input_name}: pass what "
                                 f"flash_attention returned for these inputs")
