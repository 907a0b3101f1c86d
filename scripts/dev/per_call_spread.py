"""Why a forward call timed alone (after a synchronize, benchmarks/attention_speed.py's "call")
takes longer than the same call back to back: per shape, 200 calls each timed by CUDA events
and by the host clock, their percentiles (ms), beside the main kernel's launch alone timed the
same way and PyTorch's flash backend's call.

    python scripts/dev/per_call_spread.py [--dtype float16] [--shapes 4x16x4096x64,2x16x4096x128]

Columns: p10 / p50 / p90 of the event time; p50 of the host time of the call; and the median
of the event time with the GPU kept busy before the call (two 4096^3 float16 matrix products
first, about 0.4 ms), which hides the host's time: what the call costs the GPU itself.
"""
import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.attention_speed import events_ms  # noqa: E402
from numba_kernels import flash_attention  # noqa: E402


def spread(fn, calls=200, busy=None):
    """(event ms p10, p50, p90, host ms p50, event ms p50 behind `busy`)."""
    ev, host = [], []
    for i in range(calls + 10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        t1 = time.perf_counter()
        b.synchronize()
        if i >= 10:
            ev.append(a.elapsed_time(b))
            host.append(1e3 * (t1 - t0))
    p = np.percentile(ev, [10, 50, 90])
    return (*p, float(np.median(host)), events_ms(fn, 1, 50, before=busy))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--shapes", default="4x16x4096x64,2x16x4096x128")
    a = ap.parse_args()
    big = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)

    def busy():  # two 4096^3 products, about 0.4 ms: the GPU is busy when the call comes
        for _ in range(2):
            big @ big

    print(f"{'shape':28s} {'impl':10s} {'p10':>7s} {'p50':>7s} {'p90':>7s} {'host':>7s} "
          f"{'behind':>7s}")
    for shape in a.shapes.split(","):
        b, h, n, d = (int(x) for x in shape.split("x"))
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=getattr(torch, a.dtype))
                   for _ in range(3))
        for causal in (False, True):
            calls = {"numba-mma": lambda: flash_attention(
                         q, k, v, causal="top_left" if causal else False, kernel="mma"),
                     "flash": lambda: sdpa_flash(q, k, v, causal)}
            for name, fn in calls.items():
                fn()
                row = spread(fn, busy=busy)
                print(f"{str((b, h, n, d, causal)):28s} {name:10s} "
                      + " ".join(f"{x:7.3f}" for x in row), flush=True)


def sdpa_flash(q, k, v, causal):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


if __name__ == "__main__":
    main()
