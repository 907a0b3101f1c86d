"""Block sparsity: which tiles of the (query, key) plane a kernel must visit (docs/contract.md,
"Block-sparse attention").

A kernel that walks the plane in tiles of block_m query rows by block_n keys needs, for each
tile, one of three answers: SKIP (no pair of the tile is visible: the tile changes nothing and
costs nothing), FULL (every pair of the tile that lies inside the plane is visible: no mask
need be read) or PARTIAL (some pairs are visible, some not: the mask decides pair by pair).
Hidden pairs change nothing whichever answer a kernel takes, NaN and inf in their keys and
values included: skipping a tile is exact, never an approximation.
"""
import numpy as np

SKIP, PARTIAL, FULL = 0, 1, 2
CLASS_NAMES = ("skip", "partial", "full")


def block_mask_visible(block_mask, block_size, n_q, n_k):
    """The boolean mask (..., n_q, n_k) a block mask stands for (docs/contract.md): pair
    (i, j) visible where block_mask[..., i // block_m, j // block_n] is True (block_size as
    reference.contract.check_block_mask takes it; block_mask a NumPy array or what
    np.asarray reads)."""
    block_m, block_n = tuple(block_size) if isinstance(block_size, (tuple, list)) else (
        block_size, block_size)
    keep = np.asarray(block_mask)
    keep = keep.reshape((1,) * (2 - keep.ndim) + keep.shape) if keep.ndim < 2 else keep
    rows = np.minimum(np.arange(n_q) // block_m, keep.shape[-2] - 1)
    cols = np.minimum(np.arange(n_k) // block_n, keep.shape[-1] - 1)
    return keep[..., rows, :][..., cols]


def tile_classes(keep, block_m, block_n):
    """(..., ceil(Nq / block_m), ceil(Nk / block_n)) uint8 of SKIP, PARTIAL or FULL for the
    boolean visibility `keep` (..., Nq, Nk) (a mask, or reference.contract.dense_visible's
    mask with the band and kv_lengths): a tile at the plane's last rows or keys is judged on
    the pairs inside the plane only."""
    keep = np.asarray(keep)
    if keep.dtype != np.bool_:
        raise TypeError(f"keep must be a boolean array, got dtype {keep.dtype}")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    *lead, n_q, n_k = keep.shape
    tiles_m, tiles_n = -(-n_q // block_m), -(-n_k // block_n)
    pad = [(0, 0)] * len(lead) + [(0, tiles_m * block_m - n_q), (0, tiles_n * block_n - n_k)]
    shape = (*lead, tiles_m, block_m, tiles_n, block_n)
    axes = (len(lead) + 1, len(lead) + 3)
    some = np.pad(keep, pad, constant_values=False).reshape(shape).any(axis=axes)
    every = np.pad(keep, pad, constant_values=True).reshape(shape).all(axis=axes)
    return np.where(every & some, FULL, np.where(some, PARTIAL, SKIP)).astype(np.uint8)



def visible_lists(classes):
    """(..., query tiles, 2 + key tiles) int32 from tile classes (..., query tiles, key tiles):
    for each query tile, the number n of its key tiles that are not SKIP, then those tiles in
    ascending order, tile j written 2 j + 1 where it is PARTIAL and 2 j where FULL, then the
    sentinel 2 * key tiles (a tile past every key; the rest of the row unspecified: zeros
    here). The list a forward kernel walks (numba_kernels/block_sparse.py): its steps are the
    visible tiles alone, and the step after the last one starts past every key."""
    classes = np.asarray(classes)
    *lead, tiles_m, tiles_n = classes.shape
    out = np.zeros((*lead, tiles_m, 2 + tiles_n), np.int32)
    for index in np.ndindex(*lead, tiles_m):
        row = classes[index]
        kept = np.flatnonzero(row != SKIP)
        out[index][0] = kept.size
        out[index][1:1 + kept.size] = 2 * kept + (row[kept] == PARTIAL)
        out[index][1 + kept.size] = 2 * tiles_n
    return out
