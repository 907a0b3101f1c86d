"""numba_kernels/launch.py: the cached launch plan of torch calls, on the CPU.

The real path needs a GPU (scripts/dev/gpu_check.py runs every battery case through it). Here Numba's
dispatcher, its compiled kernel and cuda.core's launch are stand-ins with the same interface,
so the plan's bookkeeping is tested: the first call of a layout goes through Numba and builds
a plan; later calls launch with their own tensors' pointers; another layout gets another plan;
where the internals are missing every call goes through Numba.
"""
import ctypes
from types import SimpleNamespace

import pytest

from numba_kernels import launch


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
        self.numba_calls = []
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
        return run


@pytest.fixture
def fake_gpu(monkeypatch):
    """launch.py outside the simulator, with cuda.as_cuda_array and cuda.core stood in for;
    returns the list of fast launches (stream, function, config, parameters)."""
    fast = []
    monkeypatch.setattr(launch, "SIMULATOR", False)
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.setattr(launch, "_CORE_STREAMS", {})
    monkeypatch.setattr(launch.cuda, "as_cuda_array", DeviceArray, raising=False)
    monkeypatch.setattr(launch, "_cuda_core", lambda: (
        lambda **kw: kw, SimpleNamespace(from_handle=lambda handle: ("stream", handle)),
        lambda stream, config, fn, *params: fast.append((stream, fn, config, list(params)))))
    return fast


STREAM = SimpleNamespace(handle=ctypes.c_void_p(1234))


def test_later_calls_launch_with_their_own_pointers(fake_gpu):
    kernel = Dispatcher()
    launch.launch(kernel, "k", 8, 64, STREAM, Tensor(100), Tensor(200), 5)
    assert kernel.numba_calls == [[100, 200, 5]] and fake_gpu == []
    launch.launch(kernel, "k", 8, 64, STREAM, Tensor(300), Tensor(400), 5)
    assert len(kernel.numba_calls) == 1
    (stream, fn, config, params), = fake_gpu
    assert stream == ("stream", 1234) and fn == "fn"
    assert config == dict(grid=8, block=64, shmem_size=0)
    # two arrays of 2-D shape (2, 3): 9 words each, their data pointers at 4 and 13
    assert params[4] == 300 and params[13] == 400 and params[5:9] == [2, 3, 12, 4]
    assert params[18].value == 5


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
    for ptr in (100, 300, 500):
        launch.launch(kernel, "k", 8, 64, STREAM, Tensor(ptr), 5)
    assert [c[0] for c in kernel.numba_calls] == [100, 300, 500] and fake_gpu == []
