"""verify.compare(impl, world_size=N): a distributed implementation on gloo ranks (CPU
processes, the simulator), its rows put back in place and judged by the one rule; a failure
names the ranks whose rows fail."""
import pytest

import verify
from verify.adapters import Implementation, Supports
from verify.backward import backward_battery
from verify.cases import Case, battery

pytestmark = pytest.mark.usefixtures("every_core")  # spawned ranks: tests/conftest.py

pytest.importorskip("torch")
NAMES = ("causal top_left 29x31", "large scores [float32]")
RING = Supports(mask=False, bias=False)  # what ring attention claims


def _broken(name, **kw):
    """A per-rank implementation of tests/broken_distributed.py."""
    import tests.broken_distributed as broken

    return Implementation(name, getattr(broken, name), RING, array="torch", **kw)


def _sharded(name, backward=False):
    make = backward_battery if backward else battery
    return [(c, 0) for c in make("quick", ("float32",), sharded=True) if c.name.startswith(name)]


def _cases():
    chosen = [c for c in battery("quick", ("float32",)) if c.name in NAMES]
    assert len(chosen) == len(NAMES), [c.name for c in chosen]
    return [(c, i) for i, c in enumerate(chosen)]


@pytest.mark.parametrize("scheme", ["numba-ring", "numba-allgather"])
def test_our_schemes_on_two_ranks_are_certified(scheme):
    # one case each for CI's time: large scores for the ring, the causal band for the other
    cases = _cases()[1:] if scheme == "numba-ring" else _cases()[:1]
    report = verify.compare(scheme, world_size=2, shard_layout="zigzag", cases=cases,
                            progress=False)
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
    with pytest.raises(TypeError, match="grad must be callable"):
        verify.compare("numba-ring", world_size=2, grad="not a function", progress=False)


def test_ring_gradients_on_two_ranks_are_certified_where_later_ranks_hide_nan():
    """The gradients across ranks (autograd on every rank, dq put back by the rows of q, dk
    and dv by those of k), on the case whose later shards' keys are all hidden and NaN."""
    report = verify.compare("numba-ring", world_size=2, backward=True, progress=False,
                            cases=_sharded("ranks: NaN in every hidden key", backward=True))
    assert len(report.cases) == 1 and report.passed, report


@pytest.mark.parametrize("name, case, layout, owner", [
    # the zigzag chunks taken late one first: a causal band seen wrongly
    ("wrong_zigzag_order", "ranks: more ranks than rows", "zigzag", None),
    # rank 1's rows placed at 1 x its own length: right only for equal shards
    ("offsets_from_own_length", "ranks: more ranks than rows", "contiguous", None),
    ("drops_last_shard", "ranks: more ranks than rows", "contiguous", "rank 1's"),
    # kv_lengths counted in each rank's own keys: rank 1's hidden keys (and NaN) seen
    ("local_kv_lengths", "ranks: NaN in every hidden key", "zigzag", None),
])
def test_each_sharding_bug_fails_its_case(name, case, layout, owner):
    report = verify.compare(_broken(name), world_size=2, shard_layout=layout,
                            cases=_sharded(case), progress=False)
    assert len(report.cases) == 1 and not report.passed, report
    assert "ranks: out: worst at row" in report.failures[0].detail
    if owner:
        assert owner in report.failures[0].detail, report.failures[0].detail


def test_a_backward_that_reuses_its_first_k_and_v_fails():
    """The forward right, the backward's second step on stale K and V: dq, dk, dv fail."""
    from numba_kernels.distributed.ring import ring_attention
    import tests.broken_distributed as broken

    impl = Implementation("stale", ring_attention, RING, array="torch",
                          grad=broken.stale_kv_grad)
    case = Case("stale K and V", B=1, Hq=1, Hk=1, Nq=16, Nk=16, D=8, Dv=8, dtype="float32",
                causal="top_left", backward=True)
    report = verify.compare(impl, world_size=2, backward=True, cases=[(case, 0)],
                            progress=False)
    assert not report.passed, report
    assert "dq: mismatched" in report.failures[0].detail, report.failures[0].detail


def test_a_rank_that_raises_is_named_and_the_next_call_starts_anew():
    """A rank that raises mid-call leaves the others waiting on it: they give up within
    the call's time, every rank's error is reported, and the next call runs on new ranks."""
    impl = _broken("raises_on_rank_1", timeout_s=8.0)  # the ranks wait 2 s for each other
    cases = _sharded("ranks: more ranks than rows")
    report = verify.compare(impl, world_size=2, cases=cases * 2, progress=False)
    assert [r.verdict for r in report.cases] == ["fail", "fail"], report
    for result in report.cases:  # the second found the ranks to answer it
        assert "rank 1: raised ValueError: rank 1 gives up" in result.detail, result.detail


def last_first(n, world_size):
    """A shard layout of one's own (the last rank's rows first), importable by name."""
    from tests.test_distributed import _last_first

    return _last_first(n, world_size)


def test_a_layout_of_ones_own_shards_the_cases_and_the_ring():
    """shard_layout as a function: verify shards and puts back by it, the ring takes it
    (split.split_call reads it through shard_ranges), and the certificate names it; a
    name that is not one is refused by name."""
    from verify.distributed import layout_named

    layout = layout_named("tests.test_verify_distributed:last_first")
    report = verify.compare("numba-ring", world_size=2, shard_layout=layout,
                            cases=_cases()[:1], progress=False)
    assert report.passed, report
    assert "(last_first)" in report.implementation["name"]
    with pytest.raises(ValueError, match="shard layout must be one of"):
        layout_named("striped")


def gathered_keys(q, k, v, *, layout, group, scale=None, return_lse=False, **options):
    """Attention without a mask on the ranks' keys gathered whole (torch alone: a call takes
    milliseconds), for calls whose time is short."""
    import torch
    import torch.distributed as dist

    assert not any(options.get(n) for n in ("causal", "mask", "bias", "window")), options
    size = dist.get_world_size(group)
    keys, values = ([torch.empty_like(x) for _ in range(size)] for x in (k, v))
    dist.all_gather(keys, k.contiguous(), group=group)  # shards of equal length here
    dist.all_gather(values, v.contiguous(), group=group)
    k, v = torch.cat(keys, dim=2).double(), torch.cat(values, dim=2).double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scale * q.double() @ k.transpose(-1, -2)
    out = (torch.softmax(s, dim=-1) @ v).to(q.dtype)
    return (out, torch.logsumexp(s, dim=-1).float()) if return_lse else out


def test_the_ranks_start_is_not_bounded_by_a_calls_time():
    """A worker rank takes seconds to start (a process importing torch); a call's time of 2 s
    bounds the calls, not the start."""
    impl = Implementation("gathered keys", gathered_keys, RING, array="torch", timeout_s=2.0)
    case = Case("start", B=1, Hq=2, Hk=2, Nq=8, Nk=8, D=8, Dv=8, dtype="float32")
    report = verify.compare(impl, world_size=2, cases=[(case, 0)], progress=False)
    assert report.passed, report
