"""What the tensor-core forward's careful launch costs the GPU, where nothing is deferred (its
blocks all return): for each package (the working tree, an older copy as ab_mma.py takes it),
the careful variant launched ten times, and whole calls, each behind a busy GPU (matrix
products queued first, so that the host's launch time is hidden), beside calls without the
careful launch. Medians over 7 repeats, ms a launch or call.

    python scripts/dev/careful_cost.py [--packages numba_kernels,_ab_mma_old]
"""
import argparse
import importlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..")]
from benchmarks.attention_speed import events_ms  # noqa: E402
from call_timeline import careful_dropped, main_launches  # noqa: E402

SHAPES = [(4, 16, 4096, 64, "top_left"), (4, 16, 4096, 64, False),
          (2, 16, 4096, 128, "top_left"), (4, 16, 8192, 64, "top_left")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--packages", default="numba_kernels,_ab_mma_old")
    a = ap.parse_args()
    big = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)

    def busy():  # about 1.2 ms of products: ten launches' host time is hidden behind them
        for _ in range(6):
            big @ big

    print(f"{'shape':30s} {'package':16s} {'careful':>8s} {'call':>8s} {'no careful':>10s}")
    for b, h, n, d, causal in SHAPES:
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        for name in a.packages.split(","):
            api = importlib.import_module(f"{name}.api")
            call = lambda: api.flash_attention(q, k, v, causal=causal)  # noqa: E731
            _, careful = main_launches(api, q, k, v, causal)
            row = [events_ms(careful, 10, before=busy), events_ms(call, 1, before=busy)]
            with careful_dropped(api, True):
                row.append(events_ms(call, 1, before=busy))
            print(f"{str((b, h, n, d, causal)):30s} {name:16s} {row[0]:8.4f} {row[1]:8.3f} "
                  f"{row[2]:10.3f}", flush=True)


if __name__ == "__main__":
    main()
