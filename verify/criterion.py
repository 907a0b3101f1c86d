"""The error criterion: one rule for the whole project.

A kernel computing in low precision cannot match float64 exactly; what it can be held to is
doing no worse than the plainest implementation in the same precision. Each output tensor is
judged slice by slice, one slice per (batch, head) (the whole tensor where it has no such
axes), each slice against its own values:

    error(kernel) = max |kernel - truth| over the slice   truth: float64 from the same inputs
    error(plain)  = max |plain  - truth| over the slice   plain: reference.attention_lowp
    passes  <=>   error(kernel) <= K * error(plain) + floor, in every slice
    floor     =   FLOOR_ULPS[dtype] * (eps(dtype) * max|truth| + UNDERFLOW[dtype])
                + 2 * u * max_i r_i                           (out; the slice's own)
                + 2 * u * max_i t_i                           (lse; the slice's own)

and the non-finite values (NaN, +-inf) sit at exactly the places where the truth has them
(which non-finite value is not checked: docs/contract.md says why), a truth past the dtype's
largest value counting as the inf it rounds to, and an inf of the truth's sign taken where
the truth lies within the bound of the dtype's largest value (either side of the overflow
is then within the rule: 65500 in float16 with a bound of 128 may come back as inf). K = 2, as
flash-attn's own tests use. The floor is a few units of the output dtype's resolution at the
slice's own scale (FLOOR_ULPS): it covers the final rounding to the output dtype, which even a
perfect kernel cannot avoid, and cases where the plain implementation happens to be exact.
UNDERFLOW is what values at the bottom of the dtype's range may lose:
float16 keeps its subnormals, float32 and bfloat16 may flush below 2^-126. lse, a logarithm,
is judged at the scale max(1, max|lse|): its rounding near 0 is absolute.

Why per slice: the heads of a batch are independent problems, and a head whose values are
2^20 smaller than another's is as real as the large one (models hold such heads). Judged
against the largest head, a kernel that loses the small head entirely (one scale for the
whole tensor, in a format of narrow range) passes; judged against its own values, it fails.

The second term of the floor is what summing each score in float32 can do, which no
float32 computation avoids (u = 2^-24; scores are float32 in every kernel, whatever the
input dtype). A score s_ij (natural-log units) summed in float32 from its terms, in any
order (the tensor cores cut each step's terms to the accumulator's ulp, toward zero), errs
by a few u a_ij, a_ij = |scale| sum_d |q_id k_jd| + |bias_ij| (>= |s_ij|: its one rounding
included). That moves out_i by at most u r_i, r_i = sum_j p_ij a_ij (max|v_j| + max|out_i|)
(reference.score_sensitivity: only the pairs that carry weight count; a key with a huge
value and no weight adds nothing), and lse_i by at most u t_i, t_i = sum_j p_ij a_ij
(reference.lse_sensitivity). With scores of ordinary size the out term is one to four
times the first (a few float32 units at the output's scale) and lse's a fraction of a unit.
It dominates where the scores are large (|s| in the thousands) or their terms cancel (a_ij
>> |s_ij|: large inputs whose products nearly sum to 0), and rightly: there the error of a
correct kernel and of the plain implementation are both of this size but land on different
rows by chance, and "within 2x of plain" alone fails correct kernels at random
(docs/findings.md: both tensor-core forwards on an H200, lse of a score that cancels).

Why the plain implementation's error is the right yardstick: the a-priori bound of the
online-softmax algorithm in float32 (for one row, n visible keys, values bounded by |v|max) is

    |out - truth| <= (c1 * D + c2 * n) * u * |v|max + rounding of inputs and output,  u = 2^-24

with small constants, the same form as the direct computation's: tiling only reorders the sums
and adds one multiply per tile (alpha), so a correct kernel lands within a small factor of the
plain implementation, while the bugs that matter (a missed rescale, an off-by-one mask, a
dropped tile) produce errors of the size of the output itself.

Precision, measured: each Comparison also gives the error in units of eps(dtype) at the
slice's own scale (`ulps`, the worst slice), beside the plain implementation's (`plain_ulps`).
A float32 kernel whose products carry 22 bits (float16 halves) or 11 (TF32) shows it there
even where it passes.
"""
from dataclasses import asdict, dataclass

import numpy as np

from reference.dtypes import EPS, cast  # machine epsilon per dtype

K = 2.0
# The floor, in units of eps(dtype) at the output's scale. For float16 / bfloat16 the output's
# own rounding dominates: 2 units. For float32 a correct kernel still differs from the plain
# implementation by more than its rounding: the GPU's exp2 is approximate (ex2.approx, ~2 ulp
# per weight) and sums run in another order; 16 units (2e-6 relative) cover
# that, and are still ~500x below the error of TF32 arithmetic slipping into a float32 kernel.
FLOOR_ULPS = {"float16": 2.0, "bfloat16": 2.0, "float32": 16.0, "float64": 16.0}
# The magnitude below which a result may lose its value (docs/contract.md, "Accuracy"): float16
# keeps its subnormals (2^-24, its smallest, is the quantum there); float32 and bfloat16 may
# flush below 2^-126, their smallest normal (fast-math GPU code does; no attention value lives
# there).
UNDERFLOW = {"float16": 2.0**-24, "bfloat16": 2.0**-126, "float32": 2.0**-126,
             "float64": 2.0**-1022}
# The largest finite value of each dtype: past it (by half a unit) a value rounds to inf.
LARGEST = {"float16": 65504.0, "bfloat16": (2.0 - 2.0**-7) * 2.0**127,
           "float32": (2.0 - 2.0**-23) * 2.0**127, "float64": float(np.finfo(np.float64).max)}


@dataclass
class Comparison:
    """How one computed tensor compares with the truth, and whether it meets the criterion.
    The bound, plain error and ulps are the worst slice's (the slice with the largest
    error / bound); the error figures and indices are over the whole tensor."""

    name: str
    passed: bool
    max_abs_error: float  # over the finite positions
    max_rel_error: float  # |err| / max(|truth|, tiny), over the finite positions
    normwise_rel_error: float  # ||err||_2 / ||truth||_2
    bound: float  # K * plain error + floor, of the worst slice
    plain_error: float  # of the worst slice
    worst_index: tuple  # index of the largest absolute error
    worst_rel_index: tuple
    mismatched: int  # elements over their slice's bound, or non-finite in the wrong place
    total: int
    nonfinite_mismatch: int
    worst_slice: tuple = ()  # (batch, head) of the largest error / bound; () for a 1-d tensor
    worst_ratio: float = 0.0  # error / bound of that slice
    slices_failed: int = 0
    slices: int = 1
    ulps: float = 0.0  # the largest slice error in units of eps(dtype) at the slice's scale
    plain_ulps: float = 0.0  # the same for the plain implementation
    dtype: str = ""

    @property
    def ratio(self):
        """error / bound of the worst slice: < 1 passes (non-finite values aside)."""
        return self.worst_ratio

    @property
    def effective_bits(self):
        """The significand bits the worst slice's error leaves: log2(1 / (ulps * eps)),
        24 for a float32 kernel whose error is one unit of float32."""
        return float(np.log2(1.0 / (max(self.ulps, 0.5) * EPS[self.dtype]))) \
            if self.dtype in EPS else float("nan")

    def to_dict(self):
        d = asdict(self)
        d["ratio"] = self.ratio
        d["effective_bits"] = self.effective_bits
        for key in ("worst_index", "worst_rel_index", "worst_slice"):
            d[key] = list(d[key])
        return d

    def message(self):
        """Like numpy's and torch's assertion messages, with the slice that fails worst."""
        pct = 100.0 * self.mismatched / max(1, self.total)
        lines = [f"{self.name}: mismatched elements {self.mismatched} / {self.total} ({pct:.3g}%)"]
        if self.nonfinite_mismatch:
            lines.append(f"  non-finite values in the wrong places: {self.nonfinite_mismatch}")
        where = f" in (batch, head) {self.worst_slice}" if self.worst_slice else ""
        lines.append(f"  worst slice{where}: error {self.worst_ratio:.3g} x its bound "
                     f"{self.bound:.3g} (= {K:g} x plain {self.plain_error:.3g} + floor); "
                     f"{self.slices_failed} of {self.slices} slices fail")
        lines.append(f"  greatest absolute difference {self.max_abs_error:.3g} at index "
                     f"{self.worst_index}")
        lines.append(f"  greatest relative difference {self.max_rel_error:.3g} at index "
                     f"{self.worst_rel_index}; normwise relative error "
                     f"{self.normwise_rel_error:.3g}")
        lines.append(f"  precision: {self.ulps:.3g} units of {self.dtype} at the slice's scale "
                     f"(plain {self.plain_ulps:.3g}; {self.effective_bits:.1f} bits)")
        return "\n".join(lines)


U_SCORES = 2.0**-24  # unit roundoff of float32, the precision scores are computed in


def floor(dtype, truth_scale, score_term=0.0, at_least=0.0):
    """The part of the bound no kernel can avoid: rounding the output to `dtype` at the scale
    max(at_least, truth_scale), and losing what lies below UNDERFLOW[dtype], plus score_term
    (score_rounding). Takes arrays (one value per slice) as well as numbers."""
    return FLOOR_ULPS[dtype] * (EPS[dtype] * np.maximum(at_least, truth_scale)
                                + UNDERFLOW[dtype]) + score_term


def score_rounding(q, k, v, options, truth, rows=None):
    """2 u max_i r_i per (batch, query head) slice, (B, Hq): what summing each score in
    float32 can do to the output (see the module's docstring), with r_i
    reference.score_sensitivity's figure for row i: the pairs that carry weight, their
    scores' terms and their values. truth: (out, lse) of reference.attention for these
    inputs."""
    import reference

    r = reference.score_sensitivity(q, k, v, rows=rows, truth=truth, **options)
    return 2.0 * U_SCORES * np.asarray(_host(r)).max(axis=-1, initial=0.0)


def lse_score_rounding(q, k, v, options, truth, rows=None):
    """2 u max_i t_i per (batch, query head) slice, (B, Hq): what float32 sums of the scores'
    terms can do to lse (see the module's docstring), with t_i reference.lse_sensitivity's
    figure for row i. truth: (out, lse) of reference.attention for these inputs."""
    import reference

    t = reference.lse_sensitivity(q, k, v, rows=rows, truth=truth, **options)
    return 2.0 * U_SCORES * np.asarray(_host(t)).max(axis=-1, initial=0.0)


def slice_abs_max(x):
    """max |x| over the finite elements of each (batch, head) slice of a (B, H, ...) array:
    (B, H) float64."""
    x = np.asarray(x)
    return np.array([[finite_abs_max(x[b, h]) for h in range(x.shape[1])]
                     for b in range(x.shape[0])], dtype=np.float64).reshape(x.shape[:2])


def per_query_head(per_key_head, heads_q):
    """(B, Hk) figures repeated for the query heads of each group: (B, Hq)."""
    return np.repeat(per_key_head, heads_q // max(1, per_key_head.shape[1]), axis=1)


def finite_abs_max(x):
    """max |x| over the finite elements (0 if none), a slice at a time: x may be billions of
    elements (the scale suite)."""
    x = np.asarray(x)
    x = x.reshape((-1,) + x.shape[-1:]) if x.ndim else x.reshape(1, 1)
    step = max(1, (1 << 24) // max(1, x.shape[-1]))
    best = 0.0
    for i in range(0, x.shape[0], step):
        part = x[i:i + step]
        top = float(np.abs(part).max(initial=0))  # exact in the array's own dtype
        if not np.isfinite(top):  # some inf or NaN: the finite elements alone
            part = np.abs(part.astype(np.float64))
            top = float(part[np.isfinite(part)].max(initial=0.0))
        best = max(best, top)
    return best


def compare(name, got, truth, plain, dtype, score_term=0.0, at_least=0.0):
    """Compare `got` with `truth` (float64) under the criterion; `plain` is attention_lowp's.

    All three are NumPy arrays of one shape, (B, H, ...) judged per (batch, head) slice (any
    other shape as one slice); score_term: score_rounding's figure, per slice (B, H) or one
    number; at_least: the smallest scale the floor takes (1 for lse). Never raises on bad
    values: NaN, inf and huge errors are reported, not thrown.
    """
    raw = np.asarray(truth, dtype=np.float64)  # before a truth past the range becomes inf
    truth, err, plain_err, rel, same_nonfinite = _errors(got, truth, plain, dtype)
    lead = truth.shape[:2] if truth.ndim >= 3 else ()
    rows = int(np.prod(lead)) if lead else 1
    width = truth.size // rows if rows else 0  # elements a slice (a tensor may be empty)
    err_s, plain_s, scale_s = (a.reshape(rows, width).max(axis=1, initial=0.0) for a in (
        err, plain_err, np.where(np.isfinite(raw), np.abs(raw), 0.0)))
    term = np.broadcast_to(np.asarray(score_term, dtype=np.float64), lead).reshape(rows) \
        if lead else float(np.max(score_term))
    bound_s = K * plain_s + floor(dtype, scale_s, term, at_least)
    bound = np.broadcast_to(bound_s[:, None], (rows, width)).reshape(truth.shape)
    same_nonfinite |= _across_overflow(got, raw, bound, dtype)
    over = (err.reshape(rows, width) > bound_s[:, None]).reshape(truth.shape) | ~same_nonfinite
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio_s = np.where(bound_s > 0, err_s / bound_s, np.where(err_s > 0, np.inf, 0.0))
    worst = int(np.argmax(ratio_s)) if rows else 0
    norm_t = float(np.linalg.norm(truth[np.isfinite(truth)]))
    return Comparison(
        name=name,
        passed=not over.any(),
        max_abs_error=float(err.max(initial=0.0)),
        max_rel_error=float(rel.max(initial=0.0)),
        normwise_rel_error=float(np.linalg.norm(err)) / norm_t if norm_t > 0 else 0.0,
        bound=float(bound_s[worst]) if rows else 0.0,
        plain_error=float(plain_s[worst]) if rows else 0.0,
        worst_index=_argmax(err),
        worst_rel_index=_argmax(rel),
        mismatched=int(over.sum()),
        total=int(truth.size),
        nonfinite_mismatch=int((~same_nonfinite).sum()),
        worst_slice=tuple(int(i) for i in np.unravel_index(worst, lead)) if rows and lead
        else (),
        worst_ratio=float(ratio_s[worst]) if rows else 0.0,
        slices_failed=int(over.reshape(rows, width).any(axis=1).sum()),
        slices=rows,
        **_units(err_s, plain_s, scale_s, bound_s, dtype, at_least),
        dtype=dtype,
    )


def _errors(got, truth, plain, dtype):
    """(truth, |got - truth|, |plain - truth|, relative error, where got and truth are
    alike finite or not), float64; 0 where either is not finite. A truth past the dtype's
    largest value is the inf it rounds to."""
    got, truth, plain = (np.asarray(x, dtype=np.float64) for x in (got, truth, plain))
    with np.errstate(over="ignore", invalid="ignore"):
        truth = np.where(np.isinf(cast(truth, dtype)), np.sign(truth) * np.inf, truth)
    fin_t, fin_g = np.isfinite(truth), np.isfinite(got)
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.where(fin_t & fin_g, np.abs(got - truth), 0.0)
        plain_err = np.where(fin_t & np.isfinite(plain), np.abs(plain - truth), 0.0)
        rel = np.where(fin_t & fin_g, err / np.maximum(np.abs(truth),
                                                       np.finfo(np.float64).tiny), 0.0)
    return truth, err, plain_err, rel, fin_t == fin_g


def _across_overflow(got, truth, bound, dtype):
    """Where the truth (float64, as computed) and got lie within `bound` of each other on the
    two sides of the dtype's overflow: an inf of the truth's sign where the truth is within
    the bound of the dtype's largest value, or a finite value within the bound of a truth
    past it. Both are within the rule."""
    got = np.asarray(got, dtype=np.float64)
    big = LARGEST[dtype]
    with np.errstate(invalid="ignore", over="ignore"):
        same_sign = np.sign(got) == np.sign(truth)
        inf_for_near = np.isinf(got) & np.isfinite(truth) & (np.abs(truth) + bound >= big)
        near_for_past = np.isfinite(got) & np.isfinite(truth) & (np.abs(truth) > big) \
            & (np.abs(truth) - np.abs(got) <= bound)
        return same_sign & (inf_for_near | near_for_past)


def _units(err_s, plain_s, scale_s, bound_s, dtype, at_least):
    """{ulps, plain_ulps}: the largest slice error of the kernel and of the plain
    implementation in units of eps(dtype) at the slice's own scale, over the slices whose
    scale the floor's absolute parts (UNDERFLOW, the score term) do not dwarf: not a truth
    of 0, nor a cancellation's remainder far below the floor."""
    unit = EPS[dtype] * np.maximum(at_least, scale_s)
    measured = 1024 * unit > bound_s - K * plain_s - FLOOR_ULPS[dtype] * unit  # never for 0
    with np.errstate(divide="ignore", invalid="ignore"):
        return dict(ulps=float((err_s / unit)[measured].max(initial=0.0)),
                    plain_ulps=float((plain_s / unit)[measured].max(initial=0.0)))


def _argmax(x):
    if x.size == 0:
        return ()
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(x)), x.shape))


def judge(q, k, v, out, lse=None, dtype=None, rows=None, **options):
    """Compare a kernel's (out, lse) for inputs q, k, v with the reference.

    q, k, v: NumPy or CuPy arrays (CuPy: the truth is computed on the GPU, in float64); dtype:
    the precision the kernel was given, when q holds its values in a wider type (CuPy has no
    bfloat16). rows: out and lse hold only these query rows (reference.attention's rows).
    options are the contract's keyword arguments. Returns a list of Comparison, one for out
    and one for lse when given.
    """
    import reference

    dtype = dtype or reference.dtype_name(q)
    truth, truth_lse = reference.attention(q, k, v, return_lse=True, rows=rows, **options)
    plain, plain_lse = reference.attention_lowp(q, k, v, return_lse=True, dtype=dtype,
                                                rows=rows, **options)
    term = score_rounding(q, k, v, options, (truth, truth_lse), rows)
    result = [compare("out", out, _host(truth), _host(plain), dtype, term)]
    if lse is not None:
        lse_term = lse_score_rounding(q, k, v, options, (truth, truth_lse), rows)
        result.append(compare("lse", lse, _host(truth_lse), _host(plain_lse), "float32",
                              lse_term, at_least=1.0))
    return result


def judge_backward(q, k, v, dout, grads, dtype=None, **options):
    """Compare a kernel's (dq, dk, dv) for inputs q, k, v and incoming gradient dout with the
    reference's, under the same rule as the forward: one Comparison per gradient, the plain
    implementation being reference.attention_backward_lowp, the floor's score term
    gradient_score_rounding's."""
    import reference

    dtype = dtype or reference.dtype_name(q)
    truth = reference.attention_backward(q, k, v, dout, **options)
    plain = reference.attention_backward_lowp(q, k, v, dout, dtype=dtype, **options)
    terms = gradient_score_rounding(q, k, v, dout, options, dtype)
    return [compare(name, g, _host(t), _host(p), dtype, term)
            for name, g, t, p, term in zip(("dq", "dk", "dv"), grads, truth, plain, terms)]


def gradient_score_rounding(q, k, v, dout, options, dtype="float32"):
    """(dq, dk, dv) terms of the floor, per slice ((B, Hq) for dq, (B, Hk) for dk and dv):
    what rounding the scores to float32 once can do to each gradient. A backward kernel
    recomputes P = exp(S - lse) in float32, so each weight carries a relative error up to
    d = 2 u max|lse| (as in the forward's score_rounding). Through dV = P^T dO that moves dV
    by at most d max(P^T |dO|); through dS = P (dP - delta), with |dP_ij| <= ||dO_i||_1
    max|v|, it moves each dS_ij by at most 3 d P_ij ||dO_i||_1 max|v|, hence dQ = dS K scale
    by 3 d scale max|k| max|v| max_i ||dO_i||_1, and dK = dS^T Q scale by 3 d scale max|q|
    max|v| max_j sum_c (P^T |dO|)_jc. P^T |dO| is the truth's dV for the incoming gradient
    |dO|. dP - delta itself cancels: rounding dP and delta (each at most ||dO_i||_1 max|v|)
    errs by up to 2 u ||dO_i||_1 max|v| each, so dQ's and dK's terms take 3 d + 4 u (a row
    that puts all its weight on one key has dS = 0 exactly in the truth, and a float32
    kernel's dS there is this rounding). And a backward takes delta = rowsum(dO * O) from the
    forward's O, held in `dtype`: O's rounding and the forward's own error, 2 eps(dtype) |O|
    with |O| <= max|v|, move delta by up to 2 eps(dtype) ||dO_i||_1 max|v| (in 16 bits the
    largest part where dP - delta cancels: a row whose weight is nearly all on one key). A
    key head's terms take the largest of its query heads'."""
    import reference

    _, lse = reference.attention(q, k, v, return_lse=True, **options)
    lse = np.asarray(_host(lse), dtype=np.float64)
    d = 2.0 * U_SCORES * np.where(np.isfinite(lse), np.abs(lse), 0.0).max(axis=-1,
                                                                           initial=0.0)
    dout_abs = np.abs(np.asarray(_host(dout), dtype=np.float64))
    dout_abs = np.where(np.isfinite(dout_abs), dout_abs, 0.0)
    clean = [np.where(np.isfinite(x), x, 0.0) for x in
             (np.asarray(_host(y), dtype=np.float64) for y in (q, k, v))]
    weight = reference.attention_backward(*clean, dout_abs, **options)[2]  # P^T |dO|
    scale = abs(reference.check_attention_args(q, k, v, **options).scale)
    qmax, kmax, vmax = (slice_abs_max(_host(x)) for x in (q, k, v))
    heads_q, heads_k = qmax.shape[1], kmax.shape[1]
    row_l1 = dout_abs.sum(axis=-1).max(axis=-1, initial=0.0)  # (B, Hq)
    # dS's relative error: the scores', dP - delta's rounding, and delta's from O in dtype
    ds = 3.0 * d + 4.0 * U_SCORES + 2.0 * EPS[dtype]
    by_key_head = (ds * qmax).reshape(d.shape[0], heads_k, -1).max(axis=-1)  # (B, Hk)
    d_key = d.reshape(d.shape[0], heads_k, -1).max(axis=-1)
    return (ds * scale * per_query_head(kmax * vmax, heads_q) * row_l1,
            by_key_head * scale * vmax * weight.sum(axis=-1).max(axis=-1, initial=0.0),
            d_key * weight.max(axis=(-2, -1), initial=0.0))


def _host(x):
    return x.get() if hasattr(x, "get") else x
