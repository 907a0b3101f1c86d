"""The FlashAttention-2 forward on Hopper's warpgroup tensor cores (sm_90a): flash_mma.py's
algorithm and parts, with S = Q K^T and O += P V each one chain of wgmma.mma_async
(warpgroup.py) over a whole tile instead of mma.sync by warp. One warpgroup (128 threads) a
block for 64 query rows, as flash_mma's 4 warps: the accumulators hold the rows its warps
hold, so the online softmax, the masks and the stores are flash_mma's own. Key tiles of
KEYS, float16 and bfloat16.

Shared memory, in wgmma's layout without swizzle (core matrices of 8 rows by 16 bytes, 128
contiguous bytes each, warpgroup.operand_address):
- Q (64 x D) and a K tile (KEYS x D) in each of two stages, copied by cp.async straight into
  core matrices: A and B "K-major", the head dim along K;
- V^T (Dv x KEYS): P V's B operand has the keys along K, which V's rows are not; V's tile is
  copied as it is (rows of Dv + PAD values) and each warp turns its 8 x 8 pieces into V^T's
  core matrices with ldmatrix.trans, whose registers are a core matrix's 32 words in lane
  order.

Per key tile: wait for its copies, V^T from V, a barrier; the next tile's copies begin; S by
D / 16 products (Q and K through descriptors); the scale, the mask and the online softmax
on S's fragments; O += P V by KEYS / 16 products, P from the registers S left it in
(converted to 16 bits: mma.sync's A fragment by warp, warpgroup.a_fragments). This is the
fast variant only: a block whose rows end non-finite is flagged in `deferred` and flash_mma's
careful variant does it again, as after flash_mma's fast one. docs/design/hopper.md says
what comes next (TMA, warp specialization, pingpong).
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
                        make_init_rows, make_online_softmax, make_store_out, make_this_block)
from .mma_parts import (BLOCK_M, BLOCK_N, MMA_DTYPES, MMA_WIDTHS, PAD, THREADS, make_copy_tile,
                        make_scale_and_mask)
from .schedule import key_tiles

KEYS = 64  # keys a tile: S is one m64n64 accumulator, 32 floats a thread
CORE_WORDS = 32  # a core matrix: 8 rows of 16 bytes
LBO = 128  # core matrices adjacent along K: 128 bytes apart
WGMMA_CC = (9, 0, "a")  # wgmma exists on sm_90a alone


@dataclass(frozen=True)
class WgmmaSpec:
    """One compiled variant: padded head dims, input dtype (16-bit), whether it reads a mask
    or bias, whether out is float32 partials (split-KV, or float32_out)."""

    d: int
    dv: int
    dtype: str
    has_mask: bool
    partial: bool = False

    def check(self):
        if self.d not in MMA_WIDTHS or self.dv not in MMA_WIDTHS:
            raise ValueError(f"WgmmaSpec: d and dv must be in {MMA_WIDTHS}, got {self}")
        if self.dtype not in MMA_DTYPES:
            raise ValueError(f"WgmmaSpec: dtype must be one of {MMA_DTYPES}, got "
                             f"{self.dtype!r}")
        return self

    @property
    def halves(self):
        """Never float32 as halves (specs.mma_signature asks)."""
        return False

    @property
    def cc(self):
        """The compute capability the variant compiles for (the PTX gate's)."""
        return WGMMA_CC

    @property
    def layout(self):
        """Where the shared tiles start, in 32-bit words after the 128-byte aligned start:
        Q (`q_at`), each stage's K tile (`k_at` + stage * `stage`), V^T (`vt_at`), V as
        copied (`v_at`, rows of `v_row` words); the total `words` (with room to align)."""
        q_words, k_words = BLOCK_M * self.d // 2, KEYS * self.d // 2
        v_row = (self.dv + PAD) // 2
        vt_at = q_words + 2 * k_words
        v_at = vt_at + KEYS * self.dv // 2
        return dict(q_at=0, k_at=q_words, stage=k_words, vt_at=vt_at, v_at=v_at, v_row=v_row,
                    words=v_at + KEYS * v_row + CORE_WORDS)

    @property
    def dynamic_shared_bytes(self):
        """Bytes of dynamic shared memory a launch passes (above 48 KB at D = 128)."""
        return 4 * self.layout["words"]


def wgmma_specs():
    """Every variant the PTX report compiles."""
    return [WgmmaSpec(d, dv, dtype, m, p).check() for d in MMA_WIDTHS for dv in MMA_WIDTHS
            for dtype in MMA_DTYPES for m in (False, True) for p in (False, True)]


def make_copy_cores(ROWS, WIDTH):
    CHUNKS = WIDTH // 8  # 16-byte pieces a row: core matrices along K
    ITEMS = ROWS * CHUNKS

    @kernel_part
    def copy_cores(words, at, x, base, start, n, width):
        """Rows start .. start + ROWS of the (n, width) matrix at flat element `base` of x
        (16-bit, C-contiguous) to the tile at word `at` as core matrices: row r's chunk c
        at core (r // 8) * CHUNKS + c, its row r % 8; zeros past row n and column width.
        Item i of the block is core i // 8's row i % 8, its 16 bytes at word 4 i: a warp
        writes 512 contiguous bytes. Not waited for here."""
        for i in range(cuda.threadIdx.x, ITEMS, THREADS):
            core = i // 8
            row, c = (core // CHUNKS) * 8 + i % 8, core % CHUNKS
            ok = c * 8 < width and start + row < n
            warp.cp_async16(words, at + 4 * i, x, base + (start + row) * width + c * 8
                            if ok else base, 16 if ok else 0)

    return copy_cores


def make_transpose_v(DV, V_ROW):
    PIECES = KEYS // 8 * DV // 32  # ldmatrix.x4 of the tile: 4 core matrices each
    GROUPS = DV // 32  # x4 pieces along Dv, for each 8 keys

    @kernel_part
    def transpose_v(words, v_at, vt_at, lane, w):
        """V^T's core matrices from the V tile at word v_at (rows of V_ROW words) to vt_at:
        core (n // 8, key // 8) at word ((n // 8) (KEYS / 8) + key // 8) * 32, its row n % 8
        the keys of column n. Matrix m of an ldmatrix.x4.trans is keys 8 kb .., columns
        8 (c0 + m) .., which lane 4 i + j holds as column i's keys 2 j, 2 j + 1: word
        4 i + j of the core matrix, so the warp stores 32 contiguous words a matrix."""
        for piece in range(w, PIECES, 4):
            kb, c0 = piece // GROUPS, piece % GROUPS * 4
            r0, r1, r2, r3 = warp.ldmatrix_x4_trans(
                words, v_at + (8 * kb + lane % 8) * V_ROW + 4 * (c0 + lane // 8))
            at = vt_at + (c0 * (KEYS // 8) + kb) * CORE_WORDS + lane
            step = KEYS // 8 * CORE_WORDS  # the next 8 columns
            words[at] = r0
            words[at + step] = r1
            words[at + 2 * step] = r2
            words[at + 3 * step] = r3

    return transpose_v


def make_scores(D, mma):
    SBO = 16 * D  # the next 8 rows: after the row's D / 8 core matrices
    FLOATS = KEYS // 2  # the accumulator's, a thread (a literal for the intrinsics)

    @kernel_part
    def scores(words, q_at, k_at, s):
        """S = Q K^T into the fragment array s (KEYS / 8, 4): D / 16 products, Q (A) and K
        (B) through descriptors, step kk's two core matrices along K 256 bytes in."""
        acc = warpgroup.accumulator(FLOATS)
        warpgroup.wgmma_fence()
        for kk in range(D // 16):
            acc = mma(warpgroup.descriptor(words, q_at + 64 * kk, LBO, SBO, 0),
                      warpgroup.descriptor(words, k_at + 64 * kk, LBO, SBO, 0), acc)
        warpgroup.wgmma_commit()
        warpgroup.wgmma_wait(0)
        warpgroup.fragment_store(s, acc)

    return scores


def make_pv(DV, mma_regs, pack):
    SBO = 16 * KEYS  # V^T: the next 8 columns of V after KEYS / 8 core matrices
    FLOATS = DV // 2  # the accumulator's, a thread (a literal for the intrinsics)

    @kernel_part
    def pv(words, vt_at, s, o):
        """o += P V: KEYS / 16 products, P from s (16-bit, A registers: n-blocks 2 n2 and
        2 n2 + 1 as mma.sync's A fragment), V^T (B) through descriptors."""
        acc = warpgroup.fragment_tuple(o, FLOATS)
        warpgroup.wgmma_fence()
        for n2 in range(KEYS // 16):
            p = (pack(s[2 * n2, 0], s[2 * n2, 1]), pack(s[2 * n2, 2], s[2 * n2, 3]),
                 pack(s[2 * n2 + 1, 0], s[2 * n2 + 1, 1]),
                 pack(s[2 * n2 + 1, 2], s[2 * n2 + 1, 3]))
            acc = mma_regs(p, warpgroup.descriptor(words, vt_at + 64 * n2, LBO, SBO, 0), acc)
        warpgroup.wgmma_commit()
        warpgroup.wgmma_wait(0)
        warpgroup.fragment_store(o, acc)

    return pv


def make_copy_tiles(spec):
    lay = spec.layout
    copy_k, copy_v = make_copy_cores(KEYS, spec.d), make_copy_tile(KEYS, spec.dv, lay["v_row"])
    K_AT, STAGE, V_AT = lay["k_at"], lay["stage"], lay["v_at"]

    @kernel_part
    def copy_tiles(words, base, k, v, k_base, v_base, start, n, d, d_v, stage):
        """Keys start .. start + KEYS: K's tile into `stage`, V's as it is (one group)."""
        copy_k(words, base + K_AT + stage * STAGE, k, k_base, start, n, d)
        copy_v(words, base + V_AT, v, v_base, start, n, d_v)
        warp.cp_async_commit()

    return copy_tiles


def kernel_source(spec):
    """The kernel for variant `spec` as a Python function (for cuda.jit or compile_ptx);
    flash_mma's arguments (MMA_ARG_NAMES), of which it reads no float32 flags or factors."""
    spec.check()
    D, DV, lay = spec.d, spec.dv, spec.layout
    NB, VB = KEYS // 8, DV // 8
    Q_AT, K_AT, STAGE, VT_AT, V_AT = (lay[x] for x in ("q_at", "k_at", "stage", "vt_at", "v_at"))
    READS = spec.has_mask
    if spec.dtype == "float16":
        mma, mma_regs, pack = warpgroup.mma_async_f16, warpgroup.mma_async_regs_f16, warp.pack_f16
    else:
        mma, mma_regs, pack = (warpgroup.mma_async_bf16, warpgroup.mma_async_regs_bf16,
                               warp.pack_bf16)
    copy_q, copy_tiles = make_copy_cores(BLOCK_M, D), make_copy_tiles(spec)
    transpose_v = make_transpose_v(DV, lay["v_row"])
    scores, pv = make_scores(D, mma), make_pv(DV, mma_regs, pack)
    this_block, init_rows = make_this_block(False), make_init_rows(VB)
    walk = make_tile_walk(spec.has_mask, KEYS)
    walk_steps, step_tile, reads_mask, WALK_STEP = (walk.walk_steps, walk.step_tile,
                                                     walk.reads_mask, walk.STEP)
    scale_and_mask = make_scale_and_mask(make_masked_score({"HAS_MASK": spec.has_mask}),
                                         spec.has_mask)
    NB_HALF = BLOCK_N // 8
    assert KEYS == 2 * BLOCK_N
    online_softmax, acc_finite = make_online_softmax(NB, VB), make_acc_finite(VB)
    store_out = make_store_out(DV, CONVERTERS["float32" if spec.partial else spec.dtype][1])

    def flash_wgmma(q, k, v, mask, visible, bias, kv_lengths, q_flags, k_flags, factors,
                    deferred, out, lse, n_q, d, d_v, group, heads_q, split_len, qk_scale, left,
                    right, bottom_right, mask_steps, bias_steps):
        words = cuda.shared.array(0, uint32)  # dynamic: layout's words
        s = cuda.local.array((NB, 4), float32)  # S, then P, of the thread's fragment
        acc = cuda.local.array((VB, 4), float32)  # running sum of exp2(s - m_i) * v
        m_i = cuda.local.array(2, float32)  # running max, rows g and g + 8
        l_i = cuda.local.array(2, float32)  # this thread's part of sum exp2(s - m_i)
        lo = cuda.local.array(2, int64)  # each row's visible keys lo <= j < hi
        hi = cuda.local.array(2, int64)

        tid = cuda.threadIdx.x
        w, lane = tid // 32, tid % 32
        base = warpgroup.aligned_index(words, 128)
        b, h, tile, split, ob = this_block(heads_q, kv_lengths.shape[0], right)
        hk = h // group  # grouped-query attention: query head h reads key head h // group
        q_base, k_base, v_base = head_bases(b, h, hk, heads_q, k, n_q, d, d_v)
        start_m = tile * BLOCK_M
        whole_rows = start_m + BLOCK_M <= n_q
        row0 = start_m + w * 16 + lane // 4  # the thread's rows: row0 and row0 + 8
        kv_len = int64(kv_lengths[b])
        first, last, lo_last, hi_first = key_tiles(
            start_m, min(start_m + BLOCK_M, n_q) - 1, n_q, kv_len, left, right, bottom_right,
            split, split_len, KEYS)
        cb, ch = b * mask_steps[0], h * mask_steps[1]  # this block's visible list
        biased = READS and bias_given(bias, bias_steps)
        t0, t_end = walk_steps(visible, cb, ch, tile, first, last)
        start_n = step_tile(visible, cb, ch, tile, t0)  # past last where there is no step
        init_rows(m_i, l_i, acc, lo, hi, row0, n_q, kv_len, left, right, bottom_right)
        copy_q(words, base + Q_AT, q, q_base, start_m, n_q, d)
        if start_n < last:  # one group: Q and the first key tile, into stage 0
            copy_tiles(words, base, k, v, k_base, v_base, start_n, last, d, d_v, 0)
        warp.cp_async_commit()
        stage = 0
        for t in range(t0, t_end, WALK_STEP):
            if start_n >= last:
                break  # the band ends before the list
            warp.cp_async_wait(0)  # this thread's copies of this tile have landed
            cuda.syncthreads()  # Barrier: every thread's have; V^T and the stages are free.
            transpose_v(words, base + V_AT, base + VT_AT, lane, w)
            warpgroup.fence_proxy_async()  # the copies and V^T, for wgmma's reads
            cuda.syncthreads()  # Barrier: V^T whole; V's tile read.
            following = step_tile(visible, cb, ch, tile, t + WALK_STEP)  # or the sentinel
            if following < last:
                copy_tiles(words, base, k, v, k_base, v_base, following, last, d, d_v,
                           1 - stage)
            scores(words, base + Q_AT, base + K_AT + stage * STAGE, s)  # S = Q K^T
            interior = start_n >= lo_last and start_n + KEYS <= hi_first  # all rows see it
            read_mask = READS and reads_mask(visible, cb, ch, tile, t)
            # flash_mma's tiles of keys, one after the other: one loop over the tile's 32
            # elements of s would not be unrolled, and s would live in local memory
            scale_and_mask(s[:NB_HALF], qk_scale, mask, bias, mask_steps, bias_steps, b, h,
                           row0, start_n, lo, hi, interior, whole_rows, n_q, read_mask,
                           biased, lane)
            scale_and_mask(s[NB_HALF:], qk_scale, mask, bias, mask_steps, bias_steps, b, h,
                           row0, start_n + BLOCK_N, lo, hi, interior, whole_rows, n_q,
                           read_mask, biased, lane)
            online_softmax(s, m_i, l_i, acc, False)
            pv(words, base + VT_AT, s, acc)  # O += P V
            stage = 1 - stage
            start_n = following
        warp.cp_async_wait(0)  # Q, where no tile was walked
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
