"""numba_kernels/launch.py and numba_internals.py: the cached launch plan of torch calls, on
the CPU.

The real path needs a GPU (tests/test_gpu.py runs every battery case through it). Here
Numba's dispatcher, its compiled kernel and the driver's launch are stand-ins with the same
interface, so the plan's bookkeeping is tested: the first call of a layout goes through Numba
and builds a plan; later calls launch with their own tensors' pointers; another layout gets
another plan; where the internals are missing every call goes through Numba, with one
warning. The flattening itself is tested against numba-cuda's real _Kernel._prepare_args and
device arrays, and the packing of the flattened parameters (a real PackedLaunch, the driver
call stood in for) against the sizes a kernel's image declares.
"""
import ctypes
import os
import subprocess
import sys
import threading
from types import MethodType, SimpleNamespace

import numpy as np
import pytest

from numba_kernels import launch, numba_internals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Tensor:
    """What launch reads of a torch CUDA tensor."""

    def __init__(self, ptr, shape=(2, 3), dtype="float32"):
        self.ptr, self.shape, self.dtype = ptr, tuple(shape), dtype

    def data_ptr(self):
        return self.ptr

    def stride(self):
        return (self.shape[1], 1)

    def get_device(self):
        return 0


class DeviceArray:
    """What cuda.as_cuda_array makes of a Tensor."""

    def __init__(self, t):
        self.tensor = t
        self.device_ctypes_pointer = ctypes.c_void_p(t.ptr)


class Compiled:
    """A compiled kernel version: Numba's flattening of arrays (meminfo, parent, size,
    itemsize, data, shape, strides) and scalars."""

    def __init__(self, types):
        self.argument_types = types
        self._codelibrary = SimpleNamespace(get_cufunc=lambda: SimpleNamespace(kernel="fn"))

    def _prepare_args(self, ty, value, stream, retr, params):
        if ty == "array":
            t = value.tensor
            params += [0, 0, 6, 4, t.ptr, *t.shape, *(4 * s for s in t.stride())]
        else:
            params.append(ctypes.c_int64(value))


class Dispatcher:
    """kernel[blocks, threads, stream](*args) records the pointers it was given."""

    def __init__(self, internals=True):
        self.overloads = {}
        self.numba_calls, self.configs = [], []
        self.compiled = Compiled if internals else lambda types: SimpleNamespace()

    @staticmethod
    def typeof_pyval(a):
        return "array" if isinstance(a, DeviceArray) else "int"

    def __getitem__(self, config):
        def run(*args):
            types = tuple(self.typeof_pyval(a) for a in args)
            self.overloads.setdefault(types, self.compiled(types))
            self.numba_calls.append([a.tensor.ptr if isinstance(a, DeviceArray) else a
                                     for a in args])
            self.configs.append(config)
        return run


class FakePacked:
    """numba_internals.PackedLaunch without a GPU: a launch appends (stream, function, config,
    the parameters with the writes applied) to `launched`."""

    launched = None

    def __init__(self, function, params, grid, block, stream_handle, shared):
        self.function, self.params = function, list(params)
        self.config, self.stream = dict(grid=grid, block=block, shared=shared), stream_handle

    def __call__(self, writes):
        params = list(self.params)
        for slot, value in writes:
            params[slot] = value
        self.launched.append((self.stream, self.function, self.config, params))


@pytest.fixture
def fake_gpu(monkeypatch):
    """launch.py outside the simulator, with cuda.as_cuda_array and the packed launch stood
    in for; returns the list of fast launches (stream, function, config, parameters)."""
    fast = []
    monkeypatch.setattr(launch, "SIMULATOR", False)
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.setattr(launch.cuda, "as_cuda_array", DeviceArray, raising=False)
    monkeypatch.setattr(numba_internals, "PROBLEM", None)
    monkeypatch.setattr(numba_internals, "_WARNED", [])
    monkeypatch.setattr(FakePacked, "launched", fast)
    monkeypatch.setattr(numba_internals, "PackedLaunch", FakePacked)
    return fast


STREAM = SimpleNamespace(handle=ctypes.c_void_p(1234))


def test_later_calls_launch_with_their_own_pointers(fake_gpu):
    kernel = Dispatcher()
    launch.launch(kernel, "k", 8, 64, STREAM, Tensor(100), Tensor(200), 5)
    assert kernel.numba_calls == [[100, 200, 5]] and fake_gpu == []
    launch.launch(kernel, "k", 8, 64, STREAM, Tensor(300), Tensor(400), 5)
    assert len(kernel.numba_calls) == 1
    (stream, fn, config, params), = fake_gpu
    assert stream == 1234 and fn == "fn"
    assert config == dict(grid=8, block=64, shared=0)
    # two arrays of 2-D shape (2, 3): 9 words each, their data pointers at 4 and 13
    assert params[4] == 300 and params[13] == 400 and params[5:9] == [2, 3, 12, 4]
    assert params[18].value == 5


def test_dynamic_shared_memory_is_allowed_before_the_first_launch(fake_gpu, monkeypatch):
    """Above 48 KB the kernel is let take its dynamic shared memory before Numba's launch
    (which would fail otherwise), and the packed launch passes the same bytes."""
    kernel, allowed = Dispatcher(), []
    monkeypatch.setattr(numba_internals, "allow_dynamic_shared", lambda k, args, n: allowed.append(
        (k, [a.tensor.ptr for a in args[:1]], n, len(k.numba_calls))))
    launch.launch(kernel, "k", 8, 64, STREAM, Tensor(100), 5, shared=48 * 1024)
    assert allowed == [] and kernel.configs == [(8, 64, STREAM, 48 * 1024)]
    launch.launch(kernel, "k", 8, 64, STREAM, Tensor(100), 5, shared=77056)
    assert allowed == [(kernel, [100], 77056, 1)]  # before that layout's Numba launch
    launch.launch(kernel, "k", 8, 64, STREAM, Tensor(300), 5, shared=77056)
    assert kernel.configs[-1] == (8, 64, STREAM, 77056) and len(kernel.configs) == 2
    assert fake_gpu[-1][2] == dict(grid=8, block=64, shared=77056)


@pytest.mark.parametrize("change", ["shape", "scalar", "grid", "stream"])
def test_another_layout_goes_through_numba_again(fake_gpu, change):
    kernel = Dispatcher()
    launch.launch(kernel, "k", 8, 64, STREAM, Tensor(100), 5)
    args = dict(blocks=8, stream=STREAM, tensor=Tensor(300), scalar=5)
    args.update(dict(shape=dict(tensor=Tensor(300, (4, 3))), scalar=dict(scalar=6),
                     grid=dict(blocks=9),
                     stream=dict(stream=SimpleNamespace(handle=ctypes.c_void_p(99))))[change])
    launch.launch(kernel, "k", args["blocks"], 64, args["stream"], args["tensor"],
                  args["scalar"])
    assert len(kernel.numba_calls) == 2 and fake_gpu == []


def test_without_the_internals_every_call_takes_numbas_launch(fake_gpu):
    kernel = Dispatcher(internals=False)  # a compiled version without _prepare_args
    with pytest.warns(numba_internals.FastLaunchOff, match="fast launch is off") as warned:
        for ptr, shape in ((100, (2, 3)), (300, (2, 3)), (500, (4, 3))):
            launch.launch(kernel, "k", 8, 64, STREAM, Tensor(ptr, shape), 5)
    assert [c[0] for c in kernel.numba_calls] == [100, 300, 500] and fake_gpu == []
    assert len(warned) == 1  # once a process, not once a layout


def test_a_changed_internal_turns_the_fast_launch_off(fake_gpu, monkeypatch):
    monkeypatch.setattr(numba_internals, "PROBLEM", "_Kernel._prepare_args takes [...]")
    kernel = Dispatcher()
    with pytest.warns(numba_internals.FastLaunchOff, match="_prepare_args takes"):
        for ptr in (100, 300):
            launch.launch(kernel, "k", 8, 64, STREAM, Tensor(ptr), 5)
    assert len(kernel.numba_calls) == 2 and fake_gpu == []


def test_numbas_real_internals_outside_the_simulator():
    """The import check and the flattening against numba-cuda itself (its _Kernel, its device
    arrays), in a process of their own: this one may run in the simulator."""
    pytest.importorskip("cuda.core", reason="needs numba-cuda's CUDA bindings (ptx extra)")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-c", "import tests.test_launch as t; "
                          "t.real_import_check(); t.real_flattening((12, 4)); "
                          "t.real_flattening((4, 8)); print('ok')"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def real_import_check():
    from numba.cuda.dispatcher import _Kernel

    assert numba_internals.PROBLEM is None, numba_internals.PROBLEM
    assert numba_internals.numba_cuda_version() in numba_internals.TESTED_WITH
    real = _Kernel._prepare_args
    _Kernel._prepare_args = lambda self, ty, val, stream, params: None
    try:
        assert "_prepare_args takes" in numba_internals._check()
    finally:
        _Kernel._prepare_args = real


def real_flattening(strides):
    """Numba's flattening of arrays (meminfo, parent, size, itemsize, data, shape, strides)
    and scalars, with real Numba device arrays over stand-in device memory: the data pointer
    slots found are where each array's pointer is."""
    from numba.cuda import types
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.cuda.dispatcher import _Kernel

    def device_array(ptr):
        memory = SimpleNamespace(device_ctypes_pointer=ctypes.c_void_p(ptr))
        return DeviceNDArray((2, 3), strides, np.float32, gpu_data=memory)

    array = types.Array(types.float32, 2, "A")
    compiled = SimpleNamespace(
        argument_types=(array, types.int32, array, types.float32),
        _prepare_args=MethodType(_Kernel._prepare_args, SimpleNamespace(extensions=[])),
        _codelibrary=SimpleNamespace(get_cufunc=lambda: SimpleNamespace(kernel="fn")))
    devs = (device_array(0x7F0000001000), 7, device_array(0x7F0000002000), 0.5)
    kernel = SimpleNamespace(overloads={("a", int, "a", float): compiled},
                             typeof_pyval=lambda a: "a" if hasattr(a, "gpu_data") else type(a))
    function, params, slots = numba_internals.flatten(kernel, devs, 0, {0, 2})
    assert function == "fn" and slots == [(4, 0), (14, 2)], slots
    assert params[:9] == [0, 0, 6, 4, 0x7F0000001000, 2, 3, *strides], params
    assert params[9].value == 7 and params[14] == 0x7F0000002000
    assert params[19].value == 0.5


def packed_launch(params, sizes, grid=(4, 2), block=128, stream=1234, shared=0):
    """A real PackedLaunch over a stand-in kernel (its handle and declared parameter sizes)
    whose driver call appends its arguments to the returned list instead of launching."""
    pytest.importorskip("cuda.bindings", reason="needs numba-cuda's CUDA bindings (ptx extra)")
    function = SimpleNamespace(handle="fn", arguments_info=[(0, size) for size in sizes])
    packed = numba_internals.PackedLaunch(function, params, grid, block, stream, shared)
    calls = []
    packed._driver = SimpleNamespace(cuLaunchKernel=lambda *a: calls.append(a) or (0,),
                                     CUresult=SimpleNamespace(CUDA_SUCCESS=0))
    return packed, calls


def test_a_packed_launch_gives_the_driver_each_parameter_as_declared(monkeypatch):
    import struct

    monkeypatch.setattr(numba_internals, "_BOUND", SimpleNamespace(context=True))
    params = [0x7F0000001000, -8, ctypes.c_int32(-3), ctypes.c_float(0.5), True,
              ctypes.c_uint16(7)]
    packed, calls = packed_launch(params, [8, 8, 4, 4, 1, 2])
    packed([(0, 0x7F0000002000)])
    packed([(0, 0x7F0000003000)])
    (fn, *dims, shared, stream, addresses, extra), = calls[:1]
    assert fn == "fn" and dims == [4, 2, 1, 128, 1, 1] and shared == 0 and extra == 0
    assert int(stream) == 1234
    pointers = (ctypes.c_uint64 * len(params)).from_address(addresses)

    def read(j, fmt):
        return struct.unpack_from(fmt, ctypes.string_at(pointers[j], struct.calcsize(fmt)))[0]

    assert read(0, "<Q") == 0x7F0000003000  # the last launch's write
    assert (read(1, "<q"), read(2, "<i"), read(3, "<f"), read(4, "<?"), read(5, "<H")) == \
        (-8, -3, 0.5, True, 7)


def test_a_packed_launch_passes_its_dynamic_shared_memory(monkeypatch):
    monkeypatch.setattr(numba_internals, "_BOUND", SimpleNamespace(context=True))
    packed, calls = packed_launch([5], [8], shared=77056)
    packed([])
    assert calls[0][7] == 77056  # cuLaunchKernel's sharedMemBytes


@pytest.mark.parametrize("loaded_as", ["CUkernel", "CUfunction"])
def test_dynamic_shared_memory_is_allowed_on_the_version_the_arguments_select(monkeypatch,
                                                                             loaded_as):
    """allow_dynamic_shared compiles (or finds) the version for the arguments' types and sets
    its MAX_DYNAMIC_SHARED_SIZE_BYTES through the call that fits its handle's type."""
    driver = pytest.importorskip("cuda.bindings.driver", reason="needs the ptx extra")
    import numba.cuda

    calls = []
    for name in ("cuKernelSetAttribute", "cuFuncSetAttribute"):
        monkeypatch.setattr(driver, name, lambda *a, name=name: calls.append((name, a)) or (
            driver.CUresult.CUDA_SUCCESS,))
    monkeypatch.setattr(numba.cuda, "get_current_device", lambda: SimpleNamespace(id=3))
    handle = getattr(driver, loaded_as)()
    versions = {("a", int): SimpleNamespace(_codelibrary=SimpleNamespace(
        get_cufunc=lambda: SimpleNamespace(kernel=SimpleNamespace(handle=handle))))}
    kernel = SimpleNamespace(compile=versions.__getitem__,
                             typeof_pyval=lambda a: "a" if isinstance(a, np.ndarray) else type(a))
    numba_internals.allow_dynamic_shared(kernel, (np.zeros(2), 7), 77056)
    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    if loaded_as == "CUkernel":
        assert calls == [("cuKernelSetAttribute", (attribute, 77056, handle, 3))]
    else:
        assert calls == [("cuFuncSetAttribute", (handle, attribute, 77056))]
    monkeypatch.setattr(driver, "cuKernelSetAttribute", lambda *a: (
        driver.CUresult.CUDA_ERROR_INVALID_VALUE,))
    monkeypatch.setattr(driver, "cuFuncSetAttribute", lambda *a: (
        driver.CUresult.CUDA_ERROR_INVALID_VALUE,))
    with pytest.raises(RuntimeError, match="cannot take 77056 bytes"):
        numba_internals.allow_dynamic_shared(kernel, (np.zeros(2), 7), 77056)


@pytest.mark.parametrize("sizes", [[8, 8], [8, 4, 4], [8, 8, 8]])
def test_a_packed_launch_refuses_parameters_the_image_does_not_declare(sizes):
    """Two parameters (an int and a c_int32) against images declaring other counts or
    sizes: the internals changed, and the launch must not guess."""
    with pytest.raises(numba_internals.InternalsChanged, match="declares"):
        packed_launch([5, ctypes.c_int32(1)], sizes)


def test_each_thread_binds_numbas_context_before_its_first_fast_launch(monkeypatch):
    """A thread that never touched CUDA through Numba has no current context; the driver
    refuses a launch there (seen on the H200: CUDA_ERROR_INVALID_CONTEXT)."""
    bound = []
    monkeypatch.setattr(numba_internals, "_BOUND", threading.local())
    monkeypatch.setattr(launch.cuda, "current_context",
                        lambda: bound.append(threading.get_ident()), raising=False)
    packed, launched = packed_launch([5], [8])

    def two_launches():
        for _ in range(2):
            packed([])

    two_launches()
    thread = threading.Thread(target=two_launches)
    thread.start()
    thread.join()
    assert len(launched) == 4 and len(bound) == 2 and bound[0] != bound[1]


def test_pyproject_pins_the_tested_numba_cuda_versions():
    """pyproject.toml's numba-cuda range and numba_internals.TESTED_WITH say the same."""
    import re

    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        pins = set(re.findall(r'numba-cuda(?:\[\w+\])?>=([\d.]+),<([\d.]+)"', f.read()))
    assert len(pins) == 1, pins  # one range, in the dependencies and every extra
    low, high = (tuple(int(p) for p in v.split(".")) for v in pins.pop())
    for version in numba_internals.TESTED_WITH:
        assert low <= tuple(int(p) for p in version.split(".")) < high, version
