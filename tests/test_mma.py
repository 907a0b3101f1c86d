"""The tensor-core kernel (numba_kernels/flash_mma.py) in the simulator, whose warp.py emulates
mma.sync, ldmatrix, shuffles and cp.async lane by lane: verify's cases, one per feature (the
simulator runs 32 threads an instruction: a few small cases only), and its refusals. The PTX
gate (tests/test_ptx.py) compiles every variant for sm_90."""
from dataclasses import replace

import numpy as np
import pytest

import verify  # noqa: F401  (selects the simulator on a machine without a GPU)
from numba_kernels import choose_spec, flash_attention, kernel_plan, mma_attention
from numba_kernels.convert import SIMULATOR
from verify.adapters import load
from verify.cases import Case, battery
from verify.runner import run_case

# (case, dtype): together every feature the adapter claims, both dtypes, a V tile holding NaN
# (the slow path), a partial key tile and a causal diagonal of two key tiles
CASES = [
    ("causal top_left 29x31", "float16"),
    ("mask per head + GQA", "bfloat16"),
    ("kv_lengths 0, 1, Nk", "float16"),
    ("v:nan in keys some rows see (window=(3, 2))", "bfloat16"),
    ("Dv != D", "float16"),
    ("bias per head (B, Hq, Nq, Nk)", "bfloat16"),
    ("ties", "float16"),  # causal over a whole query tile: its first warps see no key of
]                         # the second key tile, the last ones part of it


# 64 query rows, one whole tile: its first key tile is interior (scaled, not masked), the
# second (8 keys) is not
WHOLE_TILE = Case("a whole query tile, no mask", B=1, Hq=1, Hk=1, Nq=64, Nk=40, D=16, Dv=16,
                  dtype="float16")


@pytest.mark.long
@pytest.mark.skipif(not SIMULATOR, reason="scripts/gpu_verify.sh certifies it on the GPU")
@pytest.mark.parametrize("name,dtype", CASES + [(WHOLE_TILE.name, WHOLE_TILE.dtype)])
def test_mma_kernel_passes_verify_cases(name, dtype):
    impl = load("numba-mma")
    case = next((c for c in battery("quick", dtypes=(dtype,)) if c.name == name), WHOLE_TILE)
    if "kv_lengths" not in name:  # one batch element: half the simulator's blocks
        case = replace(case, B=1)
    claimed, why = impl.supports.claims(case)
    assert claimed, why
    result = run_case(impl, case, seed=3)
    assert result.verdict == "pass", result.detail


@pytest.mark.long
@pytest.mark.skipif(not SIMULATOR, reason="scripts/gpu_verify.sh certifies it on the GPU")
def test_a_block_whose_rows_end_non_finite_is_done_again_by_the_careful_variant(monkeypatch):
    """V holds NaN in keys some rows see and others do not: the fast variant adds 0 * NaN for
    the pairs that take no part, so it defers the block to the careful variant, which takes
    the slow path where a V tile holds a NaN (test_mma_kernel_passes_verify_cases: the case
    passes). When no block is deferred (acc_finite stood in by one that finds every row
    finite) verify fails it."""
    from numba_kernels import flash_mma
    from numba_kernels.common import kernel_part

    def never_again(VB):
        return kernel_part(lambda acc: True)

    monkeypatch.setattr(flash_mma, "make_acc_finite", never_again)
    flash_mma.mma_kernel.cache_clear()
    try:
        name = "v:nan in keys some rows see (window=(3, 2))"
        case = next(c for c in battery("quick", dtypes=("bfloat16",)) if c.name == name)
        result = run_case(load("numba-mma"), replace(case, B=1), seed=3)
    finally:
        flash_mma.mma_kernel.cache_clear()
    assert result.verdict == "fail" and "non-finite" in result.detail, result.detail


@pytest.mark.parametrize("dtype,D,masked,phrase", [
    ("float32", 128, True, "float32 with a mask or bias at head dims D=128"),
    ("float16", 12, False, "head dims D=12"),
    ("float16", 136, False, "head dims D=136"),
])
def test_mma_kernel_names_what_it_does_not_take(dtype, D, masked, phrase):
    q = np.zeros((1, 1, 4, D), dtype)
    mask = np.ones((4, 4), bool) if masked else None
    with pytest.raises(ValueError, match=phrase):
        mma_attention(q, q, q, mask=mask)


def test_flash_attention_takes_the_kernel_by_name():
    q = np.zeros((1, 1, 4, 16), np.float32)
    with pytest.raises(ValueError, match="kernel must be one of .*, got 'tensor'"):
        flash_attention(q, q, q, kernel="tensor")
    with pytest.raises(ValueError, match="kernel='mma': float32 with a mask or bias"):
        w = np.zeros((1, 1, 4, 72), np.float32)
        flash_attention(w, w, w, kernel="mma", bias=np.zeros((4, 4), np.float32))
    h = q.astype(np.float16)
    with pytest.raises(ValueError, match="a spec"):
        flash_attention(h, h, h, kernel="mma", spec=choose_spec(16, 16, "float16", False))


@pytest.mark.parametrize("dtype,D,options,want,phrase", [
    ("float16", 64, {}, "mma", "16-bit inputs"),
    ("bfloat16", 128, dict(causal="top_left"), "mma", "16-bit inputs"),
    ("float32", 64, {}, "simt", "fewer than 64 query rows (decoding)"),
    ("float32", 64, dict(precision="high"), "simt", "fewer than 64 query rows (decoding)"),
    ("float32", 72, dict(mask=np.ones((4, 4), bool), precision="high"), "simt",
     "float32 with a mask"),
    ("float32", 64, dict(mask=np.ones((4, 4), bool), precision="high"), "simt",
     "float32 with a mask or bias takes the tensor cores only"),
    ("float16", 40 + 1, {}, "simt", "head dims D=41"),
    ("float16", 256, {}, "simt", "up to 128"),
    ("float16", 64, dict(num_splits=3), "mma", "16-bit inputs"),
    ("float16", 64, dict(spec=choose_spec(64, 64, "float16", False)), "simt", "a spec"),
])
def test_auto_takes_the_tensor_core_kernel_where_it_applies_and_says_why_not(
        dtype, D, options, want, phrase):
    from reference.dtypes import numpy_dtype
    q = np.zeros((1, 1, 4, D), numpy_dtype(dtype))
    kernel, why, precision = kernel_plan(q, q, q, kernel="auto", **options)
    assert kernel == want and phrase in why, (kernel, why)
    assert precision == options.get("precision", "highest") if kernel == "mma" and \
        dtype == "float32" else precision == "highest"


def test_float32_takes_the_tensor_cores_at_either_precision_summed_at_highest():
    """float32 takes the tensor cores as float16 halves (halves.py) where verify certifies
    the pair: no mask or bias, 64 query rows or more (plan.float32_why_not); at "highest"
    (the default) the variants that sum each step's products apart, at "high" mma.sync's
    own sums. The precision is the plan's, and kernel="mma" runs at the one asked for."""
    q = np.zeros((1, 2, 64, 72), np.float32)
    assert kernel_plan(q, q, q) == (
        "mma", "float32 inputs it takes, as float16 halves (precision 'highest': each "
        "step's products summed apart)", "highest")
    assert kernel_plan(q, q, q, precision="high") == (
        "mma", "float32 inputs it takes, as float16 halves (precision 'high': mma.sync's own "
        "sums)", "high")
    for precision in ("highest", "high"):
        assert kernel_plan(q[:, :, :63], q, q, precision=precision)[0] == "simt"
        assert kernel_plan(q, q, q, bias=np.zeros((64, 64), np.float32),
                           precision=precision)[0] == "simt"
        assert kernel_plan(q, q, q, kernel="mma", precision=precision)[::2] == (
            "mma", precision)
    assert kernel_plan(q, q, q, kernel="mma")[::2] == ("mma", "highest")
    with pytest.raises(ValueError, match="precision must be one of"):
        kernel_plan(q, q, q, precision="medium")


def test_torch_tensors_take_torchs_float32_matmul_precision():
    torch = pytest.importorskip("torch")
    q = torch.zeros((1, 2, 64, 72))
    before = torch.get_float32_matmul_precision()
    try:
        for setting, want in (("highest", "highest"), ("high", "high"), ("medium", "high")):
            torch.set_float32_matmul_precision(setting)
            assert kernel_plan(q, q, q)[::2] == ("mma", want), setting
            assert kernel_plan(q, q, q, precision="highest").precision == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_default_takes_the_tensor_core_kernel_for_decoding_too(monkeypatch):
    """One query row against many keys: the tensor-core kernel splits the keys across the SMs
    itself (split-KV), so the default need not fall back."""
    from numba_kernels import forward
    monkeypatch.setattr(forward, "sm_count", lambda: 132)  # an H200 (the simulator says 1)
    q, k = np.zeros((2, 8, 1, 128), np.float16), np.zeros((2, 8, 32768, 128), np.float16)
    plan = kernel_plan(q, k, k)  # (on a Hopper GPU the why goes on to name wgmma)
    assert plan.kernel == "mma" and plan.why.startswith("16-bit inputs it takes")


@pytest.mark.skipif(not SIMULATOR, reason="scripts/gpu_verify.sh certifies it on the GPU")
def test_mma_split_kv_equals_one_range():
    """Three key ranges, one block each (partials in float32, merged by lse), against one
    range: the same within float32 rounding. Causal from the top left with Nq = 3 leaves the
    second and third ranges no visible key: they must add nothing."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 1, 3, 16)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, 70, 16)).astype(np.float16) for _ in range(2))
    whole, whole_lse = mma_attention(q, k, v, causal="top_left", return_lse=True,
                                     num_splits=1)
    out, lse = mma_attention(q, k, v, causal="top_left", return_lse=True, num_splits=3)
    np.testing.assert_allclose(out.astype(np.float32), whole.astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not SIMULATOR, reason="scripts/gpu_verify.sh certifies it on the GPU")
def test_mma_split_kv_defers_a_split_whose_rows_end_non_finite():
    """Split-KV's partial variants take the careful one too: V holds NaN at key 2, which
    (causal from the top left, Nq = 3) row 2 sees and rows 0 and 1 do not. The first of two
    key ranges defers its block (0 * NaN in rows 0 and 1), the careful variant redoes it, and
    after the merge row 2 alone is NaN, rows 0 and 1 as the reference's."""
    import reference

    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 1, 3, 16)).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, 40, 16)).astype(np.float16) for _ in range(2))
    v[0, 0, 2, 5] = np.nan
    out = mma_attention(q, k, v, causal="top_left", num_splits=2).astype(np.float32)
    want = reference.attention(q, k, v, causal="top_left")
    assert np.isnan(out[0, 0, 2]).any() and np.isfinite(out[0, 0, :2]).all(), out
    np.testing.assert_allclose(out[0, 0, :2], want[0, 0, :2], atol=2e-3)


@pytest.mark.skipif(not SIMULATOR, reason="scripts/gpu_verify.sh certifies it on the GPU")
def test_the_careful_variant_redoes_the_deferred_blocks_of_every_batch_and_head():
    """The careful variant takes the grid in its own order (blockIdx: tile, batch * head),
    not the fast one's: V holds NaN at key 2 in heads (0, 1) and (1, 2) of (B, H) = (2, 3),
    which row 2 sees and rows 0 and 1 do not (causal from the top left). Those two blocks
    are deferred and redone; the others are the fast variant's. Every row as the
    reference's, NaN exactly in row 2 of those heads. (With batch and head decoded the other
    way round in the careful variant it fails: checked once.)"""
    import reference

    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 3, 3, 16)).astype(np.float16)
    k, v = (rng.standard_normal((2, 3, 40, 16)).astype(np.float16) for _ in range(2))
    v[0, 1, 2, 5] = v[1, 2, 2, 5] = np.nan
    out = mma_attention(q, k, v, causal="top_left", num_splits=1).astype(np.float32)
    want = reference.attention(q, k, v, causal="top_left")
    nan_rows = np.isnan(want).any(axis=-1)
    assert nan_rows.sum() == 2 and nan_rows[0, 1, 2] and nan_rows[1, 2, 2]
    assert np.array_equal(np.isnan(out).any(axis=-1), nan_rows), out
    np.testing.assert_allclose(out[~nan_rows], want[~nan_rows], atol=2e-3)


@pytest.mark.skipif(not SIMULATOR, reason="scripts/gpu_verify.sh certifies it on the GPU")
@pytest.mark.parametrize("dtype,exponent", [("float16", 0x7C00), ("bfloat16", 0x7F80)])
def test_the_pre_pass_flags_exactly_the_tiles_holding_nan_or_inf(dtype, exponent):
    """The backward's nonfinite_tiles over x (1, 2, 33, 8) as 16-bit patterns (33 rows: a tile
    and one row): inf in a word's high value, NaN in a low one, -inf in the one-row tile; the
    largest finite values and a subnormal elsewhere must not be flagged."""
    from numba import cuda
    from numba_kernels.flash_mma_bwd import SCAN_THREADS, ScanSpec, scan_kernel
    from numba_kernels.mma_parts import FLAG_ROWS
    bits = np.full((1, 2, 33, 8), exponent - 1, np.uint16)  # the largest finite value
    bits[0, 1, 5, 3] = 1  # a subnormal
    cases = {(0, 0, 7, 7): exponent, (0, 1, 0, 0): exponent | 0x40,  # inf, NaN
             (0, 1, 32, 2): exponent | 0x8000}  # -inf, in the second tile
    for at, pattern in cases.items():
        bits[at] = pattern
    flags = cuda.to_device(np.full((1, 2, 2), 7, np.uint8))
    words = cuda.to_device(bits.view(np.int32).reshape(-1))
    scan_kernel(ScanSpec(dtype))[(2, 2), SCAN_THREADS](words, flags, 33, 4)
    expected = np.zeros((1, 2, 2), np.uint8)
    for b, h, key, _ in cases:
        expected[b, h, key // FLAG_ROWS] = 1
    np.testing.assert_array_equal(flags.copy_to_host(), expected)


def test_precision_high_never_trades_the_range():
    """float16 halves with one scale per tensor hold a row only down to 2^-16 of the
    tensor's largest value, and tensors whose largest lies within 2^-48 .. 2^48: past that
    "auto" runs the SIMT kernel and "mma" refuses, saying which row of which tensor."""
    q = np.ones((1, 2, 64, 72), np.float32)
    k = q.copy()
    k[0, 1] *= 2.0**-20
    plan = kernel_plan(q, k, k, precision="high")
    assert plan.kernel == "simt" and plan.precision == "highest"
    assert "row 0 of (batch 0, head 1) of k holds values 2^20 below the tensor's largest" \
        in plan.why
    with pytest.raises(ValueError, match="kernel='mma': float32 at precision 'high'"):
        kernel_plan(q, k, k, kernel="mma", precision="high")
    k[0, 1] = 2.0**-15  # within the range
    assert kernel_plan(q, k, k, precision="high").kernel == "mma"
    k[0, 1] = 0.0  # zeros are exact
    k[0, 0, 0, 0] = np.nan  # and a NaN does not count
    assert kernel_plan(q, k, k, precision="high").kernel == "mma"
    v = q.copy()
    v[0, 0, 5] = 2.0**-17  # one key's values
    assert "row 5 of (batch 0, head 0) of v" in kernel_plan(q, q, v, precision="high").why
    for top in (2.0**-50, 2.0**50):  # the scales' products would leave float32's range
        assert "outside the 2^-48 .. 2^48" in kernel_plan(q * top, q, q, precision="high").why


def test_precision_highest_keeps_rows_within_2_to_the_12():
    """At "highest" a row's largest value may lie 2^12 below its tensor's largest on the
    halves (plan.HALVES_RANGE: past that their error grows past a float32 kernel's), at
    "high" 2^16: between the two the default runs the SIMT kernel and "high" the halves."""
    q = np.ones((1, 2, 64, 72), np.float32)
    k = q.copy()
    k[0, 1] = 2.0**-13
    plan = kernel_plan(q, k, k)
    assert plan == ("simt", "the tensor-core kernel does not apply: float32 at precision "
                    "'highest': row 0 of (batch 0, head 1) of k holds values 2^13 below the "
                    "tensor's largest, past the 2^12 that float16 halves with one scale per "
                    "tensor hold at that precision (halves.py)", "highest")
    assert kernel_plan(q, k, k, precision="high").kernel == "mma"
    with pytest.raises(ValueError, match="kernel='mma': float32 at precision 'highest'"):
        kernel_plan(q, k, k, kernel="mma")
    k[0, 1] = 2.0**-12
    assert kernel_plan(q, k, k) == ("mma", "float32 inputs it takes, as float16 halves "
                                    "(precision 'highest': each step's products summed "
                                    "apart)", "highest")


@pytest.mark.skipif(not SIMULATOR, reason="scripts/gpu_verify.sh certifies it on the GPU")
def test_precision_high_passes_heads_far_apart_and_the_halves_alone_do_not(monkeypatch):
    """Two heads 2^40 apart (q up, k down: the scores unchanged): what precision="high" runs
    passes verify's rule per head; forced onto the halves (the range check taken out), the
    small head is lost."""
    from numba_kernels import api, plan

    case = Case("heads 2^40 apart", B=1, Hq=2, Hk=2, Nq=16, Nk=16, D=16, Dv=16,
                dtype="float32", values="heads-held")
    impl = load("numba-mma-backward")
    assert run_case(impl, case, seed=0).verdict == "pass"
    monkeypatch.setattr(plan, "halves_range_why_not", lambda named, precision: None)
    monkeypatch.setattr(impl, "fn", lambda q, k, v, **options: api.flash_attention(
        q, k, v, kernel="mma", precision="high", **options))
    result = run_case(impl, case, seed=0)
    assert result.verdict == "fail" and "mismatched" in result.detail, result.detail


def test_the_range_check_reads_back_two_numbers_a_tensor_in_one_copy(monkeypatch):
    """halves_range_why_not keeps torch's row maxima in torch (on the device on a GPU) and
    brings back each tensor's largest and smallest row maximum, for all its tensors in one
    copy (each copy waits for the device), and the first row past the range only where it
    refuses; the same answers as NumPy's."""
    torch = pytest.importorskip("torch")
    from numba_kernels import plan
    from numba_kernels.plan import first_below, row_extremes, row_maxima

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 40, 8)).astype(np.float32)
    x[1, 2, 7] *= 2.0**-20
    x[0, 0, 3, 1] = np.inf
    x[0, 1, 5, 2], x[1, 0, 9, 0] = -np.inf, np.nan
    x[1, 1, 11] = [np.nan, -np.inf, np.inf, 0, 0, 0, 0, 0]
    top = row_maxima(torch.from_numpy(x))
    assert isinstance(top, torch.Tensor) and top.shape == (2, 3, 40)
    empty = np.zeros((1, 2, 0), np.float32)
    found = row_extremes([top, top[:, :, :7], torch.from_numpy(empty)])
    assert found == row_extremes([row_maxima(x), row_maxima(x)[:, :, :7], empty])
    (largest, lowest), _, nothing = found
    assert largest == np.abs(x[np.isfinite(x)]).max() and nothing == (0.0, np.inf)
    assert lowest == np.abs(x[1, 2, 7]).max()  # the all-zero row 11 does not count
    for rows in (top, row_maxima(x)):
        first, value = first_below(rows, largest * 2.0**-16)
        assert first == np.ravel_multi_index((1, 2, 7), (2, 3, 40)) and value == lowest
        assert first_below(rows, largest * 2.0**-30) is None
    copies = []
    monkeypatch.setattr(plan, "row_extremes",
                        lambda tops: copies.append(len(tops)) or row_extremes(tops))
    named = {name: torch.from_numpy(x) for name in ("q", "k", "v")}
    assert "row 7 of (batch 1, head 2) of q" in plan.halves_range_why_not(named, "high")
    x[1, 2, 7] *= 2.0**6  # 2^14 below now: within 2^16, past 2^12
    assert plan.halves_range_why_not(named, "high") is None
    assert "row 7 of (batch 1, head 2) of q" in plan.halves_range_why_not(named, "highest")
    assert copies == [3, 3, 3]
