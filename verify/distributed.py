"""Certifying attention split across ranks: verify.compare(impl, world_size=N).

The implementation under test follows a per-rank protocol: on every rank of a
torch.distributed group it is called as fn(q, k, v, *, layout, group, **options) with the
rank's shards of q, k and v (torch tensors; the rows sharding.shard_ranges gives the rank
under `layout`, "contiguous" or "zigzag") and the contract's options for the whole problem,
and returns out for the rank's rows (and lse with return_lse=True). Its gradients: where it
is differentiable by torch's autograd, each rank differentiates its own call against its rows
of dout (the ranks' backward passes run together, as their forwards did); or a per-rank
grad(q, k, v, dout, *, layout, group, **options) -> (dq, dk, dv) of the rank's shards.
`group` holds every rank and is the implementation's own: verify's messages go on groups of
its own, so a rank that raises mid-call leaves the others waiting on the implementation's
calls only; they give up after a quarter of the call's time, every rank's error is
reported, and the ranks are started anew for the next call.

`spread(impl, world_size, layout)` makes it an ordinary Implementation: this process is rank
0 of a group of world_size (gloo on CPU processes, NCCL on one GPU a rank), the others are
worker processes started (spawned: a script needs `if __name__ == "__main__":`) before the
first call, outside its time (they have START_TIMEOUT_S to meet), and kept for every spread
implementation of the same size, device and timeout (each message says what to run and how
to shard). Each call sends the case's whole inputs to every rank, each rank calls the
implementation on its shards, and rank 0 puts the rows back in place (dq by the rows of q,
dk and dv by the rows of k): verify then judges the whole by its one rule, per (batch, head), with every check it makes of any kernel. A failure's detail
names the ranks whose rows fail (`rows_by_rank`).
"""
import atexit
import os
import tempfile
from collections import namedtuple

from numba_kernels.distributed.sharding import LAYOUTS, put_back, shard_ranges, take
from .adapters import BUILTIN_NAMES, Implementation

_ACTIVE = {}  # (size, device, timeout_s): the _Ranks this process is rank 0 of (one at most)
# What a rank needs to answer a call: the group the implementation runs on (its own, apart
# from the world's: a rank that stops mid-call can pair no call of the implementation's with
# one of verify's), this rank, the world's size, the device kind
_Rank = namedtuple("_Rank", "group rank size device")


def spread(impl, world_size, layout="contiguous", grad=None):
    """The Implementation that runs `impl` (an Implementation or MODULE:CALLABLE / built-in
    name following the per-rank protocol) on world_size ranks sharded by `layout`; its
    gradients by `grad` (the per-rank grad; it must be importable by name, as the workers
    load it), impl's own, or autograd where impl is differentiable."""
    from .adapters import load

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not callable(layout) and layout not in LAYOUTS:
        raise ValueError(f"shard_layout must be one of {LAYOUTS} or a function (n, "
                         f"world_size) -> every rank's ranges, got {layout!r}")
    spec = impl if isinstance(impl, str) else None
    impl = load(impl, array="torch") if isinstance(impl, str) else impl
    if spec in BUILTIN_NAMES and not impl.per_rank:
        raise ValueError(f"{impl.name} runs on one device; on ranks, an implementation of "
                         f"the per-rank protocol (numba-ring, or MODULE:CALLABLE)")
    if impl.array != "torch":
        raise ValueError(f"{impl.name}: a distributed implementation takes torch tensors "
                         f"(array='torch'), got array={impl.array!r}")
    if grad is not None and not callable(grad):
        raise TypeError(f"grad must be callable or None, got {type(grad).__name__}")
    world = _World(world_size, layout, spec or impl, impl.device, grad, impl.timeout_s)
    has_grad = grad is not None or impl.grad is not None or impl.differentiable
    return Implementation(
        f"{impl.name} on {world_size} ranks ({getattr(layout, '__qualname__', layout)})",
        world.call, impl.supports,
        array="torch", device=impl.device, layout=impl.layout, version=impl.version,
        timeout_s=impl.timeout_s, precision=impl.precision, differentiable=False,
        grad=world.grad if has_grad else None, prepare=world.start)


def layout_named(spec):
    """The shard layout a command line names: "contiguous", "zigzag", or MODULE:FUNCTION (a
    function (n, world_size) -> every rank's ranges, sharding.shard_ranges's kind).
    ValueError where it names none."""
    import importlib

    if spec in LAYOUTS:
        return spec
    module, _, name = str(spec).partition(":")
    try:
        function = getattr(importlib.import_module(module), name) if name else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"shard layout {spec!r}: {e}") from None
    if not callable(function):
        raise ValueError(f"shard layout must be one of {LAYOUTS} or MODULE:FUNCTION, got "
                         f"{spec!r}")
    return function


def rows_by_rank(rows, n, world_size, layout):
    """Which ranks hold query rows `rows` of n (a failure map's words), e.g. "rank 1"."""
    owners = sorted({r for r, ranges in enumerate(shard_ranges(n, world_size, layout))
                     for start, stop in ranges for i in rows if start <= i < stop})
    return ", ".join(f"rank {r}" for r in owners)


def where_it_fails(result, world_size, layout):
    """A failed CaseResult's line on the ranks: whose rows hold each failing tensor's
    largest error, and whether that row is at a shard's edge ("" where none is known)."""
    words = []
    for c in result.comparisons:
        if not c.passed and len(c.worst_index) >= 3:
            # dk and dv have a row a key: the rows of k's shards
            n = result.case.Nk if c.name in ("dk", "dv") else result.case.Nq
            edges = {i for ranges in shard_ranges(n, world_size, layout)
                     for start, stop in ranges for i in (start, stop - 1)}
            row = int(c.worst_index[2])
            owner = rows_by_rank([row], n, world_size, layout)
            words.append(f"{c.name}: worst at row {row}, {owner}'s"
                         + (" (a shard's edge)" if row in edges else ""))
    return "; ".join(words)


class _World:
    """A spread implementation's view of the ranks: what it runs on them (impl, grad) and
    how its cases are sharded (layout); the ranks themselves (_Ranks) are shared by every
    spread implementation of the same size, device and timeout."""

    def __init__(self, size, layout, impl, device, grad, timeout_s):
        self.size, self.layout, self.impl, self.device = size, layout, impl, device
        self.grad_spec, self.timeout_s = grad, timeout_s

    def start(self):
        """The ranks running, started where they are not (before a call, outside its time:
        Implementation.prepare)."""
        _ranks(self)

    def call(self, q, k, v, **options):
        """out (and lse) of the whole problem, from every rank's rows."""
        got = _exchange(self, _message(self, q, k, v, None, options))
        return _put_back(got, [q.shape[2]] * len(got[0]), self.layout, q.device)

    def grad(self, q, k, v, dout, **options):
        """(dq, dk, dv) of the whole problem, from every rank's shards."""
        got = _exchange(self, _message(self, q, k, v, dout, options))
        return _put_back(got, [q.shape[2], k.shape[2], v.shape[2]], self.layout, q.device)


class _Ranks:
    """This process as rank 0 of a group of `size`, the workers started (spawned) before the
    first call and stopped at exit, or when ranks of another size, device or timeout are
    needed (a process is in one group at a time)."""

    def __init__(self, size, device, timeout_s):
        self.size, self.device, self.timeout_s = size, device, timeout_s  # _join's
        self.workers, self.group_ready, self.me, self.verify = [], False, None, None

    def start(self):
        import torch.multiprocessing as mp

        init = f"file://{tempfile.mkdtemp(prefix='verify-world-')}/init"
        context = mp.get_context("spawn")
        for rank in range(1, self.size):
            worker = context.Process(target=_worker, daemon=True, args=(
                rank, self.size, init, self.device, self.timeout_s))
            worker.start()
            self.workers.append(worker)
        try:
            self.verify, group = _join(0, self.size, init, self.device, self.timeout_s)
        except Exception:
            self.abort()  # the workers too: a start that failed leaves nothing behind
            raise
        self.group_ready = True
        self.me = _Rank(group, 0, self.size, self.device)
        atexit.register(self.stop)

    def stop(self):
        import torch.distributed as dist

        if self.group_ready:
            dist.broadcast_object_list([None], src=0, group=self.verify.calls)
            for worker in self.workers:
                worker.join(timeout=30)
            dist.destroy_process_group()
            self.group_ready, self.workers = False, []
        _ACTIVE.pop(self.key, None)

    def abort(self):
        """Stop every rank at once, wherever it is (after a rank raised: the others may be
        waiting on it, and the group's calls no longer pair up); the next call starts anew."""
        import torch.distributed as dist

        for worker in self.workers:
            worker.kill()
            worker.join(timeout=30)
        if self.group_ready:
            dist.destroy_process_group()
        self.group_ready, self.workers = False, []
        _ACTIVE.pop(self.key, None)

    @property
    def key(self):
        return (self.size, self.device, self.timeout_s)


def _ranks(world):
    """The running ranks a spread implementation's call needs: the ones running if they
    match, else new ones (the others stopped first)."""
    key = (world.size, world.device, world.timeout_s)
    if key not in _ACTIVE:
        for other in list(_ACTIVE.values()):
            other.stop()
        ranks = _Ranks(*key)
        ranks.start()
        _ACTIVE[key] = ranks
    return _ACTIVE[key]


def _backend(device):
    return "nccl" if device == "cuda" else "gloo"


def _seconds(timeout_s):
    import datetime

    return datetime.timedelta(seconds=timeout_s)


def _message(world, q, k, v, dout, options):
    """A call's inputs as they go to every rank (CPU tensors; dout None for the forward),
    with what to run on them (world.impl, world.grad_spec) and how they are sharded."""
    import torch

    return dict(impl=world.impl, grad=world.grad_spec, layout=world.layout,
                q=q.cpu(), k=k.cpu(), v=v.cpu(), dout=None if dout is None else dout.cpu(),
                options={n: x.cpu() if isinstance(x, torch.Tensor) else x
                         for n, x in options.items()})


def _exchange(world, message):
    """Every rank's result for `message` (rank 0's own computed here), or a RuntimeError
    naming the ranks that raised."""
    import torch.distributed as dist

    ranks = _ranks(world)
    dist.broadcast_object_list([message], src=0, group=ranks.verify.calls)
    mine = _rank_result(ranks.me, message)
    every = [None] * world.size
    dist.gather_object(mine, every, dst=0, group=ranks.verify.results)
    errors = [f"rank {r}: {x}" for r, x in enumerate(every) if isinstance(x, str)]
    if errors:
        ranks.abort()
        raise RuntimeError("; ".join(errors))
    return every


def _fns(impl, grad):
    """(forward, grad) per-rank callables of an Implementation or a spec: grad the one
    given, the implementation's own, or autograd through its forward."""
    from .adapters import load
    from .backward import torch_grad

    impl = load(impl, array="torch") if isinstance(impl, str) else impl
    return impl.fn, grad or impl.grad or torch_grad(impl.fn)


START_TIMEOUT_S = 600  # the ranks' start: spawning, importing torch, meeting (a busy host)
# a worker waits this long for the next call (where rank 0 dies, its sockets close and the
# wait ends with an error at once)
IDLE_TIMEOUT_S = 7 * 24 * 3600
# verify's groups: the calls go out on one (a worker waits for the next as long as it
# takes), the results come back on another (half a call's time)
_VerifyGroups = namedtuple("_VerifyGroups", "calls results")


def _join(rank, size, init, device, timeout_s):
    """This process as `rank` of the world at `init`: (verify's groups, the implementation's
    group), every rank making them in the same order. The world waits START_TIMEOUT_S for
    every rank to come, apart from any call's time; a rank waits half a call's time for the
    others' results, and a quarter in the implementation's calls (one that raised stops in
    mid-call): the errors, not a hang, come back within the call's time."""
    import torch.distributed as dist

    backend = _backend(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=size,
                            timeout=_seconds(START_TIMEOUT_S))
    try:
        calls = dist.new_group(backend=backend, timeout=_seconds(IDLE_TIMEOUT_S))
        results = dist.new_group(backend=backend, timeout=_seconds(timeout_s / 2))
        return (_VerifyGroups(calls, results),
                dist.new_group(backend=backend, timeout=_seconds(timeout_s / 4)))
    except Exception:
        dist.destroy_process_group()  # the world this call made, and nothing else
        raise


def _rank_result(me, message):
    """This rank's (out,) or (out, lse) on its shards, or (dq, dk, dv) where the message
    holds dout, as CPU tensors; or the error's words."""
    import torch

    try:
        fns, layout = _fns(message["impl"], message["grad"]), message["layout"]
        place = f"cuda:{me.rank}" if me.device == "cuda" else "cpu"
        q, k, v = (_shard(message[n], me, layout).to(place) for n in ("q", "k", "v"))
        options = {n: x.to(place) if isinstance(x, torch.Tensor) else x
                   for n, x in message["options"].items()}
        options.update(layout=layout, group=me.group)
        if message["dout"] is None:
            result = fns[0](q, k, v, **options)
        else:
            result = tuple(fns[1](q, k, v, _shard(message["dout"], me, layout).to(place),
                                  **options))
        result = result if isinstance(result, tuple) else (result,)
        return tuple(x.detach().cpu() for x in result)
    except Exception as e:  # noqa: BLE001 - a rank's error is the call's result
        return f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _shard(x, me, layout):
    """This rank's rows of x (B, H, N, ...) under `layout`."""
    return take(x, shard_ranges(x.shape[2], me.size, layout)[me.rank])


def _put_back(every, lengths, layout, device):
    """The whole tensors from every rank's results (each a tuple, its i-th tensor's rows
    sharded from a sequence of lengths[i]), each rank's rows put back in place."""
    wholes = [put_back([result[i] for result in every], n, layout).to(device)
              for i, n in enumerate(lengths)]
    return wholes[0] if len(wholes) == 1 else tuple(wholes)


def _worker(rank, size, init, device, timeout_s):
    """A worker rank: joins the group, then computes its shard of every call until told to
    stop (None)."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
    torch.set_num_threads(1)  # the ranks share the host's cores
    groups, group = _join(rank, size, init, device, timeout_s)
    me = _Rank(group, rank, size, device)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=groups.calls)
        if box[0] is None:
            break
        dist.gather_object(_rank_result(me, box[0]), None, dst=0, group=groups.results)
    dist.destroy_process_group()
    os._exit(0)
