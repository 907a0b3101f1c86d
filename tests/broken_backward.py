"""Deliberately broken attention backward kernels: verify.compare(backward=True) must fail
every one, for its reason.

`grad(bug)` is a float32 FlashAttention-2 backward in NumPy (P recomputed from the lse, key
tiles of BLOCK_N, dQ gathered over the key tiles) that is correct with bug=None and carries
exactly one classic bug otherwise. The forward it pairs with is the reference's.
"""
import itertools

import numpy as np

from reference.blocks import PARTIAL
from reference.contract import check_attention_args, dense_visible
from reference.naive import weighted_values
from tests.broken_kernels import halves_per_tensor, pair_classes

BLOCK_N = 16
CALLS = itertools.count()
BUGS = {  # bug: (a case that must fail, a phrase its failure must contain)
    "delta-omitted": ("shape 65x33 [float32] (backward)", "dq: mismatched"),
    "p-without-scale": ("shape 65x33 [float32] (backward)", "mismatched"),
    "dk-not-scaled": ("shape 65x33 [float32] (backward)", "dk: mismatched"),
    "gqa-one-head": ("GQA 4:1 (backward)", "dk: mismatched"),
    "ds-not-masked": ("NaN past kv_lengths (backward)", "non-finite"),
    "dq-order-varies": ("backward: determinism", "differ: dq"),
    "dv-unnormalised": ("shape 65x33 [float32] (backward)", "dv: mismatched"),
    # dV and dK as plain products: a pair that takes no part adds 0 * NaN (a tensor-core
    # kernel's products without the slow path for tiles holding a NaN)
    "products-add-every-pair": ("backward: q:nan in a row some keys see (causal=top_left)",
                                "non-finite"),
    # torch-cudnn on the H200 (docs/findings.md, bug 8): a plan cached by shape reads a later
    # dout by the strides of the first call
    "dout-layout-cached": ("backward: dout strided after contiguous", "mismatched"),
    # q, k, v and dout as float16 halves with one scale per tensor (halves.py's split): a
    # head of dout 2^20 below another loses its gradients, which only a judgement per
    # (batch, head) sees
    "halves-per-tensor": ("backward: dout heads 2^40 apart", "mismatched"),
    # block sparsity in the backward (tiles of broken_kernels.SPARSE_TILE): a partly visible
    # tile's pairs left out of dQ, dK and dV, or its hidden pairs added as if visible (the
    # forward, and so lse, correct)
    "partial-tile-skipped": ("block-sparse blocks (backward)", "mismatched"),
    "partial-tile-as-full": ("block-sparse ragged blocks (backward)", "mismatched"),
}
LAYOUTS = {}  # dout-layout-cached: (shape, dtype) -> dout's strides at the first call


def grad(bug=None):
    """grad(q, k, v, dout, **options) -> (dq, dk, dv) for NumPy float32 inputs."""
    assert bug is None or bug in BUGS, bug

    def attention_grad(q, k, v, dout, *, scale=None, causal=False, mask=None, bias=None,
                       kv_lengths=None, window=None):
        pb = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                                  kv_lengths=kv_lengths, window=window)
        full = (pb.batch, pb.heads_q, pb.n_q, pb.n_k)
        keep = np.broadcast_to(dense_visible(pb, mask, kv_lengths), full)
        bias = np.zeros(full, np.float32) if bias is None else np.broadcast_to(
            np.asarray(bias, np.float32), full)
        keep = keep & (bias != -np.inf)
        seen = keep  # the pairs the gradients take: a block-sparse bug's differ from keep
        if bug in ("partial-tile-skipped", "partial-tile-as-full") and mask is not None:
            partial = pair_classes(np.asarray(mask)) == PARTIAL
            seen = keep & ~partial if bug == "partial-tile-skipped" else \
                np.broadcast_to(dense_visible(pb, np.asarray(mask) | partial, kv_lengths),
                                full) & (bias != -np.inf)
        heads = [h // pb.group for h in range(pb.heads_q)]
        if bug == "dout-layout-cached":  # the same buffer read with the first call's strides
            first = LAYOUTS.setdefault((dout.shape, dout.dtype.str), dout.strides)
            dout = np.lib.stride_tricks.as_strided(dout, dout.shape, first)
        if bug == "halves-per-tensor" and q.dtype == np.float32:
            q, k, v, dout = (halves_per_tensor(x.astype(np.float32)) for x in (q, k, v, dout))
        qf, dof = q.astype(np.float32), dout.astype(np.float32)
        kf, vf = (x.astype(np.float32)[:, heads] for x in (k, v))
        with np.errstate(all="ignore"):
            dq, dk, dv = _grads(bug, pb, qf, kf, vf, dof, keep, bias, seen)
        if bug == "gqa-one-head":  # the group's first head only, not the sum
            dk, dv = dk[:, ::pb.group], dv[:, ::pb.group]
        else:
            dk, dv = (x.reshape(pb.batch, pb.heads_k, pb.group, *x.shape[2:]).sum(2)
                      for x in (dk, dv))
        return tuple(x.astype(q.dtype) for x in (dq, dk, dv))

    attention_grad.__name__ = f"broken_grad[{bug}]"
    return attention_grad


def _grads(bug, pb, qf, kf, vf, dof, keep, bias, seen):
    """dq (B, Hq, Nq, D), and dk, dv per query head (B, Hq, Nk, .) before the group sum, from
    the lse of the pairs `keep` (the forward's) and the pairs `seen` (keep, but for a bug)."""
    scale = np.float32(pb.scale)
    s = np.where(keep, qf @ np.swapaxes(kf, -1, -2) * scale + bias, -np.inf)
    keep = s != -np.inf  # the contract: a score of -inf, however it arose, hides the key
    m = s.max(-1, keepdims=True)
    m = np.where(m == -np.inf, 0, m)
    e = np.exp(s - m)
    l = e.sum(-1, keepdims=True)  # noqa: E741
    lse = np.where(l == 0, -np.inf, m + np.log(l))  # what the forward saved
    if seen is not keep:
        s = np.where(seen, qf @ np.swapaxes(kf, -1, -2) * scale + bias, -np.inf)
        keep = s != -np.inf
    if bug == "p-without-scale":  # P recomputed from raw scores
        s = np.where(keep, qf @ np.swapaxes(kf, -1, -2) + bias, -np.inf)
    p = np.where(keep, np.exp(s - lse), 0)  # a NaN row's P reaches none of its hidden keys
    out = weighted_values(p, keep, vf, np)
    dp = dof @ np.swapaxes(vf, -1, -2)
    if bug != "ds-not-masked":
        dp = np.where(keep, dp, 0)
    delta = (dof * out).sum(-1, keepdims=True) if bug != "delta-omitted" else 0
    ds = p * (dp - delta)
    if bug != "ds-not-masked":
        ds = np.where(keep, ds, 0)
    keep_t = np.swapaxes(keep, -1, -2)
    p_for_dv = e if bug == "dv-unnormalised" else p  # exp(S - m) without the 1 / l
    if bug == "products-add-every-pair":
        dv, dk = np.swapaxes(p_for_dv, -1, -2) @ dof, np.swapaxes(ds, -1, -2) @ qf
    else:
        dv = weighted_values(np.swapaxes(p_for_dv, -1, -2), keep_t, dof, np)
        dk = weighted_values(np.swapaxes(ds, -1, -2), keep_t, qf, np)
    dk = dk * scale if bug != "dk-not-scaled" else dk
    return _dq(bug, ds, keep, kf, scale), dk, dv


def _dq(bug, ds, keep, kf, scale):
    """dQ gathered over the key tiles, in tile order (a kernel's atomics: in any order)."""
    tiles = list(range(0, kf.shape[2], BLOCK_N))
    if bug == "dq-order-varies":
        np.random.default_rng(next(CALLS)).shuffle(tiles)
    dq = np.zeros(ds.shape[:3] + kf.shape[3:], np.float32)
    for j0 in tiles:
        cols = slice(j0, j0 + BLOCK_N)
        dq += weighted_values(ds[..., cols], keep[..., cols], kf[:, :, cols], np) * scale
    return dq


def _implementation(bug):
    """The reference-like forward of broken_kernels with grad(bug): for `--impl` of the
    conformance suite (tests/test_conformance.py)."""
    from tests.broken_kernels import kernel
    from verify.adapters import Implementation

    return Implementation(f"broken backward [{bug}]", kernel(None), grad=grad(bug))


CORRECT = _implementation(None)
DK_NOT_SCALED = _implementation("dk-not-scaled")
LEAKS_NAN_ROWS = _implementation("products-add-every-pair")
PARTIAL_TILE_SKIPPED = _implementation("partial-tile-skipped")


def _record_warm(backward=False, say=None):
    """A warm hook (Implementation.warm) that appends what it was asked to $FLASH_WARM_LOG."""
    import os

    with open(os.environ["FLASH_WARM_LOG"], "a") as f:
        f.write(f"backward={backward}\n")
    if say:
        say("warm hook called")


WARMED = _implementation(None)
WARMED.warm = _record_warm
