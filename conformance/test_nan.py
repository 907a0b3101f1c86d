"""NaN safety (finite in, finite out) and NaN containment (a non-finite input reaches exactly
the outputs it takes part in)."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from .strategies import assert_holds, cases, seeds


def test_finite_inputs_give_finite_outputs(impl, limits):
    """Fully masked rows, extreme scores, ties and tiny values included: no NaN, no inf."""
    masks = st.sampled_from((None, "empty-rows")) if impl.supports.mask else st.none()

    @given(case=cases(impl, limits, values=st.sampled_from(("large", "ties", "tiny", "normal")),
                      mask=masks), seed=seeds())
    def prop(case, seed):
        result = assert_holds("NaN safety", impl, case, seed)
        assert all(c.nonfinite_mismatch == 0 for c in result.comparisons)

    prop()


def test_long_rows_stay_finite(impl, limits):
    long_rows = st.integers(limits["long_n"] // 2, limits["long_n"])

    @given(case=cases(impl, limits, nq=st.integers(1, 4), nk=long_rows, values="large"),
           seed=seeds())
    def prop(case, seed):
        assert_holds("NaN safety on long rows", impl, case, seed)

    prop()


def _needs_containment(impl):
    if not impl.supports.nonfinite_hidden:
        pytest.skip(f"{impl.name} does not claim that hidden NaN/inf values are ignored")


def test_hidden_non_finite_values_change_nothing(impl, limits):
    _needs_containment(impl)
    s = impl.supports
    if not (s.mask or s.kv_lengths):
        pytest.skip(f"{impl.name} claims neither masks nor kv_lengths: nothing can be hidden")

    @given(case=cases(impl, limits, values=st.sampled_from(("nan-hidden", "inf-hidden")),
                      mask=st.sampled_from(("random", None)) if s.mask else st.none(),
                      kv_lengths=st.just("random") if s.kv_lengths else st.none()),
           seed=seeds())
    def prop(case, seed):
        assert_holds("NaN containment (hidden values)", impl, case, seed)

    prop()


def test_visible_nan_reaches_exactly_its_rows(impl, limits):
    _needs_containment(impl)

    @given(case=cases(impl, limits, values="nan-visible", nk=st.integers(2, limits["max_n"])),
           seed=seeds())
    def prop(case, seed):
        assert_holds("NaN containment (visible value)", impl, case, seed)

    prop()
