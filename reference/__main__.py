"""python -m reference [--help]: check the reference against itself on awkward shapes.

Compares the tiled FlashAttention-2 algorithm and the split-and-merge rule with the direct
float64 computation, and reports the low-precision emulation's error per dtype. Exit code 0
when every check holds.
"""
import argparse
import sys

import numpy as np

from . import attention, attention_lowp, attention_tiled, merge

CASES = [  # (B, Hq, Hk, Nq, Nk, D, Dv, options)
    (1, 1, 1, 1, 1, 1, 1, {}),
    (2, 4, 2, 15, 17, 8, 8, dict(causal="top_left")),
    (2, 4, 1, 17, 13, 8, 5, dict(causal="bottom_right")),
    (1, 2, 2, 33, 31, 16, 16, dict(window=(4, 2))),
    (3, 2, 2, 16, 40, 4, 4, dict(kv_lengths=np.array([0, 7, 40]), causal="bottom_right")),
    (2, 2, 1, 29, 23, 6, 6, dict(mask="random")),
]


def main(argv=None):
    argparse.ArgumentParser(prog="python -m reference", description=__doc__.split("\n\n", 1)[1]
                            ).parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"{'case':52s} {'tiled vs naive':>15s} {'merge vs whole':>15s} {'fp16 emul.':>11s}")
    ok = True
    for B, Hq, Hk, Nq, Nk, D, Dv, opts in CASES:
        q, k, v = (rng.standard_normal(s) for s in
                   ((B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, Dv)))
        if opts.get("mask") == "random":
            opts = dict(opts, mask=rng.random((B, 1, Nq, Nk)) < 0.7)
        out, lse = attention(q, k, v, return_lse=True, **opts)
        tiled = attention_tiled(q, k, v, **opts)
        half = np.zeros((Nq, Nk), bool)
        half[:, : Nk // 2] = True
        base = opts.get("mask", True)
        parts = [attention(q, k, v, return_lse=True, **dict(opts, mask=base & m))
                 for m in (half, ~half)]
        merged, _ = merge(*parts)
        low = attention_lowp(*(x.astype(np.float16) for x in (q, k, v)), **opts)
        exact16 = attention(*(x.astype(np.float16) for x in (q, k, v)), **opts)
        e_tiled = np.abs(tiled - out).max(initial=0)
        e_merge = np.abs(merged - out).max(initial=0)
        e_low = np.abs(low - exact16).max(initial=0)
        good = e_tiled < 1e-12 and e_merge < 1e-12 and np.isfinite(out).all()
        ok &= bool(good)
        name = f"B={B} Hq={Hq} Hk={Hk} Nq={Nq} Nk={Nk} D={D} Dv={Dv} " + ",".join(opts)
        print(f"{name:52s} {e_tiled:15.1e} {e_merge:15.1e} {e_low:11.1e} {'ok' if good else 'FAIL'}")
    print("reference self-check:", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
