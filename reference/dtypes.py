"""The one registry of floating-point dtypes: names, resolution, array types, bfloat16 transport.

Every part of the project names dtypes by these strings and takes their facts from here:

    FLOAT_DTYPES    what the reference takes ("float64" included: exact inputs)
    KERNEL_DTYPES   what kernels and the low-precision emulation take
    EPS[name]       machine epsilon (the gap between 1 and the next number)
    numpy_dtype     the NumPy dtype (bfloat16 through ml_dtypes)
    torch_dtype     the torch dtype (torch imported only when asked)
    TRANSPORT       how a dtype travels to a Numba kernel: bfloat16 as its int16 bit pattern
                    (Numba and its simulator have no bfloat16); the others as themselves
"""
import numpy as np

KERNEL_DTYPES = ("float32", "float16", "bfloat16")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
TRANSPORT = {"float32": "float32", "float16": "float16", "bfloat16": "int16",
             "float64": "float64"}


def dtype_name(x):
    """'float16', 'bfloat16', 'float32', ... for NumPy, ml_dtypes, CuPy and torch arrays."""
    return str(x.dtype).replace("torch.", "")


def numpy_dtype(name):
    """The NumPy dtype for a registry name (bfloat16: ml_dtypes.bfloat16)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def torch_dtype(name):
    import torch

    return getattr(torch, name)


def cast(x, name):
    """A NumPy array as dtype `name` (bfloat16 rounded from float32, as hardware does); no
    copy when it already is."""
    if name == "bfloat16":
        x = x.astype(np.float32, copy=False)
    return x.astype(numpy_dtype(name), copy=False)


def transported(x):
    """x as a Numba kernel receives it: bfloat16 (NumPy or torch) viewed as int16."""
    if dtype_name(x) != "bfloat16":
        return x
    if hasattr(x, "view") and type(x).__module__.startswith("torch"):
        import torch

        return x.view(torch.int16)
    return x.view(np.int16)
