"""The FlashAttention-2 forward kernel, one thread block per (BLOCK_M query rows, batch, head).

Read it beside reference/tiled.py: same algorithm, same names (m_i, l_i, acc, alpha, qk_scale).
What the tiled reference does with whole-tile NumPy operations, a block does here with
THREADS = THREADS_M * THREADS_N threads, each owning a register micro-tile:

    rows  ty + i * THREADS_M   for i < TM    (TM = BLOCK_M / THREADS_M)
    keys  tx + j * THREADS_N   for j < TN    (S = Q K^T, TN = BLOCK_N / THREADS_N)
    cols  (j // VV) * THREADS_N * VV + tx * VV + j % VV    for j < TV
                                             (O = P V,   TV = DV / THREADS_N, VV = 4 where
                                              4 divides TV, else 1)

Per key tile a thread does TM * TN * D + TM * TV * BLOCK_N fused multiply-adds, reading
(TM + TN) * D + TM * BLOCK_N + TV * BLOCK_N words of shared memory, mostly four at a time
(128-bit loads, convert.load4): the micro-tile is what keeps the arithmetic ahead of the
shared-memory loads.

Shared memory: one float32 array (low-precision inputs are converted once, on load), carved
by KernelSpec.offsets, every tile row-major, widths from KernelSpec.widths:
    Q     (BLOCK_M, D + 4), loaded once; at the end the output tile (BLOCK_M, DV + 1), for
          coalesced stores
    K, V  (BLOCK_N, D + 4), then the V tile (BLOCK_N, DV) in the same words
    P     (BLOCK_M, BLOCK_N + 4)
    stats (BLOCK_M, THREADS_N): each thread's part of its rows' max, at the end of their sums
S takes eight head-dim columns a step from a row of Q and a row of K (two 128-bit loads each);
P V takes four keys a step from a row of P, and for each key a thread's output columns of V,
four side by side.

All sizes are closure ints of the factory: the CUDA compiler needs literal shared-array shapes.
"""
import math
from dataclasses import dataclass

from numba import cuda, float32, int64, uint64

from reference.contract import key_range
from .convert import CONVERTERS, device_function, load4

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): exp2 is one ex2.approx instruction
LN2 = 0.6931471805599453
# Fused multiply-add, approximate exp2/log2 and reciprocal. Not nnan/ninf: -inf marks masked
# scores and NaN must propagate, so the compiler may not assume them away.
FASTMATH = {"contract", "afn", "arcp"}
STATIC_SHARED_LIMIT = 48 * 1024  # bytes; above it numba-cuda needs dynamic shared memory
VEC = 4  # float32 words a 128-bit shared load takes (convert.load4)

key_range_device = device_function(key_range)  # the contract's own code


@dataclass(frozen=True)
class KernelSpec:
    """One compiled variant: everything here is a compile-time constant of the kernel."""

    d: int  # head dim of q and k, zero-padded to one of specs.HEAD_DIMS
    dv: int  # head dim of v, padded likewise
    dtype: str  # "float32", "float16" or "bfloat16"
    has_mask: bool  # reads a boolean mask and an additive bias (either may be a constant)
    block_m: int
    block_n: int
    threads_m: int
    threads_n: int
    partial: bool = False  # out is float32 whatever the input dtype (split-KV, split_kv.py)
    qk_load_batch: int = 8  # Q or K tile elements a thread loads before storing any
    v_load_batch: int = 8  # the same for the V tile (tile_loader)

    @property
    def threads(self):
        return self.threads_m * self.threads_n

    @property
    def widths(self):
        """Row widths in words of the shared tiles Q, K, V, P (all row-major) and of the output
        tile. Q, K and P are read VEC words at a time along their rows, by threads on different
        rows: a width of a multiple of VEC plus VEC keeps each row 16-byte aligned and puts the
        rows' 16-byte groups in different banks (width / VEC is odd: every head dim and
        BLOCK_N here is a multiple of 16). V is read along rows by consecutive threads, and
        the output tile is written once: one spare word staggers its rows."""
        return self.d + VEC, self.d + VEC, self.dv, self.block_n + VEC, self.dv + 1

    @property
    def offsets(self):
        """Where the tiles start in the kernel's one shared array, in words, and its length:
        Q (at the end the output tile), K then V in the same words, P, and the row statistics
        (BLOCK_M, THREADS_N): each thread's part of a row's max, at the end of its sum."""
        q_w, k_w, v_w, p_w, o_w = self.widths
        q_at = 0
        kv_at = q_at + self.block_m * max(q_w, o_w)
        p_at = kv_at + self.block_n * max(k_w, v_w)
        stat_at = p_at + self.block_m * p_w
        return q_at, kv_at, p_at, stat_at, stat_at + self.block_m * self.threads_n

    @property
    def shared_bytes(self):
        return 4 * self.offsets[-1]

    def check(self):
        ok = (self.block_m % self.threads_m == 0 and self.block_n % self.threads_n == 0
              and self.dv % self.threads_n == 0 and self.shared_bytes <= STATIC_SHARED_LIMIT
              and self.d % VEC == 0 and self.block_n % VEC == 0
              and all(at % VEC == 0 for at in self.offsets)
              and all(n % self.threads == 0 for n in (self.block_m * self.d,
                                                      self.block_m * self.dv,
                                                      self.block_n * self.d,
                                                      self.block_n * self.dv)))
        if not ok:
            raise ValueError(f"inconsistent kernel spec {self}")
        return self


def tile_loader(load, ROWS, COLS, THREADS, WIDTH, MAX_BATCH):
    """A device function copying a ROWS x COLS tile of a 2-D (N, C) array into shared memory,
    row-major: element (r, c) goes to words[offset + r * WIDTH + c]. Rows >= rows_valid and
    columns >= cols_valid become 0.

    Consecutive threads take consecutive columns, so global reads are coalesced and shared
    stores hit consecutive banks. Which (r, c) a thread takes at step k is a constant plus its
    own (tid // COLS, tid % COLS) where the block's threads tile a row, or a row of them, evenly
    (every shipped width but a few): no division a step. The loads of a batch (at most
    MAX_BATCH elements) are all issued before any store, so their latencies overlap; in a tile
    that is not whole (the last one, or head dims padded with zero columns) out-of-range
    indices are clamped. Returns nonzero if this thread loaded a
    NaN or an inf: x * 0 is 0 for every finite x and NaN otherwise, so one FMA an element
    keeps the test.
    """
    ITERS = ROWS * COLS // THREADS
    BATCH = next(n for n in (16, 8, 4, 2, 1) if ITERS % n == 0 and n <= MAX_BATCH)
    ZERO = float32(0.0)
    ROW_THREADS = COLS % THREADS == 0  # the threads cover part of a row, PER_ROW steps a row
    PER_ROW = uint64(max(1, COLS // THREADS))
    COL_THREADS = not ROW_THREADS and THREADS % COLS == 0  # rows of threads, ROWS_AT_ONCE
    ROWS_AT_ONCE = uint64(max(1, THREADS // COLS))
    U_COLS, U_THREADS, U_WIDTH = uint64(COLS), uint64(THREADS), uint64(WIDTH)

    @device_function
    def where(tid, k):
        """(row, column) of the tile that thread tid takes at step k."""
        if ROW_THREADS:
            return k // PER_ROW, tid + k % PER_ROW * U_THREADS
        if COL_THREADS:
            return tid // U_COLS + k * ROWS_AT_ONCE, tid % U_COLS
        idx = tid + k * U_THREADS
        return idx // U_COLS, idx % U_COLS

    @device_function
    def load_tile(src, row0, rows_valid, cols_valid, words, offset):
        tid = uint64(cuda.threadIdx.x)
        first = uint64(row0)
        stage = cuda.local.array(BATCH, float32)
        check = ZERO
        whole = rows_valid >= ROWS and cols_valid >= COLS  # the same for the whole block
        last_row = uint64(min(rows_valid, ROWS) - 1)
        last_col = uint64(min(cols_valid, COLS) - 1)
        for batch in range(ITERS // BATCH):
            if whole:
                for it in range(BATCH):
                    r, c = where(tid, uint64(batch * BATCH + it))
                    stage[it] = load(src[first + r, c])
            else:  # the tail tile, or padded head-dim columns
                for it in range(BATCH):
                    r, c = where(tid, uint64(batch * BATCH + it))
                    x = load(src[first + min(r, last_row), min(c, last_col)])
                    stage[it] = x if r <= last_row and c <= last_col else ZERO
            for it in range(BATCH):
                r, c = where(tid, uint64(batch * BATCH + it))
                x = stage[it]
                check += x * ZERO
                words[offset + r * U_WIDTH + c] = x
        return 0 if check == ZERO else 1  # NaN == 0 is false

    return load_tile


def kernel_source(spec):
    """The kernel as a Python function, for cuda.jit or cuda.compile_ptx."""
    spec.check()
    BLOCK_M, BLOCK_N, D, DV = spec.block_m, spec.block_n, spec.d, spec.dv
    THREADS_M, THREADS_N, THREADS = spec.threads_m, spec.threads_n, spec.threads
    TM, TN, TV = BLOCK_M // THREADS_M, BLOCK_N // THREADS_N, DV // THREADS_N
    VV = VEC if TV % VEC == 0 else 1  # output columns a thread owns side by side
    VEC2 = 2 * VEC  # S takes two load4s a row a step
    Q_W, K_W, V_W, P_W, O_W = spec.widths
    Q_AT, KV_AT, P_AT, STAT_AT = (uint64(x) for x in spec.offsets[:4])
    SHARED_WORDS = spec.offsets[4]
    HAS_MASK = spec.has_mask
    load, store, _ = CONVERTERS[spec.dtype]
    if spec.partial:  # split-KV partial results stay float32 until the merge
        store = CONVERTERS["float32"][1]
    # Each batch of tile loads waits for global memory once; larger batches cost registers
    # (specs.LOAD_BATCH chooses them per variant).
    load_q = tile_loader(load, BLOCK_M, D, THREADS, Q_W, spec.qk_load_batch)
    load_k = tile_loader(load, BLOCK_N, D, THREADS, K_W, spec.qk_load_batch)
    load_v = tile_loader(load, BLOCK_N, DV, THREADS, V_W, spec.v_load_batch)
    ZERO, NEG_INF = float32(0.0), float32(-math.inf)
    F_LN2, F_LOG2E = float32(LN2), float32(LOG2E)
    U = uint64  # shared-memory indices are unsigned: see uty below

    @device_function
    def masked_score(x, mask, bias, b, h, row, col, lo, hi, interior, n_q, msb, msh, msi,
                     msj, bsb, bsh, bsi, bsj):
        """x (a scaled score, log2 units) plus the bias if query row `row` sees key `col`, else
        -inf (contract: key_range, the boolean mask, bias != -inf). Selected, not added: a
        NaN score of a hidden key must vanish."""
        if not (row < n_q and (interior or (col >= lo and col < hi))):
            return NEG_INF
        if HAS_MASK:
            if mask[b * msb, h * msh, row * msi, col * msj] == 0:
                return NEG_INF
            add = bias[b * bsb, h * bsh, row * bsi, col * bsj]
            if add == NEG_INF:
                return NEG_INF
            x += add * F_LOG2E
        return x

    def flash_fwd(q, k, v, mask, bias, kv_lengths, out, lse, n_q, d, dv, group, heads_q,
                  n_tiles, split_len, qk_scale, left, right, bottom_right, msb, msh, msi, msj,
                  bsb, bsh, bsi, bsj):
        # One shared array, carved by the offsets of KernelSpec.offsets: starting at offset 0
        # of the block's shared memory, it is 16-byte aligned, which load4 needs.
        words = cuda.shared.array(SHARED_WORDS, float32)
        # S holds raw scores q . k, then s * qk_scale (+ bias), in log2 units. Scaling Q on
        # load instead rounds every element of Q once more, which with large scores costs more
        # accuracy than the plain computation loses (verify's criterion).
        m_i = cuda.local.array(TM, float32)  # running max of the scaled scores (log2), per row
        l_i = cuda.local.array(TM, float32)  # this thread's part of sum exp2(s * qk_scale - m_i)
        acc = cuda.local.array((TM, TV), float32)  # running sum of exp2(s * qk_scale - m_i) * v
        lo = cuda.local.array(TM, int64)  # each row's visible keys lo <= j < hi
        hi = cuda.local.array(TM, int64)
        s = cuda.local.array((TM, TN), float32)
        a = cuda.local.array((TM, VEC2), float32)
        bb = cuda.local.array(TV, float32)

        tid = cuda.threadIdx.x
        ty = tid // THREADS_N
        tx = tid % THREADS_N
        # The inner loops index shared memory with unsigned integers: Numba tests every signed
        # index for a negative value (Python's wraparound), a compare and a select a load,
        # which the profile (PERF.md, v5) found filling the integer pipe.
        uty = U(ty)
        utx = U(tx)
        # Blocks run over (split, batch, head, query tile). Consecutive blocks share a (batch,
        # head), so its K and V stay in L2, and the last query tile of each goes first. Under a
        # causal band (right >= 0) the later query tiles see more keys: then the blocks run
        # tile by tile across every (split, batch, head), last tile first, so the longest
        # blocks start first and none of them runs last. With split-KV (split_kv.py) a block
        # sees only keys [split * split_len, (split + 1) * split_len) and writes a partial
        # result at batch index split * B + b; without it, split = 0.
        batch = kv_lengths.shape[0]
        block = int64(cuda.blockIdx.x)
        if right >= 0:
            n_bh = int64(cuda.gridDim.x) // n_tiles
            bh = block % n_bh
            tile = n_tiles - 1 - block // n_bh
        else:
            bh = block // n_tiles
            tile = n_tiles - 1 - block % n_tiles
        split = bh // (batch * heads_q)
        b = bh // heads_q % batch
        h = bh % heads_q
        ob = split * batch + b  # where this block's out and lse go
        hk = h // group  # grouped-query attention: query head h reads key head h // group
        start_m = tile * BLOCK_M
        kv_len = int64(kv_lengths[b])
        k_bh = k[b, hk]  # (N_k, D) views: the tile loaders index rows and columns only
        v_bh = v[b, hk]

        # Q tile, loaded once and reused against every key tile.
        load_q(q[b, h], start_m, min(BLOCK_M, n_q - start_m), d, words, Q_AT)

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
        # Head-dim columns past the real d are zeros in both tiles: S stops at d, rounded up
        # to 2 * VEC (a step pair of load4s; D is a multiple of 16).
        d_pairs = (d + 2 * VEC - 1) // (2 * VEC)

        for start_n in range(first_n, end_n, BLOCK_N):
            # A tile every row sees whole needs no per-key band test.
            interior = start_n >= lo_last and start_n + BLOCK_N <= hi_first
            # Barrier: the previous tile's reads of the K/V words and of P are finished before
            # K overwrites them; on the first tile, Q's writes become visible.
            cuda.syncthreads()
            load_k(k_bh, start_n, end_n - start_n, d, words, KV_AT)  # tail rows: zeros
            cuda.syncthreads()  # Barrier: the K tile is complete before anyone reads it.

            # S = Q K^T for this thread's TM x TN micro-tile (raw scores), VEC columns of the
            # head dim a step: one 128-bit load a row of Q and one a key.
            for i in range(TM):
                for j in range(TN):
                    s[i, j] = ZERO
            for pair in range(d_pairs):  # two load4s a row: the second overlaps the FMAs
                c = U(pair * 2 * VEC)
                for i in range(TM):
                    q_row = Q_AT + (uty + U(i * THREADS_M)) * U(Q_W) + c
                    a[i, 0], a[i, 1], a[i, 2], a[i, 3] = load4(words, q_row)
                    a[i, 4], a[i, 5], a[i, 6], a[i, 7] = load4(words, q_row + U(VEC))
                for j in range(TN):
                    k_row = KV_AT + (utx + U(j * THREADS_N)) * U(K_W) + c
                    k0, k1, k2, k3 = load4(words, k_row)
                    k4, k5, k6, k7 = load4(words, k_row + U(VEC))
                    for i in range(TM):  # head-dim order, as one thread would sum it
                        s[i, j] += a[i, 0] * k0
                        s[i, j] += a[i, 1] * k1
                        s[i, j] += a[i, 2] * k2
                        s[i, j] += a[i, 3] * k3
                        s[i, j] += a[i, 4] * k4
                        s[i, j] += a[i, 5] * k5
                        s[i, j] += a[i, 6] * k6
                        s[i, j] += a[i, 7] * k7

            # S = S * qk_scale (+ bias), then masked scores become -inf by selection (a NaN
            # score of a hidden key must vanish). Scale first: a scale <= 0 would turn a
            # masked -inf into +inf or NaN.
            for i in range(TM):
                row = start_m + ty + i * THREADS_M
                tile_max = NEG_INF
                for j in range(TN):
                    s[i, j] = masked_score(s[i, j] * qk_scale, mask, bias, b, h, row,
                                           start_n + tx + j * THREADS_N, lo[i], hi[i],
                                           interior, n_q, msb, msh, msi, msj, bsb, bsh, bsi,
                                           bsj)
                    tile_max = max(tile_max, s[i, j])
                words[STAT_AT + (uty + U(i * THREADS_M)) * U(THREADS_N) + utx] = tile_max
            cuda.syncthreads()  # Barrier: all partial row maxima are written.

            for i in range(TM):
                r = uty + U(i * THREADS_M)
                tile_max = NEG_INF
                for t in range(THREADS_N):
                    tile_max = max(tile_max, words[STAT_AT + r * U(THREADS_N) + U(t)])
                m_new = max(m_i[i], tile_max)
                m_safe = ZERO if m_new == NEG_INF else m_new  # fully masked: no exp2(-inf + inf)
                alpha = math.exp2(m_i[i] - m_safe)  # rescales what was summed under the old max
                partial = ZERO
                for j in range(TN):
                    # Hidden keys: exp2(-inf) = 0; NaN stays NaN.
                    p = math.exp2(s[i, j] - m_safe)
                    partial += p
                    words[P_AT + r * U(P_W) + utx + U(j * THREADS_N)] = p
                # Each thread sums its own keys of the row; the THREADS_N parts are added once,
                # at the end.
                l_i[i] = l_i[i] * alpha + partial
                for j in range(TV):
                    acc[i, j] *= alpha
                m_i[i] = m_new
            # Barrier: P is written, and every read of K is done, so V may take its place.
            cuda.syncthreads()

            bad = load_v(v_bh, start_n, end_n - start_n, dv, words, KV_AT)
            # Barrier: the V tile is complete. It also tells every thread whether any thread
            # loaded a non-finite value, so the whole block takes the same path below.
            v_bad = cuda.syncthreads_or(bad)

            # O += P V for this thread's TM x TV micro-tile, VEC keys a step: one 128-bit load
            # of P a row, then for each key the thread's output columns of V, VV side by side
            # (consecutive threads take consecutive groups: no bank conflicts).
            if not v_bad:
                # Keys past end_n have p = 0 and zero rows of V: the loop stops there.
                for quad in range((min(BLOCK_N, end_n - start_n) + VEC - 1) // VEC):
                    n = U(quad * VEC)
                    for i in range(TM):
                        a[i, 0], a[i, 1], a[i, 2], a[i, 3] = load4(
                            words, P_AT + (uty + U(i * THREADS_M)) * U(P_W) + n)
                    for e in range(VEC):
                        v_row = KV_AT + (n + U(e)) * U(V_W) + utx * U(VV)
                        for g in range(TV // VV):
                            if VV == VEC:
                                bb[g * VEC], bb[g * VEC + 1], bb[g * VEC + 2], bb[g * VEC + 3] = \
                                    load4(words, v_row + U(g * THREADS_N * VEC))
                            else:
                                bb[g] = words[v_row + U(g * THREADS_N)]
                        for i in range(TM):
                            for j in range(TV):
                                acc[i, j] += a[i, e] * bb[j]
            else:
                # A NaN or inf in V. A hidden key has p = 0, but 0 * NaN = NaN: add only the
                # keys each row sees. Rare, so not unrolled.
                for n in range(BLOCK_N):
                    for g in range(TV // VV):
                        for e in range(VV):
                            bb[g * VV + e] = words[KV_AT + U(n * V_W) + utx * U(VV)
                                                   + U(g * THREADS_N * VV + e)]
                    for i in range(TM):
                        if masked_score(ZERO, mask, bias, b, h, start_m + ty + i * THREADS_M,
                                        start_n + n, lo[i], hi[i], interior, n_q, msb, msh,
                                        msi, msj, bsb, bsh, bsi, bsj) != NEG_INF:
                            a_i = words[P_AT + (uty + U(i * THREADS_M)) * U(P_W) + U(n)]
                            for j in range(TV):
                                acc[i, j] += a_i * bb[j]

        # out = acc / l; a row that saw no key has l = 0 and gives out = 0, lse = -inf.
        # Barrier: every read of Q, P and the row maxima is finished.
        cuda.syncthreads()
        for i in range(TM):
            words[STAT_AT + (uty + U(i * THREADS_M)) * U(THREADS_N) + utx] = l_i[i]
        cuda.syncthreads()  # Barrier: every thread's part of each row sum is written.
        # The rows go through shared memory (Q's words, free now) so that the stores to `out`
        # are coalesced: a thread's own columns are THREADS_N * VV words apart.
        for i in range(TM):
            r = uty + U(i * THREADS_M)
            l_row = ZERO
            for t in range(THREADS_N):
                l_row += words[STAT_AT + r * U(THREADS_N) + U(t)]
            empty = l_row == ZERO
            inv_l = ZERO if empty else float32(1.0) / l_row
            for g in range(TV // VV):
                for e in range(VV):
                    col = utx * U(VV) + U(g * THREADS_N * VV + e)
                    words[Q_AT + r * U(O_W) + col] = ZERO if empty else acc[i, g * VV + e] * inv_l
            if tx == 0 and start_m + ty + i * THREADS_M < n_q:
                lse[ob, h, start_m + ty + i * THREADS_M] = (
                    NEG_INF if empty else (m_i[i] + math.log2(l_row)) * F_LN2)
        cuda.syncthreads()  # Barrier: the output tile is complete.
        for it in range(BLOCK_M * DV // THREADS):
            idx = tid + it * THREADS
            r = idx // DV
            c = idx % DV
            if start_m + r < n_q and c < dv:
                out[ob, h, start_m + r, c] = store(words[Q_AT + U(r * O_W + c)])

    return flash_fwd
