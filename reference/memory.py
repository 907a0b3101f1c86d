"""Where an array's memory lies: for the checks that two arrays do not overlap (a kernel's
output aliasing an input, a backward given one of its inputs as the forward's output).
NumPy, torch, CuPy and Numba device arrays alike; imports none of them."""


def span(x):
    """(first byte, one past the last byte) of an array's memory, or None if unknown."""
    if hasattr(x, "data_ptr"):  # torch
        ptr, strides, size = x.data_ptr(), x.stride(), x.element_size()
        shape = x.shape
    else:
        face = getattr(x, "__cuda_array_interface__", None) or getattr(
            x, "__array_interface__", None)
        if face is None or not hasattr(x, "strides"):
            return None
        ptr, strides, shape = face["data"][0], x.strides, x.shape
        size = x.dtype.itemsize
        strides = [s // size for s in strides]
    if any(n == 0 for n in shape):
        return None
    lo = ptr + size * sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    hi = ptr + size * (1 + sum((n - 1) * s for n, s in zip(shape, strides) if s > 0))
    return lo, hi


def overlaps(a, b):
    """Whether arrays a and b (NumPy, torch, CuPy or Numba device arrays) share any byte of
    memory in one address space (host or device)."""
    sa, sb = span(a), span(b)
    same_space = on_device(a) == on_device(b)
    return bool(sa and sb and same_space and sa[0] < sb[1] and sb[0] < sa[1])


def on_device(x):
    """Whether array x lies in device memory. A torch tensor is asked is_cuda, never
    __cuda_array_interface__: a CUDA tensor that requires grad raises RuntimeError there,
    which hasattr does not swallow."""
    if hasattr(x, "data_ptr"):  # torch
        return bool(x.is_cuda)
    return hasattr(x, "__cuda_array_interface__")
