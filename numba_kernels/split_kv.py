"""Split-KV: more thread blocks when the query tiles alone cannot fill the GPU (decoding).

With few query rows (Nq = 1 when decoding) there are only B * Hq * ceil(Nq / BLOCK_M) blocks,
fewer than the SMs, and each walks every key. Cut the keys each block sees (its band: causal,
window, kv_lengths) into n_splits shares of whole split_keys (schedule.key_tiles: the widest key tile of the kernels a call launches); the kernel
then runs one block per (split, query tile, batch, head), each writing a partial (out, lse)
over its share in float32, and `merge_splits` combines them with reference/merge.py's rule:

    lse = log(sum_s exp(lse_s)),    out = sum_s exp(lse_s - lse) * out_s

A split with no visible key (lse_s = -inf) adds nothing; a row that sees no key in any split
gets out = 0 and lse = -inf, as without splitting. NaN in a split's lse or out reaches the row.
"""
import math

from numba import cuda

from .common import NEG_INF, ZERO
from .convert import int64, CONVERTERS

FILL_BLOCKS_PER_SM = 4  # resident blocks an SM holds of the SIMT kernel at D = 128 (PERF.md)
MIN_TILES_PER_SPLIT = 4  # key tiles a split walks at least: a split is worth a block


def choose_splits(blocks, n_k, block_n, n_sm, resident=FILL_BLOCKS_PER_SM):
    """How many shares to cut each block's keys into (split_count's).

    blocks: thread blocks without splitting; resident: blocks of the split variant an SM
    holds at once (launch.resident_blocks). Splits as far as one wave of resident blocks
    holds them all, n_sm * resident, and no further: a launch of a wave and a part waits on
    its last part, which leaves most SMs idle (PERF.md, decoding); a launch that already
    fills more than half a wave is not
    split (it would pay the merge and gain no SM), and a split of all Nk keys walks at least
    MIN_TILES_PER_SPLIT key tiles of block_n."""
    key_tiles = -(-n_k // block_n)
    want = n_sm * resident // blocks
    return split_count(n_k, block_n, max(1, min(want, key_tiles // MIN_TILES_PER_SPLIT)))


def split_count(n_k, split_keys, n_splits):
    """n_splits, at most the pieces of split_keys keys that Nk holds (no share of all Nk keys
    empty), at least 1."""
    return max(1, min(n_splits, -(-n_k // split_keys)))


def merge_source(dtype):
    """The merge kernel for outputs of `dtype`: one thread per output element."""
    _, store, _ = CONVERTERS[dtype]

    def merge_splits(out_part, lse_part, out, lse, n_splits):
        """out_part (n_splits * B, Hq, Nq, Dv) and lse_part (n_splits * B, Hq, Nq), float32,
        split s of batch b at s * B + b; out (B, Hq, Nq, Dv) and lse (B, Hq, Nq)."""
        batch, heads, n_q, d_v = out.shape
        idx = int64(cuda.grid(1))
        if idx >= batch * heads * n_q * d_v:
            return
        c = idx % d_v
        row = idx // d_v % n_q
        h = idx // (d_v * n_q) % heads
        b = idx // (d_v * n_q * heads)
        m = NEG_INF
        for s in range(n_splits):
            x = lse_part[s * batch + b, h, row]
            if x > m:  # a NaN lse never wins: it reaches the row through its weight below
                m = x
        m_safe = ZERO if m == NEG_INF else m
        total = ZERO
        acc = ZERO
        for s in range(n_splits):
            x = lse_part[s * batch + b, h, row]
            if x != NEG_INF:  # an empty split adds nothing (its out is 0, its weight 0)
                w = math.exp(x - m_safe)
                total += w
                acc += w * out_part[s * batch + b, h, row, c]
        empty = total == ZERO
        out[b, h, row, c] = store(ZERO if empty else acc / total)
        if c == 0:
            lse[b, h, row] = NEG_INF if empty else m_safe + math.log(total)

    return merge_splits
