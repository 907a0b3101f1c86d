"""The order in which the kernels' blocks take their tiles (schedule.launch_order), on the
host: every (head, tile) once, a head's tiles together without a causal band, and under one
the longest blocks first across every head, for the forward's query tiles and the backward's
key tiles alike; in grouped_order (the tensor-core forward's), the same in groups of whole
heads, one group after the other."""
import pytest

from numba_kernels.schedule import GROUP_BLOCKS, group_size, grouped_order, launch_order
from reference.contract import key_range

SIZES = [(1, 1), (1, 5), (3, 1), (7, 32), (64, 32), (13, 3)]  # (tiles, heads)


GROUPS = [1, 20, GROUP_BLOCKS]  # group_blocks: one head a group, several, the kernel's own
ORDERS = [launch_order] + [
    lambda i, n_tiles, n_bh, causal, g=g: grouped_order(i, n_tiles, n_bh, causal,
                                                        group_size(n_tiles, g, 1))
    for g in GROUPS]


@pytest.mark.parametrize("n_tiles,n_bh", SIZES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("order", ORDERS)
def test_every_tile_of_every_head_once(n_tiles, n_bh, causal, order):
    seen = [order(i, n_tiles, n_bh, causal) for i in range(n_tiles * n_bh)]
    assert sorted(seen) == [(bh, r) for bh in range(n_bh) for r in range(n_tiles)]


@pytest.mark.parametrize("n_tiles,n_bh", SIZES)
@pytest.mark.parametrize("order", ORDERS)
def test_without_causal_a_heads_tiles_run_together(n_tiles, n_bh, order):
    heads = [order(i, n_tiles, n_bh, False)[0] for i in range(n_tiles * n_bh)]
    assert heads == sorted(heads)


def query_tile_keys(rank, n_tiles, tile, n):
    """Keys the query tile of this rank walks (the last tile first), causal top-left."""
    last_row = min((n_tiles - rank) * tile, n) - 1
    return key_range(last_row, n, n, -1, 0, False)[1]


def key_tile_rows(rank, tile, n):
    """Query rows that see the first key of the key tile of this rank (rank = key tile),
    causal top-left."""
    return sum(1 for i in range(n) if key_range(i, n, n, -1, 0, False)[1] > rank * tile)


@pytest.mark.parametrize("n,n_bh", [(64, 1), (2048, 32), (1000, 3), (65, 7)])
def test_under_a_causal_band_the_longest_blocks_start_first(n, n_bh):
    """The work of each block in launch order never grows: head by head (the order without a
    causal band) the last head's longest tiles would start near the end."""
    tile = 64
    n_tiles = -(-n // tile)
    order = [launch_order(i, n_tiles, n_bh, True)[1] for i in range(n_tiles * n_bh)]
    for work in (lambda r: query_tile_keys(r, n_tiles, tile, n),
                 lambda r: key_tile_rows(r, tile, n)):
        done = [work(r) for r in order]
        assert done == sorted(done, reverse=True)


@pytest.mark.parametrize("n,n_bh", [(64, 1), (2048, 32), (1000, 3), (65, 7), (8192, 64)])
@pytest.mark.parametrize("group_blocks", GROUPS)
def test_grouped_the_heads_run_in_groups_each_longest_first(n, n_bh, group_blocks):
    """grouped_order under a causal band: groups of whole heads, as many as group_blocks holds
    and at least one (so that a group's K and V stay in the L2), one group after the other;
    in each group the work of each block in launch order never grows. (launch_order, every
    head at once, and head by head both fail it.)"""
    tile = 64
    n_tiles = -(-n // tile)
    size = max(1, group_blocks // n_tiles)
    assert group_size(n_tiles, group_blocks, 1) == size
    order = [grouped_order(i, n_tiles, n_bh, True, size) for i in range(n_tiles * n_bh)]
    work = [query_tile_keys(r, n_tiles, tile, n) for r in range(n_tiles)]
    for start in range(0, n_bh, size):
        heads = range(start, min(start + size, n_bh))
        group = order[start * n_tiles:(start + len(heads)) * n_tiles]
        assert sorted({bh for bh, _ in group}) == list(heads)
        done = [work[r] for _, r in group]
        assert done == sorted(done, reverse=True)
