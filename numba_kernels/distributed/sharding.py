"""How a sequence is split across ranks: each rank's rows as ranges of the whole sequence.

contiguous: rank r holds rows [r N / W, (r + 1) N / W) (floor division: lengths differ by at
most one). zigzag: the sequence cut the same way into 2 W chunks, rank r holding chunks r and
2 W - 1 - r, so that under a causal band every rank has as many visible pairs as another
(the early chunk sees few keys, the late one many). Or a layout of the caller's own: a
function layout(n, world_size) giving every rank's ranges, checked to cover the sequence
once (an importable function where ranks are processes: they load it by name). A rank's
rows are its ranges in order.
"""
from reference.contract import is_integer

LAYOUTS = ("contiguous", "zigzag")


def shard_ranges(n, world_size, layout="contiguous"):
    """For each rank, its rows of a sequence of n as a tuple of (start, stop) ranges, in
    ascending order (empty ranges left out). layout: "contiguous", "zigzag" or a function
    (n, world_size) -> every rank's ranges. A ValueError names a bad argument, or what a
    layout function's ranges get wrong."""
    for name, x, least in (("n", n, 0), ("world_size", world_size, 1)):
        if not is_integer(x) or x < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {x!r}")
    n, world_size = int(n), int(world_size)
    if callable(layout):
        return _checked(layout, n, world_size)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or a function (n, world_size) -> "
                         f"every rank's ranges, got {layout!r}")
    pieces = world_size if layout == "contiguous" else 2 * world_size
    cuts = [c * n // pieces for c in range(pieces + 1)]
    owned = [(r,) if layout == "contiguous" else (r, pieces - 1 - r) for r in range(world_size)]
    return [tuple((cuts[c], cuts[c + 1]) for c in chunks if cuts[c] < cuts[c + 1])
            for chunks in owned]


def _checked(layout, n, world_size):
    """A layout function's ranges for (n, world_size), as shard_ranges gives them, or a
    ValueError naming the function and what its ranges get wrong."""
    name = getattr(layout, "__qualname__", repr(layout))
    try:
        got = [tuple((int(a), int(b)) for a, b in rank) for rank in layout(n, world_size)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"layout {name}({n}, {world_size}) must give, for each rank, a list "
                         f"of (start, stop) ranges: {e}") from None
    if len(got) != world_size:
        raise ValueError(f"layout {name}({n}, {world_size}) gave {len(got)} ranks' ranges")
    rows = sorted(i for rank in got for a, b in rank for i in range(a, b))
    wrong = [(r, a, b) for r, rank in enumerate(got) for a, b in rank if not 0 <= a <= b <= n]
    if wrong or rows != list(range(n)):
        raise ValueError(f"layout {name}({n}, {world_size}) must cover rows 0..{n - 1} once "
                         f"each with ranges (start, stop), 0 <= start <= stop <= {n}; got "
                         f"{got}")
    if any(rank[i][1] > rank[i + 1][0] for rank in got for i in range(len(rank) - 1)):
        raise ValueError(f"layout {name}({n}, {world_size}): each rank's ranges must be in "
                         f"ascending order; got {got}")
    return [tuple(r for r in rank if r[0] < r[1]) for rank in got]


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
