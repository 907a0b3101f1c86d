"""Which compiled variant serves a call, the launch grid, and the variants we ship.

Tile sizes are bounded by static shared memory (48 KB a block, see KernelSpec.shared_bytes):
the Q tile and the K tile are D words per row, so larger head dims take smaller tiles.
"""
from functools import lru_cache

from numba import boolean, cuda, float32, int16, int32, int64, uint8
from numba.types import UniTuple, float16

from reference.dtypes import KERNEL_DTYPES
from .block_sparse import (BlocksSpec, ClassesSpec, ListsSpec, blocks_kernel, blocks_source,
                           classes_kernel, classes_source, lists_kernel, lists_source)
from .compile_cache import jit
from .convert import CONVERTERS
from .flash_bwd import (TUNED_DKDV_ARGS, TUNED_DQ_ARGS, BwdSpec, bwd_kernel_source,
                        bwd_specs)
from .common import ARGS, FASTMATH
from .flash_fwd import KernelSpec, kernel_source
from .flash_mma import MMA_ARGS, MmaSpec, mma_kernel, mma_specs
from .mma_parts import BLOCK_M as MMA_BLOCK_M, BLOCK_N as MMA_BLOCK_N
from .flash_mma import kernel_source as mma_kernel_source
from .flash_wgmma import KEYS as WGMMA_KEYS, WgmmaSpec, wgmma_kernel, wgmma_specs
from .flash_wgmma import kernel_source as wgmma_kernel_source
from .flash_wgmma_bwd import (WgmmaBwdSpec, wgmma_bwd_kernel, wgmma_bwd_source,
                              wgmma_bwd_specs)
from .flash_mma_bwd import (BLOCK as MMA_BWD_BLOCK, MMA_DKDV_ARGS, MMA_DQ_ARGS, MmaBwdSpec,
                            ScanSpec, mma_bwd_kernel, mma_bwd_source, mma_bwd_specs,
                            scan_kernel, scan_source)
from .halves import HalvesSpec, absmax_source, halves_kernel, halves_specs, split_source
from .plain_bwd import (DELTA_ARGS, DKDV_ARGS, DQ_ARGS, PlainBwdSpec, plain_bwd_kernel,
                        plain_bwd_specs)
from .plain_bwd import bwd_kernel_source as plain_bwd_source
from .plain_fwd import PLAIN_ARGS, PlainSpec, plain_kernel, plain_kernel_source, plain_specs
from .split_kv import merge_source

MAX_HEAD_DIM = 256
# D and Dv are zero-padded up to the next of these (the padding costs FLOPs, not accuracy).
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
DTYPES = KERNEL_DTYPES

# padded width -> tiles (BLOCK_M, BLOCK_N, THREADS_M, THREADS_N), without and with a mask.
# The fastest tiles of benchmarks/attention_speed.py --sweep on an H200 (PERF.md) where every
# variant compiles without spills or local memory (python -m numba_kernels.ptx_report, a CI
# gate). These kernels sit at the 255-register limit, so a tile that compiles clean in one
# variant can spill in another (the mask's indexing, bfloat16's conversions): where the
# fastest tiles spilled, the table takes the next fastest that do not.
_NARROW = (64, 32, 16, 8)  # TM = 4
_DEEP = (64, 16, 16, 4)  # TM = 4, TN = 4; width / 4 output columns a thread
_SMALL = (32, 32, 8, 8)
_TILE = (16, 16, 4, 16)  # above 128 only 16 x 16 fits in 48 KB
TILES = {
    16: (_NARROW, _NARROW),
    32: (_NARROW, _SMALL),
    48: (_NARROW, _SMALL),  # masked float16 spills 24 B with _NARROW since the bias
    64: (_NARROW, _NARROW),
    80: (_DEEP, _DEEP),
    96: (_SMALL, _SMALL),
    112: (_DEEP, _SMALL),
    128: (_DEEP, _SMALL),
    160: (_TILE, _TILE),
    192: (_TILE, _TILE),
    224: (_TILE, _TILE),
    256: (_TILE, _TILE),
}
assert tuple(TILES) == HEAD_DIMS
# (padded width, dtype, has_mask) -> KernelSpec (qk_load_batch, v_load_batch) where they are
# not the default (8, 8). Measured (PERF.md, v10 to v12): at width 128 the compiler keeps the
# 16-bit V loader's four batches of 8 in a loop, each waiting for global memory. Batches of 16
# for Q, K and V made float16 9% faster there (and width 64 in float16 5% slower). bfloat16
# spills with all three at 16; with V alone at 16 it compiles clean and runs 6% faster (0.938
# of v11), while float16 with Q and K back at 8 runs 6% slower.
LOAD_BATCH = {(128, "float16", False): (16, 16), (128, "bfloat16", False): (8, 16)}


def pad(n):
    return next(d for d in HEAD_DIMS if d >= n)


@lru_cache(maxsize=4096)
def choose_spec(d, dv, dtype, has_mask, partial=False):
    """The variant for head dims d, dv (unpadded), input dtype, whether a mask or a bias is
    given (has_mask), and whether it writes float32 partial results for split-KV
    (split_kv.py).

    D and Dv are padded to one common size, so that the variants a call can select are exactly
    shipped_specs(), each compiled once per process at its first launch. In float32 the
    partial results are the output itself: one variant serves both."""
    width = pad(max(d, dv))
    tiles = TILES[width][has_mask]
    qk_batch, v_batch = LOAD_BATCH.get((width, dtype, has_mask), (8, 8))
    return KernelSpec(width, width, dtype, has_mask, *tiles,
                      partial=partial and dtype != "float32", qk_load_batch=qk_batch,
                      v_load_batch=v_batch).check()


def gate_specs():
    """Every variant a call can launch, of every kernel: what the PTX gate compiles (the
    plain kernels and the delta kernel at each padded width pad() gives, the merges by dtype)."""
    return (shipped_specs() + list(DTYPES) + plain_specs(HEAD_DIMS) + plain_bwd_specs(HEAD_DIMS)
            + bwd_specs() + mma_specs() + wgmma_specs() + mma_bwd_specs() + wgmma_bwd_specs()
            + classes_specs())


def classes_specs():
    """The tile-class pre-passes (block_sparse.py) at the tile sizes of the kernels that read
    a mask (each masked SIMT forward variant's, the tensor-core forward's and dQ kernel's,
    the tensor-core dK, dV kernel's), and the pre-passes that make their classes into visible
    lists, by query tile and by key tile."""
    sizes = {(s.block_m, s.block_n) for s in shipped_specs() if s.has_mask}
    sizes |= {(MMA_BLOCK_M, MMA_BLOCK_N), (MMA_BLOCK_M, WGMMA_KEYS)}
    sizes |= {s.tiles[:2] for s in bwd_specs() if s.has_mask}
    sizes |= {(s.qb, MMA_BWD_BLOCK) for s in mma_bwd_specs()
              if isinstance(s, MmaBwdSpec) and s.has_mask}
    sizes |= {s.tiles for s in wgmma_bwd_specs() if s.has_mask}
    return [ClassesSpec(m, n, words) for m, n in sorted(sizes) for words in (False, True)] + [
        ListsSpec(transposed) for transposed in (False, True)] + [
        BlocksSpec(expand) for expand in (False, True)]


def shipped_specs():
    """Every variant a call can select: CI compiles each of them for sm_90."""
    return [choose_spec(d, d, dtype, has_mask, partial)
            for d in HEAD_DIMS for dtype in DTYPES for has_mask in (False, True)
            for partial in ((False, True) if dtype != "float32" else (False,))]


_NUMBA_TYPES = {"float32": float32, "float16": float16, "int16": int16}


def signature(spec):
    """Argument types of the kernel for `spec`, from its ARGS: what every launch passes (every
    array C-contiguous: arrays.py makes them so), for compile_ptx and warm.py."""
    elem = _NUMBA_TYPES[CONVERTERS[spec.dtype][2]]
    return arg_types(ARGS, elem, float32 if spec.partial else elem)


def arg_types(args, elem, out_elem):
    """The Numba type of each (name, kind, meaning) of a kernel's ARGS, for input elements
    `elem` and output elements `out_elem`, arrays C-contiguous."""
    def array(t, ndim):  # t[:, :, ::1]; t[::1] in one dimension (a 1-tuple would be F)
        last = slice(None, None, 1)
        return t[(slice(None),) * (ndim - 1) + (last,)] if ndim > 1 else t[last]

    kinds = {"input": array(elem, 4), "output": array(out_elem, 4), "mask": array(uint8, 4),
             "visible": array(int32, 4),
             "bias": array(float32, 4), "lengths": array(int32, 1), "lse": array(float32, 3),
             "flags": array(uint8, 3), "factors": array(float32, 1),
             "int": int64, "float": float32, "steps": UniTuple(int64, 4)}
    return tuple(kinds[kind] for _, kind, _ in args)


def plain_signature(spec):
    """Argument types of the plain kernel (plain_fwd.py), C-contiguous arrays."""
    elem = _NUMBA_TYPES[CONVERTERS[spec.dtype][2]]
    return arg_types(PLAIN_ARGS, elem, elem)


def plain_bwd_signature(spec):
    """Argument types of a plain backward kernel (plain_bwd.py), C-contiguous arrays."""
    elem = _NUMBA_TYPES[CONVERTERS[spec.dtype][2]]
    args = {"delta": DELTA_ARGS, "dkdv": DKDV_ARGS, "dq": DQ_ARGS}[spec.part]
    return arg_types(args, elem, elem)


def mma_signature(spec):
    """Argument types of the tensor-core kernel (flash_mma.py), C-contiguous arrays: float32
    inputs arrive as float16 halves (halves.py)."""
    elem = _NUMBA_TYPES[CONVERTERS[spec.dtype][2]]
    return arg_types(MMA_ARGS, float16 if spec.halves else elem,
                     float32 if spec.partial else elem)


def scan_signature(spec):
    """Argument types of the tensor-core backward's pre-pass (flash_mma_bwd.scan_source)."""
    return (int32[::1], uint8[:, :, ::1], int64, int64)


def mma_bwd_signature(spec):
    """Argument types of a tensor-core backward kernel (flash_mma_bwd.py): float32 inputs
    arrive as float16 halves (halves.py); the gradients leave in spec.grads_dtype."""
    elem = _NUMBA_TYPES[CONVERTERS[spec.dtype][2]]
    args = MMA_DQ_ARGS if spec.part == "dq" else MMA_DKDV_ARGS  # dkdv, dk, dv
    return arg_types(args, float16 if spec.halves else elem,
                     _NUMBA_TYPES[CONVERTERS[spec.grads_dtype][2]])


def classes_signature(spec):
    """Argument types of the tile-class pre-pass (block_sparse.classes_source)."""
    mask = int32[:, :, :, ::1] if spec.words else uint8[:, :, :, ::1]
    return (mask, UniTuple(int64, 4), int64, int64, uint8[:, :, :, ::1])


def blocks_signature(spec):
    """Argument types of a block mask's pre-passes (block_sparse.blocks_source)."""
    table, steps = uint8[:, :, :, ::1], UniTuple(int64, 4)
    if spec.expand:
        return (table, steps, int64, int64, table, steps, table)
    return (table, steps, int64, int64, boolean, table)


def lists_signature(spec):
    """Argument types of the visible-list pre-pass (block_sparse.lists_source)."""
    return (uint8[:, :, :, ::1], int32[:, :, :, ::1])


def halves_signature(spec):
    """Argument types of the halves' pre-pass kernels (halves.py)."""
    flat = float32[::1]
    if spec.part == "absmax":
        return (flat, flat, flat, flat, float32[:, ::1])
    return (float32[:, :, :, ::1], float16[:, :, :, ::1], float32[:, ::1], flat,
            uint8[:, :, ::1], int64)


def tuned_bwd_signature(spec):
    """Argument types of a tuned backward kernel (flash_bwd.py), C-contiguous arrays."""
    elem = _NUMBA_TYPES[CONVERTERS[spec.dtype][2]]
    return arg_types(TUNED_DKDV_ARGS if spec.part == "dkdv" else TUNED_DQ_ARGS, elem, elem)


def merge_signature(dtype):
    out4 = _NUMBA_TYPES[CONVERTERS[dtype][2]][:, :, :, ::1]
    return (float32[:, :, :, ::1], float32[:, :, ::1], out4, float32[:, :, ::1], int64)


@lru_cache(maxsize=None)
def build_kernel(spec):
    """The kernel for `spec`. Numba compiles it at the first launch for the argument types it
    sees (or loads it from the disk cache, compile_cache.py) and keeps each compiled version
    for the process: one for C-contiguous arrays (torch and CuPy inputs are made contiguous:
    arrays.py), one more if other strided device arrays come."""
    return jit(kernel_source(spec), spec, FASTMATH)


@lru_cache(maxsize=None)
def tuned_bwd_kernel(spec):
    """The tuned backward kernel of BwdSpec `spec` (flash_bwd.py)."""
    return jit(bwd_kernel_source(spec), spec, FASTMATH)


@lru_cache(maxsize=None)
def build_merge(dtype):
    """The split-KV merge kernel writing outputs of `dtype`."""
    return jit(merge_source(dtype), ("merge", dtype), FASTMATH)


def _variant(spec):
    """(source, kernel, argument types) of any variant gate_specs() lists: makers of the
    Python function it is compiled from and of the dispatcher a launch uses (through the
    disk cache), and the types every launch passes. The one place a spec's kind is told."""
    w = getattr(spec, "width", None)
    if isinstance(spec, str):  # a merge kernel, by dtype
        return (lambda: merge_source(spec), lambda: build_merge(spec), merge_signature(spec))
    if isinstance(spec, PlainSpec):
        args = (w, w, spec.dtype, spec.has_mask)
        return (lambda: plain_kernel_source(*args), lambda: plain_kernel(*args),
                plain_signature(spec))
    if isinstance(spec, PlainBwdSpec):
        args = (spec.part, w, w, spec.dtype, spec.has_mask)
        return (lambda: plain_bwd_source(*args), lambda: plain_bwd_kernel(*args),
                plain_bwd_signature(spec))
    if isinstance(spec, BwdSpec):
        return (lambda: bwd_kernel_source(spec), lambda: tuned_bwd_kernel(spec),
                tuned_bwd_signature(spec))
    if isinstance(spec, MmaBwdSpec):
        return (lambda: mma_bwd_source(spec), lambda: mma_bwd_kernel(spec),
                mma_bwd_signature(spec))
    if isinstance(spec, WgmmaBwdSpec):  # flash_mma_bwd's arguments
        return (lambda: wgmma_bwd_source(spec), lambda: wgmma_bwd_kernel(spec),
                mma_bwd_signature(spec))
    if isinstance(spec, MmaSpec):
        return (lambda: mma_kernel_source(spec), lambda: mma_kernel(spec),
                mma_signature(spec))
    if isinstance(spec, WgmmaSpec):  # flash_mma's arguments
        return (lambda: wgmma_kernel_source(spec), lambda: wgmma_kernel(spec),
                mma_signature(spec))
    if isinstance(spec, ScanSpec):
        return (lambda: scan_source(spec), lambda: scan_kernel(spec), scan_signature(spec))
    if isinstance(spec, ClassesSpec):
        return (lambda: classes_source(spec), lambda: classes_kernel(spec),
                classes_signature(spec))
    if isinstance(spec, ListsSpec):
        return (lambda: lists_source(spec), lambda: lists_kernel(spec), lists_signature(spec))
    if isinstance(spec, BlocksSpec):
        return (lambda: blocks_source(spec), lambda: blocks_kernel(spec),
                blocks_signature(spec))
    if isinstance(spec, HalvesSpec):
        source = absmax_source if spec.part == "absmax" else split_source
        return (source, lambda: halves_kernel(spec), halves_signature(spec))
    return (lambda: kernel_source(spec), lambda: build_kernel(spec), signature(spec))


def compiled(spec):
    """(kernel, argument types) of any variant gate_specs() lists, for warm.py."""
    _, kernel, types = _variant(spec)
    return kernel(), types


def variants(forward, backward=None):
    """The variants calls of one of our implementations can launch, for warming the cache
    before a run: forward "simt" (flash_attention(kernel="simt")), "plain", "mma" or "wgmma",
    with the split-KV merges; backward None, "plain", "tuned", "mma" or "wgmma" (with the
    delta kernel; "mma" and "wgmma" with the pre-pass that flags tiles holding a NaN or an
    inf; "wgmma" with mma's, whose nonfinite variants it launches)."""
    fwd = {"simt": shipped_specs() + classes_specs(), "plain": plain_specs(HEAD_DIMS),
           "mma": mma_specs() + halves_specs() + classes_specs(),
           "wgmma": wgmma_specs() + [s for s in mma_specs() if s.careful] + classes_specs()}
    bwd = [] if backward is None else [s for s in plain_bwd_specs(HEAD_DIMS)
                                       if s.part == "delta" or backward == "plain"]
    if backward == "tuned":
        bwd += bwd_specs()
    if backward in ("mma", "wgmma"):
        bwd += mma_bwd_specs()
    if backward == "wgmma":
        bwd += wgmma_bwd_specs()
    return list(dict.fromkeys(fwd[forward] + list(DTYPES) + bwd))  # in order, once each


def launch_grid(n_q, batch, heads_q, spec, n_splits=1):
    """(blocks, threads_per_block, n_tiles): one block per (split, batch, head, query tile)."""
    n_tiles = -(-n_q // spec.block_m)
    blocks = n_splits * n_tiles * batch * heads_q
    if blocks >= 2**31:
        raise ValueError(f"{blocks} thread blocks exceed the grid limit 2**31 - 1")
    return blocks, spec.threads, n_tiles


def compile_ptx(spec, cc=(9, 0)):
    """PTX of any variant gate_specs() lists, with the argument types every launch passes,
    for compute capability cc, compiled on any machine (no GPU needed) inside
    numba_internals.compiling_for(cc): for the ptxas report (ptx_report.py), in processes of
    its own."""
    source, _, types = _variant(spec)
    return cuda.compile_ptx(source(), types, cc=getattr(spec, "cc", cc), fastmath=FASTMATH,
                            launch_bounds=getattr(spec, "launch_bounds", None))[0]
