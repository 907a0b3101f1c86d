"""Certifying attention split across ranks: verify.compare(impl, world_size=N).

The implementation under test follows a per-rank protocol: on every rank of a
torch.distributed group it is called as fn(q, k, v, *, layout, group, **options) with the
rank's shards of q, k and v (torch tensors; the rows sharding.shard_ranges gives the rank
under `layout`, "contiguous" or "zigzag") and the contract's options for the whole problem,
and returns out for the rank's rows (and lse with return_lse=True).

`spread(impl, world_size, layout)` makes it an ordinary Implementation: this process is rank
0 of a group of world_size (gloo on CPU processes, NCCL on one GPU a rank), the others are
worker processes started at the first call. Each call sends the case's whole inputs to every
rank, each rank calls the implementation on its shards, and rank 0 puts the rows back in
place: verify then judges the whole by its one rule, per (batch, head), with every check it
makes of any kernel. A failure's detail names the ranks whose rows fail (`rows_by_rank`).
"""
import atexit
import os
import tempfile

from numba_kernels.distributed.sharding import LAYOUTS, shard_ranges, take
from .adapters import Implementation

_ACTIVE = []  # the world whose group this process is in (a process is in one at a time)


def spread(impl, world_size, layout="contiguous"):
    """The Implementation that runs `impl` (an Implementation or MODULE:CALLABLE / built-in
    name following the per-rank protocol) on world_size ranks sharded by `layout`."""
    from .adapters import load

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    spec = impl if isinstance(impl, str) else None
    impl = load(impl, array="torch") if isinstance(impl, str) else impl
    if impl.array != "torch":
        raise ValueError(f"{impl.name}: a distributed implementation takes torch tensors "
                         f"(array='torch'), got array={impl.array!r}")
    world = _World(world_size, layout, spec or impl, impl.device)
    return Implementation(
        f"{impl.name} on {world_size} ranks ({layout})", world.call, impl.supports,
        array="torch", device=impl.device, layout=impl.layout, version=impl.version,
        timeout_s=impl.timeout_s, precision=impl.precision, differentiable=False)


def rows_by_rank(rows, n, world_size, layout):
    """Which ranks hold query rows `rows` of n (a failure map's words), e.g. "rank 1"."""
    owners = sorted({r for r, ranges in enumerate(shard_ranges(n, world_size, layout))
                     for start, stop in ranges for i in rows if start <= i < stop})
    return ", ".join(f"rank {r}" for r in owners)


def where_it_fails(result, world_size, layout):
    """A failed CaseResult's line on the ranks: whose rows hold each failing tensor's
    largest error, and whether that row is at a shard's edge ("" where none is known)."""
    edges = {i for ranges in shard_ranges(result.case.Nq, world_size, layout)
             for start, stop in ranges for i in (start, stop - 1)}
    words = []
    for c in result.comparisons:
        if not c.passed and len(c.worst_index) >= 3:
            row = int(c.worst_index[2])
            owner = rows_by_rank([row], result.case.Nq, world_size, layout)
            words.append(f"{c.name}: worst at row {row}, {owner}'s"
                         + (" (a shard's edge)" if row in edges else ""))
    return "; ".join(words)


class _World:
    """The ranks of a spread implementation: this process as rank 0, the workers started
    at the first call and stopped at exit."""

    def __init__(self, size, layout, impl, device):
        self.size, self.layout, self.impl, self.device = size, layout, impl, device
        self.workers, self.group_ready, self.fn = [], False, None

    def call(self, q, k, v, **options):
        import torch

        self._start()
        message = dict(q=q.cpu(), k=k.cpu(), v=v.cpu(),
                       options={n: x.cpu() if isinstance(x, torch.Tensor) else x
                                for n, x in options.items()})
        got = _exchange(self, message)
        return _placed(got, self.layout, q, v, options.get("return_lse", False))

    def _start(self):
        if self.group_ready:
            return
        import torch.distributed as dist
        import torch.multiprocessing as mp

        for world in _ACTIVE:  # another spread implementation's ranks: stopped first
            world._stop()
        init = f"file://{tempfile.mkdtemp(prefix='verify-world-')}/init"
        context = mp.get_context("spawn")
        for rank in range(1, self.size):
            worker = context.Process(target=_worker, daemon=True, args=(
                rank, self.size, init, self.layout, self.impl, self.device))
            worker.start()
            self.workers.append(worker)
        dist.init_process_group(_backend(self.device), init_method=init, rank=0,
                                world_size=self.size)
        self.group_ready, self.fn = True, _fn(self.impl)
        _ACTIVE[:] = [self]
        atexit.register(self._stop)

    def _stop(self):
        import torch.distributed as dist

        if self.group_ready:
            dist.broadcast_object_list([None], src=0)
            for worker in self.workers:
                worker.join(timeout=30)
            dist.destroy_process_group()
            self.group_ready, self.workers = False, []
            if self in _ACTIVE:
                _ACTIVE.remove(self)


def _backend(device):
    return "nccl" if device == "cuda" else "gloo"


def _exchange(world, message):
    """Every rank's result for `message` (rank 0's own computed here), or a RuntimeError
    naming the ranks that raised."""
    import torch.distributed as dist

    dist.broadcast_object_list([message], src=0)
    mine = _rank_result(world.fn, 0, world.size, world.layout, message, world.device)
    every = [None] * world.size
    dist.gather_object(mine, every, dst=0)
    errors = [f"rank {r}: {x}" for r, x in enumerate(every) if isinstance(x, str)]
    if errors:
        raise RuntimeError("; ".join(errors))
    return every


def _fn(impl):
    """The per-rank callable of an Implementation or a spec."""
    from .adapters import load

    return (load(impl, array="torch") if isinstance(impl, str) else impl).fn


def _rank_result(fn, rank, size, layout, message, device):
    """This rank's (out,) or (out, lse) on its shards, as CPU tensors, or the error's words."""
    import torch
    import torch.distributed as dist

    try:
        place = f"cuda:{rank}" if device == "cuda" else "cpu"
        q, k, v = (take(message[n], shard_ranges(message[n].shape[2], size, layout)[rank])
                   .to(place) for n in ("q", "k", "v"))
        options = {n: x.to(place) if isinstance(x, torch.Tensor) else x
                   for n, x in message["options"].items()}
        result = fn(q, k, v, layout=layout, group=dist.group.WORLD, **options)
        result = result if isinstance(result, tuple) else (result,)
        return tuple(x.detach().cpu() for x in result)
    except Exception as e:  # noqa: BLE001 - a rank's error is the call's result
        return f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _placed(every, layout, q, v, return_lse):
    """The whole out (and lse) from each rank's rows, put back in place."""
    import torch

    n, size = q.shape[2], len(every)
    out = torch.zeros(q.shape[:3] + v.shape[3:], dtype=every[0][0].dtype)
    lse = torch.zeros(q.shape[:3], dtype=torch.float32)
    for result, ranges in zip(every, shard_ranges(n, size, layout)):
        at = 0
        for start, stop in ranges:
            out[:, :, start:stop] = result[0][:, :, at:at + stop - start]
            if return_lse:
                lse[:, :, start:stop] = result[1][:, :, at:at + stop - start]
            at += stop - start
    out = out.to(q.device)
    return (out, lse.to(q.device)) if return_lse else out


def _worker(rank, size, init, layout, impl, device):
    """A worker rank: joins the group, then computes its shard of every call until told to
    stop (None)."""
    import torch.distributed as dist

    if device == "cuda":
        import torch
        torch.cuda.set_device(rank)
    dist.init_process_group(_backend(device), init_method=init, rank=rank, world_size=size)
    fn = _fn(impl)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        dist.gather_object(_rank_result(fn, rank, size, layout, box[0], device), None, dst=0)
    dist.destroy_process_group()
    os._exit(0)
