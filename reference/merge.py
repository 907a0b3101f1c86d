"""Combining partial attention results over disjoint key sets: the split-KV rule.

If the keys of each row are split into disjoint parts a and b, with (out_a, lse_a) and
(out_b, lse_b) the attention over each part alone, then over all keys

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

A part with no visible key has lse = -inf and out = 0 and contributes nothing; a row with no
visible key in any part stays out = 0, lse = -inf. NumPy, CuPy or torch arrays, in their own
dtype (attention split across ranks merges its float32 parts on the device with it).
"""
from ._xp import array_namespace, quiet


def merge(*parts):
    """merge((out_a, lse_a), (out_b, lse_b), ...) -> (out, lse).

    out_x (..., Nq, Dv), lse_x (..., Nq). Any number of parts, in any order.
    """
    if not parts:
        raise ValueError("merge needs at least one (out, lse) part")
    out, lse = parts[0]
    for out_b, lse_b in parts[1:]:
        out, lse = _merge2(out, lse, out_b, lse_b)
    return out, lse


def _merge2(out_a, lse_a, out_b, lse_b):
    xp = array_namespace(out_a, out_b, torch_too=True)
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(f"parts must have equal shapes, got out {out_a.shape} vs {out_b.shape}"
                         f" and lse {lse_a.shape} vs {lse_b.shape}")
    with quiet(xp):
        m = xp.maximum(lse_a, lse_b)
        m_safe = xp.where(m == -xp.inf, 0.0, m)
        w_a = xp.exp(lse_a - m_safe)
        w_b = xp.exp(lse_b - m_safe)
        total = w_a + w_b
        lse = m_safe + xp.log(total)
        w_a, w_b = (xp.where(total == 0, 0.0, w / total)[..., None] for w in (w_a, w_b))
        # where(), not w * out: an empty part's weight is 0 and its out must not matter.
        out = xp.where(w_a == 0, 0.0, w_a * out_a) + xp.where(w_b == 0, 0.0, w_b * out_b)
    return out, lse
