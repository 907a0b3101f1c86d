"""The working tree's kernel against an older flash_fwd.py, side by side on the same inputs.

    git show REV:numba_kernels/flash_fwd.py > numba_kernels/_ab_old_flash_fwd.py
    python scripts/ab_kernel.py

Medians of CUDA events (attention_speed.time_ms), alternating old and new three times.
"""
import dataclasses
import os
import sys

import torch
from numba import cuda

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.attention_speed import DTYPES, time_ms  # noqa: E402
from numba_kernels import _ab_old_flash_fwd as old  # noqa: E402
from numba_kernels import api, choose_spec, flash_attention  # noqa: E402
from numba_kernels.flash_fwd import FASTMATH  # noqa: E402
from numba_kernels.specs import build_kernel  # noqa: E402

SHAPES = [(2, 16, 4096, 128, "float32", False), (4, 16, 4096, 64, "float16", False),
          (2, 16, 4096, 128, "float16", False), (2, 16, 4096, 128, "bfloat16", False),
          (2, 16, 4096, 128, "float32", "bottom_right"), (2, 16, 8192, 128, "float32", False)]
# Fields of the old KernelSpec that the new one lacks, per (width, dtype, has_mask): what the
# old specs.py chose for them (v11: load_batch, 16 for float16 at width 128, else 8).
OLD_FIELDS = {(128, "float16", False): {"load_batch": 16}}


def old_spec(spec):
    """The old module's KernelSpec for the variant `spec` selects: the fields both have are
    copied; one only the old has takes OLD_FIELDS's value, else its default."""
    names = {f.name for f in dataclasses.fields(old.KernelSpec)}
    fields = {n: getattr(spec, n) for n in names if hasattr(spec, n)}
    fields.update((n, x) for n, x in OLD_FIELDS.get((spec.d, spec.dtype, spec.has_mask), {})
                  .items() if n in names and not hasattr(spec, n))
    return old.KernelSpec(**fields)


print(f"{'shape':44s} {'old ms':>8s} {'new ms':>8s} {'new/old':>7s}")
for B, H, N, D, dtype, causal in SHAPES:
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=DTYPES[dtype]) for _ in range(3))
    spec = choose_spec(D, D, dtype, False)
    old_kernel = cuda.jit(fastmath=FASTMATH)(old.kernel_source(old_spec(spec)))
    times = {"old": [], "new": []}
    for _ in range(3):
        for name in ("old", "new"):
            api.build_kernel = (lambda s: old_kernel) if name == "old" else build_kernel
            times[name].append(time_ms(lambda: flash_attention(q, k, v, causal=causal))[0])
    o, n = min(times["old"]), min(times["new"])
    print(f"{str((B, H, N, D, dtype, causal)):44s} {o:8.3f} {n:8.3f} {n / o:7.3f}", flush=True)
