"""The seed's scheme on torch.distributed: each rank computes every query row against its own
shard of K and V, and the parts of a row are merged by their lse at the row's rank.

Forward: q's shards are all-gathered (every rank then holds every query); each rank computes
the blocks of every rank's rows against its keys (split.blocks: the whole problem's band as
each block's own arguments; float32 parts); the parts of rank j's rows go to rank j (a
gather), which merges them in rank order (split.merge_into) and rounds once. No step waits
on a neighbour: one all-gather before the products, one gather a rank after them.

Backward: q, out, lse and dout (and dlse) all-gathered; each rank computes the blocks of
every row against its keys: its shard's dK and dV whole, and every rank's part of dQ, which
goes to that rank and is summed there in rank order (float32, rounded once).

Against ring.py: the same blocks and the same parts, with no ring to wait on, for W times
the queries' memory on every rank (every rank holds q, and in the backward out and dout).
"""
import torch
import torch.distributed as dist

from ..plan import BACKWARD_KERNEL
from .sharding import all_shards, shard_length
from .split import (add_block, block_backward, block_forward, blocks, differentiable,
                    merge_block, merge_into, split_call)


def allgather_attention(q, k, v, *, layout="contiguous", group=None, scale=None, causal=False,
                        window=None, kv_lengths=None, return_lse=False, kernel="auto",
                        precision=None):
    """This rank's rows of attention over the whole sequence, by the seed's scheme; the same
    arguments and results as ring.ring_attention (docs/contract.md, "Sharding");
    differentiable (allgather_attention_backward)."""
    options = dict(layout=layout, group=group, scale=scale, causal=causal, window=window,
                   kv_lengths=kv_lengths, kernel=kernel, precision=precision)
    out, lse = differentiable(_forward, allgather_attention_backward, q, k, v, options)
    return (out, lse) if return_lse else out


def allgather_attention_backward(q, k, v, out, lse, dout, *, dlse=None, layout="contiguous",
                                 group=None, scale=None, causal=False, window=None,
                                 kv_lengths=None, kernel="auto", precision=None):
    """(dq, dk, dv) of this rank's shards, as ring.ring_attention_backward's, by the seed's
    scheme."""
    split = split_call(q, k, v, layout, group, scale, causal, window, kv_lengths)
    settings = dict(scale=split.pb.scale, kernel=BACKWARD_KERNEL.get(kernel, kernel),
                    precision=precision)
    rows = [_gathered(split, x) for x in (q, out, lse, dout)]
    dlses = [None] * split.world if dlse is None else _gathered(split, dlse)
    dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (k, v))
    dq_parts = []
    for j in range(split.world):
        dq_j = torch.zeros_like(rows[0][j], dtype=torch.float32)
        for block in blocks(split, j, split.rank):
            parts = block_backward(block, rows[0][j], k, v, *(x[j] for x in rows[1:]),
                                   dlses[j], **settings)
            add_block(block, dq_j, dk, dv, parts)
        dq_parts.append(dq_j)
    dq = torch.zeros_like(q, dtype=torch.float32)
    for part in _to_owners(split, dq_parts):  # in rank order: the same bits every run
        dq += part
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _forward(q, k, v, options):
    """(out, lse) of this rank's rows (allgather_attention without autograd)."""
    options = dict(options)
    kernel, precision = options.pop("kernel"), options.pop("precision")
    split = split_call(q, k, v, **options)
    settings = dict(scale=split.pb.scale, kernel=kernel, precision=precision)
    outs, lses = [], []
    for j, q_j in enumerate(_gathered(split, q)):
        out_j = torch.zeros(q_j.shape[:3] + v.shape[3:], dtype=torch.float32, device=q.device)
        lse_j = torch.full(q_j.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        for block in blocks(split, j, split.rank):
            merge_block(block, out_j, lse_j, *block_forward(block, q_j, k, v, **settings))
        outs.append(out_j)
        lses.append(lse_j)
    out = torch.zeros(q.shape[:3] + v.shape[3:], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for part_out, part_lse in zip(_to_owners(split, outs), _to_owners(split, lses)):
        merge_into(out, lse, part_out, part_lse)
    return out.to(q.dtype), lse


def _gathered(split, x):
    """Every rank's shard of x (rows of q's shards along dim 2), a list in rank order."""
    return all_shards(x.contiguous(), [shard_length(r) for r in split.q_ranges], split.group)


def _to_owners(split, parts):
    """parts[j] (this rank's tensor for rank j's rows) sent to rank j: the list, in rank
    order, of every rank's tensor for this rank's rows."""
    mine = None
    for j, part in enumerate(parts):
        into = [torch.empty_like(part) for _ in range(split.world)] if j == split.rank \
            else None
        dist.gather(part.contiguous(), into, group=split.group, group_dst=j)
        mine = into if j == split.rank else mine
    return mine
