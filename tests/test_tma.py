"""tma.py: bulk copies landing on transaction barriers, as a producer warp filling a ring of
two stages for 128 consumer threads (FlashAttention-3's K and V loads in miniature), in the
simulator and on the H200; the kernel assembles for sm_90a; misuse is an error."""
import numpy as np
import pytest
from numba import cuda

from numba_kernels import tma, warpgroup
from numba_kernels.convert import SIMULATOR, uint32, uint64
from tests.assembly import run_compiler_script

CONSUMERS, STAGES, TILE = 128, 2, 128  # a tile: 128 float32, one a consumer
TILE_BYTES, RING_WORDS = TILE * 4, STAGES * TILE


def make_ring():
    """The kernel: warp 4 (threads 128..159) produces, its lane 0 copying tile r of src
    (uint32) into stage r % STAGES once the consumers have released that stage; consumer t
    adds element t of every tile to out[t]."""

    @cuda.jit
    def ring(src, tiles, out):
        words = cuda.shared.array(RING_WORDS, uint32)
        full = cuda.shared.array(STAGES, uint64)  # a stage's tile has landed
        empty = cuda.shared.array(STAGES, uint64)  # every consumer is done with the stage
        t = cuda.threadIdx.x
        if t == 0:
            for s in range(STAGES):
                tma.barrier_init(full, s, 1)
                tma.barrier_init(empty, s, CONSUMERS)
        cuda.syncthreads()
        if t == CONSUMERS:  # the producer
            for r in range(tiles):
                s = r % STAGES
                if r >= STAGES:
                    tma.wait(empty, s, (r // STAGES - 1) % 2)
                tma.arrive_expect_tx(full, s, TILE_BYTES)
                tma.bulk_copy(words, s * TILE, src, r * TILE, TILE_BYTES, full, s)
        elif t < CONSUMERS:
            total = uint64(0)
            for r in range(tiles):
                s = r % STAGES
                tma.wait(full, s, (r // STAGES) % 2)
                total += uint64(words[s * TILE + t])
                tma.arrive(empty, s)
            out[t] = total

    return ring


def run_ring(tiles=6):
    src = np.random.default_rng(tiles).integers(0, 2**31, tiles * TILE).astype(np.uint32)
    out = np.zeros(CONSUMERS, np.uint64)
    make_ring()[1, CONSUMERS + 32](src, tiles, out)
    return out, src.reshape(tiles, TILE).sum(axis=0, dtype=np.uint64)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's barriers")
def test_a_ring_of_stages_delivers_every_tile_once_in_order():
    got, want = run_ring()
    assert np.array_equal(got, want)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's checks")
def test_misuse_is_an_error():
    bars, words = np.zeros(2, np.uint64), np.zeros(64, np.uint32)
    with pytest.raises(RuntimeError, match="before barrier_init"):
        tma.arrive(bars, 0)
    tma.barrier_init(bars, 0, 1)
    tma.arrive(bars, 0)  # completes phase 0
    tma.wait(bars, 0, 0)
    tma.barrier_init(bars, 1, 1)
    with pytest.raises(ValueError, match="multiple of 16"):
        tma.bulk_copy(words, 0, words, 0, 8, bars, 1)
    with pytest.raises(ValueError, match="16-byte aligned"):
        tma.bulk_copy(words, 1, words, 0, 16, bars, 1)
    tmap = tma.tensor_map(np.zeros((16, 64), np.uint16), 8, 32)
    with pytest.raises(ValueError, match="col 100, a multiple of 8"):  # illegal on the GPU
        tma.tensor_copy(words, 0, tmap, 100, 0, bars, 1)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's checks")
def test_a_new_array_inherits_no_dead_arrays_barriers():
    for _ in range(20):  # a new array often takes a freed one's id
        dead = np.zeros(2, np.uint64)
        tma.barrier_init(dead, 0, 1)
        del dead
        with pytest.raises(RuntimeError, match="before barrier_init"):
            tma.arrive(np.zeros(2, np.uint64), 0)


ASSEMBLE = """
from numba import cuda, types
from numba_kernels.numba_internals import compiling_for
from numba_kernels.ptx_report import ptxas_figures
import test_tma as T
u32, u64 = types.Array(types.uint32, 1, "C"), types.Array(types.uint64, 1, "C")
f32 = types.Array(types.float32, 2, "C")
for kernel, sig, instruction in ((T.make_ring(), (u32, types.int64, u64), "cp.async.bulk."),
                                 (T.make_tma_wgmma("bfloat16"), (u64, u64, f32),
                                  "cp.async.bulk.tensor")):
    with compiling_for((9, 0)):
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0, "a"))
    print(ptx.count(instruction), ptxas_figures(ptx, (9, "0a")))
"""


def test_the_kernels_assemble_for_sm_90a():
    out = run_compiler_script(ASSEMBLE)
    for line, copies in zip(out.strip().splitlines()[-2:], (1, 2)):
        count, figures = line.split(" ", 1)
        assert int(count) == copies and "'spill_stores': 0" in figures, out


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="a GPU test (pytest -m gpu on a GPU machine)")
@pytest.mark.parametrize("tiles", [1, 2, 7, 64])
def test_the_ring_on_the_gpu_delivers_every_tile(tiles):
    got, want = run_ring(tiles)
    assert np.array_equal(got, want)


def on_device(x):
    """What tensor_map describes: a device array on the GPU, the array itself in the
    simulator."""
    return x if SIMULATOR else cuda.to_device(x)


def make_box_copy(box_words):
    """128 threads: thread 0 copies one box by TMA to a 1024-byte aligned start; all wait;
    the shared words go to out."""

    @cuda.jit
    def box_copy(tmap, row, col, out):
        t = cuda.threadIdx.x
        bars = cuda.shared.array(1, uint64)  # the box has landed
        if t == 0:
            tma.barrier_init(bars, 0, 1)
        words = cuda.shared.array(BOX_ROOM, uint32)
        pad = warpgroup.aligned_index(words, 1024)
        cuda.syncthreads()
        if t == 0:
            tma.arrive_expect_tx(bars, 0, box_words * 4)
            tma.tensor_copy(words, pad, tmap, col, row, bars, 0)
        tma.wait(bars, 0, 0)
        for i in range(t, box_words, 128):
            out[i] = words[pad + i]

    return box_copy


BOX_ROOM = 64 * 64 // 2 + 256


@pytest.mark.gpu  # and in the simulator: the same test
@pytest.mark.parametrize("row, col, box, swizzle", [(0, 0, (64, 64), 0), (40, 24, (32, 64), 128),
                                                    (70, 96, (16, 32), 0), (8, 64, (64, 64), 128)])
def test_a_tma_box_lands_as_box_image_says(row, col, box, swizzle):
    """Boxes inside the array and across its edges (zeros there), row-major and swizzled."""
    array = np.random.default_rng(row).integers(0, 2**16, (80, 120)).astype(np.uint16)
    box_words = box[0] * box[1] // 2
    out = np.zeros(box_words, np.uint32)
    make_box_copy(box_words)[1, 128](tma.tensor_map(on_device(array), *box, swizzle), row,
                                      col, out)
    want = tma.box_image(array, row, col, *box, swizzle)
    assert np.array_equal(out.view(np.uint16), want)


def test_box_image_zero_fills_and_swizzles():
    array = np.arange(16 * 64, dtype=np.uint16).reshape(16, 64)
    plain = tma.box_image(array, 12, 0, 8, 64, 0).reshape(8, 64)
    assert np.array_equal(plain[:4], array[12:]) and not plain[4:].any()
    swz = tma.box_image(array, 0, 0, 8, 64, 128).reshape(8, 8, 8)  # row, chunk, value
    for r in range(8):
        for c in range(8):
            assert np.array_equal(swz[r, c ^ r], array[r, 8 * c:8 * c + 8])
    with pytest.raises(ValueError, match="64 with the swizzle"):
        tma.check_box((16, 64), 8, 32, 128)


A_WORDS, B_WORDS = 64 * 64 // 2, 128 * 64 // 2  # A (64, 64), B^T (128, 64), 16-bit
PRODUCT_ROOM = A_WORDS + B_WORDS + 256


def make_tma_wgmma(dtype):
    """FlashAttention-3's inner step in miniature: thread 0 loads A and B^T by TMA, swizzled,
    onto one barrier; the warpgroup waits and multiplies them from shared memory, four
    steps of K, by descriptors of the same swizzle; each thread's accumulator to out[t]."""
    mma = warpgroup.mma_async_f16 if dtype == "float16" else warpgroup.mma_async_bf16

    @cuda.jit
    def tma_wgmma(map_a, map_b, out):
        words = cuda.shared.array(PRODUCT_ROOM, uint32)
        bars = cuda.shared.array(1, uint64)
        t = cuda.threadIdx.x
        pad = warpgroup.aligned_index(words, 1024)
        if t == 0:
            tma.barrier_init(bars, 0, 1)
        cuda.syncthreads()
        if t == 0:
            tma.arrive_expect_tx(bars, 0, (A_WORDS + B_WORDS) * 4)
            tma.tensor_copy(words, pad, map_a, 0, 0, bars, 0)
            tma.tensor_copy(words, pad + A_WORDS, map_b, 0, 0, bars, 0)
        tma.wait(bars, 0, 0)
        acc = warpgroup.accumulator(64)
        warpgroup.wgmma_fence()
        for s in range(4):  # step_start: 32 bytes, 8 words, a step
            acc = mma(warpgroup.descriptor(words, pad + 8 * s, 16, 1024, 128),
                      warpgroup.descriptor(words, pad + A_WORDS + 8 * s, 16, 1024, 128), acc)
        warpgroup.wgmma_commit()
        warpgroup.wgmma_wait(0)
        for i in range(64):
            out[t, i] = acc[i]

    return tma_wgmma


@pytest.mark.gpu  # and in the simulator: the same test
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tiles_loaded_by_tma_multiply_by_wgmma(dtype):
    from tests.test_warpgroup import operands

    (a_bits, b_bits), (a, b_t) = operands(128, 4, dtype)
    out = np.zeros((128, 64), np.float32)
    maps = [tma.tensor_map(on_device(x), x.shape[0], 64, warpgroup.SWIZZLE)
            for x in (a_bits, b_bits)]
    make_tma_wgmma(dtype)[1, 128](*maps, out)
    want = np.zeros((64, 128), np.float32)
    for s in range(4):
        cut = slice(16 * s, 16 * s + 16)
        want = warpgroup.product_reference(a[:, cut], b_t[:, cut], want)
    err = float(np.abs(warpgroup.accumulator_matrix(out) - want).max())
    assert err <= (0 if SIMULATOR else 1e-5 * 16 * float(np.abs(want).max())), err
