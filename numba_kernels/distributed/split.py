"""A call split across ranks by sequence, as every scheme computes it: the whole problem
and every rank's shards (`Split`, from `split_call`), the blocks of one rank's rows against
another rank's keys, each said with the kernel's own arguments (`blocks`, from
block_band.block_plan), a block's float32 parts forward and backward, and their merge by
lse (`merge_into`). ring.py and allgather.py pass the shards differently and share these.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reference.contract import check_attention_args, row_lengths
from reference.merge import merge
from ..backward import backward_float32
from ..forward import forward_float32
from .block_band import LocalBand, block_plan
from .sharding import shard_length, shard_ranges


@dataclass(frozen=True)
class Split:
    """A call's split: its group, this rank, the whole problem (pb, each batch element's
    keys) and every rank's ranges of q's and k's rows."""

    group: object
    world: int
    rank: int
    pb: object
    lengths: list
    q_ranges: list
    k_ranges: list


@dataclass(frozen=True)
class Block:
    """One call of the kernels: batch elements `batch` (None: every one), rows `rows` of a
    rank's q shard, keys `cols` of a rank's k shard (slices of the local tensors), `how` a
    LocalBand or a boolean mask's rows."""

    batch: object
    rows: slice
    cols: slice
    how: object


def split_call(q, k, v, layout, group, scale, causal, window, kv_lengths):
    """The Split of a call, the shards' lengths gathered from every rank and checked against
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
    return Split(group, world, rank, pb, row_lengths(pb, kv_lengths), ranges["q"],
                 ranges["k"])


def _whole(x, n):
    """A tensor of the whole problem's shape, no memory (the meta device), for the checks."""
    return torch.empty(x.shape[:2] + (n,) + x.shape[3:], dtype=x.dtype, device="meta")


def blocks(split, q_rank, k_rank):
    """The Blocks of rank q_rank's rows against rank k_rank's keys that show any pair."""
    pb, q_at = split.pb, 0
    for q_range in split.q_ranges[q_rank]:
        k_at = 0
        for k_range in split.k_ranges[k_rank]:
            plans = {}  # batch elements with the same plan go in one call
            for b, kv_len in enumerate(split.lengths):
                plan = block_plan(pb, kv_len, q_range, k_range)
                plans.setdefault(_plan_key(plan), (plan, []))[1].append(b)
            rows = slice(q_at, q_at + q_range[1] - q_range[0])
            for plan, batch in plans.values():
                for keys, how in plan:
                    cols = slice(k_at + keys[0] - k_range[0], k_at + keys[1] - k_range[0])
                    yield Block(None if len(batch) == pb.batch else batch, rows, cols, how)
            k_at += k_range[1] - k_range[0]
        q_at += q_range[1] - q_range[0]


def _plan_key(plan):
    return tuple((keys, how if isinstance(how, LocalBand) else (how.shape, how.tobytes()))
                 for keys, how in plan)


def block_forward(block, q, k, v, **settings):
    """(out, lse) of a block, out float32 unrounded (forward.forward_float32): q the rows'
    shard, k and v the keys'; settings: scale, kernel, precision."""
    pick = _pick(block.batch, q)
    return forward_float32(_part(q, pick, block.rows), _part(k, pick, block.cols),
                           _part(v, pick, block.cols), **_sides(block, q), **settings)


def merge_block(block, out, lse, part_out, part_lse):
    """out and lse (float32, the rows' shard) merged in place with a block's part."""
    pick = _pick(block.batch, out)
    o, s = _part(out, pick, block.rows), _part(lse, pick, block.rows)
    merge_into(o, s, part_out, part_lse)
    if block.batch is not None:  # o and s are copies: put them back
        out[pick, :, block.rows], lse[pick, :, block.rows] = o, s


def block_backward(block, q, k, v, out, lse, dout, dlse, **settings):
    """(dq, dk, dv) of a block, float32 unrounded (backward.backward_float32): q, out, lse,
    dout and dlse the rows' shard (the whole problem's out and lse for them), k and v the
    keys'."""
    pick = _pick(block.batch, q)
    rows = [None if x is None else _part(x, pick, block.rows) for x in (q, out, lse, dout, dlse)]
    return backward_float32(rows[0], _part(k, pick, block.cols), _part(v, pick, block.cols),
                            *rows[1:4], dlse=rows[4], **_sides(block, q), **settings)


def add_block(block, dq, dk, dv, parts):
    """A block's (dq, dk, dv) added into float32 dq (the rows' shard), dk and dv (the
    keys')."""
    pick = _pick(block.batch, dq)
    for x, at, part in zip((dq, dk, dv), (block.rows, block.cols, block.cols), parts):
        if isinstance(pick, torch.Tensor):
            x[pick, :, at] += part.to(x.dtype)
        else:
            x[:, :, at] += part.to(x.dtype)


def _pick(batch, x):
    return slice(None) if batch is None else torch.tensor(batch, device=x.device)


def _part(x, pick, at):
    """x's batch elements `pick` and rows `at` (a view where pick takes every element)."""
    return x[pick][:, :, at] if isinstance(pick, torch.Tensor) else x[:, :, at]


def _sides(block, q):
    """The causal, window and kv_lengths (or mask) of a block's call."""
    if not isinstance(block.how, LocalBand):
        return dict(mask=torch.as_tensor(block.how, device=q.device)[None, None])
    n_batch = q.shape[0] if block.batch is None else len(block.batch)
    lengths = None if block.how.kv_len >= block.cols.stop - block.cols.start else torch.full(
        (n_batch,), block.how.kv_len, dtype=torch.int32, device=q.device)
    return dict(causal=block.how.causal, window=block.how.window, kv_lengths=lengths)


def differentiable(forward, backward, q, k, v, options):
    """(out, lse) of a split call by forward(q, k, v, options); under autograd (grad enabled,
    q, k or v requiring it) its gradients by backward(q, k, v, out, lse, dout, dlse=...,
    **options), every rank's backward pass run together as their forwards were."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _SplitFunction.apply(q, k, v, forward, backward, options)
    return forward(q, k, v, options)


class _SplitFunction(torch.autograd.Function):
    """A split call under autograd: (out, lse) forward, the scheme's backward back."""

    @staticmethod
    def forward(ctx, q, k, v, forward, backward, options):
        out, lse = forward(q, k, v, options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backward, ctx.options = backward, options
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        grads = ctx.backward(q, k, v, out, lse, dout.contiguous(), dlse=dlse, **ctx.options)
        return grads + (None, None, None)


def merge_into(out, lse, part_out, part_lse):
    """(out, lse) merged in place with a part over other keys: reference.merge's rule (a
    part or a row with no visible key adds nothing), in their float32."""
    merged_out, merged_lse = merge((out, lse), (part_out, part_lse))
    out.copy_(merged_out)
    lse.copy_(merged_lse)
