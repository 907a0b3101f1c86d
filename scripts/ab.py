"""Two revisions of the kernels side by side on one GPU: outputs bitwise, and time.

    python scripts/ab.py --old REV [--new REV] [--worktrees DIR] [--rounds 2] [--quick]

Each revision runs in a process of its own, from a git worktree of it outside the package
(DIR/REV, default .ab/REV, made with `git worktree add` unless it is there already; --new
defaults to the working tree as it is; on a machine whose copy of the repository lacks the
history, make the worktrees where it has it and bring the folder along). Both run the same
calls of the public API (flash_attention and flash_attention_backward, by kernel= and
precision=) on the same inputs: the SIMT and tensor-core forwards in every dtype (mma.sync,
and wgmma on a Hopper GPU), float32 on halves, split-KV decoding, the plain, tuned and
tensor-core backwards (wgmma's too), autograd steps (the forward and
torch.autograd.grad of its output, the host's time between launches counted),
block-sparse calls (a table of 128 x 128 blocks, `block_mask=`, 11.8% or all of them kept,
and the boolean mask it stands for). Each call is timed by CUDA events (median of repeats
worth about 0.2 s, after a warm-up call that also compiles), old and new alternating for
--rounds rounds. Prints, per call: whether the outputs are bitwise equal, each revision's
median time and new / old. Exit status 1 where an output differs.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (kernel function, (B, H, Nq, Nk, D), dtype, options); "bwd" calls take the forward
# of the same kernel family first (out, lse), then time the backward alone
CALLS = {
    "simt fp32": ("fwd", (2, 16, 4096, 4096, 128), "float32", dict(kernel="simt")),
    "simt bf16 causal": ("fwd", (2, 16, 4096, 4096, 64), "bfloat16",
                         dict(kernel="simt", causal="bottom_right")),
    "mma bf16": ("fwd", (2, 16, 4096, 4096, 128), "bfloat16", dict(kernel="mma")),
    "mma fp16 causal": ("fwd", (4, 16, 4096, 4096, 64), "float16",
                        dict(kernel="mma", causal="bottom_right")),
    "mma fp32 halves": ("fwd", (2, 16, 4096, 4096, 128), "float32",
                        dict(kernel="mma", precision="high")),
    "wgmma bf16": ("fwd", (2, 16, 8192, 8192, 128), "bfloat16", dict(kernel="wgmma")),
    "wgmma fp16 causal": ("fwd", (2, 16, 8192, 8192, 128), "float16",
                          dict(kernel="wgmma", causal="bottom_right")),
    "wgmma bf16 d64": ("fwd", (4, 16, 4096, 4096, 64), "bfloat16", dict(kernel="wgmma")),
    "mma fp16 decoding": ("fwd", (8, 8, 1, 32768, 128), "float16", dict(kernel="mma")),
    "simt fp32 decoding": ("fwd", (8, 8, 1, 32768, 128), "float32", dict(kernel="simt")),
    "mma fp16 decoding window": ("fwd", (8, 8, 1, 32768, 128), "float16",
                                 dict(kernel="mma", causal="bottom_right", window=(4096, 0))),
    "plain fp32": ("fwd-plain", (1, 4, 512, 512, 64), "float32", {}),
    "tuned bwd fp32": ("bwd", (2, 8, 2048, 2048, 128), "float32", dict(kernel="tuned")),
    "mma bwd bf16": ("bwd", (2, 16, 4096, 4096, 128), "bfloat16", dict(kernel="mma")),
    "mma bwd fp16 causal": ("bwd", (4, 16, 4096, 4096, 64), "float16",
                            dict(kernel="mma", causal="bottom_right")),
    "mma bwd fp32 halves": ("bwd", (2, 8, 2048, 2048, 128), "float32",
                            dict(kernel="mma", precision="high")),
    "plain bwd fp32": ("bwd", (1, 4, 512, 512, 64), "float32", dict(kernel="plain")),
    # blocks: (fraction of 128 x 128 blocks kept, the diagonal always; given as "table"
    # (block_mask=) or as the boolean "mask" it stands for)
    "mma bf16 blocks 12%": ("fwd", (1, 16, 8192, 8192, 128), "bfloat16",
                            dict(kernel="mma", blocks=(0.118, "table"))),
    "mma bf16 blocks all": ("fwd", (1, 16, 8192, 8192, 128), "bfloat16",
                            dict(kernel="mma", blocks=(1.0, "table"))),
    "mma bf16 mask 12%": ("fwd", (1, 16, 8192, 8192, 128), "bfloat16",
                          dict(kernel="mma", blocks=(0.118, "mask"))),
    "wgmma bf16 blocks 12%": ("fwd", (1, 16, 8192, 8192, 128), "bfloat16",
                              dict(kernel="wgmma", blocks=(0.118, "table"))),
    "wgmma fp16 decoding": ("fwd", (8, 8, 1, 32768, 128), "float16", dict(kernel="wgmma")),
    "mma bwd bf16 blocks 12%": ("bwd", (1, 16, 8192, 8192, 128), "bfloat16",
                                dict(kernel="mma", blocks=(0.118, "table"))),
    "mma bwd bf16 blocks all": ("bwd", (1, 16, 8192, 8192, 128), "bfloat16",
                                dict(kernel="mma", blocks=(1.0, "table"))),
    "wgmma bwd bf16": ("bwd", (2, 16, 8192, 8192, 128), "bfloat16", dict(kernel="wgmma")),
    "wgmma bwd bf16 d64": ("bwd", (4, 16, 4096, 4096, 64), "bfloat16", dict(kernel="wgmma")),
    "wgmma bwd bf16 blocks 12%": ("bwd", (1, 16, 8192, 8192, 128), "bfloat16",
                                  dict(kernel="wgmma", blocks=(0.118, "table"))),
    # "step": one autograd step, the forward and torch.autograd.grad of its output
    "wgmma step bf16 blocks 12%": ("step", (1, 16, 8192, 8192, 128), "bfloat16",
                                   dict(kernel="wgmma", blocks=(0.118, "table"))),
    "mma step bf16 blocks 12%": ("step", (1, 16, 8192, 8192, 128), "bfloat16",
                                 dict(kernel="mma", blocks=(0.118, "table"))),
}
BLOCK = 128  # the block-sparse calls' block size
FORWARD_OF = {"tuned": "simt", "plain": "simt", "mma": "mma", "wgmma": "wgmma"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="the older revision (any git revision)")
    parser.add_argument("--new", default=None, help="the newer one (default: the working tree)")
    parser.add_argument("--worktrees", default=os.path.join(ROOT, ".ab"),
                        help="where the revisions' worktrees are made (default .ab, ignored)")
    parser.add_argument("--rounds", type=int, default=2, help="old and new alternating")
    parser.add_argument("--quick", action="store_true", help="shapes a quarter the length")
    parser.add_argument("--only", default=None, help="comma-separated call names to run")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a revision's root: run its calls
    parser.add_argument("--results", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = list(CALLS) if args.only is None else args.only.split(",")
    unknown = sorted(set(names) - set(CALLS))
    if unknown:
        parser.error(f"--only: unknown calls {unknown}; the calls are {sorted(CALLS)}")
    if args.child:
        return run_calls(args.child, args.results, names, args.quick)
    roots = {"old": worktree(args.old, args.worktrees),
             "new": ROOT if args.new is None else worktree(args.new, args.worktrees)}
    times = {"old": [], "new": []}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for which in ("old", "new") if r % 2 == 0 else ("new", "old"):
                results = os.path.join(tmp, f"{which}{r}")
                print(f"round {r + 1}: {which} ({roots[which]})", flush=True)
                cmd = [sys.executable, os.path.abspath(__file__), "--old", args.old,
                       "--child", roots[which], "--results", results,
                       "--only", ",".join(names)] + (["--quick"] if args.quick else [])
                subprocess.run(cmd, check=True)
                with open(results + ".json") as f:
                    times[which].append(json.load(f))
                if r == 0:
                    outputs[which] = results + ".npz"
        return report(names, times, outputs)


def worktree(rev, folder):
    """A worktree of revision rev at folder/rev (made unless there already)."""
    path = os.path.join(folder, rev.replace("/", "_"))
    if not os.path.isdir(path):
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, rev],
                       check=True)
    return path


def report(names, times, outputs):
    import numpy as np

    old, new = np.load(outputs["old"]), np.load(outputs["new"])
    print(f"\n{'call':24} {'outputs':9} {'old ms':>9} {'new ms':>9} {'new / old':>9}")
    differ = 0
    for name in names:
        same = all(np.array_equal(old[key].view(np.uint8), new[key].view(np.uint8))
                   for key in old.files if key.startswith(name + "|"))
        differ += not same
        t_old = float(np.median([t[name] for t in times["old"]]))
        t_new = float(np.median([t[name] for t in times["new"]]))
        print(f"{name:24} {'equal' if same else 'DIFFER':9} {t_old:9.3f} {t_new:9.3f} "
              f"{t_new / t_old:9.3f}")
    return 1 if differ else 0


def run_calls(root, results, names, quick):
    """In a revision's own process: each call, its outputs to results.npz and its median
    milliseconds to results.json."""
    sys.path.insert(0, root)
    import numpy as np
    import torch

    import numba_kernels as nk

    assert os.path.dirname(os.path.abspath(nk.__file__)) == os.path.join(root, "numba_kernels")
    saved, times = {}, {}
    for name in names:
        fn, shape, dtype, options = CALLS[name]
        b, h, n_q, n_k, d = shape
        if quick:
            n_q, n_k = max(1, n_q // 4), n_k // 4
        g = torch.Generator(device="cuda").manual_seed(0)
        dt = getattr(torch, dtype)
        q = torch.randn(b, h, n_q, d, device="cuda", generator=g).to(dt)
        k, v = (torch.randn(b, h, n_k, d, device="cuda", generator=g).to(dt) for _ in "kv")
        if "blocks" in options:
            options = block_options(options, n_q, n_k, g)
        if fn == "fwd":
            call = lambda: nk.flash_attention(q, k, v, return_lse=True, **options)  # noqa: E731
        elif fn == "fwd-plain":
            call = lambda: nk.plain_attention(q, k, v, return_lse=True, **options)  # noqa: E731
        elif fn == "step":
            dout = torch.randn(q.shape[:3] + v.shape[3:], device="cuda", generator=g).to(dt)
            call = lambda: autograd_step(nk, q, k, v, dout, options)  # noqa: E731
        else:
            fwd = dict(options, kernel=FORWARD_OF[options["kernel"]])
            out, lse = nk.flash_attention(q, k, v, return_lse=True, **fwd)
            dout = torch.randn(out.shape, device="cuda", generator=g).to(dt)
            call = lambda: nk.flash_attention_backward(q, k, v, out, lse, dout,  # noqa: E731
                                                       **options)
        with torch.no_grad():
            result = call()
            for i, x in enumerate(result):
                saved[f"{name}|{i}"] = x.contiguous().view(torch.uint8).cpu().numpy()
            times[name] = median_ms(call)
        print(f"  {name}: {times[name]:.3f} ms", flush=True)
    np.savez(results + ".npz", **saved)
    with open(results + ".json", "w") as f:
        json.dump(times, f)
    return 0


def autograd_step(nk, q, k, v, dout, options):
    """out and the gradients of q, k and v for dout, through flash_attention's autograd
    operator (grad mode on whatever the caller's)."""
    import torch

    with torch.enable_grad():
        q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
        out = nk.flash_attention(q, k, v, **options)
        return (out.detach(),) + torch.autograd.grad(out, (q, k, v), dout)


def block_options(options, n_q, n_k, generator):
    """options with its `blocks` (density, form) made into block_mask= and block_size=, or
    mask= (the boolean mask of those blocks), on the GPU."""
    import torch

    density, form = options["blocks"]
    rows, cols = -(-n_q // BLOCK), -(-n_k // BLOCK)
    table = torch.rand(rows, cols, device="cuda", generator=generator) < density
    table[torch.arange(min(rows, cols)), torch.arange(min(rows, cols))] = True
    rest = {k: v for k, v in options.items() if k != "blocks"}
    if form == "table":
        return dict(rest, block_mask=table[None, None], block_size=BLOCK)
    mask = table.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n_q, :n_k]
    return dict(rest, mask=mask[None, None].contiguous())


def median_ms(call, target_s=0.2):
    import torch

    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    reps = int(min(50, max(3, target_s * 1000 / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    sys.exit(main())
