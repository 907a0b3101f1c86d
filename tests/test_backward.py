"""The float64 gradients (reference/backward.py, tiled_backward.py, lowp.py) against central
differences of the forward, across every contract feature, and the contract's rules for
hidden keys and rows that see no key."""
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from tests.test_reference import FEATURES, assert_same, feature_kwargs, qkv

B, HQ, HK, D, DV = 2, 4, 2, 3, 2


def problem(name, nq=5, nk=6):
    rng = np.random.default_rng(zlib.crc32(f"bwd{name}{nq}{nk}".encode()))
    q, k, v = qkv(rng, B, HQ, HK, nq, nk, D, DV)
    kw = feature_kwargs(name, rng, B, HQ, nq, nk)
    if "kv_lengths" in kw:
        kw["kv_lengths"] = np.minimum(kw["kv_lengths"][:B], nk)
    return q, k, v, rng.standard_normal((B, HQ, nq, DV)), kw


def numeric_gradient(fn, x, h=1e-6):
    """Central differences of the scalar fn() in each finite element of x (changed in place
    and restored); elements that are -inf (hidden by a bias) get 0."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        if not np.isfinite(x[idx]):
            continue
        keep = x[idx]
        x[idx] = keep + h
        up = fn()
        x[idx] = keep - h
        down = fn()
        x[idx] = keep
        grad[idx] = (up - down) / (2 * h)
    return grad


@pytest.mark.parametrize("feature", list(FEATURES))
def test_gradients_match_central_differences(feature):
    q, k, v, dout, kw = problem(feature)
    loss = lambda: float((R.attention(q, k, v, **kw) * dout).sum())  # noqa: E731
    want = [numeric_gradient(loss, x) for x in (q, k, v)]
    got = R.attention_backward(q, k, v, dout, **kw)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == np.float64
        np.testing.assert_allclose(g, w, atol=1e-7, rtol=1e-6, err_msg=name)
    if "bias" in kw:
        bias = kw["bias"]
        *_, dbias = R.attention_backward(q, k, v, dout, return_dbias=True, **kw)
        assert dbias.shape == bias.shape
        np.testing.assert_allclose(dbias, numeric_gradient(loss, bias), atol=1e-7, rtol=1e-6)
        assert (dbias[bias == -np.inf] == 0).all()


@pytest.mark.parametrize("shape", [(1, HQ, 5, 6), (5, 6), (B, 1, 1, 6)])
def test_dbias_is_summed_over_broadcast_dimensions(shape):
    q, k, v, dout, _ = problem("plain")
    bias = np.random.default_rng(1).standard_normal(shape)
    loss = lambda: float((R.attention(q, k, v, bias=bias) * dout).sum())  # noqa: E731
    *_, dbias = R.attention_backward(q, k, v, dout, bias=bias, return_dbias=True)
    np.testing.assert_allclose(dbias, numeric_gradient(loss, bias), atol=1e-7, rtol=1e-6)


AWKWARD = [1, 3, 4, 5, 9, 13]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_tiled_backward_equals_naive(data):
    nq, nk = data.draw(st.sampled_from(AWKWARD)), data.draw(st.sampled_from(AWKWARD))
    feature = data.draw(st.sampled_from(list(FEATURES)))
    q, k, v, dout, kw = problem(feature, nq, nk)
    block_m, block_n = data.draw(st.sampled_from([1, 2, 4])), data.draw(st.sampled_from([1, 3, 4]))
    want = R.attention_backward(q, k, v, dout, **kw)
    got = R.attention_backward_tiled(q, k, v, dout, BLOCK_M=block_m, BLOCK_N=block_n, **kw)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_same(g, w, 1e-12, name)


def test_backward_chunking_does_not_change_results(monkeypatch):
    from reference import naive

    q, k, v, dout, kw = problem("everything", 9, 7)
    want = R.attention_backward(q, k, v, dout, **kw)
    monkeypatch.setattr(naive, "CHUNK_ELEMS", 5)  # one row of the group a block
    for g, w in zip(R.attention_backward(q, k, v, dout, **kw), want):
        assert_same(g, w, 1e-14)


def test_hidden_values_reach_no_gradient_and_empty_rows_give_none():
    """Hidden keys (past kv_lengths, masked) hold NaN and inf, and rows that see no key have
    a NaN dout: every gradient stays finite, hidden keys get dk = dv = 0, empty rows dq = 0."""
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, 2, 2, 1, 6, 8, 3, 2)
    dout = rng.standard_normal((2, 2, 6, 2))
    lengths = np.array([5, 8])
    mask = rng.random((2, 1, 6, 8)) < 0.6
    mask[:, :, 2] = False  # row 2 sees no key
    mask[1, :, :, 6] = False  # key 6 of batch 1 is seen by no row
    k[0, :, 5:], v[0, :, 5:] = np.nan, np.inf
    k[1, :, 6], v[1, :, 6] = np.inf, np.nan
    dout[:, :, 2] = np.nan
    opts = dict(mask=mask, kv_lengths=lengths)
    for fn in (R.attention_backward, R.attention_backward_tiled):
        dq, dk, dv = fn(q, k, v, dout, **opts)
        assert all(np.isfinite(g).all() for g in (dq, dk, dv)), fn.__name__
        assert (dk[0, :, 5:] == 0).all() and (dv[0, :, 5:] == 0).all()
        assert (dk[1, :, 6] == 0).all() and (dv[1, :, 6] == 0).all()
        assert (dq[:, :, 2] == 0).all()
    clean_k, clean_v = np.nan_to_num(k, posinf=0.0, nan=0.0), np.nan_to_num(v, nan=0.0,
                                                                          posinf=0.0)
    for g, w in zip(R.attention_backward(q, k, v, dout, **opts),
                    R.attention_backward(q, clean_k, clean_v, np.nan_to_num(dout), **opts)):
        assert_same(g, w, 1e-14)


def test_minus_inf_scores_act_as_masked_keys_in_every_gradient():
    """Key 2 holds -inf and every row's q has a positive first column: its scores are -inf.
    The contract: such a key behaves as a masked one. (0 * -inf in dQ, or a -inf put back at
    a visible key of zero weight, is not the gradient: found by verify against the bundled
    kernel on the H200.) And a NaN row (row 1, a NaN q) reaches no key it does not see."""
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, 1, 1, 1, 5, 6, 4, 3)
    dout = rng.standard_normal((1, 1, 5, 3))
    q[..., 0] = np.abs(q[..., 0]) + 0.1
    k[0, 0, 2, 0] = -np.inf
    masked = np.ones((5, 6), bool)
    masked[:, 2] = False
    clean_k = np.where(np.isfinite(k), k, 0.0)
    for fn in (R.attention_backward, R.attention_backward_tiled):
        for g, w in zip(fn(q, k, v, dout), fn(q, clean_k, v, dout, mask=masked)):
            assert_same(g, w, 1e-14)
        q_nan = q.copy()
        q_nan[0, 0, 1] = np.nan  # row 1 sees keys 0 and 1 (top-left causal)
        dq, dk, dv = fn(q_nan, clean_k, v, dout, causal="top_left")
        assert np.isnan(dq[0, 0, 1]).all() and np.isnan(dv[0, 0, :2]).all()
        assert np.isfinite(dk[0, 0, 2:]).all() and np.isfinite(dv[0, 0, 2:]).all(), fn.__name__
    v_inf = v.copy()
    v_inf[0, 0, 2] = np.inf  # the forward likewise: the key's values reach no row
    for fn in (R.attention, R.attention_tiled):
        assert_same(fn(q, k, v_inf), fn(q, clean_k, v, mask=masked), 1e-14)


def test_a_seen_nan_reaches_the_gradients_it_takes_part_in():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, 1, 1, 1, 4, 5, 3, 2)
    dout = rng.standard_normal((1, 1, 4, 2))
    v[0, 0, 3, 1] = np.nan  # seen by rows 3.. under top-left causal
    dq, dk, dv = R.attention_backward(q, k, v, dout, causal="top_left")
    assert np.isfinite(dq[0, 0, :3]).all() and np.isnan(dq[0, 0, 3]).all()
    assert np.isfinite(dv[0, 0, 4]).all() and np.isnan(dk[0, 0, :4]).any()


@pytest.mark.parametrize("dtype, worst", [("float32", 1e-5), ("float16", 2e-2),
                                          ("bfloat16", 1.5e-1)])
def test_low_precision_emulation_errs_like_its_dtype(dtype, worst):
    from reference.dtypes import cast

    rng = np.random.default_rng(9)
    q, k, v = (cast(x, dtype) for x in qkv(rng, 1, 2, 1, 33, 40, 16, 8))
    dout = cast(rng.standard_normal((1, 2, 33, 8)), dtype)
    truth = R.attention_backward(q, k, v, dout, causal="bottom_right")
    plain = R.attention_backward_lowp(q, k, v, dout, causal="bottom_right")
    unrounded = R.attention_backward_lowp(q, k, v, dout, causal="bottom_right", round_p=False)
    for t, p, u in zip(truth, plain, unrounded):
        assert p.dtype == np.float32 and p.shape == t.shape
        err = np.abs(p - t).max() / np.abs(t).max()
        assert 0 < err < worst, err
        if dtype != "float32":
            assert not np.array_equal(p, u)  # rounding P and dS is part of the emulation


def test_backward_argument_errors():
    q, k, v, dout, _ = problem("plain")
    with pytest.raises(ValueError, match=r"dout must have the output's shape"):
        R.attention_backward(q, k, v, dout[..., :1])
    with pytest.raises(ValueError, match="return_dbias=True needs a bias"):
        R.attention_backward(q, k, v, dout, return_dbias=True)
    with pytest.raises(TypeError, match="dout must be"):
        R.attention_backward(q, k, v, dout.tolist())
