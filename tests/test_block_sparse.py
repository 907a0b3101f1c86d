"""Block sparsity in the kernels (numba_kernels/block_sparse.py): the pre-passes class a
mask's tiles and list the visible ones as reference/blocks.py does, and the forward and
backward kernels walk those lists: a SKIP tile is not visited, a FULL tile's mask is not
read."""
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import verify  # noqa: F401  (selects the simulator on a machine without a GPU)
import reference
from numba_kernels import backward, flash_attention, flash_attention_backward, forward
from numba_kernels.arrays import begin, block_table, side_inputs
from numba_kernels.flash_mma_bwd import MmaBwdSpec
from numba_kernels.plan import kernel_plan
from numba_kernels.prepass import class_prepass, fit_blocks, list_prepass
from reference.blocks import (FULL, PARTIAL, SKIP, block_mask_visible, tile_classes,
                              visible_lists)
from reference.contract import block_pair


def _host(x):
    return x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.sampled_from([(16, 16), (64, 32), (32, 32)]),
       st.sampled_from(["batch", "head", "shared", "keys"]), st.integers(0, 2**31))
def test_the_prepass_classes_tiles_as_the_reference_does(n_q, n_k, tiles, shape, seed):
    """On the device, at a kernel's tile sizes, for masks of every broadcast form: the
    reference's classes, batch and head dimensions the mask's own."""
    rng = np.random.default_rng(seed)
    b, h = 2, 3
    mask_shape = {"batch": (b, 1, n_q, n_k), "head": (b, h, n_q, n_k),
                  "shared": (1, 1, n_q, n_k), "keys": (b, 1, 1, n_k)}[shape]
    blocks = rng.random(mask_shape[:2] + (-(-mask_shape[2] // 4), -(-n_k // 4))) < 0.4
    mask = blocks.repeat(4, axis=2).repeat(4, axis=3)[:, :, :mask_shape[2], :n_k]
    mask[..., :1, :1] = rng.random() < 0.5  # a ragged corner now and then
    q = np.zeros((b, h, n_q, 8), np.float32)
    k = v = np.zeros((b, h, n_k, 8), np.float32)
    pb, io, _, _ = begin(q, k, v, None, False, mask, None, None, None)
    mask_dev, _, _, steps = side_inputs(io, pb, mask, None, None)
    classes = class_prepass(io, pb, mask_dev, steps["mask_steps"], True, *tiles)
    got = _host(classes)
    want = tile_classes(np.broadcast_to(mask, mask_shape[:2] + (n_q, n_k)), *tiles)
    assert got.shape == want.shape and (got == want).all(), (got, want)
    for transposed in (False, True):  # by query tile; by key tile (the dK, dV kernel's)
        lists = _host(list_prepass(io, classes, transposed))
        wanted = visible_lists(np.swapaxes(want, -1, -2) if transposed else want)
        assert lists.shape == wanted.shape
        for index in np.ndindex(*wanted.shape[:-1]):  # the count, that many tiles, the sentinel
            n = wanted[index][0]
            assert (lists[index][:2 + n] == wanted[index][:2 + n]).all(), (index, lists, wanted)


@pytest.mark.parametrize("tiles_m,tiles_n", [(5, 70), (67, 3), (1, 32), (33, 1)])
def test_the_list_prepass_lists_long_rows_and_columns(tiles_m, tiles_n):
    """Rows and columns of classes longer than a warp's 32 lanes (a warp a list, 32 classes a
    ballot): the reference's lists, by row and by column."""
    rng = np.random.default_rng(tiles_m * 100 + tiles_n)
    classes = rng.choice(np.array([SKIP, PARTIAL, FULL], np.uint8), (2, 3, tiles_m, tiles_n),
                         p=[0.5, 0.25, 0.25])
    classes[0, 0] = SKIP  # an empty list beside full ones
    classes[0, 1] = FULL
    q = np.zeros((1, 1, 1, 8), np.float32)
    _, io, _, _ = begin(q, q, q, None, False, None, None, None, None)
    for transposed in (False, True):
        got = _host(list_prepass(io, io.dev(classes), transposed))
        want = visible_lists(np.swapaxes(classes, -1, -2) if transposed else classes)
        assert got.shape == want.shape
        for index in np.ndindex(*want.shape[:-1]):
            n = want[index][0]
            assert (got[index][:2 + n] == want[index][:2 + n]).all(), (index, got, want)


@pytest.mark.parametrize("kernel,dtype", [("simt", "float32"), ("mma", "float16")])
def test_the_forward_kernels_skip_and_trust_the_classes(monkeypatch, kernel, dtype):
    """With the true classes the masked result; with every tile SKIP nothing is visited (zeros,
    lse -inf); with every tile FULL no mask is read (the unmasked result), but a bias still
    is: the kernels walk the classes, they do not merely receive them."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 64, 16)).astype(dtype) for _ in range(3))
    mask = rng.random((1, 1, 64, 64)) < 0.5  # every tile partly visible
    true = forward.class_prepass

    def run(fill=None, bias=None):
        def classes(io, pb, mask_dev, mask_steps, has_mask, block_m, block_n, blocks=None):
            got = true(io, pb, mask_dev, mask_steps, has_mask, block_m, block_n, blocks)
            if fill is not None:
                got = io.dev(np.full(_host(got).shape, fill, np.uint8))
            return got

        monkeypatch.setattr(forward, "class_prepass", classes)
        return flash_attention(q, k, v, mask=mask, bias=bias, kernel=kernel, return_lse=True)

    def close(got, want):
        return np.allclose(np.asarray(got, np.float64), want, atol=2e-3, rtol=2e-3)

    masked = reference.attention(q.astype(np.float64), k.astype(np.float64),
                                 v.astype(np.float64), mask=mask)
    plain = reference.attention(q.astype(np.float64), k.astype(np.float64),
                                v.astype(np.float64))
    out, _ = run()
    assert close(out, masked) and not close(out, plain)
    out, lse = run(SKIP)
    assert (np.asarray(out) == 0).all() and np.isneginf(np.asarray(lse)).all()
    out, _ = run(FULL)
    assert close(out, plain) and not close(out, masked)
    bias = rng.standard_normal((1, 1, 64, 64)).astype(np.float32)
    biased = reference.attention(q.astype(np.float64), k.astype(np.float64),
                                 v.astype(np.float64), bias=bias)
    out, _ = run(FULL, bias)
    assert close(out, biased) and not close(out, plain)


@pytest.mark.long
@pytest.mark.parametrize("kernel,dtype", [("mma", np.float16), ("tuned", np.float32)])
def test_the_backward_kernels_skip_and_trust_the_classes(monkeypatch, kernel, dtype):
    """The dQ and dK, dV kernels walk their lists (by query tile; by key tile, across a
    group's heads): with the true classes the masked gradients, with every tile SKIP zeros,
    with every tile FULL the unmasked gradients (no mask read), a bias still read there."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 64, 16)).astype(dtype)
    k, v = (rng.standard_normal((1, 1, 64, 16)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal((1, 2, 64, 16)).astype(dtype)
    mask = rng.random((1, 2, 64, 64)) < 0.5  # per head: each head its own lists
    mask[:, 1, 16:48] = False  # head 1: whole query tiles that no key sees
    true = backward.class_prepass

    def run(fill=None, bias=None):
        """The gradients from the backward with `mask` and its classes (every one `fill`
        where given), after the forward that `fill` asks for (FULL: without the mask)."""
        def classes(io, pb, mask_dev, mask_steps, has_mask, block_m, block_n, blocks=None):
            got = true(io, pb, mask_dev, mask_steps, has_mask, block_m, block_n, blocks)
            if fill is not None:
                got = io.dev(np.full(_host(got).shape, fill, np.uint8))
            return got

        seen = None if fill == FULL else mask  # the forward's (the reference's: exact)
        out, lse = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), mask=seen,
                                       bias=bias, return_lse=True)
        out, lse = out.astype(q.dtype), lse.astype(np.float32)
        monkeypatch.setattr(backward, "class_prepass", classes)
        got = flash_attention_backward(q, k, v, out, lse, dout, mask=mask, bias=bias,
                                       kernel=kernel)
        monkeypatch.setattr(backward, "class_prepass", true)
        return [np.asarray(g, np.float64) for g in got]

    def want(**sides):
        return reference.attention_backward(*(x.astype(np.float64) for x in (q, k, v, dout)),
                                            **sides)

    def close(got, wanted):
        return all(np.allclose(g, w, atol=3e-2, rtol=3e-2) for g, w in zip(got, wanted))

    masked, plain = want(mask=mask), want()
    got = run()
    assert close(got, masked) and not close(got, plain)
    assert all((g == 0).all() for g in run(SKIP))
    got = run(FULL)
    assert close(got, plain) and not close(got, masked)
    bias = rng.standard_normal((1, 1, 64, 64)).astype(np.float32)
    got = run(FULL, bias)
    assert close(got, want(bias=bias)) and not close(got, plain)


@pytest.mark.parametrize("n_k,offset,words", [(36, 0, True), (37, 0, False), (36, 1, False)])
def test_the_prepass_reads_words_of_four_keys_where_it_can(n_k, offset, words):
    """A mask whose keys are a multiple of 4 and 4-byte aligned is read as int32 words
    (prepass.mask_words), else a byte a load: the same classes either way, against the
    reference, with tiles whose rows and keys end partway."""
    from numba_kernels.prepass import mask_words

    rng = np.random.default_rng(n_k + offset)
    b, h, n_q = 2, 3, 45
    bytes_ = (rng.random(b * n_q * n_k + offset) < 0.8).astype(np.uint8)
    bytes_[offset::7] = 0  # a hidden pair now and then: PARTIAL tiles beside FULL ones
    mask = bytes_[offset:].reshape(b, 1, n_q, n_k).view(bool)
    mask[1] = True  # batch 1: FULL tiles, a SKIP one, and PARTIAL ones by one pair each,
    mask[1, 0, 32:, :16] = False  # at each of the four bytes of a word in turn
    for at, (i, j) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        mask[1, 0, 16 * i + 3, 16 * j + at] = False
    q = np.zeros((b, h, n_q, 8), np.float32)
    k = v = np.zeros((b, h, n_k, 8), np.float32)
    pb, io, _, _ = begin(q, k, v, None, False, mask, None, None, None)
    mask_dev, _, _, steps = side_inputs(io, pb, mask, None, None)
    if offset:  # the device copy of a host array is aligned: shift it on the device
        wide = io.dev(bytes_.reshape(1, 1, 1, -1))
        mask_dev = wide[:, :, :, offset:].reshape(b, 1, n_q, n_k)
    assert (mask_words(mask_dev, n_k) is not None) == words
    got = _host(class_prepass(io, pb, mask_dev, steps["mask_steps"], True, 16, 16))
    want = tile_classes(np.broadcast_to(mask, (b, 1, n_q, n_k)), 16, 16)
    assert (got == want).all() and {SKIP, FULL} <= set(np.unique(got)), (got, want)


@settings(max_examples=6, deadline=None)
@given(st.integers(1, 150), st.integers(1, 150), st.sampled_from([(64, 32), (32, 64)]),
       st.sampled_from([(64, 64), (128, 64), (64, 192)]), st.booleans(), st.integers(0, 2**31))
def test_a_block_table_classes_tiles_as_its_mask_would(n_q, n_k, tiles, size, masked, seed):
    """From a block table alone (blocks holding whole tiles), and with a mask beside it: the
    reference's classes of the boolean mask the table stands for."""
    rng = np.random.default_rng(seed)
    b, h = 2, 3
    blocks = rng.random((1, h, -(-n_q // size[0]), -(-n_k // size[1]))) < 0.5
    mask = rng.random((b, h, n_q, n_k)) < 0.9 if masked else None
    q = np.zeros((b, h, n_q, 8), np.float16)
    k = v = np.zeros((b, h, n_k, 8), np.float16)
    pb, io, _, _ = begin(q, k, v, None, False, mask, None, None, None, blocks, size)
    table = block_table(io, pb, blocks, size, masked)
    mask_dev, _, _, steps = side_inputs(io, pb, mask, None, None)
    mask_dev, steps, table = fit_blocks(io, pb, mask_dev, steps, table, [tiles])
    assert table is not None  # read from the table, not written out
    got = _host(class_prepass(io, pb, mask_dev, steps["mask_steps"], True, *tiles, table))
    keep = block_mask_visible(blocks, size, n_q, n_k) & (True if mask is None else mask)
    want = tile_classes(keep, *tiles)
    assert (got == np.broadcast_to(want, got.shape)).all(), (got, want)


BLOCK_CASES = {  # name: (block_size, table shape's batch and heads, mask's, kernel)
    "table": ((64, 64), (1, 2), None, "mma"),  # classed from the table, no mask read, the
    # table's heads not the mask's: every tile FULL, the variant that reads no mask (full_tiles)
    "table, wgmma": ((64, 64), (1, 2), None, "wgmma"),  # its full_tiles variant too
    "table and mask": ((64, 64), (1, 2), (1, 2), "mma"),  # the mask's classes: read
    "written out": (16, (2, 1), (1, 2), "simt"),  # blocks smaller than the tiles
}


@pytest.mark.parametrize("name", BLOCK_CASES)
def test_a_block_mask_gives_its_masks_bits(name, monkeypatch):
    """flash_attention(block_mask=) is the call with the boolean mask the table stands for
    (reference.blocks.block_mask_visible), bit for bit, and its backward that mask's
    gradients bit for bit, a table alone through the backward's full_tiles variants (and on
    the GPU: tests/test_gpu.py); kernel_plan says which way the table was read."""
    size, lead, mask_lead, kernel = BLOCK_CASES[name]
    rng = np.random.default_rng(7)
    b, h, n_q, n_k, d = lead[0], 2, 40, 100, 16
    bm, bn = block_pair(size)
    q, k, v, dout = (rng.standard_normal(s).astype(np.float16) for s in (
        (b, h, n_q, d), (b, h, n_k, d), (b, h, n_k, d), (b, h, n_q, d)))
    blocks = rng.random(lead + (-(-n_q // bm), -(-n_k // bn))) < 0.5
    blocks[..., 0, 0] = True
    blocks[..., -1, -1] = np.arange(lead[1]) % 2 == 0  # a head that skips, one that keeps
    mask = None if mask_lead is None else rng.random(mask_lead + (n_q, n_k)) < 0.8
    keep = block_mask_visible(blocks, size, n_q, n_k) & (True if mask is None else mask)
    options = dict(causal="bottom_right", kernel=kernel)
    plan = kernel_plan(q, k, v, mask=mask, block_mask=blocks, block_size=size, **options)
    assert ("written out" if name == "written out" else "from its table") in plan.why
    assert ("read no mask" in plan.why) == (mask is None)
    got = flash_attention(q, k, v, mask=mask, block_mask=blocks, block_size=size,
                          return_lse=True, **options)
    want = flash_attention(q, k, v, mask=keep, return_lse=True, **options)
    for x, y in zip(got, want):
        assert np.array_equal(x, y, equal_nan=True)
    exact = [x.astype(np.float64) for x in (q, k, v, dout)]
    close = reference.attention(*exact[:3], mask=keep, causal="bottom_right")
    assert np.abs(got[0] - close).max() < 2e-3
    if kernel == "mma":  # the backward: the mask's gradients, bit for bit
        launched, launch = [], backward.launch
        monkeypatch.setattr(backward, "launch", lambda kernel, spec, *a, **kw: (
            launched.append(spec), launch(kernel, spec, *a, **kw))[1])
        grads = flash_attention_backward(q, k, v, *got, dout, causal="bottom_right",
                                         mask=mask, block_mask=blocks, block_size=size)
        monkeypatch.undo()
        fast = [s for s in launched if isinstance(s, MmaBwdSpec) and not s.nonfinite]
        assert {s.part for s in fast} == {"dq", "dkdv"}
        assert all(s.full_tiles == (mask is None) for s in fast), fast
        for x, y, z in zip(grads, flash_attention_backward(
                q, k, v, *want, dout, causal="bottom_right", mask=keep),
                reference.attention_backward(*exact, mask=keep, causal="bottom_right")):
            assert np.array_equal(x, y, equal_nan=True)
            assert np.abs(x - z).max() < 1e-2 * np.abs(z).max() + 1e-3


def test_a_block_mask_is_checked():
    """Errors name block_mask or block_size and what was expected."""
    q = k = v = np.zeros((1, 2, 100, 8), np.float32)
    good = np.ones((1, 2, 1, 1), bool)
    for bad, size, error, words in [
            (np.ones((1, 2, 2, 2), np.uint8), 64, TypeError, "block_mask must be boolean"),
            ([[True]], 64, TypeError, "block_mask must be a boolean array"),
            (np.ones((1, 2, 3, 2), bool), 64, ValueError, "ceil(Nq / 64)"),
            (good, 0, ValueError, "block_size must be"),
            (good, (64, 2.0), ValueError, "block_size must be"),
            (good, True, ValueError, "block_size must be")]:
        with pytest.raises(error, match=re.escape(words)):
            flash_attention(q, k, v, block_mask=bad, block_size=size)
