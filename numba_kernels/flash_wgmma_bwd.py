"""The FlashAttention-2 backward on Hopper's warpgroup tensor cores (sm_90a): flash_mma_bwd.py's
dkdv and dq kernels (reference/tiled_backward.py) with each product of a tile one chain of
wgmma.mma_async (warpgroup.py) by a warpgroup, for float16 and bfloat16. One warpgroup (128
threads) a block of BLOCK = 64 keys (dK, dV) or 64 query rows (dQ), as flash_mma_bwd's 4
warps: the accumulators hold the rows and columns mma.sync's C fragments hold there, so the
probabilities, the masks, the walks over the visible tiles and the stores are flash_mma_bwd's
own.

Shared memory, every tile as it is in global memory in the 128-byte swizzle (flash_wgmma.py):
the block's two tiles once and, in each of two stages, the walk's two, copied by cp.async.
dkdv (K, V kept; Q and dO walked in query tiles of QB = 64 rows, 32 where a mask is read at
head dims above 64: WgmmaBwdSpec.qb), a step:

    S^T  = K Q^T      A = K, B = Q, both K-major (the head dim along K)     D / 16 products
    dP^T = V dO^T     A = V, B = dO, both K-major                          Dv / 16
    P^T = exp2(S^T scale - lse), dS^T = P^T (dP^T - delta)   (flash_mma_bwd's probabilities)
    dV  += P^T dO     A = P^T from registers, B = dO MN-major (Dv along N)   QB / 16
    dK  += dS^T Q     A = dS^T from registers, B = Q MN-major (D along N)    QB / 16

dq (Q, dO kept; K and V walked in key tiles of KEYS = 64), a step: S = Q K^T, dP = dO V^T,
P and dS (flash_mma's scale and mask, flash_mma_bwd's q probabilities), dQ += dS K (K
MN-major). The score chains are waited for together, then the gradient chains, while the next
tile's copy is in flight. These are the fast variants only: a block whose tiles hold a NaN or
an inf (Q or dO for dkdv, K for dq) is flagged in `deferred` by flash_mma_bwd's test, and
flash_mma_bwd's nonfinite variant does it. In the simulator each product is summed as
mma.sync's (warp.mma_reference), so the gradients are the mma.sync kernels' bit for bit there.
docs/design/hopper.md draws the design.
"""
from dataclasses import astuple, dataclass
from functools import lru_cache

from numba import cuda

from . import warp, warpgroup
from .common import FASTMATH, bias_given, check_parameters, kernel_part, make_masked_score
from .compile_cache import jit
from .convert import CONVERTERS, float32, int64, uint32
from .block_sparse import make_tile_walk
from .flash_mma_bwd import (BLOCK, MMA_DKDV_ARGS, MMA_DQ_ARGS, deferred_block, init_dq_rows,
                            make_interior, make_kv_probabilities, make_q_probabilities,
                            make_query_tiles, make_query_walk, make_store_rows, row_stats,
                            zero)
from .flash_wgmma import (ALIGN_WORDS, GROUP_BYTES, KEYS, ROW_WORDS, WgmmaVariant, make_pv,
                          make_scores)
from .mma_parts import (BLOCK_N, MMA_DTYPES, MMA_WIDTHS, THREADS, make_copy_kv,
                        make_copy_tile, make_scale_and_mask)
from .schedule import grid_order, key_tiles

PARTS = ("dkdv", "dq")
NB_PART = 4  # n-blocks of 8 columns the probabilities take at once (unrolled)
assert BLOCK == 64 and THREADS == warpgroup.WARPGROUP  # wgmma's M, one warpgroup


@dataclass(frozen=True)
class WgmmaBwdSpec(WgmmaVariant):
    """One compiled variant of a wgmma backward kernel: the part ("dkdv" or "dq", as
    MmaBwdSpec's, with their arguments), padded head dims, 16-bit dtype, whether it walks
    visible lists and reads a mask or bias, whether every listed tile is FULL (full_tiles: a
    block mask alone, as MmaBwdSpec.full_tiles)."""

    part: str
    d: int
    dv: int
    dtype: str
    has_mask: bool
    full_tiles: bool = False

    def check(self):
        if self.part not in PARTS or self.d not in MMA_WIDTHS or self.dv not in MMA_WIDTHS \
                or self.dtype not in MMA_DTYPES or (self.full_tiles and not self.has_mask):
            raise ValueError(f"WgmmaBwdSpec: part in {PARTS}, d and dv in {MMA_WIDTHS}, "
                             f"dtype in {MMA_DTYPES}, full_tiles with a mask only; got {self}")
        return self

    @property
    def grads_dtype(self):
        """The dtype the gradients are stored in: the inputs'."""
        return self.dtype

    @property
    def qb(self):
        """dkdv's query rows a step: 64 (S^T and dP^T m64n64 accumulators, 32 floats a
        thread each), or 32 where the variant reads a mask at head dims above 64 (with 64,
        ptxas spills 24 bytes at 255 registers)."""
        return 32 if self.reads_mask and max(self.d, self.dv) > 64 else 64

    @property
    def tiles(self):
        """(rows, keys) of the tiles its visible lists hold: dkdv's (qb, BLOCK), dq's
        (BLOCK, KEYS)."""
        return (self.qb, BLOCK) if self.part == "dkdv" else (BLOCK, KEYS)

    @property
    def layout(self):
        """Where the shared tiles start, in 32-bit words after the 1024-byte aligned start:
        the block's two tiles of 64 rows (dkdv: K at `k_at`, V at `v_at`; dq: Q at `q_at`,
        dO at `do_at`), then two stages from `stages_at`, `stage` words each, of the walk's
        two tiles (dkdv: Q, and dO `do_at` words after it; dq: K, and V `v_at` words after
        it); the total `words`, with room to align."""
        rows = self.qb if self.part == "dkdv" else KEYS  # a stage's
        block_words, block_v_words = BLOCK * self.d // 2, BLOCK * self.dv // 2
        walk_words, walk_v_words = rows * self.d // 2, rows * self.dv // 2
        stages_at = block_words + block_v_words
        at = dict(k_at=0, v_at=block_words, do_at=walk_words) if self.part == "dkdv" else \
            dict(q_at=0, do_at=block_words, v_at=walk_words)
        return dict(at, stages_at=stages_at, stage=walk_words + walk_v_words,
                    words=stages_at + 2 * (walk_words + walk_v_words) + ALIGN_WORDS)


def wgmma_bwd_specs():
    """Every variant a call can launch: the PTX gate compiles each."""
    return [WgmmaBwdSpec(part, d, dv, dtype, m, full).check() for part in PARTS
            for d in MMA_WIDTHS for dv in MMA_WIDTHS for dtype in MMA_DTYPES
            for m in (False, True) for full in ((False, True) if m else (False,))]


def make_tile_probabilities(spec):
    """flash_mma_bwd's probabilities over a tile of qb query columns, NB_PART n-blocks at a
    time (one loop over 32 elements of s would not be unrolled, and s and dp would live in
    local memory)."""
    READS, NB = spec.reads_mask, spec.qb // 8
    one = float32(1.0)
    part = make_kv_probabilities(NB_PART, make_masked_score({"HAS_MASK": READS}), READS, one,
                                 one)
    COLS, TWO = 8 * NB_PART, NB == 2 * NB_PART
    assert NB in (NB_PART, 2 * NB_PART)

    @kernel_part
    def tile_probabilities(s, dp, stats, stage, qk_scale, mask, bias, mask_steps, bias_steps,
                           b, h, key0, start_q, n_q, kv_len, left, right, bottom_right,
                           interior, read_mask, read_bias, lane):
        """P^T in place of S^T, dS^T in place of dP^T, for query columns start_q .. + qb
        (their lse and delta at stats[stage, :, column - start_q])."""
        part(s[:NB_PART], dp[:NB_PART], stats[:, :, :COLS], stage, qk_scale, mask, bias,
             mask_steps, bias_steps, b, h, key0, start_q, n_q, kv_len, left, right,
             bottom_right, interior, read_mask, read_bias, lane)
        if TWO:
            part(s[NB_PART:], dp[NB_PART:], stats[:, :, COLS:], stage, qk_scale, mask, bias,
                 mask_steps, bias_steps, b, h, key0, start_q + COLS, n_q, kv_len, left, right,
                 bottom_right, interior, read_mask, read_bias, lane)

    return tile_probabilities


def make_copy_pair(ROWS, D, DV, SECOND_AT):
    """copy_pair(words, at, x, y, row_at, start, n, d, d_v): rows start .. + ROWS of one
    head of x (D wide) and of y (DV wide), whose row 0 is flat row `row_at`, to the tiles at
    word `at` and SECOND_AT words after it (zeros past row n): one group of copies, not
    waited for."""
    copy = make_copy_kv(make_copy_tile(ROWS, D, ROW_WORDS, SWIZZLED=True),
                        make_copy_tile(ROWS, DV, ROW_WORDS, SWIZZLED=True), SECOND_AT)

    @kernel_part
    def copy_pair(words, at, x, y, row_at, start, n, d, d_v):
        copy(words, at, x, y, row_at * d, row_at * d_v, start, n, d, d_v)
        warp.cp_async_commit()

    return copy_pair


def make_fetch_step(QB, D, DV, DO_AT, step_tile):
    """fetch_step(words, at, q, dout, lse_in, delta, b, heads_q, h, visible, cb, mask_steps,
    tile, t, n_q, d, d_v): dkdv's step (h, t) (make_query_walk's step_tile gives its query
    tile: rows start_q .. + QB of head h's Q and dO) to the stage at word `at`, one group of
    copies; returns this thread's row of the tile's statistics (lse in log2 units, delta:
    flash_mma_bwd.row_stats; zeros past the tile), for keep_stats to store beside it once
    the stage's readers are done."""
    copy_step = make_copy_pair(QB, D, DV, DO_AT)  # Q and dO

    @kernel_part
    def fetch_step(words, at, q, dout, lse_in, delta, b, heads_q, h, visible, cb, mask_steps,
                   tile, t, n_q, d, d_v):
        start_q = step_tile(visible, cb, h * mask_steps[1], tile, t)
        copy_step(words, at, q, dout, (int64(b) * heads_q + h) * n_q, start_q, n_q, d, d_v)
        tid = cuda.threadIdx.x
        return row_stats(lse_in, delta, b, h, start_q + tid, n_q, tid < QB, float32(1.0))

    return fetch_step


def make_keep_stats(QB):
    @kernel_part
    def keep_stats(stats, stage, lse, delta_row, tid):
        """Thread tid's row of a stage's statistics (fetch_step's) into stats[stage]."""
        if tid < QB:
            stats[stage, 0, tid], stats[stage, 1, tid] = lse, delta_row

    return keep_stats


@kernel_part
def stage_landed():
    """Wait for this thread's copies (every group), make them visible to wgmma's reads
    (the async proxy), then the block's barrier: every thread's copies have landed, and
    every thread is past the products of the step before, so the stage those read is free
    for the next copy."""
    warp.cp_async_wait(0)
    warpgroup.fence_proxy_async()
    cuda.syncthreads()


def instructions(spec):
    """(mma, mma_regs_mn, pack) of the variant's dtype: warpgroup.py's products with both
    operands in shared memory and with A from registers (B MN-major), warp.py's packing."""
    if spec.dtype == "float16":
        return warpgroup.mma_async_f16, warpgroup.mma_async_regs_mn_f16, warp.pack_f16
    return warpgroup.mma_async_bf16, warpgroup.mma_async_regs_mn_bf16, warp.pack_bf16


def make_score_pair(spec, COLS):
    """scores(words, x_at, y_at, x2_at, y2_at, s, dp): s = X Y^T (D wide) and dp = X2 Y2^T
    (Dv wide), X and X2 of 64 rows, Y and Y2 of COLS: two groups of wgmma, waited for here.
    dkdv's S^T = K Q^T and dP^T = V dO^T, dq's S = Q K^T and dP = dO V^T."""
    mma = instructions(spec)[0]
    issue_s, issue_dp = make_scores(spec.d, mma, BLOCK, COLS), make_scores(spec.dv, mma,
                                                                        BLOCK, COLS)

    @kernel_part
    def scores(words, x_at, y_at, x2_at, y2_at, s, dp):
        s_acc = issue_s(words, x_at, y_at)
        dp_acc = issue_dp(words, x2_at, y2_at)
        warpgroup.wgmma_wait(0)
        warpgroup.fragment_store(s, s_acc)
        warpgroup.fragment_store(dp, dp_acc)

    return scores


def make_kv_gradients(spec):
    """gradients(words, at, s, dp, dk_acc, dv_acc): dV += P^T dO (P^T in s) and dK += dS^T Q
    (dS^T in dp) for the stage at word `at` (Q, then dO), two groups of wgmma, waited for
    here: the stage is free once they return."""
    _, mma_regs_mn, pack = instructions(spec)
    DO_AT, QB = spec.layout["do_at"], spec.qb
    issue_dv = make_pv(spec.dv, mma_regs_mn, pack, QB)  # dV += P^T dO
    issue_dk = make_pv(spec.d, mma_regs_mn, pack, QB)  # dK += dS^T Q

    @kernel_part
    def gradients(words, at, s, dp, dk_acc, dv_acc):
        dv_new = issue_dv(words, at + DO_AT, s, dv_acc)
        dk_new = issue_dk(words, at, dp, dk_acc)
        warpgroup.wgmma_wait(0)
        warpgroup.fragment_store(dv_acc, dv_new)
        warpgroup.fragment_store(dk_acc, dk_new)

    return gradients


def make_kv_step(spec):
    """kv_step(words, base, at, s, dp, dk_acc, dv_acc, stats, stage, qk_scale, mask, bias,
    mask_steps, bias_steps, b, h, key0, start_n, start_q, n_q, kv_len, left, right,
    bottom_right, read_mask, read_bias, lane): one step of the dK, dV walk, the query tile
    start_q .. + qb in the stage at word `at` (its statistics in stats[stage]), the block's
    K and V at base: S^T = K Q^T and dP^T = V dO^T, P^T and dS^T in their place, dV += P^T
    dO and dK += dS^T Q."""
    lay, QB = spec.layout, spec.qb
    K_AT, V_AT, DO_AT = lay["k_at"], lay["v_at"], lay["do_at"]
    scores, gradients = make_score_pair(spec, QB), make_kv_gradients(spec)
    probabilities, interior = make_tile_probabilities(spec), make_interior(QB)

    @kernel_part
    def kv_step(words, base, at, s, dp, dk_acc, dv_acc, stats, stage, qk_scale, mask, bias,
                mask_steps, bias_steps, b, h, key0, start_n, start_q, n_q, kv_len, left, right,
                bottom_right, read_mask, read_bias, lane):
        scores(words, base + K_AT, at, base + V_AT, at + DO_AT, s, dp)  # S^T, dP^T
        probabilities(s, dp, stats, stage, qk_scale, mask, bias, mask_steps, bias_steps, b, h,
                      key0, start_q, n_q, kv_len, left, right, bottom_right,
                      interior(start_q, start_n, n_q, kv_len, left, right, bottom_right),
                      read_mask, read_bias, lane)
        gradients(words, at, s, dp, dk_acc, dv_acc)

    return kv_step


def dkdv_kernel_source(spec):
    """The dK, dV kernel of variant `spec` as a Python function (for cuda.jit or
    compile_ptx), with flash_mma_bwd's dkdv arguments (MMA_DKDV_ARGS): one block per 64
    keys."""
    spec.check()
    D, DV, QB, lay = spec.d, spec.dv, spec.qb, spec.layout
    STAGES_AT, STAGE = lay["stages_at"], lay["stage"]
    NB, DB, VB = QB // 8, D // 8, DV // 8  # n-blocks of S^T, of dK, of dV
    READS, HAS_MASK = spec.reads_mask, spec.has_mask
    step_tile, reads_mask, head_steps, next_step = make_query_walk(HAS_MASK, QB)
    K_AT = lay["k_at"]
    copy_block = make_copy_pair(BLOCK, D, DV, lay["v_at"] - K_AT)  # K and V
    fetch_step = make_fetch_step(QB, D, DV, lay["do_at"], step_tile)
    kv_step, keep_stats, query_tiles = make_kv_step(spec), make_keep_stats(QB), \
        make_query_tiles(QB)
    ENDS = THREADS if HAS_MASK else 1  # slots of make_query_walk's ends
    store = CONVERTERS[spec.grads_dtype][1]
    store_dk, store_dv = make_store_rows(D, store), make_store_rows(DV, store)

    def wgmma_dkdv(q, k, v, mask, visible, bias, kv_lengths, dout, lse_in, delta, q_flags,
                   dout_flags, k_flags, deferred, factors, dk, dv, n_q, group, qk_scale,
                   scale, left, right, bottom_right, mask_steps, bias_steps):
        words = cuda.shared.array(0, uint32)  # dynamic: layout's words
        s = cuda.local.array((NB, 4), float32)  # S^T, then P^T
        dp = cuda.local.array((NB, 4), float32)  # dP^T, then dS^T
        dk_acc = cuda.local.array((DB, 4), float32)
        dv_acc = cuda.local.array((VB, 4), float32)
        # lse (log2 units) and delta of a stage's query rows, copied beside Q and dO
        stats = cuda.shared.array((2, 2, QB), float32)
        ends = cuda.shared.array(ENDS, int64)  # make_query_walk's: the thread's own slot

        tid = cuda.threadIdx.x
        base = warpgroup.aligned_index(words, GROUP_BYTES)  # the swizzle's alignment
        heads_q, heads_k, n_k = q.shape[1], k.shape[1], k.shape[2]
        d, d_v = q.shape[3], v.shape[3]
        bhk, tile = grid_order(right >= 0)  # as flash_mma_bwd's (schedule.launch_order)
        b, hk = bhk // heads_k, bhk % heads_k
        start_n = tile * BLOCK
        key0 = start_n + tid // 32 * 16 + tid % 32 // 4  # the thread's keys: key0, key0 + 8
        kv_len = int64(kv_lengths[b])
        zero(dk_acc)
        zero(dv_acc)
        first_q, tiles = query_tiles(start_n, n_q, kv_len, left, right, bottom_right)
        last_q, h0, h_end = first_q + tiles * QB, int64(hk) * group, (int64(hk) + 1) * group
        if deferred_block(deferred, b, hk, tile, q_flags, dout_flags, h0, group, first_q,
                          min(last_q, n_q) - 1, tid, False):
            return  # a tile holds a NaN or an inf: flash_mma_bwd's nonfinite variant
        if start_n < kv_len:  # else every key of the block is hidden: dK = dV = 0
            copy_block(words, base + K_AT, k, v, (int64(b) * heads_k + hk) * n_k, start_n,
                       kv_len, d, d_v)
            cb, biased = b * mask_steps[0], READS and bias_given(bias, bias_steps)
            # the next step to copy: head h_next's step t_next; the first into stage 0
            h_next, t_next = head_steps(visible, cb, mask_steps, tile, h0, h_end, first_q,
                                        last_q, ends, tid)
            if h_next < h_end:
                lse_next, delta_next = fetch_step(words, base + STAGES_AT, q, dout, lse_in,
                                                  delta, b, heads_q, h_next, visible, cb,
                                                  mask_steps, tile, t_next, n_q, d, d_v)
                keep_stats(stats, 0, lse_next, delta_next, tid)
            stage = 0
            while h_next < h_end:  # the group's heads in order, their steps in order
                h, t = h_next, t_next
                start_q = step_tile(visible, cb, h * mask_steps[1], tile, t)
                partial = READS and reads_mask(visible, cb, h * mask_steps[1], tile, t)
                h_next, t_next = next_step(visible, cb, mask_steps, tile, h, t, h_end,
                                           first_q, last_q, ends, tid)
                stage_landed()  # this tile, its statistics, K and V; the other stage free
                lse_next, delta_next = float32(0.0), float32(0.0)
                if h_next < h_end:  # the next step's tile, into the other stage
                    lse_next, delta_next = fetch_step(
                        words, base + STAGES_AT + (1 - stage) * STAGE, q, dout, lse_in, delta,
                        b, heads_q, h_next, visible, cb, mask_steps, tile, t_next, n_q, d, d_v)
                kv_step(words, base, base + STAGES_AT + stage * STAGE, s, dp, dk_acc, dv_acc,
                        stats, stage, qk_scale, mask, bias, mask_steps, bias_steps, b, h, key0,
                        start_n, start_q, n_q, kv_len, left, right, bottom_right, partial,
                        biased, tid % 32)
                # the next tile's statistics, their loads' latency hidden by the step
                keep_stats(stats, 1 - stage, lse_next, delta_next, tid)
                stage = 1 - stage
            warp.cp_async_wait(0)  # no copy outlives the block (where no step was walked)
        store_dk(dk, dk_acc, b, hk, key0, n_k, d, scale, tid % 32)
        store_dv(dv, dv_acc, b, hk, key0, n_k, d_v, float32(1.0), tid % 32)

    return check_parameters(wgmma_dkdv, tuple(a[0] for a in MMA_DKDV_ARGS))


def make_q_gradients(spec):
    """(probabilities, add_dq): flash_mma's scale and mask and flash_mma_bwd's q
    probabilities over a tile of KEYS keys, NB_PART n-blocks at a time (P in place of S, dS
    in place of dP), and dQ += dS K for the stage at word `at` (one group of wgmma, waited
    for here: the stage is free once it returns)."""
    READS = spec.reads_mask
    scale_and_mask = make_scale_and_mask(make_masked_score({"HAS_MASK": READS}), READS)
    part = make_q_probabilities(NB_PART, float32(1.0))
    _, mma_regs_mn, pack = instructions(spec)
    issue_dq = make_pv(spec.d, mma_regs_mn, pack, KEYS)  # dQ += dS K, K MN-major
    assert KEYS == 2 * 8 * NB_PART == 2 * BLOCK_N

    @kernel_part
    def probabilities(s, dp, lse_r, delta_r, qk_scale, mask, bias, mask_steps, bias_steps, b,
                      h, row0, start_n, lo, hi, interior, whole_rows, n_q, read_mask,
                      read_bias, lane):
        scale_and_mask(s[:NB_PART], qk_scale, mask, bias, mask_steps, bias_steps, b, h, row0,
                       start_n, lo, hi, interior, whole_rows, n_q, read_mask, read_bias, lane)
        scale_and_mask(s[NB_PART:], qk_scale, mask, bias, mask_steps, bias_steps, b, h, row0,
                       start_n + BLOCK_N, lo, hi, interior, whole_rows, n_q, read_mask,
                       read_bias, lane)
        part(s[:NB_PART], dp[:NB_PART], lse_r, delta_r)
        part(s[NB_PART:], dp[NB_PART:], lse_r, delta_r)

    @kernel_part
    def add_dq(words, at, dp, dq_acc):
        dq_new = issue_dq(words, at, dp, dq_acc)
        warpgroup.wgmma_wait(0)
        warpgroup.fragment_store(dq_acc, dq_new)

    return probabilities, add_dq


def dq_kernel_source(spec):
    """The dQ kernel of variant `spec` as a Python function, with flash_mma_bwd's dq
    arguments (MMA_DQ_ARGS): one block per 64 query rows, key tiles of KEYS."""
    spec.check()
    D, DV, lay = spec.d, spec.dv, spec.layout
    STAGES_AT, STAGE, Q_AT, DO_AT, V_AT = (lay[n] for n in (
        "stages_at", "stage", "q_at", "do_at", "v_at"))
    NB, DB = KEYS // 8, D // 8  # n-blocks of S, of dQ
    copy_block = make_copy_pair(BLOCK, D, DV, DO_AT - Q_AT)  # Q and dO
    copy_step = make_copy_pair(KEYS, D, DV, V_AT)  # K and V
    scores = make_score_pair(spec, KEYS)
    probabilities, add_dq = make_q_gradients(spec)
    READS, walk = spec.reads_mask, make_tile_walk(spec.has_mask, KEYS)
    walk_range, tile_start, reads_mask, WALK_STEP = (walk.walk_range, walk.tile_start,
                                                     walk.reads_mask, walk.STEP)
    store_dq = make_store_rows(D, CONVERTERS[spec.grads_dtype][1])

    def wgmma_dq(q, k, v, mask, visible, bias, kv_lengths, dout, lse_in, delta, k_flags,
                 q_flags, deferred, factors, dq, n_q, group, qk_scale, scale, left, right,
                 bottom_right, mask_steps, bias_steps):
        words = cuda.shared.array(0, uint32)  # dynamic: layout's words
        s = cuda.local.array((NB, 4), float32)  # S, then P
        dp = cuda.local.array((NB, 4), float32)  # dP, then dS
        dq_acc = cuda.local.array((DB, 4), float32)
        lse_r = cuda.local.array(2, float32)  # rows g and g + 8: lse (log2 units), delta
        delta_r = cuda.local.array(2, float32)
        lo = cuda.local.array(2, int64)  # each row's visible keys lo <= j < hi
        hi = cuda.local.array(2, int64)

        tid = cuda.threadIdx.x
        base = warpgroup.aligned_index(words, GROUP_BYTES)  # the swizzle's alignment
        heads_q, heads_k, n_k = q.shape[1], k.shape[1], k.shape[2]
        d, d_v = q.shape[3], v.shape[3]
        bh, rank = grid_order(right >= 0)  # as flash_mma_bwd's (schedule.launch_order)
        b, h = bh // heads_q, bh % heads_q
        tile = cuda.gridDim.x - 1 - rank
        start_m = tile * BLOCK
        row0 = start_m + tid // 32 * 16 + tid % 32 // 4  # the thread's rows: row0, row0 + 8
        kv_len = int64(kv_lengths[b])
        zero(dq_acc)
        init_dq_rows(lse_r, delta_r, lo, hi, lse_in, delta, b, h, row0, n_q, kv_len, left,
                     right, bottom_right, float32(1.0))
        first, last, lo_last, hi_first = key_tiles(
            start_m, min(start_m + BLOCK, n_q) - 1, n_q, kv_len, left, right, bottom_right, 0,
            1, KEYS, KEYS)
        cb, ch = b * mask_steps[0], h * mask_steps[1]  # this block's visible list
        biased = READS and bias_given(bias, bias_steps)
        t0, t1 = walk_range(visible, cb, ch, tile, first, last)  # tiles no row sees: none
        if deferred_block(deferred, b, h, tile, k_flags, k_flags, h // group, 1, first,
                          last - 1, tid, False):
            return  # a K tile holds a NaN or an inf: flash_mma_bwd's nonfinite variant
        kv_at = (int64(b) * heads_k + h // group) * n_k
        copy_block(words, base + Q_AT, q, dout, (int64(b) * heads_q + h) * n_q, start_m, n_q,
                   d, d_v)
        start_n = tile_start(visible, cb, ch, tile, t0, t1, last)
        if start_n < last:  # the first key tile, into stage 0 (zeros past the band)
            copy_step(words, base + STAGES_AT, k, v, kv_at, start_n, last, d, d_v)
        stage = 0
        for t in range(t0, t1, WALK_STEP):
            start_n = tile_start(visible, cb, ch, tile, t, t1, last)
            following = tile_start(visible, cb, ch, tile, t + WALK_STEP, t1, last)
            stage_landed()  # this tile, Q and dO; the other stage free
            if following < last:  # the next key tile, into the other stage
                copy_step(words, base + STAGES_AT + (1 - stage) * STAGE, k, v, kv_at,
                          following, last, d, d_v)
            at = base + STAGES_AT + stage * STAGE
            scores(words, base + Q_AT, at, base + DO_AT, at + V_AT, s, dp)  # S, dP
            probabilities(s, dp, lse_r, delta_r, qk_scale, mask, bias, mask_steps,
                          bias_steps, b, h, row0, start_n, lo, hi,
                          start_n >= lo_last and start_n + KEYS <= hi_first,
                          start_m + BLOCK <= n_q, n_q,
                          READS and reads_mask(visible, cb, ch, tile, t), biased, tid % 32)
            add_dq(words, at, dp, dq_acc)
            stage = 1 - stage
        warp.cp_async_wait(0)  # no copy outlives the block (where no tile was walked)
        store_dq(dq, dq_acc, b, h, row0, n_q, d, scale, tid % 32)

    return check_parameters(wgmma_dq, tuple(a[0] for a in MMA_DQ_ARGS))


@lru_cache(maxsize=16)
def wgmma_bwd_kernel(spec):
    """The compiled kernel of a variant (through the on-disk compile cache)."""
    return jit(wgmma_bwd_source(spec), ("wgmma-bwd",) + astuple(spec), FASTMATH)


def wgmma_bwd_source(spec):
    """The Python function of any variant (for compile_ptx)."""
    return (dkdv_kernel_source if spec.part == "dkdv" else dq_kernel_source)(spec)
