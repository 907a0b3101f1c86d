"""How a sequence is split across ranks: each rank's rows as ranges of the whole sequence.

contiguous: rank r holds rows [r N / W, (r + 1) N / W) (floor division: lengths differ by at
most one). zigzag: the sequence cut the same way into 2 W chunks, rank r holding chunks r and
2 W - 1 - r, so that under a causal band every rank has as many visible pairs as another
(the early chunk sees few keys, the late one many). A rank's rows are its ranges in order.
"""
from reference.contract import is_integer

LAYOUTS = ("contiguous", "zigzag")


def shard_ranges(n, world_size, layout="contiguous"):
    """For each rank, its rows of a sequence of n as a tuple of (start, stop) ranges, in
    ascending order (empty ranges left out). A ValueError names a bad argument."""
    for name, x, least in (("n", n, 0), ("world_size", world_size, 1)):
        if not is_integer(x) or x < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {x!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    n, world_size = int(n), int(world_size)
    pieces = world_size if layout == "contiguous" else 2 * world_size
    cuts = [c * n // pieces for c in range(pieces + 1)]
    owned = [(r,) if layout == "contiguous" else (r, pieces - 1 - r) for r in range(world_size)]
    return [tuple((cuts[c], cuts[c + 1]) for c in chunks if cuts[c] < cuts[c + 1])
            for chunks in owned]


def shard_length(ranges):
    """The rows a rank holds: the sum of its ranges' lengths."""
    return sum(stop - start for start, stop in ranges)


def take(x, ranges, dim=2):
    """x's rows `ranges` along dim, concatenated (a torch tensor or a NumPy array)."""
    parts = [_slice(x, start, stop, dim) for start, stop in ranges]
    if hasattr(x, "new_empty"):
        import torch
        return torch.cat(parts, dim) if parts else _slice(x, 0, 0, dim)
    import numpy as np
    return np.concatenate(parts, dim) if parts else _slice(x, 0, 0, dim)


def _slice(x, start, stop, dim):
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, stop)
    return x[tuple(index)]
