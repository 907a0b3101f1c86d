"""Masks: all-false rows, a single visible key, the diagonal, block-sparse masks, kv_lengths of
0, 1 and Nk, windows of width 0 and 1, both causal alignments with Nq < Nk and Nq > Nk, and
mixtures."""
from dataclasses import replace

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from verify.cases import BLOCK, BLOCK_MASKS, make_inputs, visibility
from verify.checks import most_hidden_block
from .strategies import assert_holds, cases, seeds


def _claims(impl, feature):
    if not getattr(impl.supports, feature):
        pytest.skip(f"{impl.name} does not claim {feature}")


@pytest.mark.parametrize("kind", ["empty-rows", "single-key", "diagonal", "random",
                                  *BLOCK_MASKS])
def test_mask_kinds(impl, limits, kind):
    """Each kind of mask, block-sparse ones (verify.cases.BLOCK_MASKS) included: a kernel
    that skips tiles must give the dense masked result."""
    _claims(impl, "mask")

    @given(case=cases(impl, limits, mask=kind), seed=seeds())
    def prop(case, seed):
        assert_holds(f"mask {kind}", impl, case, seed)

    prop()


def test_kv_lengths_edges(impl, limits):
    _claims(impl, "kv_lengths")

    @given(case=cases(impl, limits, kv_lengths="edges"), seed=seeds())
    def prop(case, seed):
        assert_holds("kv_lengths 0, 1, Nk", impl, case, seed)

    prop()


@pytest.mark.parametrize("window", [(0, 0), (1, 0), (0, 1), (1, 1)], ids=str)
def test_narrow_windows(impl, limits, window):
    _claims(impl, "window")

    @given(case=cases(impl, limits, window=window), seed=seeds())
    def prop(case, seed):
        assert_holds(f"window {window}", impl, case, seed)

    prop()


@pytest.mark.parametrize("shape", ["Nq<Nk", "Nq>Nk"])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_alignments(impl, limits, alignment, shape):
    if alignment not in impl.supports.causal:
        pytest.skip(f"{impl.name} does not claim causal={alignment!r}")
    n = limits["max_n"]

    @given(data=st.data(), seed=seeds())
    def prop(data, seed):
        a = data.draw(st.integers(1, n - 1), label="shorter")
        b = data.draw(st.integers(a + 1, n), label="longer")
        nq, nk = (a, b) if shape == "Nq<Nk" else (b, a)
        case = data.draw(cases(impl, limits, causal=alignment, nq=nq, nk=nk), label="case")
        assert_holds(f"causal {alignment} {shape}", impl, case, seed)

    prop()


def test_keys_a_row_does_not_see_leave_its_bits_alone(impl, limits):
    """Under a block-sparse mask, other K and V in keys some rows do not see leave those rows'
    outputs bit for bit the same where the implementation claims it (verify's hidden-keys
    check): a kernel that skips the tiles a mask hides agrees with one that reads them."""
    _claims(impl, "mask")

    @given(case=cases(impl, limits, mask="blocks"), seed=seeds())
    def prop(case, seed):
        q, k, v, options = make_inputs(case, seed)
        seen = visibility(case, options, q, k, v)
        first = most_hidden_block(seen)
        assume((~seen[..., first:first + BLOCK].any(axis=-1)).any())  # rows that see none
        assert_holds("hidden keys", impl, replace(case, check="hidden-keys"), seed)

    prop()
