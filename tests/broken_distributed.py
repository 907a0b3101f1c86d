"""Deliberately broken distributed attention, in verify/distributed.py's per-rank protocol:
verify.compare(..., world_size=N) must fail each for its reason."""


def own_keys_only(q, k, v, *, layout, group, **options):
    """Each rank attends to its own shard's keys alone, as if they were the whole sequence
    (a ring that never passes K and V on). Under a top-left causal band with contiguous
    shards rank 0's rows are right (they see only its keys); the others' are not."""
    from numba_kernels import flash_attention

    return flash_attention(q, k, v, **options)
