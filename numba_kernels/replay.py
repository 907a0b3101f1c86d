"""Calls of one layout, replayed: the first call's launches, recorded once.

Which kernels a call (forward.forward, backward.flash_attention_backward) launches, on which
grids, with which scalars, and which buffers it allocates depend only on its layout: the
inputs' dtypes, shapes, strides, devices and which of them share memory, the options, the
stream. So the first torch call of a layout takes the api's whole path and records it
(`recording`): each launch's packed plan (launch.py) and where each of its data pointers
came from, an input, a buffer the call allocated (io.empty, io.scratch) or a tensor the api
keeps (io's constants). A later call of that layout allocates the same buffers anew and
launches the same plans with its own pointers (`Replay.run`): no argument checks, kernel
choice or per-launch bookkeeping, whose host time the GPU otherwise waits for on every call
that starts from an idle GPU.

Only torch CUDA tensors without kv_lengths, spec or dlse are replayed (the host reads
kv_lengths' values; dlse is subtracted by a torch operation, not a launch), with options of
plain Python values; a mask and a bias are inputs like q, k and v (their pre-passes are
launches). The layout holds each input's data pointer modulo 16: a pre-pass that reads a
mask as words of four keys is chosen by its alignment. A call whose recording meets anything
else (a launch without a packed plan, a pointer that is neither an input, an allocated
buffer nor a kept tensor: a strided input's contiguous copy) marks its layout as not
replayable, and every call of it takes the whole path.
"""
import sys
import threading
from contextlib import contextmanager

import numpy as np

MAX_CALLS = 1024
_CALLS = {}  # layout -> Replay, or None where the layout cannot be replayed
_ACTIVE = threading.local()  # .recording: this thread's _Recording, or None
REPLAYED = [0]  # calls that were replayed (for the GPU checks)
PLAIN = (type(None), bool, int, float, str, np.integer, np.floating)


def call_key(inputs, options):
    """The layout of a call with torch CUDA tensors `inputs` and `options` (a tuple of plain
    values), or None where the call is not one to replay."""
    torch = sys.modules.get("torch")
    if torch is None or not all(type(x) is torch.Tensor and x.is_cuda for x in inputs):
        return None
    if not all(_plain(o) for o in options):
        return None
    ptrs = [x.data_ptr() for x in inputs]
    shared = tuple(a == b for i, a in enumerate(ptrs) for b in ptrs[i + 1:])
    stream = torch.cuda.current_stream(inputs[0].device).cuda_stream
    layouts = tuple((x.dtype, x.shape, x.stride(), x.device, p % 16)
                    for x, p in zip(inputs, ptrs))
    return layouts, shared, stream, tuple((type(o), o) for o in options)


def _plain(value):
    if isinstance(value, tuple):
        return all(isinstance(x, PLAIN) for x in value)
    return isinstance(value, PLAIN)


def forget():
    """Drop every recorded layout: the next call of each takes the whole path again."""
    _CALLS.clear()


def find(key):
    """The Replay of a layout seen before, else None."""
    return None if key is None else _CALLS.get(key)


@contextmanager
def recording(key, inputs):
    """Record the launches and allocations of the call inside this block (key None, or a
    recording already running in this thread: nothing is recorded); when the block ends
    without an exception, remember the layout's Replay (or that it has none). The block
    calls `returns` with what the call returns."""
    if key is None or getattr(_ACTIVE, "recording", None) is not None or key in _CALLS:
        yield None
        return
    rec = _ACTIVE.recording = _Recording(inputs)
    try:
        yield rec
    finally:
        _ACTIVE.recording = None
    if len(_CALLS) >= MAX_CALLS:  # many layouts (varying sequence lengths): start over
        _CALLS.clear()
    _CALLS[key] = rec.replay()


def launched(plan, args):
    """launch.py: a launch was made with `plan` (None: no packed plan) and `args`."""
    rec = getattr(_ACTIVE, "recording", None)
    if rec is not None:
        rec.launches.append((plan, None if plan is None else [
            (slot, args[i].data_ptr()) for slot, i in plan.pointer_slots]))


def allocated(tensor):
    """The api allocated `tensor` for this call (its contents are not read before written)."""
    rec = getattr(_ACTIVE, "recording", None)
    if rec is not None:
        rec.allocated.append(tensor)
    return tensor


def kept(tensor):
    """The api passes `tensor`, which it keeps for the process, to this call's kernels."""
    rec = getattr(_ACTIVE, "recording", None)
    if rec is not None and all(t is not tensor for t in rec.kept):
        rec.kept.append(tensor)
    return tensor


class _Recording:
    def __init__(self, inputs):
        self.inputs = [x.data_ptr() for x in inputs]
        self.allocated, self.kept, self.launches = [], [], []
        self.outputs = None

    def returns(self, result):
        """The call returns `result`: one tensor it allocated, or a tuple of them."""
        self.outputs = result

    def replay(self):
        """The Replay of what was recorded, or None where something cannot be replayed."""
        known = self.inputs + [t.data_ptr() for t in self.allocated + self.kept]
        if self.outputs is None or 0 in known:  # 0: an empty tensor, no memory to tell by
            return None
        launches = []
        for plan, writes in self.launches:
            if plan is None or any(ptr not in known for _, ptr in writes):
                return None
            launches.append((plan, [(slot, known.index(ptr)) for slot, ptr in writes]))
        single = not isinstance(self.outputs, tuple)
        outputs = (self.outputs,) if single else self.outputs
        ids = [id(t) for t in self.allocated]
        if any(id(t) not in ids for t in outputs):
            return None
        return Replay([(t.shape, t.dtype, t.device) for t in self.allocated], self.kept,
                      launches, [ids.index(id(t)) for t in outputs], single)


class Replay:
    """A recorded call: buffers to allocate, kept tensors, launches whose data-pointer
    slots each name an index into (inputs, new buffers, kept tensors), and the buffers the
    call returns (their indices; single: the one, not a tuple)."""

    def __init__(self, buffers, kept_tensors, launches, outputs, single):
        self.buffers, self.kept_tensors, self.launches = buffers, kept_tensors, launches
        self.kept_ptrs = [t.data_ptr() for t in kept_tensors]
        self.outputs, self.single = outputs, single

    def run(self, inputs):
        torch = sys.modules["torch"]
        new = [torch.empty(shape, dtype=dtype, device=device)
               for shape, dtype, device in self.buffers]
        ptrs = [x.data_ptr() for x in inputs] + [t.data_ptr() for t in new] + self.kept_ptrs
        for plan, sources in self.launches:
            plan.packed([(slot, ptrs[i]) for slot, i in sources])
        REPLAYED[0] += 1
        result = tuple(new[i] for i in self.outputs)
        return result[0] if self.single else result
