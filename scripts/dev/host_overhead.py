"""Where the time of one flash_attention call goes at small N, on a GPU with torch tensors.

    python scripts/dev/host_overhead.py [--out DIR] [--dtype float16] [--n 1024,4096] [--d 64]

For each shape, three figures in milliseconds:
- call: CUDA events around one flash_attention call after a synchronize, median (what
  benchmarks/attention_speed.py reports: the host work before the launch is inside it, since
  the GPU waits for it);
- kernel: the call's main kernel launched ten times back to back with the arguments of one
  call, events around the ten, divided by ten (the GPU's time, when launches queue faster
  than the kernel runs; a split-KV merge and the tensor-core kernel's careful variant are
  not in it);
- launch: host milliseconds of that launch alone (the api's `launch` function).
Then a cProfile of 50 calls of the first shape (the functions with the most own time), written
to DIR/host_profile_new.txt (and _old.txt) with its first lines printed. --dtype (default
float32) picks the inputs' dtype, and with it the kernel (float16 and bfloat16: the
tensor-core one); --n replaces the shapes by (B, 16, N, N, D), full and causal, D from --d
(default 128) and B = 256 / D (the benchmark's shapes).
When numba_kernels/_ab_old_api.py exists (git show REV:numba_kernels/api.py), its calls are
timed too, alternating with the working tree's.
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.attention_speed import events_ms, time_ms  # noqa: E402
from scripts.dev.call_timeline import host_ms, main_launch  # noqa: E402
from numba_kernels import api  # noqa: E402

try:
    from numba_kernels import _ab_old_api as old_api  # noqa: E402
except ImportError:
    old_api = None

SHAPES = [(2, 16, 1024, 1024, 128, False), (4, 16, 1024, 1024, 64, False),
          (2, 16, 2048, 2048, 128, False), (2, 16, 1024, 1024, 128, "bottom_right"),
          (8, 8, 1, 4096, 128, False)]  # (B, H, Nq, Nk, D, causal)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--n", help="sizes N of (B, 16, N, N, D) shapes, full and causal")
    parser.add_argument("--d", default="128", help="head dims D of those shapes, e.g. 64,128")
    args = parser.parse_args()
    out, dtype = args.out, getattr(torch, args.dtype)
    shapes = SHAPES if not args.n else [(256 // d, 16, n, n, d, c)
                                        for d in map(int, args.d.split(","))
                                        for n in map(int, args.n.split(","))
                                        for c in (False, "top_left")]
    os.makedirs(out, exist_ok=True)
    modules = [("new", api)] + ([("old", old_api)] if old_api else [])
    print(f"{'shape':36s} {'api':4s} {'call':>7s} {'kernel':>7s} {'launch':>7s}")
    for B, H, n_q, n_k, d, causal in shapes:
        q = torch.randn(B, H, n_q, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(B, H, n_k, d, device="cuda", dtype=dtype) for _ in range(2))
        for name, module in modules * 2:
            call = time_ms(partial(module.flash_attention, q, k, v, causal=causal))[0]
            relaunch = main_launch(module, q, k, v, causal)
            kern = events_ms(relaunch, 10, 5)
            host = host_ms(relaunch, 20)
            shape = str((B, H, n_q, n_k, d, causal))
            print(f"{shape:36s} {name:4s} {call:7.3f} {kern:7.3f} {host:7.3f}", flush=True)
    q, k, v = (torch.randn(2, 16, 1024, 128, device="cuda", dtype=dtype) for _ in range(3))
    for name, module in modules:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(50):
            module.flash_attention(q, k, v)
        torch.cuda.synchronize()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        with open(os.path.join(out, f"host_profile_{name}.txt"), "w") as f:
            f.write(text.getvalue())
        lines = [ln for ln in text.getvalue().splitlines() if ln.strip()]
        print(f"--- cProfile, 50 calls of (2, 16, 1024, 128), {name} api")
        print("\n".join(lines[:22]))


if __name__ == "__main__":
    main()
