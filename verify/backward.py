"""verify's gradients: the backward battery, and how a backward case is run and judged.

A backward case draws q, k, v and the options as its forward twin does, and an incoming
gradient dout (DOUTS); the implementation's grad(q, k, v, dout, **options) returns (dq, dk,
dv), judged each against reference.attention_backward under the forward's rule, with
reference.attention_backward_lowp as the plain same-precision computation (criterion
.judge_backward). An implementation gives gradients through Implementation.grad: the
adapters of PyTorch and JAX derive it from their forward (torch_grad, jax_grad), the
reference computes it, and a user passes `grad=` to verify.compare or a differentiable torch
or JAX forward.

Rows that see no key: the contract gives them out = 0 and no gradient. An implementation that
declares another forward convention (Supports.fully_masked) gets dout = 0 on those rows, so
its convention, declared and reported by the forward suite, is not counted twice.
"""
import time
from dataclasses import replace

import numpy as np

from reference.dtypes import cast
from .cases import POISONS, SPREAD, Case, battery, ladder, poison_rows, visibility
from .criterion import judge_backward
from .calling import Fail, bits, call, converter, host, to_impl
from .pipeline import empty_rows, verdict
from .report import CaseResult

DOUTS = {
    "normal": "standard normal values",
    "large": "standard normal values times 1000",
    "tiny": "standard normal values times 0.001",
    "strided": "standard normal values in a non-contiguous view",
    "relayout": "the strided view, after a call with dout contiguous at the same shapes (a "
                "plan cached by shape must not read the view by the first call's layout)",
    "heads": "standard normal values, each (batch, head) times its own 2^e, e over "
             "cases.SPREAD[dtype] binades (a loss that weighs heads apart)",
}
GRADS = ("dq", "dk", "dv")


def backward_battery(suite="quick", dtypes=None, max_head_dim=256, sharded=False):
    """The forward battery's cases of values as backward cases, and the cases where backward
    kernels break: short rows with peaked softmax, dout of every kind, GQA reductions under a
    mask, determinism of each gradient. sharded: as battery's."""
    kw = {} if dtypes is None else dict(dtypes=dtypes)
    forward = battery(suite, max_head_dim=max_head_dim, sharded=sharded, **kw)
    cases = [replace(c, name=f"{c.name} (backward)", backward=True) for c in forward
             if c.check is None and not c.sampled]
    dtype = forward[0].dtype

    def add(name, **fields):
        base = dict(B=2, Hq=2, Hk=2, Nq=33, Nk=40, D=16, Dv=16, dtype=dtype, backward=True)
        base.update(fields)
        cases.append(Case(name=f"backward: {name}", **base))

    for n in (1, 2, 5, 17):
        add(f"N = {n}, scores x16", Nq=n, Nk=n, values="scaled", causal="bottom_right")
    for kind in ("large", "tiny", "strided"):
        add(f"dout {kind}", dout=kind)
    add(f"dout heads 2^{SPREAD[dtype]} apart", dout="heads", Hq=4, Hk=4)
    add("dout strided after contiguous", dout="relayout", Nq=34, Nk=41)  # shapes of its own
    add("GQA 4:1 with a mask", Hq=8, Hk=2, mask="random")
    add("GQA 4:1, Dv != D, causal", Hq=8, Hk=2, Dv=24, causal="top_left")
    # a NaN or an inf in a row of Q or dO: the keys the row does not see get nothing from it
    # (a kernel that adds 0 * NaN for them leaks it into their dk, dv)
    add("q:nan in a row some keys see (causal=top_left)", poison="q:nan", causal="top_left")
    add("dout:inf in a row some keys see (mask=random)", poison="dout:inf", mask="random")
    add("determinism", repeat=True, Nq=65, Nk=70, mask="random")
    add("determinism, GQA", repeat=True, Hq=8, Hk=2, Nq=65, Nk=70)
    return cases


def make_dout(case, seed):
    """The incoming gradient (B, Hq, Nq, Dv) of a backward case, in the case's dtype."""
    rng = np.random.default_rng([seed, 0xD0])
    dout = rng.standard_normal((case.B, case.Hq, case.Nq, case.Dv))
    dout *= {"large": 1e3, "tiny": 1e-3}.get(case.dout, 1.0)
    if case.dout == "heads":
        e = ladder(rng, case.B * case.Hq, SPREAD[case.dtype])
        dout *= 2.0 ** e.reshape(case.B, case.Hq, 1, 1)
    return cast(dout, case.dtype)


def run_backward_case(impl, case, seed, inputs):
    """The CaseResult of one backward case, inputs from make_inputs."""
    q, k, v, options = inputs
    dout, notes = make_dout(case, seed), []
    for part in (case.poison or "").split(","):
        if part.startswith("dout:"):
            poison_rows(case, dout, visibility(case, options), POISONS[part[5:]])
    empty = empty_rows(q, k, v, options)
    if empty.any() and impl.supports.fully_masked != "zeros":
        dout = np.where(empty[..., None], 0, dout).astype(dout.dtype)
        notes.append(f"dout = 0 on rows that see no key ({impl.supports.fully_masked} "
                     "declared for them)")
    args, kwargs = to_impl(impl, case, inputs)
    kwargs.pop("return_lse", None)
    dout_arg = _dout_arg(impl, case, dout, converter(impl))
    before = [bits(x) for x in args + [dout_arg]]
    t0 = time.perf_counter()
    try:
        if case.dout == "relayout":  # first the same shapes with dout contiguous (unjudged)
            plain = _dout_arg(impl, replace(case, dout="normal"), dout, converter(impl))
            call(impl, (), {}, run=lambda: impl.grad(*args, plain, **kwargs))
        grads = _unpack(impl, case, call(impl, (), {}, run=lambda: impl.grad(
            *args, dout_arg, **kwargs)), host)
        seconds = time.perf_counter() - t0
        if not all(np.array_equal(b, bits(x)) for b, x in zip(before, args + [dout_arg])):
            raise Fail("the backward call wrote into its inputs or dout")
        if case.repeat:
            again = _unpack(impl, case, call(impl, (), {}, run=lambda: impl.grad(
                *args, dout_arg, **kwargs)), host)
            differ = [n for n, a, b in zip(GRADS, grads, again) if not np.array_equal(a, b)]
            if differ:
                raise Fail(f"two runs on the same inputs differ: {', '.join(differ)}")
    except Fail as e:
        return CaseResult(case, seed, "fail", str(e), seconds=time.perf_counter() - t0)
    comparisons = judge_backward(q, k, v, dout, grads, dtype=case.dtype, **options)
    return verdict(case, seed, comparisons, notes, seconds)


def _dout_arg(impl, case, dout, convert):
    if impl.layout == "bnhd":
        dout = dout.transpose(0, 2, 1, 3)
    if case.dout in ("strided", "relayout"):  # the same values in the other layout: a view
        x = convert(np.ascontiguousarray(dout.transpose(0, 2, 1, 3)))
        return x.permute(0, 2, 1, 3) if hasattr(x, "permute") else x.transpose(0, 2, 1, 3)
    return convert(np.ascontiguousarray(dout))


def _unpack(impl, case, grads, host):
    """(dq, dk, dv) as float64 NumPy arrays in the contract's layout, after checking them."""
    if not (isinstance(grads, (tuple, list)) and len(grads) == 3):
        raise Fail(f"grad returned {type(grads).__name__}; expected (dq, dk, dv)")
    shapes = [(case.B, case.Hq, case.Nq, case.D), (case.B, case.Hk, case.Nk, case.D),
              (case.B, case.Hk, case.Nk, case.Dv)]
    result = []
    for name, g, shape in zip(GRADS, grads, shapes):
        want = shape if impl.layout == "bhnd" else (shape[0], shape[2], shape[1], shape[3])
        if tuple(getattr(g, "shape", ())) != want:
            raise Fail(f"{name} has shape {tuple(getattr(g, 'shape', ()))}; expected {want}")
        got_dtype = str(g.dtype).replace("torch.", "")
        if got_dtype != case.dtype:
            raise Fail(f"{name} has dtype {got_dtype}; expected {case.dtype}, the inputs'")
        g = host(g).astype(np.float64)
        result.append(g.transpose(0, 2, 1, 3) if impl.layout == "bnhd" else g)
    return result


def torch_grad(fn):
    """grad(q, k, v, dout, **options) from a differentiable torch forward fn, by autograd."""
    def grad(q, k, v, dout, **options):
        import torch

        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        with torch.enable_grad():
            out = fn(*leaves, **options)
            out = out[0] if isinstance(out, tuple) else out
            grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
        return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads))

    return grad


def jax_grad(fn):
    """grad(q, k, v, dout, **options) from a JAX forward fn, by jax.vjp."""
    def grad(q, k, v, dout, **options):
        import jax

        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **options), q, k, v)
        return vjp(dout.astype(out.dtype))

    return grad


def for_backward(impl, grad=None):
    """impl with its gradients: `grad` if given, its own, or derived from its torch or JAX
    forward. Raises ValueError where there is none."""
    if grad is not None:
        impl.grad = grad
    elif impl.grad is None:
        if not impl.differentiable:
            raise ValueError(f"backward=True: {impl.name} has no backward pass")
        if impl.array == "torch":
            impl.grad = torch_grad(impl.fn)
        elif impl.array == "jax":
            impl.grad = jax_grad(impl.fn)
        else:
            raise ValueError(f"backward=True: {impl.name} gives no gradients; pass grad=fn "
                             "(fn(q, k, v, dout, **options) -> (dq, dk, dv)), or a "
                             "differentiable torch or JAX forward")
    impl.supports.backward = True
    return impl
