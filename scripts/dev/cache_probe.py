"""Where a process's first launch of a cached kernel variant spends its time.

    FLASH_KERNEL_CACHE=DIR python scripts/dev/cache_probe.py [--profile]

Calls flash_attention once for three variants and prints, per variant, the seconds of the
first call and Numba's cache hits and misses (run it twice on one DIR: the second process
should only load). --profile: the top of cProfile's cumulative listing.
"""
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from numba_kernels import flash_attention  # noqa: E402
from numba_kernels.specs import build_kernel, choose_spec  # noqa: E402


def first_call(d, dtype, mask):
    t = getattr(torch, dtype)
    q, k, v = (torch.randn(2, 4, 300, d, device="cuda").to(t) for _ in range(3))
    m = torch.rand(2, 1, 300, 300, device="cuda") < 0.5 if mask else None
    t0 = time.perf_counter()
    flash_attention(q, k, v, mask=m)
    torch.cuda.synchronize()
    kernel = build_kernel(choose_spec(d, d, dtype, mask))
    return time.perf_counter() - t0, dict(kernel._cache_hits), dict(kernel._cache_misses)


def main():
    profile = cProfile.Profile() if "--profile" in sys.argv else None
    if profile:
        profile.enable()
    for case in ((64, "float16", False), (128, "float32", True), (96, "bfloat16", False)):
        seconds, hits, misses = first_call(*case)
        print(f"{case}: first call {seconds:.2f} s, cache hits {sum(hits.values())}, "
              f"misses {sum(misses.values())}", flush=True)
    if profile:
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
