"""One float32 backward through the tensor-core kernels (float16 halves, halves.py), on the
GPU, judged by verify's rule: causal, GQA, a NaN in q (so the nonfinite variants run), for
compute-sanitizer (scripts/dev/gpu_halves_round.sh PART=sanitize).

    python scripts/dev/halves_check.py
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from numba_kernels import flash_attention, flash_attention_backward  # noqa: E402
from verify.criterion import judge_backward  # noqa: E402


def main():
    rng = np.random.default_rng(0)
    shapes = ((2, 4, 200, 72), (2, 2, 232, 72), (2, 2, 232, 72), (2, 4, 200, 72))
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32) for s in shapes)
    q[1, 3, 70, 5] = np.nan  # row 70 of head 3: its gradients, and the keys it sees
    options = dict(causal="bottom_right")
    t = [torch.tensor(x, device="cuda") for x in (q, k, v, dout)]
    out, lse = flash_attention(*t[:3], return_lse=True, **options)
    grads = flash_attention_backward(*t[:3], out, lse, t[3], kernel="mma", **options)
    torch.cuda.synchronize()
    host = [g.cpu().numpy() for g in grads]
    judged = judge_backward(q, k, v, dout, host, dtype="float32", **options)
    for c, g in zip(judged, host):
        print(f"{c.name}: {'pass' if c.passed else 'FAIL'} max error {c.max_abs_error:.3g} "
              f"({c.ratio:.3f} of the bound), non-finite in the wrong place "
              f"{c.nonfinite_mismatch}, nan {int(np.isnan(g).sum())}")


if __name__ == "__main__":
    main()
