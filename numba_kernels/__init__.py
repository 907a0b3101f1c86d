"""FlashAttention-2 kernels written in Python with Numba CUDA: the forward, and the backward.

    from numba_kernels import flash_attention, flash_attention_backward

Runs on NVIDIA GPUs and, unchanged, in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1).
Read plain_fwd.py (one thread per query row, the textbook kernel) beside reference/tiled.py,
then flash_fwd.py (the same algorithm, tuned), then flash_mma.py (tensor cores through
warp.py's mma.sync: what flash_attention runs by default for float16 and bfloat16 where it
applies, and for float32 at precision="high" as float16 halves; kernel_plan says which
kernel a call gets, and at which precision). The backward: plain_bwd.py beside
reference/tiled_backward.py, then flash_bwd.py (tuned), then flash_mma_bwd.py (tensor cores:
what flash_attention_backward and the autograd of flash_attention run for float16 and
bfloat16 inputs where it applies; flash_bwd.py elsewhere; kernel= takes one by name).
"""
from .api import (PRECISIONS, flash_attention, halves_range_why_not, kernel_plan,
                  mma_attention, plain_attention)
from .backward import flash_attention_backward
from .launch import compile_times
from .specs import MAX_HEAD_DIM, choose_spec, shipped_specs

__all__ = ["flash_attention", "kernel_plan", "mma_attention", "plain_attention",
           "flash_attention_backward", "choose_spec", "compile_times", "shipped_specs",
           "MAX_HEAD_DIM", "PRECISIONS", "halves_range_why_not"]
