"""Where a whole forward call's time goes beyond its main kernel, on a GPU with torch tensors.

    python scripts/dev/call_timeline.py [--dtype bfloat16] [--n 4096] [--d 64,128]
        [--packages numba_kernels,_ab_mma_old,numba_kernels:nocareful]

For each (B, 16, N, N, D) shape, full and causal, and each package (an older copy of
numba_kernels beside the working tree's, as ab_mma.py takes it; PACKAGE:nocareful: its calls
without the tensor-core forward's careful launch, right only for finite inputs: what that
launch costs at most), in milliseconds (medians):
- call: CUDA events around one call after a synchronize (benchmarks/attention_speed.py's
  figure: the GPU waits for the call's host work);
- calls: ten calls back to back between two events, divided by ten (the host work hides
  behind the GPU's where it is shorter);
- host: host time of one call after a synchronize;
- alone: the main kernel launched ten times back to back, divided by ten; once: one launch
  of it after a synchronize, between events;
- launch: host time of the main kernel's launch (the api's `launch`);
- careful: the tensor-core forward's careful variant launched ten times back to back, divided
  by ten (its blocks all return at once: nothing deferred).
"""
import argparse
import importlib
import os
import sys
import time
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.attention_speed import events_ms, time_ms  # noqa: E402


def main_launches(api, q, k, v, causal):
    """The main kernel's launch of one call (a KernelSpec's or an MmaSpec's), and the careful
    variant's (None without), as functions that repeat them. The call takes the whole path
    (replay.py's records are dropped first)."""
    seen, real = [], api.launch
    if hasattr(api, "replay"):
        api.replay._CALLS.clear()
    api.launch = lambda *args, **kw: seen.append((args, kw)) or real(*args, **kw)
    try:
        api.flash_attention(q, k, v, causal=causal)
    finally:
        api.launch = real
    torch.cuda.synchronize()
    mains = [partial(real, *a, **kw) for a, kw in seen
             if type(a[1]).__name__ in ("KernelSpec", "MmaSpec")]
    return mains[0], (mains[1] if len(mains) > 1 else None)


@contextmanager
def careful_dropped(api, drop):
    """Inside, where `drop`, api's calls make no launch of a careful variant (nor record one
    to replay), for :nocareful."""
    real = api.launch

    def launch(kernel, key, *args, **kw):
        if not getattr(key, "careful", False):
            real(kernel, key, *args, **kw)

    api.launch = launch if drop else real
    api.replay._CALLS.clear()
    try:
        yield
    finally:
        api.launch = real
        api.replay._CALLS.clear()


def host_ms(fn, reps=30):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e3 * float(np.median(times))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--n", default="4096")
    parser.add_argument("--d", default="64,128")
    parser.add_argument("--packages", default="numba_kernels")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    apis = [(name, importlib.import_module(f"{name.split(':')[0]}.api"),
             name.endswith(":nocareful")) for name in args.packages.split(",")]
    print(f"{'shape':30s} {'package':24s} {'call':>6s} {'calls':>6s} {'host':>6s} "
          f"{'alone':>6s} {'once':>6s} {'launch':>6s} {'careful':>7s}")
    for d in map(int, args.d.split(",")):
        for n in map(int, args.n.split(",")):
            q, k, v = (torch.randn(256 // d, 16, n, d, device="cuda", dtype=dtype)
                       for _ in range(3))
            for causal in (False, "top_left"):
                for name, api, drop in apis * 2:
                    with careful_dropped(api, drop):
                        row = timeline(api, q, k, v, causal)
                    shape = str((256 // d, 16, n, d, causal))
                    print(f"{shape:30s} {name:24s} " + " ".join(
                        f"{x:6.3f}" for x in row[:-1]) + f" {row[-1]:7.4f}", flush=True)


def timeline(api, q, k, v, causal):
    """(call, calls, host, alone, once, launch, careful) of one shape (the module's
    docstring)."""
    call = partial(api.flash_attention, q, k, v, causal=causal)
    ms = time_ms(call)[0]
    calls, host = events_ms(call, 10), host_ms(call)
    relaunch, careful = main_launches(api, q, k, v, causal)
    alone, once = events_ms(relaunch, 10), events_ms(relaunch, 1, 21)
    launch = host_ms(relaunch)
    careful_ms = events_ms(careful, 10) if careful else float("nan")
    return ms, calls, host, alone, once, launch, careful_ms


if __name__ == "__main__":
    main()
