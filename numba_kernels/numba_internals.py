"""Every use of numba-cuda's private internals, behind this one module.

The kernels are public Numba CUDA. Two things need more, and only this module reaches in:

1. The fast launch (launch.py). For each compiled kernel version (numba.cuda.dispatcher._Kernel)
   it uses
       kernel.overloads[types], kernel.typeof_pyval(value)   the version for given arguments
       _Kernel._prepare_args(ty, val, stream, retr, params)  Numba's flattening of an argument
                                                             into the kernel's parameter list
       _Kernel._codelibrary.get_cufunc().kernel              the version's cuda.core Kernel
   and launches through cuda.core, as Numba itself does (`flatten`, `launch_flat`).
2. The PTX gate (ptx_report.py, on machines without a GPU). Device functions compile for
   numba.cuda.dispatcher.get_current_device().compute_capability; `compiling_for(cc)` answers
   that question for one compile. Only the gate's own worker processes use it: a device
   function keeps what it compiled for the rest of its process.

TESTED_WITH names the numba-cuda versions these were tested against; pyproject.toml pins the
same range. At import, PROBLEM is None when the internals look as expected, or says what
changed; then every launch takes Numba's public path, and the first one that would have
used the fast path warns once (FastLaunchOff) with the reason. An untested numba-cuda whose
internals still look right warns once at import.
"""
import inspect
import threading
import warnings
from contextlib import contextmanager
from types import SimpleNamespace

TESTED_WITH = ("0.30.4",)
PREPARE_ARGS = ["self", "ty", "val", "stream", "retr", "kernelargs"]


class FastLaunchOff(UserWarning):
    """The fast launch is off: every launch takes Numba's own (slower for torch tensors)."""


class InternalsChanged(Exception):
    """numba-cuda's internals are not what this module expects."""


SIMULATOR_MESSAGE = "the CUDA simulator launches through Numba only"


def _check():
    """None when the internals look as expected, or what differs."""
    from .convert import SIMULATOR

    if SIMULATOR:
        return SIMULATOR_MESSAGE
    try:
        from cuda.core import LaunchConfig, Stream, launch  # noqa: F401
        from numba.cuda.codegen import CUDACodeLibrary
        from numba.cuda.dispatcher import CUDADispatcher, _Kernel
    except ImportError as e:
        return f"an import failed: {e}"
    got = list(inspect.signature(_Kernel._prepare_args).parameters)
    if got != PREPARE_ARGS:
        return f"_Kernel._prepare_args takes {got}, expected {PREPARE_ARGS}"
    for cls, name in ((CUDACodeLibrary, "get_cufunc"), (CUDADispatcher, "typeof_pyval")):
        if not callable(getattr(cls, name, None)):
            return f"{cls.__name__}.{name} is gone"
    return None


def numba_cuda_version():
    try:
        from importlib.metadata import version

        return version("numba-cuda")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


PROBLEM = _check()
if PROBLEM is None and numba_cuda_version() not in TESTED_WITH:
    warnings.warn(f"numba-cuda {numba_cuda_version()} is untested with numba_kernels' fast "
                  f"launch (tested: {', '.join(TESTED_WITH)}); its internals look as expected",
                  FastLaunchOff, stacklevel=2)
_WARNED = []


def warn_fallback(reason):
    """Warn, once a process, that the fast launch is off and why."""
    if not _WARNED:
        _WARNED.append(reason)
        warnings.warn(f"numba_kernels: the fast launch is off ({reason}); every call takes "
                      "Numba's launch, about 0.5 ms of host time more", FastLaunchOff,
                      stacklevel=3)


def flatten(kernel, devs, stream, arrays):
    """(function, params, slots) of the version of dispatcher `kernel` that Numba just
    launched with arguments `devs`: its cuda.core Kernel, its flattened parameter list, and
    for each index in `arrays` (Numba device arrays among devs) the (slot, index) of its data
    pointer in that list. Raises InternalsChanged where the internals differ."""
    if PROBLEM is not None:
        raise InternalsChanged(PROBLEM)
    try:
        compiled = kernel.overloads[tuple(kernel.typeof_pyval(a) for a in devs)]
        params, slots = [], []
        for i, (ty, value) in enumerate(zip(compiled.argument_types, devs)):
            start = len(params)
            compiled._prepare_args(ty, value, stream, [], params)
            if i in arrays:
                slots.append((_data_slot(params, start, value), i))
        return compiled._codelibrary.get_cufunc().kernel, params, slots
    except (AttributeError, KeyError, TypeError) as e:
        raise InternalsChanged(f"{type(e).__name__}: {e}") from e


def _data_slot(params, start, array):
    """Where array's data pointer landed among params[start:] (exactly one place)."""
    ptr = array.device_ctypes_pointer.value
    found = [j for j in range(start, len(params)) if params[j] == ptr]
    if len(found) != 1:
        raise InternalsChanged(f"an array's data pointer appears {len(found)} times in its "
                               "flattened parameters, expected once")
    return found[0]


_BOUND = threading.local()


def launch_flat(config, stream, function, params):
    """cuda.core's launch of `function` with flattened `params`, from any thread: the first
    launch in a thread makes Numba's context current there (a thread that never touched
    CUDA through Numba has none, and the driver would refuse the launch)."""
    if not getattr(_BOUND, "context", False):
        from numba import cuda

        cuda.current_context()
        _BOUND.context = True
    from cuda.core import launch

    launch(stream, config, function, *params)


_COMPILE_LOCK = threading.Lock()


@contextmanager
def compiling_for(cc):
    """Inside this block, device functions compile for compute capability `cc` instead of the
    current GPU's (which a CPU machine does not have). For the PTX gate's worker processes
    only (ptx_report.py)."""
    import numba.cuda.dispatcher as dispatcher

    with _COMPILE_LOCK:
        current = dispatcher.get_current_device
        dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=tuple(cc))
        try:
            yield
        finally:
            dispatcher.get_current_device = current
