"""The FlashAttention-2 forward on Hopper's warpgroup tensor cores (sm_90a): flash_mma.py's
algorithm and parts, with S = Q K^T and O += P V each one chain of wgmma.mma_async
(warpgroup.py) over a whole tile instead of mma.sync by warp. One warpgroup (128 threads) a
block for 64 query rows, as flash_mma's 4 warps: the accumulators hold the rows its warps
hold, so the online softmax, the masks and the stores are flash_mma's own. Key tiles of
KEYS, float16 and bfloat16.

Shared memory: Q (64 x D) once, and in each of two stages a K tile (KEYS x D) and a V tile
(KEYS x Dv), all three as they are in global memory, row by row, in the 128-byte swizzle
(warpgroup.SWIZZLE: a tile is blocks of 64 columns, a block rows of 128 bytes, the 16-byte
chunk c of row r at chunk c ^ (r % 8)), copied by cp.async: a warp reads whole rows and
stores without bank conflicts. Q and K are A and B "K-major" (the head dim along K); V is
P V's B "MN-major" (Dv along N, the keys along K: wgmma's transpose flag), so no tile is
transposed.

Per key tile j: wait for its K copy (and the previous tile's V), a fence for the async
proxy, a barrier; K(j + 1)'s copy begins into the other stage; S(j) is issued (D / 16
products, Q and K through descriptors), then O += P(j - 1) V(j - 1) (KEYS / 16 products, P
from the registers S(j - 1) left it in, converted to 16 bits: mma.sync's A fragment by warp,
warpgroup.a_fragments); S(j) alone is waited for, and its scale, mask and online softmax
run while P V is on the tensor cores; then P V is waited for, O rescaled, and V(j + 1)'s
copy begins into the stage P V has read. The last tile's P V follows the loop. This is the
fast variant only: a block whose rows end non-finite is flagged in `deferred` and
flash_mma's careful variant does it again, as after flash_mma's fast one.
docs/design/hopper.md says what comes next (TMA, warp specialization, pingpong).
"""
from dataclasses import astuple, dataclass
from functools import lru_cache

from numba import cuda

from . import warp, warpgroup
from .block_sparse import make_tile_walk
from .common import FASTMATH, bias_given, check_parameters, kernel_part, make_masked_score
from .compile_cache import jit
from .convert import CONVERTERS, float32, int64, uint32
from .flash_mma import (MMA_ARG_NAMES, ONE, hand_over, head_bases, make_acc_finite,
                        make_init_rows, make_rescale, make_row_update, make_store_out,
                        make_this_block)
from .mma_parts import (BLOCK_M, BLOCK_N, MMA_DTYPES, MMA_WIDTHS, TensorCoreVariant,
                        make_copy_tile, make_scale_and_mask)
from .schedule import key_tiles

KEYS = 64  # keys a tile: S is one m64n64 accumulator, 32 floats a thread
SWIZZLE = warpgroup.SWIZZLE  # the layout of every tile (a literal for the descriptors)
ROW_WORDS = SWIZZLE // 4  # a swizzled row, in 32-bit words
GROUP_BYTES = 8 * SWIZZLE  # 8 rows: the swizzle's period, SBO along rows
ALIGN_WORDS = GROUP_BYTES // 4  # room to align the tiles to it
K_MAJOR_LBO = 16  # unread: a step's 32 bytes of K lie within one swizzled row
WGMMA_CC = (9, 0, "a")  # wgmma exists on sm_90a alone


class WgmmaVariant(TensorCoreVariant):
    """What a wgmma kernel's variant (WgmmaSpec, flash_wgmma_bwd's WgmmaBwdSpec: dataclasses
    with a layout property) adds: sm_90a, and its tiles in dynamic shared memory."""

    @property
    def cc(self):
        """The compute capability the variant compiles for (the PTX gate's)."""
        return WGMMA_CC

    @property
    def dynamic_shared_bytes(self):
        """Bytes of dynamic shared memory a launch passes (above 48 KB)."""
        return 4 * self.layout["words"]


@dataclass(frozen=True)
class WgmmaSpec(WgmmaVariant):
    """One compiled variant: padded head dims, input dtype (16-bit), whether it walks
    visible lists and reads a mask or bias, whether out is float32 partials (split-KV, or
    float32_out), whether every listed tile is FULL (full_tiles: a block mask alone, as
    flash_mma's MmaSpec.full_tiles: the lists are walked, no mask or bias is read)."""

    d: int
    dv: int
    dtype: str
    has_mask: bool
    partial: bool = False
    full_tiles: bool = False

    def check(self):
        if self.d not in MMA_WIDTHS or self.dv not in MMA_WIDTHS:
            raise ValueError(f"WgmmaSpec: d and dv must be in {MMA_WIDTHS}, got {self}")
        if self.dtype not in MMA_DTYPES:
            raise ValueError(f"WgmmaSpec: dtype must be one of {MMA_DTYPES}, got "
                             f"{self.dtype!r}")
        if self.full_tiles and not self.has_mask:
            raise ValueError(f"WgmmaSpec: full_tiles walks a mask's lists: has_mask, got "
                             f"{self}")
        return self

    @property
    def layout(self):
        """Where the shared tiles start, in 32-bit words after the 1024-byte aligned start:
        Q (`q_at`), stage s's K tile (`k_at` + s `stage`) and V tile (`v_at` + s `stage`);
        the total `words`, with room to align."""
        q_words, k_words, v_words = (BLOCK_M * self.d // 2, KEYS * self.d // 2,
                                     KEYS * self.dv // 2)
        return dict(q_at=0, k_at=q_words, v_at=q_words + k_words, stage=k_words + v_words,
                    words=q_words + 2 * (k_words + v_words) + ALIGN_WORDS)


def wgmma_specs():
    """Every variant the PTX report compiles."""
    return [WgmmaSpec(d, dv, dtype, m, p, full).check() for d in MMA_WIDTHS
            for dv in MMA_WIDTHS for dtype in MMA_DTYPES for m in (False, True)
            for p in (False, True) for full in ((False, True) if m else (False,))]


def make_scores(D, mma, A_ROWS=BLOCK_M, B_ROWS=KEYS):
    """issue_scores for A (A_ROWS = 64 rows) B^T (B_ROWS rows), both D wide: the forward's
    S = Q K^T, the backward's S^T = K Q^T and dP^T = V dO^T (flash_wgmma_bwd.py)."""
    FLOATS = B_ROWS // 2  # the accumulator's, a thread (a literal for the intrinsics)
    A_BLOCK, B_BLOCK = A_ROWS * ROW_WORDS, B_ROWS * ROW_WORDS  # words: 64 columns of each
    assert A_ROWS == 64  # wgmma's M

    @kernel_part
    def issue_scores(words, a_at, b_at):
        """Issues A B^T (S = Q K^T) as one group of D / 16 products, A and B through
        swizzled K-major descriptors, step kk 32 bytes into its block's rows; returns the
        accumulator, the product once the group is waited for."""
        acc = warpgroup.accumulator(FLOATS)
        warpgroup.wgmma_fence()
        for kk in range(D // 16):
            step = 8 * (kk % 4)  # words: 16 values of K
            acc = mma(warpgroup.descriptor(words, a_at + kk // 4 * A_BLOCK + step, K_MAJOR_LBO,
                                           GROUP_BYTES, SWIZZLE),
                      warpgroup.descriptor(words, b_at + kk // 4 * B_BLOCK + step, K_MAJOR_LBO,
                                           GROUP_BYTES, SWIZZLE), acc)
        warpgroup.wgmma_commit()
        return acc

    return issue_scores


def make_pv(DV, mma_regs_mn, pack, ROWS=KEYS):
    """issue_pv for P (64 x ROWS, from registers) V (ROWS rows, DV wide): the forward's
    O += P V, the backward's dV += P^T dO and dK += dS^T Q (flash_wgmma_bwd.py)."""
    V_LBO = ROWS * SWIZZLE  # bytes: V's next 64 columns (N)
    STEP_WORDS = 16 * ROW_WORDS  # 16 rows of V (keys): a step of K
    FLOATS = DV // 2  # the accumulator's, a thread (a literal for the intrinsics)

    @kernel_part
    def issue_pv(words, v_at, s, o):
        """Issues o + P V as one group of ROWS / 16 products, P from s (16-bit, A registers:
        n-blocks 2 n2 and 2 n2 + 1 as mma.sync's A fragment), V (B) MN-major through
        swizzled descriptors; returns the accumulator, o + P V once the group is waited
        for. Until then neither o's values nor V's tile may change."""
        acc = warpgroup.fragment_tuple(o, FLOATS)
        warpgroup.wgmma_fence()
        for n2 in range(ROWS // 16):
            p = (pack(s[2 * n2, 0], s[2 * n2, 1]), pack(s[2 * n2, 2], s[2 * n2, 3]),
                 pack(s[2 * n2 + 1, 0], s[2 * n2 + 1, 1]),
                 pack(s[2 * n2 + 1, 2], s[2 * n2 + 1, 3]))
            acc = mma_regs_mn(p, warpgroup.descriptor(words, v_at + n2 * STEP_WORDS, V_LBO,
                                                      GROUP_BYTES, SWIZZLE), acc)
        warpgroup.wgmma_commit()
        return acc

    return issue_pv


def make_issue_tile(issue_scores, issue_pv, FLOATS):
    @kernel_part
    def issue_tile(words, q_at, k_at, v_at, s, acc, pending):
        """Issues S = Q K^T of this tile, then, where `pending`, the previous tile's O += P V
        (P in s, V at v_at), and waits for S alone: P V runs on under the softmax. Returns
        the accumulators (S, done; O, to wait for: acc itself where nothing is pending)."""
        s_acc = issue_scores(words, q_at, k_at)
        if pending:
            o_acc = issue_pv(words, v_at, s, acc)
            warpgroup.wgmma_wait(1)  # S's group, the older, is done
        else:
            o_acc = warpgroup.fragment_tuple(acc, FLOATS)
            warpgroup.wgmma_wait(0)
        return s_acc, o_acc

    return issue_tile


def make_last_pv(issue_pv):
    @kernel_part
    def last_pv(words, v_at, s, acc):
        """O += P V of the last tile walked (its V copy waited for by this thread)."""
        warpgroup.fence_proxy_async()
        cuda.syncthreads()  # Barrier: every thread's copies of V are visible
        o_acc = issue_pv(words, v_at, s, acc)
        warpgroup.wgmma_wait(0)
        warpgroup.fragment_store(acc, o_acc)

    return last_pv


def make_copy_stage(WIDTH, AT, STAGE):
    copy = make_copy_tile(KEYS, WIDTH, ROW_WORDS, SWIZZLED=True)

    @kernel_part
    def copy_stage(words, base, x, x_base, start, n, width, stage, copying):
        """Where `copying`, keys start .. start + KEYS of K or V into `stage`; one group of
        copies either way (empty without), so that every tile commits the same groups."""
        if copying:
            copy(words, base + AT + stage * STAGE, x, x_base, start, n, width)
        warp.cp_async_commit()

    return copy_stage


def make_tile_softmax(spec):
    READS, NB_HALF = spec.reads_mask, BLOCK_N // 8
    scale_and_mask = make_scale_and_mask(make_masked_score({"HAS_MASK": READS}), READS)
    row_update = make_row_update(KEYS // 8)
    reads_mask = make_tile_walk(spec.has_mask, KEYS).reads_mask
    assert KEYS == 2 * BLOCK_N

    @kernel_part
    def tile_softmax(s, m_i, l_i, qk_scale, mask, bias, mask_steps, bias_steps, b, h, row0,
                     start_n, lo, hi, lo_last, hi_first, whole_rows, n_q, visible, cb, ch,
                     tile, t, biased, lane):
        """S of the tile at start_n (walk step t) scaled and masked by flash_mma's parts,
        its two tiles of BLOCK_N keys one after the other (one loop over the 32 elements of
        s would not be unrolled, and s would live in local memory); then P = exp2(S - m_new)
        in its place, the rows' max and sum updated; returns the rows' alphas for acc."""
        interior = start_n >= lo_last and start_n + KEYS <= hi_first  # all rows see it
        read_mask = READS and reads_mask(visible, cb, ch, tile, t)
        scale_and_mask(s[:NB_HALF], qk_scale, mask, bias, mask_steps, bias_steps, b, h, row0,
                       start_n, lo, hi, interior, whole_rows, n_q, read_mask, biased, lane)
        scale_and_mask(s[NB_HALF:], qk_scale, mask, bias, mask_steps, bias_steps, b, h, row0,
                       start_n + BLOCK_N, lo, hi, interior, whole_rows, n_q, read_mask,
                       biased, lane)
        return row_update(s, m_i, l_i, 0, False), row_update(s, m_i, l_i, 1, False)

    return tile_softmax


def kernel_source(spec):
    """The kernel for variant `spec` as a Python function (for cuda.jit or compile_ptx);
    flash_mma's arguments (MMA_ARG_NAMES), of which it reads no float32 flags or factors."""
    spec.check()
    D, DV, lay = spec.d, spec.dv, spec.layout
    NB, VB, FLOATS = KEYS // 8, DV // 8, DV // 2
    Q_AT, K_AT, V_AT, STAGE = (lay[x] for x in ("q_at", "k_at", "v_at", "stage"))
    if spec.dtype == "float16":
        mma, mma_regs_mn, pack = (warpgroup.mma_async_f16, warpgroup.mma_async_regs_mn_f16,
                                  warp.pack_f16)
    else:
        mma, mma_regs_mn, pack = (warpgroup.mma_async_bf16, warpgroup.mma_async_regs_mn_bf16,
                                  warp.pack_bf16)
    copy_q = make_copy_tile(BLOCK_M, D, ROW_WORDS, SWIZZLED=True)
    copy_k, copy_v = make_copy_stage(D, K_AT, STAGE), make_copy_stage(DV, V_AT, STAGE)
    issue_pv = make_pv(DV, mma_regs_mn, pack)
    issue_tile = make_issue_tile(make_scores(D, mma), issue_pv, FLOATS)
    last_pv = make_last_pv(issue_pv)
    this_block, init_rows = make_this_block(False), make_init_rows(VB)
    walk = make_tile_walk(spec.has_mask, KEYS)
    walk_steps, step_tile, WALK_STEP = walk.walk_steps, walk.step_tile, walk.STEP
    tile_softmax, rescale = make_tile_softmax(spec), make_rescale(VB)
    READS, acc_finite = spec.reads_mask, make_acc_finite(VB)
    store_out = make_store_out(DV, CONVERTERS["float32" if spec.partial else spec.dtype][1])

    def flash_wgmma(q, k, v, mask, visible, bias, kv_lengths, q_flags, k_flags, factors,
                    deferred, out, lse, n_q, d, d_v, group, heads_q, n_splits, split_keys,
                    qk_scale, left, right, bottom_right, mask_steps, bias_steps):
        words = cuda.shared.array(0, uint32)  # dynamic: layout's words
        s = cuda.local.array((NB, 4), float32)  # S, then P, of the thread's fragment
        acc = cuda.local.array((VB, 4), float32)  # running sum of exp2(s - m_i) * v
        m_i = cuda.local.array(2, float32)  # running max, rows g and g + 8
        l_i = cuda.local.array(2, float32)  # this thread's part of sum exp2(s - m_i)
        lo = cuda.local.array(2, int64)  # each row's visible keys lo <= j < hi
        hi = cuda.local.array(2, int64)

        tid = cuda.threadIdx.x
        lane = tid % 32
        base = warpgroup.aligned_index(words, GROUP_BYTES)  # the swizzle's alignment
        b, h, tile, split, ob = this_block(heads_q, kv_lengths.shape[0], right)
        q_base, k_base, v_base = head_bases(b, h, h // group, heads_q, k, n_q, d, d_v)
        start_m = tile * BLOCK_M
        row0 = start_m + tid // 32 * 16 + lane // 4  # the thread's rows: row0 and row0 + 8
        kv_len = int64(kv_lengths[b])
        first, last, lo_last, hi_first = key_tiles(
            start_m, min(start_m + BLOCK_M, n_q) - 1, n_q, kv_len, left, right, bottom_right,
            split, n_splits, split_keys, KEYS)
        cb, ch = b * mask_steps[0], h * mask_steps[1]  # this block's visible list
        biased = READS and bias_given(bias, bias_steps)
        t0, t_end = walk_steps(visible, cb, ch, tile, first, last)
        start_n = step_tile(visible, cb, ch, tile, t0)  # past last where there is no step
        init_rows(m_i, l_i, acc, lo, hi, row0, n_q, kv_len, left, right, bottom_right)
        copy_q(words, base + Q_AT, q, q_base, start_m, n_q, d)  # with K's first tile:
        copy_k(words, base, k, k_base, start_n, last, d, 0, start_n < last)  # one group
        copy_v(words, base, v, v_base, start_n, last, d_v, 0, start_n < last)
        stage, pending = 0, False  # pending: the previous tile's P V is still to be done
        for t in range(t0, t_end, WALK_STEP):
            if start_n >= last:
                break  # the band ends before the list
            warp.cp_async_wait(1)  # this thread's copies of Q, this K tile, the last V's
            warpgroup.fence_proxy_async()  # visible to wgmma's reads
            cuda.syncthreads()  # Barrier: every thread's are; K's other stage is free.
            following = step_tile(visible, cb, ch, tile, t + WALK_STEP)  # or the sentinel
            copy_k(words, base, k, k_base, following, last, d, 1 - stage, following < last)
            s_acc, o_acc = issue_tile(words, base + Q_AT, base + K_AT + stage * STAGE,
                                      base + V_AT + (1 - stage) * STAGE, s, acc, pending)
            warpgroup.fragment_store(s, s_acc)
            alpha0, alpha1 = tile_softmax(s, m_i, l_i, qk_scale, mask, bias, mask_steps,
                                          bias_steps, b, h, row0, start_n, lo, hi, lo_last,
                                          hi_first, start_m + BLOCK_M <= n_q, n_q, visible,
                                          cb, ch, tile, t, biased, lane)
            warpgroup.wgmma_wait(0)  # the previous P V: acc, and V's other stage, free
            warpgroup.fragment_store(acc, o_acc)
            rescale(acc, alpha0, alpha1)
            copy_v(words, base, v, v_base, following, last, d_v, 1 - stage, following < last)
            stage, pending, start_n = 1 - stage, True, following
        warp.cp_async_wait(0)  # the last V tile (or Q, where no tile was walked)
        if pending:  # the last tile's O += P V
            last_pv(words, base + V_AT + (1 - stage) * STAGE, s, acc)
        # a row that ended non-finite: flash_mma's careful variant does the block
        if hand_over(deferred, ob, h, tile, cuda.syncthreads_or(0 if acc_finite(acc) else 1),
                     tid):
            return
        store_out(out, lse, m_i, l_i, acc, ob, h, row0, n_q, d_v, ONE, lane)

    return check_parameters(flash_wgmma, MMA_ARG_NAMES)


@lru_cache(maxsize=32)
def wgmma_kernel(spec):
    """The compiled kernel of a variant (through the on-disk compile cache)."""
    return jit(kernel_source(spec), ("wgmma",) + astuple(spec), FASTMATH)
