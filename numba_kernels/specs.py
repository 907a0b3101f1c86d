"""Which compiled variant serves a call, the launch grid, and the variants we ship.

Tile sizes are bounded by static shared memory (48 KB a block, see KernelSpec.shared_bytes):
the Q tile and the K tile are D words per row, so larger head dims take smaller tiles.
"""
from functools import lru_cache

from numba import cuda, float32, int16, int32, int64, uint8
from numba.types import float16

from .convert import CONVERTERS, SIMULATOR
from .flash_fwd import FASTMATH, KernelSpec, kernel_source

MAX_HEAD_DIM = 256
# D and Dv are zero-padded up to the next of these (the padding costs FLOPs, not accuracy).
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)
DTYPES = ("float32", "float16", "bfloat16")

# padded D up to -> (BLOCK_M, BLOCK_N, THREADS_M, THREADS_N)
# The fastest tiles of benchmarks/attention_speed.py --sweep on an H200 whose every variant
# (dtype, mask) compiles without spills or local memory (PERF.md: 64x32 with 8x8 threads and
# 64x16 with 16x4 are faster unmasked in float32, but spill in masked and bfloat16 variants).
TILES = [
    (64, (64, 32, 16, 8)),
    (128, (32, 32, 8, 8)),
    (256, (16, 16, 4, 16)),  # TV = 16 output columns a thread: 32 would spill
]


def pad(n):
    return next(d for d in HEAD_DIMS if d >= n)


def choose_spec(d, dv, dtype, has_mask):
    """The variant for head dims d, dv (unpadded), input dtype, and whether a mask is given.

    D and Dv are padded to one common size, so that the variants a call can select are exactly
    shipped_specs() (72 of them, each compiled once per process at its first launch)."""
    width = pad(max(d, dv))
    tiles = next(t for limit, t in TILES if width <= limit)
    return KernelSpec(width, width, dtype, has_mask, *tiles).check()


def shipped_specs():
    """Every variant a call can select: CI compiles each of them for sm_90."""
    return [choose_spec(d, d, dtype, has_mask)
            for d in HEAD_DIMS for dtype in DTYPES for has_mask in (False, True)]


_NUMBA_TYPES = {"float32": float32, "float16": float16, "int16": int16}


def signature(spec):
    """Argument types of the kernel for `spec` (any-layout arrays: strided inputs are fine)."""
    elem = _NUMBA_TYPES[CONVERTERS[spec.dtype][2]]
    arr4 = elem[:, :, :, :]
    return (arr4, arr4, arr4, uint8[:, :, :, :], int32[:], arr4, float32[:, :, :],
            int64, int64, int64, int64, int64, int64, float32, int64, int64, int64,
            int64, int64, int64, int64)


@lru_cache(maxsize=None)
def build_kernel(spec):
    """The kernel for `spec`. Numba compiles it at the first launch for the argument types it
    sees (contiguous or strided arrays) and keeps each compiled version for the process."""
    fn = kernel_source(spec)
    if SIMULATOR:  # the simulator takes neither fastmath nor max_registers
        return cuda.jit(fn)
    return cuda.jit(fastmath=FASTMATH, max_registers=spec.max_registers or None)(fn)


def launch_grid(n_q, batch, heads_q, spec):
    """(blocks, threads_per_block, n_tiles): one block per (query tile, batch, head), 1-D."""
    n_tiles = -(-n_q // spec.block_m)
    blocks = n_tiles * batch * heads_q
    if blocks >= 2**31:
        raise ValueError(f"{blocks} thread blocks exceed the grid limit 2**31 - 1")
    return blocks, spec.threads, n_tiles


def compile_ptx(spec, cc=(9, 0)):
    """PTX of `spec` for compute capability cc, compiled on any machine (no GPU needed).
    A register cap (spec.max_registers) is ptxas's -maxrregcount, applied after this."""
    return cuda.compile_ptx(kernel_source(spec), signature(spec), cc=cc, fastmath=FASTMATH)[0]
