"""Properties of attention split across ranks by sequence (`pytest conformance --world-size N`;
skipped without it). The whole suite then holds of the ranks' rows put back in place; these
draw what breaks a split: lengths just off the world size's multiples, causal bands and
windows across shard edges, every key past the first shard hidden (and NaN there), ranks'
parts of a row far apart, and the same bits from two runs."""
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .strategies import assert_holds, cases, seeds


@pytest.fixture(scope="module")
def world_size(pytestconfig):
    n = pytestconfig.getoption("--world-size")
    if n is None:
        pytest.skip("the sharding properties run with --world-size N")
    return n


def near_multiples(world_size, limit):
    """Lengths at, just below and just above multiples of 2 W (zigzag's chunks) up to limit,
    and fewer than W."""
    chunks = 2 * world_size
    options = {n for m in range(chunks, limit + 1, chunks) for n in (m - 1, m, m + 1)}
    options |= set(range(1, world_size + 1))
    return st.sampled_from(sorted(n for n in options if 1 <= n <= limit))


def test_split_problems_meet_the_error_bound(impl, limits, world_size):
    lengths = near_multiples(world_size, limits["max_n"])
    windows = st.none() | st.tuples(st.integers(0, 8), st.integers(0, 8))

    @given(case=cases(impl, limits, nq=lengths, nk=lengths,
                      window=windows if impl.supports.window else st.none(),
                      values=st.sampled_from(("normal", "large"))), seed=seeds())
    def prop(case, seed):
        assert_holds("the error bound across ranks", impl, case, seed)

    prop()


def test_keys_hidden_on_every_later_rank_change_nothing(impl, limits, world_size):
    """kv_lengths within the first of 8 shards' keys (every rank but the first holds only
    hidden keys, for W <= 4 under either layout), their values NaN or ordinary."""
    if not impl.supports.kv_lengths:
        pytest.skip(f"{impl.name} does not claim kv_lengths")
    values = ("normal", "nan-hidden") if impl.supports.nonfinite_hidden else ("normal",)

    @given(case=cases(impl, limits, kv_lengths="prefix", values=st.sampled_from(values),
                      nk=near_multiples(world_size, limits["max_n"])), seed=seeds())
    def prop(case, seed):
        assert_holds("hidden keys on later ranks", impl, case, seed)

    prop()


def test_two_runs_give_the_same_bits(impl, limits, world_size):
    @given(case=cases(impl, limits, nq=near_multiples(world_size, limits["max_n"])),
           seed=seeds())
    def prop(case, seed):
        assert_holds("determinism across ranks", impl, replace(case, repeat=True), seed)

    prop()
