"""verify.compare(impl, world_size=N): a distributed implementation on gloo ranks (CPU
processes, the simulator), its rows put back in place and judged by the one rule; a failure
names the ranks whose rows fail."""
import pytest

import verify
from verify.cases import battery

pytest.importorskip("torch")
NAMES = ("causal top_left 29x31", "large scores [float32]")


def _cases():
    chosen = [c for c in battery("quick", ("float32",)) if c.name in NAMES]
    assert len(chosen) == len(NAMES), [c.name for c in chosen]
    return [(c, i) for i, c in enumerate(chosen)]


def test_ring_attention_on_two_ranks_is_certified():
    report = verify.compare("numba-ring", world_size=2, shard_layout="zigzag",
                            cases=_cases(), progress=False)
    assert report.passed, report
    assert "on 2 ranks (zigzag)" in report.implementation["name"]


def test_a_rank_that_keeps_its_own_keys_fails_on_the_other_ranks_rows():
    from verify.adapters import Implementation, Supports

    impl = Implementation("own keys only", __import__(
        "tests.broken_distributed", fromlist=["own_keys_only"]).own_keys_only,
        Supports(mask=False, bias=False), array="torch")
    causal = [(c, seed) for c, seed in _cases() if c.name == NAMES[0]]
    report = verify.compare(impl, world_size=2, cases=causal, progress=False)
    assert not report.passed
    failed = report.failures[0]
    assert "mismatched" in failed.detail and "ranks: out: worst at row" in failed.detail
    assert "rank 1's" in failed.detail and "rank 0's" not in failed.detail, failed.detail


def test_a_merge_without_the_shift_overflows_where_ranks_parts_are_far_apart():
    """The textbook lse merge (no shift by the larger part) on two ranks: under large scores
    the ranks' parts of a row differ past float32's exp range, and the rows come back
    non-finite (the ring's own merge passes the same case: the test above)."""
    from verify.adapters import Implementation, Supports

    case = [(c, 0) for c in battery("quick", ("float32",)) if c.name == "large scores [float32]"]
    impl = Implementation("naive merge", __import__(
        "tests.broken_distributed", fromlist=["naive_merge"]).naive_merge,
        Supports(mask=False, bias=False), array="torch")
    report = verify.compare(impl, world_size=2, cases=case, progress=False)
    assert not report.passed and "non-finite" in report.failures[0].detail, report


def test_world_size_is_refused_where_it_cannot_mean_anything():
    with pytest.raises(ValueError, match="world_size must be an integer"):
        verify.compare("numba-ring", world_size=0, cases=_cases()[:1], progress=False)
    with pytest.raises(ValueError, match="pass world_size"):
        verify.compare("numba-ring", cases=_cases()[:1], progress=False)
    with pytest.raises(ValueError, match="backward across ranks"):
        verify.compare("numba-ring", world_size=2, backward=True, progress=False)
