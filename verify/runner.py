"""Running one case against one implementation, defensively: verify never crashes on a bad
kernel. Everything the kernel does wrong (raising, hanging, a wrong type, shape, dtype or
device, writing its inputs, nondeterminism, wrong values) becomes a failed CaseResult.
"""
import threading
import time
import traceback

import numpy as np

from reference.contract import check_attention_args, dense_visible
from .criterion import judge
from .report import CaseResult


def run_case(impl, case, seed):
    claimed, missing = impl.supports.claims(case)
    if not claimed:
        return CaseResult(case, seed, "not claimed", f"needs {missing}")
    q, k, v, options = (inputs := _inputs(case, seed))
    args, kwargs = _to_impl(impl, case, q, k, v, options)
    before = [_bits(x) for x in args]
    t0 = time.perf_counter()
    try:
        result = _call(impl, args, kwargs)
        out, lse = _unpack(impl, case, result)
        if case.repeat:
            out2, lse2 = _unpack(impl, case, _call(impl, args, kwargs))
    except _Fail as e:
        return CaseResult(case, seed, "fail", str(e), seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    notes = []
    if not all(np.array_equal(b, _bits(x)) for b, x in zip(before, args)):
        return CaseResult(case, seed, "fail", "the call wrote into its inputs", seconds=seconds)
    if case.repeat and not (np.array_equal(_bits(out), _bits(out2))
                            and (lse is None or np.array_equal(_bits(lse), _bits(lse2)))):
        return CaseResult(case, seed, "fail", "two runs on the same inputs differ",
                          seconds=seconds)
    empty = _empty_rows(q, k, v, options)
    convention = _convention(out, v, empty, options)
    if empty.any():
        notes.append(f"fully masked rows give {convention}")
        if convention != "zeros" and convention == impl.supports.fully_masked:
            out = np.where(empty[..., None], 0.0, out)  # the declared convention: judge the rest
            if lse is not None:
                lse = np.where(empty, -np.inf, lse)
    *truth_qkv, truth_options = _for_truth(q, k, v, options)
    comparisons = judge(*truth_qkv, out, lse, dtype=case.dtype, **truth_options)
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
    wide = [x.astype(np.float32) if str(x.dtype) == "bfloat16" else x for x in (q, k, v)]
    on_gpu = {n: cupy.asarray(a) if n == "mask" else a for n, a in options.items()}
    return (*(cupy.asarray(x) for x in wide), on_gpu)


class _Fail(Exception):
    pass


def _inputs(case, seed):
    from .cases import make_inputs

    return make_inputs(case, seed)


def _to_impl(impl, case, q, k, v, options):
    """The inputs in the implementation's array type, device and layout."""
    convert = {"numpy": lambda: (lambda x: x), "torch": lambda: _to_torch(impl.device),
               "cupy": lambda: _to_cupy, "jax": lambda: _to_jax}[impl.array]()
    args = []
    for x in (q, k, v):
        if impl.layout == "bnhd":
            x = x.transpose(0, 2, 1, 3)
        if case.strided:  # same values, stored in the other layout: a non-contiguous view
            args.append(_swap(convert(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))))
        else:
            args.append(convert(np.ascontiguousarray(x)))
    kwargs = {name: convert(val) if isinstance(val, np.ndarray) else val
              for name, val in options.items()}
    return args, kwargs


def _swap(x):
    """Swap axes 1 and 2 as a view, in any array type."""
    return x.permute(0, 2, 1, 3) if hasattr(x, "permute") else x.transpose(0, 2, 1, 3)


def _to_torch(device):
    import torch

    def convert(x):
        if str(x.dtype) == "bfloat16":
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(device)
        return torch.from_numpy(x).to(device)

    return convert


def _to_cupy(x):
    import cupy

    return cupy.asarray(x)


def _to_jax(x):
    import jax.numpy as jnp

    return jnp.asarray(x)


def _call(impl, args, kwargs):
    """impl.fn(*args, **kwargs) in a thread, so that a hang becomes a failure."""
    box = {}

    def target():
        try:
            box["result"] = impl.fn(*args, **kwargs)
            _synchronize(impl)
        except BaseException as e:  # noqa: BLE001 - everything a kernel raises is a result
            box["error"] = e
            box["trace"] = traceback.format_exc(limit=3)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(impl.timeout_s)
    if thread.is_alive():
        raise _Fail(f"no result after {impl.timeout_s:.0f} s (hang?); the call was abandoned")
    if "error" in box:
        e = box["error"]
        raise _Fail(f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return box["result"]


def _synchronize(impl):
    if impl.array == "torch" and impl.device == "cuda":
        import torch

        torch.cuda.synchronize()


def _host(x):
    """Any array type to NumPy (bfloat16 as float32)."""
    if hasattr(x, "detach"):  # torch
        x = x.detach()
        x = x.float() if str(x.dtype) == "torch.bfloat16" else x
        return x.cpu().numpy()
    if hasattr(x, "get"):  # CuPy
        return x.get()
    x = np.asarray(x)
    return x.astype(np.float32) if str(x.dtype) == "bfloat16" else x


def _unpack(impl, case, result):
    """(out, lse) as NumPy in the contract's layout, after checking type, shape and dtype."""
    if isinstance(result, tuple):
        if len(result) != 2:
            raise _Fail(f"returned a tuple of {len(result)} items; expected out or (out, lse)")
        out, lse = result
    else:
        out, lse = result, None
    want_type = {"numpy": "numpy", "torch": "torch", "cupy": "cupy", "jax": "jax"}[impl.array]
    if type(out).__module__.split(".")[0] != want_type and not (
            want_type == "jax" and type(out).__module__.startswith("jaxlib")):
        raise _Fail(f"returned {type(out).__module__}.{type(out).__name__}; expected a "
                    f"{impl.array} array like its inputs")
    got_dtype = str(out.dtype).replace("torch.", "")
    if got_dtype != case.dtype:
        raise _Fail(f"out has dtype {got_dtype}; expected {case.dtype}, the inputs' dtype")
    if impl.array == "torch" and out.device.type != impl.device:
        raise _Fail(f"out is on {out.device}; expected {impl.device}, the inputs' device")
    shape = (case.B, case.Hq, case.Nq, case.Dv)
    want = shape if impl.layout == "bhnd" else (case.B, case.Nq, case.Hq, case.Dv)
    if tuple(out.shape) != want:
        raise _Fail(f"out has shape {tuple(out.shape)}; expected {want}")
    out = _host(out).astype(np.float64)
    if impl.layout == "bnhd":
        out = out.transpose(0, 2, 1, 3)
    if lse is not None:
        lse = _host(lse).astype(np.float64)
        if lse.shape != shape[:3]:
            raise _Fail(f"lse has shape {lse.shape}; expected {shape[:3]} (B, Hq, Nq)")
    if not impl.supports.lse:
        lse = None
    return out, lse


def _bits(x):
    """A byte-exact host copy of an array of any type (for immutability and determinism)."""
    if hasattr(x, "detach"):  # torch: through int16/int32 views, which NumPy can hold
        t = x.detach().contiguous()
        t = t.view({2: __import__("torch").int16, 4: __import__("torch").int32}.get(
            t.element_size(), t.dtype))
        return t.cpu().numpy().copy()
    h = x.get() if hasattr(x, "get") else np.asarray(x)
    h = np.ascontiguousarray(h)
    return h.view(np.uint8).copy() if h.size else h.copy()


def _empty_rows(q, k, v, options):
    """(B, Hq, Nq) True where a row sees no key."""
    pb = check_attention_args(q, k, v, **options)
    keep = dense_visible(pb, options.get("mask"), options.get("kv_lengths"))
    return np.broadcast_to(~keep.any(axis=-1), (pb.batch, pb.heads_q, pb.n_q))


def _convention(out, v, empty, options):
    """What a kernel gives for rows that see no key: zeros, nan, mean (of V), or other."""
    if not empty.any():
        return "zeros"
    rows = out[empty]
    if np.isnan(rows).all():
        return "nan"
    if (rows == 0).all():
        return "zeros"
    group = out.shape[1] // v.shape[1]
    mean = np.repeat(v.astype(np.float64).mean(axis=2), group, axis=1)  # (B, Hq, Dv)
    expected = np.broadcast_to(mean[:, :, None], out.shape)[empty]
    if np.allclose(rows, expected, rtol=1e-2, atol=1e-2):
        return "mean"
    return "other"
