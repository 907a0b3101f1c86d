"""Forward plus backward: the Numba kernels against PyTorch's attention backends, side by side.

    python benchmarks/backward_speed.py [--out DIR] [--n 1024,2048,...] [--dtypes ...]
                                        [--budget-s 480]

On the same inputs, in one run: the Numba forward with each backward kernel (numba-plain,
numba-tuned: flash_attention_backward(kernel=)), and torch SDPA forced to each backend
through autograd. For each, the forward plus backward of loss = sum(out * dout), and the
backward alone (the forward's results kept). Shapes (B, H, N, D) = (4, 16, N, 64) and
(2, 16, N, 128), causal and not.
CUDA events, median of repeats (benchmarks/attention_speed.py's time_ms). FLOPs: the forward
4 B H N^2 D, the backward 2.5 times that, halved for causal. Peak extra memory per call.
Writes DIR/backward_speed.json and DIR/backward_speed.png (forward plus backward, TF/s
against N); prints a table.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from attention_speed import BACKENDS, DTYPES, measure, plot, sdpa  # noqa: E402

from numba_kernels import flash_attention, flash_attention_backward  # noqa: E402

BACKWARD_FLOPS = 2.5  # times the forward's


def calls(name, q, k, v, dout, causal):
    """(forward plus backward, backward alone) of implementation `name`: numba-plain,
    numba-tuned, numba-mma and numba-wgmma call the kernels directly
    (flash_attention_backward's kernel=; float32's forward the SIMT kernel, but the
    tensor-core one for numba-mma, at precision "high", and numba-mma-highest, at
    "highest"; numba-wgmma's the wgmma forward), the
    SDPA backends go through autograd (their backward follows the forward's kernel)."""
    if name.startswith("numba-"):
        kernel, opts = name.split("-")[1], dict(causal="top_left" if causal else False)
        if kernel == "mma":
            opts["precision"] = "highest" if name.endswith("-highest") else "high"
        forward = kernel if kernel in ("mma", "wgmma") else "simt" if q.dtype == torch.float32 \
            else "auto"
        qd, kd, vd = (x.detach() for x in (q, k, v))
        out, lse = flash_attention(qd, kd, vd, return_lse=True, kernel=forward, **opts)

        def both():
            o, s = flash_attention(qd, kd, vd, return_lse=True, kernel=forward, **opts)
            return flash_attention_backward(qd, kd, vd, o, s, dout, kernel=kernel, **opts)

        return both, lambda: flash_attention_backward(qd, kd, vd, out, lse, dout,
                                                      kernel=kernel, **opts)
    forward = sdpa(BACKENDS[name], q, k, v, causal)
    kept = forward()
    return (lambda: torch.autograd.grad(forward(), (q, k, v), dout),
            lambda: torch.autograd.grad(kept, (q, k, v), dout, retain_graph=True))


def run_shape(rows, name, dtype, B, H, N, D, causal):
    t = DTYPES[dtype]
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=t, requires_grad=True)
               for _ in range(3))
    dout = torch.randn(B, H, N, D, device="cuda", dtype=t)
    try:
        both, backward = calls(name, q, k, v, dout, causal)
    except (RuntimeError, ValueError) as e:  # a backend refuses the shape, or memory
        print(f"{name:12s} {dtype:8s} N={N:5d} D={D:3d} causal={causal!s:5s} {e}"[:160])
        return
    flops = 4 * B * H * N * N * D / (2 if causal else 1)
    for what, fn, work in (("fwd+bwd", both, 1 + BACKWARD_FLOPS),
                           ("bwd", backward, BACKWARD_FLOPS)):
        ms, reps, mem, err = measure(fn)
        tf = flops * work / ms / 1e9 if ms else None
        rows.append(dict(impl=name, what=what, dtype=dtype, B=B, H=H, N=N, D=D, causal=causal,
                         ms=ms, tflops=tf, extra_mem_bytes=mem, repeats=reps, error=err))
        fig = f"{ms:9.3f} ms {tf:7.2f} TF/s {mem / 2**20:9.0f} MiB" if ms else f"  {err}"
        print(f"{name:10s} {what:8s} {dtype:8s} B={B} H={H} N={N:5d} D={D:3d} "
              f"causal={causal!s:5s} {fig}", flush=True)


def plot_both(rows, path):
    """The forward-plus-backward rows as attention_speed.plot draws them (a panel per dtype,
    D and causal; TF/s against N, a line per implementation)."""
    plot([dict(r, Nq=r["N"], Nk=r["N"]) for r in rows if r["what"] == "fwd+bwd"], path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--n", default="1024,2048,4096,8192")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--impls", default="numba-plain,numba-tuned,flash,efficient,cudnn,math")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting shapes after")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t_start, rows = time.time(), []
    print(torch.cuda.get_device_name(), flush=True)
    for dtype in a.dtypes.split(","):
        for causal in (False, True):
            for B, H, D in ((4, 16, 64), (2, 16, 128)):
                for n in (int(x) for x in a.n.split(",")):
                    if time.time() - t_start > a.budget_s:
                        print("time budget spent: stopping")
                        break
                    for name in a.impls.split(","):
                        run_shape(rows, name, dtype, B, H, n, D, causal)
                        torch.cuda.empty_cache()  # the shape's tensors are gone now
    with open(os.path.join(a.out, "backward_speed.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    plot_both(rows, os.path.join(a.out, "backward_speed.png"))
    print(f"\n{len(rows)} measurements in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
