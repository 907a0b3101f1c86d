"""The forward on Hopper's warpgroup tensor cores (numba_kernels/flash_wgmma.py) in the
simulator, whose warpgroup.py emulates wgmma thread by thread: verify's cases, one per
feature, its refusals, and on an H100 or H200 the same cases and verify's suite
(scripts/gpu_verify.sh). The PTX gate (tests/test_ptx.py) compiles every variant for
sm_90a."""
from dataclasses import replace

import numpy as np
import pytest

import verify  # noqa: F401  (selects the simulator on a machine without a GPU)
from numba_kernels import flash_attention, kernel_plan
from numba_kernels.convert import SIMULATOR
from numba_kernels.plan import hopper_why_not
from verify.adapters import load
from verify.cases import Case, battery
from verify.runner import run_case

# together every feature the adapter claims, both dtypes, a V tile holding NaN (deferred to
# flash_mma's careful variant) and partial key tiles; WHOLE_TILE: whole tiles of 64 keys
CASES = [
    ("causal top_left 29x31", "float16"),
    ("mask per head + GQA", "bfloat16"),
    ("kv_lengths 0, 1, Nk", "float16"),
    ("v:nan in keys some rows see (window=(3, 2))", "bfloat16"),
    ("Dv != D", "float16"),
    ("bias per head (B, Hq, Nq, Nk)", "bfloat16"),
]
# 64 query rows and 130 keys: whole key tiles of 64 (interior, scaled alone), then 2 keys
WHOLE_TILE = Case("a whole query tile, no mask", B=1, Hq=1, Hk=1, Nq=64, Nk=130, D=64, Dv=64,
                  dtype="bfloat16")


def a_case(name, dtype):
    case = next((c for c in battery("quick", dtypes=(dtype,)) if c.name == name), WHOLE_TILE)
    return case if "kv_lengths" in name or not SIMULATOR else replace(case, B=1)


@pytest.mark.long
@pytest.mark.skipif(hopper_why_not() is not None, reason=str(hopper_why_not()))
@pytest.mark.parametrize("name,dtype", CASES + [(WHOLE_TILE.name, WHOLE_TILE.dtype)])
def test_the_wgmma_forward_passes_verify_cases(name, dtype):
    impl = load("numba-wgmma")
    case = a_case(name, dtype)
    claimed, why = impl.supports.claims(case)
    assert claimed, why
    result = run_case(impl, case, seed=3)
    assert result.verdict == "pass", result.detail


@pytest.mark.long
@pytest.mark.skipif(not SIMULATOR, reason="the simulator's wgmma; the GPU runs the cases above")
def test_a_v_transposed_wrongly_fails(monkeypatch):
    """V^T's core matrices from ldmatrix.trans: stored in the wrong order (the columns of
    one 8 x 8 piece swapped with the next's) the output is wrong, and verify says so."""
    from numba_kernels import flash_wgmma
    from numba_kernels.common import kernel_part

    make = flash_wgmma.make_transpose_v

    def swapped(DV, V_ROW):
        right = make(DV, V_ROW)

        @kernel_part
        def transpose_v(words, v_at, vt_at, lane, w):
            right(words, v_at, vt_at, lane, w)
            right(words, v_at, vt_at + 32, lane, w)  # each piece one core matrix on

        return transpose_v

    monkeypatch.setattr(flash_wgmma, "make_transpose_v", swapped)
    flash_wgmma.wgmma_kernel.cache_clear()
    try:
        result = run_case(load("numba-wgmma"), WHOLE_TILE, seed=3)
    finally:
        flash_wgmma.wgmma_kernel.cache_clear()
    assert result.verdict == "fail"


@pytest.mark.skipif(not SIMULATOR, reason="on a GPU the plan depends on the GPU")
def test_kernel_plan_names_wgmma_where_asked_and_why_not():
    q = np.zeros((1, 1, 8, 64), np.float16)
    plan = kernel_plan(q, q, q, kernel="wgmma")
    assert plan.kernel == "wgmma" and "careful" in plan.why
    assert kernel_plan(q, q, q).kernel == "mma"  # "auto" keeps mma.sync
    with pytest.raises(ValueError, match="dtype float32"):
        kernel_plan(q.astype(np.float32), q.astype(np.float32), q.astype(np.float32),
                    kernel="wgmma")
    with pytest.raises(ValueError, match="head dims"):
        flash_attention(np.zeros((1, 1, 8, 136), np.float16), np.zeros((1, 1, 8, 136),
                        np.float16), np.zeros((1, 1, 8, 136), np.float16), kernel="wgmma")


def test_only_a_hopper_gpu_runs_it(monkeypatch):
    """Off the simulator, a GPU whose compute capability is not 9.0 is named."""
    from numba import cuda

    from numba_kernels import convert, plan

    class Device:
        compute_capability = (8, 0)

    monkeypatch.setattr(convert, "SIMULATOR", False)
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "get_current_device", lambda: Device())
    assert "compute capability 9.0" in plan.hopper_why_not()
    assert "8.0" in plan.hopper_why_not()


@pytest.mark.skipif(hopper_why_not() is not None, reason=str(hopper_why_not()))
def test_autograd_refuses_it_while_it_has_no_backward():
    torch = pytest.importorskip("torch")
    device = "cpu" if SIMULATOR else "cuda"
    q = torch.zeros((1, 1, 8, 64), dtype=torch.float16, device=device, requires_grad=True)
    with pytest.raises(NotImplementedError, match="no backward yet"):
        flash_attention(q, q, q, kernel="wgmma")
