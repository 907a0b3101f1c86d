"""Without a GPU, the Numba kernel runs in the CUDA simulator (set before numba is imported).
The PTX gate (tests/test_ptx.py) starts when collected, to run beside the other tests."""
import os

from verify.device import use_simulator_if_no_gpu

use_simulator_if_no_gpu()


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
