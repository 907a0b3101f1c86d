"""Shapes: sizes across tile boundaries and primes, decoding (Nq = 1), a single key, many
heads, grouped-query ratios, and every head dim the implementation claims."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from verify.cases import Case

from .strategies import AWKWARD, HEAD_DIMS, assert_holds, cases, check_case, seeds


@pytest.mark.parametrize("which", ["Nq=1", "Nk=1"])
def test_single_row_or_key(impl, limits, which):
    pin = dict(nq=1) if which == "Nq=1" else dict(nk=1)

    @given(case=cases(impl, limits, **pin), seed=seeds())
    def prop(case, seed):
        assert_holds(which, impl, case, seed)

    prop()


def test_tile_boundaries(impl, limits):
    sizes = st.sampled_from([n for n in AWKWARD if n <= limits["max_n"]])

    @given(case=cases(impl, limits, nq=sizes, nk=sizes), seed=seeds())
    def prop(case, seed):
        assert_holds("tile boundaries", impl, case, seed)

    prop()


def test_grouped_query_ratios(impl, limits):
    if not impl.supports.gqa:
        pytest.skip(f"{impl.name} does not claim grouped-query attention")

    @given(case=cases(impl, limits, gqa=st.sampled_from((2, 3, 4))), seed=seeds())
    def prop(case, seed):
        assert_holds("GQA", impl, case, seed)

    prop()


def test_many_heads(impl, limits):
    case = Case("many heads", limits["max_bh"], 1, 1, 3, 5, 16, 16, impl.supports.dtypes[0])
    check_case("B * H large", impl, case)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_every_claimed_head_dim(impl, limits, d):
    if d > impl.supports.max_head_dim:
        pytest.skip(f"{impl.name} claims head dims up to {impl.supports.max_head_dim}")
    case = Case(f"head dim {d}", 1, 2, 2, 17, 33, d, d, impl.supports.dtypes[0],
                causal=impl.supports.causal[0] if impl.supports.causal else False)
    check_case(f"head dim {d}", impl, case)
