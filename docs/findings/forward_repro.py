"""The smallest reproducers of what verify found in third-party kernels on the GPU, each
printed with what it shows. Needs torch (CUDA) and JAX.

    python docs/findings/forward_repro.py
"""
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
torch.manual_seed(0)
BACKENDS = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def sdpa(backend, q, k, v, **kw):
    with sdpa_kernel(BACKENDS[backend]):
        try:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        except RuntimeError as e:
            return str(e).splitlines()[0]


def lower_right_causal_nq_gt_nk():
    """Nq = 6 > Nk = 3, causal_lower_right: rows 0-2 see no key, row 3 sees key 0, ..."""
    q, k, v = (torch.randn(1, 1, n, 16, device="cuda") for n in (6, 3, 3))
    want = sdpa("math", q.double(), k.double(), v.double(),
                attn_mask=causal_lower_right(6, 3)).float()
    unmasked = sdpa("math", q, k, v)
    for backend, dtype in (("efficient", torch.float32), ("cudnn", torch.float16)):
        got = sdpa(backend, q.to(dtype), k.to(dtype), v.to(dtype),
                   attn_mask=causal_lower_right(6, 3))
        if isinstance(got, str):
            print(f"  {backend}: {got}")
            continue
        got = got.float()
        for i in range(6):
            err = (got[0, 0, i] - want[0, 0, i]).abs().max().item()
            same_unmasked = (got[0, 0, i] - unmasked[0, 0, i]).abs().max().item()
            print(f"  {backend} row {i}: |err| {err:.3g}  |out - unmasked row| "
                  f"{same_unmasked:.3g}  (math: {want[0, 0, i, :3].tolist()})")


def scale_zero_and_negative():
    """scale = 0 must give the mean of the visible values; scale < 0 the softmax of -s."""
    q, k, v = (torch.randn(1, 1, 4, 16, device="cuda", dtype=torch.float16) for _ in range(3))
    for scale in (0.0, -0.25):
        for causal in (False, True):
            want = sdpa("math", q.float(), k.float(), v.float(), scale=scale, is_causal=causal)
            for backend in ("efficient", "flash", "cudnn"):
                got = sdpa(backend, q, k, v, scale=scale, is_causal=causal)
                if isinstance(got, str):
                    print(f"  scale {scale} causal {causal} {backend}: {got}")
                    continue
                nan = torch.isnan(got).sum().item()
                err = (got.float() - want).abs().nan_to_num(float("inf")).max().item()
                print(f"  scale {scale} causal {causal} {backend}: NaN {nan}/{got.numel()}, "
                      f"max |err| {err:.3g}")


def jax_findings():
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 64, 2, 64)).astype(np.float32) for _ in range(3))
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(precision):
            got = np.asarray(jax.nn.dot_product_attention(q, k, v, implementation="xla"))
        with jax.default_matmul_precision("highest"):
            ref = np.asarray(jax.nn.dot_product_attention(q, k, v, implementation="xla"))
        print(f"  jax-xla float32, matmul precision {precision}: max |out - highest| "
              f"{np.abs(got - ref).max():.3g}")
    h = [jnp.asarray(x, dtype=jnp.float16) for x in (q, k, v)]
    for scale in (0.0, -0.25):
        try:
            got = np.asarray(jax.nn.dot_product_attention(*h, scale=scale,
                                                          implementation="cudnn"))
            print(f"  jax-cudnn scale {scale}: NaN {np.isnan(got).sum()}/{got.size}")
        except Exception as e:  # noqa: BLE001 - the finding is what it raises
            print(f"  jax-cudnn scale {scale}: {type(e).__name__}: {str(e)[:120]}")


def efficient_backward_large_scores():
    """One head, 40 query rows, 48 keys, D = 16; q and k times 2^e: the scores reach about
    2^(2e + 2). The largest |dq|, |dv| of the efficient backend and of ours
    (numba_kernels.flash_attention's default) beside the float64 truth's (math)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from numba_kernels import flash_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for e in (4, 8, 12, 16):
            q, k, v, dout = (torch.randn((1, 1, n, 16), device="cuda", generator=g)
                             for n in (40, 48, 48, 40))
            q, k = q * 2.0**e, k * 2.0**e
            leaves = [x.to(dtype).double().requires_grad_(True) for x in (q, k, v)]
            want = torch.autograd.grad(sdpa("math", *leaves), leaves, dout.double())
            line = [f"truth {want[0].abs().max().item():.3g}, {want[2].abs().max().item():.3g}"]
            for name, fn in (("efficient", lambda *t: sdpa("efficient", *t)),
                             ("ours", lambda *t: flash_attention(*t))):
                xs = [x.to(dtype).requires_grad_(True) for x in (q, k, v)]
                got = torch.autograd.grad(fn(*xs), xs, dout.to(dtype))
                line.append(f"{name} {got[0].abs().max().item():.3g}, "
                            f"{got[2].abs().max().item():.3g}")
            print(f"  {str(dtype)[6:]} q, k x 2^{e}: max |dq|, max |dv|: " + "; ".join(line))


for name, fn in (("torch efficient backward, large scores", efficient_backward_large_scores),
                 ("torch lower-right causal, Nq > Nk", lower_right_causal_nq_gt_nk),
                 ("torch scale <= 0", scale_zero_and_negative), ("jax", jax_findings)):
    print(name)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report and go on
        print(f"  {type(e).__name__}: {e}")
