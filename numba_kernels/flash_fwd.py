"""The FlashAttention-2 forward kernel on CUDA cores, one thread block per (BLOCK_M query rows,
batch, head), each thread a register micro-tile (TM rows x TN keys of S, TM rows x TV columns
of the output). Read it beside reference/tiled.py (and first plain_fwd.py, the same algorithm
written plainly): same names (start_m, start_n, first, last, m_i, l_i, acc, alpha, m_new,
m_safe, qk_scale). kernel_source, at the end, is the kernel; it calls named device functions
in the algorithm's order:

    load_q          the block's Q tile into shared memory, once
    init_rows       m_i = -inf, l_i = 0, acc = 0; each row's visible keys lo <= j < hi
    key_tiles       the key tiles first .. last any row of the block sees
    for each key tile start_n ..:
        load_k          the K tile
        scores          S = Q K^T, the thread's micro-tile
        scale_and_mask  S * qk_scale (+ bias), -inf where hidden; the thread's row maxima
        online_softmax  m_new, alpha, P = exp2(S - m_new), l_i and acc rescaled
        load_v          the V tile (in K's words)
        pv              acc += P V (pv_seen_keys where V holds NaN or inf)
    store_out       out = acc / l, lse

docs/design/simt.md draws the micro-tiles and the shared-memory layout. All sizes are closure
ints of the factories (sizes_of(spec)); device functions are inlined.
"""
import math
from dataclasses import dataclass

from numba import cuda

from .block_sparse import make_tile_walk
from .common import (ARG_NAMES, F_LN2, NEG_INF, NO_PART, STATIC_SHARED_LIMIT, ZERO,
                     bias_given, check_parameters, kernel_part, make_masked_score,
                     takes_part)
from .convert import float32, int64, uint64, CONVERTERS, device_function, load4
from .schedule import block_program, key_range_device, key_tiles

VEC = 4  # float32 words a 128-bit shared load takes (convert.load4)


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


def sizes_of(spec):
    """The compile-time sizes of variant `spec`, by the names the device functions use."""
    spec.check()
    TM = spec.block_m // spec.threads_m
    TV = spec.dv // spec.threads_n
    return dict(
        BLOCK_M=spec.block_m, BLOCK_N=spec.block_n, D=spec.d, DV=spec.dv,
        THREADS_M=spec.threads_m, THREADS_N=spec.threads_n, THREADS=spec.threads,
        TM=TM, TN=spec.block_n // spec.threads_n, TV=TV,
        V_GROUP=VEC if TV % VEC == 0 else 1,  # output columns a thread owns side by side
        WIDTHS=spec.widths, OFFSETS=tuple(uint64(x) for x in spec.offsets[:4]),
        HAS_MASK=spec.has_mask)


def make_init_rows(sizes):
    TM, TV, THREADS_M = sizes["TM"], sizes["TV"], sizes["THREADS_M"]

    @kernel_part
    def init_rows(m_i, l_i, acc, lo, hi, first_row, n_q, kv_len, left, right, bottom_right):
        """For each of the thread's rows first_row + i * THREADS_M: m_i = -inf, l_i = 0,
        acc = 0, and the keys lo <= j < hi it sees (the contract's key_range)."""
        for i in range(TM):
            m_i[i] = NEG_INF
            l_i[i] = ZERO
            for j in range(TV):
                acc[i, j] = ZERO
            lo[i], hi[i] = key_range_device(first_row + i * THREADS_M, n_q, kv_len, left,
                                            right, bottom_right)

    return init_rows


def make_scores(sizes):
    TM, TN, THREADS_M, THREADS_N = sizes["TM"], sizes["TN"], sizes["THREADS_M"], sizes["THREADS_N"]
    Q_W, K_W = sizes["WIDTHS"][:2]
    Q_AT, KV_AT = sizes["OFFSETS"][:2]
    STEP = 2 * VEC  # head-dim columns a step: two 128-bit loads

    @kernel_part
    def scores(words, s, frag, ty_u, tx_u, d_steps):
        """S = Q K^T (raw scores) for this thread's TM x TN micro-tile, from the Q and K tiles
        in shared memory, STEP head-dim columns a step: two 128-bit loads a row of Q (into
        frag), then two a key, each used TM times. Columns past d are zeros in both tiles:
        the d_steps steps stop at d rounded up to STEP (D is a multiple of 16)."""
        for i in range(TM):
            for j in range(TN):
                s[i, j] = ZERO
        for step in range(d_steps):
            c = uint64(step * STEP)
            for i in range(TM):
                q_row = Q_AT + (ty_u + uint64(i * THREADS_M)) * uint64(Q_W) + c
                frag[i, 0], frag[i, 1], frag[i, 2], frag[i, 3] = load4(words, q_row)
                frag[i, 4], frag[i, 5], frag[i, 6], frag[i, 7] = load4(words,
                                                                       q_row + uint64(VEC))
            for j in range(TN):
                k_row = KV_AT + (tx_u + uint64(j * THREADS_N)) * uint64(K_W) + c
                k0, k1, k2, k3 = load4(words, k_row)
                k4, k5, k6, k7 = load4(words, k_row + uint64(VEC))
                for i in range(TM):  # head-dim order, as one thread would sum it
                    s[i, j] += frag[i, 0] * k0
                    s[i, j] += frag[i, 1] * k1
                    s[i, j] += frag[i, 2] * k2
                    s[i, j] += frag[i, 3] * k3
                    s[i, j] += frag[i, 4] * k4
                    s[i, j] += frag[i, 5] * k5
                    s[i, j] += frag[i, 6] * k6
                    s[i, j] += frag[i, 7] * k7

    return scores


def make_scale_and_mask(sizes, masked_score):
    TM, TN, THREADS_M, THREADS_N = sizes["TM"], sizes["TN"], sizes["THREADS_M"], sizes["THREADS_N"]
    STAT_AT = sizes["OFFSETS"][3]

    @kernel_part
    def scale_and_mask(words, s, qk_scale, mask, bias, mask_steps, bias_steps, b, h,
                       first_row, first_key, lo, hi, interior, n_q, read_mask, read_bias,
                       ty_u, tx_u):
        """S = S * qk_scale (+ bias), -inf where a row does not see a key (masked_score);
        scaled first, as in the reference: a scale <= 0 must not turn a masked -inf into
        +inf or NaN. The thread's max of each of its rows goes to the row statistics.
        first_row, first_key: the thread's first row and key (its rows and keys are
        THREADS_M and THREADS_N apart); read_mask: the tile is partly visible by the mask."""
        for i in range(TM):
            tile_max = NEG_INF
            for j in range(TN):
                s[i, j] = masked_score(s[i, j] * qk_scale, mask, bias, mask_steps,
                                       bias_steps, b, h, first_row + i * THREADS_M,
                                       first_key + j * THREADS_N, lo[i], hi[i], interior, n_q,
                                       read_mask, read_bias)
                tile_max = max(tile_max, s[i, j])
            words[STAT_AT + (ty_u + uint64(i * THREADS_M)) * uint64(THREADS_N) + tx_u] = \
                tile_max

    return scale_and_mask


def make_online_softmax(sizes):
    TM, TN, TV = sizes["TM"], sizes["TN"], sizes["TV"]
    THREADS_M, THREADS_N = sizes["THREADS_M"], sizes["THREADS_N"]
    P_W = sizes["WIDTHS"][3]
    P_AT, STAT_AT = sizes["OFFSETS"][2:4]

    @kernel_part
    def online_softmax(words, s, m_i, l_i, acc, ty_u, tx_u):
        """The online softmax, one tile: each row's max m_new over the THREADS_N partial
        maxima; alpha = exp2(m_i - m_new) rescales what was summed under the old max (l_i,
        acc); P = exp2(S - m_new) goes to shared memory for P V (a hidden key: exp2(-inf) =
        0; NaN stays NaN). Each thread sums its own keys of a row into l_i; the THREADS_N
        parts are added once, at the end."""
        for i in range(TM):
            r = ty_u + uint64(i * THREADS_M)
            tile_max = NEG_INF
            for t in range(THREADS_N):
                tile_max = max(tile_max, words[STAT_AT + r * uint64(THREADS_N) + uint64(t)])
            m_new = max(m_i[i], tile_max)
            m_safe = ZERO if m_new == NEG_INF else m_new  # fully masked: no exp2(-inf + inf)
            alpha = math.exp2(m_i[i] - m_safe)
            row_sum = ZERO
            for j in range(TN):
                p = math.exp2(s[i, j] - m_safe)
                row_sum += p
                words[P_AT + r * uint64(P_W) + tx_u + uint64(j * THREADS_N)] = p
            l_i[i] = l_i[i] * alpha + row_sum
            for j in range(TV):
                acc[i, j] *= alpha
            m_i[i] = m_new

    return online_softmax


def make_pv(sizes):
    """pv: acc += P V for the thread's TM x TV micro-tile, from the P and V tiles in shared
    memory (the backward's products use it too, with its own sizes: flash_bwd.pv_sizes)."""
    TM, TV, V_GROUP = sizes["TM"], sizes["TV"], sizes["V_GROUP"]
    THREADS_M, THREADS_N = sizes["THREADS_M"], sizes["THREADS_N"]
    V_W, P_W = sizes["WIDTHS"][2:4]
    KV_AT, P_AT = sizes["OFFSETS"][1:3]

    @kernel_part
    def pv(words, acc, frag, v_cols, ty_u, tx_u, n_keys):
        """VEC keys a step: one 128-bit load of P a row (into frag), then for each key the
        thread's output columns of V (into v_cols), V_GROUP side by side; consecutive threads
        take consecutive groups (no bank conflicts). Keys past n_keys have p = 0 and zero
        rows of V: the steps stop there."""
        for quad in range((n_keys + VEC - 1) // VEC):
            n = uint64(quad * VEC)
            for i in range(TM):
                frag[i, 0], frag[i, 1], frag[i, 2], frag[i, 3] = load4(
                    words, P_AT + (ty_u + uint64(i * THREADS_M)) * uint64(P_W) + n)
            for e in range(VEC):
                v_row = KV_AT + (n + uint64(e)) * uint64(V_W) + tx_u * uint64(V_GROUP)
                for g in range(TV // V_GROUP):
                    if V_GROUP == VEC:
                        v_cols[g * VEC], v_cols[g * VEC + 1], v_cols[g * VEC + 2], \
                            v_cols[g * VEC + 3] = load4(words,
                                                        v_row + uint64(g * THREADS_N * VEC))
                    else:
                        v_cols[g] = words[v_row + uint64(g * THREADS_N)]
                for i in range(TM):
                    for j in range(TV):
                        acc[i, j] += frag[i, e] * v_cols[j]

    return pv


def make_pv_seen_keys(sizes):
    """pv_seen_keys: pv for a V tile holding a NaN or an inf."""
    TM, TN, TV, V_GROUP = sizes["TM"], sizes["TN"], sizes["TV"], sizes["V_GROUP"]
    BLOCK_N, THREADS_M, THREADS_N = sizes["BLOCK_N"], sizes["THREADS_M"], sizes["THREADS_N"]
    V_W, P_W = sizes["WIDTHS"][2:4]
    KV_AT, P_AT = sizes["OFFSETS"][1:3]

    @kernel_part
    def pv_seen_keys(words, acc, v_cols, s, ty_u, tx_u):
        """The same for a V tile holding a NaN or an inf, adding only the pairs that take
        part: a hidden key has p = 0, but 0 * NaN = NaN. First each thread marks the pairs
        of its micro-tile whose score is -inf (hidden, or -inf however it arose) with
        P = NO_PART, here and not in online_softmax, where the select costs registers (D =
        128 float16 spilled). Rare, so not unrolled."""
        for i in range(TM):
            for j in range(TN):
                if s[i, j] == NEG_INF:
                    words[P_AT + (ty_u + uint64(i * THREADS_M)) * uint64(P_W) + tx_u
                          + uint64(j * THREADS_N)] = NO_PART
        cuda.syncthreads()  # Barrier: every pair that takes no part is marked.
        for n in range(BLOCK_N):
            for g in range(TV // V_GROUP):
                for e in range(V_GROUP):
                    v_cols[g * V_GROUP + e] = words[
                        KV_AT + uint64(n * V_W) + tx_u * uint64(V_GROUP)
                        + uint64(g * THREADS_N * V_GROUP + e)]
            for i in range(TM):
                p = words[P_AT + (ty_u + uint64(i * THREADS_M)) * uint64(P_W) + uint64(n)]
                if takes_part(p):
                    for j in range(TV):
                        acc[i, j] += p * v_cols[j]

    return pv_seen_keys


def make_store_out(sizes, store):
    TM, TV, V_GROUP = sizes["TM"], sizes["TV"], sizes["V_GROUP"]
    BLOCK_M, DV, THREADS = sizes["BLOCK_M"], sizes["DV"], sizes["THREADS"]
    THREADS_M, THREADS_N = sizes["THREADS_M"], sizes["THREADS_N"]
    O_W = sizes["WIDTHS"][4]
    Q_AT, STAT_AT = sizes["OFFSETS"][0], sizes["OFFSETS"][3]

    @kernel_part
    def store_out(words, out, lse, m_i, l_i, acc, out_b, h, start_m, first_row, n_q, d_v,
                  ty_u, tx_u):
        """out = acc / l and lse = (m_i + log2 l) * ln 2, l the sum of the THREADS_N parts of
        l_i; a row that saw no key has l = 0 and gives out = 0, lse = -inf. The rows go
        through shared memory (Q's words, free now) so that the stores to `out` are
        coalesced: a thread's own columns are THREADS_N * V_GROUP words apart."""
        cuda.syncthreads()  # Barrier: every read of Q, P and the row maxima is finished.
        for i in range(TM):
            words[STAT_AT + (ty_u + uint64(i * THREADS_M)) * uint64(THREADS_N) + tx_u] = l_i[i]
        cuda.syncthreads()  # Barrier: every thread's part of each row sum is written.
        for i in range(TM):
            r = ty_u + uint64(i * THREADS_M)
            l_row = ZERO
            for t in range(THREADS_N):
                l_row += words[STAT_AT + r * uint64(THREADS_N) + uint64(t)]
            empty = l_row == ZERO
            inv_l = ZERO if empty else float32(1.0) / l_row
            for g in range(TV // V_GROUP):
                for e in range(V_GROUP):
                    col = tx_u * uint64(V_GROUP) + uint64(g * THREADS_N * V_GROUP + e)
                    words[Q_AT + r * uint64(O_W) + col] = \
                        ZERO if empty else acc[i, g * V_GROUP + e] * inv_l
            row = first_row + i * THREADS_M
            if tx_u == 0 and row < n_q:
                lse[out_b, h, row] = NEG_INF if empty else (m_i[i] + math.log2(l_row)) * F_LN2
        cuda.syncthreads()  # Barrier: the output tile is complete.
        tid = cuda.threadIdx.x
        for it in range(BLOCK_M * DV // THREADS):
            idx = tid + it * THREADS
            r = idx // DV
            c = idx % DV
            if start_m + r < n_q and c < d_v:
                out[out_b, h, start_m + r, c] = store(words[Q_AT + uint64(r * O_W + c)])

    return store_out


def device_functions(spec):
    """The variant's device functions, built for its sizes (sizes_of(spec)), in the order the
    kernel calls them: load_q, init_rows, load_k, scores, scale_and_mask, online_softmax,
    load_v, pv, pv_seen_keys, store_out."""
    sizes = sizes_of(spec)
    load, store, _ = CONVERTERS[spec.dtype]
    if spec.partial:  # split-KV partial results stay float32 until the merge
        store = CONVERTERS["float32"][1]
    Q_W, K_W, V_W = sizes["WIDTHS"][:3]
    masked_score = make_masked_score(sizes)
    pv, pv_seen_keys = make_pv(sizes), make_pv_seen_keys(sizes)
    # Each batch of tile loads waits for global memory once; larger batches cost registers
    # (specs.LOAD_BATCH chooses them per variant).
    return (tile_loader(load, spec.block_m, spec.d, spec.threads, Q_W, spec.qk_load_batch),
            make_init_rows(sizes),
            tile_loader(load, spec.block_n, spec.d, spec.threads, K_W, spec.qk_load_batch),
            make_scores(sizes), make_scale_and_mask(sizes, masked_score),
            make_online_softmax(sizes),
            tile_loader(load, spec.block_n, spec.dv, spec.threads, V_W, spec.v_load_batch),
            pv, pv_seen_keys, make_store_out(sizes, store))


def kernel_source(spec):
    """The kernel for variant `spec` as a Python function, for cuda.jit or cuda.compile_ptx:
    the FlashAttention-2 forward pass of reference/tiled.py's _program, one block per
    program, calling the device functions above in the algorithm's order."""
    sizes = sizes_of(spec)
    BLOCK_M, BLOCK_N, THREADS_M, THREADS_N = (sizes[n] for n in ("BLOCK_M", "BLOCK_N",
                                                             "THREADS_M", "THREADS_N"))
    TM, TN, TV = sizes["TM"], sizes["TN"], sizes["TV"]
    Q_AT, KV_AT = sizes["OFFSETS"][:2]
    SHARED_WORDS = spec.offsets[4]
    FRAG = 2 * VEC  # local-array shapes must be closure ints, not expressions
    (load_q, init_rows, load_k, scores, scale_and_mask, online_softmax, load_v, pv,
     pv_seen_keys, store_out) = device_functions(spec)
    HAS_MASK = spec.has_mask
    walk = make_tile_walk(HAS_MASK, BLOCK_N)
    walk_range, step_tile, reads_mask, WALK_STEP = (walk.walk_range, walk.step_tile,
                                                     walk.reads_mask, walk.STEP)

    def flash_fwd(q, k, v, mask, visible, bias, kv_lengths, out, lse, n_q, d, d_v, group,
                  heads_q, n_tiles, n_splits, split_keys, qk_scale, left, right, bottom_right,
                  mask_steps, bias_steps):
        # One shared array, carved by KernelSpec.offsets; at offset 0 of the block's shared
        # memory it is 16-byte aligned, as load4 needs.
        words = cuda.shared.array(SHARED_WORDS, float32)
        m_i = cuda.local.array(TM, float32)  # running max of the scaled scores (log2), a row
        l_i = cuda.local.array(TM, float32)  # this thread's part of sum exp2(s - m_i)
        acc = cuda.local.array((TM, TV), float32)  # running sum of exp2(s - m_i) * v
        lo = cuda.local.array(TM, int64)  # each row's visible keys lo <= j < hi
        hi = cuda.local.array(TM, int64)
        s = cuda.local.array((TM, TN), float32)  # the scores of the thread's micro-tile
        frag = cuda.local.array((TM, FRAG), float32)  # a row's slice of Q, then of P
        v_cols = cuda.local.array(TV, float32)  # the thread's columns of one key's V

        tid = cuda.threadIdx.x
        ty, tx = tid // THREADS_N, tid % THREADS_N  # rows ty + i * THREADS_M, keys tx + j * ..
        # Shared-memory indices are unsigned: Numba tests every signed index for a negative
        # value (Python's wraparound), a compare and a select a load (PERF.md, v5).
        ty_u, tx_u = uint64(ty), uint64(tx)
        batch = kv_lengths.shape[0]
        split, b, h, tile = block_program(n_tiles, right, batch, heads_q)
        out_b = split * batch + b  # where this block's out and lse go (split-KV: partials)
        hk = h // group  # grouped-query attention: query head h reads key head h // group
        start_m = tile * BLOCK_M
        kv_len = int64(kv_lengths[b])
        k_bh, v_bh = k[b, hk], v[b, hk]  # (Nk, D) views: the tile loaders index rows, columns

        load_q(q[b, h], start_m, min(BLOCK_M, n_q - start_m), d, words, Q_AT)  # once
        init_rows(m_i, l_i, acc, lo, hi, start_m + ty, n_q, kv_len, left, right, bottom_right)
        first, last, lo_last, hi_first = key_tiles(
            start_m, min(start_m + BLOCK_M, n_q) - 1, n_q, kv_len, left, right, bottom_right,
            split, n_splits, split_keys, BLOCK_N)
        d_steps = (d + FRAG - 1) // FRAG  # scores' steps: head-dim columns past d are zeros
        cb, ch = b * mask_steps[0], h * mask_steps[1]  # this block's visible list
        biased = HAS_MASK and bias_given(bias, bias_steps)
        t0, t1 = walk_range(visible, cb, ch, tile, first, last)  # tiles no row sees: none
        for t in range(t0, t1, WALK_STEP):
            start_n = step_tile(visible, cb, ch, tile, t)
            # Keys left from start_n: the last tile may be partial (its rows past them are
            # loaded as zeros). Not min(last, start_n + BLOCK_N): that costs registers.
            n_keys = last - start_n
            interior = start_n >= lo_last and start_n + BLOCK_N <= hi_first  # all rows see it
            # Barrier: the last tile's reads of K, V and P are done (on the first tile: Q is
            # loaded) before K takes their words.
            cuda.syncthreads()
            load_k(k_bh, start_n, n_keys, d, words, KV_AT)  # tail rows: zeros
            cuda.syncthreads()  # Barrier: the K tile is complete.
            scores(words, s, frag, ty_u, tx_u, d_steps)
            scale_and_mask(words, s, qk_scale, mask, bias, mask_steps, bias_steps, b, h,
                           start_m + ty, start_n + tx, lo, hi, interior, n_q,
                           reads_mask(visible, cb, ch, tile, t), biased, ty_u, tx_u)
            cuda.syncthreads()  # Barrier: every thread's row maxima are written.
            online_softmax(words, s, m_i, l_i, acc, ty_u, tx_u)
            cuda.syncthreads()  # Barrier: P is written and K is read: V may take its words.
            bad = load_v(v_bh, start_n, n_keys, d_v, words, KV_AT)
            # Barrier: the V tile is complete, and every thread knows whether any loaded a
            # NaN or an inf, so the whole block takes the same path.
            if not cuda.syncthreads_or(bad):
                pv(words, acc, frag, v_cols, ty_u, tx_u, min(BLOCK_N, n_keys))
            else:
                pv_seen_keys(words, acc, v_cols, s, ty_u, tx_u)
        store_out(words, out, lse, m_i, l_i, acc, out_b, h, start_m, start_m + ty, n_q, d_v,
                  ty_u, tx_u)

    return check_parameters(flash_fwd, ARG_NAMES)
