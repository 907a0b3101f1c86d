"""The FlashAttention-2 backward algorithm, tile by tile, as a kernel performs it.

Read it beside tiled.py (the forward). The forward saved out and lse; the backward never
stores P. It runs in two steps:

1. Preprocessing: delta = rowsum(dO * O), one number per query row.
2. One "program" per key tile of BLOCK_N keys of a (batch, key head): it keeps its K and V
   tiles and the accumulators dk_acc, dv_acc, and walks every query tile of BLOCK_M rows of
   the G query heads of its group that can see its keys:

       S  = Q K^T * qk_scale (+ bias), log2 units, -inf where hidden
       P  = exp2(S - lse * log2(e))         recomputed from the saved lse: the normalised P
       dV += P^T dO
       dP = dO V^T                           (0 where hidden)
       dS = P * (dP - delta)
       dK += dS^T Q * scale
       dQ += dS K * scale                    every key tile adds to the query tile's dQ

   dK and dV of a key tile are written once, summed over the group's heads (GQA); dQ gathers
   the contributions of all key tiles (on a GPU: atomic adds, or partial sums reduced in a
   fixed order; here in key-tile order).

For reading and checking: it agrees with reference.attention_backward to ~1e-12 relative.
"""
from ._xp import array_namespace, quiet
from .backward import check_dout
from .contract import check_attention_args, row_lengths, row_ranges
from .naive import attention, seen, visible, weighted_values
from .tiled import LOG2E


def attention_backward_tiled(q, k, v, dout, *, scale=None, causal=False, mask=None,
                             bias=None, kv_lengths=None, window=None, BLOCK_M=16, BLOCK_N=16):
    """Same arguments and results as reference.attention_backward (float64, no dbias),
    computed key tile by key tile."""
    options = dict(scale=scale, causal=causal, mask=mask, bias=bias, kv_lengths=kv_lengths,
                   window=window)
    pb = check_attention_args(q, k, v, **options)
    check_dout(pb, dout)
    xp = array_namespace(q, k, v, dout)
    q, k, v, dout = (xp.asarray(x, dtype="float64") for x in (q, k, v, dout))
    out, lse = attention(q, k, v, return_lse=True, **options)  # what the forward saved
    delta = (dout * out).sum(axis=-1)  # step 1: rowsum(dO * O)
    full = (pb.batch, pb.heads_q, pb.n_q, pb.n_k)
    mask = None if mask is None else xp.broadcast_to(xp.asarray(mask), full)
    bias = None if bias is None else xp.broadcast_to(xp.asarray(bias).astype("float64"), full)
    dq, dk, dv = xp.zeros(q.shape), xp.zeros(k.shape), xp.zeros(v.shape)
    for b, kv_len in enumerate(row_lengths(pb, kv_lengths)):
        for hk in range(pb.heads_k):
            for start_n in range(0, kv_len, BLOCK_N):  # step 2: one program per key tile
                cols = slice(start_n, min(kv_len, start_n + BLOCK_N))
                heads = range(hk * pb.group, (hk + 1) * pb.group)
                dk[b, hk, cols], dv[b, hk, cols] = _key_program(
                    pb, b, heads, kv_len, cols, q, k[b, hk, cols], v[b, hk, cols], dout, lse,
                    delta, mask, bias, dq, BLOCK_M, xp)
    return dq, dk, dv


def _key_program(pb, b, heads, kv_len, cols, q, k_tile, v_tile, dout, lse, delta, mask,
                 bias, dq, BLOCK_M, xp):
    """One thread block: the key tile `cols` against every query tile of `heads` that sees
    it. Returns its (dk, dv); adds its part of dQ into dq."""
    dk_acc = xp.zeros(k_tile.shape)
    dv_acc = xp.zeros(v_tile.shape)
    qk_scale = pb.scale * LOG2E
    with quiet(xp):
        for h in heads:
            for start_m in range(0, pb.n_q, BLOCK_M):
                rows = slice(start_m, min(pb.n_q, start_m + BLOCK_M))
                lo, hi = row_ranges(pb, kv_len, rows.start, rows.stop)
                if max(hi) <= cols.start or min(lo) >= cols.stop:
                    continue  # no row of this query tile sees these keys
                keep = visible(lo, hi, cols.start, cols.stop,
                               None if mask is None else mask[b, h, rows, cols],
                               None if bias is None else bias[b, h, rows, cols], xp)
                q_tile, do_tile = q[b, h, rows], dout[b, h, rows]
                s = (q_tile @ k_tile.T) * qk_scale  # log2 units
                if bias is not None:
                    s = s + bias[b, h, rows, cols] * LOG2E
                if keep is not None:
                    s = xp.where(keep, s, -xp.inf)
                keep = seen(s, xp)  # -inf scores take no part, however they arose
                lse2 = lse[b, h, rows, None] * LOG2E
                p = xp.where(lse2 == -xp.inf, 0.0, xp.exp2(s - lse2))  # empty rows: P = 0
                if keep is not None:  # a NaN lse makes P NaN at hidden keys too
                    p = xp.where(keep, p, 0.0)
                keep_t = None if keep is None else keep.T  # (key, row) pairs seen
                dv_acc += weighted_values(p.T, keep_t, do_tile, xp)
                dp = do_tile @ v_tile.T
                if keep is not None:
                    dp = xp.where(keep, dp, 0.0)  # a hidden key's value never reaches dS
                ds = p * (dp - delta[b, h, rows, None])
                if keep is not None:
                    ds = xp.where(keep, ds, 0.0)
                dk_acc += weighted_values(ds.T, keep_t, q_tile, xp) * pb.scale
                dq[b, h, rows] += weighted_values(ds, keep, k_tile, xp) * pb.scale
    return dk_acc, dv_acc
