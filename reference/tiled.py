"""The FlashAttention-2 forward algorithm, tile by tile, as the Numba kernel performs it.

Read it beside numba_kernels/flash_fwd.py: the names are the same. One "program" handles
BLOCK_M query rows of one (batch, head); it walks the key/value tiles of BLOCK_N keys that its
rows can see and keeps, per row, a running max m_i, a running sum l_i and an unnormalised
accumulator acc. Exponentials are base 2 with log2(e) folded into qk_scale, as on the GPU.

This is for reading and for checking: it agrees with reference.attention to ~1e-12 relative
and is not fast (a Python loop over tiles).
"""
import math

from ._xp import array_namespace, quiet
from .contract import check_attention_args, check_flag, row_lengths, row_ranges
from .naive import seen, visible, weighted_values

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def attention_tiled(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
                    kv_lengths=None, window=None, return_lse=False, BLOCK_M=16, BLOCK_N=16):
    """Same arguments and results as reference.attention (float64), computed tile by tile."""
    pb = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                              kv_lengths=kv_lengths, window=window)
    xp = array_namespace(q, k, v)
    q, k, v = (xp.asarray(x, dtype="float64") for x in (q, k, v))
    full = (pb.batch, pb.heads_q, pb.n_q, pb.n_k)
    mask = None if mask is None else xp.broadcast_to(xp.asarray(mask), full)
    bias = None if bias is None else xp.broadcast_to(xp.asarray(bias).astype("float64"), full)
    out = xp.zeros((pb.batch, pb.heads_q, pb.n_q, pb.dv))
    lse = xp.full((pb.batch, pb.heads_q, pb.n_q), -xp.inf)
    qk_scale = pb.scale * LOG2E  # exp(x) = exp2(x * log2(e))
    for b, kv_len in enumerate(row_lengths(pb, kv_lengths)):
        for h in range(pb.heads_q):
            hk = h // pb.group  # grouped-query attention: query head h reads key head h // G
            for start_m in range(0, pb.n_q, BLOCK_M):
                rows = slice(start_m, min(pb.n_q, start_m + BLOCK_M))
                o, l_ = _program(pb, q[b, h, rows], k[b, hk], v[b, hk], kv_len, start_m,
                                 None if mask is None else mask[b, h, rows],
                                 None if bias is None else bias[b, h, rows],
                                 qk_scale, BLOCK_N, xp)
                out[b, h, rows], lse[b, h, rows] = o, l_
    return (out, lse) if check_flag("return_lse", return_lse) else out


def _program(pb, q_tile, k, v, kv_len, start_m, mask, bias, qk_scale, BLOCK_N, xp):
    """One thread block: BLOCK_M rows of one (batch, head) against all visible key tiles."""
    n_rows = q_tile.shape[0]
    lo, hi = row_ranges(pb, kv_len, start_m, start_m + n_rows)
    m_i = xp.full(n_rows, -xp.inf)  # running max of the scaled scores (log2 units)
    l_i = xp.zeros(n_rows)  # running sum of exp2(s - m_i)
    acc = xp.zeros((n_rows, v.shape[-1]))  # running sum of exp2(s - m_i) * v
    # Skip the tiles no row of this block can see (causal, window, kv_lengths).
    first = max(0, min(lo)) // BLOCK_N * BLOCK_N
    last = min(kv_len, max(hi))
    with quiet(xp):
        for start_n in range(first, last, BLOCK_N):
            end_n = min(last, start_n + BLOCK_N)  # the last tile may be partial
            cols = slice(start_n, end_n)
            keep = visible(lo, hi, start_n, end_n, None if mask is None else mask[:, cols],
                           None if bias is None else bias[:, cols], xp)
            s = (q_tile @ k[cols].T) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
            if bias is not None:
                s = s + bias[:, cols] * LOG2E
            if keep is not None:
                s = xp.where(keep, s, -xp.inf)
            keep = seen(s, xp)  # -inf scores take no part, however they arose
            m_new = xp.maximum(m_i, s.max(axis=1))  # NaN propagates
            m_safe = xp.where(m_new == -xp.inf, 0.0, m_new)  # fully-masked guard
            alpha = xp.exp2(m_i - m_safe)  # rescales what was summed under the old max
            p = xp.exp2(s - m_safe[:, None])
            l_i = alpha * l_i + p.sum(axis=1)
            acc = alpha[:, None] * acc + weighted_values(p, keep, v[cols], xp)
            m_i = m_new
        out = xp.where((l_i == 0)[:, None], 0.0, acc / l_i[:, None])
        lse = (m_i + xp.log2(l_i)) * LN2  # l_i == 0 (no visible key) gives -inf
    return out, lse
