"""Error bounds: on any input the contract allows, the error is within verify's criterion."""
from hypothesis import given

from .strategies import assert_holds, cases, seeds


def test_error_within_bound(impl, limits):
    @given(case=cases(impl, limits, values="normal"), seed=seeds())
    def prop(case, seed):
        assert_holds("error bound", impl, case, seed)

    prop()
