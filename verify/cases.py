"""The battery: what verify.compare runs, and how each case's inputs are made.

A Case is plain data (shapes, dtype, options, the kind of values), so a failure can be
reproduced from its fields and a seed alone. make_inputs turns it into NumPy arrays.
"""
import itertools
from dataclasses import asdict, dataclass

import numpy as np

from reference.dtypes import KERNEL_DTYPES, cast, numpy_dtype

SUITES = ("quick", "standard", "full", "scale")
BIAS_KINDS = {  # kind: the bias's shape, what it holds
    "random": "(B, Hq, Nq, Nk) normal values",
    "neg-inf": "(B, 1, Nq, Nk) normal values, a third of them -inf (a mask)",
    "alibi": "(1, Hq, Nq, Nk) per-head slopes times the distance to the diagonal, as in ALiBi",
    "shared": "(1, 1, Nq, Nk) normal values",
}
VALUES = {  # values: what q, k and v hold (standard normal draws, then ...)
    "normal": "standard normal draws",
    "large": "q and k times 30: scores far beyond exp's range",
    "scaled": "q and k times 4: peaked softmax rows",
    "tiny": "q, k and v times 1e-3",
    "ties": "q and k their signs: many exact ties in every row",
    "heads-held": "each head's q times 2^e and k times 2^-e (scores unchanged), v times 2^f; "
                  "e and f spread over SPREAD[dtype] binades across the heads",
    "heads-free": "each head's q, k and v times their own 2^e: scores up to 2^SPREAD",
    "batch-held": "as heads-held, across the batch",
    "batch-free": "as heads-free, across the batch",
    "rows": "each query row's q times its own 2^e (SPREAD binades): tiny and saturated rows",
    "keys": "each key's k times 2^e and v times 2^-e (e over SPREAD binades): the keys "
            "that win the softmax hold the smallest values",
    "outliers": "two channels of q times 1000, of k times 100, one of v times 1e4 (the "
                "'massive activations' of large language models)",
    "heavy-tails": "random signs times log-normal magnitudes exp(3 N(0, 1)): the largest of "
                   "a few thousand draws about 10^4 times the median (float16: at most "
                   "8192)",
    "cancelling": "q and k times 30, q's channels in pairs equal to 1e-3, k's in pairs of "
                  "opposite sign: each score a sum of products in the thousands that nearly "
                  "cancel (the tensor cores' truncated sums land units of them off)",
    "score-limit": "q and k times 2^LIMITS[dtype][0]: raw scores past float16's range for "
                   "float16 inputs (not float32's), near 2^108 for the others",
    "value-limit": "v times 2^LIMITS[dtype][1], q and k times 0.1: near-uniform rows of "
                   "values near the dtype's largest (float16), or at 2^100",
    "subnormal": "v in the dtype's subnormal range, q and k small enough that the scores "
                 "underflow",
    "nan-hidden": "NaN where no row sees it (past kv_lengths, masked columns)",
    "inf-hidden": "+inf where no row sees it",
    "nan-visible": "one NaN in a key that some rows see",
}
SPREAD = {"float32": 40, "bfloat16": 40, "float16": 20}  # binades the disparities cover
# log2 of the factors of score-limit (q and k) and value-limit (v): within what float32
# arithmetic holds (scores, and sums of up to Nk values) for every dtype
LIMITS = {"float32": (52, 100), "bfloat16": (52, 100), "float16": (7, 13)}
SUBNORMAL = {"float32": -135, "bfloat16": -130, "float16": -20}  # log2 of a subnormal value
EXPANDED = {  # expanded: the axis of q, k and v given as a stride-0 view
    "batch": 0, "heads": 1, "sequence": 2}
# Block-sparse masks: whole blocks of BLOCK x BLOCK pairs visible or hidden (as FlexAttention's
# BlockMask describes them), smaller than any kernel's tile, so that a kernel's tile holds
# several blocks: tiles wholly hidden (to skip), wholly visible (no mask to read) and partly
# visible (the mask read pair by pair) in one call.
BLOCK = 16
BLOCK_MASKS = {  # mask: which blocks are visible
    "blocks": "a quarter of the blocks at random, and every block on the diagonal",
    "blocks-one": "one block in the middle: every other row sees nothing",
    "blocks-empty-rows": "as blocks, with every other row of blocks wholly hidden",
    "blocks-dense": "every block (a mask of ones, given as a mask)",
    "blocks-ragged": "as blocks, each visible block without its last row and first column: "
                     "partly visible at every tile's edges",
}
CHECKS = {  # check: what the runner does beyond one call
    "fresh-inputs": "new values written into the same buffers must give a new, correct answer",
    "batch-alone": "each (batch, head) computed alone must give the batched result",
    "stream": "on a non-default stream, the result must be complete on that stream",
    "out-buffer": "writing into a caller's out= view must leave the bytes around it alone",
    "hidden-keys": "other K and V in keys some rows do not see (a block-sparse mask) must "
                   "leave those rows' outputs alone, bitwise where claimed",
}


class VacuousCase(Exception):
    """A case whose inputs cannot show what it is meant to test: a bug of verify."""


@dataclass(frozen=True)
class Case:
    name: str
    B: int
    Hq: int
    Hk: int
    Nq: int
    Nk: int
    D: int
    Dv: int
    dtype: str
    causal: object = False  # False, "top_left", "bottom_right"
    window: tuple = None
    mask: str = None  # None, "random", "diagonal", "empty-rows", "single-key", BLOCK_MASKS
    kv_lengths: str = None  # None, "random", "edges" (0, 1 and Nk), "prefix" (Nk // 8 each)
    values: str = "normal"  # VALUES
    strided: bool = False  # inputs are non-contiguous views
    expanded: str = None  # EXPANDED: q, k and v are stride-0 views along this axis
    repeat: bool = False  # run twice, outputs must be bitwise equal
    scale: float = None  # an explicit scale (None: the default 1 / sqrt(D))
    mask_shape: str = "batch"  # batch (B, 1, Nq, Nk), head (B, Hq, Nq, Nk), shared (1, 1, ..)
    bias: str = None  # None, random, neg-inf, alibi, shared (BIAS_KINDS)
    poison: str = None  # "k:nan", "v:-inf", ...: keys some rows see and others do not
    check: str = None  # a property of the call beyond its values (CHECKS)
    sampled: bool = False  # judged on sample_rows(case) only (the scale suite's sizes)
    backward: bool = False  # judges dq, dk, dv for an incoming gradient dout (verify.backward)
    dout: str = "normal"  # dout's values or layout: normal, large, tiny, strided, relayout (DOUTS)

    def to_dict(self):
        return asdict(self)

    def features(self):
        """What an implementation must support to be held to this case."""
        f = {f"dtype:{self.dtype}"}
        if self.causal:
            f.add(f"causal:{self.causal}")
        if self.window is not None:
            f.add("window")
        if self.mask:
            f.add("mask")
        if self.bias:
            f.add("bias")
        if self.kv_lengths:
            f.add("kv_lengths")
        if self.Hq != self.Hk:
            f.add("gqa")
        if self.Dv != self.D:
            f.add("dv_differs")
        if self.values in ("nan-hidden", "inf-hidden", "nan-visible") or self.poison:
            f.add("nonfinite_hidden")  # containment
        if self.scale is not None:
            f.add("scale:" + ("zero" if self.scale == 0 else
                              "positive" if self.scale > 0 else "negative"))
        if self.check == "out-buffer":
            f.add("out_buffer")
        if self.backward:
            f.add("backward")
        return f


def make_inputs(case, seed):
    """(q, k, v, options) as NumPy arrays for `case`; options are the contract's keywords."""
    rng = np.random.default_rng(seed)
    shapes = [(case.B, case.Hq, case.Nq, case.D), (case.B, case.Hk, case.Nk, case.D),
              (case.B, case.Hk, case.Nk, case.Dv)]
    if case.sampled:  # billions of elements: drawn and cast on every core
        q, k, v = (_normal(seed, i, s, case.dtype) for i, s in enumerate(shapes))
    else:
        q, k, v = (rng.standard_normal(s) for s in shapes)
    q, k, v = _values(case, rng, q, k, v)
    if case.expanded:  # one copy along the axis, repeated: to_impl passes stride-0 views
        axis = EXPANDED[case.expanded]
        q, k, v = (np.broadcast_to(np.take(x, [0], axis=axis), x.shape).copy()
                   for x in (q, k, v))
    options = {}
    if case.scale is not None:
        options["scale"] = case.scale
    if case.causal:
        options["causal"] = case.causal
    if case.window is not None:
        options["window"] = case.window
    if case.mask:
        options["mask"] = _mask(case, rng)
    if case.bias:  # in the inputs' dtype, as libraries take it
        options["bias"] = cast(_bias(case, rng), case.dtype)
    if case.kv_lengths:
        lengths = rng.integers(1, case.Nk + 1, case.B)
        if case.kv_lengths == "edges":
            lengths = np.array([0, 1, case.Nk] * case.B)[: case.B]
        elif case.kv_lengths == "prefix":  # within the first of 8 or more shards' keys
            lengths = np.full(case.B, max(1, case.Nk // 8))
        options["kv_lengths"] = lengths.astype(np.int32)
    q, k, v = (cast(x, case.dtype) for x in (q, k, v))
    if case.values in ("nan-hidden", "inf-hidden"):
        _poison_hidden(case, k, v, options, np.nan if case.values == "nan-hidden" else np.inf)
    elif case.values == "nan-visible":
        k[0, 0, case.Nk // 2, 0] = np.nan  # seen by the rows that see key Nk // 2
    if case.poison:
        _poison_some_rows(case, q, k, v, options)
    return q, k, v, options



def _values(case, rng, q, k, v):
    """q, k, v (float64 standard normal draws) made into case.values (VALUES)."""
    kind, group = case.values, case.Hq // case.Hk
    if kind in ("heads-held", "heads-free", "batch-held", "batch-free"):
        axis = 1 if kind.startswith("heads") else 0
        n = case.Hk if axis else case.B
        e, f = (ladder(rng, n, SPREAD[case.dtype]) for _ in range(2))
        e_q = np.repeat(e, group) if axis else e  # a query head takes its key head's
        e_k = -e if kind.endswith("held") else ladder(rng, n, SPREAD[case.dtype])
        shape = (-1, 1, 1, 1) if axis == 0 else (1, -1, 1, 1)
        return (q * 2.0 ** e_q.reshape(shape), k * 2.0 ** e_k.reshape(shape),
                v * 2.0 ** f.reshape(shape))
    if kind == "rows":
        return q * 2.0 ** ladder(rng, case.Nq, SPREAD[case.dtype])[:, None], k, v
    if kind == "keys":
        e = ladder(rng, case.Nk, SPREAD[case.dtype])[:, None]
        return q, k * 2.0 ** e, v * 2.0 ** -e
    if kind == "outliers":
        q, k, v = q.copy(), k.copy(), v.copy()
        channels = sorted({0, case.D // 2})
        q[..., channels] *= 1e3
        k[..., channels] *= 1e2
        v[..., case.Dv // 3] *= 1e4
        return q, k, v
    if kind == "heavy-tails":
        top = 2.0 ** LIMITS[case.dtype][1]  # float16: 8192
        return tuple(np.sign(x) * np.minimum(np.exp(3.0 * rng.standard_normal(x.shape)), top)
                     for x in (q, k, v))
    if kind == "cancelling":
        pairs = 2 * (case.D // 2)  # an odd last channel stays as it is
        q, k = q * 30.0, k * 30.0
        q[..., 1:pairs:2] = q[..., 0:pairs:2] * (1 + 1e-3 * rng.standard_normal(
            q[..., 0:pairs:2].shape))
        k[..., 1:pairs:2] = -k[..., 0:pairs:2]
        return q, k, v
    if kind == "score-limit":
        big = 2.0 ** LIMITS[case.dtype][0]
        return q * big, k * big, v
    if kind == "value-limit":
        return q * 0.1, k * 0.1, v * 2.0 ** LIMITS[case.dtype][1]
    if kind == "subnormal":
        small = 2.0 ** (SUBNORMAL[case.dtype] // 2)
        return q * small, k * small, v * 2.0 ** SUBNORMAL[case.dtype]
    factors = {"large": (30.0, 30.0, 1.0), "tiny": (1e-3, 1e-3, 1e-3),
               "scaled": (4.0, 4.0, 1.0)}  # scaled: scores 16 times their usual size
    if kind == "ties":  # few distinct scores: many exact ties in every row
        return np.sign(q), np.sign(k), v
    a, b, c = factors.get(kind, (1.0, 1.0, 1.0))
    return q * a, k * b, v * c


def ladder(rng, n, spread):
    """n exponents evenly spaced over `spread` binades around 0, in random order."""
    steps = np.linspace(-spread / 2, spread / 2, n) if n > 1 else np.zeros(1)
    return rng.permutation(np.round(steps))


def _normal(seed, which, shape, dtype, chunk=1 << 24):
    """Standard normal draws as dtype `dtype`, in chunks of `chunk` elements, each drawn in
    float32 from its own stream of SeedSequence(seed, which) and cast in its thread: the same
    values whatever the number of threads."""
    from concurrent.futures import ThreadPoolExecutor

    out = np.empty(int(np.prod(shape)), numpy_dtype(dtype))
    starts = range(0, out.size, chunk)
    streams = np.random.SeedSequence([seed, which]).spawn(len(starts))

    def fill(i):
        draws = np.random.default_rng(streams[i]).standard_normal(
            min(chunk, out.size - starts[i]), dtype=np.float32)
        out[starts[i]:starts[i] + chunk] = cast(draws, dtype)

    with ThreadPoolExecutor() as pool:
        list(pool.map(fill, range(len(starts))))
    return out.reshape(shape)


def _mask(case, rng):
    heads = {"batch": (case.B, 1), "head": (case.B, case.Hq), "shared": (1, 1)}
    shape = heads[case.mask_shape] + (case.Nq, case.Nk)
    if case.sampled:  # billions of elements: rows drawn from PATTERNS random ones
        return _patterned(rng.random((PATTERNS, case.Nk)) < 0.6, shape)
    if case.mask in BLOCK_MASKS:
        return block_mask(case.mask, rng, shape)
    if case.mask == "random":
        m = rng.random(shape) < 0.6
        m[..., rng.integers(0, case.Nk, case.Nq)] = True  # keep rows non-empty
        m[..., np.arange(case.Nq), rng.integers(0, case.Nk, case.Nq)] = True
        return m
    m = np.zeros(shape, bool)
    if case.mask == "diagonal":  # row i sees key i (i mod Nk when Nq > Nk) alone
        i = np.arange(case.Nq)
        m[..., i, i % case.Nk] = True
    elif case.mask == "single-key":  # one visible key per row: first, last, or in between
        cols = np.array([0, case.Nk - 1, case.Nk // 2])[np.arange(case.Nq) % 3]
        m[..., np.arange(case.Nq), cols] = True
    elif case.mask == "empty-rows":  # every third row sees nothing
        m[:] = rng.random(shape) < 0.5
        m[..., ::3, :] = False
    return m


def block_mask(kind, rng, shape, block=BLOCK, density=0.25):
    """A boolean mask of shape (..., Nq, Nk) made of block x block blocks (BLOCK_MASKS[kind];
    `density` of the blocks kept at random where the kind draws them)."""
    *lead, n_q, n_k = shape
    rows, cols = -(-n_q // block), -(-n_k // block)
    if kind == "blocks-dense":
        return np.ones(shape, bool)
    blocks = np.zeros((*lead, rows, cols), bool)
    if kind == "blocks-one":
        blocks[..., rows // 2, cols // 2] = True
    else:
        blocks[:] = rng.random(blocks.shape) < density
        blocks[..., np.arange(rows), np.arange(rows) * cols // rows] = True
        if kind == "blocks-empty-rows":
            blocks[..., ::2, :] = False
    m = blocks.repeat(block, axis=-2).repeat(block, axis=-1)[..., :n_q, :n_k]
    if kind == "blocks-ragged":
        m[..., block - 1::block, :] = False
        m[..., ::block] = False
    return np.ascontiguousarray(m)


def _bias(case, rng):
    """An additive bias of kind case.bias (BIAS_KINDS), float64 (cast by the runner)."""
    if case.bias == "alibi":  # slope_h * (j - i): closer keys weigh more, slopes 2^-(8h/H)
        slopes = 2.0 ** (-8.0 * np.arange(1, case.Hq + 1) / case.Hq)
        dist = np.arange(case.Nk)[None, :] - np.arange(case.Nq)[:, None]
        return (-slopes[:, None, None] * np.abs(dist))[None]
    shape = {"random": (case.B, case.Hq), "neg-inf": (case.B, 1), "shared": (1, 1)}
    shape = shape[case.bias] + (case.Nq, case.Nk)
    if case.sampled:
        return _patterned(rng.standard_normal((PATTERNS, case.Nk), dtype=np.float32), shape)
    bias = rng.standard_normal(shape)
    if case.bias == "neg-inf":
        bias[rng.random(bias.shape) < 1 / 3] = -np.inf
        bias[..., np.arange(case.Nq), rng.integers(0, case.Nk, case.Nq)] = 0.5  # rows see a key
    return bias


PATTERNS = 251  # distinct rows of a scale-suite mask or bias (a prime: rows i, i + 2^k differ)


def _patterned(patterns, shape):
    """An array of `shape` (.., Nq, Nk) whose row i is patterns[(i * 7919) % PATTERNS]."""
    lead = int(np.prod(shape[:-1]))
    index = (np.arange(lead, dtype=np.int64) * 7919) % len(patterns)
    return np.take(patterns, index, axis=0).reshape(shape)


def sample_rows(case):
    """The query rows the scale suite judges (all of them for small cases): spread over Nq,
    dense at the end, and around every power of two 2^k (k >= 10) of the flattened indices
    of q, out, lse and of the (B, Hq, Nq, Nk) scores, mask and bias, where 32-bit index
    arithmetic wraps."""
    n = case.Nq
    rows = set(np.linspace(0, n - 1, 64).astype(int).tolist()) | set(range(max(0, n - 32), n))
    widths = {case.D, case.Dv, 1, case.Nk}  # elements per query row in each flat array
    total = case.B * case.Hq * n * max(case.D, case.Dv, case.Nk)
    for k in range(10, max(11, int(total).bit_length() + 1)):
        for width in widths:
            row = (2**k // width) % n
            rows |= {r % n for r in (row - 1, row, row + 1)}
    return sorted(rows)


def visibility(case, options, q=None, k=None, v=None):
    """(B, Hq, Nq, Nk) True where a key is visible (the contract's definition: key_range,
    mask, bias != -inf), for a case's options; q, k, v default to stand-ins of its shapes."""
    from reference.contract import check_attention_args, dense_visible

    if q is None:
        q, k, v = [np.broadcast_to(np.float32(0), s) for s in (
            (case.B, case.Hq, case.Nq, case.D), (case.B, case.Hk, case.Nk, case.D),
            (case.B, case.Hk, case.Nk, case.Dv))]
    pb = check_attention_args(q, k, v, **options)
    keep = dense_visible(pb, options.get("mask"), options.get("kv_lengths"))
    if options.get("bias") is not None:
        keep = keep & (np.asarray(options["bias"]) != -np.inf)
    return np.broadcast_to(keep, (pb.batch, pb.heads_q, pb.n_q, pb.n_k))


def _poison_hidden(case, k, v, options, value):
    """Put non-finite values where no row can see them: past kv_lengths, or masked columns."""
    if "kv_lengths" in options:
        for b, n in enumerate(options["kv_lengths"]):
            k[b, :, n:], v[b, :, n:] = value, value
    if "mask" in options:
        hidden = ~np.broadcast_to(options["mask"], (case.B, case.Hq, case.Nq, case.Nk)).any(
            axis=(1, 2))  # (B, Nk) keys no row sees
        for b in range(case.B):
            k[b, :, hidden[b]], v[b, :, hidden[b]] = value, value


POISONS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def _poison_some_rows(case, q, k, v, options):
    """case.poison = "k:nan", "v:-inf", ... or several, "k:-inf,v:nan": in each batch, every
    key that no row sees, and one key that some rows see and others (which see other keys) do
    not, get the value: in K one element, in V one column. "q:nan" (or inf): one row of Q
    that sees some keys and not others (poison_rows); "dout:...": the same for a backward
    case's dout (verify.backward poisons it). Raises VacuousCase when no key or row anywhere
    is of that kind: then a kernel that leaks would pass unnoticed."""
    keep = visibility(case, options)
    for part in case.poison.split(","):
        tensor, _, name = part.partition(":")
        if tensor in ("k", "v"):
            _poison_keys(case, k, v, keep, tensor, POISONS[name])
        elif tensor == "q":
            poison_rows(case, q, keep, POISONS[name])


def poison_rows(case, x, keep, value):
    """One row of x (Q, or a backward case's dout) in each batch gets `value`, in column
    row % width of every head: a row that, in every head, sees some keys and not others, so
    that a kernel which adds the row's pairs with keys it does not see (0 * NaN) leaks the
    value into their dk and dv. keep: visibility(case, options). VacuousCase when no row is
    of that kind."""
    bites = 0
    for b in range(case.B):
        partial = (keep[b].any(axis=-1) & ~keep[b].all(axis=-1)).all(axis=0)  # (Nq,)
        rows = np.flatnonzero(partial)
        if rows.size:
            r = int(rows[rows.size // 2])
            x[b, :, r, r % x.shape[-1]] = value
            bites += 1
    if not bites:
        raise VacuousCase(f"case {case.name!r}: no row sees some keys and not others, so "
                          f"poisoning cannot show a leak")


def _poison_keys(case, k, v, keep, tensor, value):
    """One poison of _poison_some_rows: `tensor` ("k" or "v") gets `value`."""
    bites = 0
    for b in range(case.B):
        seen = keep[b].reshape(-1, case.Nk)  # (Hq * Nq, Nk)
        rows = seen.any(axis=1)
        biting = np.flatnonzero(seen.any(axis=0) & (rows[:, None] & ~seen).any(axis=0))
        keys = list(np.flatnonzero(~seen.any(axis=0)))
        if biting.size:
            keys.append(int(biting[biting.size // 2]))
            bites += 1
        for j in keys:
            if tensor == "k":
                k[b, :, j, 0] = value
            else:
                v[b, :, j, j % case.Dv] = value
    if not bites:
        raise VacuousCase(f"case {case.name!r}: no key is seen by some rows and hidden from "
                          f"others, so poisoning cannot show a leak")


def battery(suite="quick", dtypes=KERNEL_DTYPES, max_head_dim=256, sharded=False):
    """The cases of a suite, in a fixed order. max_head_dim: the largest head dim claimed
    (one case runs at it). sharded: with the cases that break attention split across ranks
    by sequence (verify.compare's world_size)."""
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}, got {suite!r}")
    if suite == "scale":
        return scale_cases(dtypes[0])
    small = suite == "quick"
    N = (lambda n: n) if not small else (lambda n: min(n, 70))
    cases = []

    def add(name, **kw):
        base = dict(B=2, Hq=2, Hk=2, Nq=N(64), Nk=N(64), D=16, Dv=16, dtype=dtypes[0])
        base.update(kw)
        cases.append(Case(name=name, **base))

    for dtype in dtypes:
        tag = f"[{dtype}]"
        for nq, nk in ([(1, 1), (2, 63), (63, 64), (65, 2), (113, 203)] if not small
                       else [(1, 1), (2, 63), (65, 33), (13, 37)]):
            add(f"shape {nq}x{nk} {tag}", Nq=nq, Nk=nk, dtype=dtype)
        add(f"causal top_left Nq<Nk {tag}", Nq=N(37), Nk=N(61), causal="top_left", dtype=dtype)
        add(f"causal bottom_right Nq>Nk {tag}", Nq=N(61), Nk=N(37), causal="bottom_right",
            dtype=dtype)
        add(f"large scores {tag}", values="large", dtype=dtype)
        add(f"mask random {tag}", mask="random", dtype=dtype)
    _aligned(add, small)
    for nq, nk, causal in itertools.product((N(29), N(67)), (N(31),), ("top_left",
                                                                        "bottom_right")):
        add(f"causal {causal} {nq}x{nk}", Nq=nq, Nk=nk, causal=causal)
    add("window (4, 2)", Nq=N(50), Nk=N(50), window=(4, 2))
    add("window (0, 0)", Nq=N(20), Nk=N(20), window=(0, 0))
    add("window (3, -1) + causal", Nq=N(40), Nk=N(45), window=(3, -1), causal="bottom_right")
    _scales(add, N)
    _masks_and_bias(add, N)
    _block_sparse(add, N)
    add("kv_lengths random", kv_lengths="random", B=3, Nk=N(70))
    add("kv_lengths 0, 1, Nk", kv_lengths="edges", B=3, Nk=N(70), causal="bottom_right")
    add("mask + causal + kv_lengths", mask="random", causal="top_left", kv_lengths="random",
        B=3)
    add("GQA 4:1", Hq=8, Hk=2)
    add("MQA", Hq=4, Hk=1, causal="bottom_right")
    add("Dv != D", D=32, Dv=24)
    add("head dim 40", D=40, Dv=40)
    add("head dim 1", D=1, Dv=1, Nq=N(9), Nk=N(9))
    add(f"head dim {max_head_dim} (the largest claimed)", D=max_head_dim, Dv=max_head_dim,
        B=1, Hq=1, Hk=1, Nq=N(33), Nk=N(47))
    add("tiny values", values="tiny")
    add("ties", values="ties", causal="top_left")
    _distributions(add, N, dtypes, small)
    _expanded(add, N, small)
    _non_finite(add, N)
    _call_checks(add, N)
    if sharded:
        _sharded(add, N)
    if not small:
        for d in (64, 96, 128, 256):
            add(f"head dim {d}", D=d, Dv=d, Nq=257, Nk=1023, causal="bottom_right")
        add("long row 4096", Nq=64, Nk=4096, B=1)
        add("decode Nq=1", Nq=1, Nk=3000, B=4, Hq=8, Hk=2, kv_lengths="random")
    if suite == "full":
        sweep = zip((16, 40, 64, 96, 128, max_head_dim), ("mask", "top_left", "bottom_right",
                                                            "window", "kv_lengths", "none"))
        for (d, kind), dtype in itertools.product(sweep, dtypes):  # each dtype, each kind
            add(f"head dim {d} {kind} 1000x1537 [{dtype}]", B=2, Hq=4, Hk=2, Nq=1000, Nk=1537,
                D=d, Dv=d, dtype=dtype, **_KINDS[kind])
        for dtype in dtypes:
            add(f"long 4096x4096 D=128 [{dtype}]", B=1, Hq=4, Hk=4, Nq=4096, Nk=4096, D=128,
                Dv=128, causal="bottom_right", dtype=dtype)
        add("long 8192x8192 D=64", B=1, Hq=2, Hk=2, Nq=8192, Nk=8192, D=64, Dv=64)
        add("B*H = 1024", B=64, Hq=16, Hk=16, Nq=128, Nk=128)
    return cases


_KINDS = {"none": {}, "mask": dict(mask="random"), "top_left": dict(causal="top_left"),
          "bottom_right": dict(causal="bottom_right"), "window": dict(window=(97, 13)),
          "kv_lengths": dict(kv_lengths="random", causal="bottom_right")}


def edge_cases(dtype="float32"):
    """Sizes at the edges of the tiles kernels use (one row, one key, a tile of 16, 32 or 64
    plus or minus one, a partial last tile in both directions), each with the option that
    moves the edge: causal alignments, a window, kv_lengths of 0 and 1, GQA with Dv != D,
    head dims 1, 40, 96 and 256 with 200. Small enough for the CUDA simulator; the Numba
    kernel's tests run them with every output buffer poisoned."""
    def case(name, **kw):
        base = dict(B=1, Hq=2, Hk=1, Nq=5, Nk=7, D=16, Dv=16, dtype=dtype)
        base.update(kw)
        return Case(name=f"edge: {name}", **base)

    return [
        case("tails 65x33", Nq=65, Nk=33),
        case("one row, one key", Nq=1, Nk=1),
        case("causal top_left 31x45", Nq=31, Nk=45, causal="top_left"),
        case("causal bottom_right 45x31", Nq=45, Nk=31, causal="bottom_right"),
        case("causal bottom_right 7x64", Nq=7, Nk=64, causal="bottom_right"),
        case("causal over tiles and heads 70x75", Hq=2, Hk=1, Nq=70, Nk=75,
             causal="bottom_right"),
        case("window (3, 2) 40x40", Nq=40, Nk=40, window=(3, 2)),
        case("window (0, 0) 9x9", Nq=9, Nk=9, window=(0, 0)),
        case("GQA, Dv != D 9x33", Hq=4, Hk=2, Nq=9, Nk=33, D=16, Dv=24, causal="top_left"),
        case("MQA, head dim 1", Hq=3, Hk=1, Nq=6, Nk=5, D=1, Dv=3),
        case("kv_lengths 0, 1, Nk", B=3, Nq=6, Nk=34, kv_lengths="edges",
             causal="bottom_right"),
        case("mask with empty rows 9x35", B=2, Nq=9, Nk=35, mask="empty-rows"),
        case("mask, one key a row 9x35", B=2, Nq=9, Nk=35, mask="single-key"),
        case("head dim 40, scale 0.05", Nq=9, Nk=12, D=40, Dv=40, scale=0.05),
        case("head dim 96 33x33", Hq=1, Nq=33, Nk=33, D=96, Dv=96, causal="bottom_right"),
        case("head dim 256, Dv 200 17x17", Hq=1, Nq=17, Nk=17, D=256, Dv=200,
             causal="top_left"),
    ]


SCALE_N = 65552  # SCALE_N**2 > 2**32 scores


def scale_cases(dtype, n=SCALE_N, keys=524289, queries=16385, long=131089, cache=2**20 + 7):
    """The scale suite (a GPU's memory): 32-bit index limits crossed, judged on sample_rows.
    The sizes are parameters so that a CPU test can run the same cases small."""
    def case(name, **kw):
        base = dict(B=1, Hq=1, Hk=1, D=64, Dv=64, dtype=dtype, sampled=True)
        base.update(kw)
        return Case(name=name, **base)

    return [
        case("scale: Nq*Nk > 2^32 with a mask", Nq=n, Nk=n, mask="random",
             mask_shape="shared"),
        case("scale: Nq*Nk > 2^32 with a bias", Nq=n, Nk=n, bias="shared"),
        case("scale: B*H*Nk*D > 2^31 (keys)", B=4, Hq=8, Hk=8, Nq=64, Nk=keys, D=128,
             Dv=128),
        case("scale: B*H*Nq*D > 2^31 (queries)", B=64, Hq=16, Hk=16, Nq=queries, Nk=64,
             D=128, Dv=128),
        case("scale: 128k keys, causal, GQA", B=2, Hq=8, Hk=2, Nq=512, Nk=long, D=128,
             Dv=128, causal="bottom_right"),
        case("scale: decoding, 1M-key cache", B=2, Hq=8, Hk=8, Nq=1, Nk=cache, D=128, Dv=128,
             kv_lengths="random"),
    ]


def _aligned(add, small):
    """Tile-aligned shapes beside the awkward ones, so a failure map can tell them apart."""
    sizes, dims = ((64, 128), (64,)) if small else ((64, 128, 256, 1024), (64, 128))
    for n, d in itertools.product(sizes, dims):
        add(f"aligned {n}x{n} D={d}", B=1, Hq=2, Hk=2, Nq=n, Nk=n, D=d, Dv=d)


def _scales(add, N):
    add("scale 1.0", scale=1.0)
    add("scale 0.01 (small)", scale=0.01)
    add("scale 3.0 (large)", scale=3.0, Nq=N(40), Nk=N(50))
    add("scale 0", scale=0.0, Nq=N(20), Nk=N(30))
    add("scale 0 + causal", scale=0.0, causal="top_left", Nq=N(40), Nk=N(40))
    add("scale -0.25 + causal", scale=-0.25, causal="bottom_right", Nq=N(30), Nk=N(45))
    add("scale -1.0 + mask", scale=-1.0, mask="random", Nq=N(30), Nk=N(45))


def _masks_and_bias(add, N):
    add("mask diagonal", mask="diagonal", Nq=N(30), Nk=N(30))
    add("mask single key", mask="single-key", Nq=N(40), Nk=N(50))
    add("mask empty rows", mask="empty-rows", Nq=N(40), Nk=N(50))
    add("mask per head (B, Hq, Nq, Nk)", mask="random", mask_shape="head", Hq=3, Hk=3,
        Nq=N(33), Nk=N(40))
    add("mask per head + GQA", mask="empty-rows", mask_shape="head", Hq=4, Hk=2, Nq=N(20),
        Nk=N(24))
    add("mask shared (1, 1, Nq, Nk)", mask="random", mask_shape="shared", Nq=N(33), Nk=N(40))
    add("bias per head (B, Hq, Nq, Nk)", bias="random", Hq=3, Hk=3, Nq=N(33), Nk=N(40))
    add("bias with -inf (B, 1, Nq, Nk)", bias="neg-inf", Nq=N(33), Nk=N(40))
    add("bias ALiBi slopes (1, Hq, Nq, Nk)", bias="alibi", Hq=4, Hk=4, Nq=N(40), Nk=N(40),
        causal="bottom_right")
    add("bias shared (1, 1, Nq, Nk)", bias="shared", Nq=N(33), Nk=N(40))
    add("bias + mask + kv_lengths", bias="random", mask="random", kv_lengths="random", B=3,
        Nq=N(30), Nk=N(40))


def _block_sparse(add, N):
    """Block-sparse masks (BLOCK_MASKS) at sizes that are no multiple of BLOCK, so the last
    blocks are cut by the plane's edges."""
    add("block-sparse blocks", mask="blocks", Nq=N(100), Nk=N(120))
    add("block-sparse one block", mask="blocks-one", Nq=N(100), Nk=N(90))
    add("block-sparse empty block rows", mask="blocks-empty-rows", mask_shape="head", Hq=3,
        Hk=3, Nq=N(90), Nk=N(100))
    add("block-sparse dense + causal", mask="blocks-dense", causal="bottom_right",
        Nq=N(90), Nk=N(100))
    add("block-sparse ragged blocks", mask="blocks-ragged", Nq=N(100), Nk=N(110))
    add("block-sparse blocks + kv_lengths", mask="blocks", kv_lengths="random", B=3,
        Nq=N(80), Nk=N(120))


def _distributions(add, N, dtypes, small):
    """The values real models produce (VALUES), each judged per (batch, head): disparity
    across heads, batch elements, query rows and keys, outlier channels, heavy tails and
    scores whose products cancel (at
    the first dtype in the quick suite, every dtype otherwise), and each dtype's limits."""
    b = 1 if small else 2  # the simulator runs the quick suite: a block a (batch, head)
    shapes = {"heads-held": dict(B=b, Hq=4, Hk=4), "heads-free": dict(B=b, Hq=4, Hk=4),
              "batch-held": dict(B=4, Hq=1, Hk=1), "batch-free": dict(B=4, Hq=1, Hk=1),
              "rows": dict(B=1, Hq=b, Hk=b, Nq=64, Nk=40),
              "keys": dict(B=1, Hq=b, Hk=b, Nq=24, Nk=64),
              "outliers": dict(B=b, D=32, Dv=32), "heavy-tails": dict(B=b),
              "cancelling": dict(B=b)}
    for dtype in dtypes[:1] if small else dtypes:
        for kind, kw in shapes.items():
            add(f"values {kind} [{dtype}]", values=kind, dtype=dtype,
                **dict(dict(Nq=24 if small else 40, Nk=40 if small else 48), **kw))
    if not small:
        add("values heads-held, GQA 2:1, causal", values="heads-held", Hq=8, Hk=4,
            causal="bottom_right", Nq=70, Nk=90)
    for dtype in dtypes:
        for kind in ("score-limit", "value-limit", "subnormal"):
            add(f"values {kind} [{dtype}]", values=kind, dtype=dtype, B=b, Nq=N(33),
                Nk=N(40))


def _expanded(add, N, small):
    """q, k and v as stride-0 views (EXPANDED), and expanded keys at lengths one past a
    multiple of 32."""
    n = 17 if small else 33
    add("expanded over batch", expanded="batch", B=3, Hq=1, Hk=1, Nq=n, Nk=40)
    add("expanded over heads", expanded="heads", B=1, Hq=4, Hk=4, Nq=n, Nk=40)
    add("expanded over the sequence", expanded="sequence", B=1, Nq=n, Nk=40)
    for nk in (33,) if small else (33, 65, 129):
        add(f"expanded over heads, Nk = {nk}", expanded="heads", B=1 if small else 2, Hq=4,
            Hk=4, Nq=N(20), Nk=nk)


def _non_finite(add, N):
    """Non-finite values: in keys no row sees (past kv_lengths, masked), in keys some rows see
    and others do not (under each kind of masking), and in a visible key."""
    add("NaN past kv_lengths", values="nan-hidden", kv_lengths="random", B=3)
    add("inf in masked keys", values="inf-hidden", mask="random")
    add("NaN in a visible key", values="nan-visible", causal="top_left", Nq=N(40), Nk=N(40))
    setups = [  # (poison, where some rows see it and others not)
        ("k:nan", dict(causal="top_left")), ("v:nan", dict(window=(3, 2))),
        ("k:inf", dict(mask="random")), ("v:inf", dict(kv_lengths="random", B=3,
                                                       causal="bottom_right")),
        ("k:-inf", dict(causal="bottom_right", Nq=N(50), Nk=N(30))),
        ("v:-inf", dict(mask="random", mask_shape="head")),
        ("v:nan", dict(bias="neg-inf")),
        # K's -inf gives a score of -inf in the rows with q > 0 there (the key takes no
        # part: its NaN in V reaches nothing) and +inf in the others (NaN rows).
        ("k:-inf,v:nan", dict(mask="random")),
    ]
    for poison, kw in setups:
        where = "+".join(f"{k}={v}" for k, v in kw.items() if k in ("causal", "window",
                                                                    "mask", "kv_lengths",
                                                                    "bias"))
        kw = dict(dict(Nq=N(40), Nk=N(40)), **kw)
        add(f"{poison} in keys some rows see ({where})", poison=poison, **kw)


def _sharded(add, N):
    """Where attention split across ranks by sequence breaks (for any world size up to 8
    and either shard layout): lengths no world size divides, the causal band across shard
    edges (load-balanced layouts put a rank's rows far apart), ranks whose keys are all
    hidden or hide NaN, ranks' parts of a row far apart (the merge's overflow)."""
    add("ranks: lengths no world size divides (61x67), causal", Nq=N(61), Nk=N(67),
        causal="top_left")
    add("ranks: causal bottom_right, fewer rows than keys", Nq=N(23), Nk=N(67),
        causal="bottom_right")
    add("ranks: window (5, 3) across shard edges", Nq=N(64), Nk=N(64), window=(5, 3))
    add("ranks: GQA 2:1, causal", Hq=4, Hk=2, causal="top_left", Nq=N(45), Nk=N(45))
    add("ranks: more ranks than rows (3x5)", Nq=3, Nk=5, causal="bottom_right")
    add("ranks: all keys past the first shard hidden", kv_lengths="prefix", Nq=N(45),
        Nk=N(67))
    add("ranks: NaN in every hidden key of the later shards", kv_lengths="prefix",
        values="nan-hidden", Nq=N(45), Nk=N(67), causal="bottom_right")
    add("ranks: large scores, causal (parts far apart)", values="large", causal="top_left",
        Nq=N(61), Nk=N(61))
    add("ranks: determinism, causal", repeat=True, causal="top_left", Nq=N(61), Nk=N(61))


def _call_checks(add, N):
    """What every kernel must do at its minimal claim (first dtype, no mask, Hq = Hk)."""
    add("strided inputs", strided=True, causal="top_left", Hq=4, Hk=2)
    add("strided inputs (minimal)", strided=True, Nq=N(37), Nk=N(41))
    add("determinism", repeat=True, Nq=N(100), Nk=N(100), mask="random")
    add("determinism (minimal)", repeat=True, Nq=N(45), Nk=N(61))
    for check in CHECKS:
        if check == "hidden-keys":  # on a block-sparse mask (it needs keys rows do not see)
            add(f"call check: {check}", check=check, mask="blocks", Nq=N(80), Nk=N(96))
        else:
            add(f"call check: {check}", check=check, B=3, Nq=N(33), Nk=N(47))
