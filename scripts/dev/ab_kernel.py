"""The working tree's kernel against an older flash_fwd.py, side by side on the same inputs.

    git show REV:numba_kernels/flash_fwd.py > numba_kernels/_ab_old_flash_fwd.py
    python scripts/dev/ab_kernel.py

Both kernels are launched directly (Numba's own launch, the same host path for both), with
their own argument lists: the old one (v13) takes the mask's and the bias's steps as eight
integers, the new one by name through flash_fwd.kernel_args (two 4-tuples). Medians of CUDA events over the kernel alone,
alternating old and new three times. Unmasked calls, no split-KV: the variants the
benchmarks time.
"""
import dataclasses
import os
import sys

import numpy as np
import torch
from numba import cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.attention_speed import DTYPES, time_ms  # noqa: E402
from numba_kernels import _ab_old_flash_fwd as old  # noqa: E402
from numba_kernels import choose_spec  # noqa: E402
from numba_kernels.flash_fwd import ARG_NAMES, FASTMATH, LOG2E, kernel_args  # noqa: E402
from numba_kernels.specs import build_kernel, launch_grid  # noqa: E402
from reference.dtypes import transported  # noqa: E402

SHAPES = [(2, 16, 8192, 128, "float32", False), (4, 16, 4096, 64, "float32", False),
          (2, 16, 8192, 128, "float16", False), (4, 16, 4096, 64, "float16", False),
          (2, 16, 4096, 128, "bfloat16", False), (2, 16, 4096, 128, "float32", True)]


def old_spec(spec):
    """The old module's KernelSpec for the variant `spec`: the fields both have."""
    names = {f.name for f in dataclasses.fields(old.KernelSpec)}
    return old.KernelSpec(**{n: getattr(spec, n) for n in names if hasattr(spec, n)})


def launcher(kernel, spec, q, k, v, causal, named):
    """A no-argument function launching `kernel` once on (q, k, v): with its arguments by
    name (named: the working tree's ARGS) or positional (the old kernel's 27 arguments)."""
    B, H, N, D = q.shape
    blocks, threads, n_tiles = launch_grid(N, B, H, spec)
    dev = cuda.as_cuda_array
    out = torch.empty_like(q)
    values = dict(
        q=dev(transported(q)), k=dev(transported(k)), v=dev(transported(v)),
        mask=dev(torch.ones(1, 1, 1, 1, dtype=torch.uint8, device="cuda")),
        bias=dev(torch.zeros(1, 1, 1, 1, device="cuda")),
        kv_lengths=dev(torch.full((B,), N, dtype=torch.int32, device="cuda")),
        out=dev(transported(out)), lse=dev(torch.empty(B, H, N, device="cuda")), n_q=N, d=D,
        dv=D, group=1, heads_q=H, n_tiles=n_tiles, split_len=N,
        qk_scale=np.float32(D ** -0.5 * LOG2E), left=-1, right=0 if causal else -1,
        bottom_right=int(causal), mask_steps=(0, 0, 0, 0), bias_steps=(0, 0, 0, 0))
    if named:
        args = kernel_args(**values)
    else:  # the steps as eight separate integers
        args = [values[n] for n in ARG_NAMES[:-2]] + [0] * 8
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    return lambda: kernel[blocks, threads, stream](*args)


print(f"{'shape':44s} {'old ms':>8s} {'new ms':>8s} {'new/old':>7s}")
for B, H, N, D, dtype, causal in SHAPES:
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=DTYPES[dtype]) for _ in range(3))
    spec = choose_spec(D, D, dtype, False)
    runs = {"old": launcher(cuda.jit(fastmath=FASTMATH)(old.kernel_source(old_spec(spec))),
                            spec, q, k, v, causal, False),
            "new": launcher(build_kernel(spec), spec, q, k, v, causal, True)}
    times = {"old": [], "new": []}
    for _ in range(3):
        for name, run in runs.items():
            times[name].append(time_ms(run)[0])
    o, n = min(times["old"]), min(times["new"])
    print(f"{str((B, H, N, D, dtype, causal)):44s} {o:8.3f} {n:8.3f} {n / o:7.3f}", flush=True)
