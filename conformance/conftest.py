"""Selecting the implementation under test, the Hypothesis profile, the report header and the
end-of-run summary. The command-line options are the plugin's (conformance/plugin.py), so
that they exist wherever pytest runs, `pytest --pyargs conformance` in another project
included."""
import os

import pytest

from verify.device import gpu_count, gpu_present, use_simulator_if_no_gpu

from .plugin import ENV_IMPL


def pytest_configure(config):
    _one_gpu_a_worker(config)
    use_simulator_if_no_gpu()  # before anything imports numba.cuda
    from hypothesis import Phase, settings

    from . import profiles  # noqa: F401 - registers the profiles

    profile = config.getoption("--profile") or ("gpu" if gpu_present() else "ci")
    settings.load_profile(profile)
    overrides = {}
    if config.getoption("--max-examples") is not None:
        if config.getoption("--max-examples") < 1:
            raise pytest.UsageError("--max-examples must be at least 1")
        overrides["max_examples"] = config.getoption("--max-examples")
    if config.getoption("--no-shrink"):
        overrides["phases"] = [p for p in Phase if p != Phase.shrink]
    if overrides:
        settings.register_profile(f"{profile}+options", settings.get_profile(profile),
                                  **overrides)
        settings.load_profile(f"{profile}+options")
    config.conformance_profile = profile
    config.conformance_impl_spec = (config.getoption("--impl") or os.environ.get(ENV_IMPL)
                                    or "numba")
    config.conformance_impl = None
    _load(config)  # a bad --impl is a usage error now, not an error in every test
    # Small test grids are what this suite launches: Numba's advice on them is noise here.
    config.addinivalue_line("filterwarnings",
                            r"ignore:Grid size \d+ will likely result in GPU under-utilization")


def _one_gpu_a_worker(config):
    """Under pytest-xdist on a host of several GPUs, worker gwN takes GPU N mod their count
    (CUDA_VISIBLE_DEVICES, before anything starts CUDA), so `pytest conformance -n G`
    spreads the suite over G GPUs. Left alone where CUDA_VISIBLE_DEVICES is set already."""
    worker = getattr(config, "workerinput", {}).get("workerid", "")
    if not worker.startswith("gw") or "CUDA_VISIBLE_DEVICES" in os.environ:
        return
    gpus = gpu_count()
    if gpus > 1:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(int(worker[2:]) % gpus)


def pytest_sessionstart(session):
    """The implementation's warm hook (Implementation.warm) before the first test: ours
    compile their kernel variants on every core, once for the machine
    (numba_kernels/compile_cache.py), the backward's too with --backward. Not in xdist's
    workers."""
    config = session.config
    impl = config.conformance_impl
    if impl.warm is None or hasattr(config, "workerinput"):
        return
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    impl.warm(backward=config.getoption("--backward"),
              say=lambda line: terminal.write_line(f"conformance: {line}") if terminal else None)


def _load(config):
    """The implementation under test (spread over --world-size ranks where given)."""
    if config.conformance_impl is None:
        from verify.adapters import load

        spec, world_size = config.conformance_impl_spec, config.getoption("--world-size")
        try:
            if world_size is None:
                impl = load(spec)
            else:
                from verify.distributed import layout_named, spread

                impl = spread(spec, world_size, layout_named(config.getoption("--shard-layout")))
        except Exception as e:  # noqa: BLE001 - a clear usage error, not a traceback
            raise pytest.UsageError(f"cannot load implementation {spec!r}"
                                    f"{'' if world_size is None else ' on ranks'}: {e}") from None
        if impl.per_rank:
            raise pytest.UsageError(f"{impl.name} runs on the ranks of a group: pass "
                                    f"--world-size N")
        config.conformance_impl = impl
    return config.conformance_impl


def pytest_report_header(config):
    impl = _load(config)
    from hypothesis import Phase, settings

    from verify.report import environment

    env = environment(impl)
    return [f"conformance: implementation {impl.name} ({impl.version or 'no version'}) on "
            f"{env.get('device')}; arrays {impl.array}/{impl.layout}",
            f"conformance: Hypothesis profile {config.conformance_profile} "
            f"(max_examples={settings.default.max_examples}"
            f"{'' if Phase.shrink in settings.default.phases else ', no shrinking'})"]


@pytest.fixture(scope="session")
def impl(pytestconfig):
    return _load(pytestconfig)


@pytest.fixture(scope="session")
def grad_impl(pytestconfig, impl):
    """The implementation with its gradients (its own, or through autograd or jax.vjp), for
    the gradient properties, which run with --backward."""
    from verify.backward import for_backward

    if not pytestconfig.getoption("--backward"):
        pytest.skip(f"{impl.name}: gradients are tested with --backward")
    try:
        return for_backward(impl)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None


@pytest.fixture(scope="session")
def limits(pytestconfig):
    from .profiles import LIMITS

    return LIMITS[pytestconfig.conformance_profile]


def pytest_terminal_summary(terminalreporter, config):
    """Each broken property on one line (untruncated, whatever the verbosity), then the
    implementation's costs (compile time)."""
    for report in terminalreporter.stats.get("failed", []):
        why = next((ln.strip().removeprefix("E").strip() for ln in report.longreprtext.splitlines()
                    if ln.startswith("E") and "property '" in ln and "' broken for " in ln),
                   None)  # the error's line ("E ..."), not the source line that raised it
        if why:
            terminalreporter.write_line(f"conformance: {report.nodeid.split('::')[-1]}: "
                                        f"{why.removeprefix('AssertionError: ')}")
    impl = config.conformance_impl
    line = impl.costs_line() if impl is not None else None
    if line:
        terminalreporter.write_line(f"conformance: {line}")
