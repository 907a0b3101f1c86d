"""The tuned (SIMT) backward's tile shapes, side by side on one GPU: for each candidate
(BLOCK_M, BLOCK_N, THREADS_M, THREADS_N) of a padded width, the whole backward call's time
and its dK/dV and dQ kernels' (torch.profiler), and the largest difference from the first
candidate's gradients (the same sums in another order: ~1e-6 of the largest gradient).

    python scripts/dev/backward_tiles.py [--tiles "128:16,16,8,8 128:32,32,8,16 256:shipped ..."]
        [--shapes 2x16x8192x128,...] [--dtype float32] [--reps 3]

Candidates run in rounds (each candidate once a round) so that clock drift reaches them
alike; the figure is each one's median. flash_bwd.TILES is read when a call makes its
BwdSpec, so setting it chooses the tiles of the next call: a candidate's for both parts, or
"shipped", flash_bwd.TILES as the module has them (each part its own). Each part's kernel
time is printed, so one run tells each part's best.
"""
import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.getcwd())
from numba_kernels import flash_attention, flash_attention_backward, flash_bwd  # noqa: E402
from numba_kernels.compile_cache import warm  # noqa: E402

DEFAULT_TILES = ("64:32,32,8,8 64:shipped 128:16,16,8,8 128:shipped 256:8,8,8,8 "
                 "256:shipped")  # before and after the dynamic tiles
SHIPPED = {w: tuple(sorted(parts.items())) for w, parts in flash_bwd.TILES.items()}
DEFAULT_SHAPES = "2x16x8192x128,2x16x2048x128,4x16x8192x64,2x16x2048x256"


def parse(args):
    tiles = {}
    for item in args.tiles.split():
        width, t = item.split(":")
        tiles.setdefault(int(width), []).append(
            SHIPPED[int(width)] if t == "shipped" else tuple(int(x) for x in t.split(",")))
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    return tiles, shapes


def part_tiles(t):
    """A candidate as TILES holds it: {part: tiles}."""
    return dict(t) if isinstance(t[0], tuple) else dict(dkdv=t, dq=t)


def kernel_times(call):
    """{'dkdv': ms, 'dq': ms} of one call, from torch.profiler's CUDA kernel records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    times = {"dkdv": 0.0, "dq": 0.0}
    for event in prof.events():
        for part in times:
            if f"{part}_kernel" in event.name and str(event.device_type).endswith("CUDA"):
                times[part] += event.time_range.elapsed_us() / 1e3
    return times


def timed(call, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        call()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", default=DEFAULT_TILES)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tiles, shapes = parse(args)
    specs = [flash_bwd.BwdSpec(part, w, w, args.dtype, False, part_tiles(t)[part]).check()
             for w, ts in tiles.items() for t in ts for part in ("dkdv", "dq")]
    for s in specs:
        print(f"{s.part} {s.d} {s.tiles}: {s.threads} threads, {s.shared_bytes} B shared"
              f"{' (dynamic)' if s.dynamic_shared_bytes else ''}", flush=True)
    warm(specs, say=print)
    dtype = getattr(torch, args.dtype)
    for (b, h, n, d) in shapes:
        w = flash_bwd.bwd_width(d, d)
        if w not in tiles:
            continue
        flops = 4 * b * h * n * n * d * 2.5
        for causal in (False, True):
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=dtype,
                                         generator=gen) for _ in range(4))
            causal = "top_left" if causal else False
            out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
            results, first = {}, None
            for _ in range(args.rounds):
                for t in tiles[w]:
                    flash_bwd.TILES[w] = part_tiles(t)

                    def call():
                        return flash_attention_backward(q, k, v, out, lse, dout, causal=causal,
                                                        kernel="tuned")
                    grads = call()  # compiled (warm) and checked
                    if first is None:
                        first = grads
                    diff = max(float((g - f).abs().max() / f.abs().max())
                               for g, f in zip(grads, first))
                    del grads
                    r = results.setdefault(t, dict(ms=[], diff=diff, parts=None))
                    r["ms"] += timed(call, args.reps)
                    r["diff"] = max(r["diff"], diff)
                    if r["parts"] is None:
                        r["parts"] = kernel_times(call)
            print(f"\n({b},{h},{n},{d}) {args.dtype}{' causal' if causal else ''}:", flush=True)
            base = None
            for t, r in results.items():
                ms = statistics.median(r["ms"])
                base = base or ms
                tf = flops / (2 if causal else 1) / ms / 1e9
                print(f"  tiles {t}: {ms:8.2f} ms ({min(r['ms']):.2f}-{max(r['ms']):.2f}), "
                      f"{tf:5.1f} TF/s, {ms / base:.3f} of the first; dkdv "
                      f"{r['parts']['dkdv']:.2f} ms, dq {r['parts']['dq']:.2f} ms; "
                      f"largest difference {r['diff']:.1e}", flush=True)
            del q, k, v, dout, out, lse, first
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
