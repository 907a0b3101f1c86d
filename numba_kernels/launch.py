"""Launching a compiled kernel, with little host work per call for torch tensors.

Numba's `kernel[blocks, threads, stream](*args)` types every argument and flattens every array
into the kernel's parameters (its data pointer, shape and strides) at each call; turning a torch
tensor into a Numba device array (cuda.as_cuda_array) costs more. For flash_fwd's 22 arguments
that was as long as the kernel itself at N = 1024, and the GPU waits for it whenever the
caller waits for each result.

So `launch` keeps, for each kernel and argument layout (the tensors' dtypes, shapes, strides
and device, the scalars' values, the grid and the stream), the compiled function and its
flattened parameter list.
The first call of a layout goes through Numba's own launch, which compiles the variant when it
is new; a later call with the same layout only writes the tensors' data pointers into the packed
list and launches it with the driver's cuLaunchKernel. NumPy, CuPy and Numba device
arrays, and every call in the simulator, take Numba's launch each time. What this needs of
Numba's internals is in numba_internals.py, and only there.
"""
import time
import warnings

from numba import cuda

from . import numba_internals, replay
from .compile_cache import compiling
from .convert import SIMULATOR
from .common import STATIC_SHARED_LIMIT

if SIMULATOR:
    # The simulator runs the kernels' float32 arithmetic on NumPy scalars, one Python thread
    # per CUDA thread, and NumPy warns where the GPU computes in silence what the kernels
    # mean (-inf - -inf = NaN in a score that is then selected away, 0 * inf in a product
    # that takes no part): those warnings are off, for the kernels' own modules only.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"numba_kernels\.")

# What compiling, or loading from the disk cache (compile_cache.py), took in this process:
# KernelSpec (or merge dtype) -> seconds.
COMPILE_SECONDS = {}
# Launches that reused a cached parameter list (for the GPU checks: the fast path ran).
FAST_LAUNCHES = [0]
MAX_PLANS = 4096
_PLANS = {}  # layout -> _Plan, or None where a layout cannot take the fast path


def compile_times():
    """{KernelSpec or merge dtype: seconds} for every kernel this process compiled or loaded
    from the disk cache so far (the first call of a variant pays for it; later calls reuse
    it)."""
    return dict(COMPILE_SECONDS)


def launch(kernel, key, blocks, threads, stream, *args, shared=0):
    """kernel[blocks, threads, stream, shared](*args), where array arguments may also be torch
    CUDA tensors and `shared` is the bytes of dynamic shared memory (above 48 KB the kernel
    is let take them first: numba_internals.allow_dynamic_shared). When the launch compiled
    a new version of the kernel, the seconds it took are added to COMPILE_SECONDS[key]."""
    tensors = [i for i, a in enumerate(args) if hasattr(a, "data_ptr")]
    if SIMULATOR or not tensors:
        _numba_launch(kernel, key, blocks, threads, stream, shared, args)
        replay.launched(None, args)
        return
    layout = (kernel, blocks, threads, _handle(stream), shared) + tuple(
        (a.dtype, a.shape, a.stride(), a.get_device()) if i in tensors else (type(a), a)
        for i, a in enumerate(args))
    plan = _PLANS.get(layout, False)
    if plan:
        plan.launch(args)
        FAST_LAUNCHES[0] += 1
        replay.launched(plan, args)
        return
    devs = tuple(cuda.as_cuda_array(a) if i in tensors else a for i, a in enumerate(args))
    _numba_launch(kernel, key, blocks, threads, stream, shared, devs)
    if plan is False:  # the first call of this layout (None: it cannot take the fast path)
        if len(_PLANS) >= MAX_PLANS:  # many shapes (varying sequence lengths): start over
            _PLANS.clear()
        plan = _PLANS[layout] = _Plan.build(kernel, blocks, threads, stream, shared, devs,
                                            tensors)
    replay.launched(plan, args)


def resident_blocks(kernel, key, threads, *args, shared=0):
    """How many blocks of kernel, launched with `threads` threads, `shared` bytes of dynamic
    shared memory and arguments like args (torch tensors too), an SM holds at once
    (numba_internals.resident_blocks), compiling the variant first where it is new (its
    seconds added to COMPILE_SECONDS[key]); None in the simulator, or where numba-cuda's
    internals differ. Kept per kernel, threads and shared."""
    if SIMULATOR:
        return None
    found = _RESIDENT.get((kernel, threads, shared))
    if found is None:
        devs = tuple(cuda.as_cuda_array(a) if hasattr(a, "data_ptr") else a for a in args)
        versions = len(kernel.overloads)
        t0 = time.perf_counter()
        try:
            with compiling(kernel):
                found = numba_internals.resident_blocks(kernel, devs, threads, shared)
        except numba_internals.InternalsChanged as e:
            warnings.warn(f"numba_kernels: a kernel's occupancy cannot be read ({e}); "
                          "split-KV takes its default blocks an SM", RuntimeWarning,
                          stacklevel=2)
            return None
        if len(kernel.overloads) > versions:
            COMPILE_SECONDS[key] = COMPILE_SECONDS.get(key, 0.0) + time.perf_counter() - t0
        _RESIDENT[(kernel, threads, shared)] = found
    return found


_RESIDENT = {}  # (kernel, threads, shared) -> resident_blocks


def _numba_launch(kernel, key, blocks, threads, stream, shared, args):
    versions = len(getattr(kernel, "overloads", ()))  # the simulator compiles nothing
    t0 = time.perf_counter()
    with compiling(kernel):  # compiling: the only process compiling the variant
        if shared > STATIC_SHARED_LIMIT and not SIMULATOR:
            numba_internals.allow_dynamic_shared(kernel, args, shared)  # compiles it first
        kernel[blocks, threads, stream, shared](*args)
    if len(getattr(kernel, "overloads", ())) > versions:
        COMPILE_SECONDS[key] = COMPILE_SECONDS.get(key, 0.0) + time.perf_counter() - t0


def _handle(stream):
    """The CUstream address of a Numba stream (0 for the default stream)."""
    if not stream:
        return 0
    handle = stream.handle
    return int(getattr(handle, "value", handle) or 0)


class _Plan:
    """A compiled kernel's launch with its parameters packed (numba_internals.PackedLaunch),
    and the (slot, argument index) of each tensor's data pointer among them."""

    def __init__(self, packed, pointer_slots):
        self.packed, self.pointer_slots = packed, pointer_slots

    @classmethod
    def build(cls, kernel, blocks, threads, stream, shared, devs, tensors):
        """The plan for the launch just made with `devs`, or None where numba-cuda's internals
        are not as numba_internals expects (then every call takes Numba's launch, and the
        first such call warns)."""
        try:
            function, params, slots = numba_internals.flatten(kernel, devs, stream, tensors)
            packed = numba_internals.PackedLaunch(function, params, blocks, threads,
                                                  _handle(stream), shared)
        except (numba_internals.InternalsChanged, ImportError) as e:
            numba_internals.warn_fallback(str(e))
            return None
        return cls(packed, slots)

    def launch(self, args):
        self.packed([(slot, args[i].data_ptr()) for slot, i in self.pointer_slots])
