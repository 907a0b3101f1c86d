"""Error bounds: on any input the contract allows, the error is within verify's criterion,
judged per (batch, head): ordinary values, and the values of real models (heads, rows and
keys far apart in magnitude, outlier channels, heavy tails, each dtype's limits)."""
from hypothesis import given
from hypothesis import strategies as st

from .strategies import MODEL_VALUES, assert_holds, cases, seeds


def test_error_within_bound(impl, limits):
    @given(case=cases(impl, limits, values="normal"), seed=seeds())
    def prop(case, seed):
        assert_holds("error bound", impl, case, seed)

    prop()


def test_error_within_bound_on_the_values_of_real_models(impl, limits):
    @given(case=cases(impl, limits, values=st.sampled_from(MODEL_VALUES)), seed=seeds())
    def prop(case, seed):
        assert_holds("error bound, values of real models", impl, case, seed)

    prop()
