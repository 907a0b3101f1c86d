"""flash_attention: the contract's entry point for the Numba kernel.

Takes NumPy arrays (copied to the device and back), PyTorch CUDA tensors, CuPy arrays or Numba
device arrays (used in place through their strides, launched on the caller's current stream),
and returns the caller's array type. Outputs are fresh arrays; inputs are never written.
"""
from typing import NamedTuple

import numpy as np
from numba import cuda

from reference.contract import check_attention_args, row_lengths
from reference.dtypes import TRANSPORT, numpy_dtype, transported
from .convert import SIMULATOR
from .flash_fwd import LOG2E, kernel_args
from . import replay
from .launch import launch
from .flash_mma import (BLOCK_M as MMA_BLOCK_M, BLOCK_N as MMA_BLOCK_N, FLAG_ROWS,
                        MMA_ARG_NAMES, MmaSpec, mma_kernel, mma_plan, mma_width as pad_mma)
from .halves import ABS_BLOCKS, SLOTS, THREADS as HALVES_THREADS, HalvesSpec, halves_kernel
from .plain_fwd import PLAIN_ARG_NAMES, plain_kernel, plain_tiles
from .specs import (DTYPES, MAX_HEAD_DIM, build_kernel, build_merge, choose_spec, launch_grid,
                    pad)
from .split_kv import choose_splits, split_layout

NO_DEVICE = ("no CUDA GPU is available. To run the kernel on the CPU, set the environment "
             "variable NUMBA_ENABLE_CUDASIM=1 before Python starts (the simulator runs one "
             "Python thread per CUDA thread: tiny sizes only).")


def flash_attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
                    kv_lengths=None, window=None, return_lse=False, num_splits=None, spec=None,
                    kernel="auto", precision=None):
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

    num_splits: split the keys into this many ranges, one block each, merged by lse
    (split_kv.py); None chooses: splits only when the query tiles alone leave the GPU's SMs
    idle (decoding). spec: a KernelSpec that forces one variant of the SIMT kernel (for
    benchmarks); by default specs.choose_spec picks it. kernel: "auto" (the default: the
    tensor-core kernel where it applies: 16-bit inputs, and float32 at precision "high" from
    64 query rows without a mask or bias (float32_why_not); else the SIMT one), "simt"
    (flash_fwd.py, every dtype and head dims up to 256) or "mma" (flash_mma.py: float16 and
    bfloat16, and float32 as two float16 halves a value (halves.py: products of about 22
    bits, precision "high"), whose scores flash_attention_backward recomputes bit for bit
    with the same kernel=; head dims multiples of 8 up to 128, float32 with a mask or bias
    up to 64; a ValueError says why where it does not apply); kernel_plan tells which one a
    call gets, why, and at which precision.
    precision: what float32 inputs may run at, PyTorch's names: "highest", full float32 (the
    SIMT kernels), or "high", products of about 22 bits allowed (the tensor cores' float16
    halves; PERF.md has their speed). None (the default) takes
    torch.get_float32_matmul_precision() for torch tensors ("high" and "medium" give "high";
    its default is "highest") and "highest" for any other array. 16-bit inputs run at their
    own precision either way. "high" never trades the range: where a row of q, k or v lies
    more than 2^16 below its tensor's largest value, or a tensor's largest lies outside
    2^-48 .. 2^48, the call runs the SIMT kernel (halves_range_why_not; kernel="mma" raises
    instead). The gradients through autograd follow the forward's choice.
    """
    if type(q).__module__.startswith("torch") and spec is None:
        from . import autograd

        if autograd.wanted(q, k, v, bias):
            return autograd.attention(q, k, v, scale=scale, causal=causal, mask=mask,
                                      bias=bias, kv_lengths=kv_lengths, window=window,
                                      return_lse=return_lse, num_splits=num_splits,
                                      kernel=kernel, precision=precision)
    return forward(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                   kv_lengths=kv_lengths, window=window, return_lse=return_lse,
                   num_splits=num_splits, spec=spec, kernel=kernel, precision=precision)


KERNELS = ("simt", "mma", "auto")
PRECISIONS = ("highest", "high")  # PyTorch's float32 matmul precisions ("medium" as "high")
FLOAT32_MIN_ROWS = 64  # "auto": float32 with fewer query rows (decoding) stays on SIMT


class Plan(NamedTuple):
    """What a call runs: the forward kernel ("simt" or "mma"), why, and the precision of its
    float32 arithmetic ("highest": full float32; "high": float16 halves)."""
    kernel: str
    why: str
    precision: str


def resolve_precision(precision, q, kernel, dtype):
    """The precision a call runs float32 at (PRECISIONS): precision as given, or for None,
    PyTorch's float32 matmul precision where q is a torch tensor, else "highest". Raises
    ValueError for a name not in PRECISIONS, and for kernel="mma" on dtype float32 (float16
    halves) with precision="highest" asked for by name."""
    if precision is None:
        if not type(q).__module__.startswith("torch"):
            return "highest"
        from .autograd import float32_matmul_precision

        return "highest" if float32_matmul_precision() == "highest" else "high"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, or None (PyTorch's float32 "
                         f"matmul precision for torch tensors, else 'highest'), got "
                         f"{precision!r}")
    if precision == "highest" and kernel == "mma" and dtype == "float32":
        raise ValueError("kernel='mma' runs float32 as float16 halves (products of about 22 "
                         "bits: precision 'high'); precision='highest' asks for full float32: "
                         "use kernel='auto' or 'simt'")
    return precision


def float32_why_not(pb, has_mask, precision="highest"):
    """Why "auto" leaves float32 problem pb to the SIMT kernels, forward and backward alike,
    or None: the tensor cores take float32 as float16 halves (halves.py) at precision "high"
    only, where verify's numba-mma-backward certifies the pair, without a mask or bias, and
    where a query tile is full: with one query row the halves' pre-pass, which reads k and v
    once more, made decoding twice as slow on the H200 (PERF.md)."""
    if precision == "highest":
        return ("float32 at precision 'highest' (the default) is full float32; the tensor "
                "cores' float16 halves (products of about 22 bits) run at precision='high'")
    if has_mask:
        return ("float32 with a mask or bias takes the tensor cores only when asked, "
                "kernel='mma' (verify's numba-mma-backward does not certify it)")
    if pb.n_q < FLOAT32_MIN_ROWS:
        return (f"float32 with fewer than {FLOAT32_MIN_ROWS} query rows (decoding) takes "
                "the tensor cores only when asked, kernel='mma' (their pre-pass reads k and "
                "v once more)")
    return None


def kernel_plan(q, k, v, *, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
                window=None, num_splits=None, spec=None, kernel="auto", precision=None):
    """Plan(kernel, why, precision): which forward kernel flash_attention runs for these
    arguments, "simt" (flash_fwd.py) or "mma" (flash_mma.py), why, and the precision of its
    float32 arithmetic. kernel="auto" takes the tensor-core kernel where it applies
    (flash_mma.mma_plan: head dims multiples of 8 up to 128; no spec of the SIMT kernel
    given) for float16 and bfloat16, and for float32 at precision "high" (float32_why_not:
    not with a mask or bias, nor for decoding; halves_range_why_not: not where a row's
    values lie too far below the tensor's largest), and says why not where it falls back;
    "mma" raises ValueError with that reason instead. num_splits is taken as flash_attention
    takes it; both kernels split the keys, so it does not decide."""
    _check_kernel(kernel)
    pb = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                              kv_lengths=kv_lengths, window=window, dtypes=DTYPES)
    return _plan_for(pb, kernel, spec, mask is not None or bias is not None,
                     resolve_precision(precision, q, kernel, pb.dtype), dict(q=q, k=k, v=v))


def _check_kernel(kernel):
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def _plan(pb, kernel, spec, has_mask, precision):
    """kernel_plan for a checked problem pb (has_mask: a mask or bias is given; precision:
    resolve_precision's)."""
    if kernel == "simt":
        return Plan("simt", "asked for", "highest")
    why_not = mma_plan(pb, has_mask)
    if why_not is None and spec is not None:
        why_not = "a spec (a variant of the SIMT kernel) was given"
    if why_not is None and kernel == "auto" and pb.dtype == "float32":
        why_not = float32_why_not(pb, has_mask, precision)
    if why_not is None:
        halves = pb.dtype == "float32"
        return Plan("mma", "asked for" if kernel == "mma" else "16-bit inputs it takes"
                    if not halves else "float32 inputs it takes, as float16 halves "
                    "(precision 'high')", "high" if halves else "highest")
    if kernel == "mma":
        raise ValueError(f"kernel='mma': {why_not}")
    return Plan("simt", f"the tensor-core kernel does not apply: {why_not}", "highest")


HALVES_RANGE = 16  # binades below a tensor's largest value where its halves keep 22 bits
HALVES_SPAN = 48  # the tensors' largest values within 2^-48 .. 2^48: the scales' products fit


def halves_range_why_not(named):
    """None, or why float16 halves with one scale per tensor (halves.py) would not hold the
    float32 tensors `named` ({name: (B, H, N, W) array of any kind}): a row (of a query, a
    key or a value; a head of dout, whose rows scale their own gradients alone) whose largest
    finite |x| lies more than 2^HALVES_RANGE below the tensor's largest (zeros are exact):
    after the tensor's scale its values fall toward float16's subnormals (hi + lo keep fewer
    than 22 bits), and 2^30 below nothing of them is left, which a head or a key whose values
    are small beside the others' cannot afford; or a tensor whose largest |x| lies outside
    2^-HALVES_SPAN .. 2^HALVES_SPAN, whose scales' products would leave float32's range.
    Reads every element once (on the device for torch and CuPy, one small copy back)."""
    for name, x in named.items():
        top = _row_maxima(x)
        if name == "dout":
            top = top.max(axis=2, keepdims=True)
        largest = float(top.max(initial=0.0))
        if largest and not 2.0**-HALVES_SPAN <= largest <= 2.0**HALVES_SPAN:
            return (f"float32 at precision 'high': the largest value of {name} is "
                    f"2^{np.log2(largest):.0f}, outside the 2^-{HALVES_SPAN} .. "
                    f"2^{HALVES_SPAN} that float16 halves with one scale per tensor hold")
        low = (top > 0) & (top < largest * 2.0**-HALVES_RANGE)
        if low.any():
            b, h, r = np.unravel_index(int(np.argmax(low)), top.shape)
            gap = np.log2(largest / top[b, h, r])
            where = f"(batch {b}, head {h})" if name == "dout" else \
                f"row {r} of (batch {b}, head {h})"
            return (f"float32 at precision 'high': {where} of {name} holds values "
                    f"2^{gap:.0f} below the tensor's largest, past the "
                    f"2^{HALVES_RANGE} that float16 halves with one scale per tensor hold "
                    f"(halves.py)")
    return None


def _row_maxima(x):
    """(B, H, N) float64 NumPy: the largest finite |x| of each row of x (B, H, N, W)."""
    shape = tuple(x.shape[:3])
    if int(np.prod(x.shape)) == 0:
        return np.zeros(shape)
    if hasattr(x, "detach"):  # torch
        import torch

        x = x.detach()
        return torch.where(torch.isfinite(x), x.abs(), 0).amax(dim=3).double().cpu().numpy()
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy.where(cupy.isfinite(x), cupy.abs(x), 0).max(axis=3).astype(
            np.float64).get()
    x = x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)
    return np.where(np.isfinite(x), np.abs(x), 0).max(axis=3).astype(np.float64)


def _plan_for(pb, kernel, spec, has_mask, precision, named):
    """_plan, and where it takes the tensor cores for float32, the range of the values
    (halves_range_why_not over the tensors `named`): past it "auto" takes the SIMT kernel
    (full float32), and "mma" raises ValueError saying why."""
    plan = _plan(pb, kernel, spec, has_mask, precision)
    if plan.kernel != "mma" or pb.dtype != "float32":
        return plan
    why_not = halves_range_why_not(named)
    if why_not is None:
        return plan
    if kernel == "mma":
        raise ValueError(f"kernel='mma': {why_not}")
    return Plan("simt", f"the tensor-core kernel does not apply: {why_not}", "highest")


def forward(q, k, v, *, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
            window=None, return_lse=False, num_splits=None, spec=None, kernel="auto",
            precision=None):
    """flash_attention without autograd: the kernels' launch (the arguments checked once).
    A torch call of a layout seen before replays that call's launches (replay.py)."""
    _check_kernel(kernel)
    _check_num_splits(num_splits)
    precision = resolve_precision(precision, q, kernel, _dtype_of(q))
    key = None
    halves = _dtype_of(q) == "float32" and (precision == "high" or kernel == "mma")
    if mask is None and bias is None and kv_lengths is None and spec is None and not halves:
        # (float32 on halves is not replayed: the values' range decides the kernel)
        key = replay_key(q, k, v, scale, causal, window, return_lse, num_splits, kernel,
                         precision)
        found = replay.find(key)
        if found is not None:
            return found.run((q, k, v))
    with replay.recording(key, (q, k, v)) as recorded:
        pb, io, out, lse = _begin(q, k, v, scale, causal, mask, bias, kv_lengths, window)
        if _plan_for(pb, kernel, spec, mask is not None or bias is not None, precision,
                     dict(q=q, k=k, v=v)).kernel == "mma":
            _mma_forward(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits)
        else:
            _simt_forward(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits,
                          spec)
        if recorded is not None:
            recorded.returns(out, lse, return_lse)
    return _results(io, out, lse, return_lse)


def replay_key(q, k, v, scale=None, causal=False, window=None, return_lse=False,
               num_splits=None, kernel="auto", precision="highest"):
    """The layout under which forward records and replays a call without mask, bias,
    kv_lengths or spec (replay.call_key; None: not one to replay)."""
    return replay.call_key((q, k, v), (scale, causal, window, return_lse, num_splits, kernel,
                                       precision))


def _dtype_of(x):
    """x's dtype name, as check_attention_args names it, without checking anything else."""
    return str(getattr(x, "dtype", "")).replace("torch.", "")


def _simt_forward(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits, spec):
    """The SIMT kernel (flash_fwd.py) into out and lse, split-KV merged."""
    if pb.batch * pb.heads_q * pb.n_q > 0:  # else the outputs are empty: nothing to launch
        has_mask = mask is not None or bias is not None
        # Splitting depends on the tiles only, which do not depend on splitting.
        tiles = spec or choose_spec(pb.d, pb.dv, pb.dtype, has_mask)
        blocks, _, _ = launch_grid(pb.n_q, pb.batch, pb.heads_q, tiles)
        n_splits, split_len = _splits(pb, blocks, tiles.block_n, num_splits)
        chosen = choose_spec(pb.d, pb.dv, pb.dtype, has_mask, partial=n_splits > 1)
        if spec is None:
            spec = chosen
        elif spec.d < pb.d or spec.dv < pb.dv or spec.dtype != pb.dtype \
                or spec.has_mask != has_mask or spec.partial != chosen.partial:
            raise ValueError(f"spec {spec} does not fit D={pb.d}, Dv={pb.dv}, {pb.dtype}, "
                             f"mask or bias={'yes' if has_mask else 'no'}, {n_splits} split(s)")
        mask_dev, bias_dev, lengths, steps = _side_inputs(io, pb, mask, bias, kv_lengths)
        dest = _partials(io, pb, n_splits) if n_splits > 1 else (out, lse)
        blocks, threads, n_tiles = launch_grid(pb.n_q, pb.batch, pb.heads_q, spec, n_splits)
        launch(build_kernel(spec), spec, blocks, threads, io.stream, *kernel_args(
            q=io.dev(q), k=io.dev(k), v=io.dev(v), mask=mask_dev, bias=bias_dev,
            kv_lengths=lengths, out=io.dev(dest[0]), lse=io.dev(dest[1]), n_q=pb.n_q, d=pb.d,
            dv=pb.dv, group=pb.group, heads_q=pb.heads_q, n_tiles=n_tiles,
            split_len=split_len, **_band(pb), **steps))
        if n_splits > 1:
            _merge(io, pb, dest, out, lse, n_splits)


MERGE_THREADS = 128


def _results(io, out, lse, return_lse):
    """What a forward call returns: out, or (out, lse), in the caller's array kind."""
    out, lse = io.result(out), io.result(lse)
    return (out, lse) if return_lse else out


def _check_num_splits(num_splits):
    if num_splits is not None and (isinstance(num_splits, bool)
                                   or not isinstance(num_splits, (int, np.integer))
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be None or an integer >= 1, got {num_splits!r}")


def _splits(pb, blocks, block_n, num_splits):
    """(n_splits, split_len): chosen (num_splits None) or as asked, in whole key tiles."""
    if num_splits is None:
        return choose_splits(blocks, pb.n_k, block_n, _sm_count())
    return split_layout(pb.n_k, block_n, int(num_splits))


def _partials(io, pb, n_splits):
    """Where a split-KV launch writes: float32, split s of batch b at s * B + b."""
    return (io.empty((n_splits * pb.batch, pb.heads_q, pb.n_q, pb.dv), "float32"),
            io.empty((n_splits * pb.batch, pb.heads_q, pb.n_q), "float32"))


def _merge(io, pb, dest, out, lse, n_splits):
    """out and lse from the partial results `dest` of n_splits splits (split_kv.py)."""
    elements = pb.batch * pb.heads_q * pb.n_q * pb.dv
    launch(build_merge(pb.dtype), pb.dtype, -(-elements // MERGE_THREADS), MERGE_THREADS,
           io.stream, io.dev(dest[0]), io.dev(dest[1]), io.dev(out), io.dev(lse), n_splits)


def _begin(q, k, v, scale, causal, mask, bias, kv_lengths, window):
    """(problem, io, out, lse) of a call: the arguments checked against the contract and
    this kernel's limits, the array handling for their kind, the empty outputs."""
    pb = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                              kv_lengths=kv_lengths, window=window, dtypes=DTYPES)
    if max(pb.d, pb.dv) > MAX_HEAD_DIM:
        raise ValueError(f"head dims D={pb.d}, Dv={pb.dv}: this kernel supports at most "
                         f"{MAX_HEAD_DIM}")
    io = _io_for(q, k, v, mask, bias, kv_lengths)
    out = io.empty((pb.batch, pb.heads_q, pb.n_q, pb.dv), pb.dtype)
    lse = io.empty((pb.batch, pb.heads_q, pb.n_q), "float32")
    return pb, io, out, lse


def _side_inputs(io, pb, mask, bias, kv_lengths):
    """(mask, bias, key counts) on the device, and {mask_steps, bias_steps}: the kernels'
    arguments beside q, k and v."""
    mask_dev, mask_steps = io.mask(mask)
    bias_dev, bias_steps = io.bias(bias)
    lengths = io.lengths(np.asarray(row_lengths(pb, kv_lengths), np.int32),
                         kv_lengths is not None)
    return mask_dev, bias_dev, lengths, dict(mask_steps=mask_steps, bias_steps=bias_steps)


def _band(pb):
    """The kernels' scale and band arguments: qk_scale (log2 units), left, right,
    bottom_right (the contract's key_range)."""
    return dict(qk_scale=np.float32(pb.scale * LOG2E), left=pb.left, right=pb.right,
                bottom_right=int(pb.bottom_right))


def plain_attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
                    kv_lengths=None, window=None, return_lse=False):
    """The plain kernel (plain_fwd.py: one thread per query row, for reading) with
    flash_attention's arguments, checks and array handling. Slower; no split-KV."""
    pb, io, out, lse = _begin(q, k, v, scale, causal, mask, bias, kv_lengths, window)
    if pb.batch * pb.heads_q * pb.n_q > 0:
        width = pad(max(pb.d, pb.dv))
        has_mask = mask is not None or bias is not None
        block_m = plain_tiles(width)[0]
        mask_dev, bias_dev, lengths, steps = _side_inputs(io, pb, mask, bias, kv_lengths)
        launch(plain_kernel(width, width, pb.dtype, has_mask), ("plain", width, pb.dtype),
               (-(-pb.n_q // block_m), pb.batch * pb.heads_q), block_m, io.stream,
               *kernel_args(PLAIN_ARG_NAMES, q=io.dev(q), k=io.dev(k), v=io.dev(v),
                            mask=mask_dev, bias=bias_dev, kv_lengths=lengths,
                            out=io.dev(out), lse=io.dev(lse), n_q=pb.n_q, group=pb.group,
                            **_band(pb), **steps))
    return _results(io, out, lse, return_lse)


def mma_attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
                  kv_lengths=None, window=None, return_lse=False, num_splits=None):
    """The tensor-core kernel (flash_mma.py: mma.sync, float16 and bfloat16 inputs, float32
    as float16 halves) with flash_attention's arguments, checks and array handling, split-KV
    included. Raises ValueError naming the reason where it does not apply
    (flash_mma.mma_plan)."""
    _check_num_splits(num_splits)
    pb, io, out, lse = _begin(q, k, v, scale, causal, mask, bias, kv_lengths, window)
    why_not = mma_plan(pb, mask is not None or bias is not None)
    if why_not:
        raise ValueError(f"the tensor-core kernel does not apply: {why_not}")
    _mma_forward(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits)
    return _results(io, out, lse, return_lse)


def _mma_forward(pb, io, out, lse, q, k, v, mask, bias, kv_lengths, num_splits):
    """The tensor-core kernel (flash_mma.py) into out and lse, split-KV merged: its fast
    variant, then its careful variant for the blocks the fast one deferred (a row that
    ended non-finite, or, float32, a Q or K tile holding a NaN or an inf; most often none,
    and its blocks return at once). float32 goes through halves.py's pre-pass first."""
    if pb.batch * pb.heads_q * pb.n_q > 0:
        q_tiles = -(-pb.n_q // MMA_BLOCK_M)
        n_splits, split_len = _splits(pb, q_tiles * pb.batch * pb.heads_q, MMA_BLOCK_N,
                                      num_splits)
        mask_dev, bias_dev, lengths, steps = _side_inputs(io, pb, mask, bias, kv_lengths)
        dest = _partials(io, pb, n_splits) if n_splits > 1 else (out, lse)
        deferred = io.scratch((n_splits * pb.batch, pb.heads_q, q_tiles))
        named = dict(q=io.dev(q), k=io.dev(k), v=io.dev(v))
        if pb.dtype == "float32":
            named, flags = _halves(io, named, ("q", "k", "v"))
            del flags["v_flags"]  # a V tile's NaN or inf: the careful variant's own test
        else:  # not read by the 16-bit variants
            flags = dict(q_flags=deferred, k_flags=deferred, factors=io.flat(io.dev(dest[1])))
        args = kernel_args(
            MMA_ARG_NAMES, **named, **flags, mask=mask_dev, bias=bias_dev, kv_lengths=lengths,
            deferred=deferred, out=io.dev(dest[0]), lse=io.dev(dest[1]), n_q=pb.n_q, d=pb.d,
            dv=pb.dv, group=pb.group, heads_q=pb.heads_q, split_len=split_len, **_band(pb),
            **steps)
        for careful in (False, True):
            spec = MmaSpec(pad_mma(pb.d), pad_mma(pb.dv), pb.dtype,
                           mask is not None or bias is not None, n_splits > 1, careful)
            launch(mma_kernel(spec), spec, (q_tiles, pb.batch * pb.heads_q, n_splits), 128,
                   io.stream, *args, shared=spec.dynamic_shared_bytes)
        if n_splits > 1:
            _merge(io, pb, dest, out, lse, n_splits)


def _halves(io, named, names=SLOTS):
    """(named with the tensors `names` (of q, k, v, dout) as float16 halves on the device
    (2B, H, N, W): hi at b, lo at B + b; {x_flags} of each, and the scales' `factors`), from
    halves.py's pre-pass: one absmax launch for them all, a split launch each. No wait for
    the host. The forward and the backward split q and k alike: the same halves."""
    assert names == SLOTS[:len(names)], names  # blockIdx.y and `slot` index SLOTS
    largest = max(int(np.prod(named[n].shape)) for n in names)
    blocks = max(1, min(ABS_BLOCKS, -(-largest // HALVES_THREADS)))  # each a stride of them
    partial = io.dev(io.empty((len(SLOTS), blocks), "float32"))
    factors = io.dev(io.empty((2 * len(SLOTS),), "float32"))
    spec = HalvesSpec("absmax")  # rows of partial past len(names) are not written
    tensors = [io.flat(named[n]) for n in names]
    launch(halves_kernel(spec), spec, (blocks, len(names)), HALVES_THREADS, io.stream,
           *(tensors + tensors[-1:] * (len(SLOTS) - len(names))), partial)
    named, flags, spec = dict(named), {"factors": factors}, HalvesSpec("split")
    for slot, name in enumerate(names):
        x = named[name]
        batch, heads, rows, width = x.shape
        tiles = -(-rows // FLAG_ROWS)
        named[name] = io.dev(io.empty((2 * batch, heads, rows, width), "float16"))
        flags[f"{name}_flags"] = io.scratch((batch, heads, max(tiles, 1)))
        if batch * heads * rows:
            launch(halves_kernel(spec), spec, (tiles, batch * heads), HALVES_THREADS,
                   io.stream, x, named[name], partial, factors, flags[f"{name}_flags"], slot)
    return named, flags


def _sm_count():
    """Streaming multiprocessors of the current device (the simulator pretends one)."""
    if SIMULATOR:
        return 1
    device = cuda.get_current_device()
    count = _SM_COUNTS.get(device.id)
    if count is None:
        count = _SM_COUNTS[device.id] = device.MULTIPROCESSOR_COUNT
    return count


_SM_COUNTS = {}  # device id -> SMs (an attribute query to the driver each time otherwise)


def _kind(x):
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return "torch"
    if module == "numpy":
        return "numpy"
    if hasattr(x, "__cuda_array_interface__") or hasattr(x, "copy_to_host"):
        return "cuda"  # CuPy, Numba device arrays (and the simulator's)
    raise TypeError(f"expected NumPy arrays, torch CUDA tensors or CUDA arrays, got {type(x)}")


def _io_for(q, k, v, mask, bias, kv_lengths):
    kinds = {name: _kind(x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(kinds.values())) != 1:
        raise TypeError(f"q, k and v must be the same kind of array, got {kinds}")
    kind = kinds["q"]
    if kind == "torch":
        for name, x in (("q", q), ("k", k), ("v", v), ("mask", mask), ("bias", bias),
                        ("kv_lengths", kv_lengths)):
            if x is not None and not x.is_cuda:
                raise TypeError(f"{name} is a CPU tensor: pass CUDA tensors, or NumPy arrays "
                                f"(copied to the device and back)")
            if x is not None and x.device != q.device:
                raise ValueError(f"{name} is on {x.device} and q on {q.device}: pass tensors "
                                 f"on one device")
    if not cuda.is_available():
        raise RuntimeError(NO_DEVICE)
    if kind == "cuda":
        cupy_inputs = type(q).__module__.startswith("cupy")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not cupy_inputs and not _device_array(x).is_c_contiguous():
                raise ValueError(f"{name}: {STRIDED_DEVICE_ARRAY}")
        return _CudaIO(cupy_inputs)
    if kind == "torch":
        return _TorchIO(q.device)
    return _NumpyIO()


class _NumpyIO:
    """Host arrays: copied to the device, results copied back."""

    stream = 0

    def dev(self, x):
        if isinstance(x, _Pending):
            return x.device
        return cuda.to_device(np.ascontiguousarray(transported(x)))  # bfloat16: int16 bits

    def empty(self, shape, dtype):
        return _Pending(shape, dtype)

    def scratch(self, shape):
        """uint8 on the device, for the kernels' own use: never copied back."""
        return cuda.device_array(shape, np.uint8)

    @staticmethod
    def words(x):
        """The memory of x (from dev: C-contiguous 16-bit values, an even last dim) as flat
        int32 words, no copy: the pre-pass reads two values a load."""
        return x.view(np.int32).reshape(x.size // 2)

    @staticmethod
    def flat(x):
        """x (from dev: C-contiguous) as one dimension, no copy."""
        return x.reshape(x.size)

    def mask(self, mask):
        if mask is None:
            return cuda.to_device(np.ones((1, 1, 1, 1), np.uint8)), (0, 0, 0, 0)
        m = _as4d(np.asarray(mask))
        return cuda.to_device(np.ascontiguousarray(m).view(np.uint8)), _steps(m.shape)

    def bias(self, bias):
        if bias is None:
            return cuda.to_device(np.zeros((1, 1, 1, 1), np.float32)), (0, 0, 0, 0)
        x = _as4d(np.asarray(bias))
        return cuda.to_device(np.ascontiguousarray(x, dtype=np.float32)), _steps(x.shape)

    def lengths(self, host, given):
        return cuda.to_device(host)

    def result(self, x):
        return x.fetch()


class _Pending:
    """An output buffer on the device, to be copied back into a host array of `dtype`."""

    def __init__(self, shape, dtype):
        self.dtype = dtype
        self.device = cuda.device_array(shape, TRANSPORT[dtype])

    def fetch(self):
        return self.device.copy_to_host().view(numpy_dtype(self.dtype))


class _TorchIO:
    """torch CUDA tensors, zero copy, on torch's current stream and device. They go to the
    kernel as tensors (launch.py takes their pointers); the all-true mask and the key counts
    of calls without kv_lengths are made once per device and size, and kept."""

    _streams = {}  # CUstream address -> Numba external stream
    _constants = {}  # (device, what) -> tensor

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device
        handle = torch.cuda.current_stream(device).cuda_stream
        self.stream = self._streams.get(handle)
        if self.stream is None:
            self.stream = self._streams[handle] = cuda.external_stream(handle)

    def dev(self, x):
        # Strided inputs are copied contiguous: every kernel variant then has one compiled
        # version, for C-contiguous arrays, which the disk cache and warm-up cover
        # (compile_cache.py), where q, k and v being C-, F- or any-layout would be 27.
        return transported(x.detach().contiguous())

    def empty(self, shape, dtype):
        return replay.allocated(self.torch.empty(shape, dtype=getattr(self.torch, dtype),
                                                 device=self.device))

    def scratch(self, shape):
        return replay.allocated(self.torch.empty(shape, dtype=self.torch.uint8,
                                                 device=self.device))

    def words(self, x):
        return x.view(self.torch.int32).reshape(-1)

    @staticmethod
    def flat(x):
        return x.reshape(-1)

    def mask(self, mask):
        if mask is None:
            return self._constant("no mask", lambda: self.torch.ones(
                (1, 1, 1, 1), dtype=self.torch.uint8, device=self.device)), (0, 0, 0, 0)
        m = _as4d(mask)
        return m.contiguous().view(self.torch.uint8), _steps(m.shape)

    def bias(self, bias):
        if bias is None:
            return self._constant("no bias", lambda: self.torch.zeros(
                (1, 1, 1, 1), dtype=self.torch.float32, device=self.device)), (0, 0, 0, 0)
        x = _as4d(bias)
        return x.to(self.torch.float32).contiguous(), _steps(x.shape)

    def lengths(self, host, given):
        if given:
            return self.torch.as_tensor(host, device=self.device)
        return self._constant(("lengths",) + tuple(host), lambda: self.torch.as_tensor(
            host, device=self.device))

    def _constant(self, what, make):
        key = (self.device, what)
        x = self._constants.get(key)
        if x is None:
            x = self._constants[key] = make()
        return replay.kept(x)

    def result(self, x):
        return x


class _CudaIO(_NumpyIO):
    """CuPy or Numba device arrays (__cuda_array_interface__), zero copy, default stream.
    Results come back as CuPy arrays when the inputs were CuPy arrays."""

    def __init__(self, cupy_inputs):
        self.cupy_inputs = cupy_inputs

    def dev(self, x):
        if isinstance(x, _Pending):
            return x.device
        if type(x).__module__.startswith("cupy"):  # strided: copied, as for torch
            import cupy

            x = cupy.ascontiguousarray(x)
        x = _device_array(x)
        if not x.is_c_contiguous():
            raise ValueError(f"an array of shape {tuple(x.shape)}: {STRIDED_DEVICE_ARRAY}")
        return x

    def mask(self, mask):
        if mask is None:
            return super().mask(None)
        m = _as4d(self.dev(mask))
        return m.view(np.uint8), _steps(m.shape)

    def bias(self, bias):
        if bias is None or type(bias).__module__.split(".")[0] == "numpy":
            return super().bias(None if bias is None else bias)
        import cupy

        x = _as4d(cupy.asarray(bias))
        return cuda.as_cuda_array(cupy.ascontiguousarray(x, dtype=cupy.float32)), \
            _steps(x.shape)

    def result(self, x):
        if self.cupy_inputs:
            import cupy

            return cupy.asarray(x.device)
        return x.device


STRIDED_DEVICE_ARRAY = ("a strided Numba device array; pass it C-contiguous (torch and CuPy "
                        "arrays are copied contiguous, other device arrays are not)")


def _device_array(x):
    """A Numba device array of a CUDA array (the simulator's own arrays are already one)."""
    return cuda.as_cuda_array(x) if hasattr(cuda, "as_cuda_array") and hasattr(
        x, "__cuda_array_interface__") else x


def _as4d(x):
    """A broadcastable mask or bias with its missing leading dimensions as size 1."""
    return x.reshape((1,) * (4 - len(x.shape)) + tuple(x.shape))


def _steps(shape):
    """Index multipliers that broadcast a 4-D mask: 0 along its size-1 dimensions."""
    return tuple(0 if n == 1 else 1 for n in shape)
