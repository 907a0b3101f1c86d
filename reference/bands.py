"""The keys each query row sees before mask and bias: the causal band and the window
(docs/contract.md). Plain integer arithmetic with no imports: the kernels compile this same
function (numba_kernels/schedule.py), and compile_cache's digest holds this file alone of
the reference's.
"""


def key_range(i, n_q, kv_len, left, right, bottom_right):
    """Keys lo <= j < hi are visible to query row i (before mask and bias); empty if hi <= lo.

    kv_len is the row's number of keys: Nk, or kv_lengths[b] when given. The diagonal key of
    row i is i + (kv_len - Nq) under bottom-right alignment and i under top-left. Causal is the
    window (-1, 0). Plain integer arithmetic: the Numba kernel compiles this same function.
    """
    diag = i + (kv_len - n_q if bottom_right else 0)
    lo = 0
    hi = kv_len
    if left >= 0:
        lo = max(lo, diag - left)
    if right >= 0:
        hi = min(hi, diag + right + 1)
    return lo, hi
