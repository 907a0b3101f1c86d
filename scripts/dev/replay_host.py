"""Where a replayed forward call's host time goes (replay.py): the call's pieces timed one by
one on the host (medians over many calls, in microseconds), beside the same packed launch
made through ctypes straight into libcuda instead of cuda.bindings.

    python scripts/dev/replay_host.py [--shape 4x16x4096x64] [--dtype bfloat16] [--calls 2000]

The pieces: the whole call; its layout key (api.replay_key) and three of its parts; the
buffers' torch.empty, one torch.empty beside a bare block of the caching allocator; the
autograd check of flash_attention's entry; each recorded launch
(numba_internals.PackedLaunch: its writes and cuLaunchKernel through cuda.bindings); the
launch's driver call alone, through cuda.bindings and through ctypes. Nothing waits for the
GPU between calls except every 100th (so the queue stays short).
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from numba_kernels import autograd, flash_attention, replay  # noqa: E402
from numba_kernels.api import replay_key  # noqa: E402


def median_us(fn, calls):
    times = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
        if i % 100 == 99:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) / 1e3


def raw_alloc_free():
    """A 4 KB block from torch's caching allocator and back, as a bare pointer."""
    ptr = torch.cuda.caching_allocator_alloc(4096)
    torch.cuda.caching_allocator_delete(ptr)


def ctypes_launcher(packed):
    """The packed launch's cuLaunchKernel through ctypes, with its arguments made once."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fn.restype = ctypes.c_int
    handle, *dims, shared, stream, params, _ = packed._args
    args = (int(handle), *dims, shared, int(stream), params, None)
    return lambda: fn(*args)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4x16x4096x64")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    b, h, n, d = (int(x) for x in a.shape.split("x"))
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=getattr(torch, a.dtype))
               for _ in range(3))
    options = dict(causal="top_left")
    flash_attention(q, k, v, **options)  # compiles, records
    rec = replay.find(replay_key(q, k, v, **options))
    assert rec is not None, "the call was not recorded for replay"
    print(f"{a.shape} {a.dtype} causal: {len(rec.launches)} launches, {len(rec.buffers)} "
          f"buffers", flush=True)
    rows = [("whole call", lambda: flash_attention(q, k, v, **options)),
            ("layout key", lambda: replay_key(q, k, v, **options)),
            ("torch.empty of the buffers", lambda: [torch.empty(s, dtype=t, device=dv)
                                                    for s, t, dv in rec.buffers]),
            ("one torch.empty (uint8, 4 KB)", lambda: torch.empty(4096, dtype=torch.uint8,
                                                               device="cuda")),
            ("caching_allocator_alloc + delete (4 KB)", raw_alloc_free),
            ("torch.cuda.current_stream().cuda_stream",
             lambda: torch.cuda.current_stream(q.device).cuda_stream),
            ("3 x (dtype, shape, stride(), device)", lambda: [
                (x.dtype, x.shape, x.stride(), x.device) for x in (q, k, v)]),
            ("flash_attention's autograd check", lambda: autograd.wanted(q, k, v))]
    ptrs = [x.data_ptr() for x in (q, k, v)] + [0] * len(rec.buffers) + rec.kept_ptrs
    new = [torch.empty(s, dtype=t, device=dv) for s, t, dv in rec.buffers]
    ptrs[3:3 + len(new)] = [t.data_ptr() for t in new]
    for i, (plan, sources) in enumerate(rec.launches):
        writes = [(slot, ptrs[j]) for slot, j in sources]
        packed = plan.packed
        rows += [(f"launch {i}: PackedLaunch", lambda p=packed, w=writes: p(w)),
                 (f"launch {i}: cuda.bindings cuLaunchKernel alone",
                  lambda p=packed: p._driver.cuLaunchKernel(*p._args)),
                 (f"launch {i}: ctypes cuLaunchKernel alone", ctypes_launcher(packed))]
    for name, fn in rows:
        fn()
        print(f"  {name:48s} {median_us(fn, a.calls):8.2f} us", flush=True)


if __name__ == "__main__":
    main()
