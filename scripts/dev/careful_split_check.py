"""On a GPU: the tensor-core forward's careful variant under split-KV, where the partial
results are merged after it. V holds NaN at keys that some rows see and others do not
(causal from the top left, and a window); each case's output against the float64 reference
(the same places non-finite, the rest within 1e-2), split and not split.

    python scripts/dev/careful_split_check.py      # also under compute-sanitizer
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import reference  # noqa: E402
from numba_kernels import mma_attention  # noqa: E402

CASES = [  # (B, H, Nq, Nk, D, options, NaN keys)
    (2, 4, 3, 4096, 128, dict(causal="top_left"), (1, 2)),
    (2, 4, 5, 4096, 64, dict(causal="bottom_right"), (4093, 4094)),
    (1, 8, 2, 2048, 128, dict(window=(100, 0)), (1900, 1999)),
]


def main():
    rng = np.random.default_rng(0)
    ok = True
    for B, H, nq, nk, d, options, nan_keys in CASES:
        q, k, v = (rng.standard_normal((B, H, n, d)).astype(np.float16)
                   for n in (nq, nk, nk))
        for key in nan_keys:
            v[:, :, key, 3] = np.nan
        want = reference.attention(q, k, v, **options)
        for splits in (None, 1):
            got = mma_attention(*(torch.from_numpy(x).cuda() for x in (q, k, v)),
                                num_splits=splits, **options).float().cpu().numpy()
            same_nan = np.array_equal(np.isnan(got), np.isnan(want))
            finite = np.isfinite(want)
            err = float(np.abs(got[finite] - want[finite]).max())
            good = same_nan and err < 1e-2
            ok &= good
            print(f"{'ok  ' if good else 'FAIL'} {(B, H, nq, nk, d)} {options} splits={splits}: "
                  f"NaN where the truth has them {same_nan}, max error {err:.1e}", flush=True)
    torch.cuda.synchronize()
    print("all ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
