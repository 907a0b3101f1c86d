"""An independent oracle: attention with plain Python loops over scalars, straight from the
definitions in docs/contract.md (it does not use reference.contract.key_range). Tiny sizes only.
"""
import math

import numpy as np


def sees(i, j, n_q, kv_len, causal, window):
    """Is key j visible to query row i (causal, window, kv_lengths only)?"""
    if j >= kv_len:
        return False
    bottom_right = causal == "bottom_right" or (not causal and window is not None)
    diag = i + kv_len - n_q if bottom_right else i
    if causal and j > diag:
        return False
    if window is not None:
        left, right = window
        if left >= 0 and j < diag - left:
            return False
        if right >= 0 and j > diag + right:
            return False
    return True


def loop_attention(q, k, v, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
                   window=None):
    B, Hq, Nq, D = q.shape
    Hk, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / math.sqrt(D) if scale is None else scale
    full = (B, Hq, Nq, Nk)
    mask = np.ones(full, bool) if mask is None else np.broadcast_to(mask, full)
    bias = np.zeros(full) if bias is None else np.broadcast_to(bias, full)
    out = np.zeros((B, Hq, Nq, Dv))
    lse = np.full((B, Hq, Nq), -math.inf)
    for b in range(B):
        kv_len = Nk if kv_lengths is None else int(kv_lengths[b])
        for h in range(Hq):
            hk = h // (Hq // Hk)
            for i in range(Nq):
                keys, scores = [], []
                for j in range(Nk):
                    if sees(i, j, Nq, kv_len, causal, window) and mask[b, h, i, j] \
                            and bias[b, h, i, j] != -math.inf:
                        dot = sum(float(q[b, h, i, t]) * float(k[b, hk, j, t]) for t in range(D))
                        keys.append(j)
                        scores.append(dot * scale + float(bias[b, h, i, j]))
                if not keys:
                    continue
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                lse[b, h, i] = top + math.log(total)
                for c in range(Dv):
                    out[b, h, i, c] = sum(w * float(v[b, hk, j, c])
                                          for w, j in zip(weights, keys)) / total
    return out, lse
