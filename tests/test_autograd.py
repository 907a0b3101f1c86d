"""numba_kernels.flash_attention differentiable for torch tensors (numba_kernels/autograd.py),
in the CUDA simulator with CPU tensors: gradients of out and of lse against float64 torch
autograd, one opaque operator under torch.compile, and the contract's errors."""
import pytest

torch = pytest.importorskip("torch")

from numba_kernels import flash_attention  # noqa: E402


def torch_attention(q, k, v, scale, mask):
    """out and lse by torch's own float64 ops: what autograd differentiates for the truth."""
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


CASES = {  # name: (B, Hq, Hk, Nq, Nk, D, Dv), options, the mask those options mean
    "causal bottom_right": ((1, 2, 2, 5, 7, 8, 8), dict(causal="bottom_right"),
                            lambda nq, nk: torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)),
    "GQA, Dv != D, mask": ((2, 4, 2, 6, 5, 8, 4), "mask", None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_of_out_and_lse_match_float64_autograd(name):
    shape, options, band = CASES[name]
    B, Hq, Hk, Nq, Nk, D, Dv = shape
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*s, generator=g).requires_grad_()
               for s in ((B, Hq, Nq, D), (B, Hk, Nk, D), (B, Hk, Nk, Dv)))
    if options == "mask":
        mask = torch.rand(B, 1, Nq, Nk, generator=g) < 0.7
        mask[..., 0] = True  # every row sees a key
        options = dict(mask=mask)
    else:
        mask = band(Nq, Nk)
    out, lse = flash_attention(q, k, v, return_lse=True, **options)
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    ((out * dout).sum() + (lse * dlse).sum()).backward()

    group = Hq // Hk
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out64, lse64 = torch_attention(q64, k64.repeat_interleave(group, 1),
                                   v64.repeat_interleave(group, 1), D ** -0.5, mask)
    ((out64 * dout.double()).sum() + (lse64 * dlse.double()).sum()).backward()
    for got, want, what in ((out, out64, "out"), (lse, lse64, "lse"), (q.grad, q64.grad, "dq"),
                            (k.grad, k64.grad, "dk"), (v.grad, v64.grad, "dv")):
        err = float((got.detach().double() - want.detach()).abs().max())
        assert err < 2e-6, f"{what}: {err}"


def test_an_output_the_loss_does_not_use_sends_no_gradient(monkeypatch):
    """A loss of out alone reaches the backward with dlse None (zeros would cost a
    subtraction, and a backward with dlse is never replayed); a loss of lse alone with dout
    zeros. Either way the gradients are flash_attention_backward's for those."""
    from numba_kernels import autograd, flash_attention_backward

    seen = []
    on_device = autograd.on_device

    def spy(fn, arrays, opts, **kw):
        if "dlse" in opts:
            seen.append((opts["dlse"], arrays[5]))
        return on_device(fn, arrays, opts, **kw)

    monkeypatch.setattr(autograd, "on_device", spy)
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 2, 9, 8, generator=g).half() for _ in range(4))
    out, lse = flash_attention(q, k, v, return_lse=True)
    for loss, want in ((lambda o, s: (o * dout).sum(), (dout, None)),
                       (lambda o, s: s.sum(), (torch.zeros_like(out), torch.ones_like(lse)))):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        loss(*flash_attention(*xs, return_lse=True)).backward()
        dlse, got_dout = seen.pop()
        assert (dlse is None) == (want[1] is None) and torch.equal(got_dout, want[0])
        grads = flash_attention_backward(q, k, v, out, lse, want[0], dlse=want[1])
        assert all(torch.equal(x.grad, w) for x, w in zip(xs, grads))


def test_one_opaque_operator_under_torch_compile():
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    q, k, v = (torch.randn(1, 1, 4, 8, requires_grad=True) for _ in range(3))
    loss = torch.compile(lambda q, k, v: flash_attention(q, k, v).sum(), backend=record,
                         fullgraph=True)(q, k, v)
    loss.backward()
    assert any("flash_conformance.attention" in t for t in graphs[0]), graphs
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_cpu_tensors_without_gradients_match_numpy():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    got = flash_attention(q, k, v, causal="top_left")
    want = flash_attention(*(x.float().numpy() for x in (q, k, v)), causal="top_left")
    assert got.dtype == torch.bfloat16 and float((got.float() - torch.from_numpy(want))
                                                 .abs().max()) < 1e-2


def test_contract_errors_come_first():
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    with pytest.raises(ValueError, match="top_left"):
        flash_attention(q, q, q, causal=True)


def test_a_bias_that_needs_a_gradient_is_refused():
    """The kernels compute no dbias: a learnable bias must not silently get none."""
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    bias = torch.zeros(1, 1, 4, 4, requires_grad=True)
    for x in (q, q.detach()):  # also when q, k and v need no gradient
        with pytest.raises(NotImplementedError, match="bias requires grad"):
            flash_attention(x, x, x, bias=bias)
    flash_attention(q, q, q, bias=bias.detach()).sum().backward()
    assert q.grad is not None


def test_the_gradients_follow_the_forwards_kernel_and_precision(monkeypatch):
    """The backward runs the kernels the forward chose, at its precision: the tuned ones
    after the SIMT forward, the tensor cores after the halves (float32 by default, summed;
    precision="high"), whose scores are the forward's bit for bit; a dout whose head the
    halves cannot hold is refused by name, not run on other scores."""
    from numba_kernels import backward, forward

    ran = []
    for name in backward.LAUNCHES:
        monkeypatch.setitem(backward.LAUNCHES, name,
                            lambda *a, name=name: ran.append((name, a[-1])))
    # the forward's choice is what is tested, not its values: the halves' launch left out
    monkeypatch.setattr(forward, "mma_forward",
                        lambda *a, **kw: ran.append(("mma forward", "summed" if a[-1] else "")))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g).requires_grad_() for _ in range(3))
    flash_attention(q, k, v, kernel="simt").sum().backward()
    assert ran == [("tuned", "highest")]
    flash_attention(q, k, v).sum().backward()
    assert ran[1:] == [("mma forward", "summed"), ("mma", "highest")]
    out = flash_attention(q, k, v, precision="high")  # one forward on the halves, two uses
    dout = torch.ones(1, 2, 64, 16)
    dout[0, 1] = 2.0**-20
    with pytest.raises(ValueError, match=r"\(batch 0, head 1\) of dout holds values 2\^20"):
        out.backward(dout, retain_graph=True)
    out.backward(torch.ones(1, 2, 64, 16))
    assert ran[3:] == [("mma forward", ""), ("mma", "high")]
