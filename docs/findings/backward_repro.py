"""On a GPU: the smallest inputs on which the backward failures of verify's suite reproduce,
each against float64 truth (torch's math backend on the CPU), with nothing of this project.

    python3 docs/findings/backward_repro.py

Each suspect is tried on growing shapes (smallest first); a line per shape gives the largest
gradient error (or which gradients are not finite). docs/findings.md keeps the verdicts.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def grads(backend, q, k, v, dout, **kw):
    """(dq, dk, dv) of sum(sdpa(q, k, v) * dout) by backend, as float64 on the CPU."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(BACKENDS[backend]):
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    out.backward(dout)
    return tuple(x.grad.double().cpu() for x in (q, k, v))


def truth(q, k, v, dout, **kw):
    cpu = [x.detach().double().cpu() for x in (q, k, v, dout)]
    return grads("math", *cpu[:3], cpu[3], **kw)


def report(what, got, want):
    bad = [n for n, g in zip("qkv", got) if not torch.isfinite(g).all()]
    err = max(float((g - w).abs().max()) for g, w in zip(got, want))
    return f"{what}: " + (f"d{', d'.join(bad)} not finite" if bad else f"max |error| {err:.3g}")


def inputs(B, H, nq, nk, D, dtype=torch.float16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, n, D, device="cuda", dtype=dtype, generator=g)
            for n in (nq, nk, nk, nq)]


def strided_dout(backend):
    """dout a non-contiguous view (the same values) against dout contiguous."""
    for B, H, N, D in ((1, 1, 1, 16), (1, 1, 8, 16), (1, 1, 33, 16), (1, 1, 64, 64)):
        q, k, v, dout = inputs(B, H, N, N, D)
        view = dout.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, strided
        want = truth(q, k, v, dout)
        print(report(f"{backend} dout strided {(B, H, N, D)}", grads(backend, q, k, v, view),
                     want) + "; " + report("contiguous", grads(backend, q, k, v, dout), want),
              flush=True)


def layout_after_layout(backend):
    """The same shapes twice, dout contiguous then a (B, N, H, D) view of the same values (the
    layout of a transposed output), each against the truth."""
    q, k, v, dout = inputs(1, 2, 2, 2, 16)
    view = dout.transpose(1, 2).contiguous().transpose(1, 2)
    want = truth(q, k, v, dout)
    for name, x in (("contiguous", dout), ("a strided view", view), ("contiguous", dout)):
        print(report(f"{backend} (1, 2, 2, 2, 16) dout {name}", grads(backend, q, k, v, x),
                     want), flush=True)


def bottom_right(backend):
    """Causal aligned to the last key with Nq > Nk: rows i >= Nq - Nk see keys j <= i - (Nq -
    Nk), the same as the top-left causal Nk x Nk problem of those rows; the others see none
    (their dq is 0 and they add nothing to dk, dv)."""
    from torch.nn.attention.bias import causal_lower_right

    for B, H, nq, nk, D in ((1, 1, 2, 1, 16), (1, 1, 3, 2, 16), (1, 1, 9, 4, 16),
                            (1, 1, 61, 37, 16)):
        q, k, v, dout = inputs(B, H, nq, nk, D)
        got = grads(backend, q, k, v, dout, attn_mask=causal_lower_right(nq, nk))
        cut = nq - nk
        dq, dk, dv = truth(q[:, :, cut:], k, v, dout[:, :, cut:], is_causal=True)
        dq = torch.cat([torch.zeros(B, H, cut, D, dtype=dq.dtype), dq], dim=2)
        rows = (got[0] - dq).abs().amax(dim=(0, 1, 3))  # dq's error by query row
        print(report(f"{backend} bottom-right causal {(B, H, nq, nk, D)}", got, (dq, dk, dv))
              + f"; dq error by row {[round(float(x), 3) for x in rows[:8]]}", flush=True)


def scale(backend, value):
    for B, H, N, D in ((1, 1, 1, 16), (1, 1, 4, 16), (1, 1, 40, 64)):
        q, k, v, dout = inputs(B, H, N, N, D)
        print(report(f"{backend} scale={value} {(B, H, N, D)}",
                     grads(backend, q, k, v, dout, scale=value),
                     truth(q, k, v, dout, scale=value)), flush=True)


def main():
    """Each suspect in turn; a shape a backend refuses ends that suspect's loop."""
    print(torch.__version__, torch.cuda.get_device_name())
    for suspect in (lambda: layout_after_layout("cudnn"), lambda: bottom_right("efficient"),
                    lambda: bottom_right("cudnn"), lambda: scale("flash", 0.0),
                    lambda: scale("flash", -0.25), lambda: scale("cudnn", 0.0),
                    lambda: strided_dout("efficient")):
        try:
            suspect()
        except RuntimeError as e:
            print("  raised:", str(e).splitlines()[0][:100], flush=True)


if __name__ == "__main__":
    main()
