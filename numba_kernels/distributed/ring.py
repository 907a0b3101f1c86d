"""Ring attention on torch.distributed: Q, K and V sharded by sequence (sharding.py), each
rank's K and V passed around the ring while the rank computes with the shard it holds.

Forward, step s of W: rank r holds the K, V shard of rank (r - s) mod W; it posts the send of
that shard to rank r + 1 and the receive of the next from rank r - 1, computes its rows
against the shard it holds (block_band.block_plan: the whole problem's band as each block's
own arguments), merges, and waits. The parts are forward_float32's (out unrounded), merged in
float32 and rounded once at the end: W parts add no rounding of their own. The blocks, their
parts and the merge are split.py's.

Backward: the same ring, each block's gradients from the backward kernels with the whole
problem's out and lse for the rank's rows (P = exp(S - lse) and delta = rowsum(dO * out) are
then the whole problem's, so a block's dQ, dK and dV are exactly its share). dQ stays on the
rank; dK and dV of the held shard travel with it, and a last hop takes them home. The blocks'
gradients are backward.backward_float32's, unrounded (W roundings would add up; for 16-bit
inputs the scores are recomputed as the forward's blocks made them, bit for bit), summed in
float32, rounded once.
"""
import torch
import torch.distributed as dist

from ..plan import BACKWARD_KERNEL
from .sharding import shard_length
from .split import (add_block, block_backward, block_forward, blocks, differentiable,
                    merge_block, split_call)


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
    out, lse = differentiable(_forward, ring_attention_backward, q, k, v, options)
    return (out, lse) if return_lse else out


def ring_attention_backward(q, k, v, out, lse, dout, *, dlse=None, layout="contiguous",
                            group=None, scale=None, causal=False, window=None, kv_lengths=None,
                            kernel="auto", precision=None):
    """(dq, dk, dv) of this rank's shards, for the out and lse ring_attention returned for
    them and dout (this rank's rows of the gradient of out; dlse, of lse, where the loss
    used it), in q's dtype. The options as ring_attention's, the same values (kernel "simt"
    takes the tuned SIMT backward kernel)."""
    ring = split_call(q, k, v, layout, group, scale, causal, window, kv_lengths)
    # the forward's kernel names as the backward takes them ("simt": its tuned kernel)
    settings = dict(scale=ring.pb.scale, kernel=BACKWARD_KERNEL.get(kernel, kernel),
                    precision=precision)
    dq = torch.zeros_like(q, dtype=torch.float32)
    held = (k.contiguous(), v.contiguous(), torch.zeros_like(k, dtype=torch.float32),
            torch.zeros_like(v, dtype=torch.float32))
    for step in range(ring.world):
        owner = (ring.rank - step) % ring.world
        last = step + 1 == ring.world
        coming = None if last else _pass(ring, held[:2], owner - 1)
        for block in blocks(ring, ring.rank, owner):
            parts = block_backward(block, q, *held[:2], out, lse, dout, dlse, **settings)
            add_block(block, dq, *held[2:], parts)
        # dK, dV of the held shard go on with it; the last step's go home (its owner is
        # rank + 1), and this rank's own come from rank - 1
        grads = _pass(ring, held[2:], ring.rank if last else owner - 1)
        held = (held[:2] if last else coming.wait()) + grads.wait()
    return dq.to(q.dtype), held[2].to(k.dtype), held[3].to(v.dtype)


def _forward(q, k, v, options):
    """(out, lse) of this rank's rows (ring_attention without autograd)."""
    options = dict(options)
    kernel, precision = options.pop("kernel"), options.pop("precision")
    ring = split_call(q, k, v, **options)
    settings = dict(scale=ring.pb.scale, kernel=kernel, precision=precision)
    out = torch.zeros(q.shape[:3] + v.shape[3:], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    held = (k.contiguous(), v.contiguous())
    for step in range(ring.world):
        owner = (ring.rank - step) % ring.world
        coming = _pass(ring, held, owner - 1) if step + 1 < ring.world else None
        for block in blocks(ring, ring.rank, owner):
            merge_block(block, out, lse, *block_forward(block, q, *held, **settings))
        if coming is not None:
            held = coming.wait()
    return out.to(q.dtype), lse


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
