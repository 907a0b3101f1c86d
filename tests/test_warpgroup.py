"""warpgroup.py: Hopper's wgmma from Python. The layouts (operand_image, accumulator_matrix)
are checked against their definitions, the simulator's product against NumPy through a kernel
that runs unchanged on the H200 (test_gpu.py's twin below), and the kernel assembles for
sm_90a."""
import numpy as np
import pytest
from numba import cuda

from numba_kernels import warp, warpgroup
from numba_kernels.convert import SIMULATOR, uint32
from numba_kernels.warp import bits_value
from tests.assembly import run_compiler_script

LBO = 128  # the two core matrices along K of a step: 128 bytes apart


def b_offsets(n, steps, swizzle, mn_major):
    """B's (LBO, SBO) in make_chain's images: K-major as A's; MN-major without swizzle the
    n / 8 core matrices of 8 values of K one after another, then the next 8 of K; with it
    each 64 values of N a block of 16 steps' rows of 128 bytes."""
    if not mn_major:
        return (LBO, 256 * steps) if swizzle == 0 else (16, 1024)
    return (16 * n, 128) if swizzle == 0 else (16 * steps * 128, 1024)


def make_chain(n, steps, dtype, swizzle=0, regs=False, mn_major=False):
    """A 128-thread kernel: A (64, 16 steps) and B^T (n, 16 steps), as operand_image lays
    them out (swizzled: steps = 4, rows of 128 bytes; B MN-major with mn_major, A then from
    registers), copied to shared memory 1024-byte aligned; `steps` wgmma m64nNk16 on one
    accumulator, step s's operands from word starts[s] of A and b_starts[s] of B
    (step_start), or with regs A from each thread's registers (a_frags[s, t], as a_fragments
    lays them out); each thread's accumulator to out[t]. Returns (kernel, A's (lbo, sbo),
    B's)."""
    a_words, b_words = 64 * 8 * steps, n * 8 * steps
    lbo, sbo = b_offsets(64, steps, swizzle, False)
    b_lbo, b_sbo = b_offsets(n, steps, swizzle, mn_major)
    words_size = a_words + b_words + 256  # and room to align to 1024 bytes
    floats = n // 2  # the accumulator's
    mma = warpgroup.mma_async_f16 if dtype == "float16" else warpgroup.mma_async_bf16
    mma_regs = {("float16", False): warpgroup.mma_async_regs_f16,
                ("bfloat16", False): warpgroup.mma_async_regs_bf16,
                ("float16", True): warpgroup.mma_async_regs_mn_f16,
                ("bfloat16", True): warpgroup.mma_async_regs_mn_bf16}[dtype, mn_major]
    assert regs or not mn_major

    @cuda.jit
    def chain(image_a, image_b, a_frags, starts, b_starts, out):
        words = cuda.shared.array(words_size, uint32)
        t = cuda.threadIdx.x
        pad = warpgroup.aligned_index(words, 1024)
        for i in range(t, a_words, 128):
            words[pad + i] = image_a[i]
        for i in range(t, b_words, 128):
            words[pad + a_words + i] = image_b[i]
        warpgroup.fence_proxy_async()
        cuda.syncthreads()
        acc = warpgroup.accumulator(floats)
        warpgroup.wgmma_fence()
        for s in range(steps):
            at = starts[s]
            b = warpgroup.descriptor(words, pad + a_words + b_starts[s], b_lbo, b_sbo, swizzle)
            if regs:
                acc = mma_regs((a_frags[s, t, 0], a_frags[s, t, 1], a_frags[s, t, 2],
                                a_frags[s, t, 3]), b, acc)
            else:
                acc = mma(warpgroup.descriptor(words, pad + at, lbo, sbo, swizzle), b, acc)
        warpgroup.wgmma_commit()
        warpgroup.wgmma_wait(0)
        for i in range(floats):
            out[t, i] = acc[i]

    return chain, (lbo, sbo), (b_lbo, b_sbo)


def operands(n, steps, dtype, seed=0):
    """Random A (64, 16 steps) and B^T (n, 16 steps) as 16-bit patterns, and as float64."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((64, 16 * steps)).astype(np.float32)
    b_t = rng.standard_normal((n, 16 * steps)).astype(np.float32)
    if dtype == "float16":
        bits = [x.astype(np.float16).view(np.uint16) for x in (a, b_t)]
    else:  # bfloat16: the top 16 bits of float32, rounded to nearest even
        bits = [((x.view(np.uint32) + 0x7FFF + (x.view(np.uint32) >> 16 & 1)) >> 16)
                .astype(np.uint16) for x in (a, b_t)]
    values = [np.vectorize(lambda v: float(bits_value(int(v), dtype)))(x) for x in bits]
    return bits, values


def run_chain(n, steps, dtype, swizzle=0, regs=False, mn_major=False):
    """(the kernel's D, the simulator's rule's D: each step's sum rounded once)."""
    chain, (lbo, sbo), (b_lbo, b_sbo) = make_chain(n, steps, dtype, swizzle, regs, mn_major)
    (a_bits, b_bits), (a, b_t) = operands(n, steps, dtype)
    out = np.zeros((128, n // 2), np.float32)
    starts = np.array([warpgroup.step_start(s, lbo, sbo, swizzle) // 4 for s in range(steps)])
    b_starts = np.array([warpgroup.step_start(s, b_lbo, b_sbo, swizzle, mn_major) // 4
                         for s in range(steps)])
    a_frags = np.stack([warpgroup.a_fragments(a_bits[:, 16 * s:16 * s + 16])
                        for s in range(steps)])
    chain[1, 128](warpgroup.operand_image(a_bits, lbo, sbo, swizzle),
                  warpgroup.operand_image(b_bits, b_lbo, b_sbo, swizzle, mn_major), a_frags,
                  starts, b_starts, out)
    want = np.zeros((64, n), np.float32)
    for s in range(steps):
        cut = slice(16 * s, 16 * s + 16)
        want = warpgroup.product_reference(a[:, cut], b_t[:, cut], want)
    return warpgroup.accumulator_matrix(out), want


def test_operand_image_puts_each_element_where_the_descriptor_reads_it():
    rows, steps, sbo = 16, 2, 512
    m = np.arange(rows * 16 * steps, dtype=np.uint16).reshape(rows, 16 * steps)
    image = warpgroup.operand_image(m, LBO, sbo).view(np.uint16)
    for r in (0, 7, 8, 15):
        for k in (0, 7, 8, 15, 16, 31):
            s, kk = divmod(k, 16)
            start = warpgroup.step_start(s, LBO, sbo, 0)
            at = warpgroup.operand_address(start, r, kk, LBO, sbo, 0)
            assert image[at // 2] == m[r, k]
    # a core matrix: 8 rows of 16 bytes, rows contiguous
    assert [warpgroup.operand_address(0, r, 0, LBO, sbo, 0) for r in range(3)] == [0, 16, 32]
    assert warpgroup.operand_address(0, 8, 0, LBO, sbo, 0) == sbo
    assert warpgroup.operand_address(0, 0, 8, LBO, sbo, 0) == LBO


def test_the_swizzled_image_is_the_row_major_tile_with_chunks_xored_by_row():
    """The 128-byte swizzle: row r of 64 values at 128 r bytes, its 16-byte chunk c stored at
    chunk c ^ (r % 8), as TMA writes a tile of 64 columns with CU_TENSOR_MAP_SWIZZLE_128B."""
    m = np.arange(16 * 64, dtype=np.uint16).reshape(16, 64)
    image = warpgroup.operand_image(m, 16, 1024, warpgroup.SWIZZLE).view(np.uint16)
    for r in (0, 1, 7, 8, 13):
        for c in range(8):
            chunk = image[r * 64 + 8 * (c ^ r % 8):r * 64 + 8 * (c ^ r % 8) + 8]
            assert np.array_equal(chunk, m[r, 8 * c:8 * c + 8])


def test_accumulator_matrix_follows_the_fragment_table():
    frags = np.arange(128 * 8, dtype=np.float32).reshape(128, 8)  # N = 16
    d = warpgroup.accumulator_matrix(frags)
    t = 32 * 2 + 4 * 3 + 1  # w = 2, g = 3, q = 1
    assert d[16 * 2 + 3, 2] == frags[t, 0] and d[16 * 2 + 3, 3] == frags[t, 1]
    assert d[16 * 2 + 3 + 8, 2] == frags[t, 2] and d[16 * 2 + 3, 8 + 3] == frags[t, 5]
    assert d[16 * 2 + 3 + 8, 8 + 3] == frags[t, 7]


def test_the_mn_major_image_is_b_with_n_contiguous():
    """B MN-major: without swizzle a core matrix is 8 values of K by 8 of N (16 bytes a K
    row); with it a row of 128 bytes is 64 values of N at one K, its chunks XORed by the row
    within 8, as TMA writes a tile of V (keys along K) 64 columns wide."""
    n, steps = 128, 2
    m = np.arange(n * 16 * steps, dtype=np.uint16).reshape(n, 16 * steps)  # B^T (n, K)
    lbo, sbo = b_offsets(n, steps, 0, True)
    image = warpgroup.operand_image(m, lbo, sbo, 0, True).view(np.uint16)
    assert np.array_equal(image[:8], m[:8, 0]) and np.array_equal(image[8:16], m[:8, 1])
    assert np.array_equal(image[64:72], m[8:16, 0])  # the next core matrix along N: SBO on
    assert np.array_equal(image[lbo // 2:lbo // 2 + 8], m[:8, 8])  # along K: LBO on
    lbo, sbo = b_offsets(n, steps, warpgroup.SWIZZLE, True)
    image = warpgroup.operand_image(m, lbo, sbo, warpgroup.SWIZZLE, True).view(np.uint16)
    for k in (0, 3, 9, 31):
        for c in range(8):
            at = k * 64 + 8 * (c ^ k % 8)
            assert np.array_equal(image[at:at + 8], m[8 * c:8 * c + 8, k])
            assert np.array_equal(image[lbo // 2 + at:lbo // 2 + at + 8],
                                  m[64 + 8 * c:64 + 8 * c + 8, k])


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's wgmma")
@pytest.mark.parametrize("dtype, steps, swizzle, regs, mn_major", [
    ("float16", 2, 0, False, False), ("bfloat16", 2, 0, False, False),
    ("bfloat16", 4, warpgroup.SWIZZLE, False, False), ("float16", 4, warpgroup.SWIZZLE, True, False),
    ("bfloat16", 2, 0, True, True), ("float16", 4, warpgroup.SWIZZLE, True, True)])
def test_the_simulators_wgmma_is_a_b_plus_d(dtype, steps, swizzle, regs, mn_major):
    n = 64 if mn_major and swizzle else 16
    got, want = run_chain(n, steps, dtype, swizzle, regs, mn_major)
    assert np.array_equal(got, want)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's wgmma")
def test_a_fragments_are_mma_syncs_a_fragment_by_warp():
    """Thread 32 w + 4 g + q holds rows 16 w + g and + 8, columns 2 q, 2 q + 1 and + 8: a
    layout with two registers swapped (rows g + 8 read as columns + 8) differs."""
    a = np.arange(64 * 16, dtype=np.uint16).reshape(64, 16)
    frags = warpgroup.a_fragments(a)
    t, w, g, q = 32 * 2 + 4 * 5 + 3, 2, 5, 3
    values = frags[t].view(np.uint16).reshape(4, 2)  # low half first
    assert values.tolist() == [a[16 * w + g, 2 * q:2 * q + 2].tolist(),
                               a[16 * w + g + 8, 2 * q:2 * q + 2].tolist(),
                               a[16 * w + g, 2 * q + 8:2 * q + 10].tolist(),
                               a[16 * w + g + 8, 2 * q + 8:2 * q + 10].tolist()]


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's wgmma")
def test_a_wrong_fragment_layout_is_caught():
    """The check above can fail: a transposed accumulator (the mistake a kernel makes that
    reads d[4 j + 1] as row g + 8) does not pass."""
    got, want = run_chain(16, 1, "float16")
    frags = np.zeros((128, 8), np.float32)
    for t in range(128):  # re-read with rows and the two columns of a pair swapped
        w, g, q = t // 32, t % 32 // 4, t % 4
        for j in range(2):
            frags[t, 4 * j:4 * j + 4] = (got[16 * w + g, 8 * j + 2 * q],
                                         got[16 * w + g + 8, 8 * j + 2 * q],
                                         got[16 * w + g, 8 * j + 2 * q + 1],
                                         got[16 * w + g + 8, 8 * j + 2 * q + 1])
    assert not np.array_equal(warpgroup.accumulator_matrix(frags), want)


def make_overwrite(how):
    """128 threads: one m64n8k16 from shared memory, committed; thread 0 then changes a word
    of A: after wgmma_wait ("after wait"), or before it, by a store ("store") or by a cp.async
    it waits for only after wgmma_wait ("cp.async": the race of a two-stage ring whose copy
    into a stage is issued before the products reading that stage are waited for)."""
    lbo, sbo = b_offsets(64, 1, 0, False)
    b_lbo, b_sbo = b_offsets(8, 1, 0, False)
    WAIT_FIRST, BY_COPY = how == "after wait", how == "cp.async"

    @cuda.jit
    def overwrite(zeros, out):
        words = cuda.shared.array(64 * 8 + 8 * 8, uint32)
        t = cuda.threadIdx.x
        for i in range(t, 64 * 8 + 8 * 8, 128):
            words[i] = 0x3C003C00  # float16 ones
        warpgroup.fence_proxy_async()
        cuda.syncthreads()
        warpgroup.wgmma_fence()
        acc = warpgroup.mma_async_f16(warpgroup.descriptor(words, 0, lbo, sbo, 0),
                                      warpgroup.descriptor(words, 64 * 8, b_lbo, b_sbo, 0),
                                      warpgroup.accumulator(4))
        warpgroup.wgmma_commit()
        if WAIT_FIRST:
            warpgroup.wgmma_wait(0)
        cuda.syncthreads()
        if t == 0:
            if BY_COPY:
                warp.cp_async16(words, 0, zeros, 0, 16)
                warp.cp_async_commit()
            else:
                words[0] = 0
        cuda.syncthreads()
        warpgroup.wgmma_wait(0)
        cuda.syncthreads()  # every thread's products retired before the copy lands
        warp.cp_async_wait(0)
        out[t] = acc[0]

    return overwrite


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's ordering check")
@pytest.mark.parametrize("how", ["store", "cp.async"])
def test_an_operand_overwritten_before_its_group_is_waited_for_is_caught(how):
    zeros, out = np.zeros(8, np.float16), np.zeros(128, np.float32)
    make_overwrite("after wait")[1, 128](zeros, out)
    assert (out == 16).all()
    with pytest.raises(RuntimeError, match="before the group was waited for"):
        make_overwrite(how)[1, 128](zeros, out)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's alignment check")
def test_an_unaligned_operand_is_refused():
    words = np.zeros(64, np.uint32)
    with pytest.raises(ValueError, match="16-byte aligned"):
        warpgroup.mma_async_f16(warpgroup.descriptor(words, 1, LBO, 256, 0),
                                warpgroup.descriptor(words, 0, LBO, 256, 0),
                                warpgroup.accumulator(4))


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's shape check")
def test_a_shape_outside_m64nNk16_is_refused():
    with pytest.raises(TypeError, match="multiple of 8 from 8 to 256"):
        warpgroup.accumulator(3)


def make_specialized():
    """256 threads: warpgroup 0 (a producer's) gives registers back, warpgroup 1 (a
    consumer's) takes more; each thread then writes its warpgroup's number."""

    @cuda.jit
    def specialized(out):
        t = cuda.threadIdx.x
        if t // warpgroup.WARPGROUP == 0:
            warpgroup.setmaxnreg_dec(40)
        else:
            warpgroup.setmaxnreg_inc(232)
        out[t] = t // warpgroup.WARPGROUP

    return specialized


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's register check")
def test_setmaxnreg_takes_multiples_of_8_from_24_to_256():
    out = np.zeros(256, np.int32)
    make_specialized()[1, 256](out)
    assert (out == np.arange(256) // 128).all()
    for bad in (16, 100, 264):
        with pytest.raises(TypeError, match="multiple of 8 from 24 to 256"):
            warpgroup.setmaxnreg_inc(bad)


SPECIALIZED = """
import subprocess, sys, tempfile
from numba import cuda, types
from numba_kernels.numba_internals import compiling_for
from numba_kernels.ptx_report import find_ptxas
import test_warpgroup as T
for bounds in ((256, 1), None):
    with compiling_for((9, 0)):
        ptx, _ = cuda.compile_ptx(T.make_specialized().py_func,
                                  (types.Array(types.int32, 1, "C"),), cc=(9, 0, "a"),
                                  launch_bounds=bounds)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        run = subprocess.run([find_ptxas(), "-arch=sm_90a", "-v", f.name, "-o", f.name + ".cubin"],
                             capture_output=True, text=True)
    print(bounds is not None, run.returncode, ptx.count("setmaxnreg."),
          "C7508" in run.stderr + run.stdout)
"""


def test_setmaxnreg_assembles_and_needs_launch_bounds():
    """With launch bounds ptxas keeps both instructions; without, it ignores them (its
    message C7508: no register count known at entry), which warpgroup.py's docstring says."""
    out = run_compiler_script(SPECIALIZED)
    assert out.split("\n")[-3:-1] == ["True 0 2 False", "False 0 2 True"], out


ASSEMBLE = """
import sys
from numba import cuda, types
from numba_kernels.numba_internals import compiling_for
from numba_kernels.ptx_report import ptxas_figures
import test_warpgroup as T
chain = T.make_chain(128, 4, sys.argv[1], int(sys.argv[2]), sys.argv[3] == "True",
                     sys.argv[4] == "True")[0]
arr, starts = types.Array(types.uint32, 1, "C"), types.Array(types.int64, 1, "C")
with compiling_for((9, 0)):
    ptx, _ = cuda.compile_ptx(chain.py_func, (arr, arr, types.Array(types.uint32, 3, "C"),
                                              starts, starts,
                                              types.Array(types.float32, 2, "C")),
                              cc=(9, 0, "a"))
print(ptx.count("wgmma.mma_async"), ptxas_figures(ptx, (9, "0a")))
"""


@pytest.mark.parametrize("dtype, swizzle, regs, mn_major", [
    ("float16", 0, False, False), ("bfloat16", warpgroup.SWIZZLE, True, False),
    ("bfloat16", warpgroup.SWIZZLE, True, True)])
def test_the_kernel_assembles_for_sm_90a(dtype, swizzle, regs, mn_major):
    """The same kernel source compiles for the GPU (sm_90a: wgmma exists only there) and
    ptxas takes it, m64n128k16, without spills; A from shared memory or from registers, B
    K-major or MN-major."""
    out = run_compiler_script(ASSEMBLE, dtype, str(swizzle), str(regs), str(mn_major))
    count, figures = out.strip().splitlines()[-1].split(" ", 1)
    assert int(count) == 4, out  # one product a step
    assert "'spill_stores': 0" in figures and "'stack_frame': 0" in figures, figures


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="a GPU test (pytest -m gpu on a GPU machine)")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("swizzle", [0, warpgroup.SWIZZLE])
@pytest.mark.parametrize("regs, mn_major", [(False, False), (True, False), (True, True)])
def test_wgmma_on_the_gpu_is_a_b_plus_d_in_the_documented_layouts(dtype, swizzle, regs,
                                                                   mn_major):
    """On the GPU: m64n128k16, four steps on one accumulator, A from shared memory or from
    registers, B K-major or MN-major, against NumPy; the tensor cores cut products to the
    accumulator's ulp, so a few ulps of the sums apart, where a wrong operand or accumulator
    layout is off by the values themselves."""
    got, want = run_chain(128, 4, dtype, swizzle, regs, mn_major)
    err = float(np.abs(got - want).max())
    assert err <= 1e-5 * float(np.abs(want).max()) * 16, err
