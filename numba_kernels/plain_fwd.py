"""The plain FlashAttention-2 forward kernel: the algorithm of reference/tiled.py, written to
be read, one CUDA thread per query row.

Start here; flash_fwd.py is the same algorithm tuned (register micro-tiles, 128-bit shared
loads, batched global loads). Names follow reference/tiled.py: a block is one "program",
BLOCK_M query rows (one thread each) of one (batch, head); it walks the key tiles of BLOCK_N
keys and keeps, per row, the running max m_i, the running sum l_i and the accumulator acc.

    grid:    (query tiles, B * Hq)        block: BLOCK_M threads, thread t owns row start_m + t
    shared:  K_tile (BLOCK_N, D + 1), V_tile (BLOCK_N, DV + 1), float32: each tile is loaded
             once by all threads together and then read by every thread. The spare column
             puts the rows of a tile in different banks.
    local:   q_i (D), acc (DV), s (BLOCK_N): the thread's own row.

Every tile costs two barriers: one before it is overwritten (all reads of the last tile are
done), one after it is loaded (every element is written). Arithmetic is float32 whatever the
input dtype; exponentials are base 2 with log2(e) folded into qk_scale, as in the reference.
"""
import math
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda

from .compile_cache import jit
from .convert import float32, CONVERTERS, device_function
from .common import ARGS, F_LN2, F_LOG2E, FASTMATH, NEG_INF, ZERO, check_parameters
from .schedule import key_range_device

# The plain kernel's arguments: those of flash_fwd.py's ARGS it needs (the same meanings).
PLAIN_ARGS = tuple(a for a in ARGS if a[0] in (
    "q", "k", "v", "mask", "bias", "kv_lengths", "out", "lse", "n_q", "group", "qk_scale",
    "left", "right", "bottom_right", "mask_steps", "bias_steps"))
PLAIN_ARG_NAMES = tuple(name for name, _, _ in PLAIN_ARGS)

PLAIN_TILES = {64: (32, 32), 128: (32, 16), 256: (16, 16)}  # width: (BLOCK_M, BLOCK_N)


@dataclass(frozen=True)
class PlainSpec:
    """One compiled variant of the plain kernel (for the PTX report). Its per-thread arrays
    (the row of Q, acc, the scores of a tile) live in local memory, 0.4 to 2 KB a thread: it
    is written to be read; flash_fwd.py keeps everything in registers."""

    width: int  # head dims padded to this
    dtype: str
    has_mask: bool


def plain_specs(widths):
    """The variants of the padded head-dim widths a call can launch (specs.HEAD_DIMS), each
    dtype, with and without a mask: what the PTX gate compiles."""
    return [PlainSpec(w, dtype, m) for w in widths for dtype in ("float32", "float16",
                                                                 "bfloat16")
            for m in (False, True)]


def plain_tiles(width):
    """(BLOCK_M, BLOCK_N) for head dims padded to `width` (shared tiles within 48 KB)."""
    return PLAIN_TILES[next(w for w in PLAIN_TILES if w >= width)]


@lru_cache(maxsize=64)
def plain_kernel(D, DV, dtype, has_mask):
    """The compiled kernel for head dims padded to D, DV (compile-time sizes of the local and
    shared arrays), input dtype and whether it reads a mask and a bias."""
    fn = plain_kernel_source(D, DV, dtype, has_mask)
    return jit(fn, ("plain", D, DV, dtype, has_mask), FASTMATH)


def make_score(has_mask):
    """score(dot, ..., i, j, ...): the scaled score q_i . k_j * qk_scale (+ bias, log2 units)
    of row i and key j, or -inf where the row does not see the key (the contract's key_range,
    the mask, bias != -inf). Scaled before the mask: a scale <= 0 keeps -inf as -inf."""
    @device_function(fastmath=FASTMATH)
    def score(dot, mask, bias, mask_steps, bias_steps, b, h, i, j, n_q, kv_len, left, right,
              bottom_right, qk_scale):
        lo, hi = key_range_device(i, n_q, kv_len, left, right, bottom_right)
        if not (i < n_q and j < kv_len and lo <= j and j < hi):
            return NEG_INF
        s = dot * qk_scale
        if has_mask:  # the steps are 0 where mask or bias broadcasts
            ms, bs = mask_steps, bias_steps
            add = bias[b * bs[0], h * bs[1], i * bs[2], j * bs[3]]
            if mask[b * ms[0], h * ms[1], i * ms[2], j * ms[3]] == 0 or add == NEG_INF:
                return NEG_INF
            s += add * F_LOG2E
        return s

    return score


def make_load_tile(dtype, ROWS, WIDTH):
    """load_tile(tile, x, b, h, start, n, width, t, threads): the shared tile (ROWS, WIDTH + 1)
    gets rows start.. of x[b, h], float32, zeros past row n and column width. Thread t of
    `threads` writes every threads-th element: consecutive threads, consecutive columns."""
    load = CONVERTERS[dtype][0]

    @device_function(fastmath=FASTMATH)
    def load_tile(tile, x, b, h, start, n, width, t, threads):
        for idx in range(t, ROWS * WIDTH, threads):
            r, c = idx // WIDTH, idx % WIDTH
            ok = start + r < n and c < width
            tile[r, c] = load(x[b, h, start + r, c]) if ok else ZERO

    return load_tile


def make_load_row(dtype, WIDTH):
    """load_row(row, x, b, h, i, ok, width): the thread's own row[:WIDTH] = x[b, h, i],
    float32, zeros past column width and where not ok (a row or key past the end)."""
    load = CONVERTERS[dtype][0]

    @device_function(fastmath=FASTMATH)
    def load_row(row, x, b, h, i, ok, width):
        for c in range(WIDTH):
            row[c] = load(x[b, h, i, c]) if ok and c < width else ZERO

    return load_row


def plain_kernel_source(D, DV, dtype, has_mask):
    BLOCK_M, BLOCK_N = plain_tiles(max(D, DV))
    K_W, V_W = D + 1, DV + 1  # shared-array shapes must be closure ints, not expressions
    store = CONVERTERS[dtype][1]
    score = make_score(has_mask)
    load_q_row = make_load_row(dtype, D)
    load_k_tile, load_v_tile = make_load_tile(dtype, BLOCK_N, D), make_load_tile(dtype,
                                                                                 BLOCK_N, DV)

    def plain_fwd(q, k, v, mask, bias, kv_lengths, out, lse, n_q, group, qk_scale, left,
                  right, bottom_right, mask_steps, bias_steps):
        K_tile = cuda.shared.array((BLOCK_N, K_W), float32)
        V_tile = cuda.shared.array((BLOCK_N, V_W), float32)
        q_i = cuda.local.array(D, float32)
        acc = cuda.local.array(DV, float32)
        s = cuda.local.array(BLOCK_N, float32)

        t = cuda.threadIdx.x
        heads_q = out.shape[1]
        b, h = cuda.blockIdx.y // heads_q, cuda.blockIdx.y % heads_q
        hk = h // group  # grouped-query attention: query head h reads key head h // group
        start_m = cuda.blockIdx.x * BLOCK_M
        i = start_m + t  # this thread's query row
        d, d_v, kv_len = q.shape[3], v.shape[3], kv_lengths[b]
        row_ok = i < n_q  # rows past the end still help load tiles and reach every barrier

        load_q_row(q_i, q, b, h, i, row_ok, d)  # the row of Q, zero-padded to D
        m_i, l_i = NEG_INF, ZERO  # running max (log2 units) and sum of exp2(s - m_i)
        for c in range(DV):
            acc[c] = ZERO  # running sum of exp2(s - m_i) * v

        for start_n in range(0, kv_len, BLOCK_N):
            cuda.syncthreads()  # Barrier: every read of the previous K and V tiles is done.
            load_k_tile(K_tile, k, b, hk, start_n, kv_len, d, t, BLOCK_M)  # zeros past the end
            load_v_tile(V_tile, v, b, hk, start_n, kv_len, d_v, t, BLOCK_M)
            cuda.syncthreads()  # Barrier: both tiles are complete.

            # S = Q K^T * qk_scale (+ bias), log2 units; -inf where the row does not see j.
            tile_max = NEG_INF
            for jj in range(BLOCK_N):
                dot = ZERO
                for c in range(D):
                    dot += q_i[c] * K_tile[jj, c]
                s[jj] = score(dot, mask, bias, mask_steps, bias_steps, b, h, i, start_n + jj,
                              n_q, kv_len, left, right, bottom_right, qk_scale)
                tile_max = max(tile_max, s[jj])

            # The online softmax: rescale what was summed under the old max, add this tile.
            m_new = max(m_i, tile_max)
            m_safe = ZERO if m_new == NEG_INF else m_new  # no key seen yet: no exp2(-inf + inf)
            alpha = math.exp2(m_i - m_safe)
            l_i *= alpha
            for c in range(DV):
                acc[c] *= alpha
            for jj in range(BLOCK_N):
                if s[jj] != NEG_INF:  # a hidden key adds nothing: 0 * NaN would be NaN
                    p = math.exp2(s[jj] - m_safe)
                    l_i += p
                    for c in range(DV):
                        acc[c] += p * V_tile[jj, c]
            m_i = m_new

        if row_ok:  # out = acc / l_i; a row that saw no key: out = 0, lse = -inf
            empty = l_i == ZERO
            for c in range(d_v):
                out[b, h, i, c] = store(ZERO if empty else acc[c] / l_i)
            lse[b, h, i] = NEG_INF if empty else (m_i + math.log2(l_i)) * F_LN2

    return check_parameters(plain_fwd, PLAIN_ARG_NAMES)
