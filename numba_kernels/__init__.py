"""FlashAttention-2 kernels written in Python with Numba CUDA: the forward, and the backward.

    from numba_kernels import flash_attention, flash_attention_backward

Runs on NVIDIA GPUs and, unchanged, in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1).

The package in layers, each importing only the ones above it in this list:

    convert, numba_internals, compile_cache, torch_precision,     shared parts
      common, schedule, warp, block_sparse
    plain_fwd, flash_fwd, plain_bwd, flash_bwd, split_kv,               the kernels
      mma_parts, halves, flash_mma, flash_mma_bwd
    specs, warm                                          the registry of compiled variants
    plan                                     which kernel a call runs, and why
    replay, launch, arrays, prepass, forward, backward   a call's arrays and launches
    autograd                                 the PyTorch operator
    api                                      flash_attention

(ptx_report, the PTX gate's tool, stands beside them, over specs.)

Read plain_fwd.py (one thread per query row, the textbook kernel) beside reference/tiled.py,
then flash_fwd.py (the same algorithm, tuned), then flash_mma.py (tensor cores through
warp.py's mma.sync: what flash_attention runs by default for float16 and bfloat16 where it
applies, and for float32 at precision="high" as float16 halves; kernel_plan says which
kernel a call gets, and at which precision). The backward: plain_bwd.py beside
reference/tiled_backward.py, then flash_bwd.py (tuned), then flash_mma_bwd.py (tensor cores:
what flash_attention_backward and the autograd of flash_attention run for float16 and
bfloat16 inputs where it applies; flash_bwd.py elsewhere; kernel= takes one by name).
"""
from .api import flash_attention
from .backward import flash_attention_backward
from .convert import SIMULATOR
from .forward import mma_attention, plain_attention
from .launch import compile_times
from .mma_parts import MMA_DTYPES, MMA_WIDTHS
from .plan import PRECISIONS, Plan, halves_range_why_not, kernel_plan
from .specs import MAX_HEAD_DIM, choose_spec, shipped_specs
from .warm import warm_variants

__all__ = ["flash_attention", "kernel_plan", "mma_attention", "plain_attention",
           "flash_attention_backward", "choose_spec", "compile_times", "shipped_specs",
           "warm_variants", "MAX_HEAD_DIM", "MMA_DTYPES", "MMA_WIDTHS", "PRECISIONS", "Plan",
           "SIMULATOR", "halves_range_why_not"]
