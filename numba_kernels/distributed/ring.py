"""Ring attention on torch.distributed: Q, K and V sharded by sequence (sharding.py), each
rank's K and V passed around the ring while the rank computes with the shard it holds.

Forward, step s of W: rank r holds the K, V shard of rank (r - s) mod W; it posts the send of
that shard to rank r + 1 and the receive of the next from rank r - 1, computes its rows
against the shard it holds (block_band.block_plan: the whole problem's band as each block's
own arguments), merges, and waits. The parts are forward_float32's (out unrounded), merged in
float32 and rounded once at the end: W parts add no rounding of their own.

Backward: the same ring, each block's gradients from the backward kernels with the whole
problem's out and lse for the rank's rows (P = exp(S - lse) and delta = rowsum(dO * out) are
then the whole problem's, so a block's dQ, dK and dV are exactly its share). dQ stays on the
rank; dK and dV of the held shard travel with it, and a last hop takes them home. The blocks'
gradients are computed from float32 copies of the inputs (the kernels round 16-bit gradients
to 16 bits: W such roundings would add up), summed in float32, rounded once.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference.contract import check_attention_args, row_lengths
from ..backward import flash_attention_backward
from ..forward import forward_float32
from ..plan import BACKWARD_KERNEL
from .block_band import LocalBand, block_plan
from .sharding import shard_length, shard_ranges


def ring_attention(q, k, v, *, layout="contiguous", group=None, scale=None, causal=False,
                   window=None, kv_lengths=None, return_lse=False, kernel="auto",
                   precision=None):
    """This rank's rows of attention over the whole sequence (docs/contract.md, "Sharding"):
    out (and lse where return_lse) for the rank's rows of q, in q's dtype (lse float32);
    differentiable (the gradients' own ring, ring_attention_backward).

    q (B, Hq, nq, D), k (B, Hk, nk, D), v (B, Hk, nk, Dv): this rank's rows of the whole
    problem's, sharded by `layout` ("contiguous" or "zigzag": sharding.shard_ranges over
    the ranks of `group`, the default group if None), torch tensors on this rank's device.
    causal, window, kv_lengths ((B,) of the whole problem's keys, the same on every rank),
    scale: as flash_attention takes them for the whole problem. kernel, precision: as
    flash_attention's, for every block. Every rank of the group calls it together."""
    options = dict(layout=layout, group=group, scale=scale, causal=causal, window=window,
                   kv_lengths=kv_lengths, kernel=kernel, precision=precision)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        out, lse = _RingFunction.apply(q, k, v, options)
    else:
        out, lse = _forward(q, k, v, options)
    return (out, lse) if return_lse else out


def ring_attention_backward(q, k, v, out, lse, dout, *, dlse=None, layout="contiguous",
                            group=None, scale=None, causal=False, window=None, kv_lengths=None,
                            kernel="auto", precision=None):
    """(dq, dk, dv) of this rank's shards, for the out and lse ring_attention returned for
    them and dout (this rank's rows of the gradient of out; dlse, of lse, where the loss
    used it), in q's dtype. The options as ring_attention's, the same values (kernel "simt"
    takes the tuned SIMT backward kernel)."""
    ring = _ring(q, k, v, layout, group, scale, causal, window, kv_lengths)
    # the forward's kernel names as the backward takes them ("simt": its tuned kernel)
    options = dict(scale=ring.pb.scale, kernel=BACKWARD_KERNEL.get(kernel, kernel),
                   precision=precision)
    q32, out32, dout32 = (x.float() for x in (q, out, dout))
    dq = torch.zeros_like(q32)
    held = (k.float(), v.float(), torch.zeros_like(k, dtype=torch.float32),
            torch.zeros_like(v, dtype=torch.float32))
    for step in range(ring.world):
        owner = (ring.rank - step) % ring.world
        last = step + 1 == ring.world
        coming = None if last else _pass(ring, held[:2], owner - 1)
        for batch, rows, cols, how in _blocks(ring, owner, q):
            pick = _pick(batch, q)
            parts = flash_attention_backward(
                _part(q32, pick, rows), _part(held[0], pick, cols), _part(held[1], pick, cols),
                _part(out32, pick, rows), _part(lse, pick, rows), _part(dout32, pick, rows),
                dlse=None if dlse is None else _part(dlse, pick, rows),
                **_sides(how, cols, _count(batch, q), q.device), **options)
            for x, at, part in zip((dq, held[2], held[3]), (rows, cols, cols), parts):
                _add(x, pick, at, part)
        # dK, dV of the held shard go on with it; the last step's go home (its owner is
        # rank + 1), and this rank's own come from rank - 1
        grads = _pass(ring, held[2:], ring.rank if last else owner - 1)
        held = (held[:2] if last else coming.wait()) + grads.wait()
    return dq.to(q.dtype), held[2].to(k.dtype), held[3].to(v.dtype)


class _RingFunction(torch.autograd.Function):
    """ring_attention under autograd: (out, lse) forward, ring_attention_backward back."""

    @staticmethod
    def forward(ctx, q, k, v, options):
        out, lse = _forward(q, k, v, options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        grads = ring_attention_backward(q, k, v, out, lse, dout.contiguous(), dlse=dlse,
                                        **ctx.options)
        return grads + (None,)


def _forward(q, k, v, options):
    """(out, lse) of this rank's rows (ring_attention without autograd)."""
    options = dict(options)
    kernel, precision = options.pop("kernel"), options.pop("precision")
    ring = _ring(q, k, v, **options)
    settings = dict(scale=ring.pb.scale, kernel=kernel, precision=precision)
    out = torch.zeros(q.shape[:3] + v.shape[3:], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    held = (k.contiguous(), v.contiguous())
    for step in range(ring.world):
        owner = (ring.rank - step) % ring.world
        coming = _pass(ring, held, owner - 1) if step + 1 < ring.world else None
        for batch, rows, cols, how in _blocks(ring, owner, q):
            pick = _pick(batch, q)
            part_out, part_lse = forward_float32(
                _part(q, pick, rows), _part(held[0], pick, cols), _part(held[1], pick, cols),
                **_sides(how, cols, _count(batch, q), q.device), **settings)
            o, s = _part(out, pick, rows), _part(lse, pick, rows)
            merge_into(o, s, part_out, part_lse)
            if batch is not None:  # o and s are copies: put them back
                out[pick, :, rows], lse[pick, :, rows] = o, s
        if coming is not None:
            held = coming.wait()
    return out.to(q.dtype), lse


@dataclass(frozen=True)
class _Ring:
    """A call's ring: its group, this rank, the whole problem (pb, each batch element's
    keys) and every rank's ranges of q's and k's rows."""

    group: object
    world: int
    rank: int
    pb: object
    lengths: list
    q_ranges: list
    k_ranges: list


def _ring(q, k, v, layout, group, scale, causal, window, kv_lengths):
    """The _Ring of a call, the shards' lengths gathered from every rank and checked against
    the layout (a ValueError naming the rank), the options against the contract."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise TypeError(f"{name} must be a 4-D torch tensor (B, H, N, D), got "
                            f"{type(x).__name__} of shape {tuple(getattr(x, 'shape', ()))}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.tensor([q.shape[2], k.shape[2]], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    every = [tuple(int(n) for n in x.tolist()) for x in every]
    n_q, n_k = (sum(x[side] for x in every) for side in (0, 1))
    ranges = {"q": shard_ranges(n_q, world, layout), "k": shard_ranges(n_k, world, layout)}
    for side, name, n in ((0, "q", n_q), (1, "k", n_k)):
        for r, rows in enumerate(ranges[name]):
            if every[r][side] != shard_length(rows):
                raise ValueError(f"rank {r} holds {every[r][side]} rows of {name}; layout "
                                 f"{layout!r} gives it {shard_length(rows)} of {n} ({rows})")
    pb = check_attention_args(*(_whole(x, n) for x, n in ((q, n_q), (k, n_k), (v, n_k))),
                              scale=scale, causal=causal, window=window, kv_lengths=kv_lengths)
    return _Ring(group, world, rank, pb, row_lengths(pb, kv_lengths), ranges["q"],
                 ranges["k"])


def _whole(x, n):
    """A tensor of the whole problem's shape, no memory (the meta device), for the checks."""
    return torch.empty(x.shape[:2] + (n,) + x.shape[3:], dtype=x.dtype, device="meta")


def _blocks(ring, owner, q):
    """(batch, rows, cols, how) of every call this rank makes against rank owner's shard:
    batch None (every element) or a list of batch elements, rows its rows of q, cols the
    held shard's keys (slices of the local tensors), how a LocalBand or a mask's rows."""
    pb, q_at = ring.pb, 0
    for q_range in ring.q_ranges[ring.rank]:
        k_at = 0
        for k_range in ring.k_ranges[owner]:
            plans = {}  # batch elements with the same plan go in one call
            for b, kv_len in enumerate(ring.lengths):
                plan = block_plan(pb, kv_len, q_range, k_range)
                plans.setdefault(_plan_key(plan), (plan, []))[1].append(b)
            rows = slice(q_at, q_at + q_range[1] - q_range[0])
            for plan, batch in plans.values():
                for keys, how in plan:
                    cols = slice(k_at + keys[0] - k_range[0], k_at + keys[1] - k_range[0])
                    yield (None if len(batch) == pb.batch else batch), rows, cols, how
            k_at += k_range[1] - k_range[0]
        q_at += q_range[1] - q_range[0]


def _plan_key(plan):
    return tuple((keys, how if isinstance(how, LocalBand) else (how.shape, how.tobytes()))
                 for keys, how in plan)


def _pick(batch, q):
    return slice(None) if batch is None else torch.tensor(batch, device=q.device)


def _count(batch, q):
    return q.shape[0] if batch is None else len(batch)


def _part(x, pick, at):
    """x's batch elements `pick` and rows `at` (a view where pick takes every element)."""
    return x[pick][:, :, at] if isinstance(pick, torch.Tensor) else x[:, :, at]


def _add(x, pick, at, part):
    """x's batch elements `pick`, rows `at` += part."""
    if isinstance(pick, torch.Tensor):
        x[pick, :, at] += part.to(x.dtype)
    else:
        x[:, :, at] += part.to(x.dtype)


def _sides(how, cols, n_batch, device):
    """The causal, window and kv_lengths (or mask) of a call that `how` says."""
    if not isinstance(how, LocalBand):
        return dict(mask=torch.as_tensor(how, device=device)[None, None])
    lengths = None if how.kv_len >= cols.stop - cols.start else torch.full(
        (n_batch,), how.kv_len, dtype=torch.int32, device=device)
    return dict(causal=how.causal, window=how.window, kv_lengths=lengths)


class _Passing:
    """Tensors on their way from rank - 1: wait() gives them once they have landed."""

    def __init__(self, requests, tensors):
        self.requests, self.tensors = requests, tensors

    def wait(self):
        for request in self.requests:
            request.wait()
        return self.tensors


def _pass(ring, tensors, source):
    """Post the send of `tensors` (shaped as a shard's) to rank + 1 and the receive of their
    likes for rank `source`'s shard (mod world) from rank - 1; a _Passing of the received."""
    n = shard_length(ring.k_ranges[source % ring.world])
    coming = tuple(x.new_empty(x.shape[:2] + (n,) + x.shape[3:]) for x in tensors)
    if ring.world == 1:
        return _Passing([], tuple(x.clone() for x in tensors))
    ahead, behind = (ring.rank + 1) % ring.world, (ring.rank - 1) % ring.world
    # an empty shard (fewer rows than ranks) is neither sent nor received: both ends know
    ops = ([dist.P2POp(dist.isend, x.contiguous(), ahead, ring.group)
            for x in tensors if x.numel()]
           + [dist.P2POp(dist.irecv, x, behind, ring.group) for x in coming if x.numel()])
    return _Passing(dist.batch_isend_irecv(ops) if ops else [], coming)


def merge_into(out, lse, part_out, part_lse):
    """(out, lse) merged in place with a part over other keys (reference/merge.py's rule, in
    float32): a part or a row with no visible key (lse -inf) adds nothing and takes no NaN
    from the other side's weight."""
    top = torch.maximum(lse, part_lse)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    w_a, w_b = torch.exp(lse - top), torch.exp(part_lse - top)
    total = w_a + w_b
    lse.copy_(top + torch.log(total))
    w_a, w_b = (torch.where(total == 0, torch.zeros_like(w), w / total)[..., None]
                for w in (w_a, w_b))
    zero = torch.zeros((), dtype=out.dtype, device=out.device)
    out.copy_(torch.where(w_a == 0, zero, w_a * out)
              + torch.where(w_b == 0, zero, w_b * part_out))
