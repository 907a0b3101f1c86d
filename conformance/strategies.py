"""Hypothesis strategies that draw verify Cases within what the implementation claims, and the
one assertion every property uses."""
from hypothesis import note, reject
from hypothesis import strategies as st

from verify.cases import Case
from verify.runner import run_case

# Sizes around the usual tiles (16, 32, 64, 128), and primes.
AWKWARD = (1, 2, 3, 15, 16, 17, 31, 32, 33, 37, 63, 64, 65, 113, 127, 128, 129, 203, 255,
           256, 257, 1023, 1024, 1025, 2047, 4096)
# Awkward head dims (flash-attn's tests use 40, 59, 111) that fall in six of the kernel's
# padded widths, so a GPU run compiles few variants.
HEAD_DIMS = (1, 16, 40, 59, 64, 111, 128, 256)
MAX_SCORES = 2**26  # B * Hq * Nq * Nk per example, so the float64 truth stays quick
# The same for the gradient properties: the backward on the host keeps several arrays of
# that many scores (S, P, dP, dS) and runs twice (float64 truth, low-precision emulation):
# 4.4 s an example at 2**26 scores, 1.0 s at 2**24 (D = 64, a 2-core CPU). Nq and Nk still
# reach 4096.
GRAD_MAX_SCORES = 2**24
# the values drawn (verify.cases.VALUES): ordinary ones, and those of real models (heads,
# rows and keys far apart in magnitude, outlier channels, heavy tails, scores whose products
# cancel, each dtype's limits)
ORDINARY_VALUES = ("normal", "large", "tiny", "ties")
MODEL_VALUES = ("heads-held", "heads-free", "rows", "keys", "outliers", "heavy-tails",
                "cancelling", "score-limit", "value-limit", "subnormal")
MAX_OUTPUT = 2**22  # B * Hq * Nq * max(D, Dv): the comparison runs on the host


def lengths(limit, label):
    small = [n for n in AWKWARD if n <= limit]
    return st.one_of(st.sampled_from(small), st.integers(1, limit)).map(int)


@st.composite
def cases(draw, impl, limits, *, values=None, mask=None, causal=None, kv_lengths=None,
          window=None, nq=None, nk=None, gqa=None, max_scores=MAX_SCORES):
    """A Case the implementation claims, with at most max_scores scores (B * Hq * Nq * Nk).
    Keyword arguments pin a field instead of drawing it (a strategy, or a plain value)."""
    s = impl.supports

    def pick(fixed, strategy, label):
        if fixed is None:
            return draw(strategy, label=label)
        return draw(fixed, label=label) if isinstance(fixed, st.SearchStrategy) else fixed

    dtype = draw(st.sampled_from(s.dtypes), label="dtype")
    m = s.length_multiple  # lengths it takes: multiples of m, equal ones where claimed so
    Nq = -(-pick(nq, lengths(limits["max_n"], "Nq"), "Nq") // m) * m
    Nk = Nq if s.equal_lengths else -(-pick(nk, lengths(limits["max_n"], "Nk"), "Nk") // m) * m
    d_max = min(limits["max_d"], s.max_head_dim)
    dims = [d for d in HEAD_DIMS if d <= d_max and d % s.head_dim_multiple == 0
            and (s.head_dims is None or d in s.head_dims)]
    if not dims:
        reject()
    D = draw(st.sampled_from(dims), label="D")
    Dv = draw(st.sampled_from([D] + ([d for d in dims if d != D] if s.dv_differs else [])),
              label="Dv")
    Hk = draw(st.integers(1, 2), label="Hk")
    group = pick(gqa, st.sampled_from((1, 2, 3, 4) if s.gqa else (1,)), "Hq/Hk")
    Hq = Hk * group
    b_max = min(limits["max_bh"] // Hq, max_scores // (Hq * Nq * Nk),
                MAX_OUTPUT // (Hq * Nq * max(D, Dv)))
    if b_max < 1:
        reject()
    B = draw(st.integers(1, b_max), label="B")
    causal = pick(causal, st.sampled_from((False,) + tuple(s.causal)), "causal")
    window = pick(window, st.none() | st.tuples(st.integers(-1, 8), st.integers(-1, 8))
                  if s.window else st.none(), "window")
    mask = pick(mask, st.sampled_from((None, "random", "diagonal", "single-key", "empty-rows"))
                if s.mask else st.none(), "mask")
    kv = pick(kv_lengths, st.sampled_from((None, "random", "edges")) if s.kv_lengths
              else st.none(), "kv_lengths")
    if (window is not None and not s.window) or (mask and not s.mask) or (kv and not s.kv_lengths):
        reject()
    vals = pick(values, st.sampled_from(ORDINARY_VALUES), "values")
    case = Case("hypothesis", B, Hq, Hk, Nq, Nk, D, Dv, dtype, causal, window, mask, kv, vals)
    if not s.claims(case)[0]:  # a property calls the implementation on what it draws
        reject()
    return case


def seeds():
    return st.integers(0, 2**31 - 1)


def assert_holds(prop, impl, case, seed):
    """Inside a Hypothesis test: check_case, rejecting what the implementation does not claim."""
    note(f"{prop}: {case} seed={seed}")
    result = run_case(impl, case, seed)
    if result.verdict == "not claimed":
        reject()
    return _verdict(prop, impl, case, result)


def check_case(prop, impl, case, seed=0):
    """Outside Hypothesis: run one case and fail with verify's figures if it does not hold."""
    result = run_case(impl, case, seed)
    if result.verdict == "not claimed":
        import pytest

        pytest.skip(f"{impl.name}: {result.detail}")
    return _verdict(prop, impl, case, result)


def _verdict(prop, impl, case, result):
    if result.verdict != "pass":
        raise AssertionError(
            f"property '{prop}' broken for {impl.name}: {result.detail}\n"
            f"case: {case}\nreproduce with the reference beside the implementation:\n"
            + result.reproducer(impl.name))
    return result
