"""numba_kernels/replay.py on the CPU: what a recorded call replays.

A real replay needs torch CUDA tensors (tests/test_gpu.py compares replayed calls
with whole ones on the GPU, bitwise). Here CPU tensors stand in for them and a stand-in plan
records its launches, so the bookkeeping is tested: each recorded pointer is found again
among the new call's inputs, its new buffers and the kept tensors; anything else, a launch
without a plan, or a call that raised leaves its layout without a replay.
"""
from types import SimpleNamespace

import pytest

from numba_kernels import replay

torch = pytest.importorskip("torch")


class Plan:
    """A packed plan whose launches append their (slot, pointer) writes to `launches`."""

    def __init__(self, slots):
        self.pointer_slots = slots
        self.launches = []
        self.packed = self.launches.append


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(replay, "_CALLS", {})


KEPT = torch.zeros(1)


def tensors(n=3, shape=(2, 3)):
    return tuple(torch.randn(shape) for _ in range(n))


def record(key, inputs, extra=None, plan=True):
    """A stand-in call: allocates out and lse, launches one kernel on (k, out, a kept
    tensor, lse, q, extra), and returns out and lse. The plan, or None without one."""
    plan = Plan([(4, 0), (9, 1), (13, 2), (20, 3), (24, 4)] + ([(30, 5)] if extra is not None
                                                              else [])) if plan else None
    with replay.recording(key, inputs) as rec:
        out = replay.allocated(torch.empty((2, 3, 4)))
        lse = replay.allocated(torch.empty((2, 3)))
        args = (inputs[1], out, replay.kept(KEPT), lse, inputs[0]) + (
            () if extra is None else (extra,))
        replay.launched(plan, args)
        if plan is not None:
            plan.launches.append("whole")
        rec.returns((out, lse))
    return plan


def test_a_replay_launches_the_recorded_plan_with_the_new_calls_pointers():
    plan = record("layout", tensors())
    q, k, v = new = tensors()
    out, lse = replay.find("layout").run(new)
    assert out.shape == (2, 3, 4) and lse.shape == (2, 3)
    assert plan.launches[-1] == [(4, k.data_ptr()), (9, out.data_ptr()),
                                 (13, KEPT.data_ptr()), (20, lse.data_ptr()),
                                 (24, q.data_ptr())]
    again = replay.find("layout").run(new)
    assert again[0].data_ptr() != out.data_ptr()  # fresh outputs every call


def test_inputs_that_share_memory_replay_as_shared():
    """q is k when recorded and when replayed: both of the plan's slots take the one new
    pointer (q's slot 24, k's slot 4)."""
    q = torch.randn(2, 3)
    plan = record("self", (q, q, torch.randn(2, 3)))
    x = torch.randn(2, 3)
    replay.find("self").run((x, x, torch.randn(2, 3)))
    slots = dict(plan.launches[-1])
    assert slots[4] == slots[24] == x.data_ptr()


@pytest.mark.parametrize("why", ["unknown pointer", "no plan", "no outputs",
                                 "outputs not allocated", "an empty input"])
def test_what_it_cannot_place_leaves_the_layout_unreplayed(why):
    inputs = tensors()
    if why == "unknown pointer":  # a strided input's contiguous copy, say
        record("layout", inputs, extra=torch.randn(2, 3))
    elif why == "no plan":
        record("layout", inputs, plan=False)
    elif why == "an empty input":  # no memory: its pointer says nothing
        inputs = inputs[:2] + (torch.empty(0),)
        record("layout", inputs)
    else:
        with replay.recording("layout", inputs) as rec:
            replay.launched(Plan([]), ())
            if why == "outputs not allocated":
                rec.returns((torch.empty(1), torch.empty(1)))
    assert replay.find("layout") is None
    with replay.recording("layout", inputs) as rec:  # not recorded again
        assert rec is None


def test_a_call_that_raises_records_nothing():
    with pytest.raises(ValueError):
        with replay.recording("layout", tensors()):
            replay.allocated(torch.empty(2))
            raise ValueError("q has 3 dims")
    assert "layout" not in replay._CALLS
    assert record("layout", tensors()) is not None and replay.find("layout") is not None


def test_recording_does_not_nest_and_outside_it_nothing_is_kept():
    with replay.recording("outer", tensors()) as outer:
        with replay.recording("inner", tensors()) as inner:
            assert inner is None and outer is not None
    assert "inner" not in replay._CALLS
    replay.allocated(torch.empty(1))  # no recording running: no-ops
    replay.launched(None, ())


def test_a_call_returns_what_it_recorded_one_tensor_or_a_tuple():
    """forward returns out alone or (out, lse); the backward (dq, dk, dv): a replay returns
    the same form, from its own new buffers."""
    for key, pick in (("one", lambda out, lse: out), ("three", lambda out, lse: (lse, out, lse))):
        with replay.recording(key, tensors()) as rec:
            out = replay.allocated(torch.empty((2, 3, 4)))
            lse = replay.allocated(torch.empty((2, 3)))
            replay.launched(Plan([(4, 0)]), (out,))
            rec.returns(pick(out, lse))
    one = replay.find("one").run(tensors())
    assert isinstance(one, torch.Tensor) and one.shape == (2, 3, 4)
    a, b, c = replay.find("three").run(tensors())
    assert a.shape == c.shape == (2, 3) and b.shape == (2, 3, 4) and a is c


@pytest.mark.parametrize("inputs, options", [
    (tensors(), (None, False)),  # CPU tensors
    ((SimpleNamespace(),) * 3, (None,)),  # not torch
    (tensors(), ([1, 2],)),  # a list: not a plain value
    (tensors(), (torch.tensor(0.5),)),  # a tensor scale
])
def test_only_torch_cuda_calls_with_plain_options_have_a_key(inputs, options):
    assert replay.call_key(inputs, options) is None
