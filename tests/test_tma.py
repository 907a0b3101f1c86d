"""tma.py: bulk copies landing on transaction barriers, as a producer warp filling a ring of
two stages for 128 consumer threads (FlashAttention-3's K and V loads in miniature), in the
simulator and on the H200; the kernel assembles for sm_90a; misuse is an error."""
import os
import subprocess
import sys

import numpy as np
import pytest
from numba import cuda

from numba_kernels import tma
from numba_kernels.convert import SIMULATOR, uint32, uint64

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


ASSEMBLE = """
from numba import cuda, types
from numba_kernels.numba_internals import compiling_for
from numba_kernels.ptx_report import ptxas_figures
import test_tma as T
arr = lambda ty: types.Array(ty, 1, "C")
with compiling_for((9, 0)):
    ptx, _ = cuda.compile_ptx(T.make_ring().py_func,
                              (arr(types.uint32), types.int64, arr(types.uint64)), cc=(9, 0, "a"))
print(ptx.count("cp.async.bulk"), ptxas_figures(ptx, (9, "0a")))
"""


def test_the_ring_assembles_for_sm_90a():
    pytest.importorskip("cuda.bindings", reason="needs the ptx extra (numba-cuda[cu13] and ptxas)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests"),
                                           os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", ASSEMBLE], capture_output=True, text=True,
                         env=env, cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    count, figures = run.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(count) == 1 and "'spill_stores': 0" in figures, run.stdout


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="a GPU test (pytest -m gpu on a GPU machine)")
@pytest.mark.parametrize("tiles", [1, 2, 7, 64])
def test_the_ring_on_the_gpu_delivers_every_tile(tiles):
    got, want = run_ring(tiles)
    assert np.array_equal(got, want)
