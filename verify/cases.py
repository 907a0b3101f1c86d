"""The battery: what verify.compare runs, and how each case's inputs are made.

A Case is plain data (shapes, dtype, options, the kind of values), so a failure can be
reproduced from its fields and a seed alone. make_inputs turns it into NumPy arrays.
"""
import itertools
from dataclasses import asdict, dataclass

import numpy as np

SUITES = ("quick", "standard", "full")


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
    mask: str = None  # None, "random", "diagonal", "empty-rows", "single-key"
    kv_lengths: str = None  # None, "random", "edges" (0, 1 and Nk)
    values: str = "normal"  # normal, large, tiny, ties, nan-hidden, inf-hidden, nan-visible
    strided: bool = False  # inputs are non-contiguous views
    repeat: bool = False  # run twice, outputs must be bitwise equal

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
        if self.kv_lengths:
            f.add("kv_lengths")
        if self.Hq != self.Hk:
            f.add("gqa")
        if self.Dv != self.D:
            f.add("dv_differs")
        if self.values in ("nan-hidden", "inf-hidden", "nan-visible"):  # containment
            f.add("nonfinite_hidden")
        return f


def make_inputs(case, seed):
    """(q, k, v, options) as NumPy arrays for `case`; options are the contract's keywords."""
    rng = np.random.default_rng(seed)
    shapes = [(case.B, case.Hq, case.Nq, case.D), (case.B, case.Hk, case.Nk, case.D),
              (case.B, case.Hk, case.Nk, case.Dv)]
    q, k, v = (rng.standard_normal(s) for s in shapes)
    if case.values == "large":  # scores far beyond exp's range: needs the max subtraction
        q, k = q * 30.0, k * 30.0
    elif case.values == "tiny":
        q, k, v = q * 1e-3, k * 1e-3, v * 1e-3
    elif case.values == "ties":  # few distinct scores: many exact ties in every row
        q, k = np.sign(q), np.sign(k)
    options = {}
    if case.causal:
        options["causal"] = case.causal
    if case.window is not None:
        options["window"] = case.window
    if case.mask:
        options["mask"] = _mask(case, rng)
    if case.kv_lengths:
        lengths = rng.integers(1, case.Nk + 1, case.B)
        if case.kv_lengths == "edges":
            lengths = np.array([0, 1, case.Nk] * case.B)[: case.B]
        options["kv_lengths"] = lengths.astype(np.int32)
    q, k, v = (_cast(x, case.dtype) for x in (q, k, v))
    if case.values in ("nan-hidden", "inf-hidden"):
        _poison_hidden(case, k, v, options, np.nan if case.values == "nan-hidden" else np.inf)
    elif case.values == "nan-visible":
        k[0, 0, case.Nk // 2, 0] = np.nan  # seen by the rows that see key Nk // 2
    return q, k, v, options


def _cast(x, dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(np.float32).astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


def _mask(case, rng):
    shape = (case.B, 1, case.Nq, case.Nk)
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


def _poison_hidden(case, k, v, options, value):
    """Put non-finite values where no row can see them: past kv_lengths, or masked columns."""
    if "kv_lengths" in options:
        for b, n in enumerate(options["kv_lengths"]):
            k[b, :, n:], v[b, :, n:] = value, value
    if "mask" in options:
        hidden = ~options["mask"].any(axis=(1, 2))  # (B, Nk) keys no row sees
        for b in range(case.B):
            k[b, :, hidden[b]], v[b, :, hidden[b]] = value, value


def battery(suite="quick", dtypes=("float32", "float16", "bfloat16")):
    """The cases of a suite, in a fixed order."""
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}, got {suite!r}")
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
    for nq, nk, causal in itertools.product((N(29), N(67)), (N(31),), ("top_left",
                                                                        "bottom_right")):
        add(f"causal {causal} {nq}x{nk}", Nq=nq, Nk=nk, causal=causal)
    add("window (4, 2)", Nq=N(50), Nk=N(50), window=(4, 2))
    add("window (0, 0)", Nq=N(20), Nk=N(20), window=(0, 0))
    add("window (3, -1) + causal", Nq=N(40), Nk=N(45), window=(3, -1), causal="bottom_right")
    add("mask diagonal", mask="diagonal", Nq=N(30), Nk=N(30))
    add("mask single key", mask="single-key", Nq=N(40), Nk=N(50))
    add("mask empty rows", mask="empty-rows", Nq=N(40), Nk=N(50))
    add("kv_lengths random", kv_lengths="random", B=3, Nk=N(70))
    add("kv_lengths 0, 1, Nk", kv_lengths="edges", B=3, Nk=N(70), causal="bottom_right")
    add("mask + causal + kv_lengths", mask="random", causal="top_left", kv_lengths="random",
        B=3)
    add("GQA 4:1", Hq=8, Hk=2)
    add("MQA", Hq=4, Hk=1, causal="bottom_right")
    add("Dv != D", D=32, Dv=24)
    add("head dim 40", D=40, Dv=40)
    add("head dim 1", D=1, Dv=1, Nq=N(9), Nk=N(9))
    add("tiny values", values="tiny")
    add("ties", values="ties", causal="top_left")
    add("NaN past kv_lengths", values="nan-hidden", kv_lengths="random", B=3)
    add("inf in masked keys", values="inf-hidden", mask="random")
    add("NaN in a visible key", values="nan-visible", causal="top_left", Nq=N(40), Nk=N(40))
    add("strided inputs", strided=True, causal="top_left", Hq=4, Hk=2)
    add("determinism", repeat=True, Nq=N(100), Nk=N(100), mask="random")
    if not small:
        for d in (64, 96, 128, 256):
            add(f"head dim {d}", D=d, Dv=d, Nq=257, Nk=1023, causal="bottom_right")
        add("long row 4096", Nq=64, Nk=4096, B=1)
        add("decode Nq=1", Nq=1, Nk=3000, B=4, Hq=8, Hk=2, kv_lengths="random")
    if suite == "full":
        for dtype in dtypes:
            add(f"long 4096x4096 D=128 [{dtype}]", B=1, Hq=4, Hk=4, Nq=4096, Nk=4096, D=128,
                Dv=128, causal="bottom_right", dtype=dtype)
        add("long 8192x8192 D=64", B=1, Hq=2, Hk=2, Nq=8192, Nk=8192, D=64, Dv=64)
        add("B*H = 1024", B=64, Hq=16, Hk=16, Nq=128, Nk=128)
    return cases

