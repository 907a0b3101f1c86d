"""The tensor-core kernels' shared parts (flash_mma.py's forward, flash_mma_bwd.py's backward,
halves.py's float32 products): the warp tiling and its constants, shared-memory tile copies
(cp.async), fragment loads (ldmatrix), the products (mma.sync), the scale and the mask of a
score fragment, and the flags of tiles that hold a NaN or an inf. warp.py draws the fragment
layouts.
"""
from numba import cuda

from . import warp
from .common import ZERO, kernel_part, takes_part

FACTORS = ("factors", "factors", "(8,) float32: float32 inputs' scales c_q, c_k, c_v, c_dout "
           "and their inverses (halves.py); not read for 16-bit inputs")


MMA_DTYPES = ("float16", "bfloat16")  # what mma.sync multiplies
MMA_INPUT_DTYPES = MMA_DTYPES + ("float32",)  # float32: each value as two float16 halves
MMA_WIDTHS = (64, 128)  # head dims are zero-padded to one of these
HALVES_MASK_WIDTH = 64  # float32 with a mask or bias: head dims up to this (above, spills)
BLOCK_M, WARPS, BLOCK_N = 64, 4, 32
FLAG_ROWS = BLOCK_N  # rows of q, k or dout a pre-pass flag covers (halves.py, flash_mma_bwd)
THREADS = 32 * WARPS
PAD = 8  # 16-bit values after each shared row


class TensorCoreVariant:
    """What a tensor-core kernel's variant (flash_mma's MmaSpec, flash_mma_bwd's MmaBwdSpec,
    flash_wgmma's WgmmaSpec, flash_wgmma_bwd's WgmmaBwdSpec: dataclasses with the fields
    dtype, has_mask and full_tiles) derives from its fields."""

    @property
    def halves(self):
        """Whether each operand is two float16 halves (float32 inputs)."""
        return self.dtype == "float32"

    @property
    def reads_mask(self):
        """Whether the variant reads the mask and the bias (with a mask, not full_tiles: a
        block mask alone, whose listed tiles are FULL)."""
        return self.has_mask and not self.full_tiles


def halves_ship(dtype, has_mask, d, d_v):
    """Whether the float32 (halves) kernels, forward and backward alike, take a call: not
    with a mask or bias above head dims of HALVES_MASK_WIDTH, where the backward's registers
    spill. One rule for both: the backward's scores are then the forward's, bit for bit."""
    return not (dtype == "float32" and has_mask and max(d, d_v) > HALVES_MASK_WIDTH)


def full_tiles_apply(dtype, table_read, mask_given, bias_given):
    """Whether the tensor-core kernels, forward (mma.sync and wgmma) and backward, run their
    full_tiles variants (no mask or bias read): 16-bit inputs and a block table read as it is
    (prepass.table_fits), with neither a mask nor a bias, so every tile its lists hold is
    FULL."""
    return dtype != "float32" and table_read and not mask_given and not bias_given


def mma_width(d):
    """The padded width for a head dim d, or None beyond the widest."""
    return next((w for w in MMA_WIDTHS if w >= d), None)


@kernel_part
def row_max(x):
    """The max over the 4 lanes that hold a row of an accumulator fragment (lanes 4g .. 4g
    + 3)."""
    x = max(x, warp.shfl_xor(x, 1))
    return max(x, warp.shfl_xor(x, 2))


def make_copy_tile(ROWS, WIDTH, ROW_WORDS, SWIZZLED=False):
    """copy_tile(words, at, x, base, start, n, width): rows start .. start + ROWS of the
    (n, width) matrix at flat element `base` of x (C-contiguous 16-bit values, width % 8 == 0)
    to the shared tile at word `at`, 16 bytes a cp.async, zeros past row n and column width.
    Thread tid copies chunk c = tid % CHUNKS of rows r = tid // CHUNKS + p * ROWS_AT_ONCE, so
    a warp reads whole rows. Row r's chunk c lands at word r ROW_WORDS + 4 c; SWIZZLED, in the
    128-byte swizzle (flash_wgmma.py's tiles, at a 1024-byte aligned word: blocks of 64
    columns, each ROWS rows of 128 bytes, the chunk at chunk (c % 8) ^ (r % 8) of its row of
    block c // 8), which passes of a multiple of 8 rows leave in place. Not waited for here."""
    CHUNKS = WIDTH // 8  # 16-byte pieces a row
    THREADS = WARPS * 32
    ROWS_AT_ONCE = THREADS // CHUNKS  # rows the block copies in one pass
    PASSES = ROWS // ROWS_AT_ONCE
    BLOCK_WORDS = ROWS * ROW_WORDS  # SWIZZLED: a block of 64 columns
    assert THREADS % CHUNKS == 0 and ROWS % ROWS_AT_ONCE == 0
    assert not SWIZZLED or (ROWS_AT_ONCE % 8 == 0 and ROW_WORDS == 32)

    @kernel_part
    def copy_tile(words, at, x, base, start, n, width):
        tid = cuda.threadIdx.x
        r, c = tid // CHUNKS, tid % CHUNKS
        src = base + (start + r) * width + c * 8  # flat element of pass 0
        swizzled = at + (c // 8) * BLOCK_WORDS + r * ROW_WORDS + 4 * ((c % 8) ^ (r % 8))
        for p in range(PASSES):
            ok = c * 8 < width and start + r + p * ROWS_AT_ONCE < n
            if SWIZZLED:  # pass p's rows: the same chunk of a row
                dst = swizzled + p * ROWS_AT_ONCE * ROW_WORDS
            else:
                dst = at + (r + p * ROWS_AT_ONCE) * ROW_WORDS + c * 4
            warp.cp_async16(words, dst, x, src + p * ROWS_AT_ONCE * width if ok else base,
                            16 if ok else 0)

    return copy_tile


def make_copy_kv(copy_k, copy_v, K_TILE):
    @kernel_part
    def copy_kv(words, at, k, v, k_base, v_base, start, n, d, d_v):
        """The K and V tiles of keys start .. start + BLOCK_N to the stage at word `at`."""
        copy_k(words, at, k, k_base, start, n, d)
        copy_v(words, at + K_TILE, v, v_base, start, n, d_v)

    return copy_kv


def make_next_tile(copy_kv, STAGE):
    @kernel_part
    def next_tile(words, k, v, k_base, v_base, following, last, d, d_v, stage):
        """Wait until this key tile has landed in `stage` for every warp, then begin copying
        the one from `following` (if before `last`) into the other stage (the forward's and
        dQ's loops)."""
        warp.cp_async_wait(0)  # this thread's copies of this tile have landed
        # Barrier: every thread's copies of this tile have landed, and every warp is done
        # with the other stage (the previous tile, or the forward's Q), which the next copy
        # overwrites.
        cuda.syncthreads()
        if following < last:
            copy_kv(words, (1 - stage) * STAGE, k, v, k_base, v_base, following, last, d,
                    d_v)
            warp.cp_async_commit()

    return next_tile


def make_load_q_fragments(D, K_ROW):
    @kernel_part
    def load_q_fragments(words, at, q_frag, lane, w):
        """This warp's 16 rows of the Q tile -> A fragments, 16 head-dim columns a step: lanes
        8m .. 8m + 7 address rows (m % 2) * 8 + r, columns (m // 2) * 8 of the step."""
        m, r = lane // 8, lane % 8
        for kk in range(D // 16):
            q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3] = warp.ldmatrix_x4(
                words, at + (w * 16 + r + 8 * (m % 2)) * K_ROW + kk * 8 + 4 * (m // 2))

    return load_q_fragments


def make_mma_pair(mma):
    @kernel_part
    def mma_pair(c, nb, a0, a1, a2, a3, b0, b1, b2, b3):
        """c's n-blocks nb and nb + 1 += A B for the A fragment a0..a3 and the two B fragments
        of one ldmatrix.x4 (matrices 0, 1: n-block nb; 2, 3: nb + 1)."""
        c[nb, 0], c[nb, 1], c[nb, 2], c[nb, 3] = mma(
            a0, a1, a2, a3, b0, b1, c[nb, 0], c[nb, 1], c[nb, 2], c[nb, 3])
        c[nb + 1, 0], c[nb + 1, 1], c[nb + 1, 2], c[nb + 1, 3] = mma(
            a0, a1, a2, a3, b2, b3, c[nb + 1, 0], c[nb + 1, 1], c[nb + 1, 2], c[nb + 1, 3])

    return mma_pair


def make_scores(D, K_ROW, mma, KEYS=BLOCK_N):
    mma_pair = make_mma_pair(mma)

    @kernel_part
    def scores(words, at, q_frag, s, lane):
        """S = Q K^T for this warp's 16 rows and the KEYS keys, 16 keys x 16 columns a step:
        one ldmatrix.x4 of K gives B fragments for keys 0..7 (matrices 0, 1) and 8..15 (2, 3)."""
        m, r = lane // 8, lane % 8
        for nb in range(KEYS // 8):
            for e in range(4):
                s[nb, e] = ZERO
        for n2 in range(KEYS // 16):
            for kk in range(D // 16):
                b0, b1, b2, b3 = warp.ldmatrix_x4(
                    words, at + (n2 * 16 + r + 8 * (m // 2)) * K_ROW + kk * 8 + 4 * (m % 2))
                mma_pair(s, 2 * n2, q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3],
                         b0, b1, b2, b3)

    return scores


def make_scale_and_mask(masked_score, HAS_MASK):
    @kernel_part
    def scale_and_mask(s, qk_scale, mask, bias, mask_steps, bias_steps, b, h, row0, start_n,
                       lo, hi, interior, whole_rows, n_q, read_mask, read_bias, lane):
        """S * qk_scale (+ bias), -inf where a row does not see a key. Element e of n-block
        nb is row row0 + 8 (e // 2), key start_n + 8 nb + 2 t + e % 2. Most tiles are
        interior (every row sees every key) in a block whose rows all exist: where neither
        mask nor bias is read there (no mask, or a FULL tile of one without a bias),
        S * qk_scale is all (masked_score's tests cost 8 instructions an element).
        read_mask False: the mask shows every pair of the tile; read_bias False: no bias."""
        if (not HAS_MASK or not (read_mask or read_bias)) and interior and whole_rows:
            for nb in range(BLOCK_N // 8):
                for e in range(4):
                    s[nb, e] *= qk_scale
            return
        t = lane % 4
        for nb in range(BLOCK_N // 8):
            for e in range(4):
                half = e // 2
                s[nb, e] = masked_score(s[nb, e] * qk_scale, mask, bias, mask_steps,
                                        bias_steps, b, h, row0 + 8 * half,
                                        start_n + 8 * nb + 2 * t + e % 2, lo[half], hi[half],
                                        interior, n_q, read_mask, read_bias)

    return scale_and_mask


def make_pv(DV, V_ROW, mma, pack, KEYS=BLOCK_N):
    mma_pair = make_mma_pair(mma)

    @kernel_part
    def pv(words, at, s, acc, lane):
        """acc += P V over KEYS keys, 16 a step: P's fragments of n-blocks 2 n2 and 2 n2 + 1
        are the A fragment of keys 16 n2 .. + 15 (packed to the input dtype); one
        ldmatrix.x4.trans of V gives B fragments for 16 output columns (matrices 0, 1:
        columns 0..7; 2, 3: 8..15)."""
        m, r = lane // 8, lane % 8
        for n2 in range(KEYS // 16):
            a0 = pack(s[2 * n2, 0], s[2 * n2, 1])
            a1 = pack(s[2 * n2, 2], s[2 * n2, 3])
            a2 = pack(s[2 * n2 + 1, 0], s[2 * n2 + 1, 1])
            a3 = pack(s[2 * n2 + 1, 2], s[2 * n2 + 1, 3])
            for v2 in range(DV // 16):
                b0, b1, b2, b3 = warp.ldmatrix_x4_trans(
                    words, at + (n2 * 16 + r + 8 * (m % 2)) * V_ROW + v2 * 8 + 4 * (m // 2))
                mma_pair(acc, 2 * v2, a0, a1, a2, a3, b0, b1, b2, b3)

    return pv


def make_unpacked(unpack):
    @kernel_part
    def load_pair(words, at):
        """The two values of the 32-bit word `at` as float32 (pv_seen_pairs's load_pair)."""
        return unpack(words[at])

    return load_pair


def make_pv_seen_pairs(DV, V_ROW, load_pair, KEYS=BLOCK_N):
    @kernel_part
    def pv_seen_pairs(words, at, part, x, acc, lane):
        """acc += X V in float32 over KEYS keys, adding only the pairs that take part
        (takes_part of `part`'s element; the forward passes P as both), for a V tile holding
        a NaN or an inf: -0.0 * NaN would be NaN. Key by key, each lane fetches the values of
        its two rows from the lane that holds them (4 g + (key % 8) // 2), element key % 2
        (+ 2 for row g + 8) of n-block key // 8. Rare."""
        g, t = lane // 4, lane % 4
        for key in range(KEYS):  # a loop, not unrolled: an element is picked by selects
            for half in range(2):  # (an index computed at run time would put it in memory)
                mine_part, mine_x = ZERO, ZERO
                for nb in range(KEYS // 8):
                    for e in range(2):
                        if nb == key // 8 and e == key % 2:
                            mine_part, mine_x = part[nb, 2 * half + e], x[nb, 2 * half + e]
                src = 4 * g + key % 8 // 2
                p, v_x = warp.shfl_idx(mine_part, src), warp.shfl_idx(mine_x, src)
                if takes_part(p):
                    for vb in range(DV // 8):
                        v0, v1 = load_pair(words, at + key * V_ROW + vb * 4 + t)
                        acc[vb, 2 * half] += v_x * v0
                        acc[vb, 2 * half + 1] += v_x * v1

    return pv_seen_pairs


# The exponent bits of a 16-bit float: all ones for an inf or a NaN (either sign).
EXPONENT_BITS = {"float16": 0x7C00, "bfloat16": 0x7F80}


@kernel_part
def word_nonfinite(w, low):
    """Whether either 16-bit value of the 32-bit word w is a NaN or an inf, their exponent
    bits being `low` (EXPONENT_BITS) in the low value: all ones in either half."""
    high = low << 16
    return (w & low) == low or (w & high) == high


@kernel_part
def own_flagged(flags, b, h, start):
    """Whether the 2 FLAG_ROWS rows from `start` of head h are flagged in `flags` (a block's
    own 64 rows: BLOCK_M here, flash_mma_bwd's BLOCK)."""
    f = start // FLAG_ROWS
    return flags[b, h, f] != 0 or (f + 1 < flags.shape[2] and flags[b, h, f + 1] != 0)


@kernel_part
def tiles_flagged(flags_a, flags_b, b, h_first, heads, first_row, last_row, tid, own_bad):
    """Whether the flags of rows first_row .. last_row (inclusive; none when last_row <
    first_row) of heads h_first .. + heads in flags_a or flags_b, or own_bad, say a NaN or an
    inf, for the whole block: its threads read the flags side by side. A barrier (every
    thread calls it)."""
    bad = 1 if own_bad else 0
    if last_row >= first_row:  # no run-time division (a 64-bit one is a subroutine)
        first, last = first_row // FLAG_ROWS, last_row // FLAG_ROWS
        for hh in range(h_first, h_first + heads):
            for f in range(first + tid, last + 1, THREADS):
                if flags_a[b, hh, f] != 0 or flags_b[b, hh, f] != 0:
                    bad = 1
    return cuda.syncthreads_or(bad) != 0


def make_q_scores(scores, exact, Q_HI_AT):
    """S = Q K^T: scores (Q's fragments in registers), or where the call says `slow` (a tile
    pair holding a NaN or an inf) halves.scores_exact from Q's tiles at Q_HI_AT (hi) and
    after; exact None (16-bit, or a variant without the slow path): scores alone."""
    if exact is None:
        @kernel_part
        def plain(words, at, q_frag, s, lane, w, slow):
            scores(words, at, q_frag, s, lane)

        return plain

    @kernel_part
    def either(words, at, q_frag, s, lane, w, slow):
        if slow:
            exact(words, Q_HI_AT, at, s, lane, w)
        else:
            scores(words, at, q_frag, s, lane)

    return either
