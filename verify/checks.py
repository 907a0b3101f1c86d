"""The call checks (cases.CHECKS): properties of a call that one call cannot show, run at the
kernel's minimal claim. Each runner takes (impl, case, seed, inputs) and returns (inputs the
result is judged against, out, lse, notes) like pipeline.call_and_check, or raises calling.Fail.

    fresh-inputs   a cache keyed on pointers, shapes or values returns a stale answer
    batch-alone    a result that depends on the rest of the batch (bitwise, when claimed)
    stream         work launched on another stream than the caller's current one
    out-buffer     writes outside the caller's out= view
    hidden-keys    a row's output changed by keys it does not see (bitwise, when claimed)
"""
import numpy as np

from reference.dtypes import cast
from .cases import BLOCK, VacuousCase, make_inputs, visibility
from .calling import Fail, bits, call, converter, to_impl, unpack
from .pipeline import call_and_check, judge_result

FRESH_SEED = 1_000_003  # the second inputs of fresh-inputs: seed + this
SENTINEL = 12345.0  # what out-buffer's guard bytes hold
SLEEP_CYCLES = 200_000_000  # the stream check's delay on the caller's stream (~0.1 s)


def applicable(impl, case):
    """None, or why a check cannot run for this implementation (reported "not claimed")."""
    if case.check == "stream" and not (impl.device == "cuda"
                                       and impl.array in ("torch", "cupy")):
        return "needs an implementation on CUDA torch tensors or CuPy arrays"
    return None


def fresh_inputs(impl, case, seed, inputs):
    """Call, then write other values into the same buffers (same pointers, shapes, strides)
    and call again: the second answer is judged against the second inputs."""
    args, kwargs = to_impl(impl, case, inputs)
    unpack(impl, case, call(impl, args, kwargs), args)
    fresh = make_inputs(case, seed + FRESH_SEED)
    new_args, _ = to_impl(impl, case, fresh)
    for old, new in zip(args, new_args):
        _overwrite(old, new)
    if impl.array == "jax":  # immutable arrays: new buffers, same shapes and values differ
        args = new_args
    out, lse = unpack(impl, case, call(impl, args, kwargs), args)
    return fresh, out, lse, []


def _overwrite(dst, src):
    if hasattr(dst, "copy_"):  # torch
        dst.copy_(src)
    elif hasattr(dst, "__setitem__") and not type(dst).__module__.startswith("jax"):
        dst[...] = src


def batch_alone(impl, case, seed, inputs):
    """The batched call, then each (batch, head) alone: bitwise the same where the
    implementation claims batch invariance, else each alone judged against the truth."""
    inputs, out, lse, notes = call_and_check(impl, case, seed, inputs)
    q, k, v, options = inputs
    group = case.Hq // case.Hk
    differ = []
    alone = type(case)(**dict(case.to_dict(), B=1, Hq=1, Hk=1, check=None))
    for b in range(case.B):
        for h in range(case.Hq):
            hk = h // group
            one = (q[b:b + 1, h:h + 1], k[b:b + 1, hk:hk + 1], v[b:b + 1, hk:hk + 1], options)
            _, out1, lse1, _ = call_and_check(impl, alone, seed, one)
            same = np.array_equal(out1[0, 0], out[b, h]) and (
                lse is None or np.array_equal(lse1[0, 0], lse[b, h]))
            if not same:
                differ.append((b, h, float(np.abs(out1[0, 0] - out[b, h]).max())))
                if not impl.supports.batch_invariant:
                    _judge_alone(impl, alone, seed, one, out1, lse1, (b, h))
    if differ and impl.supports.batch_invariant:
        b, h, err = differ[0]
        raise Fail(f"batch element {b}, head {h} computed alone differs from the batched "
                   f"result by up to {err:.3g} ({len(differ)} of {case.B * case.Hq} (batch, "
                   f"head) pairs differ; batch invariance is claimed)")
    if differ:
        notes.append(f"{len(differ)} of {case.B * case.Hq} (batch, head) pairs alone differ "
                     f"from the batched result in their last bits (not claimed bitwise); each "
                     f"alone passes")
    return inputs, out, lse, notes


def _judge_alone(impl, case, seed, inputs, out, lse, where):
    result = judge_result(impl, case, seed, inputs, out, lse, [], 0.0)
    if result.verdict != "pass":
        raise Fail(f"(batch, head) {where} computed alone is wrong:\n{result.detail}")


def stream(impl, case, seed, inputs):
    """On a fresh non-default stream, the inputs are written only after a delay queued on
    that stream, then the kernel is called with that stream current, and its output is read
    on that stream. Work launched elsewhere reads the inputs before they are written. All of
    it in the calling thread (torch's current stream is per thread), under calling.call."""
    gpu = _TorchStreams() if impl.array == "torch" else _CupyStreams()
    ready, kwargs = to_impl(impl, case, inputs)
    gpu.synchronize()
    side, box = gpu.stream(), {}

    def run():
        with gpu.current(side):
            box["args"] = args = [gpu.nan_like(x) for x in ready]
            gpu.sleep(SLEEP_CYCLES)
            for a, x in zip(args, ready):
                gpu.copy(a, x)
            result = impl.fn(*args, **kwargs)
            result = tuple(gpu.clone(r) for r in result) if isinstance(result, tuple) else \
                gpu.clone(result)  # read on the caller's stream
        side.synchronize()
        return result

    result = call(impl, ready, kwargs, run=run)
    out, lse = unpack(impl, case, result, box["args"])
    return inputs, out, lse, []


class _TorchStreams:
    def __init__(self):
        import torch

        self.torch = torch

    def synchronize(self):
        self.torch.cuda.synchronize()

    def stream(self):
        return self.torch.cuda.Stream()

    def current(self, s):
        return self.torch.cuda.stream(s)

    def nan_like(self, x):
        return self.torch.full_like(x, float("nan"))

    def sleep(self, cycles):
        self.torch.cuda._sleep(cycles)

    def copy(self, dst, src):
        dst.copy_(src)

    def clone(self, x):
        return x.clone()


class _CupyStreams:
    SPIN = r'''extern "C" __global__ void spin(long long n) {
        long long t = clock64(); while (clock64() - t < n) {} }'''

    def __init__(self):
        import cupy

        self.cupy = cupy

    def synchronize(self):
        self.cupy.cuda.Device().synchronize()

    def stream(self):
        return self.cupy.cuda.Stream(non_blocking=True)

    def current(self, s):
        return s

    def nan_like(self, x):
        return self.cupy.full_like(x, np.nan)

    def sleep(self, cycles):
        self.cupy.RawKernel(self.SPIN, "spin")((1,), (1,), (np.int64(cycles),))

    def copy(self, dst, src):
        dst[...] = src

    def clone(self, x):
        return x.copy()


def out_buffer(impl, case, seed, inputs):
    """out= is a view into a larger buffer of SENTINEL values (one guard row before and after
    each (batch, head), and guard columns): the guard bytes must stay as they were."""
    args, kwargs = to_impl(impl, case, inputs)
    shape = (case.B, case.Hq, case.Nq, case.Dv)
    if impl.layout == "bnhd":
        shape = (case.B, case.Nq, case.Hq, case.Dv)
    padded = shape[:2] + (shape[2] + 2, shape[3] + 3)
    buffer = converter(impl)(cast(np.full(padded, SENTINEL, np.float32), case.dtype))
    view = buffer[:, :, 1:-1, 1:-2]
    before = bits(buffer)
    result = call(impl, args, dict(kwargs, out=view))
    # What is judged is what the caller's view holds, whatever the call returned.
    out, lse = unpack(impl, case, (view, result[1]) if isinstance(result, tuple) else view)
    changed = (before != bits(buffer)).reshape(padded + (-1,)).any(-1)
    outside = np.ones(padded, bool)
    outside[:, :, 1:-1, 1:-2] = False
    if (changed & outside).any():
        where = tuple(int(i) for i in np.argwhere(changed & outside)[0])
        raise Fail(f"wrote outside its out= view: {int((changed & outside).sum())} guard "
                   f"elements changed, the first at {where} of the padded buffer {padded}")
    return inputs, out, lse, []


def hidden_keys(impl, case, seed, inputs):
    """Call, then again with other finite K and V in the block of keys that the most rows do
    not see: both judged against the truth, and every row that sees none of those keys
    bitwise the same where the implementation claims it (a kernel that skips the tiles a
    mask hides and one that reads them must agree to the bit)."""
    inputs, out, lse, notes = call_and_check(impl, case, seed, inputs)
    q, k, v, options = inputs
    seen = visibility(case, options, q, k, v)
    first = most_hidden_block(seen)
    keys = slice(first, min(first + BLOCK, case.Nk))
    rng = np.random.default_rng(seed + FRESH_SEED)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, keys] = cast(rng.standard_normal(k2[:, :, keys].shape), case.dtype)
    v2[:, :, keys] = cast(rng.standard_normal(v2[:, :, keys].shape), case.dtype)
    changed = (q, k2, v2, options)
    _, out2, lse2, _ = call_and_check(impl, case, seed, changed)
    result = judge_result(impl, case, seed, changed, out2, lse2, [], 0.0)
    if result.verdict != "pass":
        raise Fail(f"with other values in keys {keys.start}..{keys.stop - 1}:\n{result.detail}")
    blind = ~seen[..., keys].any(axis=-1)  # (B, Hq, Nq): rows that see none of them
    if not blind.any():
        raise VacuousCase(f"case {case.name!r}: every row sees a key of keys {keys.start}.."
                          f"{keys.stop - 1}, so changing them can show nothing")
    moved = blind & ~(bits(out) == bits(out2)).all(axis=-1)
    if moved.any() and impl.supports.hidden_bitwise:
        b, h, i = (int(x[0]) for x in np.nonzero(moved))
        raise Fail(f"row {i} of (batch {b}, head {h}) sees none of keys {keys.start}.."
                   f"{keys.stop - 1}, whose K and V changed, and its output changed by up to "
                   f"{float(np.abs(out[b, h, i] - out2[b, h, i]).max()):.3g} ({int(moved.sum())}"
                   f" of {int(blind.sum())} such rows): keys a row does not see reach it")
    if moved.any():
        notes.append(f"{int(moved.sum())} of {int(blind.sum())} rows that see none of the "
                     f"changed keys differ in their last bits (not claimed bitwise)")
    return inputs, out, lse, notes


def most_hidden_block(seen):
    """The first key of the BLOCK-aligned block of keys that the most rows see none of."""
    n_k = seen.shape[-1]
    starts = list(range(0, n_k, BLOCK))
    blind = [int((~seen[..., j:j + BLOCK].any(axis=-1)).sum()) for j in starts]
    return starts[int(np.argmax(blind))]


CHECK_RUNNERS = {"fresh-inputs": fresh_inputs, "batch-alone": batch_alone, "stream": stream,
                 "out-buffer": out_buffer, "hidden-keys": hidden_keys}
