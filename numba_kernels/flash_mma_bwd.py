"""The FlashAttention-2 backward on tensor cores: the algorithm of flash_bwd.py
(reference/tiled_backward.py) with every product done by mma.sync (warp.py), float32
accumulation, P and dS rounded to the input dtype where they enter a product; float32 inputs
as two float16 halves a value (halves.py). Two kernels after plain_bwd's delta kernel: dkdv
(4 warps own 64 keys: S^T, dP^T, dV += P^T dO, dK += dS^T Q; two kernels, "dk" and "dv",
for float32 above head dims of 64, with a mask, or summed: kv_parts) and dq (the forward's
structure, dQ += dS K). With a mask each walks its visible lists (block_sparse.py): dq its
query tile's key tiles, dkdv its key tile's query tiles, head by head. Tiles holding a NaN
or an inf (flagged by a pre-pass) defer their blocks to a nonfinite variant, which adds only
the pairs that take part. No atomic adds: deterministic.
docs/design/tensor_cores.md draws the steps, the fragments and the shared memory.
"""
import math
from dataclasses import astuple, dataclass
from functools import lru_cache

from numba import cuda

from . import halves, warp
from .compile_cache import jit
from .convert import CONVERTERS, float32, int64, uint32, uint64
from .block_sparse import make_tile_walk
from .common import (DKDV_ARGS, DQ_ARGS, FASTMATH, F_LOG2E, NEG_INF, NO_PART, ZERO,
                     bias_given, check_parameters, kernel_part, make_masked_score,
                     with_visible)
from .schedule import grid_order, key_range_device, key_tiles
from .mma_parts import (BLOCK_N as KEY_TILE, EXPONENT_BITS, FACTORS, FLAG_ROWS, MMA_DTYPES,
                        MMA_INPUT_DTYPES, MMA_WIDTHS, PAD, THREADS, WARPS, TensorCoreVariant,
                        halves_ship, make_copy_kv, make_copy_tile, make_load_q_fragments,
                        make_mma_pair, make_next_tile, make_pv, make_pv_seen_pairs,
                        make_q_scores, make_scale_and_mask, make_scores, make_unpacked,
                        own_flagged, tiles_flagged, word_nonfinite)


DEFERRED = ("deferred", "flags", "(B, H, blocks) uint8: 1 where a block's tiles hold a NaN or "
            "an inf: written by the fast variant, read by the nonfinite one")


def _with_flags(args, before, *names):
    """args with the pre-pass's flags of each of names (nonfinite_tiles's) and DEFERRED
    inserted before the argument `before`."""
    extra = tuple((f"{n}_flags", "flags", f"(B, H, rows / 32) uint8: 1 where 32 rows of {n} "
                   "hold a NaN or an inf") for n in names) + (DEFERRED, FACTORS)
    return tuple(x for a in args for x in (extra + (a,) if a[0] == before else (a,)))


MMA_DKDV_ARGS = _with_flags(with_visible(
    DKDV_ARGS, "int32 (B or 1, Hq or 1, key tiles of BLOCK, 2 + query tiles of qb): each key "
    "tile's count of query tiles the mask does not skip, then those tiles, 2 i + 1 where "
    "partly visible, 2 i where fully, then 2 * query tiles; read with a mask"),
    "dk", "q", "dout", "k")
MMA_DQ_ARGS = _with_flags(with_visible(
    DQ_ARGS, "int32 (B or 1, Hq or 1, query tiles of BLOCK, 2 + key tiles of KEY_TILE): the "
    "forward's lists (ARGS), at this kernel's tiles; read with a mask"), "dq", "k", "q")

BLOCK = 16 * WARPS  # keys of a dkdv block, query rows of a dq block


MMA_BWD_DTYPES = MMA_INPUT_DTYPES  # float32: each operand as two float16 halves
PARTS = ("dkdv", "dk", "dv", "dq")
KV_SPLIT_WIDTH = 64  # float32 above this head dim: dK and dV in two kernels (kv_parts)


def kv_parts(dtype, d, dv, has_mask, summed=False):
    """The kernels that make dK and dV: "dkdv", or for float32 above head dims of
    KV_SPLIT_WIDTH, with a mask or bias, or summed (precision "highest"), "dk" and "dv".
    dV's step sums (halves.mma_halves_summed) take registers that dkdv does not have there
    (ptxas spills 8 bytes at width 128, 56 with a mask at 64, 8 summed at 64); apart, each
    kernel has room, at the cost of computing S^T twice (5 products a step instead of 4)."""
    split = dtype == "float32" and (max(d, dv) > KV_SPLIT_WIDTH or has_mask or summed)
    return ("dk", "dv") if split else ("dkdv",)


@dataclass(frozen=True)
class MmaBwdSpec(TensorCoreVariant):
    """One compiled variant of a tensor-core backward kernel."""

    part: str  # "dkdv" (or "dk" and "dv": kv_parts) or "dq"
    d: int  # head dims, padded to MMA_WIDTHS
    dv: int
    dtype: str  # the inputs' dtype; float32 is multiplied as float16 halves (halves.py)
    has_mask: bool
    nonfinite: bool = False  # the variant for blocks whose tiles hold a NaN or an inf
    summed: bool = False  # float32: each step's products summed apart (precision "highest")
    # 16-bit inputs: the gradients stored as float32, unrounded (backward.backward_float32)
    float32_grads: bool = False
    # every listed tile FULL, no bias (a block mask alone, mma_parts.full_tiles_apply): the
    # lists are walked, no mask or bias is read
    full_tiles: bool = False

    def check(self):
        if self.part not in PARTS or self.d not in MMA_WIDTHS \
                or self.dv not in MMA_WIDTHS or self.dtype not in MMA_BWD_DTYPES \
                or (self.summed and not self.halves) or (self.float32_grads and self.halves) \
                or (self.full_tiles and (not self.has_mask or self.halves or self.nonfinite)):
            raise ValueError(f"MmaBwdSpec: part in {PARTS}, d and dv in {MMA_WIDTHS}, dtype "
                             f"in {MMA_BWD_DTYPES}, summed for float32 only, float32_grads "
                             f"for 16-bit dtypes only, full_tiles for the fast 16-bit "
                             f"variants with a mask only; got {self}")
        return self

    @property
    def grads_dtype(self):
        """The dtype the gradients are stored in."""
        return "float32" if self.float32_grads or self.halves else self.dtype

    @property
    def ships(self):
        """Whether calls launch it (flash_mma.halves_ship: not float32 with a mask or bias
        above width 64, whose registers spill; flash_mma.mma_plan sends those calls to the
        tuned kernels; and the dK, dV kernels of kv_parts)."""
        return halves_ship(self.dtype, self.has_mask, self.d, self.dv) and (
            self.part == "dq" or self.part in kv_parts(self.dtype, self.d, self.dv,
                                                       self.has_mask, self.summed))

    @property
    def dynamic_shared_bytes(self):
        """Bytes of dynamic shared memory a launch passes: the halves' tiles take more than
        the static 48 KB; 0 for the 16-bit variants (a static array)."""
        return 4 * self.layout["words"] if self.halves else 0

    @property
    def qb(self):
        """Query rows a dkdv step."""
        return 32 if max(self.d, self.dv) <= 64 else 16

    @property
    def tiles(self):
        """(rows, keys) of the tiles its visible lists hold: dq's (BLOCK, KEY_TILE), dK and
        dV's (qb, BLOCK)."""
        return (BLOCK, KEY_TILE) if self.part == "dq" else (self.qb, BLOCK)

    @property
    def layout(self):
        """Where the shared tiles start, in 32-bit words (the module's docstring draws them;
        with halves each tile's lo half follows its hi one, `*_lo` words after it, or lives
        at `*_lo_at`): row words of Q/K and V/dO tiles, offsets, and the total `words`."""
        k_row, v_row = (self.d + PAD) // 2, (self.dv + PAD) // 2
        n = 2 if self.halves else 1
        if self.part != "dq":  # dkdv, dk, dv
            qb = self.qb
            v = self.part != "dv"  # the dv kernel reads no V
            v_lo_at = n * BLOCK * k_row  # V's lo half stays (its hi half goes to registers)
            stages_at = v_lo_at + (BLOCK * v_row if self.halves and v else 0)
            stage = n * qb * (k_row + v_row)
            return dict(k_row=k_row, v_row=v_row, k_lo=BLOCK * k_row, v_lo_at=v_lo_at,
                        stages_at=stages_at, q_lo=qb * k_row, do_at=n * qb * k_row,
                        do_lo=qb * v_row, stage=stage,
                        words=stages_at + max(2 * stage, BLOCK * v_row if v else 0))
        stage = n * KEY_TILE * (k_row + v_row)
        q_lo_at = max(2 * stage, BLOCK * (k_row + v_row))  # after the stages Q and dO land in
        q_hi_at = q_lo_at + (BLOCK * (k_row + v_row) if self.halves else 0)
        return dict(k_row=k_row, v_row=v_row, stage=stage, k_lo=KEY_TILE * k_row,
                    v_at=n * KEY_TILE * k_row, v_lo=KEY_TILE * v_row, q_lo_at=q_lo_at,
                    do_at=BLOCK * k_row, do_lo_at=q_lo_at + BLOCK * k_row, q_hi_at=q_hi_at,
                    do_hi_at=q_hi_at + BLOCK * k_row,  # summed: dO's hi tile kept too
                    words=q_hi_at + (BLOCK * k_row if self.q_hi_shared else 0)
                    + (BLOCK * v_row if self.summed else 0))

    @property
    def q_hi_shared(self):
        """Whether dq keeps Q's hi tile in shared memory (at layout's q_hi_at): for the
        nonfinite variant's scores_exact, and for the summed scores, which read it there."""
        return self.halves and (self.nonfinite or self.summed)


def mma_bwd_specs():
    """Every variant a call can launch, the pre-passes too: the PTX gate compiles each."""
    def options(dtype, masked, nonfinite):  # (summed, float32_grads, full_tiles)
        if dtype == "float32":
            return (False, False, False), (True, False, False)
        full = ((False, False, True),) if masked and not nonfinite else ()
        return ((False, False, False), (False, True, False)) + full

    return [s for s in (MmaBwdSpec(part, d, dv, dtype, m, n, *o).check() for part in PARTS
                        for d in MMA_WIDTHS for dv in MMA_WIDTHS for dtype in MMA_BWD_DTYPES
                        for m in (False, True) for n in (False, True)
                        for o in options(dtype, m, n))
            if s.ships] \
        + [ScanSpec(t) for t in MMA_DTYPES] + halves.halves_specs()


SCAN_THREADS = 128
SCAN_UNROLL = 4  # loads a thread has in flight


@dataclass(frozen=True)
class ScanSpec:
    """The pre-pass of one input dtype: which tiles of FLAG_ROWS rows hold a NaN or an inf."""

    dtype: str


def scan_source(spec):
    """nonfinite_tiles(words, flags, rows, row_words): flags[b, h, t] = 1 where rows
    t FLAG_ROWS .. + FLAG_ROWS - 1 of head (b, h) of x hold a NaN or an inf, else 0. words:
    x's memory (C-contiguous, (B, H, rows, width)) as int32 words of two values, row_words =
    width / 2 a row. One block a tile, each thread SCAN_UNROLL coalesced 4-byte loads at a
    time and a bit test (no conversion, no division); x is read once, so the kernels test one
    flag a tile."""
    LOW = EXPONENT_BITS[spec.dtype]

    def nonfinite_tiles(words, flags, rows, row_words):
        t, head = cuda.blockIdx.x, cuda.blockIdx.y  # head: b * H + h
        first_row = int64(t) * FLAG_ROWS
        base = (int64(head) * rows + first_row) * row_words
        n = min(FLAG_ROWS, rows - first_row) * row_words
        bad = 0  # an int: syncthreads_or takes one
        for i in range(cuda.threadIdx.x, n, SCAN_UNROLL * SCAN_THREADS):
            for u in range(SCAN_UNROLL):
                j = i + u * SCAN_THREADS
                if j < n and word_nonfinite(words[base + j], LOW):
                    bad = 1
        bad = cuda.syncthreads_or(bad)
        if cuda.threadIdx.x == 0:
            heads = flags.shape[1]
            flags[head // heads, head % heads, t] = bad

    return nonfinite_tiles


@lru_cache(maxsize=4)
def scan_kernel(spec):
    """The compiled pre-pass of a ScanSpec (through the on-disk compile cache)."""
    return jit(scan_source(spec), ("mma-scan", spec.dtype), FASTMATH)


@kernel_part
def rows_seeing(start_n, last_key, n_q, kv_len, left, right, bottom_right):
    """(begin, end): the query rows begin <= i < end that see a key start_n <= j < last_key.
    key_range's lo and hi are monotone in the row: two binary searches, for the first row
    whose hi passes start_n and the first whose lo reaches last_key."""
    lo_i, hi_i = int64(0), int64(n_q)
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        if key_range_device(mid, n_q, kv_len, left, right, bottom_right)[1] > start_n:
            hi_i = mid
        else:
            lo_i = mid + 1
    begin, hi_i = lo_i, int64(n_q)
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        if key_range_device(mid, n_q, kv_len, left, right, bottom_right)[0] >= last_key:
            hi_i = mid
        else:
            lo_i = mid + 1
    return begin, lo_i


def make_scores_t(KDIM, A_ROW, B_ROW, COLS, mma):
    mma_pair = make_mma_pair(mma)

    @kernel_part
    def scores_t(words, a_at, b_at, c, lane, w):
        """c = A B^T for A's rows 16 w .. + 15 (at word a_at, A fragments by ldmatrix, as
        flash_mma's load_q_fragments) and B's COLS rows (at b_at, B fragments as flash_mma's
        scores), KDIM columns of both: S^T = K Q^T with K read from shared memory."""
        m, r = lane // 8, lane % 8
        for nb in range(COLS // 8):
            for e in range(4):
                c[nb, e] = ZERO
        for kk in range(KDIM // 16):
            a0, a1, a2, a3 = warp.ldmatrix_x4(
                words, a_at + (w * 16 + r + 8 * (m % 2)) * A_ROW + kk * 8 + 4 * (m // 2))
            for n2 in range(COLS // 16):
                b0, b1, b2, b3 = warp.ldmatrix_x4(
                    words, b_at + (n2 * 16 + r + 8 * (m // 2)) * B_ROW + kk * 8 + 4 * (m % 2))
                mma_pair(c, 2 * n2, a0, a1, a2, a3, b0, b1, b2, b3)

    return scores_t


@kernel_part
def row_stats(lse_in, delta, b, h, row, n_q, ok, delta_factor):
    """(lse in log2 units, delta * delta_factor) of query row `row` where ok and row < n_q,
    else zeros: what a thread copies of a query tile's statistics."""
    if ok and row < n_q:
        return lse_in[b, h, row] * F_LOG2E, delta[b, h, row] * delta_factor
    return ZERO, ZERO


@kernel_part
def init_dq_rows(lse_r, delta_r, lo, hi, lse_in, delta, b, h, row0, n_q, kv_len, left, right,
                 bottom_right, delta_factor):
    """For the lane's rows row0 and row0 + 8: lse (log2 units) and delta * delta_factor
    (row_stats' values, as selects: zeros past n_q), and the keys lo <= j < hi each sees."""
    for half in range(2):
        row = row0 + 8 * half
        ok = row < n_q
        lse_r[half] = lse_in[b, h, row] * F_LOG2E if ok else ZERO
        delta_r[half] = delta[b, h, row] * delta_factor if ok else ZERO
        lo[half], hi[half] = key_range_device(row, n_q, kv_len, left, right, bottom_right)


def make_add_dq(dq_product, dq_seen_pairs, NONFINITE):
    @kernel_part
    def add_dq(words, at, s, dp, dq_acc, lane, k_bad):
        """dQ += dS K for the K tile at word `at`; in the nonfinite variant, where that tile
        holds a NaN or an inf (k_bad), only the pairs taking part."""
        if not NONFINITE or not k_bad:
            dq_product(words, at, dp, dq_acc, lane)
        else:
            dq_seen_pairs(words, at, s, dp, dq_acc, lane)

    return add_dq


def make_query_tiles(QB):
    @kernel_part
    def query_tiles(start_n, n_q, kv_len, left, right, bottom_right):
        """(first_q, tiles): the query tiles of QB rows from row first_q that hold every row
        seeing a key of the block start_n .. + BLOCK (rows_seeing); none where the block
        starts past kv_len."""
        begin, end = rows_seeing(start_n, min(start_n + BLOCK, kv_len), n_q, kv_len, left,
                                 right, bottom_right)
        first_q = begin // QB * QB
        if end > begin and start_n < kv_len:
            return first_q, (end - first_q + QB - 1) // QB
        return first_q, int64(0)

    return query_tiles


def make_kv_probabilities(NB, masked_score, HAS_MASK, P_FACTOR, DS_FACTOR):
    @kernel_part
    def probabilities(s, dp, stats, stage, qk_scale, mask, bias, mask_steps, bias_steps, b,
                      h, key0, start_q, n_q, kv_len, left, right, bottom_right, interior,
                      read_mask, read_bias, lane):
        """P^T = exp2(S^T qk_scale - lse) in place of S^T, dS^T = P^T (dP^T - delta) in place
        of dP^T; element 2 half + c of n-block nb is key key0 + 8 half, query column
        start_q + 8 nb + 2 t + c, whose lse and delta are at stats[stage, :, 8 nb + 2 t + c].
        Where the row does not see the key: P = NO_PART, dS = 0 (selected). An interior tile
        where neither mask nor bias is read (read_mask, read_bias as masked_score takes
        them) is scaled only; elsewhere each column's key range is computed here
        (masked_score's test). P and dS leave times P_FACTOR and DS_FACTOR (1 for 16-bit
        inputs; halves.py's scales for float32)."""
        tested = (HAS_MASK and (read_mask or read_bias)) or not interior
        t = lane % 4
        for nb in range(NB):
            for c in range(2):
                col = start_q + 8 * nb + 2 * t + c
                at = uint64(8 * nb + 2 * t + c)  # unsigned: no wraparound code
                lse_col, delta_col = stats[uint64(stage), 0, at], stats[uint64(stage), 1, at]
                lo, hi = int64(0), int64(0)
                if tested:
                    lo, hi = key_range_device(col, n_q, kv_len, left, right, bottom_right)
                for half in range(2):
                    e = 2 * half + c
                    x = s[nb, e] * qk_scale
                    if tested:
                        x = masked_score(x, mask, bias, mask_steps, bias_steps, b, h, col,
                                         key0 + 8 * half, lo, hi, False, n_q, read_mask,
                                         read_bias)
                    p = NO_PART if x == NEG_INF else math.exp2(x - lse_col)
                    dp[nb, e] = ZERO if x == NEG_INF else \
                        p * (dp[nb, e] - delta_col) * DS_FACTOR
                    s[nb, e] = p * P_FACTOR

    return probabilities


def make_load_kv_block(copy_k, copy_v, load_v_fragments, STAGES_AT, WITH_V):
    @kernel_part
    def load_kv_block(words, k, v, v_frag, b, heads_k, hk, n_k, start_n, kv_len, d, d_v, lane,
                      w):
        """The block's keys: K to shared memory at word 0 (zeros past kv_len), V (WITH_V: the
        kernels that make dK) through the stages into this warp's A fragments. Two
        barriers."""
        kv_at = (int64(b) * heads_k + hk) * n_k
        copy_k(words, 0, k, kv_at * d, start_n, kv_len, d)
        if WITH_V:
            copy_v(words, STAGES_AT, v, kv_at * d_v, start_n, kv_len, d_v)
        warp.cp_async_commit()
        warp.cp_async_wait(0)
        cuda.syncthreads()  # Barrier: K and V have landed.
        if WITH_V:
            load_v_fragments(words, STAGES_AT, v_frag, lane, w)
        cuda.syncthreads()  # Barrier: every warp has V's fragments: the stages are free.

    return load_kv_block


def make_load_query_block(copy_q, copy_do, load_q_fragments, load_do_fragments, DO_AT,
                          FRAGMENTS=True):
    @kernel_part
    def load_query_block(words, q, dout, q_frag, do_frag, b, heads_q, h, start_m, n_q, d, d_v,
                         lane, w):
        """The block's query rows: Q and dO through the stages into this warp's A
        fragments (not FRAGMENTS: the summed variants, which read them from shared memory
        at each step). Two barriers."""
        at_q = (int64(b) * heads_q + h) * n_q
        copy_q(words, 0, q, at_q * d, start_m, n_q, d)
        copy_do(words, DO_AT, dout, at_q * d_v, start_m, n_q, d_v)
        warp.cp_async_commit()
        warp.cp_async_wait(0)
        cuda.syncthreads()  # Barrier: Q and dO have landed.
        if FRAGMENTS:
            load_q_fragments(words, 0, q_frag, lane, w)
            load_do_fragments(words, DO_AT, do_frag, lane, w)
        cuda.syncthreads()  # Barrier: every warp has its fragments: the stages are free.

    return load_query_block


def make_copy_query_tile(copy_q, copy_do, DO_AT):
    @kernel_part
    def copy_query_tile(words, at, q, dout, b, heads_q, h, start_q, n_q, d, d_v):
        """Rows start_q .. of head h's Q and dO to the stage at word `at` (dO DO_AT words
        after Q), one group of asynchronous copies."""
        at_q = (int64(b) * heads_q + h) * n_q
        copy_q(words, at, q, at_q * d, start_q, n_q, d)
        copy_do(words, at + DO_AT, dout, at_q * d_v, start_q, n_q, d_v)
        warp.cp_async_commit()

    return copy_query_tile


def make_query_walk(HAS_MASK, QB):
    """The walk of the dK, dV loop: the group's heads in order, each head's steps over the
    query tiles of QB rows first_q <= i < last_q in order, its list of this key tile's
    visible query tiles with a mask (block_sparse.make_tile_walk, transposed lists), each
    tile of the band without: (step_tile, reads_mask) as make_tile_walk's, head_steps,
    next_step. A step is (h, t). The end of head h's steps is kept in the thread's slot of
    `ends` (shared memory; registers would spill the masked variant, and a binary search a
    step takes as long as the step's products); without a mask it is last_q."""
    walk = make_tile_walk(HAS_MASK, QB)
    walk_range, STEP = walk.walk_range, walk.STEP

    @kernel_part
    def head_steps(visible, cb, mask_steps, tile, h, h_end, first_q, last_q, ends, tid):
        """(h, t0): the first head from h (before h_end) with a step over this key tile's
        band, and that step, its steps' end in ends[tid]; (h_end, 0) where none has one."""
        while h < h_end:
            t0, t1 = walk_range(visible, cb, h * mask_steps[1], tile, first_q, last_q)
            if t0 < t1:
                if HAS_MASK:
                    ends[tid] = t1
                return h, int64(t0)
            h += 1
        return h_end, int64(0)

    @kernel_part
    def next_step(visible, cb, mask_steps, tile, h, t, h_end, first_q, last_q, ends, tid):
        """The step after step (h, t): (h, t + STEP) if head h has it, else the next head's
        first (head_steps)."""
        if t + STEP < (ends[tid] if HAS_MASK else last_q):
            return h, t + STEP
        return head_steps(visible, cb, mask_steps, tile, h + 1, h_end, first_q, last_q, ends,
                          tid)

    return walk.step_tile, walk.reads_mask, head_steps, next_step


def make_interior(QB):
    @kernel_part
    def interior(start_q, start_n, n_q, kv_len, left, right, bottom_right):
        """Whether every row of the query tile start_q .. + QB exists and sees every key of
        the block start_n .. + BLOCK (key_range is monotone in the row: its first and last
        rows decide)."""
        last_row = min(start_q + QB, n_q) - 1
        return (start_q + QB <= n_q and key_range_device(
            last_row, n_q, kv_len, left, right, bottom_right)[0] <= start_n
            and key_range_device(start_q, n_q, kv_len, left, right,
                                 bottom_right)[1] >= start_n + BLOCK)

    return interior


def make_kv_products(dv_product, dk_product, dv_seen_pairs, dk_seen_pairs, DO_AT, NONFINITE,
                     DK, DV):
    @kernel_part
    def products(words, at, s, dp, dk_acc, dv_acc, q_flags, dout_flags, b, h, start_q, lane):
        """dV += P^T dO (DV), dK += dS^T Q (DK) for the stage at word `at`: by mma.sync, or
        (the nonfinite variant, a tile whose Q or dO holds a NaN or an inf) only the pairs
        taking part, in float32."""
        flag = start_q // FLAG_ROWS  # the same for the block: one path
        if not NONFINITE or (q_flags[b, h, flag] == 0 and dout_flags[b, h, flag] == 0):
            if DV:
                dv_product(words, at + DO_AT, s, dv_acc, lane)
            if DK:
                dk_product(words, at, dp, dk_acc, lane)
        else:
            if DV:
                dv_seen_pairs(words, at + DO_AT, s, s, dv_acc, lane)
            if DK:
                dk_seen_pairs(words, at, s, dp, dk_acc, lane)

    return products


@kernel_part
def deferred_block(deferred, b, h, tile, flags_a, flags_b, h_first, heads, first_row,
                   last_row, tid, own_bad):
    """Whether this block (its tile of head h) leaves its work to the nonfinite variant:
    flash_mma.tiles_flagged of these rows' flags; thread 0 records the answer in
    deferred[b, h, tile] for the nonfinite variant. A barrier (every thread calls it)."""
    bad = tiles_flagged(flags_a, flags_b, b, h_first, heads, first_row, last_row, tid,
                        own_bad)
    if tid == 0:
        deferred[b, h, tile] = 1 if bad else 0
    return bad


def make_q_probabilities(NB, DS_FACTOR):
    @kernel_part
    def q_probabilities(s, dp, lse_r, delta_r):
        """P = exp2(S - lse) in place of S (scaled and masked), dS = P (dP - delta) DS_FACTOR
        in place of dP, for the lane's rows (element e: row e // 2); where the row does not
        see the key (S = -inf): P = NO_PART, dS = 0."""
        for nb in range(NB):
            for e in range(4):
                x = s[nb, e]
                p = NO_PART if x == NEG_INF else math.exp2(x - lse_r[e // 2])
                dp[nb, e] = ZERO if x == NEG_INF else \
                    p * (dp[nb, e] - delta_r[e // 2]) * DS_FACTOR
                s[nb, e] = p

    return q_probabilities


def make_store_rows(COLS, store):
    @kernel_part
    def store_rows(x, acc, b, h, row0, n, width, factor, lane):
        """x[b, h, row, col] = acc * factor for the lane's rows row0, row0 + 8 (< n) and its
        columns 8 cb + 2 t + e (< width) of the accumulator fragments."""
        t = lane % 4
        for half in range(2):
            row = row0 + 8 * half
            if row < n:
                for cb in range(COLS // 8):
                    for e in range(2):
                        col = cb * 8 + 2 * t + e
                        if col < width:
                            x[b, h, row, col] = store(acc[cb, 2 * half + e] * factor)

    return store_rows


@kernel_part
def zero(acc):
    for i in range(acc.shape[0]):
        for e in range(4):
            acc[i, e] = ZERO


def _products(spec):
    """(mma, pack, unpack) of the variant's 16-bit dtype (warp.py); float16 for halves."""
    return (warp.mma_bf16, warp.pack_bf16, warp.unpack_bf16) if spec.dtype == "bfloat16" \
        else (warp.mma_f16, warp.pack_f16, warp.unpack_f16)


def _copier(spec, rows, width, row_words, lo_words, hi_again=None):
    """flash_mma's copy_tile, or with halves both halves (the lo one lo_words further, the
    hi one again hi_again further where given)."""
    if spec.halves:
        return halves.make_copy_tile_halves(rows, width, row_words, lo_words, hi_again)
    return make_copy_tile(rows, width, row_words)


def make_either(scores, exact):
    """dkdv's S^T = K Q^T: scores_t, or where the call says `slow` (a tile pair holding a NaN
    or an inf) halves.scores_exact; exact None (16-bit, or the fast variant): scores_t."""
    if exact is None:
        @kernel_part
        def plain(words, a_at, b_at, c, lane, w, slow):
            scores(words, a_at, b_at, c, lane, w)

        return plain

    @kernel_part
    def either(words, a_at, b_at, c, lane, w, slow):
        if slow:
            exact(words, a_at, b_at, c, lane, w)
        else:
            scores(words, a_at, b_at, c, lane, w)

    return either


def _scales(spec):
    """(P's, dS's constant factors, call_factors): halves.py's for float32, else ones."""
    if spec.halves:  # summed: dS's rows scaled at each step instead (ROW_SCALED)
        ds = float32(1.0) if spec.summed else halves.ds_factor(spec.dv)
        return halves.P_FACTOR, ds, halves.make_factors(True, ds)
    one = float32(1.0)
    return one, one, halves.make_factors(False, one)


def dkdv_kernel_source(spec):
    """The dK, dV kernel of variant `spec` (part "dkdv"; "dk" or "dv": one of the two, kv_parts):
    one block per 64 keys."""
    spec.check()
    DK, DV_ = spec.part != "dv", spec.part != "dk"  # which gradients it makes
    D, DV, QB, NB = spec.d, spec.dv, spec.qb, spec.qb // 8
    lay = spec.layout
    K_ROW, V_ROW, STAGES_AT, STAGE, DO_AT = (lay[n] for n in (
        "k_row", "v_row", "stages_at", "stage", "do_at"))  # dO DO_AT words after a stage's Q
    SHARED_WORDS = 0 if spec.halves else lay["words"]  # 0: dynamic, as the launch makes it
    DB, VB, VSTEPS = D // 8, DV // 8, DV // 16  # fragments of dK, of dV, steps of V's
    NONFINITE, spec_halves = spec.nonfinite, spec.halves
    mma, pack, unpack = _products(spec)
    copy_k = _copier(spec, BLOCK, D, K_ROW, lay["k_lo"])
    copy_v = _copier(spec, BLOCK, DV, V_ROW, lay["v_lo_at"] - STAGES_AT)
    copy_q = _copier(spec, QB, D, K_ROW, lay["q_lo"])
    copy_do = _copier(spec, QB, DV, V_ROW, lay["do_lo"])
    load_v_fragments = make_load_q_fragments(DV, V_ROW)
    P_FACTOR, DS_FACTOR, call_factors = _scales(spec)
    READS = spec.reads_mask  # the mask and the bias; the lists are walked with a mask
    probabilities = make_kv_probabilities(
        NB, make_masked_score({"HAS_MASK": READS}), READS, P_FACTOR, DS_FACTOR)
    EXACT = spec.halves and NONFINITE  # scores_exact for tile pairs holding a NaN or an inf
    if spec.halves:
        SUMMED = spec.summed
        scores_s = make_either(
            halves.make_scores_t_halves(D, K_ROW, K_ROW, QB, lay["k_lo"], lay["q_lo"], SUMMED),
            halves.make_scores_exact(D, K_ROW, K_ROW, QB, lay["k_lo"], lay["q_lo"])
            if EXACT else None)
        scores_dp = halves.make_scores_halves(DV, V_ROW, lay["v_lo_at"], lay["do_lo"], QB,
                                              SUMMED)
        products = make_kv_products(
            halves.make_pv_halves(DV, V_ROW, lay["do_lo"], QB, True),
            halves.make_pv_halves(D, K_ROW, lay["q_lo"], QB, SUMMED, SUMMED),  # dK += dS^T Q
            halves.make_pv_seen_pairs_halves(DV, V_ROW, lay["do_lo"], QB),
            halves.make_pv_seen_pairs_halves(D, K_ROW, lay["q_lo"], QB), DO_AT, NONFINITE,
            DK, DV_)
    else:
        scores_s = make_either(make_scores_t(D, K_ROW, K_ROW, QB, mma), None)
        scores_dp = make_scores(DV, V_ROW, mma, QB)  # dP^T = V dO^T, V's fragments in registers
        products = make_kv_products(
            make_pv(DV, V_ROW, mma, pack, QB), make_pv(D, K_ROW, mma, pack, QB),
            make_pv_seen_pairs(DV, V_ROW, make_unpacked(unpack), QB),
            make_pv_seen_pairs(D, K_ROW, make_unpacked(unpack), QB),
            DO_AT, NONFINITE, DK, DV_)
    copy_query_tile = make_copy_query_tile(copy_q, copy_do, DO_AT)
    interior, query_tiles = make_interior(QB), make_query_tiles(QB)
    HAS_MASK = spec.has_mask
    step_tile, reads_mask, head_steps, next_step = make_query_walk(HAS_MASK, QB)
    ENDS = THREADS if HAS_MASK else 1  # slots of make_query_walk's ends
    load_kv_block = make_load_kv_block(copy_k, copy_v, load_v_fragments, STAGES_AT, DK)
    store = CONVERTERS[spec.grads_dtype][1]
    store_dk, store_dv = make_store_rows(D, store), make_store_rows(DV, store)

    def mma_dkdv(q, k, v, mask, visible, bias, kv_lengths, dout, lse_in, delta, q_flags, dout_flags,
                 k_flags, deferred, factors, dk, dv, n_q, group, qk_scale, scale, left, right,
                 bottom_right, mask_steps, bias_steps):
        words = cuda.shared.array(SHARED_WORDS, uint32)
        v_frag = cuda.local.array((VSTEPS, 4), uint32)  # this warp's keys of V, A fragments
        s = cuda.local.array((NB, 4), float32)  # S^T, then P^T
        dp = cuda.local.array((NB, 4), float32)  # dP^T, then dS^T
        dk_acc = cuda.local.array((DB, 4), float32)
        dv_acc = cuda.local.array((VB, 4), float32)
        # lse (log2 units) and delta of a stage's query rows, copied beside Q and dO
        stats = cuda.shared.array((2, 2, QB), float32)
        ends = cuda.shared.array(ENDS, int64)  # make_query_walk's: the thread's own slot

        tid = cuda.threadIdx.x
        w, lane = tid // 32, tid % 32
        heads_q, heads_k, n_k = q.shape[1], k.shape[1], k.shape[2]
        d, d_v = q.shape[3], v.shape[3]
        # Under a causal band the first keys are seen by the most rows: they go first,
        # rank by rank across every head (schedule.launch_order).
        bhk, tile = grid_order(right >= 0)
        b, hk = bhk // heads_k, bhk % heads_k
        start_n = tile * BLOCK
        key0 = start_n + w * 16 + lane // 4  # the lane's keys: key0 and key0 + 8
        kv_len = int64(kv_lengths[b])
        if DK:
            zero(dk_acc)
        else:  # the dV kernel's dP^T: never made, never read (no garbage in the simulator)
            zero(dp)
        if DV_:
            zero(dv_acc)
        qk, delta_factor, dk_factor, dv_factor, _ = call_factors(factors, qk_scale, scale)
        first_q, tiles = query_tiles(start_n, n_q, kv_len, left, right, bottom_right)
        keys_bad = spec_halves and own_flagged(k_flags, b, hk, start_n)  # scores_exact's
        if NONFINITE:
            if deferred[b, hk, tile] == 0:
                return  # the fast variant did this block
        elif deferred_block(deferred, b, hk, tile, q_flags, dout_flags, int64(hk) * group,
                            group, first_q, first_q + tiles * QB - 1, tid, keys_bad):
            return  # a tile holds a NaN or an inf: the nonfinite variant does this block
        if start_n < kv_len:  # else every key of the tile is hidden: dK = dV = 0
            load_kv_block(words, k, v, v_frag, b, heads_k, hk, n_k, start_n, kv_len, d, d_v,
                          lane, w)
            cb, h_end = b * mask_steps[0], (int64(hk) + 1) * group
            last_q = first_q + tiles * QB
            # the nonfinite variant (rare blocks) reads mask and bias in every tile: registers
            biased = READS and (NONFINITE or bias_given(bias, bias_steps))
            # the next step to copy: head h_next's step t_next
            h_next, t_next = head_steps(visible, cb, mask_steps, tile, int64(hk) * group,
                                        h_end, first_q, last_q, ends, tid)
            if h_next < h_end:  # the first step's query tile, into stage 0
                q_next = step_tile(visible, cb, h_next * mask_steps[1], tile, t_next)
                copy_query_tile(words, STAGES_AT, q, dout, b, heads_q, h_next, q_next, n_q, d,
                                d_v)
                if tid < QB:
                    stats[0, 0, tid], stats[0, 1, tid] = row_stats(
                        lse_in, delta, b, h_next, q_next + tid, n_q, True, delta_factor)
            stage = 0
            while h_next < h_end:  # the group's heads in order, their steps in order
                h, t = h_next, t_next  # the step's tile and class: found again, not carried
                start_q = step_tile(visible, cb, h * mask_steps[1], tile, t)
                partial = NONFINITE or (READS and reads_mask(visible, cb, h * mask_steps[1],
                                                             tile, t))
                h_next, t_next = next_step(visible, cb, mask_steps, tile, h, t, h_end,
                                           first_q, last_q, ends, tid)
                warp.cp_async_wait(0)  # this thread's copies of this tile have landed
                # Barrier: every thread's copies of this tile (and its statistics) have landed,
                # and every warp is done with the other stage, which the next copy overwrites.
                cuda.syncthreads()
                lse_next, delta_next = ZERO, ZERO
                if h_next < h_end:  # the next step's tile, into the other stage
                    q_next = step_tile(visible, cb, h_next * mask_steps[1], tile, t_next)
                    copy_query_tile(words, STAGES_AT + (1 - stage) * STAGE, q, dout, b, heads_q,
                                    h_next, q_next, n_q, d, d_v)
                    lse_next, delta_next = row_stats(lse_in, delta, b, h_next, q_next + tid,
                                                     n_q, tid < QB, delta_factor)  # stored
                at = STAGES_AT + stage * STAGE                                 # after this tile
                scores_s(words, 0, at, s, lane, w,  # S^T = K Q^T
                         keys_bad or q_flags[b, h, start_q // FLAG_ROWS] != 0)
                if DK:
                    scores_dp(words, at + DO_AT, v_frag, dp, lane)
                probabilities(s, dp, stats, stage, qk, mask, bias, mask_steps,
                              bias_steps, b, h, key0, start_q, n_q, kv_len, left, right,
                              bottom_right, interior(start_q, start_n, n_q, kv_len, left,
                                                     right, bottom_right),
                              partial, biased, lane)
                products(words, at, s, dp, dk_acc, dv_acc, q_flags, dout_flags, b, h, start_q,
                         lane)
                if tid < QB:  # the next tile's statistics, their loads' latency hidden above
                    stats[1 - stage, 0, tid], stats[1 - stage, 1, tid] = lse_next, delta_next
                stage = 1 - stage
        if DK:
            store_dk(dk, dk_acc, b, hk, key0, n_k, d, dk_factor, lane)
        if DV_:
            store_dv(dv, dv_acc, b, hk, key0, n_k, d_v, dv_factor, lane)

    return check_parameters(mma_dkdv, tuple(a[0] for a in MMA_DKDV_ARGS))


def dq_kernel_source(spec):
    """The dQ kernel of variant `spec` (part "dq"): one block per 64 query rows."""
    spec.check()
    D, DV, NB = spec.d, spec.dv, KEY_TILE // 8
    lay = spec.layout
    K_ROW, V_ROW, STAGE, V_AT, DO_AT = (lay[n] for n in (
        "k_row", "v_row", "stage", "v_at", "do_at"))  # V V_AT words after a stage's K
    SHARED_WORDS = 0 if spec.halves else lay["words"]  # 0: dynamic, as the launch makes it
    QSTEPS, VSTEPS, DB = D // 16, DV // 16, D // 8  # fragments of Q, of dO, of dQ
    NONFINITE = spec.nonfinite
    mma, pack, unpack = _products(spec)
    # The summed fast variant keeps the nonfinite one's branches (scores_exact for a flagged
    # tile pair, the seen pairs of a flagged K tile), never taken there (its blocks with a
    # flagged tile were deferred): without them ptxas pipelines the loop and spills (56
    # bytes at head dim 128; 193 registers with them).
    BRANCHED = NONFINITE or spec.summed
    HALVES = spec.halves
    EXACT = HALVES and BRANCHED  # scores_exact for tile pairs holding a NaN or an inf
    Q_HI_AT = lay["q_hi_at"]
    copy_q = _copier(spec, BLOCK, D, K_ROW, lay["q_lo_at"],  # Q lands at word 0
                     Q_HI_AT if spec.q_hi_shared else None)
    DO_HI_AT = lay["do_hi_at"]  # summed: dO's hi tile, read by scores_dp there
    copy_do = _copier(spec, BLOCK, DV, V_ROW, lay["do_lo_at"] - DO_AT,
                      DO_HI_AT - DO_AT if spec.summed else None)
    copy_kv = make_copy_kv(_copier(spec, KEY_TILE, D, K_ROW, lay["k_lo"]),
                           _copier(spec, KEY_TILE, DV, V_ROW, lay["v_lo"]), V_AT)
    load_query_block = make_load_query_block(
        copy_q, copy_do, make_load_q_fragments(D, K_ROW), make_load_q_fragments(DV, V_ROW),
        DO_AT, not spec.summed)
    _, DS_FACTOR, call_factors = _scales(spec)
    if spec.halves:
        SUMMED = spec.summed
        scores_s = make_q_scores(
            halves.make_scores_halves(D, K_ROW, lay["q_lo_at"], lay["k_lo"], SUMMED=SUMMED,
                                      A_HI_AT=Q_HI_AT if SUMMED else None),
            halves.make_scores_exact(D, K_ROW, K_ROW, KEY_TILE, lay["q_lo_at"] - Q_HI_AT,
                                     lay["k_lo"]) if EXACT else None, Q_HI_AT)
        scores_dp = halves.make_scores_halves(DV, V_ROW, lay["do_lo_at"], lay["v_lo"],
                                              SUMMED=SUMMED,
                                              A_HI_AT=DO_HI_AT if SUMMED else None)
        dq_product = halves.make_pv_halves(D, K_ROW, lay["k_lo"], SUMMED=SUMMED,
                                           ROW_SCALED=SUMMED)  # dQ += dS K
        dq_seen_pairs = halves.make_pv_seen_pairs_halves(D, K_ROW, lay["k_lo"])
    else:
        scores_s = make_q_scores(make_scores(D, K_ROW, mma), None, Q_HI_AT)
        scores_dp = make_scores(DV, V_ROW, mma)
        dq_product = make_pv(D, K_ROW, mma, pack)  # dQ += dS K: K in the forward's V place
        dq_seen_pairs = make_pv_seen_pairs(D, K_ROW, make_unpacked(unpack))
    READS = spec.reads_mask  # the mask and the bias; the lists are walked with a mask
    scale_and_mask = make_scale_and_mask(make_masked_score({"HAS_MASK": READS}), READS)
    q_probabilities = make_q_probabilities(NB, DS_FACTOR)
    add_dq, next_tile = (make_add_dq(dq_product, dq_seen_pairs, BRANCHED),
                         make_next_tile(copy_kv, STAGE))
    store_dq = make_store_rows(D, CONVERTERS[spec.grads_dtype][1])
    HAS_MASK = spec.has_mask
    walk = make_tile_walk(HAS_MASK, KEY_TILE)
    walk_range, tile_start, reads_mask, WALK_STEP = (walk.walk_range, walk.tile_start,
                                                     walk.reads_mask, walk.STEP)

    def mma_dq(q, k, v, mask, visible, bias, kv_lengths, dout, lse_in, delta, k_flags, q_flags,
               deferred, factors, dq, n_q, group, qk_scale, scale, left, right, bottom_right,
               mask_steps, bias_steps):
        words = cuda.shared.array(SHARED_WORDS, uint32)
        q_frag = cuda.local.array((QSTEPS, 4), uint32)  # this warp's rows, A fragments
        do_frag = cuda.local.array((VSTEPS, 4), uint32)
        s = cuda.local.array((NB, 4), float32)  # S, then P
        dp = cuda.local.array((NB, 4), float32)  # dP, then dS
        dq_acc = cuda.local.array((DB, 4), float32)
        lse_r = cuda.local.array(2, float32)  # rows g and g + 8: lse (log2 units), delta
        delta_r = cuda.local.array(2, float32)
        lo = cuda.local.array(2, int64)
        hi = cuda.local.array(2, int64)

        tid = cuda.threadIdx.x
        w, lane = tid // 32, tid % 32
        heads_q, heads_k, n_k = q.shape[1], k.shape[1], k.shape[2]
        d, d_v = q.shape[3], v.shape[3]
        bh, rank = grid_order(right >= 0)  # the last tile first (schedule.launch_order)
        b, h = bh // heads_q, bh % heads_q
        hk = h // group
        tile = cuda.gridDim.x - 1 - rank
        start_m = tile * BLOCK
        row0 = start_m + w * 16 + lane // 4  # the lane's rows: row0 and row0 + 8
        kv_len = int64(kv_lengths[b])
        whole_rows = start_m + BLOCK <= n_q
        zero(dq_acc)
        qk, delta_factor, _, _, dq_factor = call_factors(factors, qk_scale, scale)
        init_dq_rows(lse_r, delta_r, lo, hi, lse_in, delta, b, h, row0, n_q, kv_len, left,
                     right, bottom_right, delta_factor)
        first, last, lo_last, hi_first = key_tiles(
            start_m, min(start_m + BLOCK, n_q) - 1, n_q, kv_len, left, right, bottom_right, 0, 1,
            KEY_TILE, KEY_TILE)
        cb, ch = b * mask_steps[0], h * mask_steps[1]  # this block's visible list
        biased = READS and bias_given(bias, bias_steps)
        t0, t1 = walk_range(visible, cb, ch, tile, first, last)  # tiles no row sees: none
        start_n = tile_start(visible, cb, ch, tile, t0, t1, last)
        rows_bad = HALVES and own_flagged(q_flags, b, h, start_m)  # scores_exact's
        if NONFINITE:
            if deferred[b, h, tile] == 0:
                return  # the fast variant did this block
        elif deferred_block(deferred, b, h, tile, k_flags, k_flags, hk, 1, first, last - 1,
                            tid, rows_bad):
            return  # a K tile holds a NaN or an inf: the nonfinite variant does this block
        load_query_block(words, q, dout, q_frag, do_frag, b, heads_q, h, start_m, n_q, d, d_v,
                         lane, w)
        k_at = (int64(b) * heads_k + hk) * n_k
        k_base, v_base = k_at * d, k_at * d_v
        if start_n < last:  # group: the first key tile, into stage 0
            copy_kv(words, 0, k, v, k_base, v_base, start_n, last, d, d_v)
            warp.cp_async_commit()
        stage = 0
        for t in range(t0, t1, WALK_STEP):
            start_n = tile_start(visible, cb, ch, tile, t, t1, last)
            following = tile_start(visible, cb, ch, tile, t + WALK_STEP, t1, last)
            next_tile(words, k, v, k_base, v_base, following, last, d, d_v, stage)
            at = stage * STAGE
            scores_s(words, at, q_frag, s, lane, w,  # S = Q K^T
                     EXACT and (rows_bad or k_flags[b, hk, start_n // FLAG_ROWS] != 0))
            scores_dp(words, at + V_AT, do_frag, dp, lane)
            interior = start_n >= lo_last and start_n + KEY_TILE <= hi_first
            scale_and_mask(s, qk, mask, bias, mask_steps, bias_steps, b, h, row0,
                           start_n, lo, hi, interior, whole_rows, n_q,
                           READS and reads_mask(visible, cb, ch, tile, t), biased, lane)
            q_probabilities(s, dp, lse_r, delta_r)
            add_dq(words, at, s, dp, dq_acc, lane,  # dQ += dS K
                   BRANCHED and k_flags[b, hk, start_n // FLAG_ROWS] != 0)
            stage = 1 - stage
        store_dq(dq, dq_acc, b, h, row0, n_q, d, dq_factor, lane)

    return check_parameters(mma_dq, tuple(a[0] for a in MMA_DQ_ARGS))


def mma_bwd_source(spec):
    return (dq_kernel_source if spec.part == "dq" else dkdv_kernel_source)(spec)


@lru_cache(maxsize=32)
def mma_bwd_kernel(spec):
    """The compiled kernel of a variant (through the on-disk compile cache)."""
    return jit(mma_bwd_source(spec), ("mma-bwd",) + astuple(spec), FASTMATH)
