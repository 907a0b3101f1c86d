"""Compiled kernels kept on disk between processes, and compiled ahead of a run on every core.

A kernel variant takes seconds to compile (NVVM), at its first launch in each process: most of
a first `pytest conformance` on a GPU machine. So every kernel is made by `jit(fn, key)`,
which gives it Numba's disk cache: a later process loads the compiled code (a cubin for the
GPU's compute capability) instead of compiling it again.

What keeps the cache sound is where each variant lives and what it is filed under:
- each variant has a folder of its own: FLASH_KERNEL_CACHE (default
  ~/.cache/flash-conformance/kernels) / a digest of SOURCES and the numba and numba-cuda
  versions / a digest of the variant's key (its KernelSpec, or what names a plain kernel).
  A change to any file the kernels are made from is a new folder, never a stale entry;
- in its folder Numba files one entry per argument types and compute capability
  (numba_internals.cache_on_disk says why Numba's own key cannot serve);
- processes that compile the same variant at once (pytest -n, warm()) take turns on a lock
  file in its folder: Numba's index of a folder is not safe against concurrent writers.
FLASH_KERNEL_CACHE=off turns the cache off. The simulator compiles nothing and caches nothing.

warm.py compiles variants into it before a run needs them, on every core.
"""
import hashlib
import os
import sys
import weakref
from contextlib import contextmanager
from functools import lru_cache

from numba import cuda

from . import numba_internals
from .convert import SIMULATOR

# Every file a compiled kernel is made from (what specs.py and the kernels import). A module
# that a kernel comes to import must be added here (tests/test_compile_cache.py checks).
SOURCES = ("numba_kernels/flash_fwd.py", "numba_kernels/flash_bwd.py",
           "numba_kernels/plain_fwd.py", "numba_kernels/plain_bwd.py", "numba_kernels/convert.py",
           "numba_kernels/specs.py", "numba_kernels/split_kv.py", "numba_kernels/flash_mma.py",
           "numba_kernels/flash_mma_bwd.py", "numba_kernels/halves.py", "numba_kernels/warp.py",
           "numba_kernels/flash_wgmma.py", "numba_kernels/flash_wgmma_bwd.py",
           "numba_kernels/warpgroup.py",
           "numba_kernels/numba_internals.py", "numba_kernels/common.py",
           "numba_kernels/schedule.py", "numba_kernels/mma_parts.py",
           "numba_kernels/block_sparse.py", "numba_kernels/compile_cache.py",
           "reference/bands.py", "reference/blocks.py", "reference/dtypes.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FOLDERS = weakref.WeakKeyDictionary()  # kernel -> its cache folder


def cache_root():
    """The cache's root folder, or None when FLASH_KERNEL_CACHE is "off"."""
    root = os.environ.get("FLASH_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "flash-conformance", "kernels")
    return None if root == "off" else root


@lru_cache(maxsize=None)
def sources_digest():
    """sha256 of SOURCES, their names, and the numba and numba-cuda versions."""
    import numba

    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(ROOT, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    h.update(f"numba {numba.__version__} numba-cuda "
             f"{numba_internals.numba_cuda_version()}".encode())
    return h.hexdigest()


def variant_folder(key):
    """The cache folder of the kernel variant named by `key` (a KernelSpec, or a tuple of
    plain values), or None when the cache is off."""
    root = cache_root()
    if root is None:
        return None
    variant = hashlib.sha256(repr(key).encode()).hexdigest()[:24]
    return os.path.join(root, sources_digest()[:24], variant)


def jit(fn, key, fastmath, launch_bounds=None):
    """cuda.jit(fn), kept in the disk cache under `key` (what names the variant fn is);
    launch_bounds: (threads a block, blocks an SM) for ptxas, or None."""
    if SIMULATOR:  # the simulator takes no fastmath
        return cuda.jit(fn)
    kernel = cuda.jit(fastmath=fastmath, launch_bounds=launch_bounds)(fn)
    folder = variant_folder(key)
    if folder and numba_internals.cache_on_disk(kernel, folder, key):
        _FOLDERS[kernel] = folder
    return kernel


def folder_of(kernel):
    """The cache folder `kernel` (made by jit) is kept in, or None where it is not kept."""
    return _FOLDERS.get(kernel)


@contextmanager
def compiling(kernel):
    """Around a call that may compile `kernel`: the only process doing so for its variant."""
    folder = _FOLDERS.get(kernel)
    if folder is None or sys.platform == "win32":
        yield
        return
    import fcntl

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
        yield
