"""Speed and memory of the float64 reference (forward and backward) against the plainest
chunked NumPy loop.

    python benchmarks/reference_speed.py [--bh 16] [--n 4096] [--d 128]

Runs both on the same inputs in one process, best of --repeat runs, and reports seconds and
peak extra memory (tracemalloc sees NumPy's allocations). The plain loop is the floor this
reference is held to: scores = q @ k.T, exp, @ v, per head, CHUNK rows at a time.
"""
import argparse
import time
import tracemalloc

import numpy as np

import reference
from reference.naive import CHUNK_ELEMS


def plain_loop(q, k, v):
    """The plainest correct chunked loop: no masks, no max subtraction (inputs are tame)."""
    B, H, N, D = q.shape
    out = np.empty((B, H, N, v.shape[-1]))
    rows = max(1, CHUNK_ELEMS // k.shape[2])
    for b in range(B):
        for h in range(H):
            for r0 in range(0, N, rows):
                s = q[b, h, r0:r0 + rows] @ k[b, h].T / np.sqrt(D)
                p = np.exp(s)
                out[b, h, r0:r0 + rows] = (p @ v[b, h]) / p.sum(axis=1, keepdims=True)
    return out


def measure(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        tracemalloc.start()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return best, peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bh", type=int, default=16, help="batch * heads (B = 1)")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, a.bh, a.n, a.d)) for _ in range(3))
    mask = rng.random((a.n, a.n)) < 0.9
    dout = rng.standard_normal(q.shape)
    runs = [
        ("plain chunked loop", lambda: plain_loop(q, k, v)),
        ("reference.attention", lambda: reference.attention(q, k, v)),
        ("  causal bottom_right", lambda: reference.attention(q, k, v, causal="bottom_right")),
        ("  mask (Nq, Nk)", lambda: reference.attention(q, k, v, mask=mask)),
        ("  window (256, 0)", lambda: reference.attention(q, k, v, window=(256, 0))),
        ("attention_backward", lambda: reference.attention_backward(q, k, v, dout)),
        ("  causal bottom_right", lambda: reference.attention_backward(
            q, k, v, dout, causal="bottom_right")),
    ]
    out_bytes = q.nbytes  # the output, which every variant must allocate
    print(f"B*H={a.bh} N={a.n} D={a.d} float64; extra memory excludes the {out_bytes / 2**20:.0f}"
          f" MiB output")
    print(f"{'variant':24s} {'seconds':>8s} {'vs plain':>8s} {'extra MiB':>10s}")
    base = None
    for name, fn in runs:
        t, peak = measure(fn, a.repeat)
        base = base or t
        print(f"{name:24s} {t:8.2f} {t / base:8.2f} {(peak - out_bytes) / 2**20:10.0f}", flush=True)


if __name__ == "__main__":
    main()
