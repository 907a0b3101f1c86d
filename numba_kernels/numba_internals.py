"""Every use of numba-cuda's private internals, behind this one module.

The kernels are public Numba CUDA. Seven things need more, and only this module reaches in:

1. The fast launch (launch.py). For each compiled kernel version (numba.cuda.dispatcher._Kernel)
   it uses
       kernel.overloads[types], kernel.typeof_pyval(value)   the version for given arguments
       _Kernel._prepare_args(ty, val, stream, retr, params)  Numba's flattening of an argument
                                                             into the kernel's parameter list
       _Kernel._codelibrary.get_cufunc().kernel              the version's cuda.core Kernel
   (`flatten`), then packs that list once into one buffer, checked against the sizes the
   kernel's image declares (cuda.core's Kernel.arguments_info), and launches it with the CUDA
   driver's cuLaunchKernel (cuda.bindings), writing only the data pointers at each launch
   (`PackedLaunch`). Numba itself launches through cuda.core, converting every parameter
   (about 150 for the tensor-core forward) at each call. A kernel taking more than 48 KB of
   dynamic shared memory must first be let take it (the function attribute
   MAX_DYNAMIC_SHARED_SIZE_BYTES), which Numba never sets: `allow_dynamic_shared` compiles
   the version (kernel.compile, which reads the disk cache as a launch would) and sets it
   through cuda.bindings on the cuda.core Kernel's handle.
   Split-KV asks how many blocks of a variant an SM holds (`resident_blocks`: the same
   compile, then the public occupancy of the compiled version).
2. The disk cache of compiled kernels (compile_cache.py). `cache_on_disk` gives a dispatcher
   numba.cuda.dispatcher.CUDACache (Numba's own, what cuda.jit(cache=True) uses) with two
   changes: its folder (it reads numba.cuda.core.config.CACHE_DIR when it is made) and its
   key (CUDACache._index_key, see cache_on_disk).
3. The PTX gate (ptx_report.py, on machines without a GPU). Device functions compile for
   numba.cuda.dispatcher.get_current_device().compute_capability; `compiling_for(cc)` answers
   that question for one compile. Only the gate's own worker processes use it: a device
   function keeps what it compiled for the rest of its process.

4. The simulator's shared arrays. numba.cuda.simulator.kernelapi.FakeCUDAShared.array makes a
   block's shared array at the first call from a source line: a dict lookup, then a store,
   with no lock. A thread switch between the two gives two threads two different "shared"
   arrays, and the block then computes wrong rows (seen once in a full test run: 95 of 1024
   outputs wrong, right on the repeat). `_lock_simulator_shared_arrays` (at import, in the
   simulator) puts the lookup and the store under one lock, and reads the same key (the
   calling line: file, line number) from the caller's frame, not by
   traceback.extract_stack, which also stats the file each call. It also gives a dynamic shared
   array (shape 0) of a NumPy scalar type, np.float32 (what convert.float32 is in the
   simulator), as np.dtype: the simulator divides its size by dtype.itemsize, which only a
   dtype has.
5. Poisoned memory in the simulator (tests). The simulator makes shared and local arrays with
   numba.cuda.simulator.kernelapi's `np.empty`, whatever memory held before; `poisoned_memory()`
   fills them with NaN (integers: -12345) instead, so that a kernel reading an element it
   never wrote gives a wrong answer every time, not only when the memory happens to hold one.
6. The simulator's blocks. numba.cuda.simulator.kernel.BlockManager.run runs a block's
   threads (BlockThread, one Python thread each) and polls them in a loop, holding the
   interpreter, until every live one waits in syncthreads; only then does it let them go.
   The threads still running share the interpreter with that loop, which at the end of each
   barrier is most of its time. `_event_driven_simulator_blocks` (at import, in the
   simulator) replaces BlockManager.run and BlockThread.syncthreads: the last thread to
   arrive (or to exit: an exited thread no longer counts, as before) lets the others go,
   each waiting on a lock of its own, and the launching thread only waits for the block to
   end. The same semantics, including an exception in one thread, which aborts the others
   at their next barrier and is raised by the launch. It also hands the kernel its array
   arguments as the NumPy arrays they wrap (`_unwrapped`: the simulator's two wrapper
   classes cost two Python calls an element read). Measured on a 2-core CPU: the SIMT
   kernel's verify cases 45 -> 27 s with the event-driven barrier, then 26.5 -> 21.5 s
   with locks of their own and the arrays unwrapped (the plain kernel's quick suite, 29 ->
   21.5 s in all with item 4's frame lookup).
7. The simulator's device functions. A device function called in a simulated kernel swaps
   the `cuda` of its module's globals for the launch's fake module around every call
   (kernelapi.swapped_cuda_module: an import, two locks, a generator context manager),
   a fifth of an mma kernel's time in the simulator. `_device_calls_swap_once` (at import,
   in the simulator) makes the first swap of a module in a launch hold until the launch
   ends (kernel._push_kernel_context's exit), the later calls there costing one dict
   lookup. A module is swapped for the whole launch, as the kernel's own module already
   was; the simulator runs one launch at a time.

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
        from cuda.bindings import driver  # noqa: F401
        from cuda.core import Kernel
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
    if not hasattr(Kernel, "arguments_info"):
        return "cuda.core's Kernel.arguments_info is gone"
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


def _lock_simulator_shared_arrays():
    """FakeCUDAShared.array under a lock (item 4 of the module docstring). Raises
    InternalsChanged if the method is not there to wrap."""
    import sys

    from numba.core import types
    from numba.cuda.simulator import kernelapi

    array = getattr(getattr(kernelapi, "FakeCUDAShared", None), "array", None)
    if array is None or "_allocations" not in inspect.getsource(kernelapi.FakeCUDAShared):
        raise InternalsChanged("numba.cuda.simulator.kernelapi.FakeCUDAShared.array is not "
                               "what _lock_simulator_shared_arrays wraps")
    if getattr(array, "locked", False):
        return
    from numba.np import numpy_support

    lock = threading.Lock()

    def locked_array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the error
            if isinstance(dtype, type) and issubclass(dtype, kernelapi.np.generic):
                dtype = kernelapi.np.dtype(dtype)  # it divides by dtype.itemsize
            return array(self, shape, dtype, alignment)
        # The same key as the original, the calling line (file, line number), read from the
        # frame: traceback.extract_stack also reads the file's line (a stat a call)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = self._allocations[caller] = kernelapi.np.empty(shape, dtype)
        return res

    locked_array.locked = True
    kernelapi.FakeCUDAShared.array = locked_array


class _BlockBarrier:
    """syncthreads for one simulated block (item 6): `alive` threads not yet exited, the
    `waiting` ones each on a lock of its own, released together when the last arrives (a
    threading.Condition would wake them all onto its one lock, one by one); `failed`: the
    thread whose exception aborts the block; `ended`: set when every thread has exited or
    one has failed."""

    def __init__(self, threads):
        self.lock, self.ended = threading.Lock(), threading.Event()
        self.alive, self.waiting, self.failed = threads, [], None

    def _release(self):
        """(with self.lock held)"""
        for waiter in self.waiting:
            waiter.release()
        self.waiting = []

    def wait(self):
        waiter = None
        with self.lock:
            if self.failed is None:
                if len(self.waiting) + 1 == self.alive:
                    self._release()
                    return
                waiter = threading.Lock()
                waiter.acquire()
                self.waiting.append(waiter)
        if waiter is not None:
            waiter.acquire()
        if self.failed is not None:
            raise RuntimeError("abort flag set on syncthreads: another thread raised")

    def leave(self, failed):
        """A thread exits (failed: it raised); the block's end wakes the launching thread."""
        with self.lock:
            self.alive -= 1
            if failed is not None and self.failed is None:
                self.failed = failed
                self._release()
                self.ended.set()
            elif self.alive == 0:
                self.ended.set()
            elif self.waiting and len(self.waiting) == self.alive:
                self._release()

    def join(self):
        """Wait until every thread has exited or one has raised; returns the one that raised."""
        self.ended.wait()
        return self.failed


def _unwrapped(arg):
    """A kernel's array argument as the NumPy array that the simulator's two wrappers hold
    (item 6): FakeWithinKernelCUDAArray around FakeCUDAArray around it. Records, and
    anything else, as they came."""
    import numpy as np
    from numba.cuda.simulator.cudadrv.devicearray import (FakeCUDAArray,
                                                          FakeWithinKernelCUDAArray)

    if type(arg) is not FakeWithinKernelCUDAArray:
        return arg
    item = arg.__dict__["_item"]
    if type(item) is FakeCUDAArray and type(item._ary) is np.ndarray \
            and item._ary.dtype.fields is None:
        return item._ary
    return arg


def _event_driven_simulator_blocks():
    """BlockManager.run and BlockThread.syncthreads of numba-cuda's simulator replaced (item 6
    of the module docstring). Raises InternalsChanged if they are not what this replaces."""
    import numpy as np
    from numba.cuda.simulator import kernel as sim

    manager, thread = getattr(sim, "BlockManager", None), getattr(sim, "BlockThread", None)
    run, sync = getattr(manager, "run", None), getattr(thread, "syncthreads", None)
    if getattr(run, "event_driven", False):
        return
    if (run is None or sync is None or "syncthreads_blocked" not in inspect.getsource(run)
            or list(inspect.signature(thread.__init__).parameters) != [
                "self", "f", "manager", "blockIdx", "threadIdx", "debug"]
            or not {"_f", "_block_dim", "_debug"} <= set(inspect.getsource(manager.__init__)
                                                          .replace(".", " ").split())):
        raise InternalsChanged("numba.cuda.simulator.kernel's BlockManager.run and "
                               "BlockThread.syncthreads are not what "
                               "_event_driven_simulator_blocks replaces")
    from numba.cuda.simulator.cudadrv import devicearray

    wrapper = getattr(devicearray, "FakeWithinKernelCUDAArray", None)
    if wrapper is None or not hasattr(devicearray, "FakeCUDAArray") \
            or 'self.__dict__["_item"] = item' not in inspect.getsource(wrapper.__init__) \
            or "self._ary = ary" not in inspect.getsource(devicearray.FakeCUDAArray.__init__):
        raise InternalsChanged("numba.cuda.simulator's FakeWithinKernelCUDAArray and "
                               "FakeCUDAArray are not the wrappers _unwrapped takes off")

    def run_block(self, grid_point, *args):
        barrier = _BlockBarrier(int(np.prod(self._block_dim)))
        args = tuple(_unwrapped(arg) for arg in args)

        def target():
            raised = threading.current_thread()
            try:
                self._f(*args)
                raised = None
            finally:
                barrier.leave(raised)

        threads = [thread(target, self, grid_point, point, self._debug)
                   for point in np.ndindex(*self._block_dim)]
        for t in threads:
            t.block_barrier = barrier
            t.start()
        failed = barrier.join()
        if failed is not None:  # raised as the simulator did: the others are left waiting
            failed.join()  # (daemon threads) at their next barrier
            raise failed.exception[0].with_traceback(failed.exception[1])

    def syncthreads(self):
        self.block_barrier.wait()

    run_block.event_driven = True
    manager.run, thread.syncthreads = run_block, syncthreads


def _device_calls_swap_once():
    """kernel.swapped_cuda_module and kernel._push_kernel_context wrapped (item 7 of the
    module docstring). Raises InternalsChanged if they are not what this wraps."""
    from contextlib import contextmanager, nullcontext

    from numba.cuda.simulator import kernel as sim
    from numba.cuda.simulator import kernelapi

    swap, push = getattr(sim, "swapped_cuda_module", None), getattr(sim, "_push_kernel_context",
                                                                     None)
    if getattr(swap, "held", False):
        return
    source = inspect.getsource(sim.FakeCUDAKernel.__call__)
    if (swap is not getattr(kernelapi, "swapped_cuda_module", None) or push is None
            or "swapped_cuda_module(self.fn, _get_kernel_context())" not in source
            or "_push_kernel_context(fake_cuda_module)" not in source):
        raise InternalsChanged("numba.cuda.simulator.kernel's swapped_cuda_module and "
                               "_push_kernel_context are not what _device_calls_swap_once "
                               "wraps")
    held, exits, lock, done = {}, [], threading.Lock(), nullcontext()

    def swapped_for_the_launch(fn, fake_cuda_module):
        if fake_cuda_module is None:  # a device function called from the host
            return swap(fn, fake_cuda_module)
        key = id(fn.__globals__)
        if held.get(key) is not fake_cuda_module:
            with lock:
                if held.get(key) is not fake_cuda_module:
                    swapped = swap(fn, fake_cuda_module)
                    swapped.__enter__()
                    exits.append(swapped)
                    held[key] = fake_cuda_module
        return done

    @contextmanager
    def launch_context(mod):
        with push(mod):
            try:
                yield
            finally:
                with lock:
                    while exits:
                        exits.pop().__exit__(None, None, None)
                    held.clear()

    swapped_for_the_launch.held = True
    sim.swapped_cuda_module, sim._push_kernel_context = swapped_for_the_launch, launch_context


def _in_simulator():
    from .convert import SIMULATOR

    return SIMULATOR


if _in_simulator():
    _lock_simulator_shared_arrays()
    _event_driven_simulator_blocks()
    _device_calls_swap_once()

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


def allow_dynamic_shared(kernel, args, nbytes):
    """Let the version of dispatcher `kernel` for `args` take `nbytes` of dynamic shared
    memory (above 48 KB a launch without this fails), compiling it first if it is new.
    Raises InternalsChanged where the internals differ, RuntimeError where the driver
    refuses (more than the device offers a block)."""
    from cuda.bindings import driver

    try:
        compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
        handle = compiled._codelibrary.get_cufunc().kernel.handle
    except (AttributeError, KeyError, TypeError) as e:
        raise InternalsChanged(f"{type(e).__name__}: {e}") from e
    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if isinstance(handle, driver.CUkernel):  # cuda.core loads kernels from a library
        from numba import cuda

        err, = driver.cuKernelSetAttribute(attribute, int(nbytes), handle,
                                           cuda.get_current_device().id)
    else:
        err, = driver.cuFuncSetAttribute(handle, attribute, int(nbytes))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"the kernel cannot take {nbytes} bytes of dynamic shared memory "
                           f"on this device: {err!r}")


def resident_blocks(kernel, args, threads, nbytes):
    """How many blocks of `threads` threads, each taking `nbytes` of dynamic shared memory,
    an SM holds at once of the version of dispatcher `kernel` for `args`: the driver's
    occupancy (the public _Kernel.max_cooperative_grid_blocks, over the SMs), the version
    compiled first if it is new and let take nbytes (allow_dynamic_shared). Raises
    InternalsChanged where the internals differ."""
    from numba import cuda

    try:
        compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    except (AttributeError, KeyError, TypeError) as e:
        raise InternalsChanged(f"{type(e).__name__}: {e}") from e
    if nbytes:
        allow_dynamic_shared(kernel, args, nbytes)
    return int(compiled.max_cooperative_grid_blocks(threads, nbytes)
               // cuda.get_current_device().MULTIPROCESSOR_COUNT)


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


class PackedLaunch:
    """One compiled kernel version's launch on one grid and stream, its parameters packed once.

    `params` is flatten's list: Python ints (array fields and pointers, 8 bytes), bools
    (1 byte) and ctypes scalars. Each gets an 8-byte slot of one buffer, little-endian, and
    must be as long as the kernel's image says its parameter is (else InternalsChanged);
    cuLaunchKernel gets the slots' addresses and copies each parameter from there. A launch
    writes the (slot, value) pairs it is given, then launches, under a lock (the slots are
    shared by every thread)."""

    def __init__(self, function, params, grid, block, stream_handle, shared=0):
        import numpy as np
        from cuda.bindings import driver

        try:
            sizes = [int(info[1]) for info in function.arguments_info]
            handle = function.handle
        except (AttributeError, TypeError, IndexError) as e:
            raise InternalsChanged(f"cuda.core's Kernel: {type(e).__name__}: {e}") from e
        if len(sizes) != len(params):
            raise InternalsChanged(f"the kernel's image declares {len(sizes)} parameters, "
                                   f"Numba's flattening gave {len(params)}")
        self.values = np.zeros(max(1, len(params)), np.uint64)
        raw = self.values.view(np.uint8)
        for j, (value, size) in enumerate(zip(params, sizes)):
            data = _parameter_bytes(value)
            if len(data) != size:
                raise InternalsChanged(f"parameter {j} ({value!r}) packs to {len(data)} "
                                       f"bytes, the kernel's image declares {size}")
            raw[8 * j:8 * j + size] = np.frombuffer(data, np.uint8)
        self.addresses = self.values.ctypes.data + 8 * np.arange(len(self.values),
                                                                 dtype=np.uint64)
        self._args = (handle, *_dim3(grid), *_dim3(block), int(shared),
                      driver.CUstream(stream_handle),
                      int(self.addresses.ctypes.data), 0)
        self._driver = driver
        self._lock = threading.Lock()

    def __call__(self, writes):
        """Write each (slot, value) of `writes` (the data pointers), then launch."""
        _bind_context()
        values = self.values
        with self._lock:
            for slot, value in writes:
                values[slot] = value
            err, = self._driver.cuLaunchKernel(*self._args)
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")


def _parameter_bytes(value):
    """The bytes cuLaunchKernel copies for one of flatten's parameters."""
    if isinstance(value, bool):
        return bytes([value])
    if isinstance(value, int):
        return (value % 2 ** 64).to_bytes(8, "little")
    try:
        return bytes(memoryview(value).cast("B"))  # a ctypes scalar's own memory
    except TypeError as e:
        raise InternalsChanged(f"a flattened parameter of type {type(value).__name__}: "
                               f"{e}") from e


def _dim3(dims):
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return tuple(int(x) for x in dims) + (1,) * (3 - len(dims))


def _bind_context():
    """The first launch in a thread makes Numba's context current there (a thread that never
    touched CUDA through Numba has none, and the driver would refuse the launch)."""
    if not getattr(_BOUND, "context", False):
        from numba import cuda

        cuda.current_context()
        _BOUND.context = True


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


@contextmanager
def poisoned_memory():
    """Inside this block, the simulator's new shared and local arrays start as NaN (integer
    arrays -12345; unsigned, their largest value; dynamic shared memory: every bit set).
    Simulator only; not thread-safe against other simulated launches."""
    import numpy as np
    from numba.cuda.simulator import kernelapi

    if getattr(kernelapi, "np", None) is not np:
        raise InternalsChanged("numba.cuda.simulator.kernelapi no longer makes its arrays "
                               "with its own `np` (poisoned_memory needs it)")

    class Poisoning:
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def empty(shape, dtype=float, *args, **kwargs):
            x = np.empty(shape, dtype, *args, **kwargs)
            kind = np.dtype(dtype).kind
            x.fill(np.nan if kind in "fc" else -12345 if kind == "i"
                   else np.iinfo(dtype).max if kind == "u" else 0)
            return x

        @staticmethod
        def zeros(shape, dtype=float, *args, **kwargs):  # the dynamic shared bytes
            x = np.zeros(shape, dtype, *args, **kwargs)
            if np.dtype(dtype) == np.byte:
                x.fill(-1)  # all bits set: NaN as float32, -1 as an integer
            return x

    kernelapi.np = Poisoning()
    try:
        yield
    finally:
        kernelapi.np = np
