"""The tensor-core backward (numba_kernels/flash_mma_bwd.py) in the simulator, whose warp.py
emulates mma.sync, ldmatrix and cp.async lane by lane: verify's backward judgement of a few
small cases that together take every feature (the simulator runs 32 threads an instruction),
which kernel a call runs, and the tiles holding a NaN or an inf, which take the slow
products. The PTX
gate (tests/test_ptx.py) compiles every variant for sm_90; scripts/gpu_verify.sh
runs verify's whole backward suite on a GPU."""
import numpy as np
import pytest
from numba import cuda

import verify
from numba_kernels import backward, flash_attention, flash_attention_backward
from numba_kernels.convert import SIMULATOR
from numba_kernels.flash_mma_bwd import MmaBwdSpec, mma_bwd_specs
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
# a NaN in a key that some rows see (later rows) and others must not (causal): dq's flagged
# K tile; NaN in a row of Q and one of dO that some keys do not see: dkdv's flagged Q and dO
NAN_CASES = [Case(f"{poison} in keys or rows some see", B=1, Hq=1, Hk=1, Nq=20, Nk=20, D=16,
                  Dv=16, dtype="float16", causal="top_left", poison=poison, backward=True)
             for poison in ("k:nan", "q:nan,dout:nan")]


def _judge(cases):
    report = verify.compare(verify.builtin("numba-mma"), backward=True,
                            cases=[(c, i) for i, c in enumerate(cases)], progress=False)
    return report


@pytest.mark.long
@pytest.mark.skipif(not SIMULATOR, reason="scripts/gpu_verify.sh certifies it on a GPU")
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
    for name in backward.LAUNCHES:
        monkeypatch.setitem(backward.LAUNCHES, name, lambda *a, name=name: ran.append(name))
    flash_attention_backward(*args, **options)
    return ran


def test_auto_runs_the_tensor_core_kernels_for_16_bit_inputs(monkeypatch):
    q, k, v, out, lse, dout = _inputs()
    assert _kernel_run(monkeypatch, q, k, v, out, lse, dout) == ["mma"]
    k[0, 0, 3, 5] = np.nan  # flagged tiles are the kernels' own business
    assert _kernel_run(monkeypatch, q, k, v, out, lse, dout, kernel="mma") == ["mma"]


def test_auto_runs_the_tuned_kernels_where_the_tensor_cores_do_not_apply(monkeypatch):
    assert _kernel_run(monkeypatch, *_inputs("float32")) == ["tuned"]  # as the forward's auto
    assert _kernel_run(monkeypatch, *_inputs("float32", n=64)) == ["mma"]  # (a full tile)
    assert _kernel_run(monkeypatch, *_inputs("float32", n=64),
                       precision="high") == ["mma"]
    assert _kernel_run(monkeypatch, *_inputs("float32"), kernel="mma") == ["mma"]  # halves
    assert _kernel_run(monkeypatch, *_inputs(d=12)) == ["tuned"]
    mask = np.ones((10, 10), bool)
    assert _kernel_run(monkeypatch, *_inputs("float32", d=72), mask=mask) == ["tuned"]
    assert _kernel_run(monkeypatch, *_inputs("float32", d=64), mask=mask,
                       kernel="mma") == ["mma"]
    with pytest.raises(ValueError, match="kernel='mma': head dims D=12, Dv=12"):
        flash_attention_backward(*_inputs(d=12), kernel="mma")
    with pytest.raises(ValueError, match="kernel='mma': float32 with a mask or bias at head "
                                         "dims D=72"):
        flash_attention_backward(*_inputs("float32", d=72), mask=mask, kernel="mma")


def _parts_launched(monkeypatch, *args, **options):
    """The tensor-core backward kernels (part, nonfinite) a call launches (none run, nor the
    halves' pre-pass)."""
    launched = []
    monkeypatch.setattr(backward, "launch", lambda kernel, spec, *a, **k: launched.append(
        (spec.part, spec.nonfinite)) if isinstance(spec, MmaBwdSpec) else None)
    monkeypatch.setattr(backward, "halves_prepass", lambda io, named: (named, dict.fromkeys(
        ("q_flags", "k_flags", "dout_flags", "factors"))))
    flash_attention_backward(*args, kernel="mma", **options)
    return launched


def test_float32_makes_dk_and_dv_apart_where_dkdv_has_no_registers_for_dvs_sums(monkeypatch):
    """flash_mma_bwd.kv_parts: dV's step sums (halves.mma_halves_summed) spill in dkdv above
    head dims of 64, with a mask, or with every product summed (precision "highest"; float32
    only); the gate compiles what ships."""
    both = [(p, n) for p in ("dk", "dv", "dq") for n in (False, True)]
    mask = np.ones((10, 10), bool)
    wide, narrow = _inputs("float32", d=72), _inputs("float32", d=64)
    for precision in ("high", "highest"):
        assert _parts_launched(monkeypatch, *wide, precision=precision) == both
        assert _parts_launched(monkeypatch, *narrow, mask=mask, precision=precision) == both
    assert _parts_launched(monkeypatch, *narrow) == both
    assert _parts_launched(monkeypatch, *narrow, precision="high") == \
        [(p, n) for p in ("dkdv", "dq") for n in (False, True)]
    assert _parts_launched(monkeypatch, *_inputs("float16", d=72), mask=mask) == \
        [(p, n) for p in ("dkdv", "dq") for n in (False, True)]
    shipped = {(s.part, s.d, s.dv, s.has_mask, s.summed) for s in mma_bwd_specs()
               if getattr(s, "dtype", None) == "float32"}
    assert {("dk", 128, 128, False, False), ("dv", 64, 64, True, False),
            ("dkdv", 64, 64, False, False), ("dk", 64, 64, False, True)} <= shipped
    assert not {("dkdv", 128, 128, False, False), ("dkdv", 64, 64, True, False),
                ("dkdv", 64, 64, False, True)} & shipped


@pytest.mark.long
@pytest.mark.skipif(not SIMULATOR, reason="a simulator test")
@pytest.mark.parametrize("case", NAN_CASES, ids=[c.poison for c in NAN_CASES])
def test_a_hidden_nan_takes_the_slow_products_and_reaches_nothing(monkeypatch, case):
    """A NaN in a key some rows do not see (dq), or in a row of Q and of dO some keys do not
    see (dkdv): its tile is flagged and the products add only the pairs that take part.
    Without the flags mma.sync adds 0 * NaN for the pairs that take no part, and verify
    fails the call."""
    report = _judge([case])
    assert report.passed and report.cases[0].verdict == "pass", str(report)
    monkeypatch.setattr(backward, "flag_prepass", lambda io, pb, x: cuda.to_device(
        np.zeros((x.shape[0], x.shape[1], -(-x.shape[2] // 32)), np.uint8)))
    report = _judge([case])
    assert not report.passed and report.cases[0].verdict == "fail", str(report)
