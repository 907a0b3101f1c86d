"""The FlashAttention-2 forward on tensor cores: the algorithm of reference/tiled.py with the
products S = Q K^T and P V done by mma.sync (warp.py), float32 accumulation, for float16 and
bfloat16 inputs, and float32 as two float16 halves a value (halves.py). 4 warps of 16 query
rows a block, key tiles of 32 double-buffered by cp.async, the online softmax on the
fragments. Each call launches two variants: the fast one, and the careful one that does again
the blocks where a row ended non-finite (a NaN or an inf in V, on the slow path). Split-KV as
the SIMT kernel. docs/design/tensor_cores.md draws the grid, the fragments and the stages.
"""
import math
from dataclasses import astuple, dataclass
from functools import lru_cache

from numba import cuda

from . import halves, warp
from .block_sparse import make_tile_walk
from .common import (ARGS, FASTMATH, F_LN2, NEG_INF, NO_PART, ZERO, bias_given, check_parameters,
                     kernel_part, make_masked_score)
from .compile_cache import jit
from .convert import CONVERTERS, float32, int64, uint32
from .mma_parts import (BLOCK_M, BLOCK_N, EXPONENT_BITS, FACTORS, FLAG_ROWS,
                        MMA_INPUT_DTYPES, MMA_WIDTHS, PAD, THREADS, WARPS, TensorCoreVariant,
                        halves_ship, make_copy_kv, make_copy_tile, make_load_q_fragments,
                        make_next_tile, make_pv, make_pv_seen_pairs, make_q_scores,
                        make_scale_and_mask, make_scores, make_unpacked, own_flagged, row_max,
                        tiles_flagged, word_nonfinite)
from .schedule import grid_order_grouped, key_range_device, key_tiles

DEFERRED = ("deferred", "flags", "(splits * B, Hq, query tiles) uint8: 1 where a block of the "
            "fast variant ended with a row that is not finite (or, float32, its Q or K tiles hold "
            "a NaN or an inf), which the careful one does again")


FLAGGED = tuple((f"{n}_flags", "flags", f"(B, H, rows / 32) uint8: 1 where 32 rows of {n} hold "
                 "a NaN or an inf (halves.py's split); not read for 16-bit inputs")
                for n in ("q", "k")) + (FACTORS, DEFERRED)


MMA_ARGS = tuple(x for a in ARGS if a[0] != "n_tiles"
                 for x in (FLAGGED + (a,) if a[0] == "out" else (a,)))  # before out


MMA_ARG_NAMES = tuple(name for name, _, _ in MMA_ARGS)
ONE = float32(1.0)
FULL_TILES_BLOCKS_PER_SM = 3  # launch_bounds': 65536 registers / (3 * 128) -> 168 a thread


@dataclass(frozen=True)
class MmaSpec(TensorCoreVariant):
    """One compiled variant: padded head dims, input dtype, whether it reads a mask/bias."""

    d: int
    dv: int
    dtype: str  # float32 is multiplied as float16 halves (halves.py)
    has_mask: bool
    partial: bool = False  # split-KV: float32 partial results for split_kv's merge
    careful: bool = False  # the variant for the blocks the fast one deferred (V not finite)
    summed: bool = False  # float32: each step's products summed apart (precision "highest")
    full_tiles: bool = False  # every listed tile FULL, no bias (a block mask alone): reads none


    def check(self):
        if self.d not in MMA_WIDTHS or self.dv not in MMA_WIDTHS:
            raise ValueError(f"MmaSpec: d and dv must be in {MMA_WIDTHS}, got {self}")
        if self.dtype not in MMA_INPUT_DTYPES:
            raise ValueError(f"MmaSpec: dtype must be one of {MMA_INPUT_DTYPES}, got "
                             f"{self.dtype!r}")
        if self.summed and not self.halves:
            raise ValueError(f"MmaSpec: summed is for float32 (halves) only, got {self}")
        if self.full_tiles and (not self.has_mask or self.halves or self.careful):
            raise ValueError("MmaSpec: full_tiles is for the fast 16-bit variants with a mask "
                             f"only, got {self}")
        return self

    @property
    def q_hi_shared(self):
        """Whether Q's hi tile stays in shared memory (at layout's q_hi_at): for the careful
        variant's scores_exact, and for the summed scores, which read it there."""
        return self.careful or self.summed

    @property
    def launch_bounds(self):
        """(threads a block, blocks an SM) that ptxas compiles for, or None (its own choice).
        The full_tiles variants with d = dv = 128 would take 230 registers a thread: 2
        blocks an SM; bounded they fit 168 and 3 blocks (the unmasked variants' occupancy),
        spilling a few bytes (ptx_report.BOUNDED_SPILL). The variants that read a mask or a
        bias would spill more: unbounded."""
        if self.full_tiles and self.d == self.dv == 128:
            return (THREADS, FULL_TILES_BLOCKS_PER_SM)
        return None

    @property
    def ships(self):
        """Whether calls launch it (halves_ship)."""
        return halves_ship(self.dtype, self.has_mask, self.d, self.dv)

    @property
    def layout(self):
        """Where the shared tiles start, in 32-bit words (the module's docstring draws them):
        row words of a Q/K and a V tile, K's lo tile `k_lo` after its hi one, the V tile
        `k_tile` after K (its lo tile `v_lo` after its hi one), `stage`'s words, and for
        halves Q's lo tile (at `q_lo_at`, after the stages) and, where q_hi_shared, Q's
        hi tile again (`q_hi_at`); the total `words`."""
        k_row, v_row = (self.d + PAD) // 2, (self.dv + PAD) // 2
        n = 2 if self.halves else 1
        k_tile = n * BLOCK_N * k_row
        stage = k_tile + n * BLOCK_N * v_row
        q_lo_at = 2 * stage
        q_hi_at = q_lo_at + BLOCK_M * k_row
        words = stage + max(stage, BLOCK_M * k_row)  # Q lands in the second stage
        if self.halves:
            words = q_hi_at + (BLOCK_M * k_row if self.q_hi_shared else 0)
        return dict(k_row=k_row, v_row=v_row, k_lo=BLOCK_N * k_row, k_tile=k_tile,
                    v_lo=BLOCK_N * v_row, stage=stage, q_lo_at=q_lo_at, q_hi_at=q_hi_at,
                    words=words)

    @property
    def dynamic_shared_bytes(self):
        """Bytes of dynamic shared memory a launch passes: the halves' tiles take more than
        the static 48 KB; 0 for the 16-bit variants (a static array)."""
        return 4 * self.layout["words"] if self.halves else 0


def mma_specs():
    """Every variant the PTX report compiles."""
    specs = (MmaSpec(d, dv, dtype, m, p, c, summed, full).check() for d in MMA_WIDTHS
             for dv in MMA_WIDTHS for dtype in MMA_INPUT_DTYPES for m in (False, True)
             for p in (False, True) for c in (False, True)
             for summed in ((False, True) if dtype == "float32" else (False,))
             for full in ((False, True) if m and not c and dtype != "float32" else (False,)))
    return [s for s in specs if s.ships]


def make_load_q(copy_q, copy_kv, load_q_fragments, STAGE):
    @kernel_part
    def load_q(words, q, k, v, q_base, k_base, v_base, start_m, first, last, n_q, d, d_v,
               q_frag, lane, w):
        """The Q tile through the second stage into this warp's A fragments, and the first key
        tile copied into stage 0 (not waited for)."""
        copy_q(words, STAGE, q, q_base, start_m, n_q, d)  # group: Q
        warp.cp_async_commit()
        if first < last:  # group: the first key tile, into stage 0
            copy_kv(words, 0, k, v, k_base, v_base, first, last, d, d_v)
        warp.cp_async_commit()
        warp.cp_async_wait(1)  # this thread's part of Q has landed
        cuda.syncthreads()  # Barrier: all of Q has landed.
        load_q_fragments(words, STAGE, q_frag, lane, w)

    return load_q


def make_this_block(CAREFUL):
    @kernel_part
    def this_block(heads_q, batch, right):
        """(b, h, tile, split, ob): the batch, head, query tile and key split of this thread
        block, and out's batch index (split s of b at s * B + b). The fast variant takes the
        last query tile first (rank 0: under a causal band it walks the most keys), then rank
        by rank across a group of heads (schedule.grouped_order); the careful one, of which
        few blocks do work, the grid's own order."""
        if CAREFUL:
            bh, tile = int64(cuda.blockIdx.y), int64(cuda.blockIdx.x)
        else:
            bh, rank = grid_order_grouped(right >= 0)
            tile = cuda.gridDim.x - 1 - rank
        split = cuda.blockIdx.z  # split-KV: this block's share of the keys (key_tiles)
        b = bh // heads_q
        return b, bh % heads_q, tile, split, split * batch + b

    return this_block


@kernel_part
def head_bases(b, h, hk, heads_q, k, n_q, d, d_v):
    """The flat offsets of query head h's Q and of key head hk's K and V in batch b."""
    heads_k, n_k = k.shape[1], k.shape[2]
    return ((int64(b) * heads_q + h) * n_q * d, (int64(b) * heads_k + hk) * n_k * d,
            (int64(b) * heads_k + hk) * n_k * d_v)


def make_add_pv(pv, pv_seen_pairs):
    @kernel_part
    def add_pv(words, at, s, acc, lane, nonfinite_v):
        """acc += P V for the V tile at word `at`: pv, or pv_seen_pairs where the tile holds
        a NaN or an inf (the careful variant's slow path)."""
        if nonfinite_v:
            pv_seen_pairs(words, at, s, s, acc, lane)
        else:
            pv(words, at, s, acc, lane)

    return add_pv


def make_init_rows(VB):
    @kernel_part
    def init_rows(m_i, l_i, acc, lo, hi, row0, n_q, kv_len, left, right, bottom_right):
        """For the lane's rows row0 and row0 + 8: m_i = -inf, l_i = 0, acc = 0, and the keys
        lo <= j < hi each sees (the contract's key_range)."""
        for half in range(2):
            m_i[half], l_i[half] = NEG_INF, ZERO
            lo[half], hi[half] = key_range_device(row0 + 8 * half, n_q, kv_len, left, right,
                                                  bottom_right)
        for vb in range(VB):
            for e in range(4):
                acc[vb, e] = ZERO

    return init_rows


def make_row_update(NB):
    @kernel_part
    def row_update(s, m_i, l_i, half, mark):
        """Row g + 8 half of the lane: m_new, P = exp2(S - m_new) in place of S, l_i rescaled
        plus this lane's part of the row sum (the 4 parts are added once, at the end);
        returns alpha = exp2(m_old - m_new), the factor for acc. mark: P = NO_PART where
        S = -inf, for pv_seen_pairs; the fast pv adds exp2(-inf) = +0.0 times a finite
        value, which is the same sum."""
        tile_max = NEG_INF
        for nb in range(NB):
            tile_max = max(tile_max, max(s[nb, 2 * half], s[nb, 2 * half + 1]))
        m_new = max(m_i[half], row_max(tile_max))
        m_safe = ZERO if m_new == NEG_INF else m_new  # no key seen: no exp2(-inf + inf)
        alpha = math.exp2(m_i[half] - m_safe)
        row_sum = ZERO
        for nb in range(NB):
            for e in range(2 * half, 2 * half + 2):
                p = math.exp2(s[nb, e] - m_safe)  # 0 where S = -inf
                if mark:
                    p = NO_PART if s[nb, e] == NEG_INF else p
                s[nb, e] = p
                row_sum += s[nb, e]
        l_i[half] = l_i[half] * alpha + row_sum
        m_i[half] = m_new
        return alpha

    return row_update


def make_rescale(VB):
    @kernel_part
    def rescale(acc, alpha0, alpha1):
        """acc's rows g and g + 8 of the lane times their alphas: skipped where both are
        exactly 1 (the row maxima did not move: most key tiles after the first few)."""
        if alpha0 != ONE or alpha1 != ONE:
            for vb in range(VB):
                acc[vb, 0] *= alpha0
                acc[vb, 1] *= alpha0
                acc[vb, 2] *= alpha1
                acc[vb, 3] *= alpha1

    return rescale


def make_online_softmax(NB, VB):
    row_update, rescale = make_row_update(NB), make_rescale(VB)

    @kernel_part
    def online_softmax(s, m_i, l_i, acc, mark):
        """Both rows of the lane (row_update), then acc rescaled by their alphas."""
        alpha0 = row_update(s, m_i, l_i, 0, mark)
        alpha1 = row_update(s, m_i, l_i, 1, mark)
        rescale(acc, alpha0, alpha1)

    return online_softmax


def make_tile_nonfinite(DV, V_ROW, LOW):
    WORDS_USED = DV // 2  # words of a V row the copy writes (the padding after is never read)
    TILE_WORDS = BLOCK_N * WORDS_USED
    THREADS = WARPS * 32

    @kernel_part
    def tile_nonfinite(words, at):
        """Whether the V tile at word `at` holds a NaN or an inf, for the whole block (every
        thread calls it: one barrier). Keys past the block's last and columns past d_v were
        copied as zeros. Each thread tests TILE_WORDS / THREADS words by their bits."""
        bad = 0  # an int: syncthreads_or takes one
        for i in range(cuda.threadIdx.x, TILE_WORDS, THREADS):
            if word_nonfinite(words[at + (i // WORDS_USED) * V_ROW + i % WORDS_USED], LOW):
                bad = 1
        return cuda.syncthreads_or(bad) != 0

    return tile_nonfinite


def make_acc_finite(VB):
    @kernel_part
    def acc_finite(acc):
        """Whether every value of the lane's accumulator is finite."""
        finite = True
        for vb in range(VB):
            for e in range(4):
                if not math.isfinite(acc[vb, e]):
                    finite = False
        return finite

    return acc_finite


@kernel_part
def hand_over(deferred, ob, h, tile, redo, tid):
    """The fast variant's verdict on its block: thread 0 writes deferred[ob, h, tile] = redo
    (1: the careful variant does the block again); returns whether it does."""
    if tid == 0:
        deferred[ob, h, tile] = 1 if redo else 0
    return redo != 0


def make_store_out(DV, store, P_BACK=None):
    HALVES, BACK = P_BACK is not None, P_BACK or ONE

    @kernel_part
    def store_out(out, lse, m_i, l_i, acc, ob, h, row0, n_q, d_v, out_factor, lane):
        """out = acc / l and lse = (m_i + log2 l) * ln 2 at batch index ob, l the sum of the 4
        lanes' parts; a row that saw no key: out = 0, lse = -inf. With halves (P_BACK given)
        acc is in the units of P' = P / P_BACK and V' = V c_v (halves.py): times out_factor
        (1 / c_v), then P_BACK, after the division (each step exact where out is normal)."""
        # Unsigned indices: no wrap-around of negative ones, and the row's offset is
        # computed once (signed, each element's store took 15 instructions of index checks).
        t, u_ob, u_h, u_dv = uint32(lane % 4), uint32(ob), uint32(h), uint32(d_v)
        for half in range(2):
            l_row = l_i[half]
            l_row += warp.shfl_xor(l_row, 1)
            l_row += warp.shfl_xor(l_row, 2)
            empty = l_row == ZERO
            inv_l = ZERO if empty else float32(1.0) / l_row
            row = row0 + 8 * half
            if row < n_q:
                u_row = uint32(row)
                for vb in range(DV // 8):
                    for e in range(2):
                        col = uint32(vb * 8 + e) + 2 * t
                        if col < u_dv:
                            value = acc[vb, 2 * half + e] * inv_l
                            if HALVES:
                                value = value * out_factor * BACK
                            out[u_ob, u_h, u_row, col] = store(value)
                if t == 0:
                    lse[u_ob, u_h, u_row] = (NEG_INF if empty else
                                             (m_i[half] + math.log2(l_row)) * F_LN2)

    return store_out


def _parts16(spec):
    """(copy_kv, copy_q, scores, pv, pv_seen_pairs) of a 16-bit variant."""
    lay = spec.layout
    D, DV, K_ROW, V_ROW = spec.d, spec.dv, lay["k_row"], lay["v_row"]
    mma, pack, unpack = ((warp.mma_f16, warp.pack_f16, warp.unpack_f16) if spec.dtype ==
                         "float16" else (warp.mma_bf16, warp.pack_bf16, warp.unpack_bf16))
    copy_kv = make_copy_kv(make_copy_tile(BLOCK_N, D, K_ROW), make_copy_tile(BLOCK_N, DV, V_ROW),
                           lay["k_tile"])
    return (copy_kv, make_copy_tile(BLOCK_M, D, K_ROW),
            make_q_scores(make_scores(D, K_ROW, mma), None, 0), make_pv(DV, V_ROW, mma, pack),
            make_pv_seen_pairs(DV, V_ROW, make_unpacked(unpack)))


def make_forward_factors(HALVES, P_FACTOR):
    @kernel_part
    def forward_factors(factors, qk_scale):
        """(the scores' factor, out's): qk_scale and 1 for 16-bit inputs; with halves
        qk_scale / (c_q c_k) (halves.score_factor, as the backward computes it) and 1 / c_v."""
        if not HALVES:
            return qk_scale, ONE
        return qk_scale * factors[4] * factors[5], factors[6]

    @kernel_part
    def scale_p(s):
        """P' = P P_FACTOR in place, before halves.pack_halves splits it (halves.py)."""
        if HALVES:
            for nb in range(s.shape[0]):
                for e in range(4):
                    s[nb, e] *= P_FACTOR

    return forward_factors, scale_p


def kernel_source(spec):
    """The kernel for variant `spec` as a Python function (for cuda.jit or compile_ptx)."""
    spec.check()
    D, DV, lay = spec.d, spec.dv, spec.layout
    K_ROW, STAGE, K_TILE = lay["k_row"], lay["stage"], lay["k_tile"]  # V K_TILE words after K
    WORDS = 0 if spec.halves else lay["words"]  # 0: dynamic, as the launch makes it
    NB, VB, KSTEPS = BLOCK_N // 8, DV // 8, D // 16
    CAREFUL, HALVES, HAS_MASK = spec.careful, spec.halves, spec.has_mask
    READS = HAS_MASK and not spec.full_tiles  # the mask and the bias
    EXACT = HALVES and CAREFUL  # scores_exact for tile pairs holding a NaN or an inf
    if HALVES:
        copy_kv, copy_q, scores, pv, pv_seen_pairs = halves.forward_parts(spec)
        P_FACTOR, P_BACK = halves.P_FACTOR, float32(1.0 / halves.P_FACTOR)
    else:
        copy_kv, copy_q, scores, pv, pv_seen_pairs = _parts16(spec)
        P_FACTOR, P_BACK = ONE, None
    load_q = make_load_q(copy_q, copy_kv, make_load_q_fragments(D, K_ROW), STAGE)
    this_block, next_tile = make_this_block(CAREFUL), make_next_tile(copy_kv, STAGE)
    walk = make_tile_walk(spec.has_mask, BLOCK_N)
    walk_steps, step_tile, reads_mask, WALK_STEP = (walk.walk_steps, walk.step_tile,
                                                     walk.reads_mask, walk.STEP)
    init_rows = make_init_rows(VB)
    scale_and_mask = make_scale_and_mask(make_masked_score({"HAS_MASK": spec.has_mask}),
                                         spec.has_mask)
    online_softmax = make_online_softmax(NB, VB)
    forward_factors, scale_p = make_forward_factors(HALVES, P_FACTOR)
    tile_nonfinite = make_tile_nonfinite(DV, lay["v_row"],
                                         EXPONENT_BITS["float16" if HALVES else spec.dtype])
    acc_finite, add_pv = make_acc_finite(VB), make_add_pv(pv, pv_seen_pairs)
    store_out = make_store_out(DV, CONVERTERS["float32" if spec.partial else spec.dtype][1],
                               P_BACK)

    def flash_mma(q, k, v, mask, visible, bias, kv_lengths, q_flags, k_flags, factors,
                  deferred, out, lse, n_q, d, d_v, group, heads_q, n_splits, split_keys,
                  qk_scale, left, right, bottom_right, mask_steps, bias_steps):
        words = cuda.shared.array(WORDS, uint32)  # two stages; Q lands in the second first
        q_frag = cuda.local.array((KSTEPS, 4), uint32)  # this warp's rows of Q, A fragments
        s = cuda.local.array((NB, 4), float32)  # S, then P, of the lane's fragment
        acc = cuda.local.array((VB, 4), float32)  # running sum of exp2(s - m_i) * v
        m_i = cuda.local.array(2, float32)  # running max, rows g and g + 8
        l_i = cuda.local.array(2, float32)  # this lane's part of sum exp2(s - m_i)
        lo = cuda.local.array(2, int64)  # each row's visible keys lo <= j < hi
        hi = cuda.local.array(2, int64)

        tid = cuda.threadIdx.x
        w, lane = tid // 32, tid % 32
        b, h, tile, split, ob = this_block(heads_q, kv_lengths.shape[0], right)
        if CAREFUL and deferred[ob, h, tile] == 0:
            return  # first thing: the fast variant did this block (most often every one)
        hk = h // group  # grouped-query attention: query head h reads key head h // group
        q_base, k_base, v_base = head_bases(b, h, hk, heads_q, k, n_q, d, d_v)
        start_m = tile * BLOCK_M
        whole_rows = start_m + BLOCK_M <= n_q  # every row of the tile exists
        row0 = start_m + w * 16 + lane // 4  # the lane's rows: row0 and row0 + 8
        kv_len = int64(kv_lengths[b])
        first, last, lo_last, hi_first = key_tiles(
            start_m, min(start_m + BLOCK_M, n_q) - 1, n_q, kv_len, left, right, bottom_right,
            split, n_splits, split_keys, BLOCK_N)
        cb, ch = b * mask_steps[0], h * mask_steps[1]  # this block's visible list
        biased = READS and bias_given(bias, bias_steps)
        t0, t_end = walk_steps(visible, cb, ch, tile, first, last)  # tiles no row sees: none
        start_n = step_tile(visible, cb, ch, tile, t0)  # past last where there is no step
        q_bad = HALVES and own_flagged(q_flags, b, h, start_m)  # scores_exact's
        if HALVES and not CAREFUL and tiles_flagged(k_flags, k_flags, b, hk, 1, start_n,
                                                    last - 1, tid, q_bad):
            if tid == 0:  # a Q or K tile holds a NaN or an inf: the careful variant's block
                deferred[ob, h, tile] = 1
            return
        qk, out_factor = forward_factors(factors, qk_scale)
        init_rows(m_i, l_i, acc, lo, hi, row0, n_q, kv_len, left, right, bottom_right)
        load_q(words, q, k, v, q_base, k_base, v_base, start_m, start_n, last, n_q, d, d_v,
               q_frag, lane, w)
        stage = 0
        for t in range(t0, t_end, WALK_STEP):
            if start_n >= last:
                break  # the band ends before the list
            following = step_tile(visible, cb, ch, tile, t + WALK_STEP)  # or the sentinel
            next_tile(words, k, v, k_base, v_base, following, last, d, d_v, stage)
            at = stage * STAGE
            scores(words, at, q_frag, s, lane, w,  # S = Q K^T
                   EXACT and (q_bad or k_flags[b, hk, start_n // FLAG_ROWS] != 0))
            interior = start_n >= lo_last and start_n + BLOCK_N <= hi_first  # all rows see it
            scale_and_mask(s, qk, mask, bias, mask_steps, bias_steps, b, h, row0,
                           start_n, lo, hi, interior, whole_rows, n_q,
                           READS and reads_mask(visible, cb, ch, tile, t), biased, lane)
            # the same answer for the whole block (tile_nonfinite's barrier)
            nonfinite_v = CAREFUL and tile_nonfinite(words, at + K_TILE)
            online_softmax(s, m_i, l_i, acc, nonfinite_v)
            scale_p(s)
            add_pv(words, at + K_TILE, s, acc, lane, nonfinite_v)
            stage = 1 - stage
            start_n = following
        # a row that ended non-finite: the careful variant does the block (syncthreads_or
        # takes an int)
        if not CAREFUL and hand_over(deferred, ob, h, tile,
                                     cuda.syncthreads_or(0 if acc_finite(acc) else 1), tid):
            return
        store_out(out, lse, m_i, l_i, acc, ob, h, row0, n_q, d_v, out_factor, lane)

    return check_parameters(flash_mma, MMA_ARG_NAMES)


@lru_cache(maxsize=32)
def mma_kernel(spec):
    """The compiled kernel of a variant (through the on-disk compile cache)."""
    return jit(kernel_source(spec), ("mma",) + astuple(spec), FASTMATH, spec.launch_bounds)
