"""Block-sparse attention on one GPU: our kernels with a boolean mask made of blocks and with
its table of blocks (block_mask=), beside our unmasked call, PyTorch's efficient backend with
the same mask and FlexAttention with the same blocks as a BlockMask (compiled), in one run.

    python benchmarks/block_sparse_speed.py [--shape 1,16,8192,128] [--dtype bfloat16]
                                            [--block 128] [--density 0.1] [--backward]
                                            [--kinds causal,window] [--left 1024]
                                            [--impls ours] [--kernel auto] [--out DIR]

The mask (verify.cases.block_mask, as (1, 1, N, N) booleans): "blocks", blocks of --block x
--block pairs with a fraction --density of them kept at random (the diagonal blocks always);
"blocks-dense", every block (a mask of ones). --kinds causal,window times the bands as the
kernels' own arguments (which skip tiles by the band) beside FlexAttention's block mask of
the same band; their "kept" is the fraction of pairs visible. CUDA events, a warm-up
call, the median of repeats worth about 0.3 s (attention_speed.time_ms). --backward times
forward plus backward through autograd. --kernel: ours as flash_attention(kernel=...) (its
backward follows: plan.BACKWARD_KERNEL). Writes DIR/block_sparse_speed.json.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.attention_speed import time_ms  # noqa: E402
from numba_kernels import flash_attention  # noqa: E402
from reference.dtypes import torch_dtype  # noqa: E402
from verify.cases import block_mask  # noqa: E402


def calls(q, k, v, mask, block, kernel):
    """{name: a call of it} on these inputs (FlexAttention's BlockMask made once, outside),
    ours with kernel=`kernel`."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    keep = mask[0, 0]
    table = mask[:, :, ::block, ::block].contiguous()  # the mask is made of these blocks
    blocks = create_block_mask(lambda b, h, qi, ki: keep[qi, ki], None, None, q.shape[2],
                               k.shape[2], device="cuda", BLOCK_SIZE=block)

    def efficient():
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return {"ours, no mask": lambda: flash_attention(q, k, v, kernel=kernel),
            "ours, mask": lambda: flash_attention(q, k, v, mask=mask, kernel=kernel),
            "ours, block mask": lambda: flash_attention(q, k, v, block_mask=table,
                                                        block_size=block, kernel=kernel),
            "efficient, mask": efficient,
            "flex, no mask": lambda: flex(q, k, v),
            "flex, block mask": lambda: flex(q, k, v, block_mask=blocks)}


def band_calls(q, k, v, kind, left, kernel):
    """{name: a call of it} for a band given as the kernels' own arguments ("causal": top-left
    causal; "window": each row's `left` keys before it and itself), beside FlexAttention with
    the same band as a BlockMask (made once, outside) and our unmasked call (ours with
    kernel=`kernel`)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention)
    if kind == "causal":
        options = dict(causal="top_left", kernel=kernel)

        def visible(b, h, qi, ki):
            return ki <= qi
    else:
        options = dict(window=(left, 0), kernel=kernel)

        def visible(b, h, qi, ki):
            return (ki <= qi) & (qi - ki <= left)
    blocks = create_block_mask(visible, None, None, q.shape[2], k.shape[2], device="cuda")
    return {"ours, no mask": lambda: flash_attention(q, k, v, kernel=kernel),
            f"ours, {kind}": lambda: flash_attention(q, k, v, **options),
            f"flex, {kind} block mask": lambda: flex(q, k, v, block_mask=blocks)}


def timed(call, backward, grad):
    if not backward:
        return time_ms(call)[0]

    def step():
        out = call()
        out.backward(grad)
    return time_ms(step)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1,16,8192,128", help="B,H,N,D (default 1,16,8192,128)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--block", type=int, default=128, help="the mask's block size")
    ap.add_argument("--density", type=float, default=0.1,
                    help="the fraction of blocks drawn at random, the diagonal added (0.1: about "
                         "12%% of the blocks kept in all at N = 8192, blocks of 128)")
    ap.add_argument("--kinds", default="blocks,blocks-dense",
                    help="masks to time (verify.cases.BLOCK_MASKS' names), or the bands "
                         "'causal' and 'window' (the kernels' own arguments)")
    ap.add_argument("--left", type=int, default=1024,
                    help="the window's keys before each row, for --kinds window")
    ap.add_argument("--backward", action="store_true", help="forward plus backward")
    ap.add_argument("--impls", default="",
                    help="time only the calls whose names start with one of these, comma "
                         "separated (ours, efficient, flex; default every one)")
    ap.add_argument("--kernel", default="auto", choices=("auto", "simt", "mma", "wgmma"),
                    help="our calls' kernel= (the backward follows it)")
    ap.add_argument("--out", default=".", help="folder for block_sparse_speed.json")
    a = ap.parse_args()
    b, h, n, d = (int(x) for x in a.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch_dtype(a.dtype), generator=g)
               .requires_grad_(a.backward) for _ in range(3))
    grad = torch.randn_like(q)
    rows = []
    for kind in a.kinds.split(","):
        if kind in ("causal", "window"):
            keep = np.tril(np.ones((n, n), bool)) & (kind == "causal" or np.triu(
                np.ones((n, n), bool), -a.left))
            kept, named = float(keep.mean()), band_calls(q, k, v, kind, a.left, a.kernel)
        else:
            keep = block_mask(kind, np.random.default_rng(0), (1, 1, n, n), a.block, a.density)
            kept = float(keep[..., ::a.block, ::a.block].mean())  # the blocks kept
            named = calls(q, k, v, torch.from_numpy(keep).cuda(), a.block, a.kernel)
        for name, call in named.items():
            if a.impls and not name.startswith(tuple(a.impls.split(","))):
                continue
            try:
                ms = timed(call, a.backward, grad)
            except (RuntimeError, ValueError) as e:  # a backend refuses, or memory runs out
                ms, error = None, str(e).splitlines()[0][:100]
            else:
                error = ""
            rows.append(dict(mask=kind, kept=kept, impl=name, ms=ms, error=error, shape=a.shape,
                             dtype=a.dtype, block=a.block, backward=a.backward,
                             kernel=a.kernel))
            print(f"{kind:7s} kept {kept:6.3f} {name:18s} "
                  + (f"{ms:8.3f} ms" if ms is not None else error), flush=True)
    with open(os.path.join(a.out, "block_sparse_speed.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
