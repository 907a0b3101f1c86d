"""Without a GPU, the Numba kernel runs in the CUDA simulator (set before numba is imported).
Under pytest-xdist with no more workers than cores, each worker keeps to a core of its own
(`pin_worker`). The PTX gate (tests/test_ptx.py) starts when collected, to run beside the
other tests."""
import os

import pytest

from verify.device import use_simulator_if_no_gpu

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def pin_worker():
    """Worker gwN of pytest-xdist onto core N (of those this process may use), when there
    are no more workers than cores. The simulator hands the interpreter from thread to
    thread at every barrier and warp instruction; with its threads spread over the cores,
    each hand-over waits for a wake-up on another core, where the other worker runs: on 2
    cores a worker's simulator tests took 1.5 to 2.4 times as long as on a core of its own.
    Processes the worker starts keep its core (the PTX gate takes every core again:
    tests/test_ptx.py)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get(
        "PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and count.isdigit() and 0 < int(count) <= len(CORES):
        os.sched_setaffinity(0, {CORES[int(worker[2:]) % len(CORES)]})


pin_worker()
use_simulator_if_no_gpu()


@pytest.fixture
def every_core():
    """The worker on every core for one test: the ranks it spawns (each a simulator of its
    own) inherit its cores, and on one they would take turns."""
    if not CORES or os.sched_getaffinity(0) == set(CORES):
        yield
        return
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, CORES)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


def pytest_collection_modifyitems(session, config, items):
    """The long simulator tests go first, so that under pytest-xdist each worker takes one
    early and the short tests fill in around them (last, one would run alone at the end);
    the gate's test goes last, so that every other test runs while it compiles."""
    from tests import test_ptx

    items.sort(key=lambda item: (item.name == test_ptx.GATE_TEST,  # stable: the rest keep
                                 item.get_closest_marker("long") is None))  # their order


def pytest_collection_finish(session):
    from tests import test_ptx

    if any(item.name == test_ptx.GATE_TEST for item in session.items) \
            and "PYTEST_XDIST_WORKER" not in os.environ:
        # every core: the simulator tests share them, and no core idles at the end. Under
        # pytest-xdist (-n) the gate's own test starts it, last, in whichever worker runs it.
        test_ptx.start_gate()


def pytest_sessionfinish(session):
    from tests import test_ptx

    test_ptx.stop_gate()
