"""Calling any implementation defensively: the case's inputs converted to the array kind it
takes (NumPy, torch, CuPy, JAX), the call under its timeout, and what it returns unpacked to
NumPy, checked for type, shape, dtype and aliasing. What the kernel does wrong is raised as
Fail, the case's detail; verify never crashes on a bad kernel.
"""
import threading
import traceback

import numpy as np

from reference.dtypes import dtype_name, transported
from reference.memory import overlaps
from .cases import EXPANDED


class Fail(Exception):
    """What the kernel did wrong, as the case's detail."""


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
    failure and whatever it raises a failed case; impl.prepare() first, outside the call's
    time."""
    box = {}
    if impl.prepare is not None:
        try:
            impl.prepare()
        except Exception as e:  # noqa: BLE001 - as the call's own error
            raise Fail(f"before the call, {_raised(e)}") from None

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
        raise Fail(_raised(box["error"]))
    return box["result"]


def _raised(e):
    """A failure's words for an exception: its type and its message's first line."""
    return f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


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
