"""The arrays a call takes and returns: NumPy arrays (copied to the device and back), torch
CUDA tensors, CuPy arrays and Numba device arrays (used in place, on the caller's current
stream); each kind's device views, empty outputs, mask, bias and key counts, and the checked
problem of a call (begin)."""
from collections import namedtuple

import numpy as np
from numba import cuda

from reference.contract import BLOCK_SIZE, check_attention_args, check_block_mask, row_lengths
from reference.dtypes import TRANSPORT, dtype_name, numpy_dtype, torch_dtype, transported
from .common import LOG2E
from .convert import SIMULATOR
from . import replay
from .plan import row_extremes, row_maxima
from .specs import DTYPES, MAX_HEAD_DIM


NO_DEVICE = ("no CUDA GPU is available. To run the kernel on the CPU, set the environment "
             "variable NUMBA_ENABLE_CUDASIM=1 before Python starts (the simulator runs one "
             "Python thread per CUDA thread: tiny sizes only).")


def dtype_of(x):
    """x's dtype name, as check_attention_args names it, without checking anything else."""
    return str(getattr(x, "dtype", "")).replace("torch.", "")


def results(io, out, lse, return_lse):
    """What a forward call returns: out, or (out, lse), in the caller's array kind."""
    out, lse = io.result(out), io.result(lse)
    return (out, lse) if return_lse else out


def begin(q, k, v, scale, causal, mask, bias, kv_lengths, window, block_mask=None,
          block_size=BLOCK_SIZE, outputs=True, **more):
    """(problem, io, out, lse) of a call: the arguments checked against the contract and
    this kernel's limits, the array handling for their kind, the empty outputs (None, None
    where `outputs` is False: the backward allocates its own)."""
    pb = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                              kv_lengths=kv_lengths, window=window, dtypes=DTYPES)
    if block_mask is not None:
        check_block_mask(block_mask, block_size, pb)
        more = dict(more, block_mask=block_mask)
    if max(pb.d, pb.dv) > MAX_HEAD_DIM:
        raise ValueError(f"head dims D={pb.d}, Dv={pb.dv}: this kernel supports at most "
                         f"{MAX_HEAD_DIM}")
    if abs(pb.scale) > 1.0:  # the default is 1 / sqrt(D)
        check_score_range(pb, q, k)
    io = io_for(q, k, v, mask, bias, kv_lengths, **more)
    if not outputs:
        return pb, io, None, None
    out = io.empty((pb.batch, pb.heads_q, pb.n_q, pb.dv), pb.dtype)
    lse = io.empty((pb.batch, pb.heads_q, pb.n_q), "float32")
    return pb, io, out, lse


FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_score_range(pb, q, k):
    """A ValueError where scale * (q . k) in log2 units, which the kernels hold in float32, can
    pass float32's largest value (D max|q| max|k| |scale| log2(e) does): the contract does not
    ask kernels for scores past float32, and the NaN they would give is a silent wrong answer.
    Reads q and k once (begin calls it for |scale| > 1 only)."""
    (q_top, _), (k_top, _) = row_extremes([row_maxima(q), row_maxima(k)])
    bound = pb.d * abs(pb.scale) * LOG2E * q_top * k_top
    if bound >= FLOAT32_MAX:
        raise ValueError(f"scale={pb.scale:g}: with max|q| and max|k| of these inputs the "
                         f"scores can pass float32's range ({bound:.3g} in log2 units against "
                         f"{FLOAT32_MAX:.3g}), which the kernels compute in; scale q or k "
                         f"instead, or give a smaller scale")


BlockTable = namedtuple("BlockTable", "dev steps block_m block_n masked")


def block_table(io, pb, block_mask, block_size, masked):
    """A block mask on the device as the pre-passes read it (prepass.class_prepass,
    fit_blocks): a BlockTable of the table as uint8 with its steps, its blocks' rows and
    keys, and masked, whether a boolean mask comes with it; None without a block mask."""
    if block_mask is None:
        return None
    block_m, block_n = check_block_mask(block_mask, block_size, pb)
    dev, steps = io.mask(block_mask)
    return BlockTable(dev, steps, block_m, block_n, masked)


def masked(mask, bias, blocks):
    """Whether a call runs the variants that read a mask and a bias (and walk visible
    lists): a boolean mask, a bias or a block mask (or its BlockTable) is given."""
    return mask is not None or bias is not None or blocks is not None


def side_inputs(io, pb, mask, bias, kv_lengths):
    """(mask, bias, key counts) on the device, and {mask_steps, bias_steps}: the kernels'
    arguments beside q, k and v."""
    mask_dev, mask_steps = io.mask(mask)
    bias_dev, bias_steps = io.bias(bias)
    lengths = io.lengths(np.asarray(row_lengths(pb, kv_lengths), np.int32),
                         kv_lengths is not None)
    return mask_dev, bias_dev, lengths, dict(mask_steps=mask_steps, bias_steps=bias_steps)


def band(pb):
    """The kernels' scale and band arguments: qk_scale (log2 units), left, right,
    bottom_right (the contract's key_range)."""
    return dict(qk_scale=np.float32(pb.scale * LOG2E), left=pb.left, right=pb.right,
                bottom_right=int(pb.bottom_right))


def sm_count():
    """Streaming multiprocessors of the current device (the simulator pretends one)."""
    if SIMULATOR:
        return 1
    device = cuda.get_current_device()
    count = _SM_COUNTS.get(device.id)
    if count is None:
        count = _SM_COUNTS[device.id] = device.MULTIPROCESSOR_COUNT
    return count


_SM_COUNTS = {}  # device id -> SMs (an attribute query to the driver each time otherwise)


def _kind(x, name="q"):
    module = type(x).__module__.split(".")[0]
    if module == "torch":
        return "torch"
    if module == "numpy":
        return "numpy"
    if hasattr(x, "__cuda_array_interface__") or hasattr(x, "copy_to_host"):
        return "cuda"  # CuPy, Numba device arrays (and the simulator's)
    raise TypeError(f"{name}: expected a NumPy array, a torch CUDA tensor or a CUDA array, "
                    f"got {type(x).__name__}")


def io_for(q, k, v, mask, bias, kv_lengths, **more):
    """The array handling of a call whose arrays are q, k, v, the side inputs and `more`
    (named arrays, or None): NumPy and torch calls take every array (kv_lengths aside, read
    on the host) of q's kind, or a TypeError names the one that differs; CUDA arrays may
    come with a NumPy bias."""
    kinds = {name: _kind(x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(kinds.values())) != 1:
        raise TypeError(f"q, k and v must be the same kind of array, got {kinds}")
    kind = kinds["q"]
    for name, x in dict(mask=mask, bias=bias, **more).items():
        if x is not None and kind != "cuda" and _kind(x, name) != kind:
            raise TypeError(f"{name} is a {_kind(x, name)} array and q a {kind} one: pass "
                            f"every array of a call as one kind")
    if kind == "torch":
        for name, x in dict(q=q, k=k, v=v, mask=mask, bias=bias, kv_lengths=kv_lengths,
                            **more).items():
            if x is not None and not x.is_cuda:
                raise TypeError(f"{name} is a CPU tensor: pass CUDA tensors, or NumPy arrays "
                                f"(copied to the device and back)")
            if x is not None and x.device != q.device:
                raise ValueError(f"{name} is on {x.device} and q on {q.device}: pass tensors "
                                 f"on one device")
    if not cuda.is_available():
        raise RuntimeError(NO_DEVICE)
    if kind == "cuda":
        cupy_inputs = type(q).__module__.startswith("cupy")
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not cupy_inputs and not _device_array(x).is_c_contiguous():
                raise ValueError(f"{name}: {STRIDED_DEVICE_ARRAY}")
        return CudaIO(cupy_inputs)
    if kind == "torch":
        return TorchIO(q.device)
    return NumpyIO()


def native(x):
    """A NumPy array in the machine's byte order (big-endian arrays converted, a copy)."""
    if getattr(x.dtype, "byteorder", "=") in "<>" and not x.dtype.isnative:
        return x.astype(x.dtype.newbyteorder("="))
    return x


class NumpyIO:
    """Host arrays: copied to the device, results copied back."""

    stream = 0

    def dev(self, x):
        if isinstance(x, Pending):
            return x.device
        return cuda.to_device(np.ascontiguousarray(transported(native(x))))  # bfloat16: bits

    def empty(self, shape, dtype):
        return Pending(shape, dtype)

    def scratch(self, shape, dtype="uint8"):
        """uint8 (or dtype) on the device, for the kernels' own use: never copied back."""
        return cuda.device_array(shape, np.dtype(dtype))

    @staticmethod
    def words(x):
        """The memory of x (from dev: C-contiguous 16-bit values, an even last dim) as flat
        int32 words, no copy: the pre-pass reads two values a load."""
        return x.view(np.int32).reshape(x.size // 2)

    @staticmethod
    def flat(x):
        """x (from dev: C-contiguous) as one dimension, no copy."""
        return x.reshape(x.size)

    def mask(self, mask, lead=(1, 1)):
        """(mask on the device as uint8, its steps); for None the all-true mask of shape
        (*lead, 1, 1): with lead's batch and head dimensions, each key of each row."""
        if mask is None:
            return cuda.to_device(np.ones((*lead, 1, 1), np.uint8)), _steps((*lead, 1, 1))
        m = _as4d(np.asarray(mask))
        return cuda.to_device(np.ascontiguousarray(m).view(np.uint8)), _steps(m.shape)

    def bias(self, bias):
        if bias is None:
            return cuda.to_device(np.zeros((1, 1, 1, 1), np.float32)), (0, 0, 0, 0)
        x = _as4d(np.asarray(bias))
        return cuda.to_device(np.ascontiguousarray(x, dtype=np.float32)), _steps(x.shape)

    def lengths(self, host, given):
        return cuda.to_device(host)

    def result(self, x):
        return x.fetch()


class Pending:
    """An output buffer on the device, to be copied back into a host array of `dtype`."""

    def __init__(self, shape, dtype):
        self.dtype = dtype
        self.device = cuda.device_array(shape, TRANSPORT[dtype])

    def fetch(self):
        return self.device.copy_to_host().view(numpy_dtype(self.dtype))


class TorchIO:
    """torch CUDA tensors, zero copy, on torch's current stream and device. They go to the
    kernel as tensors (launch.py takes their pointers); the all-true mask and the key counts
    of calls without kv_lengths are made once per device and size, and kept."""

    _streams = {}  # CUstream address -> Numba external stream
    _constants = {}  # (device, what) -> tensor

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device
        handle = torch.cuda.current_stream(device).cuda_stream
        self.stream = self._streams.get(handle)
        if self.stream is None:
            self.stream = self._streams[handle] = cuda.external_stream(handle)

    def dev(self, x):
        # Strided inputs are copied contiguous: every kernel variant then has one compiled
        # version, for C-contiguous arrays, which the disk cache and warm-up cover
        # (compile_cache.py), where q, k and v being C-, F- or any-layout would be 27.
        return transported(x.detach().contiguous())

    def empty(self, shape, dtype):
        return replay.allocated(self.torch.empty(shape, dtype=getattr(self.torch, dtype),
                                                 device=self.device))

    def scratch(self, shape, dtype="uint8"):
        return replay.allocated(self.torch.empty(shape, dtype=getattr(self.torch, dtype),
                                                 device=self.device))

    def words(self, x):
        return x.view(self.torch.int32).reshape(-1)

    @staticmethod
    def flat(x):
        return x.reshape(-1)

    def mask(self, mask, lead=(1, 1)):
        if mask is None:
            return self._constant(("no mask", *lead), lambda: self.torch.ones(
                (*lead, 1, 1), dtype=self.torch.uint8, device=self.device)), _steps(
                    (*lead, 1, 1))
        m = _as4d(mask)
        return m.contiguous().view(self.torch.uint8), _steps(m.shape)

    def bias(self, bias):
        if bias is None:
            return self._constant("no bias", lambda: self.torch.zeros(
                (1, 1, 1, 1), dtype=self.torch.float32, device=self.device)), (0, 0, 0, 0)
        x = _as4d(bias)
        return x.to(self.torch.float32).contiguous(), _steps(x.shape)

    def lengths(self, host, given):
        if given:
            return self.torch.as_tensor(host, device=self.device)
        return self._constant(("lengths",) + tuple(host), lambda: self.torch.as_tensor(
            host, device=self.device))

    def _constant(self, what, make):
        key = (self.device, what)
        x = self._constants.get(key)
        if x is None:
            x = self._constants[key] = make()
        return replay.kept(x)

    def result(self, x):
        return x


class CudaIO(NumpyIO):
    """CuPy or Numba device arrays (__cuda_array_interface__), zero copy, default stream.
    Results come back as CuPy arrays when the inputs were CuPy arrays."""

    def __init__(self, cupy_inputs):
        self.cupy_inputs = cupy_inputs

    def dev(self, x):
        if isinstance(x, Pending):
            return x.device
        if type(x).__module__.startswith("cupy"):  # strided: copied, as for torch
            import cupy

            x = cupy.ascontiguousarray(x)
        x = _device_array(x)
        if not x.is_c_contiguous():
            raise ValueError(f"an array of shape {tuple(x.shape)}: {STRIDED_DEVICE_ARRAY}")
        return x

    def mask(self, mask, lead=(1, 1)):
        if mask is None:
            return super().mask(None, lead)
        m = _as4d(self.dev(mask))
        return m.view(np.uint8), _steps(m.shape)

    def bias(self, bias):
        if bias is None or type(bias).__module__.split(".")[0] == "numpy":
            return super().bias(None if bias is None else bias)
        import cupy

        x = _as4d(cupy.asarray(bias))
        return cuda.as_cuda_array(cupy.ascontiguousarray(x, dtype=cupy.float32)), \
            _steps(x.shape)

    def result(self, x):
        if self.cupy_inputs:
            import cupy

            return cupy.asarray(x.device)
        return x.device


STRIDED_DEVICE_ARRAY = ("a strided Numba device array; pass it C-contiguous (torch and CuPy "
                        "arrays are copied contiguous, other device arrays are not)")


def _device_array(x):
    """A Numba device array of a CUDA array (the simulator's own arrays are already one)."""
    return cuda.as_cuda_array(x) if hasattr(cuda, "as_cuda_array") and hasattr(
        x, "__cuda_array_interface__") else x


def _as4d(x):
    """A broadcastable mask or bias with its missing leading dimensions as size 1."""
    return x.reshape((1,) * (4 - len(x.shape)) + tuple(x.shape))


def _steps(shape):
    """Index multipliers that broadcast a 4-D mask: 0 along its size-1 dimensions."""
    return tuple(0 if n == 1 else 1 for n in shape)


def is_cpu_tensor(x):
    """Whether x is a torch tensor in host memory (taken through NumPy, on_device)."""
    return type(x).__module__.startswith("torch") and not x.is_cuda


def on_device(fn, arrays, options, **kw):
    """fn(*arrays, **options, **kw) on CUDA tensors as they are; CPU tensors go as NumPy
    arrays (bfloat16 through ml_dtypes) and come back as tensors."""
    import torch

    if arrays[0].is_cuda:
        return fn(*arrays, **options, **kw)
    to_np = {name: _numpy(x) for name, x in options.items() if isinstance(x, torch.Tensor)}
    result = fn(*(_numpy(x) for x in arrays), **dict(options, **to_np), **kw)
    return tuple(_tensor(x) for x in result)


def _numpy(x):
    import torch

    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return x.numpy()


def _tensor(x):
    import torch

    name = dtype_name(x)
    if name == "bfloat16":
        return torch.from_numpy(x.view("int16").copy()).view(torch_dtype(name))
    return torch.from_numpy(x.copy())
