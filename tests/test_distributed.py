"""Sequence parallelism (numba_kernels/distributed/): how rows are sharded, and how a block of
the sharded problem sees the whole problem's band through the kernel's own arguments."""
import os
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numba_kernels.distributed.block_band import (MASK_KEYS, LocalBand, block_band, block_mask,
                                                  block_plan)
from numba_kernels.distributed.sharding import put_back, shard_ranges, shard_length, take
from reference.contract import check_attention_args, dense_visible

pytestmark = pytest.mark.usefixtures("every_core")  # spawned ranks: tests/conftest.py


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 50), st.integers(1, 9), st.sampled_from(["contiguous", "zigzag"]))
def test_shards_cover_the_sequence_once_and_balance(n, world, layout):
    """Every row on exactly one rank; lengths within one (contiguous) or two (zigzag) of each
    other; zigzag ranks hold a chunk from each end."""
    ranges = shard_ranges(n, world, layout)
    assert len(ranges) == world
    rows = [i for rank in ranges for start, stop in rank for i in range(start, stop)]
    assert sorted(rows) == list(range(n))
    lengths = [shard_length(rank) for rank in ranges]
    assert max(lengths) - min(lengths) <= (1 if layout == "contiguous" else 2)
    for rank in ranges:
        assert all(a[1] <= b[0] for a, b in zip(rank, rank[1:]))  # ascending, disjoint
    if layout == "zigzag" and n >= 2 * world:
        assert ranges[0][0][0] == 0 and ranges[0][-1][1] == n


def test_shards_refuse_bad_arguments_by_name():
    for args, name in (((-1, 2), "n"), ((4, 0), "world_size"), ((4, 2.0), "world_size"),
                       ((4, True), "world_size")):
        with pytest.raises(ValueError, match=name):
            shard_ranges(*args)
    with pytest.raises(ValueError, match="layout"):
        shard_ranges(4, 2, "ring")


def test_take_concatenates_a_ranks_ranges():
    x = np.arange(2 * 10).reshape(1, 1, 10, 2)
    got = take(x, ((1, 3), (7, 9)))
    assert got[0, 0, :, 0].tolist() == [2, 4, 14, 16]


def _visible(n_q, n_k, causal, window, kv_lengths):
    """The contract's visibility (B, Nq, Nk) for one problem, from reference.contract."""
    q = np.zeros((len(kv_lengths), 1, n_q, 1))
    k = np.zeros((len(kv_lengths), 1, n_k, 1))
    lengths = np.asarray(kv_lengths, np.int32)
    pb = check_attention_args(q, k, k, causal=causal, window=window, kv_lengths=lengths)
    return dense_visible(pb, None, lengths)[:, 0], pb


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 24), st.integers(1, 24), st.sampled_from([False, "top_left", "bottom_right"]),
       st.one_of(st.none(), st.tuples(st.integers(-1, 6), st.integers(-1, 6))),
       st.data())
def test_a_blocks_arguments_show_the_whole_bands_pairs(n_q, n_k, causal, window, data):
    """For random blocks (rows by keys) of random problems: the kernel's arguments block_band
    gives, read by the contract, show exactly the block's pairs of the whole band; None only
    for a block with none; "mask" gives them as block_mask."""
    kv_len = data.draw(st.integers(0, n_k))
    whole, pb = _visible(n_q, n_k, causal, window, [kv_len])
    qo = data.draw(st.integers(0, n_q - 1))
    q_stop = data.draw(st.integers(qo + 1, n_q))
    ko = data.draw(st.integers(0, n_k - 1))
    k_stop = data.draw(st.integers(ko + 1, n_k))
    want = whole[0, qo:q_stop, ko:k_stop]
    got = block_band(pb, kv_len, (qo, q_stop), (ko, k_stop))
    if got is None:
        assert not want.any()
        return
    if got == "mask":
        assert (block_mask(pb, kv_len, (qo, q_stop), (ko, k_stop)) == want).all()
        return
    assert isinstance(got, LocalBand)
    local, _ = _visible(q_stop - qo, k_stop - ko, got.causal, got.window, [got.kv_len])
    assert (local[0] == want).all(), (got, local[0].astype(int), want.astype(int))


def test_ring_blocks_of_a_causal_problem_need_no_mask():
    """Self-attention sharded either way, causal either alignment: every block is empty,
    whole, or said by the kernel's own arguments (a mask per block would cost the memory the
    sharding is meant to save)."""
    for n, world, layout in ((64, 4, "contiguous"), (64, 4, "zigzag"), (61, 3, "zigzag")):
        ranges = [r for rank in shard_ranges(n, world, layout) for r in rank]
        for causal in ("top_left", "bottom_right"):
            _, pb = _visible(n, n, causal, None, [n])
            for q_range in ranges:
                for k_range in ranges:
                    got = block_band(pb, n, q_range, k_range)
                    assert got != "mask", (n, world, layout, causal, q_range, k_range)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300), st.sampled_from([False, "top_left", "bottom_right"]),
       st.tuples(st.integers(-1, 40), st.integers(-1, 40)), st.data())
def test_a_blocks_plan_shows_its_pairs_with_masks_only_on_narrow_parts(n, causal, window,
                                                                         data):
    """A sliding window narrower than the shards: block_plan's parts (keys cut in halves
    where the kernel's arguments cannot say the band) show exactly the block's pairs, once
    each, and a part that takes a mask is at most MASK_KEYS keys wide."""
    kv_len = data.draw(st.integers(0, n))
    whole, pb = _visible(n, n, causal, window, [kv_len])
    qo = data.draw(st.integers(0, n - 1))
    q_range = (qo, data.draw(st.integers(qo + 1, n)))
    ko = data.draw(st.integers(0, n - 1))
    k_range = (ko, data.draw(st.integers(ko + 1, n)))
    want = whole[0, q_range[0]:q_range[1], k_range[0]:k_range[1]]
    seen = np.zeros(want.shape, int)
    for (start, stop), how in block_plan(pb, kv_len, q_range, k_range):
        cols = slice(start - ko, stop - ko)
        if isinstance(how, LocalBand):
            local, _ = _visible(q_range[1] - qo, stop - start, how.causal, how.window,
                                [how.kv_len])
            seen[:, cols] += local[0]
        else:
            assert stop - start <= MASK_KEYS
            seen[:, cols] += how
    assert (seen == want).all()


@pytest.mark.parametrize("dtype,kernel", [("bfloat16", "mma"), ("float16", "simt"),
                                          ("float32", "auto")])
def test_the_float32_result_rounds_to_the_forwards(dtype, kernel):
    """forward_float32 (the parts a distributed call merges): its out rounded to the inputs'
    dtype is the forward's out bit for bit, lse the same, and unrounded it is nearer the
    float64 result than the rounded out for 16-bit inputs."""
    torch = pytest.importorskip("torch")
    import verify  # noqa: F401  (selects the simulator on a machine without a GPU)
    import reference
    from numba_kernels import flash_attention
    from numba_kernels.forward import forward_float32

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 37, 16, generator=gen).to(getattr(torch, dtype))
               for _ in range(3))
    options = dict(causal="bottom_right", kernel=kernel)
    out32, lse32 = forward_float32(q, k, v, **options)
    out, lse = flash_attention(q, k, v, return_lse=True, **options)
    assert out32.dtype == torch.float32
    assert torch.equal(out32.to(q.dtype), out) and torch.equal(lse32, lse)
    if dtype != "float32":
        exact = reference.attention(*(x.double().numpy() for x in (q, k, v)),
                                    causal="bottom_right")
        err32 = np.abs(out32.double().numpy() - exact).max()
        err16 = np.abs(out.double().numpy() - exact).max()
        assert err32 < err16 * (0.75 if kernel == "mma" else 0.25)


def _last_first(n, world_size):
    """A layout of one's own: contiguous shards, the last rank's first in the sequence."""
    cuts = [c * n // world_size for c in range(world_size + 1)]
    return [[(cuts[world_size - 1 - r], cuts[world_size - r])] for r in range(world_size)]


def test_the_merge_on_torch_tensors_is_the_references_on_numpy():
    """split.merge_into is reference.merge's rule on torch float32 tensors: NumPy's float32
    result to within the libraries' exp and log (an ulp or two), empty parts (lse -inf)
    and a row empty in both included."""
    torch = pytest.importorskip("torch")
    from numba_kernels.distributed.split import merge_into
    from reference.merge import merge

    rng = np.random.default_rng(0)
    out_a, out_b = (rng.standard_normal((2, 5, 3)).astype(np.float32) for _ in "ab")
    lse_a = np.array([[0.0, -np.inf, 80.0, -np.inf, 3.0]] * 2, np.float32)
    lse_b = np.array([[1.0, 2.0, -90.0, -np.inf, 3.0]] * 2, np.float32)
    want_out, want_lse = merge((out_a, lse_a), (out_b, lse_b))
    out, lse = torch.from_numpy(out_a.copy()), torch.from_numpy(lse_a.copy())
    merge_into(out, lse, torch.from_numpy(out_b), torch.from_numpy(lse_b))
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-6, atol=0)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-6, atol=0)  # -inf where it is
    assert out.dtype == torch.float32 and not out.isnan().any()


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "_last_first"])
def test_put_back_is_takes_inverse(layout):
    torch = pytest.importorskip("torch")
    layout = _last_first if layout == "_last_first" else layout
    x = torch.arange(2 * 3 * 13 * 2).reshape(2, 3, 13, 2)
    for world in (1, 2, 5, 20):  # 20: ranks with no rows
        pieces = [take(x, ranges) for ranges in shard_ranges(13, world, layout)]
        assert torch.equal(put_back(pieces, 13, layout), x)


def test_a_layout_function_gives_the_ranks_their_ranges_checked():
    assert shard_ranges(10, 2, _last_first) == [((5, 10),), ((0, 5),)]
    assert shard_ranges(1, 3, _last_first) == [((0, 1),), (), ()]  # empty ranges left out
    broken = {
        "cover rows 0..9 once": lambda n, w: [[(0, 6)], [(5, 10)]],  # row 5 twice
        "gave 1 ranks' ranges": lambda n, w: [[(0, n)]],
        "ascending order": lambda n, w: [[(5, 10), (0, 2)], [(2, 5)]],
        "a list of (start, stop) ranges": lambda n, w: [[0], [1]],
    }
    for words, layout in broken.items():
        with pytest.raises(ValueError, match=r"layout .*<lambda>\(10, 2\).*" + re.escape(words)):
            shard_ranges(10, 2, layout)
    with pytest.raises(ValueError, match="or a function"):
        shard_ranges(10, 2, "striped")


@pytest.mark.parametrize("dtype,kernel", [("bfloat16", "mma"), ("float16", "tuned")])
def test_the_float32_gradients_round_to_the_backwards(dtype, kernel):
    """backward_float32 (the parts a distributed backward sums): float32 gradients that,
    rounded to the inputs' dtype, are the backward's bit for bit on the tensor-core kernels
    (the float32_grads variants: scores as the forward's); on other kernels float32 copies'
    gradients, float32 too."""
    torch = pytest.importorskip("torch")
    import verify  # noqa: F401  (selects the simulator on a machine without a GPU)
    from numba_kernels import flash_attention, flash_attention_backward
    from numba_kernels.backward import backward_float32

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 37, 16, generator=gen).to(getattr(torch, dtype))
    k, v = (torch.randn(1, 1, 45, 16, generator=gen).to(getattr(torch, dtype)) for _ in "kv")
    dout = torch.randn(1, 1, 37, 16, generator=gen).to(getattr(torch, dtype))
    options = dict(causal="bottom_right")
    out, lse = flash_attention(q, k, v, return_lse=True, kernel="mma", **options)
    grads32 = backward_float32(q, k, v, out, lse, dout, kernel=kernel, **options)
    grads = flash_attention_backward(q, k, v, out, lse, dout, kernel=kernel, **options)
    assert all(g.dtype == torch.float32 for g in grads32)
    if kernel == "mma":
        for name, g32, g in zip(("dq", "dk", "dv"), grads32, grads):
            assert torch.equal(g32.to(q.dtype), g), name
            assert not torch.equal(g32, g.float()), f"{name} was rounded before it was stored"
    else:
        for g32, g in zip(grads32, grads):
            assert torch.allclose(g32, g.float(), rtol=2e-2, atol=2e-2)


RING_CASES = [  # (layout, B, Hq, Hk, N, D, dtype, options): awkward lengths, both alignments
    # (the SIMT kernel: in the simulator the tensor-core one emulates each warp instruction,
    # and what is tested here is the ring, not the kernel)
    ("zigzag", 2, 2, 1, 29, 8, "bfloat16", dict(causal="top_left", kernel="simt")),
    ("contiguous", 1, 2, 2, 23, 8, "float16",
     dict(causal="bottom_right", kv_lengths=[19], kernel="simt")),
    ("zigzag", 2, 1, 1, 40, 8, "float32", dict(window=(5, 3), kv_lengths=[40, 22])),
    ("zigzag", 1, 1, 1, 1, 8, "float32", dict(causal="bottom_right")),  # a rank with no rows
]


def _ring_inputs(case):
    import torch

    layout, b, hq, hk, n, d, dtype, options = case
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(b, hq, n, d, generator=gen).to(getattr(torch, dtype))
    k, v = (torch.randn(b, hk, n, d, generator=gen).to(getattr(torch, dtype)) for _ in "kv")
    options = dict(options)
    if "kv_lengths" in options:
        options["kv_lengths"] = torch.tensor(options["kv_lengths"], dtype=torch.int32)
    return q, k, v, options


# the first RING_CASES take the gradients' ring too (one, for CI's time: verify's tests
# certify the gradients across ranks on the sharding cases, tests/test_verify_distributed.py)
BACKWARD_CASES = 1


def _ring_rank(rank, world, init, folder):
    """One rank: every RING_CASES case through ring_attention on its shards, saved: (out,
    lse), and for the first BACKWARD_CASES the shards' gradients for sum(out * dout)."""
    import torch
    import torch.distributed as dist

    from numba_kernels.distributed.ring import ring_attention

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for i, case in enumerate(RING_CASES):
            backward = i < BACKWARD_CASES
            q, k, v, options = _ring_inputs(case)
            ranges = shard_ranges(q.shape[2], world, case[0])[rank]
            shards = [take(x, ranges).requires_grad_(backward) for x in (q, k, v)]
            out, lse = ring_attention(*shards, layout=case[0], return_lse=True, **options)
            got = (out.detach(), lse.detach())
            if backward:
                out.backward(take(_dout(q, v), ranges))
                got += tuple(x.grad for x in shards)
            torch.save(got, os.path.join(folder, f"{i}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _dout(q, v):
    import torch

    gen = torch.Generator().manual_seed(7)
    return torch.randn(q.shape[:3] + v.shape[3:], generator=gen).to(q.dtype)


@pytest.mark.long
def test_ring_attention_on_gloo_ranks_meets_the_error_rule(tmp_path, monkeypatch):
    """Two gloo processes in the simulator (CI's two cores; the band's 3-way and uneven
    shards are block_band's properties above), each with its shards: the rows put back in
    place pass verify's error rule against the float64 truth, per (batch, head): out and lse
    for causal both ways, a window, kv_lengths, GQA, lengths the ranks do not divide and
    a rank with no rows; dq, dk and dv (the gradients' ring, through autograd) for the first
    BACKWARD_CASES of those."""
    world = 2
    torch = pytest.importorskip("torch")
    import torch.multiprocessing as mp

    from verify.criterion import judge, judge_backward
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    mp.spawn(_ring_rank, args=(world, f"file://{tmp_path}/init", str(tmp_path)), nprocs=world)
    for i, case in enumerate(RING_CASES):
        q, k, v, options = _ring_inputs(case)
        n, layout = q.shape[2], case[0]
        parts = [torch.load(tmp_path / f"{i}-{rank}.pt") for rank in range(world)]
        wide = [x.float().numpy() for x in (q, k, v)]
        sides = {name: (x.numpy() if name == "kv_lengths" else x)
                 for name, x in options.items() if name != "kernel"}
        out = put_back([p[0] for p in parts], n, layout)
        lse = put_back([p[1] for p in parts], n, layout)
        verdicts = judge(*wide, out.float().numpy(), lse.numpy(), dtype=case[6], **sides)
        if i < BACKWARD_CASES:
            grads = [put_back([p[2 + g] for p in parts], n, layout).float().numpy()
                     for g in range(3)]
            verdicts += judge_backward(*wide, _dout(q, v).float().numpy(), grads,
                                       dtype=case[6], **sides)
        for c in verdicts:
            assert c.passed, (case, c)
