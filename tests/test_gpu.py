"""What only a GPU shows about our kernels, as tests: `pytest -m gpu` on a GPU machine (with
torch CUDA) runs them all; in the simulator they are skipped.

- verify's standard suite on flash_attention's default with every output buffer poisoned
  with NaN first (an element the kernel never writes shows) and every call preceded by a
  call of the same layout on other tensors, so that the judged call reuses that launch plan
  (launch.py) and must take every pointer from its own arguments;
- replayed calls (replay.py), forward and backward, bitwise equal to whole ones, and the
  layouts that replay;
- how mma.sync rounds its sums: the model tests/test_halves.py and warp.py build on;
- float32 by default (precision "highest", the summed halves on the tensor cores) errs as
  torch's math backend in float32 does, at sizes where their sums are long;
- compute-sanitizer's racecheck and memcheck on small launches of several variants, where
  compute-sanitizer is on the PATH.
"""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from numba_kernels import SIMULATOR

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(SIMULATOR or not torch.cuda.is_available(),
                                 reason="a GPU test (pytest -m gpu on a GPU machine)")]


def test_the_standard_suite_passes_with_poisoned_outputs_and_reused_launch_plans(monkeypatch):
    import verify
    from numba_kernels import arrays, flash_attention, launch

    def poisoned(self, shape, dtype):
        return torch.full(shape, float("nan"), dtype=getattr(torch, dtype), device=self.device)

    monkeypatch.setattr(arrays.TorchIO, "empty", poisoned)

    def same_layout(x):  # other values in x's shape and strides (stride-0 ones too)
        size = 1 + sum((n - 1) * step for n, step in zip(x.shape, x.stride()))
        if x.numel() == 0:
            return torch.empty_like(x)
        return torch.randn(size, device=x.device).to(x.dtype).as_strided(x.shape, x.stride())

    def after_a_call_on_other_tensors(q, k, v, **options):
        flash_attention(*(same_layout(x) for x in (q, k, v)), **options)
        return flash_attention(q, k, v, **options)

    impl = verify.builtin("numba")
    impl.fn = after_a_call_on_other_tensors
    before = launch.FAST_LAUNCHES[0]
    report = verify.compare(impl, suite="standard", progress=False)
    assert report.passed, str(report)
    assert launch.FAST_LAUNCHES[0] > before, "every call took Numba's own launch path"


# (B, Hq, Hk, Nq, Nk, D, Dv, dtype, options, layout, replayed)
REPLAY_CASES = {
    "bf16 causal": (2, 4, 4, 200, 200, 128, 128, "bfloat16", dict(causal="top_left"), {},
                    True),
    "bf16 lse": (1, 3, 3, 65, 129, 128, 128, "bfloat16", dict(return_lse=True), {}, True),
    "bf16 gqa window": (2, 8, 2, 97, 300, 64, 64, "bfloat16",
                        dict(window=(40, 3), causal="bottom_right", scale=0.3), {}, True),
    "bf16 decoding": (4, 8, 8, 1, 4096, 128, 128, "bfloat16", {}, {}, True),
    "fp32 simt": (2, 2, 2, 70, 70, 64, 64, "float32", dict(causal="top_left", kernel="simt"),
                  {}, True),
    "bf16 strided q": (1, 2, 2, 64, 64, 64, 64, "bfloat16", {}, dict(strided=True), False),
    "bf16 q is k": (1, 2, 2, 64, 64, 64, 64, "bfloat16", {}, dict(same=True), True),
    "bf16 mask": (2, 4, 2, 100, 132, 64, 64, "bfloat16", dict(causal="bottom_right"),
                  dict(mask=True), True),
    "fp16 mask and bias": (1, 4, 4, 70, 96, 64, 32, "float16", {}, dict(mask=True, bias=True),
                           True),
    # the second call's mask starts at byte 1: its pre-pass cannot read words of four keys
    "bf16 mask moved off alignment": (1, 2, 2, 64, 96, 64, 64, "bfloat16", {},
                                      dict(mask=True, offsets=(0, 1)), False),
}


@pytest.mark.parametrize("name", list(REPLAY_CASES))
def test_a_replayed_call_is_bitwise_the_whole_one(name):
    from numba_kernels import flash_attention, replay

    b, hq, hk, nq, nk, d, dv, dtype, options, layout, replayed = REPLAY_CASES[name]
    dt = getattr(torch, dtype)

    def inputs(call):
        q = torch.randn(b, hq, nq, d, device="cuda", dtype=dt)
        if layout.get("strided"):
            q = torch.randn(b, nq, hq, d, device="cuda", dtype=dt).transpose(1, 2)
        k = q if layout.get("same") else torch.randn(b, hk, nk, d, device="cuda", dtype=dt)
        side = {}
        if layout.get("mask"):
            at = layout.get("offsets", (0, 0))[call]
            keep = torch.rand(b * hq * nq * nk + at, device="cuda") < 0.7
            side["mask"] = keep[at:].view(b, hq, nq, nk)
        if layout.get("bias"):
            side["bias"] = torch.randn(1, hq, nq, nk, device="cuda")
        return (q, k, torch.randn(b, hk, nk, dv, device="cuda", dtype=dt)), side

    with torch.no_grad():
        first, side = inputs(0)
        flash_attention(*first, **options, **side)
        second, side = inputs(1)
        before = replay.REPLAYED[0]
        got = flash_attention(*second, **options, **side)
        assert (replay.REPLAYED[0] > before) == replayed
        replay.forget()
        want = flash_attention(*second, **options, **side)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


# (dtype, options, sides, replayed): the backward of a call, replayed the second time
BACKWARD_REPLAY_CASES = {
    "bf16 causal gqa": ("bfloat16", dict(causal="bottom_right"), (), True),
    "fp16 mask and bias": ("float16", {}, ("mask", "bias"), True),
    "bf16 block mask": ("bfloat16", dict(block_size=128), ("block_mask",), True),
    "bf16 tuned": ("bfloat16", dict(kernel="tuned", window=(50, 0)), (), True),
    "bf16 dlse": ("bfloat16", {}, ("dlse",), False),  # a torch subtraction, not a launch
    "fp32": ("float32", {}, (), False),  # the values' range picks the kernel
}


@pytest.mark.parametrize("name", list(BACKWARD_REPLAY_CASES))
def test_a_replayed_backward_is_bitwise_the_whole_one(name):
    """flash_attention_backward's second call of a layout replays the first one's launches
    (where its case says so) and gives the gradients of a whole call bitwise."""
    from numba_kernels import flash_attention, flash_attention_backward, replay

    dtype, options, sides, replayed = BACKWARD_REPLAY_CASES[name]
    dt, (b, hq, hk, nq, nk, d) = getattr(torch, dtype), (2, 4, 2, 150, 260, 64)

    def call():
        q, dout = (torch.randn(b, hq, nq, d, device="cuda", dtype=dt) for _ in "qo")
        k, v = (torch.randn(b, hk, nk, d, device="cuda", dtype=dt) for _ in "kv")
        side = dict(mask=torch.rand(b, 1, nq, nk, device="cuda") < 0.6,
                    bias=torch.randn(1, hq, nq, nk, device="cuda"),
                    block_mask=torch.rand(1, hq, 2, 3, device="cuda") < 0.6)
        side = {s: side[s] for s in sides if s != "dlse"}
        forward = dict(options, kernel={"tuned": "simt"}.get(options.get("kernel"), "auto"))
        out, lse = flash_attention(q, k, v, return_lse=True, **forward, **side)
        if "dlse" in sides:
            side["dlse"] = torch.randn_like(lse)
        return (q, k, v, out, lse, dout), side

    with torch.no_grad():
        args, side = call()
        flash_attention_backward(*args, **options, **side)
        args, side = call()
        before = replay.REPLAYED[0]
        got = flash_attention_backward(*args, **options, **side)
        assert (replay.REPLAYED[0] > before) == replayed
        replay.forget()
        want = flash_attention_backward(*args, **options, **side)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_mma_sync_cuts_its_sums_toward_zero_as_the_model_says():
    """Every A and B element of one warp's mma.sync the same float16 value, so every element
    of D is c + 16 a b, exact in float64: the GPU returns what tests/test_halves.py's model
    of its sums says (each product cut to the ulp of the largest addend, the sum toward
    zero), not the nearest float32, where the two differ."""
    from numba import cuda

    from numba_kernels import warp

    quarter = 0.75 * 2.0**-13
    cases = [(1.0, quarter, 2.0**-14, 1.0), (-1.0, quarter, -2.0**-14, -1.0),
             (1.0, quarter, -2.0**-16, 1.0), (3.0, quarter, 2.0**-14, 3.0),
             (1.0, 2.0**-12, 819 * 2.0**-24, 1.0)]  # (c, a, b, what the H200 returns)

    @cuda.jit
    def probe(a_s, bs, cs, out):
        for i in range(cs.size):
            aw = warp.pack_f16(a_s[i], a_s[i])
            bw = warp.pack_f16(bs[i], bs[i])
            d0, _, _, _ = warp.mma_f16(aw, aw, aw, aw, bw, bw, cs[i], cs[i], cs[i], cs[i])
            if cuda.threadIdx.x == 0:
                out[i] = d0

    cs, a_s, bs, want = (np.array(x, np.float32) for x in zip(*cases))
    out = np.zeros(len(cases), np.float32)
    probe[1, 32](a_s, bs, cs, out)
    assert (out == want).all(), out
    nearest = cs.astype(np.float64) + 16 * a_s.astype(np.float64) * bs.astype(np.float64)
    assert (out != nearest.astype(np.float32)).any()  # the cases tell the two apart


SANITIZED = """
import torch
from numba_kernels import flash_attention, flash_attention_backward
g = torch.Generator(device="cuda").manual_seed(0)
def r(*s, dt=torch.float32):
    return torch.randn(*s, device="cuda", generator=g).to(dt)
m = torch.rand(2, 1, 200, 77, device="cuda", generator=g) < 0.5
flash_attention(r(2, 2, 200, 64), r(2, 1, 77, 64), r(2, 1, 77, 64), mask=m, causal="top_left")
flash_attention(r(1, 2, 100, 128, dt=torch.bfloat16), r(1, 2, 150, 128, dt=torch.bfloat16),
                r(1, 2, 150, 128, dt=torch.bfloat16), causal="bottom_right",
                kv_lengths=torch.tensor([111], device="cuda", dtype=torch.int32))
flash_attention(r(1, 1, 40, 256, dt=torch.float16), r(1, 1, 70, 256, dt=torch.float16),
                r(1, 1, 70, 256, dt=torch.float16), window=(9, 3), return_lse=True)
flash_attention(r(2, 4, 1, 64, dt=torch.float16), r(2, 4, 900, 64, dt=torch.float16),
                r(2, 4, 900, 64, dt=torch.float16), num_splits=5, causal="bottom_right")
vn = r(1, 2, 150, 64, dt=torch.bfloat16)
vn[0, 0, 70] = float("nan")
flash_attention(r(1, 4, 100, 128, dt=torch.bfloat16), r(1, 2, 150, 128, dt=torch.bfloat16),
                vn, causal="bottom_right", kernel="mma")
for dt, kernel in ((torch.float32, "tuned"), (torch.bfloat16, "mma")):
    q, k, v = r(1, 2, 100, 64, dt=dt), r(1, 2, 130, 64, dt=dt), r(1, 2, 130, 64, dt=dt)
    out, lse = flash_attention(q, k, v, causal="bottom_right", return_lse=True,
                               kernel="simt" if kernel == "tuned" else "mma")
    flash_attention_backward(q, k, v, out, lse, torch.ones_like(out), causal="bottom_right",
                             kernel=kernel)
for d in (64, 128):  # float32 at precision "highest": the summed tensor-core variants
    q, k, v = r(1, 2, 100, d), r(1, 2, 130, d), r(1, 2, 130, d)
    out, lse = flash_attention(q, k, v, causal="bottom_right", return_lse=True, kernel="mma")
    flash_attention_backward(q, k, v, out, lse, torch.ones_like(out), causal="bottom_right",
                             kernel="mma")
torch.cuda.synchronize()
print("launches done")
"""


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None,
                    reason="compute-sanitizer is not on the PATH")
@pytest.mark.parametrize("tool", ["racecheck", "memcheck"])
def test_compute_sanitizer_finds_nothing(tool, tmp_path):
    script = tmp_path / "launches.py"
    script.write_text(SANITIZED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run(["compute-sanitizer", "--tool", tool, "--report-api-errors", "no",
                          sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=600)
    text = run.stdout + run.stderr
    assert run.returncode == 0 and "launches done" in text, text[-3000:]
    assert "ERROR SUMMARY: 0 errors" in text or "RACECHECK SUMMARY: 0 hazards" in text, \
        text[-3000:]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_strided_inputs_give_the_contiguous_outputs_bitwise(dtype):
    """(B, N, H, D) storage seen as (B, H, N, D): the same sums in the same order."""
    from numba_kernels import flash_attention

    bnhd = [torch.randn(2, 300, 4, 64, device="cuda", dtype=getattr(torch, dtype))
            for _ in "qkv"]
    strided = [x.permute(0, 2, 1, 3) for x in bnhd]
    with torch.no_grad():
        assert torch.equal(flash_attention(*strided, causal="bottom_right"),
                           flash_attention(*(x.contiguous() for x in strided),
                                           causal="bottom_right"))


ACCURACY_SHAPES = {  # (B, Hq, Hk, Nq, Nk, D, causal)
    "GQA 8:2, causal bottom_right, D=40": (2, 8, 2, 1000, 3001, 40, "bottom_right"),
    "D=128, 4096 keys": (1, 4, 4, 4096, 4096, 128, False),
    "D=64, 2048 keys": (2, 8, 8, 2048, 2048, 64, False),
}


def _math_attention(q, k, v, dout, causal):
    """out and the gradients by torch's math backend in q's dtype (float64 for the truth)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    mask = None
    if causal:  # bottom_right: row i sees keys j <= i + Nk - Nq
        i = torch.arange(q.shape[2], device="cuda")[:, None]
        mask = torch.arange(k.shape[2], device="cuda")[None] <= i + k.shape[2] - q.shape[2]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask)
    return (out,) + torch.autograd.grad(out, (q, k, v), dout.to(q.dtype))


@pytest.mark.parametrize("name", list(ACCURACY_SHAPES))
def test_float32_by_default_errs_as_torchs_float32_math_does(name):
    """flash_attention's float32 default, forward and backward (precision "highest": here the
    summed halves, plan.halves_summed), against float64: each output's normwise error at
    most 2 times torch's math backend's in float32 for out, 3 times for each gradient, per
    (batch, head) slice as well as whole."""
    from numba_kernels import flash_attention, flash_attention_backward, kernel_plan

    b, hq, hk, nq, nk, d, causal = ACCURACY_SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, nq, d, device="cuda", generator=g)
    k, v = (torch.randn(b, hk, nk, d, device="cuda", generator=g) for _ in range(2))
    dout = torch.randn(b, hq, nq, d, device="cuda", generator=g)
    assert kernel_plan(q, k, v, causal=causal)[::2] == ("mma", "highest")
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    ours = (out,) + flash_attention_backward(q, k, v, out, lse, dout, causal=causal)
    truth = _math_attention(*(x.double() for x in (q, k, v, dout)), causal)
    math = _math_attention(q, k, v, dout, causal)

    def errors(got, want):  # whole, and the worst (batch, head) slice
        diff = (got.double() - want).flatten(2)
        return ((diff.norm() / want.norm()).item(),
                (diff.norm(dim=2) / want.flatten(2).norm(dim=2)).max().item())

    for what, mine, theirs, want, allowed in zip(("out", "dq", "dk", "dv"), ours, math, truth,
                                                  (2, 3, 3, 3)):
        for ours_err, math_err in zip(errors(mine, want), errors(theirs, want)):
            assert ours_err <= allowed * math_err, (what, ours_err, math_err)


def test_autograd_on_cuda_tensors_that_require_grad_gives_the_backward_kernels_gradients():
    """flash_attention on CUDA tensors that require grad (the operator, autograd.py), with a
    mask: the gradients are flash_attention_backward's on the same inputs, bitwise."""
    from numba_kernels import flash_attention, flash_attention_backward

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 2, 200, 64, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in "qkv")
    mask = torch.rand(1, 1, 200, 200, device="cuda", generator=g) < 0.3
    dout = torch.randn_like(q)
    out, lse = flash_attention(q, k, v, mask=mask, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    with torch.no_grad():
        want = flash_attention_backward(q, k, v, out, lse, dout, mask=mask)
    for got, kernel in zip(grads, want):
        assert torch.equal(got, kernel)


@pytest.mark.parametrize("size,masked", [((128, 128), False), ((64, 192), True), (48, False)])
def test_a_block_mask_is_its_masks_call_bit_for_bit(size, masked):
    """flash_attention(block_mask=) through autograd, forward and gradients, bitwise the call
    with the boolean mask the table stands for (read from the table for blocks of 64
    multiples, written out for others), at a size of many tiles, replayed the second time."""
    from numba_kernels import flash_attention
    from reference.blocks import block_mask_visible
    from reference.contract import block_pair

    b, h, n_q, n_k, d = 2, 4, 700, 1000, 64
    bm, bn = block_pair(size)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                     for n in (n_q, n_k, n_k, n_q))
    table = torch.rand(1, h, -(-n_q // bm), -(-n_k // bn), device="cuda", generator=g) < 0.3
    mask = torch.rand(b, h, n_q, n_k, device="cuda", generator=g) < 0.9 if masked else None
    keep = torch.as_tensor(block_mask_visible(table.cpu().numpy(), size, n_q, n_k),
                           device="cuda") & (True if mask is None else mask)
    for _ in range(2):  # the second call replays the first one's launches
        results = []
        for sides in (dict(mask=mask, block_mask=table, block_size=size), dict(mask=keep)):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            out = flash_attention(*x, causal="bottom_right", **sides)
            out.backward(dout)
            results.append([out] + [t.grad for t in x])
        for got, want in zip(*results):
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
