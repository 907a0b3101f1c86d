"""The conformance suite as a kernel author runs it: implementation selection, the options,
and what a failure says. Each test runs pytest on conformance/ in a fresh process, against
NumPy kernels (tests/broken_kernels.py), so it needs no GPU and no simulator."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_conformance(*args):
    cmd = [sys.executable, "-m", "pytest", "conformance/test_shapes.py", "-p", "no:cacheprovider",
           "--tb=no", "-W", "ignore", *args]
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_broken_kernel_fails_and_the_summary_says_why():
    run = run_conformance("-k", "tile_boundaries", "--impl", "tests.broken_kernels:BROKEN_SCALE",
                          "--max-examples", "3", "--no-shrink")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Hypothesis profile ci (max_examples=3, no shrinking)" in run.stdout
    assert ("conformance: test_tile_boundaries: property 'tile boundaries' broken for "
            "tests.broken_kernels:BROKEN_SCALE: out: mismatched elements") in run.stdout, run.stdout


def test_a_correct_kernel_passes():
    run = run_conformance("-k", "tile_boundaries or many_heads", "--impl",
                          "tests.broken_kernels:CORRECT", "--max-examples", "3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout


def test_bad_options_are_usage_errors():
    run = run_conformance("--max-examples", "0")
    assert run.returncode == 4 and "--max-examples must be at least 1" in run.stderr
    run = run_conformance("--impl", "no_such_module:fn")
    assert run.returncode == 4
    assert "cannot load implementation 'no_such_module:fn'" in run.stderr


def test_runs_from_another_directory(tmp_path):
    """A kernel author's own repository: `pytest --pyargs conformance` with every option the
    README shows, found through the installed plugin (pyproject's pytest11 entry point)."""
    (tmp_path / "mykernel.py").write_text(
        "from tests.broken_kernels import CORRECT as attention\n")
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "conformance", "-p", "no:cacheprovider",
           "-k", "tile_boundaries", "--impl", "mykernel:attention", "--profile", "ci",
           "--max-examples", "2", "--no-shrink", "-q"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout and "unrecognized arguments" not in run.stderr


def run_gradient_properties(select, impl, *extra, examples=3):
    """pytest on conformance/test_gradients.py's properties `select` (-k) against impl."""
    cmd = [sys.executable, "-m", "pytest", "conformance/test_gradients.py", "-p",
           "no:cacheprovider", "--tb=no", "-W", "ignore", "-k", select, "--impl", impl,
           "--max-examples", str(examples), "--no-shrink", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=600)


def test_the_gradient_properties_catch_a_broken_backward():
    """With --backward, a dK that misses the scale breaks the gradient properties; its
    correct twin passes them; without it they are skipped."""
    def run(impl, *extra):
        return run_gradient_properties("error_within or gqa", impl, *extra)

    skipped = run("tests.broken_backward:DK_NOT_SCALED")
    assert skipped.returncode == 0 and "2 skipped" in skipped.stdout, skipped.stdout
    broken = run("tests.broken_backward:DK_NOT_SCALED", "--backward")
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "property 'gradient GQA' broken for broken backward [dk-not-scaled]: " \
           "dk: mismatched" in broken.stdout, broken.stdout
    correct = run("tests.broken_backward:CORRECT", "--backward")
    assert correct.returncode == 0 and "2 passed" in correct.stdout, correct.stdout


def test_the_block_mask_gradient_property_catches_a_backward_that_skips_partial_tiles():
    """A backward that leaves a partly visible tile's pairs out of the gradients breaks the
    gradient property under block masks; its correct twin passes it."""
    def run(impl):
        return run_gradient_properties("gradient_masks and blocks", impl, "--backward",
                                       examples=8)

    broken = run("tests.broken_backward:PARTIAL_TILE_SKIPPED")
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "property 'gradient mask blocks' broken for broken backward " \
           "[partial-tile-skipped]" in broken.stdout, broken.stdout
    correct = run("tests.broken_backward:CORRECT")
    assert correct.returncode == 0 and "1 passed" in correct.stdout, correct.stdout


def test_the_nan_rows_property_catches_a_backward_that_adds_every_pair():
    """A backward whose dV and dK are plain products (0 * NaN for the pairs that take no
    part) breaks the NaN-rows property; its correct twin passes it."""
    broken = run_gradient_properties("nan_in_rows", "tests.broken_backward:LEAKS_NAN_ROWS",
                                     "--backward")
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "property 'gradient NaN rows' broken" in broken.stdout, broken.stdout
    correct = run_gradient_properties("nan_in_rows", "tests.broken_backward:CORRECT",
                                      "--backward")
    assert correct.returncode == 0 and "1 passed" in correct.stdout, correct.stdout


def test_the_strategies_draw_only_what_an_implementation_claims():
    """A property that calls the implementation directly (the lse merge) must never hand it a
    case it does not claim: head dims outside a multiple, dtypes, masks (found on the GPU: the
    tensor-core kernel was given D = 1)."""
    from hypothesis import given, settings

    from conformance.strategies import cases
    from verify.adapters import Implementation, Supports

    impl = Implementation("mma-like", lambda *a, **k: None,
                          Supports(dtypes=("float16",), max_head_dim=128, head_dim_multiple=8,
                                   mask=False))
    limits = {"max_n": 64, "max_d": 256, "max_bh": 8, "long_n": 64}
    drawn = []

    @settings(max_examples=60, database=None, deadline=None)
    @given(case=cases(impl, limits))
    def prop(case):
        drawn.append(case)
        assert impl.supports.claims(case)[0], case

    prop()
    assert drawn and {c.D for c in drawn} <= {16, 40, 64, 128}


def test_the_strategies_draw_lengths_and_head_dims_as_claimed():
    """A kernel that takes equal lengths, multiples of 16 and a set of head dims is drawn
    only such cases, without Hypothesis filtering most draws away."""
    from hypothesis import HealthCheck, given, settings

    from conformance.strategies import cases
    from verify.adapters import Implementation, Supports

    impl = Implementation("tutorial-like", lambda *a, **k: None,
                          Supports(dtypes=("float16",), equal_lengths=True, length_multiple=16,
                                   head_dims=(16, 64), dv_differs=False))
    limits = {"max_n": 64, "max_d": 256, "max_bh": 8, "long_n": 64}
    drawn = []

    @settings(max_examples=40, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases(impl, limits))
    def prop(case):
        drawn.append(case)
        assert case.Nq == case.Nk and case.Nq % 16 == 0 and case.D in (16, 64), case

    prop()
    assert len(drawn) == 40


def test_the_gradient_properties_draw_at_most_grad_max_scores():
    """The gradient properties' cases stay within GRAD_MAX_SCORES at the gpu profile's sizes
    (the float64 backward on the host is their cost), and can still be 4096 long."""
    from hypothesis import given, settings

    from conformance.profiles import LIMITS
    from conformance.strategies import GRAD_MAX_SCORES
    from conformance.test_gradients import cases
    from verify.adapters import Implementation, Supports

    impl = Implementation("any", lambda *a, **k: None,
                          Supports(dtypes=("float32",), max_head_dim=256))
    drawn = []

    @settings(max_examples=80, database=None, deadline=None)
    @given(case=cases(impl, LIMITS["gpu"], nq=4096))
    def prop(case):
        drawn.append(case)
        assert case.B * case.Hq * case.Nq * case.Nk <= GRAD_MAX_SCORES, case

    prop()
    assert drawn


def test_the_suite_calls_the_implementation_warm_hook_once(tmp_path):
    """pytest conformance calls Implementation.warm once before the tests (ours compile their
    kernels there), saying whether gradients will be asked for, and shows what it says."""
    log = tmp_path / "warm.log"
    for extra, expected in (((), "backward=False"), (("--backward",), "backward=True")):
        cmd = [sys.executable, "-m", "pytest", "conformance/test_gradients.py", "-p",
               "no:cacheprovider", "--tb=no", "-W", "ignore", "-k", "gqa", "--impl",
               "tests.broken_backward:WARMED", "--max-examples", "1", "--no-shrink", *extra]
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, PYTHONPATH=ROOT, FLASH_WARM_LOG=str(log)))
        assert run.returncode == 0, run.stdout + run.stderr
        assert "conformance: warm hook called" in run.stdout, run.stdout
        assert log.read_text().splitlines()[-1] == expected
    assert len(log.read_text().splitlines()) == 2


def run_sharding(*args):
    """The sharding properties (conformance/test_sharding.py) with these options."""
    cmd = [sys.executable, "-m", "pytest", "conformance/test_sharding.py", "-p",
           "no:cacheprovider", "--tb=no", "-W", "ignore", *args]
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_world_size_options_are_usage_errors_where_they_cannot_apply():
    run = run_sharding("--impl", "numba-ring")
    assert run.returncode == 4 and "pass --world-size N" in run.stderr, run.stderr
    run = run_sharding("--impl", "numba", "--world-size", "2")
    assert run.returncode == 4 and "runs on one device" in run.stderr, run.stderr
    run = run_sharding("--impl", "tests.broken_kernels:CORRECT")  # without ranks: skipped
    assert run.returncode == 0 and "3 skipped" in run.stdout, run.stdout


def test_the_sharding_properties_catch_a_wrong_zigzag_order():
    run = run_sharding("-k", "split_problems", "--impl", "tests.broken_distributed:WRONG_ZIGZAG",
                       "--world-size", "2", "--max-examples", "4", "--no-shrink")
    assert run.returncode == 1, run.stdout + run.stderr
    assert ("property 'the error bound across ranks' broken for wrong zigzag order on 2 ranks "
            "(zigzag)") in run.stdout, run.stdout


def test_each_xdist_worker_takes_its_own_gpu(monkeypatch):
    from conformance import conftest

    class Config:
        workerinput = {"workerid": "gw5"}

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(conftest, "gpu_count", lambda: 4)
    conftest._one_gpu_a_worker(Config())  # noqa: SLF001 - the hook's own helper
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # the user's choice stands
    conftest._one_gpu_a_worker(Config())  # noqa: SLF001
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
