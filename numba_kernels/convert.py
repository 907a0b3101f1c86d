"""Loading inputs as float32 and storing outputs in the input dtype, on the GPU and in the
simulator alike. The one place where the two differ: bfloat16 travels as its 16-bit pattern
(int16 views: the simulator has no bfloat16 and NumPy needs ml_dtypes for it), and turning bits
into a float is a libdevice call on the GPU and a NumPy view in the simulator, which has no
libdevice.
"""
import numpy as np
from numba import config, cuda, float32, int32, int64

SIMULATOR = bool(config.ENABLE_CUDASIM)

if SIMULATOR:

    def _bits_to_float(bits):
        return np.uint32(bits & 0xFFFFFFFF).view(np.float32)

    def _float_to_bits(x):
        return int(np.float32(x).view(np.uint32))

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def _bits_to_float(bits):
        return libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True, inline=True)
    def _float_to_bits(x):
        return int64(libdevice.float_as_int(x)) & 0xFFFFFFFF


@cuda.jit(device=True, inline=True)
def bf16_to_float(bits):
    """A bfloat16 bit pattern (int16 or uint16) as float32: the pattern is the top half."""
    return _bits_to_float((int64(bits) & 0xFFFF) << 16)


@cuda.jit(device=True, inline=True)
def float_to_bf16(x):
    """float32 -> bfloat16 bits, round to nearest even, NaN kept NaN (as the hardware does)."""
    u = _float_to_bits(x)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet_nan = (u >> 16) | 0x40
    # A select, not a branch: a branch in the output loop stops the compiler from unrolling
    # it, and the accumulators it indexes then move from registers to local memory.
    return int16_bits(quiet_nan if x != x else rounded)


@cuda.jit(device=True, inline=True)
def int16_bits(u):
    """The low 16 bits of u as an int16 value with the same bit pattern."""
    u = u & 0xFFFF
    return int32(u - 0x10000 if u >= 0x8000 else u)


@cuda.jit(device=True, inline=True)
def f16_to_float(x):
    return float32(x)


@cuda.jit(device=True, inline=True)
def f32_to_float(x):
    return float32(x)


@cuda.jit(device=True, inline=True)
def float_to_f32(x):
    return float32(x)


# dtype name -> (load as float32, store from float32, dtype of the array the kernel sees)
CONVERTERS = {
    "float32": (f32_to_float, float_to_f32, "float32"),
    "float16": (f16_to_float, float_to_f32, "float16"),  # the store rounds (cvt.rn)
    "bfloat16": (bf16_to_float, float_to_bf16, "int16"),
}
