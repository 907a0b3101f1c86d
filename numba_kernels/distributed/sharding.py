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


def put_back(pieces, n, layout, dim=2):
    """take's inverse: the whole sequence of n rows along dim from every rank's piece (its
    rows under `layout`, in rank order; torch tensors)."""
    first = pieces[0]
    whole = first.new_zeros(first.shape[:dim] + (n,) + first.shape[dim + 1:])
    for piece, ranges in zip(pieces, shard_ranges(n, len(pieces), layout)):
        at = 0
        for start, stop in ranges:
            _slice(whole, start, stop, dim).copy_(_slice(piece, at, at + stop - start, dim))
            at += stop - start
    return whole


def all_shards(x, lengths, group=None):
    """Every rank's shard (lengths[r] rows along dim 2, this rank's is x) gathered to every
    rank of `group`, in rank order: an all-gather of the shards padded to the longest."""
    import torch
    import torch.distributed as dist

    padded = x.new_zeros(x.shape[:2] + (max(lengths),) + x.shape[3:])
    padded[:, :, :x.shape[2]] = x
    every = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(every, padded, group=group)
    return [y[:, :, :n] for y, n in zip(every, lengths)]


def unsharded(x, layout, group=None):
    """The whole of x (B, H, N, ...) on every rank of `group`, from each rank's shard under
    `layout` (this rank's is x): for implementations that shard by a layout of their own
    (they take the whole and shard it their way). Values move, no arithmetic."""
    import torch
    import torch.distributed as dist

    lengths = [torch.zeros(1, dtype=torch.int64, device=x.device)
               for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, torch.tensor([x.shape[2]], device=x.device), group=group)
    lengths = [int(n) for n in lengths]
    return put_back(all_shards(x, lengths, group), sum(lengths), layout)


def _slice(x, start, stop, dim):
    index = [slice(None)] * x.ndim
    index[dim] = slice(start, stop)
    return x[tuple(index)]
