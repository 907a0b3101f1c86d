"""Block sparsity on the device: a mask's tile classes (reference/blocks.py: SKIP, PARTIAL,
FULL) made by a pre-pass kernel at a kernel's own tile sizes, and the walk of a key loop over
the tiles they do not skip.

The forward kernels with a mask read one byte a key tile: a tile that no row sees costs that
byte, and a tile every row sees by the mask reads no mask (the band and kv_lengths are still
tested there). The SIMT forward walks the visible tiles alone (a `while` on visible_from);
the tensor-core forward keeps its `for` over the band's tiles and passes over the skipped
ones (skipped), prefetching the next visible one: in each kernel the form ptxas compiles
without spills (docs/design/block_sparse.md). Below the kernels; imports none of them.
"""
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda

from reference.blocks import FULL, PARTIAL, SKIP
from .common import FASTMATH, kernel_part
from .compile_cache import jit
from .convert import int64

CLASS_THREADS = 128  # threads of a pre-pass block: one block a tile


@dataclass(frozen=True)
class ClassesSpec:
    """The pre-pass for tiles of block_m query rows by block_n keys; words: the mask read as
    int32 words of four keys (a mask whose last dimension is the keys, a multiple of 4, and
    4-byte aligned: prepass.mask_words), else a byte a load."""

    block_m: int
    block_n: int
    words: bool = False

    @property
    def span(self):
        """Keys a load reads."""
        return 4 if self.words else 1


def classes_source(spec):
    """The pre-pass kernel: one block per (key tile, query tile, (batch, head) of the classes),
    each thread testing every CLASS_THREADS-th load of its tile (a byte, or a word of four
    keys), the loads of a warp side by side in memory."""
    BLOCK_M, SPAN = spec.block_m, spec.span
    LOADS_N = spec.block_n // SPAN  # loads a row of the tile
    LOADS = -(-BLOCK_M * LOADS_N // CLASS_THREADS)  # loads a thread, unrolled
    assert spec.block_n % SPAN == 0, spec

    def tile_classes(mask, mask_steps, n_q, n_k, classes):
        """classes[cb, ch, i, j] (shape (B or 1, Hq or 1, query tiles, key tiles)) of mask
        (uint8, or int32 words of four keys; its broadcast dimensions' steps 0 in
        mask_steps) over the pairs of tile (i, j) inside the n_q x n_k plane."""
        n_tile, m_tile = int64(cuda.blockIdx.x), int64(cuda.blockIdx.y)
        heads = classes.shape[1]
        cb, ch = int64(cuda.blockIdx.z) // heads, int64(cuda.blockIdx.z) % heads
        tid = cuda.threadIdx.x
        some, every = 0, 1
        for i in range(LOADS):
            p = tid + i * CLASS_THREADS
            row, at = m_tile * BLOCK_M + p // LOADS_N, n_tile * LOADS_N + p % LOADS_N
            if p < BLOCK_M * LOADS_N and row < n_q and at * SPAN < n_k:
                x = mask[cb * mask_steps[0], ch * mask_steps[1], row * mask_steps[2],
                         at * mask_steps[3]]
                if x != 0:
                    some = 1
                if SPAN == 1:
                    if x == 0:
                        every = 0
                elif ((x & 0xFF) == 0 or (x >> 8) & 0xFF == 0 or (x >> 16) & 0xFF == 0
                      or (x >> 24) & 0xFF == 0):
                    every = 0
        some = cuda.syncthreads_or(some)
        every = cuda.syncthreads_and(every)
        if tid == 0:
            classes[cb, ch, m_tile, n_tile] = FULL if some and every else (
                PARTIAL if some else SKIP)

    return tile_classes


@lru_cache(maxsize=8)
def classes_kernel(spec):
    """The compiled pre-pass of a ClassesSpec (through the on-disk compile cache)."""
    return jit(classes_source(spec), ("classes", spec.block_m, spec.block_n, spec.words),
               FASTMATH)


def make_tile_walk(HAS_MASK, BLOCK_N):
    @kernel_part
    def visible_from(classes, cb, ch, tile, start_n, last):
        """The first key tile from start_n (a multiple of BLOCK_N) before `last` that the
        classes of query tile `tile` do not skip, or `last`; start_n itself without a
        mask."""
        if HAS_MASK:
            while start_n < last and classes[cb, ch, tile, start_n // BLOCK_N] == SKIP:
                start_n += BLOCK_N
        return start_n

    @kernel_part
    def skipped(classes, cb, ch, tile, start_n):
        """Whether the classes of query tile `tile` skip the key tile from start_n (never
        without a mask)."""
        return HAS_MASK and classes[cb, ch, tile, start_n // BLOCK_N] == SKIP

    @kernel_part
    def reads_mask(classes, cb, ch, tile, start_n):
        """Whether the key tile from start_n needs the mask read pair by pair (PARTIAL): a
        FULL tile is visible by the mask wherever the band lets a row see."""
        return HAS_MASK and classes[cb, ch, tile, start_n // BLOCK_N] != FULL

    return visible_from, skipped, reads_mask
