"""Deliberately broken distributed attention, in verify/distributed.py's per-rank protocol:
verify.compare(..., world_size=N) must fail each for its reason."""
from verify.adapters import Implementation, Supports


def own_keys_only(q, k, v, *, layout, group, **options):
    """Each rank attends to its own shard's keys alone, as if they were the whole sequence
    (a ring that never passes K and V on). Under a top-left causal band with contiguous
    shards rank 0's rows are right (they see only its keys); the others' are not."""
    from numba_kernels import flash_attention

    return flash_attention(q, k, v, **options)


def raises_on_rank_1(q, k, v, *, layout, group, **options):
    """Ring attention whose rank 1 raises at once: rank 0 waits on it mid-call."""
    import torch.distributed as dist

    from numba_kernels.distributed.ring import ring_attention

    if dist.get_rank(group) == 1:
        raise ValueError("rank 1 gives up")
    return ring_attention(q, k, v, layout=layout, group=group, **options)


def naive_merge(q, k, v, *, layout, group, **options):
    """Ring attention whose merge is the textbook lse = lse_a + log(1 + exp(lse_b - lse_a)),
    with no shift by the larger: where two ranks' parts of a row differ by more than
    float32's exp range (about 88), it overflows (the bug fixed elsewhere with logsigmoid)."""
    import torch

    def merge_into(out, lse, part_out, part_lse):
        with torch.no_grad():
            first = torch.isneginf(lse)
            new = torch.where(first, part_lse, lse + torch.log1p(torch.exp(part_lse - lse)))
            w_a = torch.where(first, torch.zeros_like(lse), torch.exp(lse - new))[..., None]
            w_b = torch.exp(part_lse - new)[..., None]
            out.copy_(w_a * out + w_b * part_out)
            lse.copy_(new)

    with _patched("merge_into", lambda real: merge_into, "split") as ring:
        return ring.ring_attention(q, k, v, layout=layout, group=group, **options)


def _patched(name, replacement, module="ring"):
    """A context in which <module>.<name> (numba_kernels.distributed's ring or split) is
    `replacement` (given the original); it gives the ring module."""
    import contextlib
    import importlib

    from numba_kernels.distributed import ring

    where = importlib.import_module(f"numba_kernels.distributed.{module}")

    @contextlib.contextmanager
    def context():
        kept = getattr(where, name)
        setattr(where, name, replacement(kept))
        try:
            yield ring
        finally:
            setattr(where, name, kept)

    return context()


def wrong_zigzag_order(q, k, v, *, layout, group, **options):
    """Ring attention that takes a rank's zigzag chunks in the wrong order (the late chunk
    first): its causal band is wrong (without a band, the order of rows and keys cannot
    matter)."""
    def ranges(real):
        return lambda n, world, layout: [tuple(reversed(r)) for r in real(n, world, layout)]

    with _patched("shard_ranges", ranges, "split") as ring:
        return ring.ring_attention(q, k, v, layout=layout, group=group, **options)


def offsets_from_own_length(q, k, v, *, layout, group, **options):
    """Ring attention that places rank r's rows at r times its own shard's length (right
    only where the ranks' shards are equally long)."""
    def ranges(real):
        def wrong(n, world, layout):
            true = real(n, world, layout)
            return [((r * (b - a), r * (b - a) + b - a),) for r, ((a, b),) in enumerate(true)]
        return wrong

    with _patched("shard_ranges", ranges, "split") as ring:
        return ring.ring_attention(q, k, v, layout=layout, group=group, **options)


def local_kv_lengths(q, k, v, *, layout, group, **options):
    """Ring attention whose ranks read kv_lengths as counts of their own shard's keys (the
    whole sequence's option taken locally): a rank whose keys are all hidden shows some."""
    def plan(real):
        return lambda pb, kv_len, q_range, k_range: real(
            pb, min(kv_len + k_range[0], pb.n_k), q_range, k_range)

    with _patched("block_plan", plan, "split") as ring:
        return ring.ring_attention(q, k, v, layout=layout, group=group, **options)


def drops_last_shard(q, k, v, *, layout, group, **options):
    """Ring attention whose loop ends a step early for the last rank's shard: no rank uses
    the keys of rank W - 1."""
    def blocks(real):
        return lambda split, q_rank, k_rank: (iter(()) if k_rank == split.world - 1
                                              else real(split, q_rank, k_rank))

    with _patched("blocks", blocks) as ring:
        return ring.ring_attention(q, k, v, layout=layout, group=group, **options)


def stale_kv_grad(q, k, v, dout, *, layout, group, **options):
    """A per-rank grad (verify/distributed.py's protocol) of ring attention whose backward's
    second step computes with the K and V of its first (the received shard is never swapped
    in; dK and dV still travel): the forward is right, the gradients are not."""
    from numba_kernels.distributed import ring

    def pass_stale(real):
        calls = []

        def passing(r, tensors, source):
            got = real(r, tensors, source)
            calls.append(source)
            if len(calls) == 1:  # the first pass is of K and V: its result is never used
                got.tensors = tuple(x.clone() for x in tensors)
            return got
        return passing

    options.pop("return_lse", None)
    out, lse = ring.ring_attention(q, k, v, layout=layout, group=group, return_lse=True,
                                   **options)
    with _patched("_pass", pass_stale):
        return ring.ring_attention_backward(q, k, v, out, lse, dout, layout=layout,
                                            group=group, **options)


# wrong_zigzag_order as `pytest conformance --impl tests.broken_distributed:WRONG_ZIGZAG
# --world-size 2` loads it (what ring attention claims, the per-rank protocol)
WRONG_ZIGZAG = Implementation("wrong zigzag order", wrong_zigzag_order,
                              Supports(mask=False, bias=False), array="torch", per_rank=True)
