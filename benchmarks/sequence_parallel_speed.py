"""Attention split across the GPUs of one host (ring attention, the seed's all-gather scheme):
each world size's time for the whole problem beside our single-GPU call on it, forward and
forward plus backward, in one run.

    python benchmarks/sequence_parallel_speed.py [--shape 1,16,8192,128] [--dtype bfloat16]
        [--causal none,top_left] [--world-sizes 1,2] [--schemes ring,allgather]
        [--layout zigzag] [--out DIR]

The problem (B, H, N, D) is the whole sequence; world size W shards it over W GPUs (one
process a rank, NCCL) by --layout, every rank holding its rows of q, k, v and dout. A rank's
time is CUDA events around its calls after a barrier, a warm-up call, the median of repeats
worth about 0.3 s (attention_speed.time_ms); a world's time is its slowest rank's. W = 1 is
a scheme on one GPU: its price against the single call is its own (float32 parts and their
merges, a zigzag shard's chunks as calls of their own). Scaling: the single call's time
over the world's. Memory: the peak allocated on a GPU during the timed calls (the inputs
included). Writes DIR/sequence_parallel_speed.json.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.attention_speed import time_ms  # noqa: E402
from numba_kernels.autograd import attention  # noqa: E402
from numba_kernels.distributed.allgather import allgather_attention  # noqa: E402
from numba_kernels.distributed.ring import ring_attention  # noqa: E402
from numba_kernels.distributed.sharding import shard_ranges, take  # noqa: E402
from reference.dtypes import torch_dtype  # noqa: E402

SCHEMES = {"ring": ring_attention, "allgather": allgather_attention}


def inputs(shape, dtype, rank=None, world=1, layout="contiguous"):
    """q, k, v, dout of the whole problem (the same draws on every rank), or rank's shards."""
    g = torch.Generator(device="cuda").manual_seed(0)
    whole = [torch.randn(shape, device="cuda", dtype=torch_dtype(dtype), generator=g)
             for _ in range(4)]
    if rank is None:
        return whole
    return [take(x, shard_ranges(shape[2], world, layout)[rank]).contiguous() for x in whole]


def step_ms(call, tensors, causal, backward):
    """Median ms of a call (forward, or forward plus backward through autograd)."""
    q, k, v, dout = tensors
    leaves = [x.detach().requires_grad_(backward) for x in (q, k, v)]

    def step():
        out = call(*leaves, causal=causal)
        if backward:
            torch.autograd.grad(out, leaves, dout)
    with torch.set_grad_enabled(backward):
        return time_ms(step)[0]


def rank_main(rank, world, a, port, results):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    tensors = inputs(a.shape, a.dtype, rank, world, a.layout)
    for scheme, causal, backward in [(s, c, b) for s in a.schemes for c in a.causal
                                     for b in (False, True)]:
        def call(q, k, v, causal):
            return SCHEMES[scheme](q, k, v, layout=a.layout, causal=causal)
        dist.barrier()
        torch.cuda.reset_peak_memory_stats()
        got = torch.tensor([step_ms(call, tensors, causal, backward),
                            torch.cuda.max_memory_allocated() / 2**30], device="cuda")
        dist.all_reduce(got, op=dist.ReduceOp.MAX)  # the world's: its slowest, its fullest
        if rank == 0:
            results.append(dict(world=world, scheme=scheme, causal=causal,
                                backward=backward, ms=float(got[0]),
                                peak_gib=float(got[1])))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,16,8192,128", help="B,H,N,D of the whole problem")
    ap.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--causal", default="none,top_left",
                    help="bands to time, comma separated: none, top_left, bottom_right")
    ap.add_argument("--world-sizes", default=None,
                    help="comma separated (default 1 up to every GPU, doubling)")
    ap.add_argument("--schemes", default="ring,allgather",
                    help=f"comma separated, of {', '.join(SCHEMES)}")
    ap.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag"))
    ap.add_argument("--out", default=".", help="folder for sequence_parallel_speed.json")
    a = ap.parse_args()
    a.shape = tuple(int(x) for x in a.shape.split(","))
    a.causal = [False if c == "none" else c for c in a.causal.split(",")]
    a.schemes = a.schemes.split(",")
    if not set(a.schemes) <= set(SCHEMES):
        ap.error(f"--schemes: each of {', '.join(SCHEMES)}, got {','.join(a.schemes)}")
    gpus = torch.cuda.device_count()
    worlds = ([int(w) for w in a.world_sizes.split(",")] if a.world_sizes else
              [w for w in (1, 2, 4, 8) if w <= gpus])
    if max(worlds) > gpus:
        ap.error(f"--world-sizes asks for {max(worlds)} GPUs; this host has {gpus}")
    rows = []
    tensors = inputs(a.shape, a.dtype)
    for causal in a.causal:
        for backward in (False, True):
            torch.cuda.reset_peak_memory_stats()
            ms = step_ms(attention, tensors, causal, backward)
            rows.append(dict(world=1, scheme="single", causal=causal, backward=backward, ms=ms,
                             peak_gib=torch.cuda.max_memory_allocated() / 2**30))
    del tensors
    torch.cuda.empty_cache()
    for port, world in enumerate(worlds, 29600):
        with mp.Manager() as manager:
            results = manager.list()
            mp.spawn(rank_main, args=(world, a, port, results), nprocs=world)
            rows += list(results)
    single = {(r["causal"], r["backward"]): r["ms"] for r in rows if r["scheme"] == "single"}
    for r in rows:
        r["scaling"] = single[r["causal"], r["backward"]] / r["ms"]
        print(f"{r['scheme']:>9s} x{r['world']} causal={str(r['causal']):8s} "
              f"{'fwd+bwd' if r['backward'] else 'fwd':7s} {r['ms']:9.3f} ms  "
              f"x{r['scaling']:.2f} of one GPU's call, peak {r['peak_gib']:.2f} GiB a GPU",
              flush=True)
    with open(os.path.join(a.out, "sequence_parallel_speed.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), shape=a.shape, dtype=a.dtype,
                       layout=a.layout, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
