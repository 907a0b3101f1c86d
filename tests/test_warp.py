"""numba_kernels/warp.py: the warp-level instructions' layouts (as the PTX ISA draws them) and
their simulator emulations, run as a real kernel of one warp; and that each compiles for sm_90
(ptxas), the check the simulator cannot make."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import verify  # noqa: F401  (selects the simulator on a machine without a GPU)
from numba import cuda

from numba_kernels import warp
from numba_kernels.convert import SIMULATOR, float32, uint32

needs_simulator = pytest.mark.skipif(not SIMULATOR, reason="runs the emulations: simulator")


def test_layouts_are_those_of_the_ptx_isa():
    """Entries read off the ISA's figures for m16n8k16 and ldmatrix (lane = 4g + t)."""
    A = np.arange(256).reshape(16, 16)
    a = warp.a_registers(A)
    assert a[0, 0].tolist() == [0, 1]  # lane 0, a0 = A[0, 0:2]
    assert a[5, 3].tolist() == [A[9, 10], A[9, 11]]  # g = 1, t = 1: a3 = A[g+8, 2t+8:2t+10]
    assert a[31, 1].tolist() == [A[15, 6], A[15, 7]]  # g = 7, t = 3: a1 = A[g+8, 2t:2t+2]
    B = np.arange(128).reshape(16, 8)
    b = warp.b_registers(B)
    assert b[6, 1].tolist() == [B[12, 1], B[13, 1]]  # g = 1, t = 2: b1 = B[2t+8:2t+10, g]
    C = np.arange(128).reshape(16, 8)
    assert warp.c_registers(C)[7].tolist() == [C[1, 6], C[1, 7], C[9, 6], C[9, 7]]
    rows = np.arange(4 * 64).reshape(4, 8, 8)
    assert warp.ldmatrix_rows(rows, False)[9, 2].tolist() == [rows[2, 2, 2], rows[2, 2, 3]]
    assert warp.ldmatrix_rows(rows, True)[9, 2].tolist() == [rows[2, 2, 2], rows[2, 3, 2]]


def test_register_layouts_round_trip():
    rng = np.random.default_rng(0)
    A, B, C = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), \
        rng.standard_normal((16, 8))
    assert (warp.a_matrix(warp.a_registers(A)) == A).all()
    assert (warp.b_matrix(warp.b_registers(B)) == B).all()
    assert (warp.c_matrix(warp.c_registers(C)) == C).all()


@pytest.mark.parametrize("dtype", ["float16", pytest.param("bfloat16", marks=needs_simulator)])
def test_mma_reference_is_a_times_b_plus_c(dtype):  # bfloat16 rounds by a device function
    rng = np.random.default_rng(1)
    A, B = rng.standard_normal((16, 16)), rng.standard_normal((16, 8))
    C = rng.standard_normal((16, 8)).astype(np.float32)
    bits = np.vectorize(lambda x: warp.value_bits(x, dtype))
    value = np.vectorize(lambda x: warp.bits_value(x, dtype))
    Ab, Bb = bits(A), bits(B)
    pack = np.vectorize(warp.pack_bits)
    a = pack(*np.moveaxis(warp.a_registers(Ab), -1, 0))
    b = pack(*np.moveaxis(warp.b_registers(Bb), -1, 0))
    d = warp.mma_reference(a, b, warp.c_registers(C), dtype)
    want = value(Ab) @ value(Bb) + C
    np.testing.assert_allclose(warp.c_matrix(d), want, rtol=1e-6, atol=1e-6)
    assert np.abs(value(Ab) - A).max() > 0  # the inputs were rounded: the test sees dtypes


def one_warp_kernel(dtype):
    """One warp: A (16x16), K (8 keys x 16) and V (16 keys x 8) to shared memory by cp.async,
    then S = A K^T by ldmatrix + mma, O = A V by ldmatrix.trans + mma, and a shuffle."""
    mma = warp.mma_f16 if dtype == "float16" else warp.mma_bf16
    ROW = 12  # words a row of 16 values (8 words) plus 4 of padding: 16-byte aligned rows
    WORDS = 3 * 16 * ROW

    @cuda.jit
    def kernel(a, k, v, s_out, o_out, lanes_out):
        words = cuda.shared.array(WORDS, uint32)
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        row, half = lane // 2, lane % 2  # each lane copies 16 bytes of a, k and v
        warp.cp_async16(words, row * ROW + 4 * half, a[row], 8 * half, 16)
        warp.cp_async16(words, (16 + row) * ROW + 4 * half, k[row % 8], 8 * half,
                        16 if row < 8 else 0)  # rows 8..15 of the K tile: zeros
        warp.cp_async_commit()
        if half == 0:
            warp.cp_async16(words, (32 + row) * ROW, v[row], 0, 16)
        warp.cp_async_commit()
        warp.cp_async_wait(0)
        cuda.syncthreads()  # Barrier: every lane's copies have landed.
        m, r = lane // 8, lane % 8
        a0, a1, a2, a3 = warp.ldmatrix_x4(words, (r + 8 * (m % 2)) * ROW + 4 * (m // 2))
        b0, b1, _, _ = warp.ldmatrix_x4(words, (16 + r) * ROW + 4 * (m % 2))
        z = float32(0.0)
        s0, s1, s2, s3 = mma(a0, a1, a2, a3, b0, b1, z, z, z, z)
        s_out[g, 2 * t], s_out[g, 2 * t + 1], s_out[g + 8, 2 * t], s_out[g + 8, 2 * t + 1] = \
            s0, s1, s2, s3
        v0, v1, _, _ = warp.ldmatrix_x4_trans(words, (32 + r + 8 * (m % 2)) * ROW)
        o0, o1, o2, o3 = mma(a0, a1, a2, a3, v0, v1, z, z, z, z)
        o_out[g, 2 * t], o_out[g, 2 * t + 1], o_out[g + 8, 2 * t], o_out[g + 8, 2 * t + 1] = \
            o0, o1, o2, o3
        lanes_out[lane] = warp.shfl_xor(float32(lane), 5)

    return kernel


@needs_simulator
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_emulated_instructions_compute_a_warps_products(dtype):
    rng = np.random.default_rng(2)
    A, K, V = (rng.standard_normal(shape) for shape in ((16, 16), (8, 16), (16, 8)))
    bits = np.vectorize(lambda x: warp.value_bits(x, dtype))
    value = np.vectorize(lambda x: warp.bits_value(x, dtype))
    # float16 travels as float16, bfloat16 as its int16 bit pattern (as the kernels take it)
    as_input = (lambda x: value(bits(x)).astype(np.float16)) if dtype == "float16" else \
        (lambda x: bits(x).astype(np.uint16).view(np.int16))
    s, o = np.zeros((16, 8), np.float32), np.zeros((16, 8), np.float32)
    lanes = np.zeros(32, np.float32)
    one_warp_kernel(dtype)[1, 32](as_input(A), as_input(K), as_input(V), s, o, lanes)
    Ar, Kr, Vr = value(bits(A)), value(bits(K)), value(bits(V))
    np.testing.assert_allclose(s, Ar @ Kr.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(o, Ar @ Vr, rtol=1e-5, atol=1e-5)
    assert lanes.tolist() == [lane ^ 5 for lane in range(32)]


@needs_simulator
def test_packing_rounds_to_nearest_even():
    assert warp.pack_f16(1.0, -2.0) == 0xC000_3C00
    # 1 + 2**-8 is a tie between bfloat16 1.0 and 1 + 2**-7: to even, 1.0 (0x3F80)
    assert int(warp.pack_bf16(1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8)) == 0x3F82_3F80


@needs_simulator
def test_reading_before_waiting_sees_stale_shared_memory():
    """The emulation lands a group only when it is waited for, as late as the hardware may."""
    @cuda.jit
    def early(src, out):
        words = cuda.shared.array(4, np.uint32)
        words[0] = 7
        warp.cp_async16(words, 0, src, 0, 16)
        warp.cp_async_commit()
        out[0] = words[0]  # before the wait: not yet landed
        warp.cp_async_wait(0)
        out[1] = words[0]

    out = np.zeros(2, np.uint32)
    early[1, 1](np.arange(8, dtype=np.int16), out)
    assert out.tolist() == [7, 0 | 1 << 16]


def test_votes_give_unsigned_words_and_their_counts():
    """ballot: bit l is lane l's predicate, an unsigned word (lane 31 is no sign: Numba's own
    ballot_sync is an int32); popc counts a word's bits, also of the lanes below one (the
    list pre-pass's positions). Two warps, lane 31's predicate true in one of them."""
    @cuda.jit
    def votes(words, counts, below_counts, every):
        tid = cuda.threadIdx.x
        lane, w = tid % warp.LANES, tid // warp.LANES
        kept = warp.ballot((lane * 7 + w) % 3 == 1)
        below = (uint32(1) << uint32(lane)) - uint32(1)
        words[tid] = kept
        n = 0
        n += warp.popc(kept)
        counts[tid] = n
        below_counts[tid] = warp.popc(kept & below)
        every[tid] = warp.ballot(True) == warp.FULL_MASK

    words, counts, below = (np.zeros(64, np.int64) for _ in range(3))
    every = np.zeros(64, np.bool_)
    votes[1, 64](words, counts, below, every)
    for w in range(2):
        bits = [(lane * 7 + w) % 3 == 1 for lane in range(32)]
        want = sum(1 << lane for lane, b in enumerate(bits) if b)
        assert words[32 * w:32 * w + 32].tolist() == [want] * 32
        assert counts[32 * w:32 * w + 32].tolist() == [sum(bits)] * 32
        assert below[32 * w:32 * w + 32].tolist() == [sum(bits[:lane]) for lane in range(32)]
    assert words[31] >= 2**31  # lane 31 kept in warp 0: a word, not a negative number
    assert every.all()


@needs_simulator
def test_a_launch_that_raises_leaves_the_next_ones_warps_alone():
    """Half a warp raises before a shuffle the other half waits in: the launch raises, those
    lanes are left waiting (till warp.MEETING_TIMEOUT_S), and the next launch's shuffles
    meet among themselves, not with them."""
    @cuda.jit
    def shuffle(fail, out):
        lane = cuda.threadIdx.x
        if fail[0] and lane < 16:
            raise ValueError("this lane fails")
        out[lane] = warp.shfl_xor(float32(lane), 1)

    out = np.zeros(32, np.float32)
    with pytest.raises(ValueError, match="this lane fails"):
        shuffle[1, 32](np.ones(1, np.int64), out)
    second = threading.Thread(target=lambda: shuffle[1, 32](np.zeros(1, np.int64), out),
                              daemon=True)
    second.start()
    second.join(60)
    assert not second.is_alive(), "the second launch met the first one's lanes"
    assert out.tolist() == [lane ^ 1 for lane in range(32)]


PTX_CHECK = """
from numba import cuda, types
from numba_kernels.numba_internals import compiling_for
from numba_kernels.ptx_report import ptxas_figures
from tests.test_warp import one_warp_kernel
for dtype, src in (("float16", types.float16), ("bfloat16", types.int16)):
    sig = (src[:, ::1], src[:, ::1], src[:, ::1], types.float32[:, ::1], types.float32[:, ::1],
           types.float32[::1])
    with compiling_for((9, 0)):
        ptx, _ = cuda.compile_ptx(one_warp_kernel(dtype).py_func, sig, cc=(9, 0))
    for op in ("mma.sync.aligned.m16n8k16.row.col.f32." + ("f16" if dtype == "float16" else "bf16"),
               "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
               "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
               "cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group 0",
               "shfl.sync.bfly"):
        assert op in ptx, (dtype, op)
    print(dtype, ptxas_figures(ptx))
"""


def test_instructions_compile_for_sm90():
    """The real compiler and ptxas take every instruction (the simulator checks no PTX)."""
    pytest.importorskip("cuda.bindings", reason="needs the ptx extra (numba-cuda[cu13])")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", PTX_CHECK], capture_output=True, text=True,
                         env=env, cwd=root)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("spill_stores': 0") == 2, run.stdout
