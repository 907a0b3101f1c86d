"""Deliberately broken attention kernels: verify.compare must fail every one, for its reason.

`kernel(bug)` is a float32 FlashAttention-2 forward in NumPy (key tiles of BLOCK_N, online
softmax) that is correct with bug=None and carries exactly one classic bug otherwise.
`default_stream_kernel()` is the one bug that needs a GPU (torch, CUDA).
"""
import itertools

import numpy as np

from reference.blocks import FULL, PARTIAL, tile_classes
from reference.contract import check_attention_args, dense_visible
from reference.naive import weighted_values

CALLS = itertools.count()

BLOCK_N = 16
WRAP_BITS = 12  # index-wrap: the mask's flat index wraps at 2**WRAP_BITS (2**32 on a GPU)
BUGS = {  # bug: (a case that must fail, a phrase its failure must contain)
    "no-max-subtraction": ("large scores [float32]", "non-finite"),
    "no-alpha-rescale": ("shape 65x33 [float32]", "mismatched"),
    "wrong-scale": ("shape 65x33 [float32]", "mismatched"),
    "causal-off-by-one": ("causal top_left 29x31", "mismatched"),
    "other-causal-alignment": ("causal bottom_right 29x31", "mismatched"),
    "last-tile-dropped": ("shape 65x33 [float32]", "mismatched"),
    "float16-accumulation": ("shape 13x37 [float32]", "mismatched"),
    "wrong-gqa-mapping": ("GQA 4:1", "mismatched"),
    "nan-for-empty-rows": ("mask empty rows", "fully masked rows give nan"),
    "masked-nan-leaks": ("NaN past kv_lengths", "non-finite"),
    "strides-ignored": ("strided inputs (minimal)", "mismatched"),
    "writes-input": ("shape 1x1 [float32]", "wrote into its inputs"),
    "nondeterministic": ("determinism (minimal)", "two runs"),
    "lse-log2": ("shape 65x33 [float32]", "lse: mismatched"),
    "head0-mask": ("mask per head (B, Hq, Nq, Nk)", "mismatched"),
    "bias-ignored": ("bias per head (B, Hq, Nq, Nk)", "mismatched"),
    "hidden-v-times-zero": ("v:nan in keys some rows see (window=(3, 2))", "non-finite"),
    # the tuned forward kernel before it marked P = -0.0: V added where the mask lets a row
    # see a key, though the key's score is -inf
    "mask-not-score": ("k:-inf,v:nan in keys some rows see (mask=random)", "non-finite"),
    "scale-ignored": ("scale 1.0", "mismatched"),
    "max-before-scale": ("scale -0.25 + causal", "non-finite"),
    "whole-last-tile": ("shape 65x33 [float32]", "mismatched"),
    "pointer-cache": ("call check: fresh-inputs", "mismatched"),
    "batch-dependent": ("call check: batch-alone", "computed alone differs"),
    "index-wrap": ("mask random [float32]", "mismatched"),
    "returns-out-only": ("shape 1x1 [float32]", "claims lse"),
    "aliases-input": ("shape 13x37 [float32]", "aliases"),
    # block sparsity at tiles of SPARSE_TILE x SPARSE_TILE (reference/blocks.py): a tile
    # partly visible skipped as if hidden, or read as if wholly visible; a wholly visible
    # tile whose band (causal, window, kv_lengths) goes untested with its mask
    "partial-tile-skipped": ("block-sparse blocks", "mismatched"),
    "partial-tile-as-full": ("block-sparse ragged blocks", "mismatched"),
    "full-tile-ignores-band": ("block-sparse dense + causal", "mismatched"),
    # the softmax's shift taken over every key's score of the row, hidden ones too: right in
    # value, but keys a row does not see move its bits
    "max-over-hidden": ("call check: hidden-keys", "keys a row does not see reach it"),
    # each score's products and partial sums rounded to float16 (a matrix product that
    # accumulates in float16): units of the products off where they cancel
    "score-sums-float16": ("values cancelling [float32]", "mismatched"),
}
SPARSE_TILE = 32
# Kernels that pass the battery without the value families and layouts (verify.cases.VALUES,
# EXPANDED) and fail one of them: bug: (dtypes claimed, a case that must fail, a phrase its
# failure must contain)
VALUE_BUGS = {
    # float32 as two float16 halves with one scale per tensor (as numba_kernels/halves.py
    # before scales per (batch, head)): a head or key 2^20 below the largest falls under
    # float16's range
    "halves-per-tensor": (("float32",), ("values heads-held [float32]",
                                         "values batch-held [float32]",
                                         "values keys [float32]"), "mismatched"),
    # the running row max kept in float16: scores past 65504 saturate it to inf
    "max-in-float16": (("float32",), ("values rows [float32]", "values outliers [float32]",
                                      "values heavy-tails [float32]",
                                      "values heads-free [float32]",
                                      "values batch-free [float32]",
                                      "values score-limit [float32]"), "mismatched"),
    # each key tile's P V summed in float16: values near float16's largest overflow
    "pv-float16-sums": (("float16",), ("values value-limit [float16]",), "non-finite"),
    # float16 subnormal inputs flushed to zero
    # (and outputs a row takes from one key, judged at their own scale)
    "flush-subnormals": (("float16",), ("values subnormal [float16]", "tiny values",
                                        "window (0, 0)"), "mismatched"),
    # a stride of 0 taken as the contiguous stride (memory past the copy read as zeros)
    "expanded-misread": (("float32",), ("expanded over batch", "expanded over heads",
                                        "expanded over the sequence"), "mismatched"),
    # expanded keys at lengths one past a multiple of 32 lose their last key (as PyTorch
    # issue 191937 reports of its efficient backend)
    "expanded-kv-tail": (("float32",), ("expanded over heads, Nk = 33",), "mismatched"),
}
OUT_BUFFER_BUG = "writes-outside-out"  # caught by the out-buffer check, when out= is claimed


def kernel(bug=None):
    assert bug is None or bug in BUGS or bug in VALUE_BUGS or bug == OUT_BUFFER_BUG, bug
    cache = {}

    def attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
                  window=None, return_lse=False, out=None):
        key = (q.ctypes.data, q.shape)
        if bug == "pointer-cache" and key in cache:
            result = cache[key]
        else:
            result = _forward(bug, q, k, v, scale, causal, mask, bias, kv_lengths, window)
            cache[key] = result
        o, lse = result
        if bug == "aliases-input" and o.shape == q.shape:  # "in place": out is q's buffer
            q[...] = o
            o = q
        if out is not None:
            target = out.base[..., :o.shape[2], :o.shape[3]] if bug == OUT_BUFFER_BUG else out
            target[...] = o
            o = out
        if bug == "returns-out-only":
            return o
        return (o, lse) if return_lse else o

    attention.__name__ = f"broken[{bug}]"
    return attention


def _forward(bug, q, k, v, scale, causal, mask, bias, kv_lengths, window):
    if bug == "expanded-kv-tail" and 0 in k.strides[1:2] and k.shape[2] % 32 == 1:
        k, v = k[:, :, :-1], v[:, :, :-1]  # the last key lost; lengths and masks cut alike
        mask = None if mask is None else mask[..., :-1]
        bias = None if bias is None else bias[..., :-1]
    q, k, v = (_quantized(bug, x, name) for x, name in zip((q, k, v), "qkv"))
    if bug == "strides-ignored":  # reads memory as if the views were contiguous
        q, k, v = (np.lib.stride_tricks.as_strided(
            x, strides=np.ascontiguousarray(x).strides) for x in (q, k, v))
    if bug == "other-causal-alignment" and causal:
        causal = "top_left" if causal == "bottom_right" else "bottom_right"
    if bug == "scale-ignored":
        scale = None
    if bug == "bias-ignored":
        bias = None
    if bug == "head0-mask" and mask is not None and mask.ndim == 4:
        mask = mask[:, :1]
    if bug == "index-wrap" and mask is not None:
        mask = _wrapped(mask, q.shape, k.shape)
    pb = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                              kv_lengths=kv_lengths, window=window)
    if bug in ("partial-tile-skipped", "partial-tile-as-full") and mask is not None:
        mask = np.asarray(mask)
        classes = pair_classes(mask)
        mask = mask & (classes != PARTIAL) if bug == "partial-tile-skipped" else \
            mask | (classes == PARTIAL)
    keep = dense_visible(pb, mask, kv_lengths)  # (B, 1 or Hq, Nq, Nk)
    if bug == "full-tile-ignores-band" and mask is not None:
        keep = keep | (pair_classes(np.asarray(mask)) == FULL)
    if bug == "causal-off-by-one" and causal:
        keep = keep & ~np.eye(pb.n_q, pb.n_k, dtype=bool)
    full = (pb.batch, pb.heads_q, pb.n_q, pb.n_k)
    keep = np.broadcast_to(keep, full)
    bias = np.zeros(full, np.float32) if bias is None else np.broadcast_to(
        np.asarray(bias, np.float32), full)
    keep = keep & (bias != -np.inf)
    scale = pb.scale if bug != "wrong-scale" else 1.0 / pb.d
    group = pb.group if bug != "wrong-gqa-mapping" else 1
    heads = [h // group % pb.heads_k for h in range(pb.heads_q)]
    qf = q.astype(np.float32)
    if bug == "writes-input":
        q[...] = q * np.float32(1.0001)  # scales the caller's array in place
    kf, vf = (x.astype(np.float32)[:, heads] for x in (k, v))
    if bug == "whole-last-tile":  # the last tile read whole: zero keys past Nk, all visible
        extra = -pb.n_k % BLOCK_N
        kf, vf = (np.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0))) for x in (kf, vf))
        keep = np.pad(keep, ((0, 0), (0, 0), (0, 0), (0, extra)), constant_values=True)
        bias = np.pad(bias, ((0, 0), (0, 0), (0, 0), (0, extra)))
    out, lse = _tiles(bug, pb, qf, kf, vf, keep, bias, np.float32(scale))
    if bug == "nondeterministic":  # as a racy reduction would: last bits vary per call
        out = out * np.float32(1 + (next(CALLS) % 2) * 2.0**-22)
    if bug == "lse-log2":
        lse = lse / np.float32(np.log(2.0))
    return out.astype(q.dtype), lse.astype(np.float32)


def pair_classes(mask):
    """Each pair's tile class (SKIP, PARTIAL, FULL) at tiles of SPARSE_TILE, mask's shape."""
    classes = tile_classes(mask, SPARSE_TILE, SPARSE_TILE)
    pairs = classes.repeat(SPARSE_TILE, axis=-2).repeat(SPARSE_TILE, axis=-1)
    return pairs[..., :mask.shape[-2], :mask.shape[-1]]


def _quantized(bug, x, name):
    """x as the value bugs read it (VALUE_BUGS), in x's dtype."""
    spread = [a for a in range(x.ndim) if x.strides[a] == 0 and x.shape[a] > 1]
    if bug == "expanded-misread" and spread:  # copies past the first read as zeros
        axis = spread[0]
        first = np.take(x, [0], axis=axis)
        return np.concatenate([first] + [np.zeros_like(first)] * (x.shape[axis] - 1), axis)
    if bug == "flush-subnormals" and x.dtype == np.float16:
        return np.where(np.abs(x) < np.finfo(np.float16).tiny, 0, x).astype(x.dtype)
    if bug == "halves-per-tensor" and x.dtype == np.float32:
        return halves_per_tensor(x)
    return x


def halves_per_tensor(x):
    """float32 x as hi + lo, two float16 halves with one scale for the whole tensor (as
    numba_kernels/halves.py splits it), back in float32; non-finite values as they are."""
    finite = np.isfinite(x)
    top = float(np.abs(np.where(finite, x, 0)).max(initial=0.0))
    if top == 0:
        return x
    c = 2.0 ** (13 - np.floor(np.log2(top)))  # halves.py's one scale for the tensor
    with np.errstate(all="ignore"):
        hi = (x * c).astype(np.float16)
        lo = (x * c - hi.astype(np.float32)).astype(np.float16)
    split = (hi.astype(np.float64) + lo.astype(np.float64)) / c
    return np.where(finite, split, x).astype(np.float32)


def _tiles(bug, pb, qf, kf, vf, keep, bias, scale):
    """The online softmax over key tiles of BLOCK_N."""
    acc_t = np.float16 if bug == "float16-accumulation" else np.float32
    m_i = np.full(qf.shape[:3], -np.inf, np.float32)
    l_i = np.zeros(qf.shape[:3], acc_t)
    acc = np.zeros(qf.shape[:3] + (pb.dv,), acc_t)
    n_k = kf.shape[2]
    last = n_k if bug != "last-tile-dropped" else n_k // BLOCK_N * BLOCK_N
    with np.errstate(all="ignore"):
        for j0 in range(0, last, BLOCK_N):
            j1 = min(j0 + BLOCK_N, last)
            raw = _float16_score_sums(qf, kf[:, :, j0:j1]) if bug == "score-sums-float16" \
                else np.einsum("bhid,bhjd->bhij", qf, kf[:, :, j0:j1])
            vis = keep[..., j0:j1]
            s = _scores(bug, raw, vis, bias[..., j0:j1], scale)
            tile_max = s.max(-1)
            if bug == "max-over-hidden":  # rows that see a key shift by every key's score
                every = np.einsum("bhid,bhjd->bhij", qf, kf).max(-1) * scale
                tile_max = np.where(keep.any(-1), np.maximum(tile_max, every), tile_max)
            if bug == "max-before-scale":  # the max of raw masked scores, scaled afterwards
                tile_max = np.where(vis, raw, -np.inf).max(-1) * scale
            if bug == "batch-dependent":  # one max for the whole batch and every head
                tile_max = np.broadcast_to(tile_max.max(axis=(0, 1)), tile_max.shape)
            m_new = np.maximum(m_i, tile_max)
            if bug == "max-in-float16":  # saturates to inf past 65504
                m_new = m_new.astype(np.float16).astype(np.float32)
            m_safe = np.where(m_new == -np.inf, 0, m_new)
            if bug == "no-max-subtraction":
                m_safe = np.zeros_like(m_safe)
            alpha = np.exp(m_i - m_safe) if bug != "no-alpha-rescale" else 1.0
            p = np.exp(s - m_safe[..., None])
            vt = vf[:, :, j0:j1]
            pv = p @ vt if bug in ("masked-nan-leaks", "hidden-v-times-zero") else \
                weighted_values(p, vis if bug == "mask-not-score" else s != -np.inf, vt, np)
            if bug == "pv-float16-sums":  # the tile's products summed in float16
                pv = _float16_sums(np.where(s != -np.inf, p, 0), vt)
            l_i = (alpha * l_i + p.sum(-1)).astype(acc_t)
            acc = (np.asarray(alpha)[..., None] * acc + pv).astype(acc_t)
            m_i = m_new
        empty = l_i == 0
        out = np.where(empty[..., None], 0, acc / l_i[..., None])
        if bug == "nan-for-empty-rows":
            out = acc / l_i[..., None]
        lse = np.where(empty, -np.inf, m_i + np.log(l_i.astype(np.float32)))
    return out, lse


def _float16_score_sums(q, k):
    """q k^T with each product and partial sum rounded to float16 (channel by channel)."""
    total = np.zeros(q.shape[:-1] + k.shape[-2:-1], np.float16)
    with np.errstate(all="ignore"):
        for d in range(q.shape[-1]):
            term = q[..., d, None].astype(np.float16) * k[..., None, :, d].astype(np.float16)
            total = (total + term).astype(np.float16)
    return total.astype(np.float32)


def _float16_sums(p, vt):
    """p @ vt with each product and partial sum rounded to float16 (key by key)."""
    total = np.zeros(p.shape[:-1] + vt.shape[-1:], np.float16)
    with np.errstate(all="ignore"):
        for j in range(p.shape[-1]):
            term = np.where(p[..., j:j + 1] > 0, p[..., j:j + 1].astype(np.float16)
                            * vt[..., j:j + 1, :].astype(np.float16), 0)
            total = (total + term).astype(np.float16)
    return total.astype(np.float32)


def _scores(bug, raw, vis, bias, scale):
    if bug == "max-before-scale":  # masks first, then scales: -inf * (scale < 0) = +inf
        return np.where(vis, raw, -np.inf) * scale + np.where(vis, bias, 0)
    if bug == "masked-nan-leaks":  # masks by adding -inf: NaN + -inf = NaN
        return raw * scale + bias + np.where(vis, 0, -np.inf).astype(np.float32)
    return np.where(vis, raw * scale + bias, -np.inf)


def _wrapped(mask, q_shape, k_shape):
    """The mask as a kernel reads it when its flat index (b, h, i, j) wraps at 2**WRAP_BITS."""
    full = (q_shape[0], mask.shape[1] if mask.ndim == 4 else 1, q_shape[2], k_shape[2])
    flat = np.ascontiguousarray(np.broadcast_to(mask, full)).reshape(-1)
    index = np.arange(flat.size) % 2**WRAP_BITS
    return flat[index].reshape(full)


def default_stream_kernel():
    """A correct attention in torch whose work goes to the default stream, whatever stream
    the caller has made current (needs CUDA)."""
    import torch

    def attention(q, k, v, **options):
        with torch.cuda.stream(torch.cuda.default_stream(q.device)):
            s = torch.einsum("bhid,bhjd->bhij", q.float(), k.float()) * (
                options.get("scale") or q.shape[-1] ** -0.5)
            return (torch.softmax(s, -1) @ v.float()).to(q.dtype)

    return attention


BROKEN_SCALE = kernel("wrong-scale")  # for the command-line tests
CORRECT = kernel(None)
