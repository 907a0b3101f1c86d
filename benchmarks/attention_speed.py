"""The Numba kernel against PyTorch's attention backends on one GPU, side by side.

    python benchmarks/attention_speed.py [--out DIR] [--n 1024,2048,...] [--dtypes ...]
                                         [--sweep] [--budget-s 600]

On the same inputs, in one run: our kernel (numba: the SIMT kernel; numba-mma: the tensor-core
kernel, float32 as float16 halves at precision "high"; numba-mma-highest: float32 on it at
precision "highest", the default; numba-wgmma: the forward on Hopper's warpgroup tensor cores,
16 bits, asked for by name), torch SDPA forced to each backend (flash, efficient, cudnn,
math), and the fp32 (TF32 off) and bf16 matrix-product ceilings (torch). Shapes
(B, H, N, D) = (4, 16, N, 64) and (2, 16, N, 128), causal and not, per dtype; decoding shapes
(Nq = 1, Nk up to 32768, B * H = 64), with and without split-KV. CUDA events, warm-up,
median of repeats (about 0.3 s of repeats each, at least 3), inputs redrawn per shape: each
call timed alone after a synchronize (ms: the GPU waits for the call's host work), and ten
calls back to back between two events (ms_back_to_back, over ten: a call's host work hides
behind the previous call's kernels where it is shorter, as in a training loop; calls of less
than BACK_TO_BACK_MS only, where a call's fixed host work is a visible part of it).
FLOPs = 4 B H Nq Nk D, halved for causal.
--sweep times the kernel's tile variants on two shapes first.
Writes DIR/attention_speed.json and DIR/attention_speed.png; prints a table.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from numba import config  # noqa: E402

config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
from numba_kernels import flash_attention  # noqa: E402
from numba_kernels.flash_fwd import KernelSpec  # noqa: E402
from reference.dtypes import KERNEL_DTYPES, torch_dtype  # noqa: E402

DTYPES = {name: torch_dtype(name) for name in KERNEL_DTYPES}
BACK_TO_BACK_MS = 20
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def time_ms(fn, target_s=0.3):
    """Median milliseconds of fn() by CUDA events, after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    reps = int(min(50, max(3, target_s / max(once, 1e-6))))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times)), reps


def events_ms(fn, reps, repeats=7, before=None):
    """Median over `repeats` of the ms between CUDA events around `reps` calls of fn after a
    synchronize, divided by reps (reps > 1: back to back). before: called after the
    synchronize, ahead of the first event (work that keeps the GPU busy hides the host's
    time from the events)."""
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        if before is not None:
            before()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return float(np.median(out))


def measure(fn):
    """(ms, repeats, peak extra device memory in bytes) or an error string."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        ms, reps = time_ms(fn)
    except (RuntimeError, ValueError) as e:  # backend refuses the dtype/shape, or OOM
        torch.cuda.empty_cache()
        return None, 0, 0, str(e).splitlines()[0][:80]
    return ms, reps, torch.cuda.max_memory_allocated() - base, ""


def sdpa(backend, q, k, v, causal):
    def call():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def matmul_ceiling(dtype=torch.float32):
    """TFLOP/s of torch's 8192^3 matrix product in dtype (float32 with TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=dtype) for _ in range(2))
    ms, _ = time_ms(lambda: a @ b)
    return 2 * 8192**3 / ms / 1e9


def run_shape(rows, dtype, B, Hq, Hk, Nq, Nk, D, causal, impls, ceiling, spec=None,
              label="numba", num_splits=None):
    t = DTYPES[dtype]
    q = torch.randn(B, Hq, Nq, D, device="cuda", dtype=t)
    k, v = (torch.randn(B, Hk, Nk, D, device="cuda", dtype=t) for _ in range(2))
    flops = 4 * B * Hq * Nq * Nk * D / (2 if causal else 1)
    calls = {}
    if "numba" in impls:
        calls[label] = lambda: flash_attention(q, k, v, causal="top_left" if causal else False,
                                               spec=spec, num_splits=num_splits, kernel="simt")
    mma = spec is None and D % 8 == 0 and D <= 128 and num_splits is None
    if "numba-mma" in impls and mma:
        calls["numba-mma"] = lambda: flash_attention(
            q, k, v, causal="top_left" if causal else False, kernel="mma", precision="high")
    if "numba-wgmma" in impls and mma and dtype != "float32":
        calls["numba-wgmma"] = lambda: flash_attention(
            q, k, v, causal="top_left" if causal else False, kernel="wgmma")
    if "numba-mma-highest" in impls and mma and dtype == "float32":
        calls["numba-mma-highest"] = lambda: flash_attention(
            q, k, v, causal="top_left" if causal else False, kernel="mma",
            precision="highest")
    for name in impls:
        if name in BACKENDS and Hq == Hk:
            calls[name] = sdpa(BACKENDS[name], q, k, v, causal)
    for name, fn in calls.items():
        ms, reps, mem, err = measure(fn)
        tf = flops / ms / 1e9 if ms else None
        back = events_ms(fn, 10, 5) if ms and ms < BACK_TO_BACK_MS else None
        row = dict(impl=name, dtype=dtype, B=B, Hq=Hq, Hk=Hk, Nq=Nq, Nk=Nk, D=D, causal=causal,
                   ms=ms, tflops=tf, frac_fp32_ceiling=tf / ceiling if tf else None,
                   ms_back_to_back=back, extra_mem_bytes=mem, repeats=reps, error=err,
                   spec=repr(spec) if spec else None)
        rows.append(row)
        fig = (f"{ms:9.3f} ms {tf:7.2f} TF/s {mem / 2**20:9.0f} MiB, back to back "
               + (f"{back:.3f} ms" if back else "-") if ms else f"  {err}")
        print(f"{name:10s} {dtype:8s} B={B:2d} H={Hq:2d} Nq={Nq:5d} Nk={Nk:5d} D={D:3d} "
              f"causal={causal!s:5s} {fig}", flush=True)
    del q, k, v
    torch.cuda.empty_cache()


SWEEP = {  # D -> (BLOCK_M, BLOCK_N, THREADS_M, THREADS_N) variants
    64: [(64, 32, 16, 8), (64, 32, 8, 8), (32, 32, 8, 8), (64, 16, 16, 4)],
    128: [(32, 32, 8, 8), (64, 16, 16, 4), (32, 16, 8, 4)],
}


def sweep(rows, ceiling):
    for D, variants in SWEEP.items():
        B = 4 if D == 64 else 2
        for tiles in variants:
            try:
                spec = KernelSpec(D, D, "float32", False, *tiles).check()
            except ValueError as e:
                print("skip", tiles, e)
                continue
            run_shape(rows, "float32", B, 16, 16, 4096, 4096, D, False, ["numba"], ceiling,
                      spec=spec, label="sweep")


def decode(rows, impls, ceiling):
    """Decoding: one query row per (batch, head), B * H = 64; our kernel with one block per
    (batch, head) (num_splits=1) and with split-KV as chosen by default."""
    for dtype in ("float16", "float32"):
        for nk in (4096, 32768):
            if "numba" in impls:
                run_shape(rows, dtype, 8, 8, 8, 1, nk, 128, False, ["numba"], ceiling,
                          label="numba-1split", num_splits=1)
            run_shape(rows, dtype, 8, 8, 8, 1, nk, 128, False, impls, ceiling)


def causal_speedups(rows):
    """Lines of each implementation's causal speed-up (the full shape's time over the causal
    one's), per call and back to back, for every shape measured both ways."""
    times = {(r["impl"], r["dtype"], r["B"], r["Hq"], r["Nq"], r["Nk"], r["D"], r["causal"]):
             (r["ms"], r["ms_back_to_back"]) for r in rows if r["ms"]}
    lines = []
    for key, (full, full_back) in times.items():
        if key[-1] or key[:-1] + (True,) not in times:
            continue
        causal, causal_back = times[key[:-1] + (True,)]
        back = f"{full_back / causal_back:.2f}x" if full_back and causal_back else "-"
        lines.append(f"causal speed-up {key[0]:10s} {key[1]:8s} B={key[2]} H={key[3]} "
                     f"N={key[4]} D={key[6]}: call {full / causal:.2f}x, back to back {back}")
    return lines


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["dtype"], r["D"], r["causal"]) for r in rows
                     if r["Nq"] == r["Nk"] and r["impl"] != "sweep"})
    cols = 4
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(4.5 * cols, 3.4 * (
        -(-len(panels) // cols))), squeeze=False)
    for ax, (dtype, D, causal) in zip(axes.flat, panels):
        sel = [r for r in rows if (r["dtype"], r["D"], r["causal"]) == (dtype, D, causal)
               and r["Nq"] == r["Nk"] and r["tflops"] and r["impl"] != "sweep"]
        for impl in sorted({r["impl"] for r in sel}):
            pts = sorted((r["Nq"], r["tflops"]) for r in sel if r["impl"] == impl)
            ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype} D={D} {'causal' if causal else 'full'}", fontsize=9)
        ax.set_xlabel("N")
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=7)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")  # the last row's unused panels
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--n", default="1024,2048,4096,8192,16384")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--impls",
                    default="numba,numba-mma-highest,numba-mma,flash,efficient,cudnn,math")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--decode-first", action="store_true",
                    help="time the decoding shapes before the others (not after)")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting shapes after")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t_start = time.time()
    ceiling = matmul_ceiling()
    bf16_ceiling = matmul_ceiling(torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}: matmul ceilings: fp32 (TF32 off) {ceiling:.1f} TF/s, "
          f"bf16 {bf16_ceiling:.1f} TF/s")
    rows = []
    if a.sweep:
        sweep(rows, ceiling)
    impls = a.impls.split(",")
    if a.decode_first:
        decode(rows, impls, ceiling)
    for dtype in a.dtypes.split(","):
        for causal in (False, True):
            for B, H, D in ((4, 16, 64), (2, 16, 128)):
                for n in (int(x) for x in a.n.split(",")):
                    if time.time() - t_start > a.budget_s:
                        print("time budget spent: stopping")
                        break
                    run_shape(rows, dtype, B, H, H, n, n, D, causal, impls, ceiling)
    if not a.decode_first and time.time() - t_start < a.budget_s:
        decode(rows, impls, ceiling)
    with open(os.path.join(a.out, "attention_speed.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), fp32_ceiling_tflops=ceiling,
                       bf16_ceiling_tflops=bf16_ceiling, rows=rows), f, indent=1)
    plot(rows, os.path.join(a.out, "attention_speed.png"))
    print("\n".join(causal_speedups(rows)))
    print(f"\nfp32 ceiling {ceiling:.1f} TF/s; {len(rows)} measurements in "
          f"{time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
