"""Ring attention's forward on torch.distributed: Q, K and V sharded by sequence (sharding.py),
each rank's K and V blocks passed around the ring while the rank computes with the block it
holds, every block's result merged into the rank's rows by their lse.

Step s of W: rank r holds the K, V shard of rank (r - s) mod W; it posts the send of that
shard to rank r + 1 and the receive of the next from rank r - 1, computes its rows against
the shard it holds (block_band.block_plan: the whole problem's band as each block's own
arguments), merges, and waits. The parts are forward_float32's (out unrounded), merged in
float32 and rounded once at the end: W parts add no rounding of their own.
"""
import torch
import torch.distributed as dist

from reference.contract import check_attention_args
from ..forward import forward_float32
from .block_band import LocalBand, block_plan
from .sharding import shard_length, shard_ranges


def ring_attention(q, k, v, *, layout="contiguous", group=None, scale=None, causal=False,
                   window=None, kv_lengths=None, return_lse=False, kernel="auto",
                   precision=None):
    """This rank's rows of attention over the whole sequence (docs/contract.md), out (and lse
    where return_lse) for the rank's rows of q, in q's dtype (lse float32).

    q (B, Hq, nq, D), k (B, Hk, nk, D), v (B, Hk, nk, Dv): this rank's rows of the whole
    problem's, sharded by `layout` ("contiguous" or "zigzag": sharding.shard_ranges over
    the ranks of `group`, the default group if None), torch tensors on this rank's device.
    causal, window, kv_lengths ((B,) of the whole problem's keys, the same on every rank),
    scale: as flash_attention takes them for the whole problem. kernel, precision: as
    flash_attention's, for every block. Every rank of the group calls it together."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n_q, n_k, shards = _sizes(q, k, layout, group, world)
    pb = check_attention_args(*(_whole(x, n) for x, n in ((q, n_q), (k, n_k), (v, n_k))),
                              scale=scale, causal=causal, window=window, kv_lengths=kv_lengths)
    lengths = _lengths(kv_lengths, pb)
    out = torch.zeros(q.shape[:3] + v.shape[3:], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    held = (k.contiguous(), v.contiguous())
    for step in range(world):
        owner = (rank - step) % world
        pending, coming = None, None
        if step + 1 < world:  # the next shard comes from rank - 1 while this one is used
            coming = tuple(x.new_empty(x.shape[:2] + (shard_length(shards["k"][
                (owner - 1) % world]),) + x.shape[3:]) for x in held)
            pending = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, x, (rank + 1) % world, group) for x in held]
                + [dist.P2POp(dist.irecv, x, (rank - 1) % world, group) for x in coming])
        _add_shard(out, lse, q, held, shards["q"][rank], shards["k"][owner], pb, lengths,
                   dict(scale=pb.scale, kernel=kernel, precision=precision))
        if pending is not None:
            for request in pending:
                request.wait()
            held = coming
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def _sizes(q, k, layout, group, world):
    """(n_q, n_k, {"q": ranges, "k": ranges}) of the whole problem, from every rank's shard
    lengths, which must be those `layout` gives (a ValueError naming the rank otherwise)."""
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise TypeError(f"{name} must be a 4-D torch tensor (B, H, N, D), got "
                            f"{type(x).__name__} of shape {tuple(getattr(x, 'shape', ()))}")
    mine = torch.tensor([q.shape[2], k.shape[2]], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    every = [tuple(int(n) for n in x.tolist()) for x in every]
    n_q, n_k = (sum(x[side] for x in every) for side in (0, 1))
    shards = {"q": shard_ranges(n_q, world, layout), "k": shard_ranges(n_k, world, layout)}
    for side, name, n in ((0, "q", n_q), (1, "k", n_k)):
        for r, ranges in enumerate(shards[name]):
            if every[r][side] != shard_length(ranges):
                raise ValueError(f"rank {r} holds {every[r][side]} rows of {name}; layout "
                                 f"{layout!r} gives it {shard_length(ranges)} of {n} "
                                 f"({ranges})")
    return n_q, n_k, shards


def _whole(x, n):
    """A tensor of the whole problem's shape, no memory (the meta device), for the checks."""
    return torch.empty(x.shape[:2] + (n,) + x.shape[3:], dtype=x.dtype, device="meta")


def _lengths(kv_lengths, pb):
    """Each batch element's keys of the whole problem, as Python ints."""
    if kv_lengths is None:
        return [pb.n_k] * pb.batch
    return [int(n) for n in torch.as_tensor(kv_lengths).reshape(-1).tolist()]


def _add_shard(out, lse, q, held, q_ranges, k_ranges, pb, lengths, options):
    """Merge into out and lse (this rank's rows) every block of its rows by the keys of the
    shard `held` (k, v), whose rows of the whole problem are k_ranges."""
    q_at = 0
    for q_range in q_ranges:
        k_at = 0
        for k_range in k_ranges:
            plans = {}  # batch elements with the same plan go in one call
            for b, kv_len in enumerate(lengths):
                plan = block_plan(pb.n_q, kv_len, pb.left, pb.right, pb.bottom_right,
                                  q_range, k_range)
                plans.setdefault(_plan_key(plan), (plan, []))[1].append(b)
            for plan, batch in plans.values():
                for keys, how in plan:
                    rows = slice(q_at, q_at + q_range[1] - q_range[0])
                    cols = slice(k_at + keys[0] - k_range[0], k_at + keys[1] - k_range[0])
                    _add_part(out, lse, q, held, batch, rows, cols, how, options)
            k_at += k_range[1] - k_range[0]
        q_at += q_range[1] - q_range[0]


def _plan_key(plan):
    return tuple((keys, how if isinstance(how, LocalBand) else tuple(map(tuple, how)))
                 for keys, how in plan)


def _add_part(out, lse, q, held, batch, rows, cols, how, options):
    """One call (q's rows `rows`, the held shard's keys `cols`, batch elements `batch`)
    merged into out and lse."""
    every = len(batch) == q.shape[0]
    pick = slice(None) if every else torch.tensor(batch, device=q.device)
    k, v = (x[pick][:, :, cols] for x in held)
    if isinstance(how, LocalBand):
        n_keys = cols.stop - cols.start
        lengths = None if how.kv_len >= n_keys else torch.full(
            (len(batch),), how.kv_len, dtype=torch.int32, device=q.device)
        sides = dict(causal=how.causal, window=how.window, kv_lengths=lengths)
    else:
        sides = dict(mask=torch.tensor(how, dtype=torch.bool, device=q.device)[None, None])
    part_out, part_lse = forward_float32(q[pick][:, :, rows], k, v, **sides, **options)
    if every:
        merge_into(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
    else:
        o, s = out[pick][:, :, rows], lse[pick][:, :, rows]
        merge_into(o, s, part_out, part_lse)
        out[pick, :, rows], lse[pick, :, rows] = o, s


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
