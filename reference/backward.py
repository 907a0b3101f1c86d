"""Ground truth of the gradients: dQ, dK, dV (and dbias) of attention, computed directly.

For out = softmax(S) V with S = (Q K^T) * scale + bias (hidden keys -inf), and the incoming
gradient dO of the output, a block of R query rows of the G query heads of a key head gives

    P     = softmax(S)                      (G, R, n)   0 at hidden keys, 0 in empty rows
    dP    = dO V^T                          (G, R, n)   0 at hidden keys (selected)
    delta = rowsum(P * dP) = rowsum(dO * O) (G, R)
    dS    = P * (dP - delta)                (G, R, n)   the gradient of the scores
    dQ    = (dS K) * scale                  (G, R, D)
    dK   += sum over the group of (dS^T Q) * scale
    dV   += sum over the group of P^T dO
    dbias = dS                              (summed over the dimensions bias broadcasts)

with the blocks and their memory bounds of naive.py (R rows with G * R * n <= CHUNK_ELEMS).
The contract (docs/contract.md, "Gradients"): a row that sees no key contributes nothing to
any gradient (its output is the constant 0); a hidden key gets dK = dV = 0, and its values,
even NaN or inf, reach no gradient. Non-finite values that are seen propagate, as in the
forward. The same function computes the low-precision emulation (lowp.py).
"""
import numpy as np

from ._xp import array_namespace, quiet
from .contract import array_dtype, check_attention_args, check_flag, shape4
from .dtypes import FLOAT_DTYPES
from .naive import blocks, seen, visible, weighted_values


def attention_backward(q, k, v, dout, *, scale=None, causal=False, mask=None, bias=None,
                       kv_lengths=None, window=None, return_dbias=False):
    """Exact gradients in float64 from the inputs' exact values.

    q, k, v and the options: as reference.attention. dout (B, Hq, Nq, Dv): the gradient of
    the output (any float dtype). Returns (dq, dk, dv), float64 of q's, k's and v's shapes,
    and dbias of bias's shape as a fourth item when return_dbias (bias required).
    """
    pb = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                              kv_lengths=kv_lengths, window=window)
    check_dout(pb, dout)
    if check_flag("return_dbias", return_dbias) and bias is None:
        raise ValueError("return_dbias=True needs a bias")
    grads = backward(pb, q, k, v, dout, mask, bias, kv_lengths, compute="float64")
    if not return_dbias:
        return grads[:3]
    return grads[:3] + (reduce_to(grads[3], bias.shape),)


def check_dout(pb, dout):
    want = (pb.batch, pb.heads_q, pb.n_q, pb.dv)
    got = shape4("dout", dout, "(B, Hq, Nq, Dv)")
    if got != want:
        raise ValueError(f"dout must have the output's shape (B, Hq, Nq, Dv)={want}, got {got}")
    if array_dtype(dout) not in FLOAT_DTYPES:
        raise TypeError(f"dout must be a real float array (one of {FLOAT_DTYPES}), got dtype "
                        f"{array_dtype(dout)}")


def reduce_to(g, shape):
    """g (B, Hq, Nq, Nk) summed over the dimensions an array of `shape` broadcasts along."""
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def backward(problem, q, k, v, dout, mask, bias, kv_lengths, compute, round_fn=None,
             p_dtype=None):
    """The one direct implementation, in arithmetic dtype `compute`; returns (dq, dk, dv,
    dbias) with dbias (B, Hq, Nq, Nk) or None. round_fn(x, dtype), for the low-precision
    emulation: P and dS rounded to p_dtype before the products that take them, as kernels
    feed matrix units. Internal: callers check arguments first."""
    xp = array_namespace(q, k, v, dout)
    pb = problem
    B, Hk, Nq, Nk = pb.batch, pb.heads_k, pb.n_q, pb.n_k
    dq = xp.zeros((B, pb.heads_q, Nq, pb.d), dtype=compute)
    dk = xp.zeros((B, Hk, Nk, pb.d), dtype=compute)
    dv = xp.zeros((B, Hk, Nk, pb.dv), dtype=compute)
    dbias = None if bias is None else xp.zeros((B, pb.heads_q, Nq, Nk), dtype=compute)
    for blk in blocks(pb, k, v, mask, bias, kv_lengths, compute, xp):
        b, heads, rows, keys = blk.b, blk.heads, blk.rows, slice(blk.j0, blk.j1)
        q_b, do_b = (xp.asarray(x[b, heads, rows], dtype=compute) for x in (q, dout))
        g = _block(pb, q_b, blk.k, blk.v, do_b, blk.lo, blk.hi, blk.j0, blk.j1, blk.mask,
                   blk.bias, compute, round_fn, p_dtype, xp)
        dq[b, heads, rows] = g[0]
        dk[b, blk.hk, keys] += g[1]
        dv[b, blk.hk, keys] += g[2]
        if dbias is not None:
            dbias[b, heads, rows, keys] = g[3]
    return dq, dk, dv, dbias


def _block(pb, q_b, k_b, v_b, do_b, lo, hi, j0, j1, mask_b, bias_b, compute, round_fn,
           p_dtype, xp):
    """(dq, dk, dv, ds) of one block: G query heads, R rows, keys j0 <= j < j1."""
    rnd = (lambda x: x) if round_fn is None else (lambda x: round_fn(x, p_dtype))
    scale = np.dtype(compute).type(pb.scale)
    bias_b = None if bias_b is None else bias_b.astype(compute)
    keep = visible(lo, hi, j0, j1, mask_b, bias_b, xp)
    with quiet(xp):  # in place where it can be: these are the largest arrays
        s = q_b @ k_b.T  # (G, R, n)
        s *= scale
        if bias_b is not None:
            s += bias_b
        if keep is not None:
            s = xp.where(keep, s, -xp.inf)
        keep = seen(s, xp)
        m = s.max(axis=-1, keepdims=True)
        s -= xp.where(m == -xp.inf, 0, m)
        p = xp.exp(s, out=s)
        l = p.sum(axis=-1, keepdims=True)  # noqa: E741
        p /= xp.where(l == 0, 1, l)  # P; a row that sees no key: all 0 already
        if keep is not None:  # a NaN row's P is NaN at its hidden keys too: selected away
            p = xp.where(keep, p, 0)
        dp = do_b @ v_b.T  # hidden keys' values (NaN, inf) must not reach dS: selected away
        if keep is not None:
            dp = xp.where(keep, dp, 0)
        delta = xp.einsum("grn,grn->gr", p, dp)[..., None]
        dp -= delta
        ds = xp.multiply(p, dp, out=dp)  # dS = P (dP - delta)
        if keep is not None:  # hidden keys: 0, even where delta is NaN or inf
            ds = xp.where(keep, ds, 0)
        p_r, ds_r = rnd(p), rnd(ds)
        # Each product adds only visible (row, key) pairs: a hidden key's K, a non-finite
        # row of Q or dO reach no gradient through a pair the row does not see (0 * NaN).
        keep_t = None if keep is None else xp.swapaxes(keep, -1, -2)
        dq = weighted_values(ds_r, keep, k_b, xp) * scale
        dk = weighted_values(xp.swapaxes(ds_r, -1, -2), keep_t, q_b, xp).sum(axis=0) * scale
        dv = weighted_values(xp.swapaxes(p_r, -1, -2), keep_t, do_b, xp).sum(axis=0)
    return dq, dk, dv, ds
