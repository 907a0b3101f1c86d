"""verify's gradients (verify/backward.py): every broken backward kernel fails for its reason,
its unbroken twin, the reference and torch's math backend pass, and every claim is exercised."""
import time

import pytest

import verify
from tests.broken_backward import BUGS, grad
from tests.broken_kernels import kernel
from tests.test_verify import CLAIMS
from verify.adapters import Supports
from verify.backward import backward_battery


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_broken_backward_fails_for_its_reason(bug):
    case_name, phrase = BUGS[bug]
    report = verify.compare(kernel(None), grad=grad(bug), suite="quick", progress=False)
    assert not report.passed
    hit = [r for r in report.failures if r.case.name == case_name]
    assert hit, f"{case_name!r} did not fail; failures: {[r.case.name for r in report.failures]}"
    assert phrase in hit[0].detail, hit[0].detail


def test_a_plan_cached_by_shape_is_caught_whatever_ran_before():
    """The dout-layout-cached kernel (cuDNN's bug 8) escapes a strided dout met first at its
    shapes; the relayout case calls with dout contiguous first, so it fails on its own."""
    from tests.broken_backward import LAYOUTS
    from verify.adapters import Implementation
    from verify.runner import run_case

    impl = Implementation("cached", kernel(None), Supports(backward=True),
                          grad=grad("dout-layout-cached"))
    cases = {c.name: c for c in backward_battery("quick")}
    LAYOUTS.clear()
    assert run_case(impl, cases["backward: dout strided"], seed=1).verdict == "pass"
    LAYOUTS.clear()
    result = run_case(impl, cases["backward: dout strided after contiguous"], seed=1)
    assert result.verdict == "fail" and "mismatched" in result.detail, result.detail
    twin = Implementation("twin", kernel(None), Supports(backward=True), grad=grad(None))
    assert run_case(twin, cases["backward: dout strided after contiguous"], seed=1).verdict \
        == "pass"


def test_a_nan_in_dout_rows_is_caught_too():
    """The dout poison (applied by verify.backward, not make_inputs) fails the backward that
    adds every pair, and not its correct twin."""
    from verify.adapters import Implementation
    from verify.runner import run_case

    case = next(c for c in backward_battery("quick") if c.poison == "dout:inf")
    for bug, verdict in (("products-add-every-pair", "fail"), (None, "pass")):
        impl = Implementation("leaky", kernel(None), Supports(backward=True), grad=grad(bug))
        result = run_case(impl, case, seed=3)
        assert result.verdict == verdict, result.detail
        assert verdict == "pass" or "non-finite" in result.detail, result.detail


def test_the_unbroken_backward_twin_passes():
    report = verify.compare(kernel(None), grad=grad(None), suite="quick", progress=False)
    assert report.passed, str(report)
    assert report.suite == "quick backward" and not report.unexercised


@pytest.mark.parametrize("suite", ["quick", "standard"])
def test_the_reference_passes_the_backward_suites(suite):
    t0 = time.perf_counter()
    report = verify.compare("reference", backward=True, suite=suite, progress=False)
    assert report.passed, str(report)
    assert [r.case for r in report.cases if r.verdict != "pass"] == []
    if suite == "quick":
        assert time.perf_counter() - t0 < 120  # the bound; about 1 s here


def test_torch_math_passes_the_quick_backward_suite():
    pytest.importorskip("torch")
    report = verify.compare("torch-math", backward=True, suite="quick", progress=False)
    assert report.passed, str(report)


@pytest.mark.parametrize("suite", ["quick", "standard", "full"])
@pytest.mark.parametrize("claims", list(CLAIMS))
def test_every_claimed_capability_is_exercised_by_the_backward_battery(suite, claims):
    from dataclasses import replace

    supports = replace(CLAIMS[claims], backward=True)
    cases = backward_battery(suite, supports.dtypes, max_head_dim=supports.max_head_dim)
    cov = supports.coverage(cases, backward=True)
    missing = [cap for cap, names in cov.items() if not names]
    assert not missing, f"verify bug: {claims} claims {missing}, no backward {suite} case"
    assert "lse" not in cov and "backward" in cov


def test_backward_needs_gradients():
    no_grad = verify.Implementation("no-grad", kernel(None), differentiable=False)
    with pytest.raises(ValueError, match="no-grad has no backward pass"):
        verify.compare(no_grad, backward=True, progress=False)
    with pytest.raises(ValueError, match="pass grad=fn"):
        verify.compare(kernel(None), backward=True, progress=False)
    with pytest.raises(ValueError, match="scale suite has no backward"):
        verify.compare("reference", backward=True, suite="scale", progress=False)
    report = verify.compare(kernel(None), supports=Supports(), progress=False, suite="quick",
                            cases=[])
    assert "backward" not in report.coverage  # a forward run answers for no gradients


def test_a_backward_certificate_replays_its_failures(tmp_path):
    report = verify.compare(kernel(None), grad=grad("dk-not-scaled"), suite="quick",
                            progress=False)
    path = tmp_path / "cert.json"
    report.save(str(path))
    again = verify.replay(str(path), kernel(None), grad=grad("dk-not-scaled"), progress=False)
    assert [r.case.name for r in again.cases] == [r.case.name for r in report.failures]
    assert all(r.verdict == "fail" and "dk:" in r.detail for r in again.cases)
    fixed = verify.replay(str(path), kernel(None), grad=grad(None), progress=False)
    assert fixed.passed and len(fixed.cases) == len(report.failures)


def test_a_row_with_all_its_weight_on_one_key_is_judged_with_dp_minus_deltas_rounding():
    """dS = P (dP - delta) is 0 in the truth where a row puts all its weight on one key, and
    the rounding of dP and delta there (here of values near 1e6) is what a correct float32
    backward returns: the floor takes it (found by Hypothesis on a key 2^40 above another)."""
    from tests.broken_backward import CORRECT
    from verify.backward import for_backward
    from verify.cases import Case
    from verify.runner import run_case

    case = Case("one key takes all", B=1, Hq=2, Hk=1, Nq=1, Nk=2, D=1, Dv=16,
                dtype="float32", values="keys", backward=True)
    result = run_case(for_backward(CORRECT), case, seed=1)
    assert result.verdict == "pass", result.detail


def test_a_backward_taking_delta_from_the_rounded_output_is_within_the_rule():
    """A FlashAttention backward takes delta = rowsum(dO * O) from the forward's O in the
    input dtype. Where a row puts nearly all its weight on one key, dP - delta cancels and
    O's float16 rounding is all that is left of it (dq 8% off the truth's own value here, a
    float16 unit at dq's natural scale): the rule's floor takes that rounding. The plain
    backward kernel, given the float64 forward's O rounded to float16, failed dq and dk at
    3.3 and 2.2 times the bound before it did."""
    import numpy as np

    import reference
    from numba_kernels import flash_attention_backward
    from verify.backward import make_dout
    from verify.cases import Case, make_inputs
    from verify.criterion import judge_backward

    case = Case("backward: N = 2, scores x16", B=2, Hq=2, Hk=2, Nq=2, Nk=2, D=16, Dv=16,
                dtype="float16", causal="bottom_right", values="scaled", backward=True)
    q, k, v, options = make_inputs(case, seed=113)
    dout = make_dout(case, 113)
    out, lse = reference.attention(q, k, v, return_lse=True, **options)
    grads = flash_attention_backward(q, k, v, out.astype(np.float16), lse.astype(np.float32),
                                     dout, kernel="plain", **options)
    comparisons = judge_backward(q, k, v, dout, grads, **options)
    assert all(c.passed for c in comparisons), [c.message() for c in comparisons]

