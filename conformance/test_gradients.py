"""Gradients (dq, dk, dv; verify.backward): error bounds, rows that see no key and hidden keys,
NaN containment (in hidden keys, and in rows of Q and dO that some keys do not see),
grouped-query reductions, determinism. Run with --backward."""
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .strategies import GRAD_MAX_SCORES, assert_holds, cases as any_cases, seeds


def _backward(case, **fields):
    return replace(case, backward=True, **fields)


def cases(impl, limits, **fields):
    """The cases of a gradient property: sized for the float64 backward on the host."""
    return any_cases(impl, limits, max_scores=GRAD_MAX_SCORES, **fields)


def test_gradient_error_within_bound(grad_impl, limits):
    @given(case=cases(grad_impl, limits, values=st.sampled_from(
           ("normal", "large", "tiny", "heads-held", "keys", "outliers"))), seed=seeds())
    def prop(case, seed):
        assert_holds("gradient error bound", grad_impl, _backward(case), seed)

    prop()


@pytest.mark.parametrize("kind", ["empty-rows", "single-key", "blocks"])
def test_gradient_masks(grad_impl, limits, kind):
    """The gradients within their bound under masks that empty rows, leave one key, or hide
    whole blocks (verify.cases.BLOCK_MASKS: tiles skipped, partly and wholly visible)."""
    if not grad_impl.supports.mask:
        pytest.skip(f"{grad_impl.name} does not claim mask")

    @given(case=cases(grad_impl, limits, mask=kind), seed=seeds())
    def prop(case, seed):
        assert_holds(f"gradient mask {kind}", grad_impl, _backward(case), seed)

    prop()


def test_gradient_nan_in_hidden_keys_reaches_nothing(grad_impl, limits):
    if not (grad_impl.supports.kv_lengths and grad_impl.supports.nonfinite_hidden):
        pytest.skip(f"{grad_impl.name} does not claim kv_lengths and hidden NaN containment")

    @given(case=cases(grad_impl, limits, kv_lengths="random", values="nan-hidden"),
           seed=seeds())
    def prop(case, seed):
        assert_holds("gradient NaN containment", grad_impl, _backward(case), seed)

    prop()


def test_gradient_nan_in_rows_reaches_only_the_keys_they_see(grad_impl, limits):
    """A NaN in a row of Q and one of dO (a row that sees some keys and not others, under a
    causal band): the keys the row does not see keep finite dk and dv."""
    causal = grad_impl.supports.causal
    if not (causal and grad_impl.supports.nonfinite_hidden):
        pytest.skip(f"{grad_impl.name} does not claim causal and NaN containment")

    @given(case=cases(grad_impl, limits, causal=st.sampled_from(tuple(causal)), mask=st.none(),
                      window=st.none(), kv_lengths=st.none(), values="normal",
                      nq=st.integers(2, limits["max_n"]), nk=st.integers(2, limits["max_n"])),
           seed=seeds())
    def prop(case, seed):
        assert_holds("gradient NaN rows", grad_impl, _backward(case, poison="q:nan,dout:nan"),
                     seed)

    prop()


def test_gradient_gqa_reductions(grad_impl, limits):
    if not grad_impl.supports.gqa:
        pytest.skip(f"{grad_impl.name} does not claim grouped-query attention")

    @given(case=cases(grad_impl, limits, gqa=st.sampled_from((2, 3, 4))), seed=seeds())
    def prop(case, seed):
        assert_holds("gradient GQA", grad_impl, _backward(case), seed)

    prop()


def test_gradient_two_runs_bitwise_equal(grad_impl, limits):
    @given(case=cases(grad_impl, limits), seed=seeds())
    def prop(case, seed):
        assert_holds("gradient determinism", grad_impl,
                     _backward(case, repeat=True, strided=True, dout="strided"), seed)

    prop()
