"""The plain FlashAttention-2 backward kernels: reference/tiled_backward.py written to be read,
one CUDA thread per key (dK, dV) or per query row (dQ).

Three kernels, launched in this order by numba_kernels.flash_attention_backward:

    delta_kernel  delta_i = rowsum(dO_i * O_i)                          one warp per row
    dkdv_kernel   one block per key tile of a (batch, key head), one thread per key j: it
                  keeps k_j, v_j and its accumulators dk_j, dv_j in its own (local) arrays
                  and walks every query tile of the group's query heads, which the block
                  loads into shared memory together
    dq_kernel     one block per query tile of a (batch, query head), one thread per row i:
                  it keeps q_i, dO_i and dq_i, and walks the key tiles (shared), as the
                  forward kernel (plain_fwd.py) does

Both recompute the score and P = exp2(s - lse * log2(e)) from the forward's saved lse, and

    dP = dO_i . v_j        dS = P * (dP - delta_i)
    dV_j += P * dO_i       dK_j += dS * q_i * scale       dQ_i += dS * k_j * scale

dQ has a kernel of its own, so every sum runs in one thread in a fixed order: two runs are
bitwise equal (no atomic adds). A (row, key) pair the row does not see is skipped, so hidden
values, and the dO of rows that see no key, reach nothing (docs/contract.md, Gradients).
Every tile costs two barriers, as in the forward. Arithmetic is float32.
"""
import math
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda

from . import warp
from .compile_cache import jit
from .convert import float32, CONVERTERS
from .common import (DELTA_ARGS, DKDV_ARGS, DQ_ARGS, F_LOG2E, FASTMATH, NEG_INF, ZERO,
                     check_parameters)
from .plain_fwd import make_load_row, make_load_tile, make_score, plain_tiles

DELTA_THREADS = 128
DELTA_ROWS = DELTA_THREADS // warp.LANES  # the delta kernel's rows a block: a warp a row


@dataclass(frozen=True)
class PlainBwdSpec:
    """One compiled variant of a plain backward kernel (for the PTX report)."""

    part: str  # "delta", "dkdv" or "dq"
    width: int  # head dims padded to this
    dtype: str
    has_mask: bool


def plain_bwd_specs(widths):
    """The variants of the padded head-dim widths a call can launch (specs.HEAD_DIMS; the
    delta kernel serves the tuned backward too): what the PTX gate compiles."""
    return [PlainBwdSpec(part, w, dtype, m) for part in ("delta", "dkdv", "dq")
            for w in widths for dtype in ("float32", "float16", "bfloat16")
            for m in ((False,) if part == "delta" else (False, True))]


@lru_cache(maxsize=64)
def plain_bwd_kernel(part, D, DV, dtype, has_mask):
    """The compiled kernel `part` ("delta", "dkdv", "dq") for head dims padded to D, DV."""
    fn = bwd_kernel_source(part, D, DV, dtype, has_mask)
    return jit(fn, ("plain_bwd", part, D, DV, dtype, has_mask), FASTMATH)


def bwd_kernel_source(part, D, DV, dtype, has_mask):
    if part == "delta":
        return delta_kernel_source(dtype)
    maker = dkdv_kernel_source if part == "dkdv" else dq_kernel_source
    return maker(D, DV, dtype, make_score(has_mask))


def delta_kernel_source(dtype):
    load = CONVERTERS[dtype][0]

    def delta_kernel(out, dout, delta, n_q):
        """delta[b, h, i] = sum_c out[b, h, i, c] * dout[b, h, i, c], one warp a row: lane l
        sums the columns l, l + 32, ... (a warp's loads side by side in memory), then the
        lanes' sums are added by shuffles. The order is fixed: two runs are bitwise equal."""
        heads_q = out.shape[1]
        b, h = cuda.blockIdx.y // heads_q, cuda.blockIdx.y % heads_q
        lane = cuda.threadIdx.x % warp.LANES
        i = cuda.blockIdx.x * DELTA_ROWS + cuda.threadIdx.x // warp.LANES
        if i < n_q:  # the whole warp
            acc = ZERO
            for c in range(lane, out.shape[3], warp.LANES):
                acc += load(out[b, h, i, c]) * load(dout[b, h, i, c])
            for step in (16, 8, 4, 2, 1):
                acc += warp.shfl_xor(acc, step)
            if lane == 0:
                delta[b, h, i] = acc

    return check_parameters(delta_kernel, tuple(a[0] for a in DELTA_ARGS))


def dkdv_kernel_source(D, DV, dtype, score):
    BLOCK_N, BLOCK_M = plain_tiles(max(D, DV))  # keys (threads) a block, rows a tile
    Q_W, DO_W = D + 1, DV + 1  # shared-array shapes must be closure ints
    store = CONVERTERS[dtype][1]
    load_k_row, load_v_row = make_load_row(dtype, D), make_load_row(dtype, DV)
    load_q_tile, load_do_tile = make_load_tile(dtype, BLOCK_M, D), make_load_tile(dtype,
                                                                                  BLOCK_M, DV)

    def dkdv_kernel(q, k, v, mask, bias, kv_lengths, dout, lse_in, delta, dk, dv, n_q, group,
                    qk_scale, scale, left, right, bottom_right, mask_steps, bias_steps):
        Q_tile = cuda.shared.array((BLOCK_M, Q_W), float32)
        dO_tile = cuda.shared.array((BLOCK_M, DO_W), float32)
        lse_tile = cuda.shared.array(BLOCK_M, float32)  # log2 units
        delta_tile = cuda.shared.array(BLOCK_M, float32)
        k_j, dk_j = cuda.local.array(D, float32), cuda.local.array(D, float32)
        v_j, dv_j = cuda.local.array(DV, float32), cuda.local.array(DV, float32)

        t = cuda.threadIdx.x
        heads_k = k.shape[1]
        b, hk = cuda.blockIdx.y // heads_k, cuda.blockIdx.y % heads_k
        j = cuda.blockIdx.x * BLOCK_N + t  # this thread's key
        d, dv_len, kv_len = q.shape[3], v.shape[3], kv_lengths[b]
        load_k_row(k_j, k, b, hk, j, j < kv_len, d)
        load_v_row(v_j, v, b, hk, j, j < kv_len, dv_len)
        for c in range(D):
            dk_j[c] = ZERO
        for c in range(DV):
            dv_j[c] = ZERO

        for h in range(hk * group, (hk + 1) * group):  # the query heads that read key head hk
            for start_m in range(0, n_q, BLOCK_M):
                cuda.syncthreads()  # Barrier: every read of the previous tiles is done.
                load_q_tile(Q_tile, q, b, h, start_m, n_q, d, t, BLOCK_N)  # zeros past the end
                load_do_tile(dO_tile, dout, b, h, start_m, n_q, dv_len, t, BLOCK_N)
                for r in range(t, BLOCK_M, BLOCK_N):
                    ok = start_m + r < n_q
                    lse_tile[r] = lse_in[b, h, start_m + r] * F_LOG2E if ok else NEG_INF
                    delta_tile[r] = delta[b, h, start_m + r] if ok else ZERO
                cuda.syncthreads()  # Barrier: the tiles are complete.

                for r in range(BLOCK_M):
                    dot = ZERO
                    for c in range(D):
                        dot += Q_tile[r, c] * k_j[c]
                    s = score(dot, mask, bias, mask_steps, bias_steps, b, h, start_m + r, j,
                              n_q, kv_len, left, right, bottom_right, qk_scale)
                    if s != NEG_INF:  # a pair the row does not see adds nothing
                        p = math.exp2(s - lse_tile[r])  # P from the saved lse
                        dp = ZERO
                        for c in range(DV):
                            dv_j[c] += p * dO_tile[r, c]
                            dp += dO_tile[r, c] * v_j[c]
                        ds = p * (dp - delta_tile[r])
                        for c in range(D):
                            dk_j[c] += ds * Q_tile[r, c]

        if j < k.shape[2]:  # every key gets its gradient: 0 for keys no row sees
            for c in range(d):
                dk[b, hk, j, c] = store(dk_j[c] * scale)
            for c in range(dv_len):
                dv[b, hk, j, c] = store(dv_j[c])

    return check_parameters(dkdv_kernel, tuple(a[0] for a in DKDV_ARGS))


def dq_kernel_source(D, DV, dtype, score):
    BLOCK_M, BLOCK_N = plain_tiles(max(D, DV))  # rows (threads) a block, keys a tile
    K_W, V_W = D + 1, DV + 1
    store = CONVERTERS[dtype][1]
    load_q_row, load_do_row = make_load_row(dtype, D), make_load_row(dtype, DV)
    load_k_tile, load_v_tile = make_load_tile(dtype, BLOCK_N, D), make_load_tile(dtype,
                                                                                 BLOCK_N, DV)

    def dq_kernel(q, k, v, mask, bias, kv_lengths, dout, lse_in, delta, dq, n_q, group,
                  qk_scale, scale, left, right, bottom_right, mask_steps, bias_steps):
        K_tile = cuda.shared.array((BLOCK_N, K_W), float32)
        V_tile = cuda.shared.array((BLOCK_N, V_W), float32)
        q_i, dq_i = cuda.local.array(D, float32), cuda.local.array(D, float32)
        do_i = cuda.local.array(DV, float32)

        t = cuda.threadIdx.x
        heads_q = q.shape[1]
        b, h = cuda.blockIdx.y // heads_q, cuda.blockIdx.y % heads_q
        hk = h // group
        i = cuda.blockIdx.x * BLOCK_M + t  # this thread's query row
        d, dv_len, kv_len = q.shape[3], v.shape[3], kv_lengths[b]
        row_ok = i < n_q
        load_q_row(q_i, q, b, h, i, row_ok, d)
        load_do_row(do_i, dout, b, h, i, row_ok, dv_len)
        for c in range(D):
            dq_i[c] = ZERO
        lse_i = lse_in[b, h, i] * F_LOG2E if row_ok else NEG_INF
        delta_i = delta[b, h, i] if row_ok else ZERO

        for start_n in range(0, kv_len, BLOCK_N):
            cuda.syncthreads()  # Barrier: every read of the previous K and V tiles is done.
            load_k_tile(K_tile, k, b, hk, start_n, kv_len, d, t, BLOCK_M)  # zeros past the end
            load_v_tile(V_tile, v, b, hk, start_n, kv_len, dv_len, t, BLOCK_M)
            cuda.syncthreads()  # Barrier: both tiles are complete.

            for jj in range(BLOCK_N):
                dot = ZERO
                for c in range(D):
                    dot += q_i[c] * K_tile[jj, c]
                s = score(dot, mask, bias, mask_steps, bias_steps, b, h, i, start_n + jj,
                          n_q, kv_len, left, right, bottom_right, qk_scale)
                if s != NEG_INF:
                    p = math.exp2(s - lse_i)
                    dp = ZERO
                    for c in range(DV):
                        dp += do_i[c] * V_tile[jj, c]
                    ds = p * (dp - delta_i)
                    for c in range(D):
                        dq_i[c] += ds * K_tile[jj, c]

        if row_ok:
            for c in range(d):
                dq[b, h, i, c] = store(dq_i[c] * scale)

    return check_parameters(dq_kernel, tuple(a[0] for a in DQ_ARGS))
