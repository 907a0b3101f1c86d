"""The forward's launches: flash_attention without autograd (forward), the SIMT kernel's
(flash_fwd.py) and the tensor-core kernel's (flash_mma.py, after halves.py's pre-pass for
float32), the split-KV merge, and the plain kernel (plain_fwd.py)."""
import numpy as np

from reference.contract import BLOCK_SIZE, check_flag
from . import replay
from .arrays import (band, begin, block_table, dtype_of, is_cpu_tensor, masked, on_device,
                     results, side_inputs, sm_count)
from .common import kernel_args
from .flash_fwd import KernelSpec
from .flash_mma import MMA_ARG_NAMES, MmaSpec, mma_kernel
from .flash_wgmma import KEYS as WGMMA_KEYS, WgmmaSpec, wgmma_kernel
from .launch import launch, resident_blocks
from .mma_parts import (BLOCK_M as MMA_BLOCK_M, BLOCK_N as MMA_BLOCK_N, full_tiles_apply,
                        mma_width as pad_mma)
from .plain_fwd import PLAIN_ARG_NAMES, plain_kernel, plain_tiles
from .plan import (call_plan, check_kernel, halves_range_why_not, halves_summed, mma_plan,
                   resolve_precision)
from .prepass import class_prepass, fit_blocks, halves_prepass, list_prepass
from .specs import build_kernel, build_merge, choose_spec, launch_grid, pad
from .split_kv import FILL_BLOCKS_PER_SM, choose_splits, split_count


def forward(q, k, v, *, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
            window=None, return_lse=False, num_splits=None, spec=None, kernel="auto",
            precision=None, block_mask=None, block_size=BLOCK_SIZE):
    """flash_attention without autograd: the kernels' launch (the arguments checked once).
    A torch call of a layout seen before replays that call's launches (replay.py)."""
    check_kernel(kernel)
    check_num_splits(num_splits)
    return_lse = check_flag("return_lse", return_lse)
    if spec is not None and not isinstance(spec, KernelSpec):
        raise TypeError(f"spec must be a KernelSpec of the SIMT kernel (specs.choose_spec) or "
                        f"None, got {spec!r}")
    precision = resolve_precision(precision, q)
    key = None
    halves = dtype_of(q) == "float32" and kernel != "simt"
    inputs = (q, k, v) + tuple(x for x in (mask, bias, block_mask) if x is not None)
    if kv_lengths is None and spec is None and not halves:
        # (float32 on halves is not replayed: the values' range decides the kernel; nor are
        # kv_lengths, whose values the host reads)
        key = replay_key(inputs, scale, causal, window, return_lse, num_splits, kernel,
                         precision, mask is not None, bias is not None,
                         None if block_mask is None else block_size)
        found = replay.find(key)
        if found is not None:
            return found.run(inputs)
    with replay.recording(key, inputs) as recorded:
        pb, io, out, lse = begin(q, k, v, scale, causal, mask, bias, kv_lengths, window,
                                 block_mask, block_size)
        blocks = block_table(io, pb, block_mask, block_size, mask is not None)
        _planned(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits, spec, kernel,
                 precision, blocks=blocks)
        if recorded is not None:
            recorded.returns((out, lse) if return_lse else out)
    return results(io, out, lse, return_lse)


def forward_float32(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
                    kv_lengths=None, window=None, kernel="auto", precision=None):
    """(out, lse) as forward(..., return_lse=True) gives them, out float32 whatever q's
    dtype: the result before its rounding to the inputs' dtype, for a caller that merges
    results by their lse (distributed attention), where each part's rounding would add to
    the error. Rounded to q's dtype (to nearest) it is forward's out. The kernel forward
    would choose; not replayed, no autograd; CPU tensors go through NumPy."""
    if is_cpu_tensor(q):
        return on_device(forward_float32, (q, k, v), dict(
            scale=scale, causal=causal, mask=mask, bias=bias, kv_lengths=kv_lengths,
            window=window, kernel=kernel, precision=resolve_precision(precision, q)))
    check_kernel(kernel)
    precision = resolve_precision(precision, q)
    pb, io, _, lse = begin(q, k, v, scale, causal, mask, bias, kv_lengths, window)
    out = io.empty((pb.batch, pb.heads_q, pb.n_q, pb.dv), "float32")
    _planned(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, None, None, kernel, precision,
             float32_out=True)
    return results(io, out, lse, True)


def _planned(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits, spec, kernel,
             precision, float32_out=False, blocks=None):
    """The launches of the kernel call_plan chooses, into out and lse (blocks: a
    BlockTable, or None)."""
    plan = call_plan(pb, kernel, spec, masked(mask, bias, blocks), precision,
                     dict(q=q, k=k, v=v))
    if plan.kernel in ("mma", "wgmma"):
        mma_forward(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits,
                    halves_summed(pb.dtype, plan.precision), float32_out=float32_out,
                    blocks=blocks, wgmma=plan.kernel == "wgmma")
    else:
        simt_forward(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits, spec,
                     float32_out=float32_out, blocks=blocks)


def replay_key(inputs, scale=None, causal=False, window=None, return_lse=False,
               num_splits=None, kernel="auto", precision="highest", masked=False,
               biased=False, block_size=None):
    """The layout under which forward records and replays a call without kv_lengths or spec
    (replay.call_key; None: not one to replay): inputs are q, k, v, then the mask, the
    bias and the block mask that were given (masked, biased; block_size None without a
    block mask)."""
    return replay.call_key(inputs, (scale, causal, window, return_lse, num_splits, kernel,
                                    precision, masked, biased, block_size))


def simt_forward(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits, spec,
                 float32_out=False, blocks=None):
    """The SIMT kernel (flash_fwd.py) into out and lse, split-KV merged; float32_out: out is
    float32 for any input dtype (the variants that write split-KV's partials); blocks: a
    BlockTable or None."""
    if pb.batch * pb.heads_q * pb.n_q > 0:  # else the outputs are empty: nothing to launch
        has_mask = masked(mask, bias, blocks)
        # Splitting depends on the tiles only, which do not depend on splitting.
        tiles = spec or choose_spec(pb.d, pb.dv, pb.dtype, has_mask)
        grid, _, _ = launch_grid(pb.n_q, pb.batch, pb.heads_q, tiles)
        n_splits = _splits(pb, grid, tiles.block_n, num_splits)
        chosen = choose_spec(pb.d, pb.dv, pb.dtype, has_mask,
                             partial=n_splits > 1 or _unrounded(pb, float32_out))
        if spec is None:
            spec = chosen
        elif spec.d < pb.d or spec.dv < pb.dv or spec.dtype != pb.dtype \
                or spec.has_mask != has_mask or spec.partial != chosen.partial:
            raise ValueError(f"spec {spec} does not fit D={pb.d}, Dv={pb.dv}, {pb.dtype}, "
                             f"mask or bias={'yes' if has_mask else 'no'}, {n_splits} split(s)")
        mask_dev, bias_dev, lengths, steps = side_inputs(io, pb, mask, bias, kv_lengths)
        mask_dev, steps, blocks = fit_blocks(io, pb, mask_dev, steps, blocks,
                                             [(spec.block_m, spec.block_n)])
        visible = list_prepass(io, class_prepass(io, pb, mask_dev, steps["mask_steps"],
                                                 has_mask, spec.block_m, spec.block_n,
                                                 blocks))
        dest = _partials(io, pb, n_splits) if n_splits > 1 else (out, lse)
        grid, threads, n_tiles = launch_grid(pb.n_q, pb.batch, pb.heads_q, spec, n_splits)
        launch(build_kernel(spec), spec, grid, threads, io.stream, *kernel_args(
            q=io.dev(q), k=io.dev(k), v=io.dev(v), mask=mask_dev, visible=visible, bias=bias_dev,
            kv_lengths=lengths, out=io.dev(dest[0]), lse=io.dev(dest[1]), n_q=pb.n_q, d=pb.d,
            d_v=pb.dv, group=pb.group, heads_q=pb.heads_q, n_tiles=n_tiles,
            n_splits=n_splits, split_keys=spec.block_n, **band(pb), **steps))
        if n_splits > 1:
            _merge(io, pb, dest, out, lse, n_splits, float32_out)


MERGE_THREADS = 128


def check_num_splits(num_splits):
    if num_splits is not None and (isinstance(num_splits, bool)
                                   or not isinstance(num_splits, (int, np.integer))
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be None or an integer >= 1, got {num_splits!r}")


def _splits(pb, blocks, block_n, num_splits, resident=None):
    """How many shares of whole block_n keys each block's keys are cut into: chosen
    (num_splits None; resident: the blocks an SM holds of the variant that runs split,
    None for split_kv's default) or as asked (split_kv.split_count)."""
    if num_splits is None:
        return choose_splits(blocks, pb.n_k, block_n, sm_count(),
                             FILL_BLOCKS_PER_SM if resident is None else resident)
    return split_count(pb.n_k, block_n, int(num_splits))


def _partials(io, pb, n_splits):
    """Where a split-KV launch writes: float32, split s of batch b at s * B + b."""
    return (io.empty((n_splits * pb.batch, pb.heads_q, pb.n_q, pb.dv), "float32"),
            io.empty((n_splits * pb.batch, pb.heads_q, pb.n_q), "float32"))


def _unrounded(pb, float32_out):
    """Whether a launch writes float32 where the inputs' dtype is 16 bits (float32_out)."""
    return float32_out and pb.dtype != "float32"


def _merge(io, pb, dest, out, lse, n_splits, float32_out=False):
    """out (float32 where float32_out, else the inputs' dtype) and lse from the partial
    results `dest` of n_splits splits (split_kv.py)."""
    elements = pb.batch * pb.heads_q * pb.n_q * pb.dv
    dtype = "float32" if float32_out else pb.dtype
    launch(build_merge(dtype), dtype, -(-elements // MERGE_THREADS), MERGE_THREADS,
           io.stream, io.dev(dest[0]), io.dev(dest[1]), io.dev(out), io.dev(lse), n_splits)


def plain_attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
                    kv_lengths=None, window=None, return_lse=False, block_mask=None,
                    block_size=BLOCK_SIZE):
    """The plain kernel (plain_fwd.py: one thread per query row, for reading) with
    flash_attention's arguments, checks and array handling (a block mask is written out
    as the boolean mask it stands for). Slower; no split-KV."""
    return_lse = check_flag("return_lse", return_lse)
    pb, io, out, lse = begin(q, k, v, scale, causal, mask, bias, kv_lengths, window,
                             block_mask, block_size)
    if pb.batch * pb.heads_q * pb.n_q > 0:
        width = pad(max(pb.d, pb.dv))
        blocks = block_table(io, pb, block_mask, block_size, mask is not None)
        has_mask = masked(mask, bias, blocks)
        block_m = plain_tiles(width)[0]
        mask_dev, bias_dev, lengths, steps = side_inputs(io, pb, mask, bias, kv_lengths)
        mask_dev, steps, _ = fit_blocks(io, pb, mask_dev, steps, blocks)
        launch(plain_kernel(width, width, pb.dtype, has_mask), ("plain", width, pb.dtype),
               (-(-pb.n_q // block_m), pb.batch * pb.heads_q), block_m, io.stream,
               *kernel_args(PLAIN_ARG_NAMES, q=io.dev(q), k=io.dev(k), v=io.dev(v),
                            mask=mask_dev, bias=bias_dev, kv_lengths=lengths,
                            out=io.dev(out), lse=io.dev(lse), n_q=pb.n_q, group=pb.group,
                            **band(pb), **steps))
    return results(io, out, lse, return_lse)


def mma_attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
                  kv_lengths=None, window=None, return_lse=False, num_splits=None,
                  precision=None, block_mask=None, block_size=BLOCK_SIZE):
    """The tensor-core kernel (flash_mma.py: mma.sync, float16 and bfloat16 inputs, float32
    as float16 halves at flash_attention's precision) with flash_attention's arguments,
    checks and array handling, split-KV included. Raises ValueError naming the reason where
    it does not apply (plan.mma_plan; for float32, plan.halves_range_why_not)."""
    return_lse = check_flag("return_lse", return_lse)
    check_num_splits(num_splits)
    precision = resolve_precision(precision, q)
    pb, io, out, lse = begin(q, k, v, scale, causal, mask, bias, kv_lengths, window,
                             block_mask, block_size)
    blocks = block_table(io, pb, block_mask, block_size, mask is not None)
    why_not = mma_plan(pb, masked(mask, bias, blocks))
    if why_not is None and pb.dtype == "float32":
        why_not = halves_range_why_not(dict(q=q, k=k, v=v), precision)
    if why_not:
        raise ValueError(f"the tensor-core kernel does not apply: {why_not}")
    mma_forward(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits,
                halves_summed(pb.dtype, precision), blocks=blocks)
    return results(io, out, lse, return_lse)


def mma_forward(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits, summed,
                float32_out=False, blocks=None, wgmma=False):
    """The tensor-core kernel (flash_mma.py) into out and lse, split-KV merged: its fast
    variant, then its careful variant for the blocks the fast one deferred (a row that
    ended non-finite, or, float32, a Q or K tile holding a NaN or an inf; most often none,
    and its blocks return at once). float32 goes through halves.py's pre-pass first;
    summed: its variants that sum each step's products apart (precision "highest");
    float32_out: out is float32 for any input dtype (the partials' variants); blocks: a
    BlockTable or None; wgmma: the fast variant is flash_wgmma.py's (16-bit inputs; its
    key tiles of WGMMA_KEYS have visible lists of their own; splits cut at multiples of
    them, which the careful variant's tiles divide)."""
    if pb.batch * pb.heads_q * pb.n_q > 0:
        q_tiles = -(-pb.n_q // MMA_BLOCK_M)
        split_keys = WGMMA_KEYS if wgmma else MMA_BLOCK_N  # both tile sizes divide it
        mask_dev, bias_dev, lengths, steps = side_inputs(io, pb, mask, bias, kv_lengths)
        has_mask = masked(mask, bias, blocks)
        tiles = [(MMA_BLOCK_M, n) for n in ((MMA_BLOCK_N, WGMMA_KEYS) if wgmma
                                            else (MMA_BLOCK_N,))]
        mask_dev, steps, blocks = fit_blocks(io, pb, mask_dev, steps, blocks, tiles)
        visible = [list_prepass(io, class_prepass(io, pb, mask_dev, steps["mask_steps"],
                                                  has_mask, m, n, blocks)) for m, n in tiles]
        named = dict(q=io.dev(q), k=io.dev(k), v=io.dev(v))
        halves_flags = None
        if pb.dtype == "float32":
            named, halves_flags = halves_prepass(io, named, ("q", "k", "v"))
            del halves_flags["v_flags"]  # a V tile's NaN or inf: the careful variant's own

        def call_args(n_splits, dest, deferred):
            """The kernels' arguments, one list for each tile size's visible lists."""
            # (the flags and factors are not read by the 16-bit variants)
            flags = halves_flags or dict(q_flags=deferred, k_flags=deferred,
                                         factors=io.flat(io.dev(dest[1])))
            return [kernel_args(
                MMA_ARG_NAMES, **named, **flags, mask=mask_dev, visible=lists, bias=bias_dev,
                kv_lengths=lengths, deferred=deferred, out=io.dev(dest[0]),
                lse=io.dev(dest[1]), n_q=pb.n_q, d=pb.d, d_v=pb.dv, group=pb.group,
                heads_q=pb.heads_q, n_splits=n_splits, split_keys=split_keys, **band(pb),
                **steps) for lists in visible]

        full = full_tiles_apply(pb.dtype, blocks is not None, blocks is not None and
                                blocks.masked, bias is not None)

        def variant(careful, partial):
            return _mma_variant(pb, has_mask, partial, careful, summed, full, wgmma)

        n_splits = _mma_splits(io, pb, q_tiles * pb.batch * pb.heads_q, split_keys,
                               num_splits, variant, call_args)
        dest = _partials(io, pb, n_splits) if n_splits > 1 else (out, lse)
        args = call_args(n_splits, dest, io.scratch((n_splits * pb.batch, pb.heads_q,
                                                     q_tiles)))
        partial = n_splits > 1 or _unrounded(pb, float32_out)
        for careful in (False, True):  # the careful variant reads the all-true mask
            spec, kernel, at = variant(careful, partial)
            launch(kernel, spec, (q_tiles, pb.batch * pb.heads_q, n_splits), MMA_THREADS,
                   io.stream, *args[at], shared=spec.dynamic_shared_bytes)
        if n_splits > 1:
            _merge(io, pb, dest, out, lse, n_splits, float32_out)


MMA_THREADS = 128  # the tensor-core forwards' threads a block: 4 warps, or a warpgroup


def _mma_variant(pb, has_mask, partial, careful, summed, full, wgmma):
    """(spec, compiled kernel, which visible lists its arguments take: 0 the mma.sync
    kernel's, -1 the wgmma kernel's) of mma_forward's fast (wgmma's where asked) or careful
    variant."""
    if wgmma and not careful:
        spec = WgmmaSpec(pad_mma(pb.d), pad_mma(pb.dv), pb.dtype, has_mask, partial, full)
        return spec, wgmma_kernel(spec), -1
    spec = MmaSpec(pad_mma(pb.d), pad_mma(pb.dv), pb.dtype, has_mask, partial, careful,
                   summed, full and not careful)
    return spec, mma_kernel(spec), 0


def _mma_splits(io, pb, blocks, split_keys, num_splits, variant, call_args):
    """mma_forward's split count (_splits): where one could be chosen, from the blocks an SM
    holds of the fast variant that writes partials (launch.resident_blocks, compiling it;
    asked with arguments of the launch's types), else split_kv's default."""
    resident = None
    if num_splits is None and choose_splits(blocks, pb.n_k, split_keys, sm_count(),
                                            MAX_RESIDENT) > 1:
        spec, kernel, at = variant(False, True)
        like = call_args(1, (io.scratch((1, 1, 1, 1), "float32"),
                             io.scratch((1, 1, 1), "float32")), io.scratch((1, 1, 1)))
        resident = resident_blocks(kernel, spec, MMA_THREADS, *like[at],
                                   shared=spec.dynamic_shared_bytes)
    return _splits(pb, blocks, split_keys, num_splits, resident)


MAX_RESIDENT = 2048 // MMA_THREADS  # blocks an SM holds at most, by its threads

