"""The contract's edges: argument errors, non-finite inputs, and the low-precision emulation."""
import numpy as np
import pytest

import reference as R
from reference.contract import key_range
from reference.dtypes import EPS
from tests.loops import sees
from tests.test_reference import assert_same, qkv

IMPLS = [R.attention, R.attention_tiled]


# ------------------------------------------------------------------------------ bad input
def good(**over):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, 2, 4, 2, 3, 5, 4, 6)
    args = dict(q=q, k=k, v=v)
    args.update(over)
    return args


BAD = {
    "q-3d": (dict(q=np.zeros((4, 3, 4))), ValueError, r"q must have 4 dimensions \(B, Hq, Nq, D\)"),
    "k-batch": (dict(k=np.zeros((3, 2, 5, 4))), ValueError, "batch sizes differ"),
    "k-head-dim": (dict(k=np.zeros((2, 2, 5, 3))), ValueError, "k must have head dim D=4"),
    "v-length": (dict(v=np.zeros((2, 2, 4, 6))), ValueError, r"v must have \(Hk, Nk\)=\(2, 5\)"),
    "gqa-ratio": (dict(k=np.zeros((2, 3, 5, 4)), v=np.zeros((2, 3, 5, 6))), ValueError,
                  "Hq=4 must be a multiple of key heads Hk=3"),
    "int-dtype": (dict(q=np.zeros((2, 4, 3, 4), int)), TypeError, "q must have a dtype in"),
    "mixed-dtype": (dict(q=np.zeros((2, 4, 3, 4), np.float16)), TypeError, "share one dtype"),
    "list": (dict(q=[[1.0]]), TypeError, "q must be an array"),
    "causal-true": (dict(causal=True), ValueError, "top_left.*bottom_right"),
    "causal-typo": (dict(causal="bottom-right"), ValueError, "causal must be one of"),
    "mask-float": (dict(mask=np.ones((3, 5))), TypeError, "mask must be boolean"),
    "mask-shape": (dict(mask=np.ones((3, 4), bool)), ValueError,
                   r"mask of shape \(3, 4\) does not broadcast to \(B, Hq, Nq, Nk\)"),
    "bias-shape": (dict(bias=np.ones((2, 2, 3, 5))), ValueError, "bias of shape"),
    "lengths-shape": (dict(kv_lengths=np.array([5])), ValueError, r"kv_lengths must be .*\(2,\)"),
    "lengths-range": (dict(kv_lengths=np.array([5, 6])), ValueError, r"lie in \[0, Nk=5\]"),
    "lengths-float": (dict(kv_lengths=np.array([5.0, 1.0])), ValueError, "integer array"),
    "window-neg": (dict(window=(-2, 0)), ValueError, "window left must be >= 0, or -1"),
    "window-bad": (dict(window=3), TypeError, "window must be a pair"),
    "scale-str": (dict(scale="1"), TypeError, "scale must be a real number"),
    "scale-bool": (dict(scale=True), TypeError, "scale must be a real number"),
    "scale-complex": (dict(scale=1j), TypeError, "scale must be a real number"),
    "causal-zero": (dict(causal=0.0), ValueError, "causal must be one of"),
    "causal-one": (dict(causal=1), ValueError, "causal must be one of"),
    "window-floats": (dict(window=(1.5, 2.7)), TypeError, "window must be a pair"),
    "window-str": (dict(window="12"), TypeError, "window must be a pair"),
    "window-bools": (dict(window=(True, False)), TypeError, "window must be a pair"),
    "return-lse-str": (dict(return_lse="no"), TypeError, "return_lse must be True or False"),
    "scale-nan": (dict(scale=float("nan")), ValueError, "scale must be a finite number"),
    "mask-list": (dict(mask=[[True] * 5] * 3), TypeError, "mask must be a boolean array"),
    "bias-list": (dict(bias=[[0.0] * 5] * 3), TypeError, "bias must be a float array"),
    "lengths-list": (dict(kv_lengths=[5, 5]), TypeError, "kv_lengths must be an integer array"),
    "scale-inf": (dict(scale=-float("inf")), ValueError, "scale must be a finite number"),
}


@pytest.mark.parametrize("fn", IMPLS + [R.attention_lowp], ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_argument(fn, case):
    over, err, pattern = BAD[case]
    args = good(**over)
    if fn is R.attention_lowp and case not in ("int-dtype",):
        args = {n: a.astype(np.float32) if n in "qkv" and hasattr(a, "astype")
                and a.dtype == np.float64 else a for n, a in args.items()}
    with pytest.raises(err, match=pattern):
        fn(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_rows_are_integer_indices():
    args = good()
    for rows in ("ab", [0.0, 1.0], 3):
        with pytest.raises(TypeError, match="rows must be a sequence of integer"):
            R.attention(args["q"], args["k"], args["v"], rows=rows)


def test_gradients_refuse_a_complex_dout_and_a_flag_that_is_not_a_bool():
    args = good()
    q, k, v = args["q"], args["k"], args["v"]
    dout = np.ones(q.shape[:3] + (v.shape[3],))
    with pytest.raises(TypeError, match="dout must be a real float array"):
        R.attention_backward(q, k, v, dout.astype(complex))
    with pytest.raises(TypeError, match="return_dbias must be True or False"):
        R.attention_backward(q, k, v, dout, bias=np.zeros((3, 5)), return_dbias="no")


@pytest.mark.parametrize("fn", IMPLS, ids=lambda f: f.__name__)
def test_legal_inputs_of_other_spellings_give_the_same_answer(fn):
    """A NumPy scalar scale, NumPy integers in a window, big-endian arrays: taken, and the
    same answer as the plain spelling."""
    args = good()
    q, k, v = args["q"], args["k"], args["v"]
    want = fn(q, k, v, scale=0.5, window=(1, 2))
    got = fn(q.astype(">f8"), k.astype(">f8"), v.astype(">f8"), scale=np.float32(0.5),
             window=(np.int64(1), np.int32(2)))
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)


# ------------------------------------------------------------- the band is the oracle's band
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("window", [None, (0, 0), (2, -1), (-1, 3), (1, 2)])
def test_key_range_matches_definition(causal, window):
    from reference.contract import _normalise_window

    left, right = _normalise_window(window)
    right = 0 if causal else right
    bottom_right = causal == "bottom_right" or (not causal and window is not None)
    for n_q in (1, 4, 9):
        for kv_len in (0, 1, 4, 9):
            for i in range(n_q):
                lo, hi = key_range(i, n_q, kv_len, left, right, bottom_right)
                got = [lo <= j < hi for j in range(12)]
                want = [sees(i, j, n_q, kv_len, causal, window) for j in range(12)]
                assert got == want, (i, n_q, kv_len)


# ------------------------------------------------------------------------ non-finite inputs
def poisoned(rng, where, value):
    """Inputs with `value` planted at `where` = (tensor, b, h, row) and a mask hiding key 2
    from every row and all keys from query row 3."""
    q, k, v = qkv(rng, 1, 2, 1, 5, 6, 4)
    mask = np.ones((5, 6), bool)
    mask[:, 2] = False
    mask[3] = False
    t, *idx = where
    {"q": q, "k": k, "v": v}[t][tuple(idx)] = value
    return q, k, v, mask


@pytest.mark.parametrize("fn", IMPLS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", [("k", 0, 0, 2), ("v", 0, 0, 2), ("q", 0, 1, 3)],
                         ids=["masked-key", "masked-value", "fully-masked-query"])
def test_invisible_non_finite_changes_nothing(fn, value, where):
    rng = np.random.default_rng(3)
    q, k, v, mask = poisoned(rng, where, value)
    clean = poisoned(np.random.default_rng(3), where, 0.0)
    got = fn(q, k, v, mask=mask, return_lse=True)
    want = fn(*clean[:3], mask=mask, return_lse=True)
    assert_same(got[0], want[0], 0, "out")
    assert_same(got[1], want[1], 0, "lse")


@pytest.mark.parametrize("fn", IMPLS, ids=lambda f: f.__name__)
def test_nan_reaches_exactly_the_rows_it_takes_part_in(fn):
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, 1, 2, 1, 5, 6, 4, 3)
    causal = "top_left"  # key j is seen by rows i >= j
    k1 = k.copy()
    k1[0, 0, 2, 1] = np.nan
    out, lse = fn(q, k1, v, causal=causal, return_lse=True)
    rows_nan = np.isnan(out).all(-1)[0, 0]
    assert rows_nan.tolist() == [False, False, True, True, True]
    assert np.isnan(lse[0, :, 2:]).all() and np.isfinite(lse[0, :, :2]).all()
    v1 = v.copy()
    v1[0, 0, 4, 2] = np.nan  # one value element: only output column 2 of rows 4..
    out, lse = fn(q, k, v1, causal=causal, return_lse=True)
    assert np.isnan(out[0, :, 4, 2]).all()
    assert np.isfinite(np.delete(out[0, :, :, :], 2, axis=-1)).all()
    assert np.isfinite(out[0, :, :4]).all() and np.isfinite(lse).all()
    q1 = q.copy()
    q1[0, 1, 0, 0] = np.nan
    out, _ = fn(q1, k, v, causal=causal, return_lse=True)
    assert np.isnan(out[0, 1, 0]).all() and np.isfinite(out[0, 0]).all()
    assert np.isfinite(out[0, 1, 1:]).all()


def test_inf_value_gives_inf_not_nan():
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, 1, 1, 1, 2, 3, 2)
    v[0, 0, 1, 0] = np.inf
    out = R.attention(q, k, v)
    assert (out[0, 0, :, 0] == np.inf).all() and np.isfinite(out[0, 0, :, 1]).all()


def test_minus_inf_bias_is_a_mask():
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, 1, 1, 1, 3, 4, 2)
    bias = np.zeros((3, 4))
    bias[:, 1] = -np.inf
    bias[2] = -np.inf
    v[0, 0, 1] = np.nan
    mask = bias != -np.inf
    for fn in IMPLS:
        a = fn(q, k, v, bias=bias, return_lse=True)
        b = fn(q, k, v, mask=mask, return_lse=True)
        assert_same(a[0], b[0], 0)
        assert_same(a[1], b[1], 0)
        assert (a[0][0, 0, 2] == 0).all() and a[1][0, 0, 2] == -np.inf


@pytest.mark.parametrize("fn", IMPLS, ids=lambda f: f.__name__)
def test_scale_zero_and_negative(fn):
    """scale = 0: every visible key weighs the same (the mean of the visible values); a
    negative scale is the softmax of the negated scores. Masks still apply after scaling."""
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, 1, 1, 1, 4, 6, 3, 2)
    out, lse = fn(q, k, v, scale=0.0, causal="top_left", return_lse=True)
    for i in range(4):
        assert_same(out[0, 0, i], v[0, 0, :i + 1].mean(axis=0), 1e-14)
        assert lse[0, 0, i] == pytest.approx(np.log(i + 1))
    neg = fn(q, k, v, scale=-0.5, causal="top_left")
    pos = fn(-q, k, v, scale=0.5, causal="top_left")
    assert_same(neg, pos, 1e-13)


# ------------------------------------------------------------------- low-precision emulation
def test_round_to_bfloat16_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(
        -40, 38, 10000), np.array([0.0, -0.0, np.inf, -np.inf, 3.3895314e38, 1e-45], np.float32)])
    # Ties: the 16 dropped bits exactly 0x8000, kept part odd and even.
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000], np.uint32).view(np.float32)
    x = np.concatenate([x, ties])
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    got = R.round_to(x, "bfloat16")
    assert (got.view(np.uint32) == want.view(np.uint32)).all()
    assert np.isnan(R.round_to(np.array([np.nan], np.float32), "bfloat16")).all()


def test_round_to_float16_is_round_to_nearest_even():
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65520.0], np.float32)  # two ties, one overflow
    assert R.round_to(x, "float16").tolist() == [1.0, 1 + 2**-9, np.inf]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_lowp_error_is_at_the_dtype_resolution(dtype):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(8)
    q, k, v = (x.astype(np_dtype) for x in qkv(rng, 2, 2, 2, 33, 65, 16))
    want = R.attention(q, k, v, causal="bottom_right")
    got = R.attention_lowp(q, k, v, causal="bottom_right")
    eps = EPS[dtype]
    err = np.abs(got - want).max()
    assert err <= 4 * eps * np.abs(want).max(), err
    assert err > 0  # it really is low precision: it cannot be the float64 path in disguise
