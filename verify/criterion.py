"""The error criterion: one rule for the whole project.

A kernel computing in low precision cannot match float64 exactly; what it can be held to is
doing no worse than the plainest implementation in the same precision. For each output tensor:

    error(kernel) = max |kernel - truth|                  truth: float64 from the same inputs
    error(plain)  = max |plain  - truth|                  plain: reference.attention_lowp
    passes  <=>   error(kernel) <= K * error(plain) + floor
    floor     =   FLOOR_ULPS[dtype] * eps(dtype) * max(1, max|truth|)      (out and lse)
                + 2 * u * max|lse| * max|v|                                (out only)

and the non-finite values (NaN, +-inf) sit at exactly the places where the truth has them
(which non-finite value is not checked: docs/contract.md says why). K = 2, as
flash-attn's own tests use. The floor is a few units of the output dtype's resolution at the
scale of the output (FLOOR_ULPS): it covers the final rounding to the output dtype, which even
a perfect kernel cannot avoid, and cases where the plain implementation happens to be exact.

The second term of the floor is the one rounding of the scores that no float32 computation can
avoid (u = 2^-24, scores are float32 in every kernel, whatever the input dtype). A score s
(natural-log units) held in float32 carries an error up to u |s|; shifting the log-weights by
at most d moves a softmax average of v by at most 2 d max|v|, and the scores that carry weight
lie within a few units of the row's lse. With scores of ordinary size this term is one to
four times the first (a few float32 units at the output's scale); with large scores (|s| in
the thousands) it dominates, and rightly: there the error of a correct kernel and of the plain
implementation are both of this size but land on different rows by chance, and "within 2x of
plain" alone fails correct kernels at random.

Why the plain implementation's error is the right yardstick: the a-priori bound of the
online-softmax algorithm in float32 (for one row, n visible keys, values bounded by |v|max) is

    |out - truth| <= (c1 * D + c2 * n) * u * |v|max + rounding of inputs and output,  u = 2^-24

with small constants, the same form as the direct computation's: tiling only reorders the sums
and adds one multiply per tile (alpha), so a correct kernel lands within a small factor of the
plain implementation, while the bugs that matter (a missed rescale, an off-by-one mask, a
dropped tile) produce errors of the size of the output itself.
"""
from dataclasses import asdict, dataclass

import numpy as np

from reference.dtypes import EPS  # machine epsilon per dtype

K = 2.0
# The floor, in units of eps(dtype) at the output's scale. For float16 / bfloat16 the output's
# own rounding dominates: 2 units. For float32 a correct kernel still differs from the plain
# implementation by more than its rounding: the GPU's exp2 is approximate (ex2.approx, ~2 ulp
# per weight) and sums run in another order; 16 units (2e-6 relative) cover
# that, and are still ~500x below the error of TF32 arithmetic slipping into a float32 kernel.
FLOOR_ULPS = {"float16": 2.0, "bfloat16": 2.0, "float32": 16.0, "float64": 16.0}


@dataclass
class Comparison:
    """How one computed tensor compares with the truth, and whether it meets the criterion."""

    name: str
    passed: bool
    max_abs_error: float  # over the finite positions
    max_rel_error: float  # |err| / max(|truth|, tiny), over the finite positions
    normwise_rel_error: float  # ||err||_2 / ||truth||_2
    bound: float  # K * plain error + floor
    plain_error: float
    worst_index: tuple  # index of the largest absolute error
    worst_rel_index: tuple
    mismatched: int  # elements over the bound, or non-finite in the wrong place
    total: int
    nonfinite_mismatch: int

    @property
    def ratio(self):
        """error / bound: < 1 passes."""
        return self.max_abs_error / self.bound if self.bound > 0 else float("inf")

    def to_dict(self):
        d = asdict(self)
        d["ratio"] = self.ratio
        d["worst_index"] = list(self.worst_index)
        d["worst_rel_index"] = list(self.worst_rel_index)
        return d

    def message(self):
        """Like numpy's and torch's assertion messages."""
        pct = 100.0 * self.mismatched / max(1, self.total)
        lines = [f"{self.name}: mismatched elements {self.mismatched} / {self.total} ({pct:.3g}%)"]
        if self.nonfinite_mismatch:
            lines.append(f"  non-finite values in the wrong places: {self.nonfinite_mismatch}")
        lines.append(f"  greatest absolute difference {self.max_abs_error:.3g} at index "
                     f"{self.worst_index} (allowed {self.bound:.3g} = {K:g} x plain "
                     f"{self.plain_error:.3g} + floor)")
        lines.append(f"  greatest relative difference {self.max_rel_error:.3g} at index "
                     f"{self.worst_rel_index}; normwise relative error "
                     f"{self.normwise_rel_error:.3g}")
        return "\n".join(lines)


U_SCORES = 2.0**-24  # unit roundoff of float32, the precision scores are computed in


def floor(dtype, truth_scale, score_term=0.0):
    """The part of the bound no kernel can avoid: rounding the output to `dtype`, plus
    score_term (score_rounding)."""
    return FLOOR_ULPS[dtype] * EPS[dtype] * max(1.0, truth_scale) + score_term


def score_rounding(lse, v):
    """2 u max|lse| max|v|: what rounding each score to float32 once can do to the output (see
    the module's docstring). lse: the truth's (natural log); v: the values; finite parts only."""
    lse = np.asarray(lse, dtype=np.float64)
    s = float(np.abs(lse[np.isfinite(lse)]).max(initial=0.0))
    return 2.0 * U_SCORES * s * finite_abs_max(v)


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


def compare(name, got, truth, plain, dtype, score_term=0.0):
    """Compare `got` with `truth` (float64) under the criterion; `plain` is attention_lowp's.

    All three are NumPy arrays of one shape; score_term is score_rounding's figure for `out`.
    Never raises on bad values: NaN, inf and huge errors are reported, not thrown.
    """
    got = np.asarray(got, dtype=np.float64)
    truth = np.asarray(truth, dtype=np.float64)
    plain = np.asarray(plain, dtype=np.float64)
    fin_t, fin_g = np.isfinite(truth), np.isfinite(got)
    same_nonfinite = fin_t == fin_g
    both = fin_t & fin_g
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.where(both, np.abs(got - truth), 0.0)
        plain_err = np.where(fin_t & np.isfinite(plain), np.abs(plain - truth), 0.0)
    scale = float(np.abs(truth[fin_t]).max()) if fin_t.any() else 0.0
    bound = K * float(plain_err.max(initial=0.0)) + floor(dtype, scale, score_term)
    rel = err / np.maximum(np.abs(truth), np.finfo(np.float64).tiny)
    rel = np.where(both, rel, 0.0)
    norm_t = float(np.linalg.norm(truth[fin_t])) if fin_t.any() else 0.0
    over = (err > bound) | ~same_nonfinite
    return Comparison(
        name=name,
        passed=not over.any(),
        max_abs_error=float(err.max(initial=0.0)),
        max_rel_error=float(rel.max(initial=0.0)),
        normwise_rel_error=float(np.linalg.norm(err)) / norm_t if norm_t > 0 else 0.0,
        bound=bound,
        plain_error=float(plain_err.max(initial=0.0)),
        worst_index=_argmax(err),
        worst_rel_index=_argmax(rel),
        mismatched=int(over.sum()),
        total=int(truth.size),
        nonfinite_mismatch=int((~same_nonfinite).sum()),
    )


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
    truth_lse = _host(truth_lse)
    result = [compare("out", out, _host(truth), _host(plain), dtype,
                      score_rounding(truth_lse, _host(v)))]
    if lse is not None:
        result.append(compare("lse", lse, truth_lse, _host(plain_lse), "float32"))
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
    terms = gradient_score_rounding(q, k, v, dout, options)
    return [compare(name, g, _host(t), _host(p), dtype, term)
            for name, g, t, p, term in zip(("dq", "dk", "dv"), grads, truth, plain, terms)]


def gradient_score_rounding(q, k, v, dout, options):
    """(dq, dk, dv) terms of the floor: what rounding the scores to float32 once can do to
    each gradient. A backward kernel recomputes P = exp(S - lse) in float32, so each weight
    carries a relative error up to d = 2 u max|lse| (as in the forward's score_rounding).
    Through dV = P^T dO that moves dV by at most d max(P^T |dO|); through dS = P (dP - delta),
    with |dP_ij| <= ||dO_i||_1 max|v|, it moves each dS_ij by at most 3 d P_ij ||dO_i||_1
    max|v|, hence dQ = dS K scale by 3 d scale max|k| max|v| max_i ||dO_i||_1, and dK = dS^T
    Q scale by 3 d scale max|q| max|v| max_j sum_c (P^T |dO|)_jc. P^T |dO| is the truth's
    dV for the incoming gradient |dO|."""
    import reference

    _, lse = reference.attention(q, k, v, return_lse=True, **options)
    lse = np.asarray(_host(lse), dtype=np.float64)
    d = 2.0 * U_SCORES * float(np.abs(lse[np.isfinite(lse)]).max(initial=0.0))
    if d == 0.0:
        return 0.0, 0.0, 0.0
    dout_abs = np.abs(np.asarray(_host(dout), dtype=np.float64))
    dout_abs = np.where(np.isfinite(dout_abs), dout_abs, 0.0)
    clean = [np.where(np.isfinite(x), x, 0.0) for x in
             (np.asarray(_host(y), dtype=np.float64) for y in (q, k, v))]
    weight = reference.attention_backward(*clean, dout_abs, **options)[2]  # P^T |dO|
    scale = abs(reference.check_attention_args(q, k, v, **options).scale)
    qmax, kmax, vmax = (finite_abs_max(_host(x)) for x in (q, k, v))
    row_l1 = float(dout_abs.sum(axis=-1).max(initial=0.0))
    return (3.0 * d * scale * kmax * vmax * row_l1,
            3.0 * d * scale * qmax * vmax * float(weight.sum(axis=-1).max(initial=0.0)),
            d * float(weight.max(initial=0.0)))


def _host(x):
    return x.get() if hasattr(x, "get") else x
