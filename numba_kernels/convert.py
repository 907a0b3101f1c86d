"""Loading inputs as float32 and storing outputs in the input dtype, on the GPU and in the
simulator alike, and the kernel's 128-bit shared-memory load. The places where the two differ:
bfloat16 travels as its 16-bit pattern (int16 views: the simulator has no bfloat16 and NumPy
needs ml_dtypes for it), and turning bits into a float is a libdevice call on the GPU and a
NumPy view in the simulator, which has no libdevice; `load4` is one vector instruction on the
GPU and four reads in the simulator.
"""
import numpy as np
from numba import config, cuda

SIMULATOR = bool(config.ENABLE_CUDASIM)

# The scalar types kernels cast with. In the simulator Numba's are casts costing about 3.6 us
# a call, which in index arithmetic took a third of a simulated kernel's time: there NumPy's
# float32 (the same rounding) and exact Python ints (indices, never negative) stand in.
if SIMULATOR:
    float32, int32, int64, uint32, uint64 = np.float32, int, int, np.uint32, int
else:
    from numba import float32, int32, int64, uint32, uint64


def device_function(fn=None, fastmath=None):
    """A device function that NVVM always inlines into its callers. Inlining at the NVVM level
    rather than Numba's: Numba then types and lowers each device function once per argument
    types, not once per call site, and a kernel variant compiles in about 30% less time with
    the same registers. A device function compiles with its own fastmath flags, not its
    caller's: give the kernel's (device_function(fastmath=...)).

    In the simulator a device function that does not name `cuda` is the Python function
    itself: the simulator's device-function wrapper swaps the module's globals under a lock
    on every call, and with a block's threads calling it per element the lock and the GIL
    convoy (a D = 256 tile took 0.4 s or 110 s from run to run). One that names `cuda`
    (shared arrays, barriers, thread indices) keeps the wrapper, which gives it the
    simulated module."""
    if fn is None:
        return lambda f: device_function(f, fastmath)
    if SIMULATOR:
        return fn if "cuda" not in fn.__code__.co_names else cuda.jit(device=True)(fn)
    if fastmath:
        return cuda.jit(device=True, forceinline=True, fastmath=fastmath)(fn)
    return cuda.jit(device=True, forceinline=True)(fn)


if SIMULATOR:

    def load4(words, i):
        return words[i], words[i + 1], words[i + 2], words[i + 3]

    def bits_to_float(bits):
        return np.uint32(bits & 0xFFFFFFFF).view(np.float32)

    def float_to_bits(x):
        return int(np.float32(x).view(np.uint32))

else:
    from llvmlite import ir
    from numba.core import types
    from numba.core.extending import intrinsic
    from numba.cuda import libdevice

    @intrinsic
    def load4(typingctx, words, i):
        """words[i : i + 4] of a 1-D float32 array as a 4-tuple, in one 128-bit load
        (ld.shared.v4.f32 when `words` is shared memory). numba-cuda declares shared arrays
        4-byte aligned and emits one 32-bit load per element; this load promises 16 bytes:
        the caller keeps i a multiple of 4 and the array's start 16-byte aligned (a kernel's
        only shared array starts at offset 0 of the block's shared memory)."""
        if not (isinstance(words, types.Array) and words.ndim == 1
                and words.dtype == types.float32 and isinstance(i, types.Integer)):
            return None
        quad = types.UniTuple(types.float32, 4)

        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, args[0])
            index = context.cast(builder, args[1], signature.args[1], types.intp)
            first = builder.gep(array.data, [index])
            vector = builder.load(builder.bitcast(first, ir.VectorType(ir.FloatType(), 4)
                                                  .as_pointer(first.type.addrspace)), align=16)
            return context.make_tuple(builder, quad, [
                builder.extract_element(vector, ir.Constant(ir.IntType(32), e))
                for e in range(4)])

        return quad(words, i), codegen

    @device_function
    def bits_to_float(bits):
        return libdevice.int_as_float(int32(bits))

    @device_function
    def float_to_bits(x):
        return int64(libdevice.float_as_int(x)) & 0xFFFFFFFF


@device_function
def bf16_to_float(bits):
    """A bfloat16 bit pattern (int16 or uint16) as float32: the pattern is the top half."""
    return bits_to_float((int64(bits) & 0xFFFF) << 16)


@device_function
def float_to_bf16(x):
    """float32 -> bfloat16 bits, round to nearest even, NaN kept NaN (as the hardware does)."""
    u = float_to_bits(x)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet_nan = (u >> 16) | 0x40
    # A select, not a branch: a branch in the output loop stops the compiler from unrolling
    # it, and the accumulators it indexes then move from registers to local memory.
    return int16_bits(quiet_nan if x != x else rounded)


@device_function
def int16_bits(u):
    """The low 16 bits of u as an int16 value with the same bit pattern."""
    u = u & 0xFFFF
    return int32(u - 0x10000 if u >= 0x8000 else u)


@device_function
def f16_to_float(x):
    return float32(x)


@device_function
def f32_to_float(x):
    return float32(x)


@device_function
def float_to_f32(x):
    return float32(x)


# dtype name -> (load as float32, store from float32, dtype of the array the kernel sees)
CONVERTERS = {
    "float32": (f32_to_float, float_to_f32, "float32"),
    "float16": (f16_to_float, float_to_f32, "float16"),  # the store rounds (cvt.rn)
    "bfloat16": (bf16_to_float, float_to_bf16, "int16"),
}
