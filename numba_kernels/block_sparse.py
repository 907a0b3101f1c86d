"""Block sparsity on the device: a mask's tile classes (reference/blocks.py: SKIP, PARTIAL,
FULL) made by a pre-pass kernel at a kernel's own tile sizes, each query tile's classes made
into its list of visible key tiles by a second pre-pass (reference.blocks.visible_lists), and
the walk of a forward kernel's key loop over that list.

A forward kernel with a mask steps through its query tile's list: a tile that no row sees
costs nothing (it is not in the list), and a tile every row sees by the mask reads no mask
(the band and kv_lengths are still tested there). The steps are independent loads of a short
list, not a scan of every key tile's class (docs/design/block_sparse.md). Below the kernels;
imports none of them.
"""
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda

from reference.blocks import FULL, PARTIAL, SKIP
from .common import FASTMATH, kernel_part
from .compile_cache import jit
from .convert import int64

CLASS_THREADS = 128  # threads of a pre-pass block: one block a tile
LIST_THREADS = 128  # threads of a block of the second pre-pass: one a query tile


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


@dataclass(frozen=True)
class ListsSpec:
    """The second pre-pass (one variant: it reads tile classes of any tile size)."""


def lists_source(spec=ListsSpec()):
    """The second pre-pass: one thread a query tile, its row of classes made into its visible
    list (reference.blocks.visible_lists), read a byte at a time (the row's cache lines
    stay in L1)."""
    def visible_lists(classes, visible):
        """visible[cb, ch, i] (shape (B or 1, Hq or 1, query tiles, 1 + key tiles)): the
        count, then the key tiles classes[cb, ch, i] does not skip, 2 j + 1 where PARTIAL,
        2 j where FULL."""
        heads, tiles_m, tiles_n = classes.shape[1], classes.shape[2], classes.shape[3]
        row = int64(cuda.blockIdx.x) * LIST_THREADS + cuda.threadIdx.x
        if row >= classes.shape[0] * heads * tiles_m:
            return
        cb, ch, i = row // (heads * tiles_m), row // tiles_m % heads, row % tiles_m
        n = 0
        for j in range(tiles_n):
            c = classes[cb, ch, i, j]
            if c != SKIP:
                n += 1
                visible[cb, ch, i, n] = 2 * j + (1 if c == PARTIAL else 0)
        visible[cb, ch, i, 0] = n

    return visible_lists


@lru_cache(maxsize=1)
def lists_kernel(spec=ListsSpec()):
    """The compiled second pre-pass (through the on-disk compile cache)."""
    return jit(lists_source(spec), ("visible lists",), FASTMATH)


def make_tile_walk(HAS_MASK, BLOCK_N):
    """The walk of a forward kernel's key loop, `for t in range(t0, t1, STEP)`: with a mask,
    the steps index the query tile's visible list (only the tiles the mask does not skip, in
    order; STEP 1); without, t is the first key of each tile of the band (STEP BLOCK_N: the
    loop the unmasked variants had before the lists, which ptxas compiles without spills)."""
    STEP = 1 if HAS_MASK else BLOCK_N

    @kernel_part
    def listed_before(visible, cb, ch, tile, j):
        """How many of the key tiles before tile j the visible list of query tile `tile`
        holds (a binary search: the list ascends)."""
        lo, hi = int64(0), int64(visible[cb, ch, tile, 0])
        while lo < hi:
            mid = (lo + hi) // 2
            if visible[cb, ch, tile, 1 + mid] >> 1 < j:
                lo = mid + 1
            else:
                hi = mid
        return lo

    @kernel_part
    def walk_range(visible, cb, ch, tile, first, last):
        """(t0, t1): the steps over the keys first <= j < last (first a multiple of
        BLOCK_N)."""
        if HAS_MASK:
            return (listed_before(visible, cb, ch, tile, first // BLOCK_N),
                    listed_before(visible, cb, ch, tile, (last + BLOCK_N - 1) // BLOCK_N))
        return first, last

    @kernel_part
    def tile_start(visible, cb, ch, tile, t, t1, first, last):
        """The first key of step t's tile; with a mask `last` from step t1 on (without, t
        itself, which a caller tests against last)."""
        if not HAS_MASK:
            return t
        if t >= t1:
            return last
        return int64(visible[cb, ch, tile, 1 + t] >> 1) * BLOCK_N

    @kernel_part
    def reads_mask(visible, cb, ch, tile, t):
        """Whether step t's tile needs the mask read pair by pair (PARTIAL): a FULL tile is
        visible by the mask wherever the band lets a row see."""
        return HAS_MASK and visible[cb, ch, tile, 1 + t] & 1 != 0

    return walk_range, tile_start, reads_mask, STEP
