"""Which tiles a thread block takes and in what order: the launch orders over the grid, and
the keys a tile of query rows sees (the contract's key_range on the device).

Below every kernel module; plain arithmetic where it can be, so that the host tests it.
"""
from numba import cuda

from reference.bands import key_range
from .convert import device_function, int64, uint32


key_range_device = device_function(key_range)  # the contract's own code


def launch_order(block, n_tiles, n_bh, causal):
    """(bh, rank) of the block-th block launched in a grid of n_bh x n_tiles blocks: its
    (split, batch, head) index bh and the rank of its tile. Consecutive blocks share a bh,
    so its K and V stay in L2, tile ranks 0, 1, ... in turn. Under a causal band (causal:
    right >= 0) tiles of rank 0 walk the most keys (the last query tile, the first key
    tile), so the blocks run rank by rank across every bh instead: the longest blocks of
    every head start first and none of them runs last. (Head by head, the last head's
    longest blocks would start near the end of the grid and run alone.)"""
    if causal:
        return block % n_bh, block // n_bh
    return block // n_tiles, block % n_tiles


launch_order_device = device_function(launch_order)  # plain arithmetic: tested on the host


@device_function
def grid_order(causal):
    """launch_order for a 2-D grid of (tiles, bh) blocks, blockIdx.x the fastest (the order
    in which the GPU starts them). Divided in 32-bit arithmetic (a 64-bit division is a
    subroutine call, which costs the kernels registers: docs/design/tensor_cores.md),
    returned as int64 (unsigned values would wrap in the kernels' differences)."""
    n_tiles = uint32(cuda.gridDim.x)
    bh, rank = launch_order_device(uint32(cuda.blockIdx.y) * n_tiles + uint32(cuda.blockIdx.x),
                                   n_tiles, uint32(cuda.gridDim.y), causal)
    return int64(bh), int64(rank)


GROUP_BLOCKS = 1024  # grouped_order: blocks of a group of whole heads, at most


def group_size(n_tiles, group_blocks, one):
    """The bh's of a group in grouped_order: as many whole heads' tiles as group_blocks
    holds, at least one. group_blocks and one come in n_tiles' type (32-bit in
    grid_order_grouped: with a literal 1, Numba's typing turns unsigned arithmetic into
    float64)."""
    return max(group_blocks // n_tiles, one)


def grouped_order(block, n_tiles, n_bh, causal, group):
    """launch_order with the bh's in groups of `group` (group_size) under a causal band:
    rank by rank across a group, one group after the other. The longest blocks of each head
    still start first, and a group's K and V, GROUP_BLOCKS tiles' worth at most (of 64 rows
    at D = 128: 32 MB), stay in the L2 while it runs, where every head's at once would not
    (64 heads of 8192 keys at D = 64: 128 MB). The tensor-core forward takes it (PERF.md,
    m5: 0.93 of launch_order's time there); the backward kept launch_order (its D = 64
    kernels took 1.14-1.18 times as long with this one, without a band too)."""
    if causal:
        start = block // (group * n_tiles) * group  # the group's first bh
        within = block - start * n_tiles
        in_group = min(group, n_bh - start)  # the last group may be smaller
        return start + within % in_group, within // in_group
    return block // n_tiles, block % n_tiles


group_size_device = device_function(group_size)
grouped_order_device = device_function(grouped_order)


@device_function
def grid_order_grouped(causal):
    """grid_order in grouped_order, in the same 32-bit arithmetic."""
    n_tiles = uint32(cuda.gridDim.x)
    group = group_size_device(n_tiles, uint32(GROUP_BLOCKS), uint32(1))
    bh, rank = grouped_order_device(uint32(cuda.blockIdx.y) * n_tiles
                                    + uint32(cuda.blockIdx.x), n_tiles,
                                    uint32(cuda.gridDim.y), causal, group)
    return int64(bh), int64(rank)


@device_function
def block_program(n_tiles, right, batch, heads_q):
    """(split, b, h, tile) of this thread block of a 1-D grid over (split, batch, head, query
    tile), in launch_order: the last query tile of a head first."""
    bh, rank = launch_order_device(int64(cuda.blockIdx.x), n_tiles,
                                   int64(cuda.gridDim.x) // n_tiles, right >= 0)
    tile = n_tiles - 1 - rank
    return bh // (batch * heads_q), bh // heads_q % batch, bh % heads_q, tile


def split_share(first, last, split, n_splits, split_keys):
    """The keys of split `split` of n_splits of the keys first <= j < last: from first
    rounded down to split_keys, shares of equal whole multiples of split_keys (the last ones
    short or empty), clipped to first .. last. Divided in 32-bit arithmetic, as grid_order
    (a 64-bit division is a subroutine call: docs/design/tensor_cores.md)."""
    keys = uint32(split_keys)
    origin = int64(uint32(first) // keys * keys)
    pieces = uint32(max(last - origin + split_keys - 1, 0)) // keys
    share = int64((pieces + uint32(n_splits - 1)) // uint32(n_splits) * keys)
    return max(first, origin + split * share), min(last, origin + (split + 1) * share)


split_share_device = device_function(split_share)  # plain arithmetic: tested on the host


@device_function
def key_tiles(start_m, last_row, n_q, kv_len, left, right, bottom_right, split, n_splits,
              split_keys, block_n):
    """(first, last, lo_last, hi_first): the keys first <= j < last that rows start_m ..
    last_row can see, first rounded down to a tile of block_n keys, and the band
    lo_last <= j < hi_first that every one of them sees. key_range is monotone in the row, so
    the first and last rows bound them: tiles outside the causal band or window are never
    visited. With split-KV (n_splits > 1) a block sees split `split` of that band alone:
    the band, from its first key rounded down to split_keys, cut into n_splits shares of
    whole split_keys (the last ones short or empty), so that the splits of a window, of a
    causal band or of a short kv_length each hold a share of its keys (cut from key 0, the
    keys a band leaves out would make most splits empty), and kernels of any key tile that
    divides split_keys cut alike (a fast variant and the careful one that redoes a block)."""
    lo_first, hi_first = key_range_device(start_m, n_q, kv_len, left, right, bottom_right)
    lo_last, hi_last = key_range_device(last_row, n_q, kv_len, left, right, bottom_right)
    # Applied to every block, the split's bounds kept beside the band's in max and min: a
    # branch on the split count costs the float32 summed variants their registers
    # (docs/design/tensor_cores.md).
    start, end = split_share_device(max(lo_first, 0), min(hi_last, kv_len), split, n_splits,
                                    split_keys)
    first = max(max(lo_first, 0) // block_n * block_n, start // block_n * block_n)
    last = min(hi_last, kv_len, end)
    return first, last, lo_last, hi_first
