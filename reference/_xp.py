"""Array-module helpers: the reference runs unchanged on NumPy and on CuPy arrays."""
import contextlib

import numpy as np


def array_namespace(*arrays, torch_too=False):
    """CuPy if any argument is a CuPy array, else NumPy; torch_too: torch if any is a torch
    tensor (for the rules written in functions both share, as merge's)."""
    for a in arrays:
        if torch_too and a is not None and type(a).__module__.split(".")[0] == "torch":
            import torch

            return torch
        if a is not None and type(a).__module__.split(".")[0] == "cupy":
            import cupy

            return cupy
    return np


def quiet(xp):
    """Silence 0/0 and log(0) warnings: fully masked rows take those paths on purpose."""
    if xp is np:
        return np.errstate(divide="ignore", invalid="ignore", over="ignore")
    return contextlib.nullcontext()


def to_int_list(a):
    """A small integer array (kv_lengths) as Python ints, from any array type."""
    if hasattr(a, "get"):  # CuPy
        a = a.get()
    if hasattr(a, "cpu"):  # torch
        a = a.cpu().numpy()
    return [int(x) for x in np.asarray(a).reshape(-1)]
