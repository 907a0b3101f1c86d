"""The tuned FlashAttention-2 backward on CUDA cores: register micro-tiles over shared-memory
tiles. Read it beside reference/tiled_backward.py and plain_bwd.py (the same algorithm, one
thread per key or row). Two kernels after plain_bwd's delta kernel (delta = rowsum(dO * O)):
dkdv (one block per key tile: dV += P^T dO, dK += dS^T Q over every query tile that sees it)
and dq (one block per query tile: dQ += dS K over every key tile it sees), both recomputing
P = exp2(S qk_scale - lse) from the forward's lse. No atomic adds: two runs are bitwise equal.
docs/design/simt.md draws the steps and the shared-memory layout.
"""
import math
from dataclasses import dataclass

from numba import cuda

from reference.dtypes import KERNEL_DTYPES
from .convert import float32, int64, uint64, CONVERTERS
from .block_sparse import make_tile_walk
from .common import (DKDV_ARGS, DQ_ARGS, DYNAMIC_SHARED_LIMIT, F_LOG2E, NEG_INF, NO_PART,
                     STATIC_SHARED_LIMIT, ZERO, check_parameters, kernel_part,
                     make_masked_score, takes_part, with_visible)
from .flash_fwd import VEC, make_pv, make_scores, tile_loader
from .schedule import key_range_device

TUNED_DKDV_ARGS = with_visible(
    DKDV_ARGS, "int32 (B or 1, Hq or 1, key tiles, 2 + query tiles): each key tile's count of "
    "query tiles the mask does not skip, then those tiles (2 i + 1 partly visible, 2 i "
    "fully), then 2 * query tiles; read with a mask")
TUNED_DQ_ARGS = with_visible(
    DQ_ARGS, "int32 (B or 1, Hq or 1, query tiles, 2 + key tiles): the forward's lists (ARGS) "
    "at this kernel's tiles; read with a mask")

# padded width -> part -> (BLOCK_M, BLOCK_N, THREADS_M, THREADS_N), read when a call makes
# its BwdSpec. Head dims are zero-padded to one of these three widths (as for plain_bwd.py):
# fewer variants to compile, FLOPs spent on zeros for the others. Each kernel keeps 64 rows
# (dq) or keys (dkdv) resident and walks the other side 64 (32 at width 256) at a time, with
# 4 x 4 register micro-tiles (4 x 8 at width 64); the tiles take 105-218 KB of dynamic shared
# memory, one or two blocks an SM (faster on the H200 than the 16 x 16 tiles that fit 48 KB
# of static shared memory).
TILES = {64: dict(dkdv=(64, 64, 8, 16), dq=(64, 64, 8, 16)),
         128: dict(dkdv=(64, 64, 16, 16), dq=(64, 64, 16, 16)),
         256: dict(dkdv=(32, 64, 16, 16), dq=(64, 32, 16, 16))}


def bwd_width(d, dv):
    """The padded width of the tuned backward for head dims d, dv."""
    return next(w for w in TILES if w >= max(d, dv))


@dataclass(frozen=True)
class BwdSpec:
    """One compiled variant of a tuned backward kernel."""

    part: str  # "dkdv" or "dq"
    d: int  # head dims, padded (specs.HEAD_DIMS)
    dv: int
    dtype: str
    has_mask: bool
    tiles: tuple = None  # (BLOCK_M, BLOCK_N, THREADS_M, THREADS_N); None: TILES' for d, dv

    def __post_init__(self):
        if self.tiles is None:
            object.__setattr__(self, "tiles", TILES[bwd_width(self.d, self.dv)][self.part])

    @property
    def threads(self):
        return self.tiles[2] * self.tiles[3]

    @property
    def shared_bytes(self):
        return 4 * self.offsets[-1]

    @property
    def dynamic_shared_bytes(self):
        """Bytes of dynamic shared memory a launch passes: 0 where the tiles fit the static
        48 KB (the kernel's shared array then has a fixed size)."""
        return self.shared_bytes if self.shared_bytes > STATIC_SHARED_LIMIT else 0

    @property
    def widths(self):
        """Row widths of the K, V, Q, dO tiles and of the P / dS tiles, in words."""
        block_m, block_n = self.tiles[:2]
        pw = block_m + VEC if self.part == "dkdv" else block_n + VEC
        return self.d + VEC, self.dv + VEC, self.d + VEC, self.dv + VEC, pw

    @property
    def offsets(self):
        """Where K, V, Q, dO, P, dS (dkdv: P^T, dS^T), lse, delta start, and the end."""
        block_m, block_n = self.tiles[:2]
        k_w, v_w, q_w, do_w, p_w = self.widths
        p_rows = block_n if self.part == "dkdv" else block_m
        at = [0]
        for words in (block_n * k_w, block_n * v_w, block_m * q_w, block_m * do_w,
                      p_rows * p_w, p_rows * p_w, block_m, block_m):
            at.append(at[-1] + words)
        return tuple(at)

    def check(self):
        block_m, block_n, threads_m, threads_n = self.tiles
        threads = threads_m * threads_n
        rows_a, rows_b = (block_n, block_m) if self.part == "dkdv" else (block_m, block_n)
        ok = (self.shared_bytes <= DYNAMIC_SHARED_LIMIT and rows_a % threads_m == 0
              and rows_b % threads_n == 0 and self.d % threads_n == 0
              and self.dv % threads_n == 0 and all(a % VEC == 0 for a in self.offsets)
              and all(n * w % threads == 0 for n in (block_m, block_n)
                      for w in (self.d, self.dv)))
        if not ok:
            raise ValueError(f"inconsistent backward kernel spec {self}")
        return self


def sizes_of(spec):
    """Compile-time sizes, by the names the device functions use."""
    spec.check()
    block_m, block_n, threads_m, threads_n = spec.tiles
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, THREADS_M=threads_m, THREADS_N=threads_n,
                THREADS=threads_m * threads_n, D=spec.d, DV=spec.dv, WIDTHS=spec.widths,
                OFFSETS=tuple(uint64(a) for a in spec.offsets), HAS_MASK=spec.has_mask,
                # the shared array's length; 0: dynamic, as long as the launch makes it
                SHARED_WORDS=0 if spec.dynamic_shared_bytes else spec.offsets[-1])


def scores_sizes(sizes, tm, tn, a_at, a_w, b_at, b_w):
    """The sizes flash_fwd's `scores` reads, for S = A B^T with A at a_at (width a_w, tm rows
    a thread, THREADS_M apart) and B at b_at (width b_w, tn rows a thread, THREADS_N apart)."""
    return dict(TM=tm, TN=tn, THREADS_M=sizes["THREADS_M"], THREADS_N=sizes["THREADS_N"],
                WIDTHS=(a_w, b_w), OFFSETS=(a_at, b_at))


def pv_sizes(sizes, tm, cols, n_reduce, p_at, p_w, v_at, v_w):
    """The sizes flash_fwd's `pv` reads, for acc += P V with P at p_at (width p_w, tm rows a
    thread), V at v_at (width v_w), cols output columns over THREADS_N threads, and a
    reduction over n_reduce rows of V."""
    tv = cols // sizes["THREADS_N"]
    return dict(TM=tm, TV=tv, V_GROUP=VEC if tv % VEC == 0 else 1, BLOCK_N=n_reduce,
                THREADS_M=sizes["THREADS_M"], THREADS_N=sizes["THREADS_N"], WIDTHS=(0, 0, v_w, p_w),
                OFFSETS=(uint64(0), v_at, p_at))


@kernel_part
def load_row_stats(words, lse_in, delta, b, h, start_m, n_q, lse_at, delta_at, block_m):
    """The query tile's lse (log2 units) and delta into shared memory; rows past n_q: 0."""
    r = cuda.threadIdx.x
    if r < block_m:
        ok = start_m + r < n_q
        words[lse_at + uint64(r)] = lse_in[b, h, start_m + r] * F_LOG2E if ok else ZERO
        words[delta_at + uint64(r)] = delta[b, h, start_m + r] if ok else ZERO


def make_kv_probabilities(sizes, masked_score):
    """probabilities(...): for the thread's TK keys and TQ rows of S^T and dP^T, P^T =
    exp2(S * qk_scale (+ bias) - lse) and dS^T = P (dP - delta) into shared memory, both 0
    where the row does not see the key (selected: a hidden key's NaN must vanish); the mask
    read where read_mask (a PARTIAL tile), the bias where read_bias."""
    TK, TQ = sizes["BLOCK_N"] // sizes["THREADS_M"], sizes["BLOCK_M"] // sizes["THREADS_N"]
    THREADS_M, THREADS_N = sizes["THREADS_M"], sizes["THREADS_N"]
    P_W = sizes["WIDTHS"][4]
    P_AT, DS_AT, LSE_AT, DELTA_AT = sizes["OFFSETS"][4:8]

    @kernel_part
    def probabilities(words, s, dp, qk_scale, mask, bias, mask_steps, bias_steps, b, h,
                      start_m, start_n, n_q, kv_len, left, right, bottom_right, read_mask,
                      read_bias, ty_u, tx_u):
        for j in range(TQ):
            r = tx_u + uint64(j * THREADS_N)  # the row within the tile
            row = start_m + int64(r)
            lo, hi = key_range_device(row, n_q, kv_len, left, right, bottom_right)
            lse_r, delta_r = words[LSE_AT + r], words[DELTA_AT + r]
            for i in range(TK):
                key = ty_u + uint64(i * THREADS_M)
                x = masked_score(s[i, j] * qk_scale, mask, bias, mask_steps, bias_steps, b, h,
                                 row, start_n + int64(key), lo, hi, False, n_q, read_mask,
                                 read_bias)
                p = NO_PART if x == NEG_INF else math.exp2(x - lse_r)
                ds = ZERO if x == NEG_INF else p * (dp[i, j] - delta_r)
                words[P_AT + key * uint64(P_W) + r] = p
                words[DS_AT + key * uint64(P_W) + r] = ds

    return probabilities


def make_column(group, threads_n):
    """column(tx_u, j): the shared-memory column of a thread's j-th output column in `pv`'s
    layout (groups of `group` side by side, consecutive threads taking consecutive groups)."""
    @kernel_part
    def column(tx_u, j):
        return tx_u * uint64(group) + uint64(j // group * threads_n * group + j % group)

    return column


def make_kv_seen_products(sizes):
    """seen_products(...): dV += P^T dO and dK += dS^T Q adding only the (row, key) pairs
    that take part (P not NO_PART), for a query tile whose Q or dO holds a NaN or an inf
    (0 * NaN = NaN). Rare, so not unrolled."""
    TK, TD, TDV = sizes["BLOCK_N"] // sizes["THREADS_M"], sizes["D"] // sizes["THREADS_N"], \
        sizes["DV"] // sizes["THREADS_N"]
    BLOCK_M, THREADS_M, THREADS_N = sizes["BLOCK_M"], sizes["THREADS_M"], sizes["THREADS_N"]
    col_d, col_dv = (make_column(VEC if t % VEC == 0 else 1, THREADS_N) for t in (TD, TDV))
    _, _, Q_W, DO_W, P_W = sizes["WIDTHS"]
    _, _, Q_AT, DO_AT, P_AT, DS_AT = sizes["OFFSETS"][:6]

    @kernel_part
    def seen_products(words, dk_acc, dv_acc, ty_u, tx_u):
        for m in range(BLOCK_M):
            for i in range(TK):
                key = ty_u + uint64(i * THREADS_M)
                p = words[P_AT + key * uint64(P_W) + uint64(m)]
                if takes_part(p):
                    ds = words[DS_AT + key * uint64(P_W) + uint64(m)]
                    for j in range(TDV):
                        dv_acc[i, j] += p * words[DO_AT + uint64(m * DO_W) + col_dv(tx_u, j)]
                    for j in range(TD):
                        dk_acc[i, j] += ds * words[Q_AT + uint64(m * Q_W) + col_d(tx_u, j)]

    return seen_products


def make_store_rows(sizes, store, T, COLS):
    """store_rows(acc, x, b, h, first, n, width, factor, ty_u, tx_u): x[b, h, first + ty +
    i * THREADS_M, column j] = acc[i, j] * factor for the thread's T rows and its COLS /
    THREADS_N columns (`pv`'s layout), rows < n and columns < width only."""
    THREADS_M, THREADS_N = sizes["THREADS_M"], sizes["THREADS_N"]
    TC = COLS // THREADS_N
    GROUP = VEC if TC % VEC == 0 else 1

    @kernel_part
    def store_rows(acc, x, b, h, first, n, width, factor, ty_u, tx_u):
        for i in range(T):
            r = first + int64(ty_u) + i * THREADS_M
            if r < n:
                for j in range(TC):
                    c = int64(tx_u) * GROUP + j // GROUP * THREADS_N * GROUP + j % GROUP
                    if c < width:
                        x[b, h, r, c] = store(acc[i, j] * factor)

    return store_rows


def make_q_probabilities(sizes, masked_score):
    """probabilities(...): for the thread's TQ rows and TK keys of S and dP, P = exp2(S *
    qk_scale (+ bias) - lse) and dS = P (dP - delta) into shared memory; where the pair
    takes no part, P = NO_PART and dS = 0; the mask read where read_mask (a PARTIAL tile),
    the bias where read_bias."""
    TQ, TK = sizes["BLOCK_M"] // sizes["THREADS_M"], sizes["BLOCK_N"] // sizes["THREADS_N"]
    THREADS_M, THREADS_N = sizes["THREADS_M"], sizes["THREADS_N"]
    P_W = sizes["WIDTHS"][4]
    P_AT, DS_AT = sizes["OFFSETS"][4:6]

    @kernel_part
    def probabilities(words, s, dp, lse_i, delta_i, lo, hi, qk_scale, mask, bias, mask_steps,
                      bias_steps, b, h, first_row, start_n, n_q, read_mask, read_bias, ty_u,
                      tx_u):
        for i in range(TQ):
            for j in range(TK):
                key = tx_u + uint64(j * THREADS_N)
                x = masked_score(s[i, j] * qk_scale, mask, bias, mask_steps, bias_steps, b, h,
                                 first_row + i * THREADS_M, start_n + int64(key), lo[i],
                                 hi[i], False, n_q, read_mask, read_bias)
                p = NO_PART if x == NEG_INF else math.exp2(x - lse_i[i])
                at = (ty_u + uint64(i * THREADS_M)) * uint64(P_W) + key
                words[P_AT + at] = p  # for the slow product's test only
                words[DS_AT + at] = ZERO if x == NEG_INF else p * (dp[i, j] - delta_i[i])

    return probabilities


def make_q_seen_products(sizes):
    """seen_products(...): dQ += dS K adding only the pairs that take part (P not NO_PART),
    for a key tile whose K holds a NaN or an inf (a hidden key's, or one whose score is
    -inf: 0 * inf = NaN). Rare, so not unrolled."""
    TQ, TD = sizes["BLOCK_M"] // sizes["THREADS_M"], sizes["D"] // sizes["THREADS_N"]
    BLOCK_N, THREADS_M, THREADS_N = sizes["BLOCK_N"], sizes["THREADS_M"], sizes["THREADS_N"]
    column = make_column(VEC if TD % VEC == 0 else 1, THREADS_N)
    K_W, P_W = sizes["WIDTHS"][0], sizes["WIDTHS"][4]
    K_AT, P_AT, DS_AT = sizes["OFFSETS"][0], sizes["OFFSETS"][4], sizes["OFFSETS"][5]

    @kernel_part
    def seen_products(words, dq_acc, ty_u, tx_u):
        for n in range(BLOCK_N):  # the rows inside: unrolled, so dq_acc stays in registers
            for i in range(TQ):
                r = ty_u + uint64(i * THREADS_M)
                p = words[P_AT + r * uint64(P_W) + uint64(n)]
                if takes_part(p):
                    ds = words[DS_AT + r * uint64(P_W) + uint64(n)]
                    for j in range(TD):
                        dq_acc[i, j] += ds * words[K_AT + uint64(n * K_W) + column(tx_u, j)]

    return seen_products


def device_functions(spec):
    """The variant's device functions, in the order its kernel calls them."""
    sizes = sizes_of(spec)
    load, store, _ = CONVERTERS[spec.dtype]
    BLOCK_M, BLOCK_N, THREADS = sizes["BLOCK_M"], sizes["BLOCK_N"], sizes["THREADS"]
    K_W, V_W, Q_W, DO_W, P_W = sizes["WIDTHS"]
    K_AT, V_AT, Q_AT, DO_AT, P_AT, DS_AT = sizes["OFFSETS"][:6]
    masked_score = make_masked_score(sizes)
    loaders = (tile_loader(load, BLOCK_N, spec.d, THREADS, K_W, 8),
               tile_loader(load, BLOCK_N, spec.dv, THREADS, V_W, 8),
               tile_loader(load, BLOCK_M, spec.d, THREADS, Q_W, 8),
               tile_loader(load, BLOCK_M, spec.dv, THREADS, DO_W, 8))
    if spec.part == "dkdv":  # S^T = K Q^T, dP^T = V dO^T; dV += P^T dO, dK += dS^T Q
        tk, tq = BLOCK_N // sizes["THREADS_M"], BLOCK_M // sizes["THREADS_N"]
        return loaders + (
            make_scores(scores_sizes(sizes, tk, tq, K_AT, K_W, Q_AT, Q_W)),
            make_scores(scores_sizes(sizes, tk, tq, V_AT, V_W, DO_AT, DO_W)),
            make_kv_probabilities(sizes, masked_score),
            make_pv(pv_sizes(sizes, tk, spec.dv, BLOCK_M, P_AT, P_W, DO_AT, DO_W)),
            make_pv(pv_sizes(sizes, tk, spec.d, BLOCK_M, DS_AT, P_W, Q_AT, Q_W)),
            make_kv_seen_products(sizes),
            make_store_rows(sizes, store, tk, spec.d), make_store_rows(sizes, store, tk, spec.dv))
    tq, tk = BLOCK_M // sizes["THREADS_M"], BLOCK_N // sizes["THREADS_N"]  # S = Q K^T, dP = dO V^T
    return loaders + (
        make_scores(scores_sizes(sizes, tq, tk, Q_AT, Q_W, K_AT, K_W)),
        make_scores(scores_sizes(sizes, tq, tk, DO_AT, DO_W, V_AT, V_W)),
        make_q_probabilities(sizes, masked_score),
        make_pv(pv_sizes(sizes, tq, spec.d, BLOCK_N, DS_AT, P_W, K_AT, K_W)),
        make_q_seen_products(sizes), make_store_rows(sizes, store, tq, spec.d))


def dkdv_kernel_source(spec):
    """The dK, dV kernel of variant `spec` (part "dkdv"): reference/tiled_backward.py's
    program for one key tile, one block each, over the query tiles of its visible list
    (block_sparse.py, transposed: the tiles a mask leaves; without a mask every one)."""
    sizes = sizes_of(spec)
    BLOCK_M, BLOCK_N, THREADS_M, THREADS_N = (sizes[n] for n in ("BLOCK_M", "BLOCK_N",
                                                             "THREADS_M", "THREADS_N"))
    TK, TQ, TD, TDV = BLOCK_N // THREADS_M, BLOCK_M // THREADS_N, spec.d // THREADS_N, \
        spec.dv // THREADS_N
    TC, SHARED_WORDS, FRAG = max(TD, TDV), sizes["SHARED_WORDS"], 2 * VEC
    K_AT, V_AT, Q_AT, DO_AT = sizes["OFFSETS"][:4]
    LSE_AT, DELTA_AT = sizes["OFFSETS"][6:8]
    (load_k, load_v, load_q, load_do, scores_s, scores_dp, probabilities, pv_dv, pv_dk,
     seen_products, store_dk, store_dv) = device_functions(spec)
    walk = make_tile_walk(spec.has_mask, BLOCK_M)  # over query tiles
    walk_range, step_tile, reads_mask, WALK_STEP = (walk.walk_range, walk.step_tile,
                                                    walk.reads_mask, walk.STEP)

    def dkdv_kernel(q, k, v, mask, visible, bias, kv_lengths, dout, lse_in, delta, dk, dv,
                    n_q, group, qk_scale, scale, left, right, bottom_right, mask_steps,
                    bias_steps):
        words = cuda.shared.array(SHARED_WORDS, float32)
        dk_acc = cuda.local.array((TK, TD), float32)  # the thread's keys' dK, columns
        dv_acc = cuda.local.array((TK, TDV), float32)
        s = cuda.local.array((TK, TQ), float32)  # S^T of the thread's keys and rows
        dp = cuda.local.array((TK, TQ), float32)  # dP^T likewise
        frag = cuda.local.array((TK, FRAG), float32)
        cols = cuda.local.array(TC, float32)
        tid = cuda.threadIdx.x
        ty_u, tx_u = uint64(tid // THREADS_N), uint64(tid % THREADS_N)  # keys, rows/columns
        heads_k = k.shape[1]
        b, hk = cuda.blockIdx.y // heads_k, cuda.blockIdx.y % heads_k
        start_n = int64(cuda.blockIdx.x) * BLOCK_N
        d, d_v, kv_len = q.shape[3], v.shape[3], int64(kv_lengths[b])
        for i in range(TK):
            for j in range(TD):
                dk_acc[i, j] = ZERO
            for j in range(TDV):
                dv_acc[i, j] = ZERO
        if start_n < kv_len:  # else every key of the tile is hidden: dK = dV = 0
            load_k(k[b, hk], start_n, kv_len - start_n, d, words, K_AT)  # once, zeros past
            load_v(v[b, hk], start_n, kv_len - start_n, d_v, words, V_AT)
            last_key = min(start_n + BLOCK_N, kv_len)
            for h in range(hk * group, (hk + 1) * group):  # the group's query heads, in order
                cb, ch = b * mask_steps[0], h * mask_steps[1]  # this key tile's list
                t0, t1 = walk_range(visible, cb, ch, cuda.blockIdx.x, 0, n_q)
                for t in range(t0, t1, WALK_STEP):  # the query tiles the mask leaves
                    start_m = step_tile(visible, cb, ch, cuda.blockIdx.x, t)
                    last_row = min(start_m + BLOCK_M, n_q) - 1
                    lo_f, _ = key_range_device(start_m, n_q, kv_len, left, right, bottom_right)
                    _, hi_l = key_range_device(last_row, n_q, kv_len, left, right, bottom_right)
                    if hi_l <= start_n or lo_f >= last_key:
                        continue  # no row of this tile sees these keys (the same for all)
                    # Barrier: the last tile's reads of Q, dO, P^T and dS^T are done (first
                    # time: K and V are loaded).
                    cuda.syncthreads()
                    bad = load_q(q[b, h], start_m, n_q - start_m, d, words, Q_AT)
                    bad |= load_do(dout[b, h], start_m, n_q - start_m, d_v, words, DO_AT)
                    load_row_stats(words, lse_in, delta, b, h, start_m, n_q, LSE_AT, DELTA_AT,
                                   BLOCK_M)
                    # Barrier: Q, dO and the row statistics are complete; every thread knows
                    # whether any loaded a NaN or an inf.
                    bad = cuda.syncthreads_or(bad)
                    scores_s(words, s, frag, ty_u, tx_u, (d + FRAG - 1) // FRAG)
                    scores_dp(words, dp, frag, ty_u, tx_u, (d_v + FRAG - 1) // FRAG)
                    # the mask read or not, each call with a constant (a flag known only at
                    # run time would keep ptxas from unrolling the loops: local memory)
                    if reads_mask(visible, cb, ch, cuda.blockIdx.x, t):  # PARTIAL
                        probabilities(words, s, dp, qk_scale, mask, bias, mask_steps,
                                      bias_steps, b, h, start_m, start_n, n_q, kv_len, left,
                                      right, bottom_right, True, True, ty_u, tx_u)
                    else:  # FULL (the mask not read), or no mask
                        probabilities(words, s, dp, qk_scale, mask, bias, mask_steps,
                                      bias_steps, b, h, start_m, start_n, n_q, kv_len, left,
                                      right, bottom_right, False, True, ty_u, tx_u)
                    cuda.syncthreads()  # Barrier: P^T and dS^T are complete.
                    if not bad:
                        pv_dv(words, dv_acc, frag, cols, ty_u, tx_u, BLOCK_M)
                        pv_dk(words, dk_acc, frag, cols, ty_u, tx_u, BLOCK_M)
                    else:
                        seen_products(words, dk_acc, dv_acc, ty_u, tx_u)
        store_dk(dk_acc, dk, b, hk, start_n, k.shape[2], d, scale, ty_u, tx_u)
        store_dv(dv_acc, dv, b, hk, start_n, k.shape[2], d_v, float32(1.0), ty_u, tx_u)

    return check_parameters(dkdv_kernel, tuple(a[0] for a in TUNED_DKDV_ARGS))


def dq_kernel_source(spec):
    """The dQ kernel of variant `spec` (part "dq"): the forward's walk over key tiles (its
    visible list with a mask), with P recomputed from the saved lse."""
    sizes = sizes_of(spec)
    BLOCK_M, BLOCK_N, THREADS_M, THREADS_N = (sizes[n] for n in ("BLOCK_M", "BLOCK_N",
                                                             "THREADS_M", "THREADS_N"))
    TQ, TK, TD = BLOCK_M // THREADS_M, BLOCK_N // THREADS_N, spec.d // THREADS_N
    SHARED_WORDS, FRAG = sizes["SHARED_WORDS"], 2 * VEC
    K_AT, V_AT, Q_AT, DO_AT = sizes["OFFSETS"][:4]
    (load_k, load_v, load_q, load_do, scores_s, scores_dp, probabilities, pv_dq,
     seen_products, store_dq) = device_functions(spec)
    walk = make_tile_walk(spec.has_mask, BLOCK_N)  # over key tiles
    walk_range, step_tile, reads_mask, WALK_STEP = (walk.walk_range, walk.step_tile,
                                                    walk.reads_mask, walk.STEP)

    def dq_kernel(q, k, v, mask, visible, bias, kv_lengths, dout, lse_in, delta, dq, n_q,
                  group, qk_scale, scale, left, right, bottom_right, mask_steps, bias_steps):
        words = cuda.shared.array(SHARED_WORDS, float32)
        dq_acc = cuda.local.array((TQ, TD), float32)
        s = cuda.local.array((TQ, TK), float32)
        dp = cuda.local.array((TQ, TK), float32)
        frag = cuda.local.array((TQ, FRAG), float32)
        cols = cuda.local.array(TD, float32)
        lse_i = cuda.local.array(TQ, float32)  # log2 units
        delta_i = cuda.local.array(TQ, float32)
        lo = cuda.local.array(TQ, int64)
        hi = cuda.local.array(TQ, int64)
        tid = cuda.threadIdx.x
        ty, tx = tid // THREADS_N, tid % THREADS_N  # rows, keys (and columns of dQ)
        ty_u, tx_u = uint64(ty), uint64(tx)
        heads_q = q.shape[1]
        b, h = cuda.blockIdx.y // heads_q, cuda.blockIdx.y % heads_q
        hk = h // group
        start_m = int64(cuda.blockIdx.x) * BLOCK_M
        d, d_v, kv_len = q.shape[3], v.shape[3], int64(kv_lengths[b])
        for i in range(TQ):
            row = start_m + ty + i * THREADS_M
            ok = row < n_q
            lse_i[i] = lse_in[b, h, row] * F_LOG2E if ok else ZERO
            delta_i[i] = delta[b, h, row] if ok else ZERO
            lo[i], hi[i] = key_range_device(row, n_q, kv_len, left, right, bottom_right)
            for j in range(TD):
                dq_acc[i, j] = ZERO
        load_q(q[b, h], start_m, n_q - start_m, d, words, Q_AT)  # once
        load_do(dout[b, h], start_m, n_q - start_m, d_v, words, DO_AT)
        last_row = min(start_m + BLOCK_M, n_q) - 1
        lo_f, _ = key_range_device(start_m, n_q, kv_len, left, right, bottom_right)
        _, hi_l = key_range_device(last_row, n_q, kv_len, left, right, bottom_right)
        first, last = max(lo_f, 0) // BLOCK_N * BLOCK_N, min(hi_l, kv_len)
        cb, ch, tile = b * mask_steps[0], h * mask_steps[1], cuda.blockIdx.x
        t0, t1 = walk_range(visible, cb, ch, tile, first, last)  # the key tiles the mask leaves
        for t in range(t0, t1, WALK_STEP):
            start_n = step_tile(visible, cb, ch, tile, t)
            # Barrier: the last tile's reads of K, V and dS are done (first time: Q and dO
            # are loaded).
            cuda.syncthreads()
            bad = load_k(k[b, hk], start_n, last - start_n, d, words, K_AT)
            bad |= load_v(v[b, hk], start_n, last - start_n, d_v, words, V_AT)
            # Barrier: K and V are complete; every thread knows whether any loaded a NaN or
            # an inf.
            bad = cuda.syncthreads_or(bad)
            scores_s(words, s, frag, ty_u, tx_u, (d + FRAG - 1) // FRAG)
            scores_dp(words, dp, frag, ty_u, tx_u, (d_v + FRAG - 1) // FRAG)
            if reads_mask(visible, cb, ch, tile, t):  # PARTIAL; each call with a constant
                probabilities(words, s, dp, lse_i, delta_i, lo, hi, qk_scale, mask, bias,
                              mask_steps, bias_steps, b, h, start_m + ty, start_n, n_q, True,
                              True, ty_u, tx_u)
            else:  # FULL (the mask not read), or no mask
                probabilities(words, s, dp, lse_i, delta_i, lo, hi, qk_scale, mask, bias,
                              mask_steps, bias_steps, b, h, start_m + ty, start_n, n_q,
                              False, True, ty_u, tx_u)
            cuda.syncthreads()  # Barrier: dS is complete.
            if not bad:
                pv_dq(words, dq_acc, frag, cols, ty_u, tx_u, min(BLOCK_N, last - start_n))
            else:  # a K holding NaN or inf: only the pairs that take part
                seen_products(words, dq_acc, ty_u, tx_u)
        store_dq(dq_acc, dq, b, h, start_m, n_q, d, scale, ty_u, tx_u)

    return check_parameters(dq_kernel, tuple(a[0] for a in TUNED_DQ_ARGS))


def bwd_kernel_source(spec):
    return (dkdv_kernel_source if spec.part == "dkdv" else dq_kernel_source)(spec)


def bwd_specs():
    """Every variant a call can select: the PTX gate compiles each."""
    return [BwdSpec(part, w, w, dtype, m).check() for part in ("dkdv", "dq")
            for w in TILES for dtype in KERNEL_DTYPES for m in (False, True)]
