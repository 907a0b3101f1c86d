"""Ground truth: attention computed directly, a block of query rows at a time.

For each (batch, key head) and each block of R query rows the scores of all G = Hq // Hk query
heads of the group are materialised, softmaxed and multiplied by V:

    S = (Q K^T) * scale + bias        (G, R, n)   n = keys visible to the block
    P = exp(S - rowmax(S))            (G, R, n)
    out = (P V) / rowsum(P)           (G, R, Dv)

R is chosen so that G * R * n <= CHUNK_ELEMS (R >= 1), so the extra memory is a few arrays of
CHUNK_ELEMS float64 (32 MiB each) whatever Nq is; only when one row of the group alone is larger
(G * Nk > CHUNK_ELEMS) does it grow, to a few G * Nk. The outputs are (B, Hq, Nq, Dv) + (B, Hq, Nq).

The same function computes the low-precision emulation (lowp.py) by changing the arithmetic
dtype: float64 here, float32 there.
"""
from typing import NamedTuple

import numpy as np

from ._xp import array_namespace, quiet
from .contract import (band, check_attention_args, check_flag, is_integer, ranges_of,
                       row_lengths)

CHUNK_ELEMS = 1 << 22


def attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
              window=None, return_lse=False, rows=None):
    """Exact attention in float64 from the inputs' exact values: the project's ground truth.

    q (B, Hq, Nq, D), k (B, Hk, Nk, D), v (B, Hk, Nk, Dv): NumPy or CuPy arrays of float16,
    bfloat16, float32 or float64. Returns out (B, Hq, Nq, Dv) float64, and lse (B, Hq, Nq) float64
    (natural log) when return_lse. See reference.contract for causal, mask, bias, kv_lengths,
    window and what happens to fully masked rows and non-finite values. rows: compute only
    these query rows (increasing indices into Nq, for sizes whose whole truth is too large);
    out is then (B, Hq, len(rows), Dv) and lse (B, Hq, len(rows)).
    """
    problem = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                                   kv_lengths=kv_lengths, window=window)
    out, lse = forward(problem, q, k, v, mask, bias, kv_lengths, compute="float64",
                       rows=check_rows(rows, problem.n_q))
    return (out, lse) if check_flag("return_lse", return_lse) else out


def score_sensitivity(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
                      kv_lengths=None, window=None, rows=None, truth=None):
    """How much float32 sums of the scores' terms can move each output row, per unit of
    relative error: r_i = sum_j p_ij a_ij (max_c |v_jc| + max_c |out_ic|) over the keys row i
    sees, a_ij = |scale| sum_d |q_id k_jd| + |bias_ij| (score_terms), float64 (B, Hq, Nq)
    (0 for a row that sees no key). A score summed in float32 (any order; tensor cores cut
    each step's terms to the accumulator's ulp) errs by a few u a_ij, its one rounding
    included (a_ij >= |s_ij|); an error ds_ij moves out_i by sum_j p_ij ds_ij (v_j - out_i),
    to first order: at most u r_i in every channel. Only the pairs that carry weight count,
    so a key with a huge value and no weight adds nothing. Non-finite terms and values count
    as 0. Same arguments as attention; truth: its (out, lse) for these arguments, when
    already made."""
    pb, rows, xp, (out, lse) = _with_truth(q, k, v, rows, truth, scale=scale, causal=causal,
                                           mask=mask, bias=bias, kv_lengths=kv_lengths,
                                           window=window)
    with quiet(xp):
        out_top = xp.where(xp.isfinite(out), xp.abs(out), 0).max(axis=-1)
    result = xp.zeros(lse.shape, dtype="float64")
    for blk, q_b, p in _weighted_blocks(pb, q, k, v, mask, bias, kv_lengths, rows, lse, xp):
        with quiet(xp):
            w = score_terms(pb, q_b, blk, p, xp)  # p a
            v_top = xp.where(xp.isfinite(blk.v), xp.abs(blk.v), 0).max(axis=-1)
            total = w @ v_top + w.sum(axis=-1) * out_top[blk.b, blk.heads, blk.out_rows]
        result[blk.b, blk.heads, blk.out_rows] = total
    return result


def lse_sensitivity(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
                    kv_lengths=None, window=None, rows=None, truth=None):
    """How much float32 sums of the scores' terms can move each row's lse, per unit of
    relative error: t_i = sum_j p_ij a_ij over the keys row i sees (a_ij as in
    score_sensitivity), float64 (B, Hq, Nq) (0 for a row that sees no key): lse_i moves by
    sum_j p_ij ds_ij. Where a score's terms cancel, a_ij >> |s_ij|. Same arguments as
    attention; truth: its (out, lse) for these arguments, when already made."""
    pb, rows, xp, (_, lse) = _with_truth(q, k, v, rows, truth, scale=scale, causal=causal,
                                         mask=mask, bias=bias, kv_lengths=kv_lengths,
                                         window=window)
    result = xp.zeros(lse.shape, dtype="float64")
    for blk, q_b, p in _weighted_blocks(pb, q, k, v, mask, bias, kv_lengths, rows, lse, xp):
        with quiet(xp):
            result[blk.b, blk.heads, blk.out_rows] = score_terms(pb, q_b, blk, p, xp).sum(
                axis=-1)
    return result


def score_terms(pb, q_b, blk, p, xp):
    """p_ij a_ij for block blk's rows q_b (float64) and weights p: a_ij = |scale| sum_d
    |q_id k_jd| + |bias_ij|, the magnitude of the terms a score is summed from; 0 where not
    finite (hidden keys, non-finite inputs)."""
    terms = (xp.abs(q_b) @ xp.abs(blk.k).T) * abs(pb.scale)
    if blk.bias is not None:
        terms = terms + xp.abs(xp.asarray(blk.bias, dtype="float64"))
    w = p * terms
    return xp.where(xp.isfinite(w), w, 0)


def _with_truth(q, k, v, rows, truth, **options):
    """The checked problem, rows, array namespace and (out, lse) in float64: truth where
    given, else computed."""
    pb = check_attention_args(q, k, v, **options)
    rows = check_rows(rows, pb.n_q)
    if truth is None:
        truth = forward(pb, q, k, v, options["mask"], options["bias"], options["kv_lengths"],
                        compute="float64", rows=rows)
    return pb, rows, array_namespace(q, k, v), truth


def _weighted_blocks(pb, q, k, v, mask, bias, kv_lengths, rows, lse, xp):
    """Each block of rows (blocks) with its queries in float64 and the weights p = exp(s -
    lse) of its masked scores s (exp(s) where a row sees no key: its scores are all -inf)."""
    for blk in blocks(pb, k, v, mask, bias, kv_lengths, "float64", xp, rows):
        q_b = xp.asarray(q[blk.b, blk.heads][:, blk.rows], dtype="float64")
        s = scores(pb, q_b, blk, "float64", xp)
        with quiet(xp):
            l_b = lse[blk.b, blk.heads, blk.out_rows][..., None]
            p = xp.exp(s - xp.where(xp.isfinite(l_b), l_b, 0))
        yield blk, q_b, p


def check_rows(rows, n_q):
    """rows as a list of increasing ints in [0, n_q), or None."""
    if rows is None:
        return None
    if isinstance(rows, (str, bytes)) or not hasattr(rows, "__iter__") \
            or not all(is_integer(r) for r in rows):
        raise TypeError(f"rows must be a sequence of integer query indices, got {rows!r}")
    rows = [int(r) for r in rows]
    if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and not 0 <= rows[0] <= rows[-1]
                                                        < n_q):
        raise ValueError(f"rows must be increasing query indices in [0, Nq={n_q})")
    return rows


def visible(lo, hi, j0, j1, mask, bias, xp):
    """Boolean (G, R, n) or (R, n) of visible keys j0 <= j < j1 for rows with ranges lo, hi.

    mask and bias are the block's slices (G, R, n) or None. None means every key is visible.
    """
    keep = None
    if max(lo) > j0 or min(hi) < j1:  # some row of the block does not see all of j0..j1
        keep = band(lo, hi, j0, j1, xp)
    for extra in (mask, None if bias is None else bias != -xp.inf):
        if extra is not None:
            keep = extra if keep is None else keep & extra
    return keep


def seen(s, xp):
    """The (row, key) pairs that take part, from the masked scores s (hidden keys -inf): those
    whose score is not -inf, however it arose (the contract: -inf scores behave as masked
    keys), or None where every pair takes part. The products below (weighted_values) and the
    gradients select on these pairs, so that neither 0 * inf from a key whose score is -inf
    nor the NaN weights of a NaN row reach anything outside the pairs."""
    keep = s != -xp.inf
    return None if bool(keep.all()) else keep


def weighted_values(p, keep, v, xp):
    """P @ V where an invisible key's value, even NaN or inf, contributes nothing.

    p (G, R, n) is already 0 at invisible keys, but 0 * NaN = NaN, so non-finite values are
    taken out of the product and put back only where their key is visible.
    """
    finite = xp.isfinite(v)
    if bool(finite.all()):
        return p @ v
    out = p @ xp.where(finite, v, 0)
    hits = xp.ones(p.shape, dtype=p.dtype) if keep is None else keep.astype(p.dtype)
    hits = xp.broadcast_to(hits, p.shape)
    n_nan = hits @ xp.isnan(v).astype(p.dtype)
    n_pos = hits @ (v == xp.inf).astype(p.dtype)
    n_neg = hits @ (v == -xp.inf).astype(p.dtype)
    out = xp.where(n_pos > 0, xp.inf, out)
    out = xp.where(n_neg > 0, -xp.inf, out)
    return xp.where((n_nan > 0) | ((n_pos > 0) & (n_neg > 0)), xp.nan, out)


class Block(NamedTuple):
    """One block of query rows of one (batch b, key head hk), with what it sees."""
    b: int
    hk: int
    heads: slice  # the group's query heads
    out_rows: slice  # where the block's rows go in the outputs
    rows: object  # which query rows: a slice, or a list of sampled rows
    lo: object  # per row, the first key it may see and one past the last (ranges_of)
    hi: object
    j0: int  # the keys j0 <= j < j1 that some row of the block sees
    j1: int
    k: object  # K and V of those keys, in the arithmetic dtype
    v: object
    mask: object  # (G, R, j1 - j0) of the mask and bias, or None
    bias: object


def blocks(pb, k, v, mask, bias, kv_lengths, compute, xp, rows=None):
    """The row blocks of the direct implementations (the forward here, backward.py), in order:
    each (batch, key head), each run of R rows with G * R * (keys) <= CHUNK_ELEMS. A block whose
    rows see no key is left out (its rows give out = 0, lse = -inf, no gradient). rows: None
    (every query row) or increasing row indices."""
    n_out = pb.n_q if rows is None else len(rows)
    full = (pb.batch, pb.heads_q, pb.n_q, pb.n_k)
    mask = None if mask is None else xp.broadcast_to(xp.asarray(mask), full)
    bias = None if bias is None else xp.broadcast_to(xp.asarray(bias), full)
    G = pb.group
    step = max(1, CHUNK_ELEMS // max(1, G * pb.n_k))
    for b, kv_len in enumerate(row_lengths(pb, kv_lengths)):
        for hk in range(pb.heads_k):
            # K and V of one head are converted to `compute` once; the inputs as a whole never
            # are (they may be billions of elements, with sampled rows).
            k_bh, v_bh = (xp.asarray(x[b, hk, :kv_len], dtype=compute) for x in (k, v))
            heads = slice(hk * G, (hk + 1) * G)
            for p0 in range(0, n_out, step):
                p1 = min(n_out, p0 + step)
                sel = slice(p0, p1) if rows is None else rows[p0:p1]
                lo, hi = ranges_of(pb, kv_len, range(p0, p1) if rows is None else sel)
                j0, j1 = max(0, min(lo)), min(kv_len, max(hi))
                if j1 > j0:
                    side = [None if x is None else x[b, heads][:, sel, j0:j1]
                            for x in (mask, bias)]
                    yield Block(b, hk, heads, slice(p0, p1), sel, lo, hi, j0, j1,
                                k_bh[j0:j1], v_bh[j0:j1], *side)


def forward(problem, q, k, v, mask, bias, kv_lengths, compute, p_dtype=None, round_fn=None,
            rows=None):
    """The one direct implementation, in arithmetic dtype `compute`; returns (out, lse).

    round_fn(x, dtype) -> x rounded to `dtype`, used by the low-precision emulation to round P
    to `p_dtype` before P @ V. rows: None (every query row) or increasing row indices (see
    attention). Internal: callers check arguments first.
    """
    xp = array_namespace(q, k, v)
    pb = problem
    n_out = pb.n_q if rows is None else len(rows)
    out = xp.zeros((pb.batch, pb.heads_q, n_out, pb.dv), dtype=compute)
    lse = xp.full((pb.batch, pb.heads_q, n_out), -xp.inf, dtype=compute)
    for blk in blocks(pb, k, v, mask, bias, kv_lengths, compute, xp, rows):
        q_b = xp.asarray(q[blk.b, blk.heads][:, blk.rows], dtype=compute)
        o, l_ = _block(pb, q_b, blk, compute, p_dtype, round_fn, xp)
        out[blk.b, blk.heads, blk.out_rows], lse[blk.b, blk.heads, blk.out_rows] = o, l_
    return out, lse


def scores(pb, q_b, blk, compute, xp):
    """The masked scores (G, R, n) of block blk's rows q_b: hidden keys -inf."""
    bias_b = None if blk.bias is None else blk.bias.astype(compute)
    keep = visible(blk.lo, blk.hi, blk.j0, blk.j1, blk.mask, bias_b, xp)
    with quiet(xp):
        s = q_b @ blk.k.T  # (G, R, n)
        s *= np.dtype(compute).type(pb.scale)
        if bias_b is not None:
            s += bias_b
        return s if keep is None else xp.where(keep, s, -xp.inf)


def _block(pb, q_b, blk, compute, p_dtype, round_fn, xp):
    """(out, lse) of one block: G query heads, R rows, keys j0 <= j < j1."""
    v_b = blk.v
    finite = bool(xp.isfinite(v_b).all())
    s = scores(pb, q_b, blk, compute, xp)
    with quiet(xp):
        keep = seen(s, xp)
        m = s.max(axis=-1, keepdims=True)  # NaN propagates; -inf: no visible key
        m = xp.where(m == -xp.inf, 0, m)  # never exp(-inf - -inf)
        s -= m
        p = xp.exp(s, out=s)
        l = p.sum(axis=-1, keepdims=True)  # noqa: E741
        if round_fn is not None:
            p = round_fn(p, p_dtype)
        o = p @ v_b if finite else weighted_values(p, keep, v_b, xp)
        return xp.where(l == 0, 0, o / l), (m + xp.log(l))[..., 0]  # NaN l stays NaN
