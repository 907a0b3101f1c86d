"""Every use of numba-cuda's private internals, behind this one module.

The kernels are public Numba CUDA. Two things need more, and only this module reaches in:

1. The fast launch (launch.py). For each compiled kernel version (numba.cuda.dispatcher._Kernel)
   it uses
       kernel.overloads[types], kernel.typeof_pyval(value)   the version for given arguments
       _Kernel._prepare_args(ty, val, stream, retr, params)  Numba's flattening of an argument
                                                             into the kernel's parameter list
       _Kernel._codelibrary.get_cufunc().kernel              the version's cuda.core Kernel
   and launches through cuda.core, as Numba itself does (`flatten`, `launch_flat`).
2. The disk cache of compiled kernels (compile_cache.py). `cache_on_disk` gives a dispatcher
   numba.cuda.dispatcher.CUDACache (Numba's own, what cuda.jit(cache=True) uses) with two
   changes: its folder (it reads numba.cuda.core.config.CACHE_DIR when it is made) and its
   key (CUDACache._index_key, see cache_on_disk).
3. The PTX gate (ptx_report.py, on machines without a GPU). Device functions compile for
   numba.cuda.dispatcher.get_current_device().compute_capability; `compiling_for(cc)` answers
   that question for one compile. Only the gate's own worker processes use it: a device
   function keeps what it compiled for the rest of its process.

TESTED_WITH names the numba-cuda versions these were tested against; pyproject.toml pins the
same range. At import, PROBLEM is None when the internals look as expected, or says what
changed; then every launch takes Numba's public path, and the first one that would have
used the fast path warns once (FastLaunchOff) with the reason. An untested numba-cuda whose
internals still look right warns once at import. CACHE_PROBLEM likewise: when it is not None,
kernels are compiled in every process (no disk cache), with one warning.
"""
import inspect
import threading
import warnings
from contextlib import contextmanager
from types import SimpleNamespace

_COMPILE_LOCK = threading.Lock()

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


INDEX_KEY_ARGS = ["self", "sig", "codegen"]


def _check_cache():
    """None when Numba's disk cache looks as cache_on_disk expects, or what differs."""
    from .convert import SIMULATOR

    if SIMULATOR:
        return "the CUDA simulator compiles nothing"
    try:
        from numba.cuda.core import config
        from numba.cuda.dispatcher import CUDACache, CUDADispatcher
    except ImportError as e:
        return f"an import failed: {e}"
    got = list(inspect.signature(CUDACache._index_key).parameters)
    if got != INDEX_KEY_ARGS:
        return f"CUDACache._index_key takes {got}, expected {INDEX_KEY_ARGS}"
    if not hasattr(config, "CACHE_DIR") or not callable(getattr(CUDADispatcher,
                                                                "enable_caching", None)):
        return "numba.cuda.core.config.CACHE_DIR or CUDADispatcher.enable_caching is gone"
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
CACHE_PROBLEM = _check_cache()
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


class CacheOff(UserWarning):
    """Compiled kernels are not kept on disk: every process compiles the ones it launches."""


def cache_on_disk(dispatcher, folder, key):
    """Keep `dispatcher`'s compiled versions in `folder`, each under (its argument types, the
    codegen's magic tuple (the compute capability), the numba-cuda version, `key`).

    Numba's own key is (those, a hash of the kernel's bytecode and of its closure's pickle).
    Our kernels' closures hold device functions, whose pickles carry a random uuid made in
    each process, so that key never matches in another process. `key` and the folder take its
    place: the caller makes them name everything the kernel is built from
    (compile_cache.variant_folder). Returns False, having warned once, where the internals
    differ (CACHE_PROBLEM)."""
    if CACHE_PROBLEM is not None:
        if not _CACHE_WARNED:
            _CACHE_WARNED.append(CACHE_PROBLEM)
            warnings.warn(f"numba_kernels: compiled kernels are not cached on disk "
                          f"({CACHE_PROBLEM})", CacheOff, stacklevel=3)
        return False
    import numba_cuda
    from numba.cuda.core import config
    from numba.cuda.dispatcher import CUDACache

    class VariantCache(CUDACache):
        def _index_key(self, sig, codegen):
            return (sig, codegen.magic_tuple(), numba_cuda.__version__, key)

    with _COMPILE_LOCK:  # CACHE_DIR is read while the cache is made, then never again
        saved, config.CACHE_DIR = config.CACHE_DIR, str(folder)
        try:
            dispatcher._cache = VariantCache(dispatcher.py_func)
        finally:
            config.CACHE_DIR = saved
    return True


_CACHE_WARNED = []
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
