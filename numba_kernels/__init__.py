"""A FlashAttention-2 forward kernel written in Python with Numba CUDA.

    from numba_kernels import flash_attention

Runs on NVIDIA GPUs and, unchanged, in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1).
Read flash_fwd.py beside reference/tiled.py.
"""
from .api import flash_attention
from .launch import compile_times
from .specs import MAX_HEAD_DIM, choose_spec, shipped_specs

__all__ = ["flash_attention", "choose_spec", "compile_times", "shipped_specs", "MAX_HEAD_DIM"]
