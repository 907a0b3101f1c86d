"""Deliberately broken attention kernels: verify.compare must fail every one, for its reason.

`kernel(bug)` is a float32 FlashAttention-2 forward in NumPy (key tiles of BLOCK_N, online
softmax) that is correct with bug=None and carries exactly one classic bug otherwise.
"""
import itertools

import numpy as np

from reference.contract import check_attention_args, dense_visible
from reference.naive import weighted_values

CALLS = itertools.count()

BLOCK_N = 16
BUGS = {  # bug: (a case that must fail, a phrase its failure must contain)
    "no-max-subtraction": ("large scores [float32]", "non-finite"),
    "no-alpha-rescale": ("shape 65x33 [float32]", "mismatched"),
    "wrong-scale": ("shape 65x33 [float32]", "mismatched"),
    "causal-off-by-one": ("causal top_left 29x31", "mismatched"),
    "other-causal-alignment": ("causal bottom_right 29x31", "mismatched"),
    "last-tile-dropped": ("shape 65x33 [float32]", "mismatched"),
    "float16-accumulation": ("shape 13x37 [float32]", "mismatched"),
    "wrong-gqa-mapping": ("GQA 4:1", "mismatched"),
    "nan-for-empty-rows": ("mask empty rows", "fully masked rows give nan"),
    "masked-nan-leaks": ("NaN past kv_lengths", "non-finite"),
    "strides-ignored": ("strided inputs", "mismatched"),
    "writes-input": ("shape 1x1 [float32]", "wrote into its inputs"),
    "nondeterministic": ("determinism", "two runs"),
}


def kernel(bug=None):
    assert bug is None or bug in BUGS, bug

    def attention(q, k, v, *, scale=None, causal=False, mask=None, kv_lengths=None,
                  window=None):
        if bug == "strides-ignored":  # reads memory as if the views were contiguous
            q, k, v = (np.lib.stride_tricks.as_strided(
                x, strides=np.ascontiguousarray(x).strides) for x in (q, k, v))
        if bug == "other-causal-alignment" and causal:
            causal = "top_left" if causal == "bottom_right" else "bottom_right"
        pb = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask,
                                  kv_lengths=kv_lengths, window=window)
        keep = dense_visible(pb, mask, kv_lengths)  # (B, 1 or Hq, Nq, Nk)
        if bug == "causal-off-by-one" and causal:
            keep = keep & ~np.eye(pb.n_q, pb.n_k, dtype=bool)
        keep = np.broadcast_to(keep, (pb.batch, pb.heads_q, pb.n_q, pb.n_k))
        scale = pb.scale if bug != "wrong-scale" else 1.0 / pb.d
        group = pb.group if bug != "wrong-gqa-mapping" else 1
        heads = [h // group % pb.heads_k for h in range(pb.heads_q)]
        qf = q.astype(np.float32)
        if bug == "writes-input":
            q[...] = q * np.float32(1.0001)  # scales the caller's array in place
        kf, vf = (x.astype(np.float32)[:, heads] for x in (k, v))
        acc_t = np.float16 if bug == "float16-accumulation" else np.float32
        m_i = np.full(qf.shape[:3], -np.inf, np.float32)
        l_i = np.zeros(qf.shape[:3], acc_t)
        acc = np.zeros(qf.shape[:3] + (pb.dv,), acc_t)
        last = pb.n_k if bug != "last-tile-dropped" else pb.n_k // BLOCK_N * BLOCK_N
        with np.errstate(all="ignore"):
            for j0 in range(0, last, BLOCK_N):
                j1 = min(j0 + BLOCK_N, last)
                s = np.einsum("bhid,bhjd->bhij", qf, kf[:, :, j0:j1]) * np.float32(scale)
                vis = keep[..., j0:j1]
                s = np.where(vis, s, -np.inf) if bug != "masked-nan-leaks" else s + np.where(
                    vis, 0, -np.inf).astype(np.float32)
                m_new = np.maximum(m_i, s.max(-1))
                m_safe = np.where(m_new == -np.inf, 0, m_new)
                if bug == "no-max-subtraction":
                    m_safe = np.zeros_like(m_safe)
                alpha = np.exp(m_i - m_safe) if bug != "no-alpha-rescale" else 1.0
                p = np.exp(s - m_safe[..., None])
                vt = vf[:, :, j0:j1]
                pv = weighted_values(p, vis, vt, np) if bug != "masked-nan-leaks" else p @ vt
                l_i = (alpha * l_i + p.sum(-1)).astype(acc_t)
                acc = (np.asarray(alpha)[..., None] * acc + pv).astype(acc_t)
                m_i = m_new
            empty = l_i == 0
            out = np.where(empty[..., None], 0, acc / l_i[..., None])
            if bug == "nan-for-empty-rows":
                out = acc / l_i[..., None]
            lse = np.where(empty, -np.inf, m_i + np.log(l_i.astype(np.float32)))
        if bug == "nondeterministic":  # as a racy reduction would: last bits vary per call
            out = out * np.float32(1 + (next(CALLS) % 2) * 2.0**-22)
        return out.astype(q.dtype), lse.astype(np.float32)

    attention.__name__ = f"broken[{bug}]"
    return attention
BROKEN_SCALE = kernel("wrong-scale")  # for the command-line tests
CORRECT = kernel(None)
