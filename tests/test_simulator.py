"""The simulator's thread blocks, as numba_internals item 6 runs them: a block's barrier lets
its threads go only when every live one has arrived, a thread that exits no longer counts,
and an exception in one thread is raised by the launch without leaving it waiting. Driven
through numba-cuda's own BlockManager with plain Python functions as the threads' code.
And item 7: a device function's module swapped once a launch, restored after it."""
import threading
import time

import numpy as np
import pytest
from numba import cuda

from numba_kernels import numba_internals
from numba_kernels.convert import SIMULATOR

sim = pytest.importorskip("numba.cuda.simulator.kernel")


def run_block(code, threads, timeout_s=20.0):
    """Run `code(tid)` on a block of `threads` threads in another thread; returns what the
    launch raised, or None. Fails if the block has not ended within timeout_s."""
    def f():
        code(threading.current_thread().thread_id)

    outcome = {}

    def launch():
        try:
            sim.BlockManager(f, (1, 1, 1), (threads, 1, 1), False).run((0, 0, 0))
        except Exception as e:  # noqa: BLE001 - handed to the test
            outcome["raised"] = e

    launcher = threading.Thread(target=launch, daemon=True)
    launcher.start()
    launcher.join(timeout_s)
    assert not launcher.is_alive(), "the block did not end"
    return outcome.get("raised")


def sync():
    threading.current_thread().syncthreads()


def test_no_thread_passes_a_barrier_before_every_thread_reaches_it():
    log = []

    def code(tid):
        for step in range(3):
            time.sleep(0.001 * (tid % 4))  # the later threads arrive later
            log.append((step, tid))
            sync()

    assert run_block(code, 16) is None
    assert [step for step, _ in log] == sorted(step for step, _ in log)
    assert len(log) == 48


def test_a_thread_that_exits_no_longer_holds_the_others_at_a_barrier():
    seen = []

    def code(tid):
        if tid % 2:
            time.sleep(0.02)  # the others are waiting at the first barrier by then
            return  # before any barrier: only its exit can let them go
        sync()
        sync()
        seen.append(tid)

    assert run_block(code, 8) is None
    assert sorted(seen) == [0, 2, 4, 6]


def test_an_exception_in_one_thread_is_raised_and_frees_the_others():
    def code(tid):
        if tid == 3:
            time.sleep(0.01)  # the others are waiting at the barrier by then
            raise ValueError("thread 3 fails")
        sync()
        sync()

    raised = run_block(code, 8)
    assert isinstance(raised, ValueError) and "thread 3 fails" in str(raised), raised


@pytest.mark.skipif(not SIMULATOR, reason="the replacement is installed in the simulator only")
def test_the_replacement_is_installed_and_refuses_a_changed_block_manager(monkeypatch):
    assert getattr(sim.BlockManager.run, "event_driven", False)

    def run(self, grid_point, *args):  # a block manager that is not numba-cuda 0.30's
        pass

    monkeypatch.setattr(sim.BlockManager, "run", run)
    with pytest.raises(numba_internals.InternalsChanged, match="BlockManager.run"):
        numba_internals._event_driven_simulator_blocks()


@pytest.mark.skipif(not SIMULATOR, reason="the replacement is installed in the simulator only")
def test_a_device_function_sees_each_launch_and_its_module_is_restored_after(monkeypatch):
    """Item 7: a device function of another module (warp.lane_values) swaps its module's
    `cuda` once a launch and keeps it till the launch ends: every call sees that launch's
    threads, the next launch its own, and the module has its own `cuda` back after each
    (also after a launch that raised)."""
    from numba_kernels import warp

    real = warp.cuda

    @cuda.jit
    def lanes(out, fail):
        for step in range(3):
            out[step, cuda.threadIdx.x] = warp.lane_values(cuda.threadIdx.x * 10 + step)[5]
        if fail[0]:
            raise ValueError("the launch fails")

    for threads in (8, 16):
        out = np.zeros((3, threads), np.int64)
        lanes[1, threads](out, np.zeros(1, np.int64))
        assert (out == 50 + np.arange(3)[:, None]).all()
        assert warp.cuda is real
    with pytest.raises(ValueError, match="the launch fails"):
        lanes[1, 8](np.zeros((3, 8), np.int64), np.ones(1, np.int64))
    assert warp.cuda is real
    monkeypatch.setattr(sim, "swapped_cuda_module", lambda fn, module: None)
    with pytest.raises(numba_internals.InternalsChanged, match="swapped_cuda_module"):
        numba_internals._device_calls_swap_once()
