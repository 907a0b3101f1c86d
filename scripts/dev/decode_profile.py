"""On a GPU: where a decoding call of the tensor-core kernel spends its time, kernel by kernel.

    python3 scripts/dev/decode_profile.py [Nk] [--once]

Decoding: q (8, 8, 1, 128), k and v (8, 8, Nk, 128), float16 (Nk = 32768 unless given). Prints
each kernel's device time a call (torch.profiler, CUDA activity), the call's host time (Python,
no waiting) and its wall time (waiting for the GPU), beside PyTorch's efficient backend.
--once: two calls and nothing else (for ncu: --launch-skip the first call's launches).
"""
import os
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from numba_kernels import mma_attention  # noqa: E402

CALLS = 20


def kernel_times(fn):
    """{kernel name: device microseconds a call} over CALLS calls."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name[:60]] += event.device_time / CALLS
    return dict(times)


def host_and_wall_us(fn):
    """(Python time a call without waiting, wall time a call waiting for the GPU), in us."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = (time.perf_counter() - t0) / CALLS * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
        torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) / CALLS * 1e6


def main():
    nk = int(next((a for a in sys.argv[1:] if a.isdigit()), 32768))
    q = torch.randn(8, 8, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(8, 8, nk, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    ours = lambda: mma_attention(q, k, v)  # noqa: E731
    if "--once" in sys.argv:
        ours()
        ours()
        torch.cuda.synchronize()
        return

    def efficient():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    gbytes = 2 * k.numel() * k.element_size() / 1e9
    print(f"decoding, Nk = {nk}: K and V are {gbytes:.2f} GB")
    for name, fn in (("mma", ours), ("efficient", efficient)):
        host, wall = host_and_wall_us(fn)
        print(f"{name}: host {host:.0f} us a call, wall {wall:.0f} us a call")
        for kernel, us in sorted(kernel_times(fn).items(), key=lambda x: -x[1]):
            print(f"    {us:9.1f} us  {kernel}")


if __name__ == "__main__":
    main()
