"""Running one case against one implementation, defensively: verify never crashes on a bad
kernel. Everything the kernel does wrong (raising, hanging, a wrong type, shape, dtype or
device, writing its inputs, aliasing them, caching, nondeterminism, wrong values) becomes a
failed CaseResult. The call checks (cases.CHECKS) live in checks.py.
"""
import threading
import time
import traceback

import numpy as np

from reference.dtypes import dtype_name, numpy_dtype, transported
from .cases import EXPANDED, make_inputs, sample_rows, visibility
from .criterion import judge
from .report import CaseResult


class Fail(Exception):
    """What the kernel did wrong, as the case's detail."""


def run_case(impl, case, seed, say=None):
    """The CaseResult of one case. say(message): progress within a scale-suite case (drawing
    billions of inputs and the truth take minutes), whose phases' times go into its detail."""
    claimed, missing = impl.supports.claims(case)
    if not claimed:
        return CaseResult(case, seed, "not claimed", f"needs {missing}")
    from .checks import CHECK_RUNNERS, applicable

    why_not = applicable(impl, case)
    if why_not:
        return CaseResult(case, seed, "not claimed", why_not)
    short = memory_shortfall(impl, case) if case.sampled else None
    if short:
        return CaseResult(case, seed, "skipped", short)
    phases = _Phases(say if case.sampled else None)
    phases.start("drawing the inputs")
    inputs = make_inputs(case, seed)
    if case.backward:
        from .backward import run_backward_case

        return run_backward_case(impl, case, seed, inputs)
    phases.start("calling")
    t0 = time.perf_counter()
    try:
        run = CHECK_RUNNERS[case.check] if case.check else call_and_check
        inputs, out, lse, notes = run(impl, case, seed, inputs)
    except Fail as e:
        if case.sampled and "out of memory" in str(e).lower():
            return CaseResult(case, seed, "skipped", f"not run to the end: {e}")
        return CaseResult(case, seed, "fail", str(e), seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    phases.start(f"the truth on {len(sample_rows(case)) if case.sampled else case.Nq} rows")
    result = judge_result(impl, case, seed, inputs, out, lse, notes, seconds)
    if case.sampled:
        result.detail = "\n".join(filter(None, [result.detail, phases.end()]))
    return result


class _Phases:
    """Seconds spent in each phase of a case, announced through say as each starts."""

    def __init__(self, say):
        self.say, self.times, self.name, self.t0 = say, [], None, None

    def start(self, name):
        now = time.perf_counter()
        if self.name:
            self.times.append((self.name, now - self.t0))
        self.name, self.t0 = name, now
        if self.say and name:
            self.say(name)

    def end(self):
        self.start(None)
        return "phases: " + ", ".join(f"{name} {t:.0f} s" for name, t in self.times)


def memory_shortfall(impl, case):
    """None, or why a scale-suite case cannot run here: the memory its inputs and output
    need (host, and device for a CUDA implementation) against what is free."""
    item = numpy_dtype(case.dtype).itemsize
    elements = case.B * (case.Hq * case.Nq * (case.D + case.Dv)
                         + case.Hk * case.Nk * (case.D + case.Dv))
    scores = case.Nq * case.Nk * (case.B * case.Hq if case.mask_shape == "head" else 1)
    extra = scores * ((1 if case.mask else 0) + (item if case.bias else 0))
    need = {"host": elements * (2 * item + 4) + 2 * extra,
            "device": elements * item + extra * 4}  # a bias may be widened to float32
    have = {"host": _host_free(), "device": _device_free(impl)}
    for where, n in need.items():
        if have[where] is not None and n > have[where]:
            return (f"not run: needs about {n / 2**30:.1f} GiB of {where} memory, "
                    f"{have[where] / 2**30:.1f} GiB free")
    return None


def _host_free():
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _device_free(impl):
    if impl.device != "cuda":
        return None
    try:
        import torch

        return torch.cuda.mem_get_info()[0]
    except Exception:  # noqa: BLE001 - no torch, or no CUDA: not known
        return None


def call_and_check(impl, case, seed, inputs):
    """One call (two with case.repeat) on inputs converted for impl, with the checks that
    hold for every call: inputs unchanged, output not aliasing an input, determinism."""
    args, kwargs = to_impl(impl, case, inputs)
    if case.sampled:  # billions of elements: values only, on the sampled rows
        result = call(impl, args, kwargs)
        return (inputs, *unpack(impl, case, result, args, rows=sample_rows(case)), [])
    before = [bits(x) for x in args]
    result = call(impl, args, kwargs)
    out, lse = unpack(impl, case, result, args)
    if not all(np.array_equal(b, bits(x)) for b, x in zip(before, args)):
        raise Fail("the call wrote into its inputs")
    if case.repeat:
        out2, lse2 = unpack(impl, case, call(impl, args, kwargs), args)
        if not (np.array_equal(bits(out), bits(out2))
                and (lse is None or np.array_equal(bits(lse), bits(lse2)))):
            raise Fail("two runs on the same inputs differ")
    return inputs, out, lse, []


def judge_result(impl, case, seed, inputs, out, lse, notes, seconds):
    """The values against the float64 truth, after naming what fully masked rows give."""
    q, k, v, options = inputs
    if case.sampled:
        comparisons = judge(q, k, v, out, lse, dtype=case.dtype, rows=sample_rows(case),
                            **options)
        return _verdict(case, seed, comparisons, notes, seconds)
    empty = empty_rows(q, k, v, options)
    if empty.any():
        convention = fully_masked_convention(out, q, k, v, empty, options)
        notes = notes + [f"fully masked rows give {convention}"]
        if convention != "zeros" and convention == impl.supports.fully_masked:
            out = np.where(empty[..., None], 0.0, out)  # the declared convention: judge the rest
            if lse is not None:
                lse = np.where(empty, -np.inf, lse)
    *truth_qkv, truth_options = _for_truth(q, k, v, options)
    comparisons = judge(*truth_qkv, out, lse, dtype=case.dtype, **truth_options)
    return _verdict(case, seed, comparisons, notes, seconds)


def _verdict(case, seed, comparisons, notes, seconds):
    failed = [c for c in comparisons if not c.passed]
    detail = "\n".join([c.message() for c in failed] + notes)
    return CaseResult(case, seed, "fail" if failed else "pass", detail, comparisons, seconds)


def _for_truth(q, k, v, options):
    """(q, k, v, **options) for the float64 truth: on the GPU through CuPy when there is one
    (bfloat16 as float32 holding the same values), else the NumPy arrays as they are."""
    from .device import gpu_present

    if not gpu_present():
        return q, k, v, options
    try:
        import cupy
    except ImportError:
        return q, k, v, options

    def wide(x):
        return x.astype(np.float32) if str(x.dtype) == "bfloat16" else x

    on_gpu = {n: cupy.asarray(wide(a)) if n in ("mask", "bias") else a
              for n, a in options.items()}
    return (*(cupy.asarray(wide(x)) for x in (q, k, v)), on_gpu)


def to_impl(impl, case, inputs):
    """(args, kwargs): the inputs in the implementation's array type, device and layout."""
    q, k, v, options = inputs
    convert = converter(impl)
    args = []
    for x in (q, k, v):
        if impl.layout == "bnhd":
            x = x.transpose(0, 2, 1, 3)
        if case.strided:  # same values, stored in the other layout: a non-contiguous view
            args.append(_swap(convert(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))))
        elif case.expanded:  # one copy along the axis, seen through a stride of 0
            axis = EXPANDED[case.expanded]
            axis = {1: 2, 2: 1}.get(axis, axis) if impl.layout == "bnhd" else axis
            args.append(_broadcast(convert(np.ascontiguousarray(np.take(x, [0], axis=axis))),
                                   x.shape))
        else:
            args.append(convert(np.ascontiguousarray(x)))
    kwargs = {name: convert(val) if isinstance(val, np.ndarray) else val
              for name, val in options.items()}
    if impl.supports.lse:
        kwargs["return_lse"] = True
    return args, kwargs


def converter(impl):
    """A function taking a NumPy array to the implementation's array type and device."""
    return {"numpy": lambda: (lambda x: x), "torch": lambda: _to_torch(impl.device),
            "cupy": lambda: _to_cupy, "jax": lambda: _to_jax}[impl.array]()


def _broadcast(x, shape):
    """x (of size 1 along some axes) as a stride-0 view of `shape`, in any array type."""
    if hasattr(x, "expand"):  # torch
        return x.expand(*shape)
    module = type(x).__module__.split(".")[0]
    if module == "cupy":
        import cupy

        return cupy.broadcast_to(x, shape)
    if module.startswith("jax"):
        import jax.numpy as jnp

        return jnp.broadcast_to(x, shape)
    return np.broadcast_to(x, shape)


def _swap(x):
    """Swap axes 1 and 2 as a view, in any array type."""
    return x.permute(0, 2, 1, 3) if hasattr(x, "permute") else x.transpose(0, 2, 1, 3)


def _to_torch(device):
    import torch

    def convert(x):  # bfloat16 through its bits: torch cannot read ml_dtypes arrays
        t = torch.from_numpy(transported(x))
        return (t.view(torch.bfloat16) if dtype_name(x) == "bfloat16" else t).to(device)

    return convert


def _to_cupy(x):
    import cupy

    return cupy.asarray(x)


def _to_jax(x):
    import jax.numpy as jnp

    return jnp.asarray(x)


def call(impl, args, kwargs, run=None):
    """impl.fn(*args, **kwargs), or run() when given, in a thread, so that a hang becomes a
    failure and whatever it raises a failed case."""
    box = {}

    def target():
        try:
            box["result"] = run() if run else impl.fn(*args, **kwargs)
            _synchronize(impl, box["result"])
        except BaseException as e:  # noqa: BLE001 - everything a kernel raises is a result
            box["error"] = e
            box["trace"] = traceback.format_exc(limit=3)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(impl.timeout_s)
    if thread.is_alive():
        raise Fail(f"{HUNG} {impl.timeout_s:g} s (hang?); the call was abandoned")
    if "error" in box:
        e = box["error"]
        raise Fail(f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return box["result"]


HUNG = "no result after"


def _synchronize(impl, result):
    """Wait for the call's work: its errors (out of memory, say) and its time belong to the
    call. JAX dispatches asynchronously, so its results are waited for."""
    if impl.array == "torch" and impl.device == "cuda":
        import torch

        torch.cuda.synchronize()
    for x in result if isinstance(result, tuple) else (result,):
        if hasattr(x, "block_until_ready"):  # a JAX array
            x.block_until_ready()


def host(x):
    """Any array type to NumPy (bfloat16 as float32)."""
    if hasattr(x, "detach"):  # torch
        x = x.detach()
        x = x.float() if str(x.dtype) == "torch.bfloat16" else x
        return x.cpu().numpy()
    if hasattr(x, "get"):  # CuPy
        return x.get()
    x = np.asarray(x)
    return x.astype(np.float32) if str(x.dtype) == "bfloat16" else x


def unpack(impl, case, result, args=(), rows=None):
    """(out, lse) as NumPy in the contract's layout, after checking type, shape, dtype and
    that out is a fresh array (not a view of one of args). rows: bring only these query rows
    to the host."""
    if impl.supports.lse:
        if not (isinstance(result, tuple) and len(result) == 2):
            raise Fail("claims lse, but called with return_lse=True it returned "
                       f"{_describe(result)}; expected (out, lse)")
        out, lse = result
    elif isinstance(result, tuple):
        raise Fail(f"returned a tuple of {len(result)} items; expected out (lse is not "
                   f"claimed)")
    else:
        out, lse = result, None
    _check_array(impl, case, out)
    if any(overlaps(out, x) for x in args):
        raise Fail("out shares memory with an input: the output aliases q, k or v")
    try:  # device work of its own (an index, a copy): an error is the case's, not verify's
        if rows is not None:
            out = take_rows(out, rows, 2 if impl.layout == "bhnd" else 1)
            lse = None if lse is None else take_rows(lse, rows, 2)
        out = host(out).astype(np.float64)
        lse = None if lse is None else host(lse).astype(np.float64)
    except Exception as e:  # noqa: BLE001 - out of memory, a failed copy
        raise Fail(f"reading the result raised {type(e).__name__}: "
                   f"{str(e).splitlines()[0] if str(e) else ''}") from e
    if impl.layout == "bnhd":
        out = out.transpose(0, 2, 1, 3)
    if lse is not None:
        n = case.Nq if rows is None else len(rows)
        if lse.shape != (case.B, case.Hq, n):
            raise Fail(f"lse has shape {lse.shape}; expected {(case.B, case.Hq, n)} "
                       f"(B, Hq, Nq)")
    return out, lse


def take_rows(x, rows, axis):
    """x's entries at `rows` along `axis`, on x's own device and in its array type."""
    if hasattr(x, "index_select"):  # torch
        import torch

        return x.index_select(axis, torch.as_tensor(rows, device=x.device))
    if type(x).__module__.startswith(("jax", "jaxlib")):
        import jax.numpy as jnp

        return jnp.take(x, jnp.asarray(rows), axis=axis)
    if type(x).__module__.startswith("cupy"):
        import cupy

        return x.take(cupy.asarray(rows), axis=axis)
    return np.take(x, rows, axis=axis)


def _describe(result):
    if isinstance(result, tuple):
        return f"a tuple of {len(result)} items"
    return f"{type(result).__module__}.{type(result).__name__}"


def _check_array(impl, case, out):
    want_type = impl.array
    module = type(out).__module__
    if module.split(".")[0] != want_type and not (want_type == "jax"
                                                  and module.startswith("jaxlib")):
        raise Fail(f"returned {module}.{type(out).__name__}; expected a {impl.array} array "
                   f"like its inputs")
    got_dtype = str(out.dtype).replace("torch.", "")
    if got_dtype != case.dtype:
        raise Fail(f"out has dtype {got_dtype}; expected {case.dtype}, the inputs' dtype")
    if impl.array == "torch" and out.device.type != impl.device:
        raise Fail(f"out is on {out.device}; expected {impl.device}, the inputs' device")
    shape = (case.B, case.Hq, case.Nq, case.Dv)
    want = shape if impl.layout == "bhnd" else (case.B, case.Nq, case.Hq, case.Dv)
    if tuple(out.shape) != want:
        raise Fail(f"out has shape {tuple(out.shape)}; expected {want}")


def span(x):
    """(first byte, one past the last byte) of an array's memory, or None if unknown."""
    if hasattr(x, "data_ptr"):  # torch
        ptr, strides, size = x.data_ptr(), x.stride(), x.element_size()
        shape = x.shape
    else:
        face = getattr(x, "__cuda_array_interface__", None) or getattr(
            x, "__array_interface__", None)
        if face is None or not hasattr(x, "strides"):
            return None
        ptr, strides, shape = face["data"][0], x.strides, x.shape
        size = x.dtype.itemsize
        strides = [s // size for s in strides]
    if any(n == 0 for n in shape):
        return None
    lo = ptr + size * sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    hi = ptr + size * (1 + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0))
    return lo, hi


def overlaps(a, b):
    sa, sb = span(a), span(b)
    same_space = (hasattr(a, "__cuda_array_interface__") or getattr(a, "is_cuda", False)) == (
        hasattr(b, "__cuda_array_interface__") or getattr(b, "is_cuda", False))
    return bool(sa and sb and same_space and sa[0] < sb[1] and sb[0] < sa[1])


def bits(x):
    """A byte-exact host copy of an array of any type (for immutability and determinism)."""
    if hasattr(x, "detach"):  # torch: through int16/int32 views, which NumPy can hold
        import torch

        t = x.detach().contiguous()
        t = t.view({2: torch.int16, 4: torch.int32}.get(t.element_size(), t.dtype))
        return t.cpu().numpy().copy()
    h = x.get() if hasattr(x, "get") else np.asarray(x)
    h = np.ascontiguousarray(h)
    return h.view(np.uint8).copy() if h.size else h.copy()



def empty_rows(q, k, v, options):
    """(B, Hq, Nq) True where a row sees no key (mask, bias -inf, causal, window, lengths)."""
    return ~visibility(None, options, q, k, v).any(axis=-1)


def fully_masked_convention(out, q, k, v, empty, options):
    """What a kernel gives for rows that see no key: zeros (the contract), nan, mean (of V),
    unmasked (the row as if nothing were masked), or other."""
    rows = out[empty]
    if np.isnan(rows).all():
        return "nan"
    if (rows == 0).all():
        return "zeros"
    group = out.shape[1] // v.shape[1]
    mean = np.repeat(v.astype(np.float64).mean(axis=2), group, axis=1)  # (B, Hq, Dv)
    if np.allclose(rows, np.broadcast_to(mean[:, :, None], out.shape)[empty], rtol=1e-2,
                   atol=1e-2):
        return "mean"
    import reference

    unmasked = reference.attention(q, k, v, scale=options.get("scale"))
    if np.allclose(rows, unmasked[empty], rtol=1e-2, atol=1e-2):
        return "unmasked"
    return "other"
