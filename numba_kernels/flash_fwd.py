"""The FlashAttention-2 forward kernel, one thread block per (BLOCK_M query rows, batch, head).

Read it beside reference/tiled.py: same algorithm, same names (m_i, l_i, acc, alpha, qk_scale).
What the tiled reference does with whole-tile NumPy operations, a block does here with
THREADS = THREADS_M * THREADS_N threads, each owning a register micro-tile:

    rows  ty + i * THREADS_M   for i < TM    (TM = BLOCK_M / THREADS_M)
    keys  tx + j * THREADS_N   for j < TN    (S = Q K^T, TN = BLOCK_N / THREADS_N)
    cols  tx + j * THREADS_N   for j < TV    (O = P V,   TV = DV / THREADS_N)

Per key tile a thread does TM * TN * D + TM * TV * BLOCK_N fused multiply-adds, reading
(TM + TN) * D + (TM + TV) * BLOCK_N words of shared memory: the micro-tile is what keeps the
arithmetic ahead of the shared-memory loads.

Shared memory (float32; low-precision inputs are converted once, on load):
    q_t   Q tile transposed (D, BLOCK_M + 1), loaded once;
          at the end the output tile (BLOCK_M, DV + 1), for coalesced stores
    kv_s  K tile transposed (D, BLOCK_N + 1), then the V tile (BLOCK_N, DV) in the same words
    p_t   (BLOCK_N, BLOCK_M + 1) P tile transposed
    row_max, row_sum (BLOCK_M, THREADS_N): partial row statistics, one column per tx
The "+ 1" words: loads write a column of a transposed tile (consecutive threads take
consecutive d); with an odd row width those words fall in different banks. V and P are read
along rows by the threads of a warp (consecutive words), so V needs no pad.

All sizes are closure ints of the factory: the CUDA compiler needs literal shared-array shapes.
"""
import math
from dataclasses import dataclass

from numba import cuda, float32, int64, uint64

from reference.contract import key_range
from .convert import CONVERTERS, device_function

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): exp2 is one ex2.approx instruction
LN2 = 0.6931471805599453
# Fused multiply-add, approximate exp2/log2 and reciprocal. Not nnan/ninf: -inf marks masked
# scores and NaN must propagate, so the compiler may not assume them away.
FASTMATH = {"contract", "afn", "arcp"}
STATIC_SHARED_LIMIT = 48 * 1024  # bytes; above it numba-cuda needs dynamic shared memory

key_range_device = device_function(key_range)  # the contract's own code


@dataclass(frozen=True)
class KernelSpec:
    """One compiled variant: everything here is a compile-time constant of the kernel."""

    d: int  # head dim of q and k, zero-padded to one of specs.HEAD_DIMS
    dv: int  # head dim of v, padded likewise
    dtype: str  # "float32", "float16" or "bfloat16"
    has_mask: bool
    block_m: int
    block_n: int
    threads_m: int
    threads_n: int
    partial: bool = False  # out is float32 whatever the input dtype (split-KV, split_kv.py)

    @property
    def threads(self):
        return self.threads_m * self.threads_n

    @property
    def shared_bytes(self):
        q = max(self.d * (self.block_m + 1), self.block_m * (self.dv + 1))
        kv = max(self.d * (self.block_n + 1), self.block_n * self.dv)
        return 4 * (q + kv + self.block_n * (self.block_m + 1)
                    + 2 * self.block_m * self.threads_n)

    def check(self):
        ok = (self.block_m % self.threads_m == 0 and self.block_n % self.threads_n == 0
              and self.dv % self.threads_n == 0 and self.shared_bytes <= STATIC_SHARED_LIMIT
              and all(n % self.threads == 0 for n in (self.block_m * self.d,
                                                      self.block_m * self.dv,
                                                      self.block_n * self.d,
                                                      self.block_n * self.dv)))
        if not ok:
            raise ValueError(f"inconsistent kernel spec {self}")
        return self


def tile_loader(load, ROWS, COLS, THREADS, ROW_STRIDE, COL_STRIDE):
    """A device function copying a ROWS x COLS tile of a (B, H, N, C) array into shared memory.

    Element (r, c) of the tile goes to dst[r * ROW_STRIDE + c * COL_STRIDE] (transposed when
    COL_STRIDE > 1), times `scale`; rows >= rows_valid and columns >= cols_valid become 0.
    Consecutive threads take consecutive columns, so global reads are coalesced. The loads of a
    batch are all issued before any store: out-of-range indices are clamped rather than
    branched around, so nothing orders the loads and their latencies overlap. Returns 1 if
    this thread loaded a NaN or an inf, else 0. Every tile passes scale = 1 today; without the
    multiply the compiler turns the select below into branches (PTX: 48 more bra), so it stays.
    """
    ITERS = ROWS * COLS // THREADS
    BATCH = next(n for n in (8, 4, 2, 1) if ITERS % n == 0)
    ZERO = float32(0.0)

    @device_function
    def load_tile(src, b, h, row0, rows_valid, cols_valid, dst, scale):
        tid = cuda.threadIdx.x
        stage = cuda.local.array(BATCH, float32)
        bad = 0
        for batch in range(ITERS // BATCH):
            for it in range(BATCH):
                idx = tid + (batch * BATCH + it) * THREADS
                r = idx // COLS
                c = idx % COLS
                x = load(src[b, h, row0 + min(r, rows_valid - 1), min(c, cols_valid - 1)])
                stage[it] = x * scale if r < rows_valid and c < cols_valid else ZERO
            for it in range(BATCH):
                idx = tid + (batch * BATCH + it) * THREADS
                x = stage[it]
                if x - x != ZERO:  # inf or NaN
                    bad = 1
                dst[(idx // COLS) * ROW_STRIDE + (idx % COLS) * COL_STRIDE] = x
        return bad

    return load_tile


def kernel_source(spec):
    """The kernel as a Python function, for cuda.jit or cuda.compile_ptx."""
    spec.check()
    BLOCK_M, BLOCK_N, D, DV = spec.block_m, spec.block_n, spec.d, spec.dv
    THREADS_M, THREADS_N, THREADS = spec.threads_m, spec.threads_n, spec.threads
    TM, TN, TV = BLOCK_M // THREADS_M, BLOCK_N // THREADS_N, DV // THREADS_N
    Q_W, K_W, P_W, O_W = BLOCK_M + 1, BLOCK_N + 1, BLOCK_M + 1, DV + 1
    Q_WORDS, KV_WORDS = max(D * Q_W, BLOCK_M * O_W), max(D * K_W, BLOCK_N * DV)
    HAS_MASK = spec.has_mask
    # Inner-loop steps unrolled together, so that their shared loads overlap. The loops run
    # to runtime bounds (the real head dim, the keys left in the tile): padded columns and
    # keys past the end cost nothing. P V holds TM + TV loaded words a step beside TM * TV
    # accumulators, so with many output columns a thread it takes fewer steps at once.
    UNROLL_S = 4
    UNROLL_PV = 4 if TV <= 8 else 2 if TV <= 16 else 1
    load, store, _ = CONVERTERS[spec.dtype]
    if spec.partial:  # split-KV partial results stay float32 until the merge
        store = CONVERTERS["float32"][1]
    load_q = tile_loader(load, BLOCK_M, D, THREADS, 1, Q_W)  # transposed: q_t[c * Q_W + r]
    load_k = tile_loader(load, BLOCK_N, D, THREADS, 1, K_W)  # transposed: kv_s[c * K_W + n]
    load_v = tile_loader(load, BLOCK_N, DV, THREADS, DV, 1)  # as is: kv_s[n * DV + c]
    ZERO, ONE, NEG_INF = float32(0.0), float32(1.0), float32(-math.inf)
    F_LN2 = float32(LN2)

    @device_function
    def visible(mask, b, h, row, col, lo, hi, interior, n_q, msb, msh, msi, msj):
        """Does query row `row` see key `col`? (contract: key_range, then the boolean mask)"""
        ok = row < n_q and (interior or (col >= lo and col < hi))
        if HAS_MASK and ok:
            ok = mask[b * msb, h * msh, row * msi, col * msj] != 0
        return ok

    def flash_fwd(q, k, v, mask, kv_lengths, out, lse, n_q, d, dv, group, heads_q, n_tiles,
                  split_len, qk_scale, left, right, bottom_right, msb, msh, msi, msj):
        q_t = cuda.shared.array(Q_WORDS, float32)
        kv_s = cuda.shared.array(KV_WORDS, float32)
        p_t = cuda.shared.array((BLOCK_N, P_W), float32)
        row_max = cuda.shared.array((BLOCK_M, THREADS_N), float32)
        row_sum = cuda.shared.array((BLOCK_M, THREADS_N), float32)
        # S holds raw scores q . k; the scale enters inside the exponent, one fused multiply-add
        # a score (as FA-2 does): exp2(s * qk_scale - m_i). Scaling Q on load instead rounds
        # every element of Q once more, which with large scores costs more accuracy than the
        # plain computation loses (verify's criterion).
        m_i = cuda.local.array(TM, float32)  # running max of s * qk_scale (log2 units), per row
        l_i = cuda.local.array(TM, float32)  # running sum of exp2(s * qk_scale - m_i)
        acc = cuda.local.array((TM, TV), float32)  # running sum of exp2(s * qk_scale - m_i) * v
        lo = cuda.local.array(TM, int64)  # each row's visible keys lo <= j < hi
        hi = cuda.local.array(TM, int64)
        s = cuda.local.array((TM, TN), float32)
        a = cuda.local.array(TM, float32)
        bb = cuda.local.array(TV if TV > TN else TN, float32)

        tid = cuda.threadIdx.x
        ty = tid // THREADS_N
        tx = tid % THREADS_N
        # The inner loops index shared memory with unsigned integers: Numba tests every signed
        # index for a negative value (Python's wraparound), a compare and a select a load,
        # which the profile (PERF.md, v5) found filling the integer pipe.
        uty = uint64(ty)
        utx = uint64(tx)
        # Blocks run over (split, batch, head, query tile). Consecutive blocks share a (batch,
        # head), so its K and V stay in L2. The last query tile goes first: under causal masks
        # it has the most keys, and it should not run last. With split-KV (split_kv.py) a block
        # sees only keys [split * split_len, (split + 1) * split_len) and writes a partial
        # result at batch index split * B + b; without it, split = 0.
        batch = kv_lengths.shape[0]
        bh = int64(cuda.blockIdx.x) // n_tiles
        tile = n_tiles - 1 - int64(cuda.blockIdx.x) % n_tiles
        split = bh // (batch * heads_q)
        b = bh // heads_q % batch
        h = bh % heads_q
        ob = split * batch + b  # where this block's out and lse go
        hk = h // group  # grouped-query attention: query head h reads key head h // group
        start_m = tile * BLOCK_M
        kv_len = int64(kv_lengths[b])

        # Q tile, loaded once and reused against every key tile.
        load_q(q, b, h, start_m, min(BLOCK_M, n_q - start_m), d, q_t, ONE)

        for i in range(TM):
            m_i[i] = NEG_INF
            l_i[i] = ZERO
            for j in range(TV):
                acc[i, j] = ZERO
            lo[i], hi[i] = key_range_device(start_m + ty + i * THREADS_M, n_q, kv_len,
                                            left, right, bottom_right)
        # key_range is monotone in the row, so the block's first and last rows bound the
        # tiles it must visit: the tiles outside the causal/window band are never computed.
        last_row = min(start_m + BLOCK_M, n_q) - 1
        lo_first, hi_first = key_range_device(start_m, n_q, kv_len, left, right, bottom_right)
        lo_last, hi_last = key_range_device(last_row, n_q, kv_len, left, right, bottom_right)
        first_n = max(max(lo_first, 0) // BLOCK_N * BLOCK_N, split * split_len)
        end_n = min(hi_last, kv_len, (split + 1) * split_len)

        for start_n in range(first_n, end_n, BLOCK_N):
            # A tile every row sees whole needs no per-key band test.
            interior = start_n >= lo_last and start_n + BLOCK_N <= hi_first
            # Barrier: the previous tile's reads of kv_s (V) and p_t are finished before K
            # overwrites them; on the first tile, q_t's writes become visible.
            cuda.syncthreads()
            load_k(k, b, hk, start_n, end_n - start_n, d, kv_s, ONE)  # tail rows: zeros
            cuda.syncthreads()  # Barrier: the K tile is complete before anyone reads it.

            # S = Q K^T for this thread's TM x TN micro-tile (raw scores).
            for i in range(TM):
                for j in range(TN):
                    s[i, j] = ZERO
            # Columns past the real head dim d are zeros: the loop stops at d (rounded up).
            for c0 in range(0, d, UNROLL_S):
                for c in range(c0, c0 + UNROLL_S):  # constant trip count: unrolled, loads overlap
                    q_col = uint64(c * Q_W) + uty  # unsigned: see uty above
                    k_col = uint64(c * K_W) + utx
                    for i in range(TM):
                        a[i] = q_t[q_col + uint64(i * THREADS_M)]
                    for j in range(TN):
                        bb[j] = kv_s[k_col + uint64(j * THREADS_N)]
                    for i in range(TM):
                        for j in range(TN):
                            s[i, j] += a[i] * bb[j]

            # Masked scores become -inf by selection (a NaN score of a hidden key must vanish).
            for i in range(TM):
                row = start_m + ty + i * THREADS_M
                tile_max = NEG_INF
                for j in range(TN):
                    col = start_n + tx + j * THREADS_N
                    if not visible(mask, b, h, row, col, lo[i], hi[i], interior, n_q,
                                   msb, msh, msi, msj):
                        s[i, j] = NEG_INF
                    tile_max = max(tile_max, s[i, j])
                row_max[ty + i * THREADS_M, tx] = tile_max
            cuda.syncthreads()  # Barrier: all partial row maxima are written.

            for i in range(TM):
                r = ty + i * THREADS_M
                tile_max = NEG_INF
                for t in range(THREADS_N):
                    tile_max = max(tile_max, row_max[r, t])
                # Rounding is monotone, so this is the max of the rounded scaled scores.
                m_new = max(m_i[i], tile_max * qk_scale)
                m_safe = ZERO if m_new == NEG_INF else m_new  # fully masked: no exp2(-inf + inf)
                alpha = math.exp2(m_i[i] - m_safe)  # rescales what was summed under the old max
                partial = ZERO
                for j in range(TN):
                    # One FMA. Hidden keys: exp2(-inf) = 0; NaN stays NaN.
                    p = math.exp2(s[i, j] * qk_scale - m_safe)
                    partial += p
                    p_t[tx + j * THREADS_N, r] = p
                row_sum[r, tx] = partial
                l_i[i] *= alpha
                for j in range(TV):
                    acc[i, j] *= alpha
                m_i[i] = m_new
            # Barrier: P and the partial sums are written, and every read of K is done, so
            # V may take its place.
            cuda.syncthreads()

            bad = load_v(v, b, hk, start_n, end_n - start_n, dv, kv_s, ONE)
            # Barrier: the V tile is complete. It also tells every thread whether any thread
            # loaded a non-finite value, so the whole block takes the same path below.
            v_bad = cuda.syncthreads_or(bad)

            for i in range(TM):
                r = ty + i * THREADS_M
                for t in range(THREADS_N):
                    l_i[i] += row_sum[r, t]
            # O += P V for this thread's TM x TV micro-tile.
            if not v_bad:
                # Keys past end_n have p = 0 and zero rows of V: the loop stops there.
                for n0 in range(0, min(BLOCK_N, end_n - start_n), UNROLL_PV):
                    for n in range(n0, n0 + UNROLL_PV):
                        p_row = uint64(n)
                        v_row = uint64(n * DV) + utx
                        for i in range(TM):
                            a[i] = p_t[p_row, uty + uint64(i * THREADS_M)]
                        for j in range(TV):
                            bb[j] = kv_s[v_row + uint64(j * THREADS_N)]
                        for i in range(TM):
                            for j in range(TV):
                                acc[i, j] += a[i] * bb[j]
            else:
                # A NaN or inf in V. A hidden key has p = 0, but 0 * NaN = NaN: add only the
                # keys each row sees. Rare, so not unrolled.
                for n in range(BLOCK_N):
                    for j in range(TV):
                        bb[j] = kv_s[n * DV + tx + j * THREADS_N]
                    for i in range(TM):
                        if visible(mask, b, h, start_m + ty + i * THREADS_M, start_n + n,
                                   lo[i], hi[i], interior, n_q, msb, msh, msi, msj):
                            a_i = p_t[n, ty + i * THREADS_M]
                            for j in range(TV):
                                acc[i, j] += a_i * bb[j]

        # out = acc / l_i; a row that saw no key has l_i = 0 and gives out = 0, lse = -inf.
        # The rows go through shared memory (q_t's words, free now) so that the stores to
        # `out` are coalesced: a thread's own columns are THREADS_N words apart.
        # Barrier: every read of q_t (and, with no key tile, its load) is finished.
        cuda.syncthreads()
        for i in range(TM):
            r = ty + i * THREADS_M
            empty = l_i[i] == ZERO
            inv_l = ZERO if empty else ONE / l_i[i]
            for j in range(TV):
                q_t[r * O_W + tx + j * THREADS_N] = ZERO if empty else acc[i, j] * inv_l
            if tx == 0 and start_m + r < n_q:
                lse[ob, h, start_m + r] = (NEG_INF if empty
                                           else (m_i[i] + math.log2(l_i[i])) * F_LN2)
        cuda.syncthreads()  # Barrier: the output tile is complete.
        for it in range(BLOCK_M * DV // THREADS):
            idx = tid + it * THREADS
            r = idx // DV
            c = idx % DV
            if start_m + r < n_q and c < dv:
                out[ob, h, start_m + r, c] = store(q_t[r * O_W + c])

    return flash_fwd
