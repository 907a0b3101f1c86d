"""Block sparsity on the device: a mask's tile classes (reference/blocks.py: SKIP, PARTIAL,
FULL) made by a pre-pass kernel at a kernel's own tile sizes, each tile's row of classes (or
column) made into its list of visible tiles by a second pre-pass
(reference.blocks.visible_lists), and the walk of a kernel's loop over that list.

A kernel with a mask steps through its tile's list: the forward's and dQ's query tile through
its visible key tiles, dK/dV's key tile through its visible query tiles. A tile that no row
sees costs nothing (it is not in the list), and a tile every row sees by the mask reads no
mask (the band and kv_lengths are still tested there). The steps are independent loads of a
short list, not a scan of every tile's class (docs/design/block_sparse.md). Below the
kernels; imports none of them.
"""
from collections import namedtuple
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda

from reference.blocks import FULL, PARTIAL, SKIP
from .common import FASTMATH, kernel_part
from .compile_cache import jit
from . import warp
from .convert import int64, uint32

CLASS_THREADS = 128  # threads of a block of the class pre-pass: a warp a tile
CLASS_WARPS = CLASS_THREADS // warp.LANES
LIST_THREADS = 128  # threads of a block of the second pre-pass: a warp a list
LIST_WARPS = LIST_THREADS // warp.LANES
BLOCKS_THREADS = 128  # threads of a block of a block mask's pre-passes: a tile or pair each


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
    """The pre-pass kernel: one warp per tile, CLASS_WARPS tiles of a row of tiles a block
    (grid: (key tiles / CLASS_WARPS, query tiles, (batch, head) of the classes)), each lane
    testing every 32nd load of its tile (a byte, or a word of four keys), the loads of a warp
    side by side in memory; the warp's votes (ballot) answer "some" and "every"."""
    BLOCK_M, SPAN = spec.block_m, spec.span
    LOADS_N = spec.block_n // SPAN  # loads a row of the tile
    LOADS = -(-BLOCK_M * LOADS_N // warp.LANES)  # loads a lane, unrolled
    assert spec.block_n % SPAN == 0, spec

    def tile_classes(mask, mask_steps, n_q, n_k, classes):
        """classes[cb, ch, i, j] (shape (B or 1, Hq or 1, query tiles, key tiles)) of mask
        (uint8, or int32 words of four keys; its broadcast dimensions' steps 0 in
        mask_steps) over the pairs of tile (i, j) inside the n_q x n_k plane."""
        lane = cuda.threadIdx.x % warp.LANES
        n_tile = int64(cuda.blockIdx.x) * CLASS_WARPS + cuda.threadIdx.x // warp.LANES
        m_tile = int64(cuda.blockIdx.y)
        if n_tile >= classes.shape[3]:
            return  # the whole warp
        heads = classes.shape[1]
        cb, ch = int64(cuda.blockIdx.z) // heads, int64(cuda.blockIdx.z) % heads
        some, every = False, True
        for i in range(LOADS):
            p = lane + i * warp.LANES
            row, at = m_tile * BLOCK_M + p // LOADS_N, n_tile * LOADS_N + p % LOADS_N
            if p < BLOCK_M * LOADS_N and row < n_q and at * SPAN < n_k:
                x = mask[cb * mask_steps[0], ch * mask_steps[1], row * mask_steps[2],
                         at * mask_steps[3]]
                if x != 0:
                    some = True
                if SPAN == 1:
                    if x == 0:
                        every = False
                elif ((x & 0xFF) == 0 or (x >> 8) & 0xFF == 0 or (x >> 16) & 0xFF == 0
                      or (x >> 24) & 0xFF == 0):
                    every = False
        some = warp.ballot(some) != 0
        every = warp.ballot(every) == warp.FULL_MASK
        if lane == 0:
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
    """The second pre-pass: each query tile's list of key tiles (a forward kernel's, the dQ
    kernel's), or with transposed each key tile's list of query tiles (the dK, dV kernel's).
    It reads tile classes of any tile size."""

    transposed: bool = False


def lists_source(spec=ListsSpec()):
    """The second pre-pass: one warp a row of the classes (a column where transposed), made
    into its visible list (reference.blocks.visible_lists, of the classes' transpose where
    transposed), 32 classes a step: a ballot of the lanes whose tile is not SKIP, each such
    lane writing its entry after those of the lanes below it (popc)."""
    TRANSPOSED = spec.transposed

    def visible_lists(classes, visible):
        """visible[cb, ch, i] (shape (B or 1, Hq or 1, tiles, 2 + other tiles)): the count,
        then the tiles j of the other side whose class classes[cb, ch, i, j] (classes[cb,
        ch, j, i] where transposed) is not SKIP, 2 j + 1 where PARTIAL, 2 j where FULL, then
        the sentinel 2 * other tiles."""
        heads, tiles = classes.shape[1], visible.shape[2]
        others = visible.shape[3] - 2
        lane = cuda.threadIdx.x % warp.LANES
        row = int64(cuda.blockIdx.x) * LIST_WARPS + cuda.threadIdx.x // warp.LANES
        if row >= classes.shape[0] * heads * tiles:
            return  # the whole warp: every lane of a warp has its row
        cb, ch, i = row // (heads * tiles), row // tiles % heads, row % tiles
        below = (uint32(1) << uint32(lane)) - uint32(1)  # the lanes before this one
        n = int64(0)
        for j0 in range(0, others, warp.LANES):
            j = j0 + lane
            c = SKIP
            if j < others:
                c = classes[cb, ch, j, i] if TRANSPOSED else classes[cb, ch, i, j]
            kept = warp.ballot(c != SKIP)
            if c != SKIP:
                visible[cb, ch, i, 1 + n + warp.popc(kept & below)] = (
                    2 * j + (1 if c == PARTIAL else 0))
            n += warp.popc(kept)
        if lane == 0:
            visible[cb, ch, i, 0] = n
            visible[cb, ch, i, 1 + n] = 2 * others

    return visible_lists


@lru_cache(maxsize=2)
def lists_kernel(spec=ListsSpec()):
    """The compiled second pre-pass (through the on-disk compile cache)."""
    return jit(lists_source(spec), ("visible lists", spec.transposed), FASTMATH)


@dataclass(frozen=True)
class BlocksSpec:
    """A block mask's pre-pass (docs/contract.md, "Block-sparse attention"): the tile classes
    of kernels whose tiles lie inside its blocks, read from the block table alone; or, with
    expand, the boolean mask it stands for written out pair by pair (and'ed with a mask), for
    kernels whose tiles its blocks do not hold whole."""

    expand: bool = False


@kernel_part
def this_element(out):
    """(b, h, i, j, inside): the element of out (4-D: batch, head, then the two dimensions
    a thread each walks) of this thread of a grid (elements / BLOCKS_THREADS, batch * heads)
    of BLOCKS_THREADS threads; inside False past its last one."""
    heads, n = out.shape[1], out.shape[3]
    p = int64(cuda.blockIdx.x) * BLOCKS_THREADS + cuda.threadIdx.x
    b, h = int64(cuda.blockIdx.y) // heads, int64(cuda.blockIdx.y) % heads
    return b, h, p // n, p % n, p < out.shape[2] * n


@kernel_part
def block_kept(blocks, block_steps, b, h, block_i, block_j):
    """Whether the block table (uint8, its broadcast dimensions' steps 0) keeps block
    (block_i, block_j) of batch b, head h."""
    return blocks[b * block_steps[0], h * block_steps[1], block_i * block_steps[2],
                  block_j * block_steps[3]] != 0


def blocks_source(spec=BlocksSpec()):
    """The pre-pass of a BlocksSpec: a thread a tile (a pair where expand), grid (tiles (pairs)
    / BLOCKS_THREADS, (batch, head) of the output)."""

    def block_classes(blocks, block_steps, per_m, per_n, masked, classes):
        """classes[cb, ch, i, j] (shape (B or 1, Hq or 1, query tiles, key tiles)) for
        tiles inside one block each, per_m tiles of rows by per_n of keys a block: SKIP
        where the block is hidden; where it is kept, FULL, or with masked the class of the
        mask that classes already holds (classes_source's)."""
        cb, ch, i, j, inside = this_element(classes)
        if not inside:
            return
        if not block_kept(blocks, block_steps, cb, ch, i // per_m, j // per_n):
            classes[cb, ch, i, j] = SKIP
        elif not masked:
            classes[cb, ch, i, j] = FULL

    def expand_blocks(blocks, block_steps, block_m, block_n, mask, mask_steps, keep):
        """keep[b, h, i, j] (uint8 (B or 1, Hq or 1, Nq, Nk)): 1 where the block of pair
        (i, j) is kept and the mask keeps the pair, else 0."""
        b, h, i, j, inside = this_element(keep)
        if not inside:
            return
        if block_kept(blocks, block_steps, b, h, i // block_m, j // block_n) and mask[
                b * mask_steps[0], h * mask_steps[1], i * mask_steps[2], j * mask_steps[3]] != 0:
            keep[b, h, i, j] = 1
        else:
            keep[b, h, i, j] = 0

    return expand_blocks if spec.expand else block_classes


@lru_cache(maxsize=2)
def blocks_kernel(spec=BlocksSpec()):
    """The compiled pre-pass of a BlocksSpec (through the on-disk compile cache)."""
    return jit(blocks_source(spec), ("block mask", spec.expand), FASTMATH)


TileWalk = namedtuple("TileWalk", "walk_range walk_steps step_tile tile_start reads_mask STEP")


def make_tile_walk(HAS_MASK, BLOCK_N):
    """The walk of a kernel's loop over one side's tiles of BLOCK_N (a forward's or dQ's key
    tiles; dK, dV's query tiles), `for t in range(t0, t1, STEP)` (walk_range), or to the
    list's end with a break at the first tile at or past `last` (walk_steps: the tensor-core
    forward's): with a mask, the steps index the tile's visible list (only the tiles the mask
    does not skip, in order; STEP 1); without, t is the first key of each tile of the band
    (STEP BLOCK_N: the loop the unmasked variants had before the lists, which ptxas compiles
    without spills). A TileWalk."""
    STEP = 1 if HAS_MASK else BLOCK_N

    @kernel_part
    def listed_before(visible, cb, ch, tile, j):
        """How many of the tiles before tile j the visible list of tile `tile` holds (a
        binary search: the list ascends)."""
        lo, hi = int64(0), int64(visible[cb, ch, tile, 0])
        while lo < hi:
            mid = (lo + hi) // 2
            if visible[cb, ch, tile, 1 + mid] >> 1 < j:
                lo = mid + 1
            else:
                hi = mid
        return lo

    @kernel_part
    def walk_steps(visible, cb, ch, tile, first, last):
        """(t0, t_end): walk_range's first step, and with a mask the end of the whole list
        (no search for last's step: the loop stops at the first step whose tile starts at
        or past `last`); without, walk_range's. The forward's walk (one search fewer; the
        masked variants' registers)."""
        if HAS_MASK:
            return (listed_before(visible, cb, ch, tile, first // BLOCK_N),
                    int64(visible[cb, ch, tile, 0]))
        return first, last

    @kernel_part
    def walk_range(visible, cb, ch, tile, first, last):
        """(t0, t1): the steps over the keys first <= j < last (first a multiple of
        BLOCK_N)."""
        if HAS_MASK:
            return (listed_before(visible, cb, ch, tile, first // BLOCK_N),
                    listed_before(visible, cb, ch, tile, (last + BLOCK_N - 1) // BLOCK_N))
        return first, last

    @kernel_part
    def step_tile(visible, cb, ch, tile, t):
        """The first key of step t's tile (t0 <= t <= t1 of walk_range): at t1, a key at or
        past `last` (with a mask the list's next tile or its sentinel), which callers test
        against last."""
        if not HAS_MASK:
            return t
        return int64(visible[cb, ch, tile, 1 + t] >> 1) * BLOCK_N

    @kernel_part
    def tile_start(visible, cb, ch, tile, t, t1, last):
        """step_tile's, where with a mask `last` from step t1 on: the dQ kernel's (its
        masked variants at D = 128 hold 255 registers, and spill when the list's sentinel
        takes this test's place)."""
        if HAS_MASK and t >= t1:
            return last
        return step_tile(visible, cb, ch, tile, t)

    @kernel_part
    def reads_mask(visible, cb, ch, tile, t):
        """Whether step t's tile needs the mask read pair by pair (PARTIAL): a FULL tile is
        visible by the mask wherever the band lets a row see."""
        return HAS_MASK and visible[cb, ch, tile, 1 + t] & 1 != 0

    return TileWalk(walk_range, walk_steps, step_tile, tile_start, reads_mask, STEP)
