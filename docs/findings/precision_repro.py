"""float32 on the GPU at each precision, beside torch's math backend in float32: how far each
head lands from the float64 truth when the heads' magnitudes lie far apart, the normwise error
at a real size, and the speed at (2, 16, 8192, 128). Needs torch with CUDA.

    python docs/findings/precision_repro.py [--part disparity,normwise,speed] [--out DIR]

disparity: four heads, head 0's q times 2^e and k times 2^-e (the scores unchanged), e from 0
to 40; the largest error of each head over that head's largest |truth| (out, and dq, dk, dv
through autograd), the worst head printed. normwise: ||err|| / ||truth|| at
(2, 8 / 2, 1000, 3001, 40), bottom-right causal, forward and gradients. speed: forward and
forward + backward, CUDA events, median of repeats; TFLOP/s with the forward as 4 B H N^2 D
and forward + backward as 3.5 times it (attention_speed.time_ms). Writes
DIR/precision_check.json.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.attention_speed import time_ms  # noqa: E402
from numba_kernels import flash_attention  # noqa: E402

WAYS = {  # name: f(q, k, v, **options) on float32 tensors
    "ours highest": lambda q, k, v, **o: flash_attention(q, k, v, **o),
    "ours high": lambda q, k, v, **o: flash_attention(q, k, v, precision="high", **o),
    "torch math": lambda q, k, v, **o: _sdpa("math", q, k, v, **o),
    "torch efficient": lambda q, k, v, **o: _sdpa("efficient", q, k, v, **o),
}


def _sdpa(backend, q, k, v, causal=False):
    kw = {}
    if causal == "bottom_right":
        kw["attn_mask"] = causal_lower_right(q.shape[2], k.shape[2])
    if q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True
    chosen = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
    with sdpa_kernel(chosen):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def _run(way, q, k, v, dout, **options):
    """out, dq, dk, dv of one way (float32), through autograd."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = WAYS[way](*leaves, **options)
    grads = torch.autograd.grad(out, leaves, dout)
    return [out.detach()] + [g.detach() for g in grads]


def _truth(q, k, v, dout, **options):
    leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    out = _sdpa("math", *leaves, **options)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return [out.detach()] + [g.detach() for g in grads]


def disparity(results):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 4, 1024, 64)
    print("\n== heads 2^e apart (q x 2^e, k x 2^-e in head 0): worst head's error / its "
          "largest |truth|, out / dq / dk / dv")
    print(f"{'e':>3s} " + " ".join(f"{w:>34s}" for w in WAYS))
    for e in (0, 10, 16, 20, 30, 40):
        q, k, v, dout = (torch.randn(shape, device="cuda", generator=g) for _ in range(4))
        q[:, 0] *= 2.0**e
        k[:, 0] *= 2.0**-e
        truth = _truth(q, k, v, dout)
        row = {}
        for way in WAYS:
            try:
                got = _run(way, q, k, v, dout)
            except RuntimeError as err:
                row[way] = str(err).splitlines()[0]
                continue
            row[way] = [max(float((a - t).abs()[0, h].max() / t.abs()[0, h].max())
                            for h in range(shape[1])) for a, t in zip(got, truth)]
        results[f"disparity e={e}"] = row
        print(f"{e:3d} " + " ".join(
            f"{'/'.join(f'{x:.1e}' for x in r):>34s}" if isinstance(r, list) else f"{r[:34]:>34s}"
            for r in row.values()))


def normwise(results):
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn((2, 8, 1000, 40), device="cuda", generator=g)
    k, v = (torch.randn((2, 2, 3001, 40), device="cuda", generator=g) for _ in range(2))
    dout = torch.randn_like(q)
    options = dict(causal="bottom_right")
    truth = _truth(q, k, v, dout, **options)
    print("\n== normwise ||err|| / ||truth|| at (2, 8/2, 1000, 3001, 40) bottom-right causal: "
          "out, dq, dk, dv")
    for way in WAYS:
        try:
            got = _run(way, q, k, v, dout, **options)
        except RuntimeError as err:
            print(f"{way:16s} {str(err).splitlines()[0][:80]}")
            continue
        errs = [float((a.double() - t).norm() / t.norm()) for a, t in zip(got, truth)]
        results[f"normwise {way}"] = errs
        print(f"{way:16s} " + " ".join(f"{x:.2e}" for x in errs))


def speed(results):
    B, H, N, D = 2, 16, 8192, 128
    q, k, v, dout = (torch.randn((B, H, N, D), device="cuda") for _ in range(4))
    flops = 4 * B * H * N * N * D
    print(f"\n== speed at {(B, H, N, D)} float32: ms and TFLOP/s, forward / forward + backward")
    for way in WAYS:
        if way == "torch math":
            continue  # 18 GB of scores
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        fwd = time_ms(lambda: WAYS[way](q, k, v))[0]
        both = time_ms(lambda: torch.autograd.grad(WAYS[way](*leaves), leaves, dout))[0]
        results[f"speed {way}"] = dict(forward_ms=fwd, both_ms=both,
                                       forward_tflops=flops / fwd / 1e9,
                                       both_tflops=3.5 * flops / both / 1e9)
        print(f"{way:16s} {fwd:8.2f} ms {flops / fwd / 1e9:6.1f} TF/s   {both:8.2f} ms "
              f"{3.5 * flops / both / 1e9:6.1f} TF/s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="disparity,normwise,speed")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    results = {}
    for part in a.part.split(","):
        {"disparity": disparity, "normwise": normwise, "speed": speed}[part](results)
    with open(os.path.join(a.out, "precision_check.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
