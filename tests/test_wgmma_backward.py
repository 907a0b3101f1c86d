"""The backward on Hopper's warpgroup tensor cores (flash_attention_backward(kernel="wgmma"),
numba_kernels/flash_wgmma_bwd.py). In the simulator warpgroup.py sums each wgmma step as
warp.py sums mma.sync's, so the gradients must be the mma.sync backward's bit for bit: cases
that take every path of the kernels (both of dK/dV's query tiles, masks read, a block table
read as it is, GQA, Dv != D, blocks deferred to the mma.sync nonfinite variants). On an H100 or H200: tests/test_gpu.py and verify's backward suite
(scripts/gpu_verify.sh). The PTX gate (tests/test_ptx.py) compiles every variant for sm_90a."""
import numpy as np
import pytest

import verify  # noqa: F401  (selects the simulator on a machine without a GPU)
from numba_kernels import backward, flash_attention, flash_attention_backward
from numba_kernels.convert import SIMULATOR
from numba_kernels.flash_wgmma_bwd import WgmmaBwdSpec, wgmma_bwd_specs
from numba_kernels.plan import hopper_why_not

# (B, Hq, Hk, Nq, Nk, D, Dv, dtype, options); "mask": a random boolean mask; "blocks": a
# table of 64 x 64 blocks (block_mask=), every other one kept, the diagonal too
CASES = {
    "GQA 2:1, causal bottom_right, Dv != D": (1, 2, 1, 70, 90, 16, 8, "bfloat16",
                                              dict(causal="bottom_right")),
    "mask, window, kv_lengths, D > 64 (query tiles of 32)": (
        2, 1, 1, 40, 50, 72, 72, "float16", dict(mask="mask", window=(9, 3),
                                                 kv_lengths=np.array([50, 17]))),
    "block table read as it is": (1, 1, 1, 130, 130, 16, 16, "float16", dict(mask="blocks")),
    "a NaN in a row of q some keys do not see (deferred)": (
        1, 1, 1, 70, 40, 16, 16, "bfloat16", dict(causal="top_left", poison=True)),
}


def _inputs(B, Hq, Hk, Nq, Nk, D, Dv, dtype, options):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((B, Hq, Nq, D)).astype(dtype)
    k = rng.standard_normal((B, Hk, Nk, D)).astype(dtype)
    v = rng.standard_normal((B, Hk, Nk, Dv)).astype(dtype)
    dout = rng.standard_normal((B, Hq, Nq, Dv)).astype(dtype)
    options = dict(options)
    if options.pop("poison", False):
        q[0, 0, 3, 2] = np.nan  # row 3 sees keys 0 .. 3 only: the keys after see no NaN
    if options.get("mask") == "mask":
        options["mask"] = rng.random((B, Hq, Nq, Nk)) < 0.6
    elif options.get("mask") == "blocks":
        table = np.zeros((1, 1, 3, 3), bool)
        table.reshape(-1)[::2] = True
        options.pop("mask")
        options.update(block_mask=table, block_size=64)
    return (q, k, v, dout), options


@pytest.mark.long
@pytest.mark.skipif(not SIMULATOR, reason="bitwise in the simulator; tests/test_gpu.py on a GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_the_wgmma_backward_is_the_mma_backward_bit_for_bit(name):
    (q, k, v, dout), options = _inputs(*CASES[name])
    out, lse = flash_attention(q, k, v, return_lse=True, kernel="wgmma", **options)
    want = flash_attention_backward(q, k, v, out, lse, dout, kernel="mma", **options)
    got = flash_attention_backward(q, k, v, out, lse, dout, kernel="wgmma", **options)
    for grad, x, y in zip(("dq", "dk", "dv"), want, got):
        assert np.array_equal(x.view(np.uint16), y.view(np.uint16)), (
            grad, np.nanmax(np.abs(x.astype(np.float32) - y.astype(np.float32))))
    if "poison" in CASES[name][-1]:  # the NaN reaches only its row's dq and the keys it sees
        assert np.isnan(got[0][0, 0, 3]).all() and np.isfinite(np.delete(got[0], 3, 2)).all()
        assert all(np.isfinite(g[0, 0, 4:]).all() for g in got[1:])


def _gradients_not_waited_for(spec):
    """A broken make_kv_gradients: dK/dV's gradient chains issued and not waited for (the
    next step's score chains' wait retires them), their accumulators stored at once."""
    from numba_kernels import flash_wgmma_bwd, warpgroup
    from numba_kernels.common import kernel_part

    _, mma_regs_mn, pack = flash_wgmma_bwd.instructions(spec)
    issue_dv = flash_wgmma_bwd.make_pv(spec.dv, mma_regs_mn, pack, spec.qb)
    issue_dk = flash_wgmma_bwd.make_pv(spec.d, mma_regs_mn, pack, spec.qb)
    DO_AT = spec.layout["do_at"]

    @kernel_part
    def gradients(words, at, s, dp, dk_acc, dv_acc):
        dv_new = issue_dv(words, at + DO_AT, s, dv_acc)
        dk_new = issue_dk(words, at, dp, dk_acc)
        warpgroup.fragment_store(dv_acc, dv_new)
        warpgroup.fragment_store(dk_acc, dk_new)

    return gradients


@pytest.mark.long
@pytest.mark.skipif(not SIMULATOR, reason="the simulator's ordering check")
def test_a_step_that_does_not_wait_for_its_gradient_products_raises(monkeypatch):
    """The step after next copies its Q and dO tiles into the stage the gradient chains
    read: a step that does not wait for them is wrong on a GPU whenever the copy lands
    first. The simulator computes them when issued, so the gradients come out right there;
    warpgroup.wgmma_wait's check must stop it (every thread reads every 16-byte chunk of the
    tiles, so the first thread to retire the chains sees its own copy in flight)."""
    from numba_kernels import flash_wgmma_bwd

    monkeypatch.setattr(flash_wgmma_bwd, "make_kv_gradients", _gradients_not_waited_for)
    flash_wgmma_bwd.wgmma_bwd_kernel.cache_clear()
    (q, k, v, dout), options = _inputs(1, 1, 1, 192, 64, 16, 16, "float16", {})  # 3 steps
    out, lse = flash_attention(q, k, v, return_lse=True, kernel="wgmma", **options)
    try:
        with pytest.raises(RuntimeError, match="before the group was waited for"):
            flash_attention_backward(q, k, v, out, lse, dout, kernel="wgmma", **options)
    finally:
        flash_wgmma_bwd.wgmma_bwd_kernel.cache_clear()


def _launched(monkeypatch, *args, **options):
    """The tensor-core backward kernels a call launches, as (kind, part, nonfinite)."""
    ran = []

    def record(kernel, spec, *a, **k):
        kind = "wgmma" if isinstance(spec, WgmmaBwdSpec) else type(spec).__name__
        ran.append((kind, getattr(spec, "part", None), getattr(spec, "nonfinite", False)))

    monkeypatch.setattr(backward, "launch", record)
    flash_attention_backward(*args, **options)
    return [r for r in ran if r[0] in ("wgmma", "MmaBwdSpec")]


def _small(dtype="float16", d=16):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 1, 10, d)).astype(dtype) for _ in range(4))
    out, lse = flash_attention(q, k, v, return_lse=True, kernel="simt")
    return q, k, v, out, lse, dout


@pytest.mark.skipif(hopper_why_not() is not None, reason=str(hopper_why_not()))
def test_it_launches_dkdv_on_wgmma_and_the_rest_on_mma_sync(monkeypatch):
    """dK/dV's and dQ's fast variants on wgmma; the blocks they defer (the nonfinite
    variants) on mma.sync's kernels."""
    assert _launched(monkeypatch, *_small(), kernel="wgmma") == [
        ("wgmma", "dkdv", False), ("MmaBwdSpec", "dkdv", True),
        ("wgmma", "dq", False), ("MmaBwdSpec", "dq", True)]
    assert _launched(monkeypatch, *_small())[0] == ("MmaBwdSpec", "dkdv", False)  # auto


def test_kernel_wgmma_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="kernel='wgmma': dtype float32"):
        flash_attention_backward(*_small("float32"), kernel="wgmma")
    with pytest.raises(ValueError, match="kernel='wgmma': head dims D=12"):
        flash_attention_backward(*_small(d=12), kernel="wgmma")
    with pytest.raises(ValueError, match="kernel must be one of"):
        flash_attention_backward(*_small(), kernel="wgmma2")


def test_query_tiles_are_64_rows_but_32_where_a_wide_dkdv_reads_a_mask():
    """ptxas spills dK/dV's 64-row masked variant at head dims above 64 (24 bytes at 255
    registers); dQ walks key tiles of 64; the gate compiles each variant at its own tiles."""
    tiles = {(s.part, s.d, s.dv, s.has_mask, s.full_tiles): s.tiles for s in wgmma_bwd_specs()}
    assert tiles[("dkdv", 128, 128, True, False)] == tiles[("dkdv", 64, 128, True, False)] \
        == (32, 64)
    assert tiles[("dkdv", 64, 64, True, False)] == tiles[("dkdv", 128, 128, False, False)] \
        == (64, 64)
    assert tiles[("dkdv", 128, 128, True, True)] == (64, 64)  # a block table: no mask read
    assert {t for (part, *_), t in tiles.items() if part == "dq"} == {(64, 64)}
    assert len(tiles) == 24 and len(wgmma_bwd_specs()) == 48  # float16 and bfloat16 each


@pytest.mark.skipif(hopper_why_not() is not None, reason=str(hopper_why_not()))
def test_autograd_after_a_wgmma_forward_runs_the_wgmma_backward(monkeypatch):
    torch = pytest.importorskip("torch")
    ran = []
    for name in backward.LAUNCHES:
        monkeypatch.setitem(backward.LAUNCHES, name, lambda *a, name=name: ran.append(name))
    device = "cpu" if SIMULATOR else "cuda"
    q = torch.zeros((1, 1, 8, 64), dtype=torch.float16, device=device, requires_grad=True)
    flash_attention(q, q, q, kernel="wgmma").sum().backward()
    assert ran == ["wgmma"]


# (B, Hq, Hk, Nq, Nk, D, Dv, dtype, options) on the GPU: the run of 2026-12-07 (H100) found
# every gradient bitwise the mma.sync backward's, causal, window, mask and block table alike
GPU_CASES = {
    "causal bottom_right, GQA 2:1": (1, 4, 2, 1000, 777, 64, 64, "float16",
                                     dict(causal="bottom_right")),
    "window, Dv != D": (1, 4, 4, 300, 700, 128, 64, "float16", dict(window=(100, 20))),
    "mask read, D 128 (query tiles of 32)": (1, 2, 2, 1024, 1024, 128, 128, "bfloat16",
                                             dict(mask="mask", causal="top_left")),
    "block table read as it is": (1, 2, 2, 1000, 1000, 128, 128, "bfloat16",
                                  dict(mask="blocks")),
}


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR or hopper_why_not() is not None,
                    reason="a Hopper GPU test" if SIMULATOR else str(hopper_why_not()))
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_on_a_hopper_gpu_the_wgmma_backward_is_the_mma_backward_bit_for_bit(name):
    """wgmma and mma.sync sum alike on the GPU too: the same gradients, bit for bit, so the
    wgmma pair recomputes its forward's scores as the mma.sync pair does (docs/findings.md,
    bug 10: a backward whose scores differ gives P far from exp(S - lse))."""
    torch = pytest.importorskip("torch")
    (q, k, v, dout), options = _inputs(*GPU_CASES[name])
    if "block_mask" in options:  # blocks of 128 here: 8 x 8 of them
        table = np.random.default_rng(1).random((1, 1, 8, 8)) < 0.3
        table[0, 0, np.arange(8), np.arange(8)] = True
        options.update(block_mask=table, block_size=128)
    dtype = getattr(torch, GPU_CASES[name][7])  # (NumPy's bfloat16 is not torch's)
    q, k, v, dout = (torch.from_numpy(x.astype(np.float32)).cuda().to(dtype)
                     for x in (q, k, v, dout))
    options = {n: torch.from_numpy(x).cuda() if isinstance(x, np.ndarray) else x
               for n, x in options.items()}
    out, lse = flash_attention(q, k, v, return_lse=True, kernel="wgmma", **options)
    want = flash_attention_backward(q, k, v, out, lse, dout, kernel="mma", **options)
    got = flash_attention_backward(q, k, v, out, lse, dout, kernel="wgmma", **options)
    for grad, x, y in zip(("dq", "dk", "dv"), want, got):
        assert torch.equal(x.view(torch.int16), y.view(torch.int16)), (
            grad, float((x.float() - y.float()).abs().max()))
