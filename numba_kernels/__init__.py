"""A FlashAttention-2 forward kernel written in Python with Numba CUDA.

    from numba_kernels import flash_attention

Runs on NVIDIA GPUs and, unchanged, in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1).
Read plain_fwd.py (one thread per query row, the textbook kernel) beside reference/tiled.py,
then flash_fwd.py (the same algorithm, tuned).
"""
from .api import flash_attention, plain_attention
from .launch import compile_times
from .specs import MAX_HEAD_DIM, choose_spec, shipped_specs

__all__ = ["flash_attention", "plain_attention", "choose_spec", "compile_times",
           "shipped_specs", "MAX_HEAD_DIM"]
