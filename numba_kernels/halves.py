"""float32 operands on the float16 tensor cores: each value as two float16 halves.

The pre-pass (absmax, then split) scales each float32 tensor by one power of two c, so that
every |x c| < 2^14, and writes hi = float16(x c) and lo = float16(x c - hi) beside each
other (hi at batch b, lo at B + b), with flags of the row tiles that hold a NaN or an inf.
The tensor-core kernels (flash_mma.py, flash_mma_bwd.py, MmaSpec and MmaBwdSpec dtype
"float32") then do each product as three mma.sync, hi hi + hi lo + lo hi (the small terms
first): products of about 22 bits. At precision "high" mma.sync sums them; at "highest" (the
summed variants) each 16-term step is summed from 0 and added in float32, and dS's rows are
scaled at each step. The forward and the backward compute the scores alike, bit for bit.
docs/design/halves.md has the design: the scales, the operands split in registers, the
rounding of mma.sync's sums, the summed variants, and what the range check
(plan.halves_range_why_not) guards.
"""
import math
from dataclasses import dataclass
from functools import lru_cache

from numba import cuda

from . import warp
from .compile_cache import jit
from .convert import bits_to_float, float_to_bits, float32, int64
from .common import FASTMATH, ZERO, kernel_part
from .mma_parts import (BLOCK_M, BLOCK_N, FLAG_ROWS, make_copy_kv, make_copy_tile,
                        make_mma_pair, make_pv_seen_pairs, make_q_scores, row_max)

TOP = 14  # |x c| < 2^TOP
P_FACTOR = float32(2.0**TOP)
ONE = float32(1.0)
ABS_BLOCKS = 256  # blocks of the absmax pass a tensor (each thread a stride of the tensor)
THREADS = 128
SLOTS = ("q", "k", "v", "dout")  # rows of partial, entries of factors


def ds_factor(d_v):
    """dS's constant scale for padded value width d_v (a power of two): 2^-(15 + log2 d_v)."""
    return float32(2.0 ** -(15 + d_v.bit_length() - 1))


@dataclass(frozen=True)
class HalvesSpec:
    """One kernel of the pre-pass: part "absmax" or "split"."""

    part: str


def halves_specs():
    return [HalvesSpec("absmax"), HalvesSpec("split")]


@kernel_part
def block_max(x, cache):
    """The max of x over the block's THREADS threads (cache: THREADS shared floats), known to
    every thread. Barriers."""
    tid = cuda.threadIdx.x
    cache[tid] = x
    step = THREADS // 2
    while step > 0:
        cuda.syncthreads()  # Barrier: the last round's values are written.
        if tid < step:
            cache[tid] = max(cache[tid], cache[tid + step])
        step //= 2
    cuda.syncthreads()  # Barrier: cache[0] is the block's max.
    top = cache[0]
    cuda.syncthreads()  # Barrier: every thread has read it before the cache is reused.
    return top


@kernel_part
def finite_abs(x):
    """|x|, or 0 for an inf or a NaN."""
    return abs(x) if math.isfinite(x) else ZERO


def absmax_source():
    def absmax(q, k, v, dout, partial):
        """partial[r, i]: the max |x| over elements i THREADS + tid + j blocks THREADS of
        tensor r (flat views), finite values only."""
        cache = cuda.shared.array(THREADS, float32)
        r, tid = cuda.blockIdx.y, cuda.threadIdx.x
        x = q if r == 0 else k if r == 1 else v if r == 2 else dout
        top = ZERO
        for i in range(cuda.blockIdx.x * THREADS + tid, x.size, cuda.gridDim.x * THREADS):
            top = max(top, finite_abs(x[i]))
        top = block_max(top, cache)
        if tid == 0:
            partial[r, cuda.blockIdx.x] = top

    return absmax


@kernel_part
def power_factors(top):
    """(c, 1 / c) for a tensor whose largest finite |x| is top: c = 2^(13 - floor(log2 top)),
    built from exponent bits (exact; at most 2^126, whose inverse is a normal float)."""
    biased = (float_to_bits(top) >> 23) & 0xFF  # floor(log2 top) + 127; 0 for 0
    c_exp = min(267 - biased, 253)  # 13 - (biased - 127) + 127, at most 2^126
    return bits_to_float(c_exp << 23), bits_to_float((254 - c_exp) << 23)


def split_source():
    def split(x, halves, partial, factors, flags, slot):
        """hi and lo of rows tile FLAG_ROWS .. + FLAG_ROWS of head (b, h) of x (B, H, N, W)
        float32 to halves (2B, H, N, W) float16; flags[b, h, tile] = 1 where they hold a NaN
        or an inf. The tensor's scale from partial[slot]."""
        cache = cuda.shared.array(THREADS, float32)
        tid, tile, head = cuda.threadIdx.x, cuda.blockIdx.x, cuda.blockIdx.y
        batch, heads, rows, width = x.shape
        top = ZERO
        for i in range(tid, partial.shape[1], THREADS):
            top = max(top, partial[slot, i])
        c, inv_c = power_factors(block_max(top, cache))
        if tile == 0 and head == 0 and tid == 0:
            factors[slot], factors[4 + slot] = c, inv_c
        b, h = head // heads, head % heads
        first = int64(tile) * FLAG_ROWS
        n = min(FLAG_ROWS, rows - first) * width
        bad = 0  # an int: syncthreads_or takes one
        for i in range(tid, n, THREADS):
            row, col = first + i // width, i % width
            value = x[b, h, row, col]
            if not math.isfinite(value):
                bad = 1
            scaled = value * c
            halves[b, h, row, col] = scaled  # rounded to float16
            lo = scaled - float32(halves[b, h, row, col])
            halves[batch + b, h, row, col] = lo if math.isfinite(scaled) else ZERO
        bad = cuda.syncthreads_or(bad)
        if tid == 0:
            flags[b, h, tile] = bad

    return split


@lru_cache(maxsize=2)
def halves_kernel(spec):
    """The compiled pre-pass kernel of a HalvesSpec (through the on-disk compile cache)."""
    source = absmax_source if spec.part == "absmax" else split_source
    return jit(source(), ("halves", spec.part), FASTMATH)


@kernel_part
def pack_halves(x0, x1):
    """(hi, lo): float32 values x0, x1 (already scaled) as two float16 pairs, hi + lo."""
    hi = warp.pack_f16(x0, x1)
    h0, h1 = warp.unpack_f16(hi)
    return hi, warp.pack_f16(x0 - h0, x1 - h1)


def make_copy_tile_halves(ROWS, WIDTH, ROW_WORDS, LO_WORDS, HI_AGAIN=None):
    """flash_mma's copy_tile for a halves array (hi at flat element base, lo x.size / 2
    further): the hi tile to word `at`, the lo tile LO_WORDS after it, and (HI_AGAIN not
    None) the hi tile again HI_AGAIN words after `at`."""
    copy = make_copy_tile(ROWS, WIDTH, ROW_WORDS)
    AGAIN, AGAIN_AT = HI_AGAIN is not None, HI_AGAIN or 0

    @kernel_part
    def copy_tile(words, at, x, base, start, n, width):
        copy(words, at, x, base, start, n, width)
        copy(words, at + LO_WORDS, x, base + (x.size >> 1), start, n, width)
        if AGAIN:
            copy(words, at + AGAIN_AT, x, base, start, n, width)

    return copy_tile


mma_pair = make_mma_pair(warp.mma_f16)


@kernel_part
def mma_halves(c, nb, a, a_lo, b, b_lo):
    """c's n-blocks nb and nb + 1 += A B for A = a + a_lo, B = b + b_lo (4-tuples of
    fragment registers, flash_mma's mma_pair's): lo hi, hi lo, then hi hi (lo lo dropped)."""
    mma_pair(c, nb, a_lo[0], a_lo[1], a_lo[2], a_lo[3], b[0], b[1], b[2], b[3])
    mma_pair(c, nb, a[0], a[1], a[2], a[3], b_lo[0], b_lo[1], b_lo[2], b_lo[3])
    mma_pair(c, nb, a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])


@kernel_part
def mma_halves_t(c, nb, a, a_lo, b, b_lo):
    """mma_halves with the middle products swapped (hi lo, lo hi, hi hi): for C^T = B A^T,
    whose elements then get the same products in the same order as mma_halves gives C (each
    product of two float16 values is exact, so an element depends on the pairs alone)."""
    mma_pair(c, nb, a[0], a[1], a[2], a[3], b_lo[0], b_lo[1], b_lo[2], b_lo[3])
    mma_pair(c, nb, a_lo[0], a_lo[1], a_lo[2], a_lo[3], b[0], b[1], b[2], b[3])
    mma_pair(c, nb, a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3])


def make_scores_halves(D, ROW, A_LO_AT, B_LO, KEYS=BLOCK_N, SUMMED=False, A_HI_AT=None):
    """flash_mma's scores (S = A B^T, A's hi fragments in registers) with halves: A's lo
    fragments from the tile at word A_LO_AT (rows of ROW words, the warp's 16 rows at 16 w),
    B's lo tile B_LO words after its hi one. SUMMED: each 16-column step's products reach S
    by float32 adds (mma_halves_summed: precision "highest"). A_HI_AT not None: A's hi
    fragments from the tile at that word too, a_frag unread (the registers the step sums
    take at head dim 128)."""
    HI_SHARED, HI_AT = A_HI_AT is not None, A_HI_AT or 0

    @kernel_part
    def scores(words, at, a_frag, s, lane):
        m, r, w = lane // 8, lane % 8, cuda.threadIdx.x // 32
        for nb in range(KEYS // 8):
            for e in range(4):
                s[nb, e] = ZERO
        for kk in range(D // 16):
            a_word = (w * 16 + r + 8 * (m % 2)) * ROW + kk * 8 + 4 * (m // 2)
            a_lo = warp.ldmatrix_x4(words, A_LO_AT + a_word)
            if HI_SHARED:
                a = warp.ldmatrix_x4(words, HI_AT + a_word)
            else:
                a = (a_frag[kk, 0], a_frag[kk, 1], a_frag[kk, 2], a_frag[kk, 3])
            for n2 in range(KEYS // 16):
                b_at = at + (n2 * 16 + r + 8 * (m // 2)) * ROW + kk * 8 + 4 * (m % 2)
                b, b_lo = warp.ldmatrix_x4(words, b_at), warp.ldmatrix_x4(words, b_at + B_LO)
                if SUMMED:
                    mma_halves_summed(s, 2 * n2, a, a_lo, b, b_lo, ONE, ONE)
                else:
                    mma_halves(s, 2 * n2, a, a_lo, b, b_lo)

    return scores


def make_scores_t_halves(KDIM, A_ROW, B_ROW, COLS, A_LO, B_LO, SUMMED=False):
    """flash_mma_bwd's scores_t (c = A B^T, both from shared memory) with halves: each lo
    tile A_LO (B_LO) words after its hi one. Made for S^T = K Q^T (dkdv): each element is
    the product scores_halves (with the same SUMMED) makes of it in S = Q K^T (the
    forward's and dq's), bit for bit (mma_halves_t, mma_halves_t_summed), so that
    P = exp2(S - lse) is the forward's P."""
    product = mma_halves_t_summed if SUMMED else mma_halves_t

    @kernel_part
    def scores_t(words, a_at, b_at, c, lane, w):
        m, r = lane // 8, lane % 8
        for nb in range(COLS // 8):
            for e in range(4):
                c[nb, e] = ZERO
        for kk in range(KDIM // 16):
            a_word = a_at + (w * 16 + r + 8 * (m % 2)) * A_ROW + kk * 8 + 4 * (m // 2)
            a, a_lo = warp.ldmatrix_x4(words, a_word), warp.ldmatrix_x4(words, a_word + A_LO)
            for n2 in range(COLS // 16):
                b_word = b_at + (n2 * 16 + r + 8 * (m // 2)) * B_ROW + kk * 8 + 4 * (m % 2)
                product(c, 2 * n2, a, a_lo, warp.ldmatrix_x4(words, b_word),
                        warp.ldmatrix_x4(words, b_word + B_LO))

    return scores_t


@kernel_part
def summed_step(c, nb, a1, b1, a2, b2, a3, b3, inv0, inv1):
    """c's n-blocks nb and nb + 1 += (a1 b1 + a2 b2 + a3 b3) times inv0 in rows g, inv1 in
    rows g + 8 (fragments as mma_halves takes them; inv powers of two, row_scales's, or 1):
    each n-block's three products summed from 0, then scaled (exact) and added to c by
    float32 adds, rounding to nearest (mma.sync would cut each product to c's ulp: the
    module's docstring)."""
    for j in range(2):
        t0, t1, t2, t3 = warp.mma_f16(a1[0], a1[1], a1[2], a1[3], b1[2 * j], b1[2 * j + 1],
                                      ZERO, ZERO, ZERO, ZERO)
        t0, t1, t2, t3 = warp.mma_f16(a2[0], a2[1], a2[2], a2[3], b2[2 * j], b2[2 * j + 1],
                                      t0, t1, t2, t3)
        t0, t1, t2, t3 = warp.mma_f16(a3[0], a3[1], a3[2], a3[3], b3[2 * j], b3[2 * j + 1],
                                      t0, t1, t2, t3)
        c[nb + j, 0] += t0 * inv0
        c[nb + j, 1] += t1 * inv0
        c[nb + j, 2] += t2 * inv1
        c[nb + j, 3] += t3 * inv1


@kernel_part
def mma_halves_summed(c, nb, a, a_lo, b, b_lo, inv0, inv1):
    """mma_halves's products (lo hi, hi lo, hi hi), summed_step's way."""
    summed_step(c, nb, a_lo, b, a, b_lo, a, b, inv0, inv1)


@kernel_part
def mma_halves_t_summed(c, nb, a, a_lo, b, b_lo):
    """mma_halves_t's products (hi lo, lo hi, hi hi), summed_step's way: C^T's elements are
    mma_halves_summed's of C, bit for bit."""
    summed_step(c, nb, a, b_lo, a_lo, b, a, b, ONE, ONE)


def make_row_scales(NB):
    @kernel_part
    def row_scales(s, inv):
        """Each of the lane's two rows of s (NB n-blocks of an accumulator fragment) times a
        power of two c that takes its largest finite |x| (over the row's 4 lanes) into
        [2^13, 2^14) (power_factors), inv[half] = 1 / c: the row's halves then keep 22 bits
        of its largest values, whatever the row's size."""
        for half in range(2):
            top = ZERO
            for nb in range(NB):
                top = max(top, max(finite_abs(s[nb, 2 * half]),
                                   finite_abs(s[nb, 2 * half + 1])))
            c, inv[half] = power_factors(row_max(top))
            for nb in range(NB):
                s[nb, 2 * half] *= c
                s[nb, 2 * half + 1] *= c

    return row_scales


def make_pv_halves(DV, V_ROW, B_LO, KEYS=BLOCK_N, SUMMED=False, ROW_SCALED=False):
    """flash_mma's pv (acc += X V, X's accumulator fragments packed in registers, V by
    ldmatrix.trans) with halves: X packed as hi and lo (pack_halves), V's lo tile B_LO words
    after its hi one. SUMMED: each 16-row step's products reach acc by float32 adds
    (mma_halves_summed: dV always, every product at precision "highest"; the module's
    docstring). ROW_SCALED (with SUMMED): X's rows scaled by row_scales first (in place),
    each step's sums scaled back before they are added: for dS, whose size the constant
    scales do not know."""
    assert SUMMED or not ROW_SCALED
    row_scales = make_row_scales(KEYS // 8)

    @kernel_part
    def pv(words, at, s, acc, lane):
        m, r = lane // 8, lane % 8
        inv = cuda.local.array(2, float32)
        inv[0], inv[1] = ONE, ONE
        if ROW_SCALED:
            row_scales(s, inv)
        for n2 in range(KEYS // 16):
            a0, l0 = pack_halves(s[2 * n2, 0], s[2 * n2, 1])
            a1, l1 = pack_halves(s[2 * n2, 2], s[2 * n2, 3])
            a2, l2 = pack_halves(s[2 * n2 + 1, 0], s[2 * n2 + 1, 1])
            a3, l3 = pack_halves(s[2 * n2 + 1, 2], s[2 * n2 + 1, 3])
            for v2 in range(DV // 16):
                v_word = at + (n2 * 16 + r + 8 * (m % 2)) * V_ROW + v2 * 8 + 4 * (m // 2)
                b, b_lo = (warp.ldmatrix_x4_trans(words, v_word),
                           warp.ldmatrix_x4_trans(words, v_word + B_LO))
                if SUMMED:
                    mma_halves_summed(acc, 2 * v2, (a0, a1, a2, a3), (l0, l1, l2, l3), b,
                                      b_lo, inv[0], inv[1])
                else:
                    mma_halves(acc, 2 * v2, (a0, a1, a2, a3), (l0, l1, l2, l3), b, b_lo)

    return pv


@kernel_part
def value_pair(words, at, lo):
    """The two float32 values hi + lo of word `at` (hi) and `at + lo` (lo): lo is 0 where hi is
    not finite (the split's), so an inf stays an inf."""
    h0, h1 = warp.unpack_f16(words[at])
    l0, l1 = warp.unpack_f16(words[at + lo])
    return h0 + l0, h1 + l1


def make_pv_seen_pairs_halves(DV, V_ROW, B_LO, KEYS=BLOCK_N):
    """flash_mma's pv_seen_pairs with V as hi + lo (value_pair; V's lo tile B_LO words after
    its hi one)."""
    @kernel_part
    def load_pair(words, at):
        return value_pair(words, at, B_LO)

    return make_pv_seen_pairs(DV, V_ROW, load_pair, KEYS)


def make_scores_exact(KDIM, A_ROW, B_ROW, COLS, A_LO, B_LO):
    """scores_t_halves's c = A B^T (both from shared memory, the lane's accumulator elements),
    each element a float32 dot product of the values hi + lo: float32's semantics for an inf
    (the module's docstring). For tile pairs holding a NaN or an inf: rare, and slow (KDIM
    multiply-adds an element)."""
    @kernel_part
    def scores_exact(words, a_at, b_at, c, lane, w):
        g, t = lane // 4, lane % 4
        for nb in range(COLS // 8):
            for e in range(4):
                c[nb, e] = ZERO
        for i in range(KDIM // 2):  # a loop: one word (two values) of each row a step
            for nb in range(COLS // 8):
                for e in range(4):
                    a0, a1 = value_pair(
                        words, a_at + (w * 16 + g + 8 * (e // 2)) * A_ROW + i, A_LO)
                    b0, b1 = value_pair(words, b_at + (nb * 8 + 2 * t + e % 2) * B_ROW + i,
                                        B_LO)
                    c[nb, e] += a0 * b0 + a1 * b1

    return scores_exact


@kernel_part
def score_factor(factors, qk_scale):
    """qk_scale for S' = (Q c_q) (K c_k)^T: qk_scale / (c_q c_k), the same float32 operations
    in the forward and in both backward kernels (their scores agree bit for bit)."""
    return qk_scale * factors[4] * factors[5]


def forward_parts(spec):
    """(copy_kv, copy_q, scores, pv, pv_seen_pairs): flash_mma's parts for a float32 variant
    (MmaSpec.layout): the K, V and Q tiles with their lo halves, S = Q K^T by
    scores_halves (scores_exact where the careful variant's tile pair holds a NaN or an
    inf), P V by pv_halves. Q's hi tile is copied again (spec.q_hi_shared) for scores_exact,
    and for the summed variants, whose scores read it there."""
    lay = spec.layout
    D, DV, K_ROW, V_ROW, STAGE = spec.d, spec.dv, lay["k_row"], lay["v_row"], lay["stage"]
    Q_LO_AT, Q_HI_AT = lay["q_lo_at"], lay["q_hi_at"]
    copy_kv = make_copy_kv(make_copy_tile_halves(BLOCK_N, D, K_ROW, lay["k_lo"]),
                           make_copy_tile_halves(BLOCK_N, DV, V_ROW, lay["v_lo"]),
                           lay["k_tile"])
    copy_q = make_copy_tile_halves(BLOCK_M, D, K_ROW, Q_LO_AT - STAGE,  # Q lands in stage 1
                                   Q_HI_AT - STAGE if spec.q_hi_shared else None)
    exact = make_scores_exact(D, K_ROW, K_ROW, BLOCK_N, Q_LO_AT - Q_HI_AT, lay["k_lo"])
    scores = make_q_scores(
        make_scores_halves(D, K_ROW, Q_LO_AT, lay["k_lo"], SUMMED=spec.summed,
                           A_HI_AT=Q_HI_AT if spec.summed else None),
        exact if spec.careful else None, Q_HI_AT)
    return (copy_kv, copy_q, scores,
            make_pv_halves(DV, V_ROW, lay["v_lo"], SUMMED=spec.summed),
            make_pv_seen_pairs_halves(DV, V_ROW, lay["v_lo"]))


def make_factors(HALVES, DS):
    @kernel_part
    def call_factors(factors, qk_scale, scale):
        """(qk_scale for S', delta's factor, dK's, dV's, dQ's): the factors that take the
        scaled products back to the contract's units (the module's docstring); without
        halves (16-bit inputs): (qk_scale, 1, scale, 1, scale)."""
        one = float32(1.0)
        if not HALVES:
            return qk_scale, one, scale, one, scale
        inv_q, inv_k, inv_v, inv_do = factors[4], factors[5], factors[6], factors[7]
        inv_ds = float32(1.0 / DS)  # a power of two: exact
        inv_delta = inv_v * inv_do  # dP' and delta' carry c_v c_do
        return (score_factor(factors, qk_scale), factors[2] * factors[3],
                scale * inv_delta * inv_ds * inv_q, inv_do * float32(1.0 / P_FACTOR),
                scale * inv_delta * inv_ds * inv_k)

    return call_factors
