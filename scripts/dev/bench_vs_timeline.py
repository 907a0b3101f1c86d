"""Why a call timed by benchmarks/attention_speed.py can take longer than the same call timed
by call_timeline.py: the same (4, 16, 4096, 64) bfloat16 calls, full and causal, timed by
time_ms in each script's setting, alternating, on one GPU.

    python scripts/dev/bench_vs_timeline.py

Settings: "bench" is run_shape as the benchmark runs it (fresh inputs, kernel="mma", the
cache emptied after); "timeline" is time_ms on inputs timed before (call_timeline's); "empty"
is time_ms right after torch.cuda.empty_cache(); "kernel" passes kernel="mma" on inputs timed
before. Prints each setting's median ms and the calls replay.py replayed.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.attention_speed import run_shape, time_ms  # noqa: E402
from numba_kernels import flash_attention, replay  # noqa: E402


def main():
    q, k, v = (torch.randn(4, 16, 4096, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    for trial in range(3):
        for causal in (False, "top_left"):
            before = replay.REPLAYED[0]
            rows = []
            run_shape(rows, "bfloat16", 4, 16, 16, 4096, 4096, 64, bool(causal), ["numba-mma"],
                      50.0)
            figures = {"bench": rows[-1]["ms"]}
            auto = lambda: flash_attention(q, k, v, causal=causal)  # noqa: E731
            mma = lambda: flash_attention(q, k, v, causal=causal, kernel="mma")  # noqa: E731
            figures["timeline"] = time_ms(auto)[0]
            torch.cuda.empty_cache()
            figures["empty"] = time_ms(auto)[0]
            figures["kernel"] = time_ms(mma)[0]
            print(f"trial {trial} causal={causal!s:8s} "
                  + " ".join(f"{name} {ms:.3f}" for name, ms in figures.items())
                  + f"  replayed {replay.REPLAYED[0] - before}", flush=True)


if __name__ == "__main__":
    main()
