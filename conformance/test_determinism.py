"""Determinism (two runs bitwise equal) and input immutability (checked on every run)."""
from hypothesis import given

from .strategies import assert_holds, cases, seeds


def test_two_runs_bitwise_equal_and_inputs_untouched(impl, limits):
    @given(case=cases(impl, limits), seed=seeds())
    def prop(case, seed):
        from dataclasses import replace

        assert_holds("determinism", impl, replace(case, repeat=True, strided=True), seed)

    prop()
