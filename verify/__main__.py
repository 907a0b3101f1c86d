"""python -m verify IMPL [--suite auto|quick|standard|full|scale] [--backward] [--dtype ...]
                        [--json PATH] [--quiet]
   python -m verify --replay CERTIFICATE.json [IMPL]

IMPL: a built-in adapter (listed by --help) or MODULE:CALLABLE. Prints the report; writes
the JSON certificate with --json. Progress goes to stderr: a line rewritten in place on a
terminal, a line per case in a log, none with --quiet. --replay re-runs a certificate's
failed cases with their seeds (against IMPL, or the implementation the certificate names).
--backward certifies the gradients dq, dk, dv instead (through autograd or jax.vjp for torch
and JAX implementations).
Exit code 0 only when the implementation passes; 2 for a bad command line.
"""
import argparse
import os
import sys

from .adapters import BUILTIN_NAMES
from .device import use_simulator_if_no_gpu


def main(argv=None):
    ap = _parser()
    a = ap.parse_args(argv)
    if a.world_size is not None:
        from .distributed import layout_named

        try:
            a.shard_layout = layout_named(a.shard_layout)
        except ValueError as e:
            ap.error(f"--shard-layout: {e}")
    if not a.impl and not a.replay:
        ap.error("name an implementation (IMPL), or a certificate with --replay")
    refused = _refusal(a)
    if refused:
        print(f"python -m verify: {refused}", file=sys.stderr)
        return 2
    simulated = use_simulator_if_no_gpu()
    if simulated and (a.impl or "").startswith("numba"):
        print("no GPU found: Numba kernels run in the CUDA simulator (tiny sizes only)",
              file=sys.stderr)
    suite = a.suite if a.suite != "auto" else ("quick" if simulated else "standard")
    from . import compare, replay

    options = dict(array=a.array, device=a.device, layout=a.layout, timeout=a.timeout,
                   progress=not a.quiet)
    try:
        if a.replay:
            report = replay(a.replay, a.impl, **options)
        else:
            report = compare(a.impl, dtypes=a.dtypes, suite=suite, seed=a.seed,
                             backward=a.backward, world_size=a.world_size,
                             shard_layout=a.shard_layout, **options)
    except (ValueError, ImportError, AttributeError, OSError, KeyError) as e:
        print(f"python -m verify: {e}", file=sys.stderr)
        return 2
    print(report)
    if a.json:
        report.save(a.json)
        print(f"certificate written to {a.json}")
    return 0 if report.passed else 1



def _parser():
    """The command line's parser."""
    ap = argparse.ArgumentParser(
        prog="python -m verify", description="Certify an attention implementation against "
        "the float64 reference.", epilog="built-in adapters: " + ", ".join(BUILTIN_NAMES)
        + " (verify/adapters.py says what each is)")
    ap.add_argument("impl", nargs="?", help="built-in adapter name or MODULE:CALLABLE")
    ap.add_argument("--replay", metavar="CERTIFICATE",
                    help="re-run the failed cases of this JSON certificate")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds a call may take before it counts as hung (default 120)")
    ap.add_argument("--suite", default="auto", choices=["auto", "quick", "standard", "full",
                                                        "scale"],
                    help="auto (default): standard on a GPU, quick in the CUDA simulator; "
                         "scale: 32-bit index limits crossed (a GPU's memory, sampled rows)")
    ap.add_argument("--backward", action="store_true",
                    help="certify the gradients dq, dk, dv (the suite's backward battery)")
    ap.add_argument("--dtype", action="append", dest="dtypes",
                    choices=["float32", "float16", "bfloat16"],
                    help="limit to this dtype (repeatable); default: all it claims")
    ap.add_argument("--array", choices=["numpy", "torch", "cupy", "jax"],
                    help="array type a MODULE:CALLABLE takes (default numpy)")
    ap.add_argument("--device", choices=["cpu", "cuda"])
    ap.add_argument("--layout", choices=["bhnd", "bnhd"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the certificate here")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    ap.add_argument("--world-size", type=int, metavar="N",
                    help="run IMPL on N ranks (its per-rank protocol: verify/distributed.py; "
                         "gloo processes on a CPU, one GPU a rank with NCCL), forward or "
                         "with --backward")
    ap.add_argument("--shard-layout", default="contiguous",
                    help="how each case's rows are sharded across the ranks: contiguous, "
                         "zigzag, or MODULE:FUNCTION (function(n, world_size) -> each rank's "
                         "(start, stop) ranges)")
    return ap


def _refusal(a):
    """Why the command line `a` cannot run, found before anything runs, or None: an adapter
    name that is not built in, or --json into a folder that does not exist."""
    if a.impl and ":" not in a.impl and a.impl not in BUILTIN_NAMES:
        return (f"unknown implementation {a.impl!r}: use one of {', '.join(BUILTIN_NAMES)}, "
                f"or MODULE:CALLABLE")
    folder = os.path.dirname(os.path.abspath(a.json)) if a.json else None
    if folder and not os.path.isdir(folder):
        return f"--json {a.json}: the folder {folder} does not exist"
    return None


if __name__ == "__main__":
    sys.exit(main())
