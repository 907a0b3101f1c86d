"""The float64 reference against hand-worked values, a plain-loop oracle, and itself (tiled)."""
import math
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import reference as R
from tests.loops import loop_attention

CAUSAL = [False, "top_left", "bottom_right"]


def rand(rng, *shape):
    return rng.standard_normal(shape)


def qkv(rng, B=1, Hq=2, Hk=1, Nq=5, Nk=7, D=4, Dv=None):
    return rand(rng, B, Hq, Nq, D), rand(rng, B, Hk, Nk, D), rand(rng, B, Hk, Nk, Dv or D)


def assert_same(a, b, rtol=1e-12, what=""):
    """Equal up to rtol (relative to the largest magnitude), NaN and inf in the same places."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    fa, fb = np.isfinite(a), np.isfinite(b)
    assert (fa == fb).all(), f"{what}: non-finite at different places"
    assert (a[~fa].astype(str) == b[~fb].astype(str)).all(), f"{what}: different non-finite values"
    if fa.any():
        err = np.max(np.abs(a[fa] - b[fb])) / max(1.0, np.max(np.abs(b[fb])))
        assert err <= rtol, f"{what}: relative difference {err:.3g} > {rtol}"


# ---------------------------------------------------------------- values worked out by hand
def test_one_query_two_keys_by_hand():
    # scores (scale 1): q.k0 = 0, q.k1 = ln 3 -> weights 1/4, 3/4
    q = np.array([[[[1.0]]]])
    k = np.array([[[[0.0], [math.log(3.0)]]]])
    v = np.array([[[[2.0, 0.0], [6.0, 4.0]]]])
    out, lse = R.attention(q, k, v, scale=1.0, return_lse=True)
    np.testing.assert_allclose(out[0, 0, 0], [0.25 * 2 + 0.75 * 6, 0.75 * 4], rtol=1e-15)
    np.testing.assert_allclose(lse[0, 0, 0], math.log(1 + 3), rtol=1e-15)


def test_causal_alignments_by_hand():
    # Nq=2, Nk=3, every score 0: rows average the values of the keys they see.
    q = np.zeros((1, 1, 2, 1))
    k = np.zeros((1, 1, 3, 1))
    v = np.array([1.0, 2.0, 4.0]).reshape(1, 1, 3, 1)
    top = R.attention(q, k, v, causal="top_left")[0, 0, :, 0]
    bottom = R.attention(q, k, v, causal="bottom_right")[0, 0, :, 0]
    np.testing.assert_allclose(top, [1.0, 1.5])  # row 0 sees {0}, row 1 sees {0, 1}
    np.testing.assert_allclose(bottom, [1.5, 7 / 3])  # row 0 sees {0, 1}, row 1 sees all


def test_fully_masked_row_is_zero_with_lse_minus_inf():
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, Nq=3, Nk=4)
    mask = np.ones((3, 4), bool)
    mask[1] = False
    for fn in (R.attention, R.attention_tiled):
        out, lse = fn(q, k, v, mask=mask, return_lse=True)
        assert (out[:, :, 1] == 0).all() and (lse[:, :, 1] == -np.inf).all()
        assert np.isfinite(out).all()


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)], ids=["Nq=0", "Nk=0", "both=0"])
def test_empty_sequences(shape):
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, Nq=shape[0], Nk=shape[1], Dv=3)
    for fn in (R.attention, R.attention_tiled, R.attention_lowp):
        out, lse = fn(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
                      return_lse=True)
        assert out.shape == (1, 2, shape[0], 3) and lse.shape == (1, 2, shape[0])
        assert (out == 0).all() and (lse == -np.inf).all()


# ---------------------------------------------------- every feature against the loop oracle
FEATURES = {
    "plain": {},
    "causal-top-left": dict(causal="top_left"),
    "causal-bottom-right": dict(causal="bottom_right"),
    "window-2-1": dict(window=(2, 1)),
    "window-0-0": dict(window=(0, 0)),
    "window-left-unbounded-causal": dict(window=(-1, 3), causal="top_left"),
    "kv-lengths": dict(kv_lengths=np.array([0, 1, 9])),
    "kv-lengths-causal": dict(kv_lengths=np.array([3, 9, 5]), causal="bottom_right"),
    "mask-per-head": "mask4",
    "mask-row-broadcast": "mask2",
    "bias-with-inf": "bias",
    "everything": "all",
    "scale": dict(scale=0.3),
}


def feature_kwargs(name, rng, B, Hq, Nq, Nk):
    spec = FEATURES[name]
    if not isinstance(spec, str):
        return dict(spec)
    mask4 = rng.random((B, Hq, Nq, Nk)) < 0.6
    bias = rand(rng, 1, Hq, Nq, Nk)
    bias[rng.random(bias.shape) < 0.2] = -np.inf
    return {
        "mask4": dict(mask=mask4),
        "mask2": dict(mask=rng.random((Nq, Nk)) < 0.5),
        "bias": dict(bias=bias),
        "all": dict(mask=mask4, bias=bias, causal="top_left", window=(4, -1),
                    kv_lengths=np.array([Nk, 2, Nk - 1])),
    }[spec]


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("nq,nk", [(6, 9), (9, 6), (1, 9), (9, 1)],
                         ids=["Nq<Nk", "Nq>Nk", "Nq=1", "Nk=1"])
def test_against_loop_oracle(feature, nq, nk):
    rng = np.random.default_rng(zlib.crc32(f"{feature}{nq}{nk}".encode()))
    B, Hq, Hk = 3, 4, 2
    q, k, v = qkv(rng, B, Hq, Hk, nq, nk, D=3, Dv=2)
    kw = feature_kwargs(feature, rng, B, Hq, nq, nk)
    if "kv_lengths" in kw:
        kw["kv_lengths"] = np.minimum(kw["kv_lengths"], nk)
    want_out, want_lse = loop_attention(q, k, v, **kw)
    for fn in (R.attention, R.attention_tiled):
        out, lse = fn(q, k, v, return_lse=True, **kw)
        assert_same(out, want_out, 1e-13, f"{fn.__name__} out")
        assert_same(lse, want_lse, 1e-13, f"{fn.__name__} lse")


# ------------------------------------------------------------------- tiled against naive
BLOCK = 8
AWKWARD = [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 1, 13, 31]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_tiled_equals_naive(data):
    draw = data.draw
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    nq = draw(st.sampled_from(AWKWARD), label="Nq")
    nk = draw(st.sampled_from(AWKWARD + [0]), label="Nk")
    hk = draw(st.sampled_from([1, 2]), label="Hk")
    group = draw(st.sampled_from([1, 3]), label="G")
    d, dv = draw(st.sampled_from([(1, 1), (5, 5), (4, 7)]), label="D, Dv")
    B = 2
    q, k, v = qkv(rng, B, hk * group, hk, nq, nk, d, dv)
    kw = dict(causal=draw(st.sampled_from(CAUSAL), label="causal"))
    if draw(st.booleans(), label="window"):
        kw["window"] = (draw(st.integers(-1, 5), label="left"),
                        draw(st.integers(-1, 5), label="right"))
    if draw(st.booleans(), label="mask"):
        kw["mask"] = rng.random((B, 1, nq, nk)) < draw(st.sampled_from([0.1, 0.7]), label="p")
    if draw(st.booleans(), label="kv_lengths"):
        kw["kv_lengths"] = rng.integers(0, nk + 1, B)
    want = R.attention(q, k, v, return_lse=True, **kw)
    got = R.attention_tiled(q, k, v, return_lse=True, BLOCK_M=BLOCK, BLOCK_N=BLOCK, **kw)
    assert_same(got[0], want[0], 1e-12, "out")
    assert_same(got[1], want[1], 1e-12, "lse")


def test_naive_chunking_does_not_change_results(monkeypatch):
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, 2, 4, 2, 37, 29, 8)
    kw = dict(causal="bottom_right", mask=rng.random((37, 29)) < 0.8, return_lse=True)
    whole = R.attention(q, k, v, **kw)
    import reference.naive

    monkeypatch.setattr(reference.naive, "CHUNK_ELEMS", 29 * 2 * 3)  # 3 rows a block
    chunked = R.attention(q, k, v, **kw)
    assert_same(chunked[0], whole[0], 1e-14)
    assert_same(chunked[1], whole[1], 1e-14)


# --------------------------------------------------------------------------------- lse, merge
def test_lse_is_the_logsumexp_of_scaled_scores():
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, 1, 2, 2, 5, 11, 6)
    _, lse = R.attention(q, k, v, scale=0.7, return_lse=True)
    s = np.einsum("bhid,bhjd->bhij", q, k) * 0.7
    direct = np.log(np.exp(s).sum(-1))
    np.testing.assert_allclose(lse, direct, rtol=1e-14)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_merge_of_any_split_equals_whole(data):
    draw = data.draw
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    nk = draw(st.integers(1, 20), label="Nk")
    cuts = sorted(draw(st.lists(st.integers(0, nk), max_size=3), label="cuts"))
    causal = draw(st.sampled_from(CAUSAL), label="causal")
    q, k, v = qkv(rng, 1, 2, 1, 6, nk, 3)
    whole = R.attention(q, k, v, causal=causal, return_lse=True)
    parts = []
    for j0, j1 in zip([0] + cuts, cuts + [nk]):
        # The keys outside [j0, j1) are hidden by a mask, so alignment stays that of the whole.
        keep = np.zeros((6, nk), bool)
        keep[:, j0:j1] = True
        parts.append(R.attention(q, k, v, causal=causal, mask=keep, return_lse=True))
    order = draw(st.permutations(range(len(parts))), label="order")
    merged = R.merge(*(parts[i] for i in order))
    assert_same(merged[0], whole[0], 1e-13, "out")
    assert_same(merged[1], whole[1], 1e-13, "lse")


def test_merge_rejects_mismatched_parts():
    with pytest.raises(ValueError, match="equal shapes"):
        R.merge((np.zeros((2, 3)), np.zeros(2)), (np.zeros((3, 3)), np.zeros(3)))


def test_command_line_help_and_self_check(capsys):
    from reference.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "usage: python -m reference" in capsys.readouterr().out
    assert main([]) == 0 and "reference self-check: passed" in capsys.readouterr().out


def test_sampled_rows_equal_the_whole():
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, 2, 4, 2, 37, 41, 8, 5)
    mask = rng.random((2, 1, 37, 41)) < 0.7
    bias = rng.standard_normal((1, 4, 37, 41))
    rows = [0, 5, 6, 20, 36]
    for options in (dict(), dict(causal="bottom_right", mask=mask, bias=bias),
                    dict(window=(3, 2), kv_lengths=np.array([10, 41]))):
        out, lse = R.attention(q, k, v, return_lse=True, **options)
        part, part_lse = R.attention(q, k, v, return_lse=True, rows=rows, **options)
        assert_same(part, out[:, :, rows], 0)
        assert_same(part_lse, lse[:, :, rows], 0)
    with pytest.raises(ValueError, match="rows must be increasing"):
        R.attention(q, k, v, rows=[3, 2])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), st.integers(1, 9), st.integers(1, 9),
       st.sampled_from([0.0, 0.3, 0.9, 1.0]), st.integers(0, 2**31))
def test_tile_classes_say_which_tiles_hold_visible_pairs(n_q, n_k, block_m, block_n, p, seed):
    """reference.blocks.tile_classes against a loop over the tiles: SKIP where no pair of a
    tile is visible, FULL where every pair inside the plane is, PARTIAL between (edge tiles
    judged on their pairs inside the plane)."""
    from reference.blocks import FULL, PARTIAL, SKIP, tile_classes

    keep = np.random.default_rng(seed).random((2, n_q, n_k)) < p
    classes = tile_classes(keep, block_m, block_n)
    assert classes.shape == (2, -(-n_q // block_m), -(-n_k // block_n))
    assert classes.dtype == np.uint8
    for b, i, j in np.ndindex(classes.shape):
        tile = keep[b, i * block_m:(i + 1) * block_m, j * block_n:(j + 1) * block_n]
        want = FULL if tile.all() else PARTIAL if tile.any() else SKIP
        assert classes[b, i, j] == want, (b, i, j, tile)


def test_tile_classes_refuse_what_they_cannot_read():
    from reference.blocks import tile_classes

    with pytest.raises(TypeError, match="keep must be a boolean array"):
        tile_classes(np.ones((4, 4)), 2, 2)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="block_n must be a positive integer"):
            tile_classes(np.ones((4, 4), bool), 2, bad)


class _GradTensor:
    """Stands in for a torch CUDA tensor that requires grad: asked for
    __cuda_array_interface__, it raises RuntimeError (not AttributeError)."""

    def __init__(self, base):
        self.base = base
        self.shape, self.is_cuda = base.shape, True

    def data_ptr(self):
        return self.base.__array_interface__["data"][0]

    def stride(self):
        return tuple(s // self.base.itemsize for s in self.base.strides)

    def element_size(self):
        return self.base.itemsize

    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")


def test_overlaps_finds_shared_bytes_and_never_asks_a_tensor_for_its_cuda_interface():
    from reference.memory import on_device, overlaps

    x = np.zeros((4, 6))
    assert overlaps(x[1:3], x[2:]) and not overlaps(x[:2], x[2:]) and not overlaps(x, x.copy())
    assert overlaps(x[:, ::2], x[:, 1::2])  # interleaved columns: spans cross (a bound, not exact)
    a, b = _GradTensor(x[:2]), _GradTensor(x[1:])
    assert on_device(a) and not on_device(x)
    assert overlaps(a, b) and not overlaps(a, x[1:])  # device and host: different spaces
