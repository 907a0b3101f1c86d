"""Deliberately broken distributed attention, in verify/distributed.py's per-rank protocol:
verify.compare(..., world_size=N) must fail each for its reason."""


def own_keys_only(q, k, v, *, layout, group, **options):
    """Each rank attends to its own shard's keys alone, as if they were the whole sequence
    (a ring that never passes K and V on). Under a top-left causal band with contiguous
    shards rank 0's rows are right (they see only its keys); the others' are not."""
    from numba_kernels import flash_attention

    return flash_attention(q, k, v, **options)


def naive_merge(q, k, v, *, layout, group, **options):
    """Ring attention whose merge is the textbook lse = lse_a + log(1 + exp(lse_b - lse_a)),
    with no shift by the larger: where two ranks' parts of a row differ by more than
    float32's exp range (about 88), it overflows (the bug fixed elsewhere with logsigmoid)."""
    import torch

    from numba_kernels.distributed import ring

    def merge_into(out, lse, part_out, part_lse):
        with torch.no_grad():
            first = torch.isneginf(lse)
            new = torch.where(first, part_lse, lse + torch.log1p(torch.exp(part_lse - lse)))
            w_a = torch.where(first, torch.zeros_like(lse), torch.exp(lse - new))[..., None]
            w_b = torch.exp(part_lse - new)[..., None]
            out.copy_(w_a * out + w_b * part_out)
            lse.copy_(new)

    kept, ring.merge_into = ring.merge_into, merge_into
    try:
        return ring.ring_attention(q, k, v, layout=layout, group=group, **options)
    finally:
        ring.merge_into = kept
