"""The tensor-core backward (numba_kernels/flash_mma_bwd.py) in the simulator, whose warp.py
emulates mma.sync, ldmatrix and cp.async lane by lane: verify's backward judgement of a few
small cases that together take every feature (the simulator runs 32 threads an instruction),
which kernel a call runs, and why inputs holding a NaN or an inf must not reach it. The PTX
gate (tests/test_ptx.py) compiles every variant for sm_90; scripts/dev/gpu_mma_bwd_round.sh
runs verify's whole backward suite on a GPU."""
import numpy as np
import pytest

import verify
from numba_kernels import backward, flash_attention, flash_attention_backward
from numba_kernels.convert import SIMULATOR
from verify.cases import Case

CASES = [
    # GQA reduced over a group's query heads; Dv != D; bottom-right causal with Nq < Nk; 2 key
    # blocks of dkdv, the second partial
    Case("GQA 2:1, causal bottom_right, Dv != D", B=1, Hq=2, Hk=1, Nq=9, Nk=70, D=16, Dv=8,
         dtype="bfloat16", causal="bottom_right", backward=True),
    # mask, window and key counts: every element through masked_score
    Case("mask, window, kv_lengths", B=2, Hq=1, Hk=1, Nq=21, Nk=40, D=24, Dv=24,
         dtype="float16", mask="random", window=(6, 2), kv_lengths="random", backward=True),
    # whole tiles: dq's key tiles and dkdv's query tiles interior (scaled, not masked)
    Case("whole tiles", B=1, Hq=1, Hk=1, Nq=64, Nk=64, D=16, Dv=16, dtype="float16",
         backward=True),
]
# a NaN in a key that some rows see (later rows) and others must not (causal)
NAN_CASE = Case("k:nan in a key some rows see", B=1, Hq=1, Hk=1, Nq=20, Nk=20, D=16, Dv=16,
                dtype="float16", causal="top_left", poison="k:nan", backward=True)


def _judge(cases):
    report = verify.compare(verify.builtin("numba-mma"), backward=True,
                            cases=[(c, i) for i, c in enumerate(cases)], progress=False)
    return report


@pytest.mark.long
@pytest.mark.skipif(not SIMULATOR, reason="scripts/dev/gpu_mma_bwd_round.sh certifies it on a GPU")
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_mma_backward_passes_verify(case):
    report = _judge([case])
    assert report.passed and report.cases[0].verdict == "pass", str(report)


def _inputs(dtype="float16", n=10, d=16):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 1, n, d)).astype(dtype) for _ in range(4))
    out, lse = flash_attention(q, k, v, return_lse=True, kernel="simt")
    return q, k, v, out, lse, dout


def _kernel_run(monkeypatch, *args, **options):
    """The backward kernel flash_attention_backward runs for args (the kernels not run)."""
    ran = []
    for name in backward.KERNELS:
        monkeypatch.setitem(backward.KERNELS, name, lambda *a, name=name: ran.append(name))
    flash_attention_backward(*args, **options)
    return ran


@pytest.mark.parametrize("poisoned", [None, 0, 1, 2, 5])
def test_auto_runs_the_tensor_core_kernels_only_on_finite_inputs(monkeypatch, poisoned):
    q, k, v, out, lse, dout = _inputs()
    inputs = [q, k, v, out, lse, dout]
    if poisoned is not None:  # q, k, v or dout
        inputs[poisoned][0, 0, 3, 5] = np.inf if poisoned == 2 else np.nan
    want = ["mma"] if poisoned is None else ["tuned"]
    assert _kernel_run(monkeypatch, *inputs) == want
    assert _kernel_run(monkeypatch, *inputs, kernel="mma") == want


def test_auto_runs_the_tuned_kernels_where_the_tensor_cores_do_not_apply(monkeypatch):
    assert _kernel_run(monkeypatch, *_inputs("float32")) == ["tuned"]
    assert _kernel_run(monkeypatch, *_inputs(d=12)) == ["tuned"]
    with pytest.raises(ValueError, match="kernel='mma': head dims D=12, Dv=12"):
        flash_attention_backward(*_inputs(d=12), kernel="mma")
    with pytest.raises(ValueError, match="kernel='mma': dtype float32"):
        flash_attention_backward(*_inputs("float32"), kernel="mma")


@pytest.mark.long
@pytest.mark.skipif(not SIMULATOR, reason="a simulator test")
def test_a_hidden_nan_reaches_the_gradients_without_the_check(monkeypatch):
    """The reason for the check: mma.sync adds 0 * NaN for a pair that takes no part, so
    without the check verify fails the call (with it, the tuned kernels run, which verify's
    backward suite passes: tests/test_kernel_backward.py)."""
    monkeypatch.setattr(backward, "_finite", lambda *a: True)
    report = _judge([NAN_CASE])
    assert not report.passed and report.cases[0].verdict == "fail", str(report)
