"""verify.compare catches every classic bug for the right reason, passes correct kernels,
and never crashes on a misbehaving one."""
import json
import re
import time
import warnings

import numpy as np
import pytest

import verify
from tests.broken_kernels import BUGS, OUT_BUFFER_BUG, VALUE_BUGS, kernel
from verify.adapters import Supports, load
from verify.cases import Case, VacuousCase, battery, make_inputs


@pytest.mark.parametrize("bug", list(BUGS))
def test_each_broken_kernel_fails_for_its_reason(bug):
    case_name, phrase = BUGS[bug]
    report = verify.compare(kernel(bug), suite="quick", progress=False)
    assert not report.passed
    hit = [r for r in report.failures if r.case.name == case_name]
    assert hit, f"{case_name!r} did not fail; failures: {[r.case.name for r in report.failures]}"
    assert phrase in hit[0].detail, hit[0].detail


@pytest.mark.parametrize("bug", list(VALUE_BUGS))
def test_each_value_bug_fails_the_families_made_for_it(bug):
    """A kernel right on ordinary values and wrong on the values models produce (or on
    stride-0 inputs) fails those cases, and nothing else: without them it would pass."""
    dtypes, names, phrase = VALUE_BUGS[bug]
    report = verify.compare(kernel(bug), suite="quick", supports=Supports(dtypes=dtypes),
                            progress=False)
    failed = {r.case.name: r for r in report.failures}
    for name in names:
        assert name in failed, f"{name!r} did not fail; failures: {sorted(failed)}"
        assert phrase in failed[name].detail, failed[name].detail
    others = [n for n, r in failed.items() if r.case.values not in NEW_VALUES
              and not r.case.expanded and n not in names]
    assert not others, others


NEW_VALUES = ("heads-held", "heads-free", "batch-held", "batch-free", "rows", "keys",
              "outliers", "heavy-tails", "cancelling", "score-limit", "value-limit",
              "subnormal")


def test_a_small_head_is_judged_by_its_own_values():
    """An error that the largest head's scale would hide fails in the head it is in."""
    from verify.criterion import compare

    truth = np.random.default_rng(0).standard_normal((1, 2, 8, 4))
    truth[0, 0] *= 1e6
    got = truth.copy()
    got[0, 1] += 1e-4  # far below float32's resolution at 1e6, far above it at 1
    result = compare("out", got, truth, truth.astype(np.float32), "float32")
    assert not result.passed and result.worst_slice == (0, 1) and result.slices_failed == 1
    assert result.ulps > 100 and result.effective_bits < 16
    assert compare("out", truth.astype(np.float32), truth, truth.astype(np.float32),
                   "float32").passed


def test_the_unbroken_twin_passes():
    report = verify.compare(kernel(None), suite="quick", progress=False)
    assert report.passed, str(report)


def test_reference_passes_standard():
    report = verify.compare("reference", suite="standard", progress=False)
    assert report.passed, str(report)
    assert {r.case.name for r in report.cases if r.verdict == "not claimed"} == {
        "call check: stream", "call check: out-buffer"}  # NumPy arrays; no out=


def test_torch_math_cpu_passes():
    pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify.compare("torch-math", suite="quick", progress=False)
    assert report.passed, str(report)
    # PyTorch adds masks as -inf, so NaN in hidden keys leaks: declared, hence not claimed.
    assert {r.case.name for r in report.cases if r.verdict == "not claimed"} >= {
        "NaN past kv_lengths"}


def test_hidden_keys_hold_bits_only_where_claimed():
    """A kernel right in value whose bits move with keys a row does not see fails the
    hidden-keys check when it claims hidden_bitwise, and passes with a note when it does not
    (the values of both calls are judged either way)."""
    cases = [(c, i) for i, c in enumerate(battery("quick", ("float32",)))
             if c.check == "hidden-keys"]
    claimed = verify.compare(kernel("max-over-hidden"), cases=cases, progress=False)
    assert not claimed.passed and "reach it" in claimed.cases[0].detail
    not_claimed = verify.compare(kernel("max-over-hidden"), cases=cases, progress=False,
                                 supports=Supports(hidden_bitwise=False))
    assert not_claimed.passed, str(not_claimed)
    assert "not claimed bitwise" in not_claimed.cases[0].detail


def test_flex_attention_takes_block_sparse_masks_as_a_block_mask():
    """torch-flex (FlexAttention, its eager path on a CPU: compiling costs a minute a shape
    here) on the block-sparse cases, float32: the adapter's mask_mod, BlockMask and
    score_mod say what the contract says. FlexAttention has no backward on a CPU: asking for
    gradients there is refused by name, not failed case by case."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CPU test (on a GPU the adapter compiles; pytest -m gpu covers it)")
    cases = [(c, i) for i, c in enumerate(battery("quick", ("float32",)))
             if c.name.startswith("block-sparse") or c.name.startswith("bias + mask")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify.compare("torch-flex", progress=False, cases=cases)
    assert len(report.cases) == 7 and report.passed, str(report)
    with pytest.raises(ValueError, match="torch-flex has no backward pass"):
        verify.compare("torch-flex", progress=False, cases=cases, backward=True)


@pytest.mark.long
@pytest.mark.parametrize("shard", [0, 1])
def test_numba_kernel_in_simulator_passes(shard):
    """The quick suite's float32 cases, with the suite's seeds, in two shards (every other
    case) that CI's two workers take side by side: the whole took 4 minutes of one.
    float32 only: in the simulator each more dtype costs about 45 s of CI. The half-precision
    variants are checked by tests/test_kernel.py and `pytest conformance` here, and by
    tests/test_gpu.py's battery on the GPU."""
    suite = battery("quick", ("float32",), max_head_dim=load("numba").supports.max_head_dim)
    cases = [(case, seed) for seed, case in enumerate(suite)][shard::2]
    report = verify.compare("numba", cases=cases, progress=False)
    assert report.passed, str(report)
    assert len(report.cases) > 10 and all(r.case.dtype == "float32" for r in report.cases)


@pytest.mark.long
def test_plain_numba_kernel_in_simulator_passes():
    """The kernel to read (numba_kernels/plain_fwd.py) is certified like the tuned one."""
    report = verify.compare("numba-plain", suite="quick", dtypes=("float32",), progress=False)
    assert report.passed and not report.unexercised, str(report)


def test_undeclared_features_are_not_claimed():
    supports = verify.Supports(dtypes=("float32",), causal=(), mask=False, bias=False,
                               kv_lengths=False, window=False, gqa=False, dv_differs=False)
    report = verify.compare(kernel(None), suite="quick", supports=supports, progress=False)
    assert report.passed
    skipped = {r.case.name: r.detail for r in report.cases if r.verdict == "not claimed"}
    assert skipped["GQA 4:1"] == "needs gqa" and skipped["MQA"] == "needs causal:bottom_right"
    assert not any("float16" in r.case.name for r in report.cases)  # only what it claims


def _wrong(kind):
    def fn(q, k, v, **options):
        out = kernel(None)(q, k, v, **options)[0]
        if kind == "raises":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if kind == "shape":
            return out[:, :, :-1]
        if kind == "dtype":
            return out.astype(np.float64)
        if kind == "type":
            return out.tolist()
        if kind == "hang":
            time.sleep(5)
        if kind == "tuple3":
            return out, out, out
        return out
    return fn


@pytest.mark.parametrize("kind,phrase", [
    ("raises", "raised RuntimeError: CUDA error"), ("shape", "out has shape"),
    ("dtype", "out has dtype float64"), ("type", "returned builtins.list"),
    ("tuple3", "tuple of 3"), ("hang", "no result after 1 s")])
def test_misbehaving_kernels_fail_cleanly(kind, phrase):
    impl = verify.Implementation(kind, _wrong(kind), verify.Supports(dtypes=("float32",),
                                                                      lse=False),
                                 timeout_s=1.0)
    if kind == "hang":  # one case is enough to see the time limit
        case = verify.battery("quick", ("float32",))[0]
        result = verify.runner.run_case(impl, case, 0)
        assert result.verdict == "fail" and phrase in result.detail
        return
    report = verify.compare(impl, suite="quick", progress=False)
    assert not report.passed and all(r.verdict != "pass" for r in report.cases)
    assert phrase in report.failures[0].detail, report.failures[0].detail


def test_report_json_and_text(tmp_path):
    report = verify.compare(kernel("wrong-gqa-mapping"), suite="quick", progress=False)
    path = tmp_path / "cert.json"
    report.save(path)
    data = json.loads(path.read_text())
    assert data["verdict"] == "fail" and data["counts"]["fail"] == len(report.failures)
    case = next(c for c in data["cases"] if c["case"]["name"] == "GQA 4:1")
    assert case["comparisons"][0]["ratio"] > 1 and case["comparisons"][0]["worst_index"]
    text = str(report)
    assert "FAILED GQA 4:1" in text and "mismatched elements" in text and "make_inputs" in text


def test_out_buffer_check_catches_writes_outside_the_view():
    claims = Supports(out_buffer=True)
    report = verify.compare(kernel(OUT_BUFFER_BUG), suite="quick", supports=claims,
                            progress=False)
    assert [r.case.name for r in report.failures] == ["call check: out-buffer"]
    assert "wrote outside its out= view" in report.failures[0].detail
    assert verify.compare(kernel(None), suite="quick", supports=claims, progress=False).passed


def test_default_stream_kernel_is_caught():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (scripts/gpu_verify.sh runs it on the GPU)")
    from tests.broken_kernels import default_stream_kernel

    impl = verify.Implementation("default-stream", default_stream_kernel(), Supports(
        dtypes=("float32",), causal=(), mask=False, bias=False, kv_lengths=False,
        window=False, gqa=False, lse=False, nonfinite_hidden=False, scale=("positive",),
        batch_invariant=False), array="torch", device="cuda")
    report = verify.compare(impl, suite="quick", progress=False)
    assert [r.case.name for r in report.failures] == ["call check: stream"], str(report)


# The capabilities each kind of implementation claims, for the coverage test.
CLAIMS = {
    "everything": Supports(out_buffer=True),
    "torch-like": Supports(lse=False, nonfinite_hidden=False, max_head_dim=1024),
    "flash-like": Supports(dtypes=("float16", "bfloat16"), causal=("bottom_right",),
                           mask=False, bias=False, kv_lengths=False, dv_differs=False,
                           max_head_dim=128),
    "minimal": Supports(dtypes=("bfloat16",), causal=(), mask=False, bias=False,
                        kv_lengths=False, window=False, gqa=False, dv_differs=False, lse=False,
                        nonfinite_hidden=False, scale=(), max_head_dim=64),
}


@pytest.mark.parametrize("suite", ["quick", "standard", "full"])
@pytest.mark.parametrize("claims", list(CLAIMS))
def test_every_claimed_capability_is_exercised(suite, claims):
    supports = CLAIMS[claims]
    cases = battery(suite, supports.dtypes, max_head_dim=supports.max_head_dim)
    missing = [cap for cap, names in supports.coverage(cases).items() if not names]
    assert not missing, f"verify bug: {claims} claims {missing}, which no {suite} case runs"


def test_coverage_check_can_fail(monkeypatch):
    """Without its bias cases the battery leaves a claimed capability unexercised, and the
    report says so."""
    import verify.cases

    real = verify.cases.battery
    monkeypatch.setattr(verify, "battery", lambda *a, **k: [c for c in real(*a, **k)
                                                            if not c.bias])
    supports = Supports(dtypes=("float32",))
    report = verify.compare(kernel(None), suite="quick", supports=supports, progress=False)
    assert report.unexercised == ["bias"]
    assert "VERIFY BUG: claimed but exercised by no case: bias" in str(report)
    assert report.coverage["scale:zero"] == ["scale 0", "scale 0 + causal"]


@pytest.mark.parametrize("suite", ["quick", "standard", "full"])
def test_poisoned_cases_always_bite(suite):
    """Every poisoned case, for every seed tried, has a poisoned key that some rows see and
    others do not (make_inputs raises VacuousCase otherwise)."""
    poisoned = [c for c in battery(suite) if c.poison]
    assert len(poisoned) >= 6
    for case in poisoned:
        for seed in range(40):
            make_inputs(case, seed)


def test_poisoned_rows_always_bite():
    """Every backward case poisoning a row of Q or dO has, for every seed tried, a row that
    sees some keys and not others (poison_rows raises VacuousCase otherwise), and the value
    lands there."""
    from verify.backward import backward_battery
    from verify.cases import poison_rows, visibility

    poisoned = [c for c in backward_battery("standard") if c.poison and (
        "q:" in c.poison or "dout:" in c.poison)]
    assert {p.split(":")[0] for c in poisoned for p in c.poison.split(",")} >= {"q", "dout"}
    for case in poisoned:
        for seed in range(20):
            q, k, v, options = make_inputs(case, seed)
            dout = np.zeros((case.B, case.Hq, case.Nq, case.Dv), np.float32)
            poison_rows(case, dout, visibility(case, options), np.inf)
            assert np.isinf(dout).any(axis=(1, 2, 3)).all()
            if "q:" in case.poison:
                assert np.isnan(np.asarray(q, np.float64)).any(axis=(1, 2, 3)).all()


def test_a_vacuous_poisoned_case_is_a_verify_bug():
    case = Case("poison without masking", 1, 1, 1, 4, 5, 8, 8, "float32", poison="k:nan")
    with pytest.raises(VacuousCase, match="cannot show a leak"):
        make_inputs(case, 0)


def test_failure_map_names_what_failures_share():
    report = verify.compare(kernel("scale-ignored"), suite="quick", progress=False)
    first = verify.failure_map.failure_map(report.cases)[0]
    assert first.exact and first.trait == "with an explicit scale"
    report = verify.compare(kernel("max-before-scale"), suite="quick", progress=False)
    assert "all 3 failures have 'scale <= 0'" in str(report)  # plain scale 0 passes
    report = verify.compare(kernel("whole-last-tile"), suite="quick", progress=False)
    first = verify.failure_map.failure_map(report.cases)[0]
    assert first.all_failures and first.trait == "Nk % 16 != 0"
    aligned = [r for r in report.cases if r.case.name.startswith("aligned")]
    assert aligned and all(r.verdict == "pass" for r in aligned)
    data = json.loads(json.dumps(report.to_dict(), default=str))
    assert data["failure_map"][0]["trait"] == "Nk % 16 != 0"


def test_fully_masked_conventions_are_named():
    from verify.pipeline import fully_masked_convention

    case = Case("c", 1, 2, 2, 9, 5, 4, 4, "float32", causal="bottom_right")
    q, k, v, options = make_inputs(case, 0)
    import reference

    truth = reference.attention(q, k, v, **options)
    empty = np.zeros(truth.shape[:3], bool)
    empty[..., :4] = True  # Nq - Nk = 4 rows see nothing under bottom-right alignment
    unmasked = reference.attention(q, k, v)
    mean = np.broadcast_to(v.mean(axis=2, keepdims=True), truth.shape)
    for name, rows in (("zeros", 0 * truth), ("nan", np.nan + truth), ("mean", mean),
                       ("unmasked", unmasked), ("other", truth + 7)):
        out = np.where(empty[..., None], rows, truth)
        assert fully_masked_convention(out, q, k, v, empty, options) == name


def test_certificate_records_where_and_what(tmp_path):
    report = verify.compare("reference", suite="quick", dtypes=("float32",), progress=False)
    report.save(tmp_path / "c.json")
    data = json.loads((tmp_path / "c.json").read_text())
    env = data["environment"]
    assert env["timestamp"] and env["numpy"] == np.__version__ and "commit" in env
    assert len(data["battery_hash"]) == 64 and data["impl_spec"] == "reference"
    assert all("seed" in c for c in data["cases"]) and data["unexercised"] == []
    other = verify.compare("reference", suite="quick", dtypes=("float16",), progress=False)
    assert other.battery_hash != report.battery_hash


def test_the_certificate_names_the_precision_claimed_and_measured(tmp_path):
    """A float32 kernel on products of 11 bits passes nothing and shows it; the plain one
    reads as float32, beside its claim."""
    from verify.adapters import Implementation

    def tf32_like(q, k, v, **options):  # inputs rounded to 11 significant bits
        import reference

        q, k, v = (reference.round_to(x, "float16").astype(np.float32) for x in (q, k, v))
        return reference.attention(q, k, v, **options).astype(np.float32)

    claims = Supports(dtypes=("float32",), lse=False)
    report = verify.compare(Implementation("tf32-like", tf32_like, claims, precision="TF32"),
                            suite="quick", progress=False)
    report.save(tmp_path / "c.json")
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["implementation"]["precision"] == "TF32"
    out = [m for m in data["precision_measured"] if m["output"] == "out"][0]
    assert out["ulps"] > 100 * out["plain_ulps"] and out["effective_bits"] < 16
    assert "precision (TF32) on ordinary values" in str(report)
    exact = verify.compare("reference", suite="quick", dtypes=("float32",), progress=False)
    assert exact.precision()[("out", "float32")]["effective_bits"] >= 23


def test_replay_reruns_the_failures(tmp_path, capsys):
    from verify.__main__ import main

    path = tmp_path / "c.json"
    assert main(["tests.broken_kernels:BROKEN_SCALE", "--dtype", "float32", "--json",
                 str(path)]) == 1
    failed = [c["case"]["name"] for c in json.loads(path.read_text())["cases"]
              if c["verdict"] == "fail"]
    report = verify.replay(str(path))
    assert [r.case.name for r in report.cases] == failed and len(report.failures) == len(failed)
    assert verify.replay(str(path), "tests.broken_kernels:CORRECT").passed
    capsys.readouterr()
    assert main(["--replay", str(path), "tests.broken_kernels:CORRECT"]) == 0
    with pytest.raises(SystemExit):
        main([])
    assert "name an implementation" in capsys.readouterr().err


def test_a_hang_skips_the_rest():
    def hangs(q, k, v, **options):
        time.sleep(3)

    impl = verify.Implementation("hangs", hangs, Supports(dtypes=("float32",)))
    cases = [(c, 0) for c in battery("quick", ("float32",))[:3]]
    report = verify.compare(impl, cases=cases, timeout=0.5, progress=False)
    assert [r.verdict for r in report.cases] == ["fail", "skipped", "skipped"]
    assert "no result after 0.5 s" in report.cases[0].detail and not report.passed
    with pytest.raises(ValueError, match="timeout must be a positive"):
        verify.compare(impl, cases=cases, timeout=-1, progress=False)


def test_scale_suite_samples_catch_index_wrap(monkeypatch):
    """The scale suite's cases, shrunk so that a CPU runs them, against a kernel whose mask
    index wraps at 2^16 (2^32 on a GPU): the rows sampled around the power-of-two boundary of
    the flattened scores catch it; the reference passes the same cases."""
    import tests.broken_kernels as broken
    from verify.cases import sample_rows, scale_cases

    small = scale_cases("float32", n=300, keys=700, queries=97, long=1001, cache=3001)
    assert 2**16 < 300 * 300 and 2**16 // 300 in sample_rows(small[0])
    cases = [(c, i) for i, c in enumerate(small) if not c.name.endswith("(queries)")]
    assert verify.compare("reference", cases=cases, progress=False).passed
    monkeypatch.setattr(broken, "WRAP_BITS", 16)
    report = verify.compare(kernel("index-wrap"), cases=cases[:1], progress=False)
    assert report.failures and "mismatched" in report.failures[0].detail
    worst_row = report.failures[0].comparisons[0].worst_index[2]
    assert sample_rows(small[0])[worst_row] >= 2**16 // 300


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_scale_suite_draws_are_cast_float32_normals(dtype):
    """The scale suite's inputs: float32 normal draws per chunk, cast in the chunk's thread to
    the case's dtype, the same on every call."""
    from reference.dtypes import cast, numpy_dtype
    from verify.cases import _normal

    a = _normal(3, 1, (2, 3, 50), dtype, chunk=64)
    assert a.dtype == numpy_dtype(dtype) and a.shape == (2, 3, 50)
    assert np.array_equal(a, _normal(3, 1, (2, 3, 50), dtype, chunk=64))
    streams = np.random.SeedSequence([3, 1]).spawn(5)
    first = np.random.default_rng(streams[0]).standard_normal(64, dtype=np.float32)
    assert np.array_equal(a.reshape(-1)[:64], cast(first, dtype))
    assert not np.array_equal(a.reshape(-1)[:64], a.reshape(-1)[64:128])


def test_scale_suite_skips_what_memory_cannot_hold(monkeypatch):
    import verify.runner as runner
    from verify.cases import scale_cases

    monkeypatch.setattr(runner, "_host_free", lambda: 2**30)
    report = verify.compare("reference", cases=[(scale_cases("float32")[0], 0)],
                            progress=False)
    result = report.cases[0]
    assert result.verdict == "skipped" and "GiB of host memory" in result.detail


def test_reproducer_snippet_reproduces():
    report = verify.compare("reference", suite="quick", progress=False)
    snippet = report.cases[5].reproducer("reference")
    exec(compile(snippet, "snippet", "exec"), {})


def test_cli_exit_codes(tmp_path, capsys):
    from verify.__main__ import main

    assert main(["reference", "--dtype", "float32", "--json", str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["verdict"] == "pass"
    assert main(["tests.broken_kernels:BROKEN_SCALE", "--dtype", "float32"]) == 1
    assert main(["no-such-kernel"]) == 2
    assert "unknown implementation" in capsys.readouterr().err


def test_large_scores_do_not_fail_a_correct_kernel_at_random(monkeypatch):
    """Scores in the thousands: a correct float32 kernel and the plain implementation both err
    by about u |s| |v|, on different rows by chance. The floor's score term (criterion.py)
    keeps every seed passing; without it a quarter of them fail."""
    import verify.criterion as criterion
    from verify.cases import Case, make_inputs

    correct = kernel(None)
    case = Case("large", 4, 4, 4, 17, 33, 64, 8, "float32", values="large")

    def failures():
        failed = 0
        for seed in range(20):
            q, k, v, options = make_inputs(case, seed)
            out, lse = correct(q, k, v, return_lse=True, **options)
            failed += not all(c.passed for c in criterion.judge(q, k, v, out, lse, **options))
        return failed

    assert failures() == 0
    monkeypatch.setattr(criterion, "U_SCORES", 0.0)
    assert failures() > 0


def tensor_core_scores(q, k, keep=24):
    """q k^T (q (R, D), k (N, D) of 16-bit values, float64) summed as an H200's tensor cores
    sum it (tests/tensor_cores.py), a step of 16 products at a time onto the accumulator.
    keep < 24: the products' bits cut to that many first (11: TF32's)."""
    from tests.tensor_cores import h200_sum

    acc = np.zeros((q.shape[0], k.shape[0]))
    for s0 in range(0, q.shape[1], 16):
        terms = q[:, None, s0:s0 + 16] * k[None, :, s0:s0 + 16]
        if keep < 24:
            mantissa, exponent = np.frexp(terms)
            terms = np.ldexp(np.trunc(np.ldexp(mantissa, keep)), exponent - keep)
        acc = h200_sum(np.concatenate([terms, acc[..., None]], axis=-1)).astype(np.float64)
    return acc


def test_a_score_whose_terms_cancel_does_not_fail_a_correct_tensor_core_kernel():
    """The H200 case of docs/findings.md (both tensor-core forwards failed it on lse): one
    row that sees one key, float16, a score of 128 large products that nearly cancel. Summed
    as the tensor cores sum it, lse lands past lse's 16 float32 units, where the plain
    implementation can be all but exact (as it was there). lse's score term (criterion.py)
    passes it, and still fails the same score from products cut to TF32's 11 bits."""
    import verify.criterion as criterion

    import reference

    case = Case("cancelling", 12, 4, 1, 1, 8232, 128, 16, "float16", causal="top_left",
                mask="diagonal", kv_lengths="random", values="large")
    q, k, v, _ = make_inputs(case, 3)
    q, k, v = q[9:10, 1:2, :1], k[9:10, :, :1], v[9:10, :, :1]  # the slice that failed
    truth = reference.attention(q, k, v, return_lse=True)
    term = criterion.lse_score_rounding(q, k, v, {}, truth)

    def lse(keep):  # one key: lse is the score
        s = tensor_core_scores(*(np.asarray(x[0, 0], np.float64) for x in (q, k)), keep)
        return (s / np.sqrt(128)).astype(np.float32)[None, None, :, 0]

    def passes(got, score_term):  # the plain implementation exact, as it was there
        return criterion.compare("lse", got, truth[1], truth[1], "float32", score_term,
                                 at_least=1.0).passed

    assert float(np.abs(lse(24) - truth[1]).max()) > 1.5e-4
    assert passes(lse(24), term) and not passes(lse(24), 0.0)
    assert not passes(lse(11), term)


def test_cancelling_scores_do_not_fail_a_correct_float32_kernel_at_random(monkeypatch):
    """Scores whose products cancel (q's channel pairs equal to 1e-3, k's opposite): a float32
    kernel summing each score in channel order, or the reverse, and the plain implementation
    err by units of the products' magnitude, on different rows by chance. The floor's term
    of a score's sum keeps every run passing; the term of its value alone (|s|, a score's
    one rounding) fails one of them."""
    import verify.criterion as criterion

    import reference.naive

    def inputs(seed):
        rng = np.random.default_rng(seed)
        q, k = (30 * rng.standard_normal((2, 2, n, 64)) for n in (16, 64))
        q[..., 1::2] = q[..., ::2] * (1 + 1e-3 * rng.standard_normal(q[..., ::2].shape))
        k[..., 1::2] = -k[..., ::2]
        return (x.astype(np.float32) for x in (q, k, rng.standard_normal((2, 2, 64, 16))))

    def kernel_f32(q, k, v, order):
        s = np.zeros(q.shape[:-1] + k.shape[-2:-1], np.float32)
        for d in range(q.shape[-1])[::order]:
            s += q[..., d, None] * k[..., None, :, d]
        s *= np.float32(1 / 8)
        m = s.max(-1, keepdims=True)
        p = np.exp((s - m).astype(np.float64))
        l = p.sum(-1, keepdims=True)  # noqa: E741
        return ((p / l) @ v).astype(np.float32), (m + np.log(l))[..., 0].astype(np.float32)

    def failures():
        return sum(not c.passed for seed in range(20) for order in (1, -1)
                   for c in criterion.judge(*inputs(seed), *kernel_f32(*inputs(seed), order)))

    assert failures() == 0
    monkeypatch.setattr(reference.naive, "score_terms", lambda pb, q_b, blk, p, xp: np.nan_to_num(
        p * np.abs(q_b @ blk.k.T * pb.scale), posinf=0.0))  # p |s|
    assert failures() > 0


def test_score_term_is_small_for_ordinary_scores():
    from verify.cases import Case, make_inputs
    from verify.criterion import EPS, FLOOR_ULPS, lse_score_rounding, score_rounding

    import reference

    first_term = FLOOR_ULPS["float32"] * EPS["float32"]  # at an output scale of 1
    for n in (16, 4096):  # lse grows like log(n)
        q, k, v, options = make_inputs(Case("normal", 2, 2, 2, 64, n, 64, 64, "float32"), 0)
        truth = reference.attention(q, k, v, return_lse=True, **options)
        term = score_rounding(q, k, v, options, truth)
        assert term.shape == (2, 2) and (0 < term).all() and (term < 4 * first_term).all()
        lse_term = lse_score_rounding(q, k, v, options, truth)  # lse: below a unit of it
        assert lse_term.shape == (2, 2) and (0 < lse_term).all() and (
            lse_term < first_term).all()


def test_score_term_counts_only_the_keys_that_carry_weight():
    """Keys with huge values and no weight (scores far below the row's largest) add nothing:
    the term stays at the scale of the values the rows average."""
    from verify.criterion import score_rounding

    import reference

    q, k, v = np.ones((1, 1, 8, 16)), np.ones((1, 1, 16, 16)), np.ones((1, 1, 16, 16))
    k[..., 8:, :] = -1e3  # keys no row weighs (scores -4000 against 4)...
    v[..., 8:, :] = 1e20  # ... with huge values
    options = {}
    truth = reference.attention(q, k, v, return_lse=True)
    assert np.abs(truth[0]).max() < 10
    assert score_rounding(q, k, v, options, truth).max() < 1e-3


def test_score_terms_are_the_magnitude_of_what_each_visible_score_sums():
    """lse_sensitivity's t_i = sum_j p_ij (|scale| sum_d |q_id k_jd| + |bias_ij|): with q, k of
    ones (every score's terms 1, summing to D) and a bias of -3, every visible key's terms
    weigh |scale| D + 3 and the weights sum to 1; a row that sees no key weighs 0; hidden
    keys (mask False, past kv_lengths) count for nothing, whatever their values."""
    import reference

    q, k, v = np.ones((1, 2, 4, 16)), np.ones((1, 2, 8, 16)), np.ones((1, 2, 8, 8))
    k[..., 6:, :] = 1e6  # past kv_lengths
    mask = np.ones((1, 1, 4, 8), bool)
    mask[..., 1, :] = False  # row 1 sees no key
    mask[..., 2, :3] = False
    bias = np.full((1, 2, 4, 8), -3.0)
    t = reference.lse_sensitivity(q, k, v, mask=mask, bias=bias, kv_lengths=np.array([6]))
    want = np.where(np.arange(4) == 1, 0.0, 16 / 4 + 3)
    assert np.allclose(t, np.broadcast_to(want, t.shape), rtol=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_finite_abs_max_skips_non_finite(dtype):
    from verify.criterion import finite_abs_max

    x = np.array([[1.0, -3.0], [np.inf, 2.0], [np.nan, -np.inf]], dtype)
    assert finite_abs_max(x) == 3.0
    assert finite_abs_max(x[1:, :1]) == 0.0 and finite_abs_max(x[1:2, 1:]) == 2.0
    assert finite_abs_max(np.full((2, 2), np.nan, dtype)) == 0.0


class _Deferred(np.ndarray):
    """A result whose device work fails late, as JAX's asynchronous dispatch does: at
    block_until_ready, or (lazy=False) when rows are taken from it on the host."""

    __module__ = "numpy"  # posing as NumPy's own, the array type the adapter expects
    failure = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 16.01GiB"
    lazy = True

    def block_until_ready(self):
        if self.lazy:
            raise RuntimeError(self.failure)
        return self

    def take(self, *args, **kwargs):
        raise RuntimeError(self.failure)


def _deferred_kernel(lazy):
    import reference

    def attention(q, k, v, **options):
        out = reference.attention(q, k, v, **options).astype(q.dtype).view(_Deferred)
        out.lazy = lazy
        return out
    return attention


@pytest.mark.parametrize("lazy", [True, False], ids=["at-wait", "at-read"])
def test_a_late_device_error_is_the_cases_not_verifys(lazy):
    """An error of the call's device work, when the result is waited for or read, fails the
    case (a scale-suite case that ran out of memory is skipped, saying so); verify runs on."""
    from verify.cases import scale_cases

    impl = _deferred_kernel(lazy)
    supports = Supports(dtypes=("float32",), causal=(), mask=False, kv_lengths=False,
                        gqa=False, lse=False)
    report = verify.compare(impl, supports=supports, progress=False,
                            cases=[(battery("quick", ("float32",))[0], 0)])
    (result,) = report.cases
    if lazy:
        assert result.verdict == "fail" and "RESOURCE_EXHAUSTED" in result.detail
    else:  # whole-array reads never take rows: this one passes
        assert result.verdict == "pass", result.detail
    small = scale_cases("float32", n=40, keys=70, queries=9, long=101, cache=301)[2]
    report = verify.compare(impl, supports=supports, cases=[(small, 0)], suite="scale",
                            progress=False)
    (result,) = report.cases
    assert result.verdict == "skipped" and "out of memory" in result.detail.lower()


@pytest.mark.parametrize("claims, phrase", [
    (dict(causal="top_left"), "Supports.causal must be a tuple"),
    (dict(causal=("top-left",)), "'top-left' is not one of"),
    (dict(lse="no"), "Supports.lse must be True or False"),
    (dict(dtypes="float32"), "write ('float32',)"),
    (dict(dtypes=("float64",)), "'float64' is not one of"),
    (dict(head_dim_multiple=0), "Supports.head_dim_multiple must be a positive integer"),
    (dict(max_head_dim=64.0), "Supports.max_head_dim must be a positive integer"),
    (dict(head_dims=(16, -32)), "head_dims' entries must be a positive integer"),
    (dict(fully_masked="zero"), "Supports.fully_masked must be one of"),
    (dict(scale=("positive", "tiny")), "'tiny' is not one of"),
])
def test_malformed_claims_are_refused_by_name(claims, phrase):
    with pytest.raises((TypeError, ValueError), match=re.escape(phrase)):
        Supports(**claims)


@pytest.mark.parametrize("arguments, phrase", [
    (dict(layout="xyz"), "layout must be one of"),
    (dict(array="tensorflow"), "array must be one of"),
    (dict(dtypes="float32"), "write ('float32',)"),
    (dict(timeout=0), "timeout must be a positive number"),
    (dict(seed="0"), "seed must be an integer"),
])
def test_malformed_arguments_are_refused_by_name(arguments, phrase):
    with pytest.raises((TypeError, ValueError), match=re.escape(phrase)):
        verify.compare(kernel(None), progress=False, **arguments)


def test_a_non_callable_implementation_is_refused():
    from verify.adapters import Implementation

    with pytest.raises(TypeError, match="'mine' is not callable"):
        Implementation("mine", "not a function")
    with pytest.raises(TypeError, match="impl must be a name, an Implementation or a callable"):
        verify.compare(42, progress=False)


def test_what_a_kernel_takes_is_not_claimed_beyond_it():
    """Refusals of equal lengths only, multiples of a block, a set of head dims are "not
    claimed" with the reason, never failures; the kernel's real bug still fails."""
    claims = Supports(dtypes=("float32",), equal_lengths=True, length_multiple=16,
                      head_dims=(16, 64))
    report = verify.compare(kernel("wrong-scale"), suite="quick", supports=claims,
                            progress=False)
    reasons = {r.detail for r in report.cases if r.verdict == "not claimed"}
    assert "needs Nq != Nk (takes equal query and key lengths only)" in reasons
    assert any("takes multiples of 16 only" in r for r in reasons)
    assert any("takes 16, 64 only" in r for r in reasons)
    ran = [r for r in report.cases if r.verdict in ("pass", "fail")]
    assert ran and all(r.case.Nq == r.case.Nk and r.case.Nq % 16 == 0
                       and r.case.D in (16, 64) for r in ran)
    assert verify.compare(kernel(None), suite="quick", supports=claims,
                          progress=False).passed
    assert not report.passed and all("mismatched" in r.detail for r in report.failures)


def test_replay_of_a_clean_certificate_says_there_is_nothing_to_replay(tmp_path, capsys):
    from verify.__main__ import main

    path = tmp_path / "clean.json"
    assert main(["tests.broken_kernels:CORRECT", "--dtype", "float32", "--suite", "quick",
                 "--json", str(path)]) == 0
    capsys.readouterr()
    assert main(["--replay", str(path)]) == 0
    assert "nothing to replay -> PASS" in capsys.readouterr().out


def test_a_truth_past_the_dtypes_range_is_the_inf_it_rounds_to():
    from verify.criterion import compare

    truth = np.array([1.0, 7e4, -7e4])
    assert compare("dq", np.array([1.0, np.inf, -np.inf]), truth, truth, "float16").passed
    assert not compare("dq", np.array([1.0, 65504.0, -np.inf]), truth, truth,
                       "float16").passed
    assert compare("dq", np.array([1.0, 7e4, -7e4]), truth, truth, "float32").passed


def test_either_side_of_the_overflow_is_taken_within_the_bound():
    """float16 at a slice scale near 65504 has a bound of 2 eps 65504 = 128: a truth of 65500
    may come back as inf, and a truth of 65530 (past the range) as 65504; a truth of 60000
    may not be inf, nor may an inf take the wrong sign."""
    from verify.criterion import compare

    def passes(got, truth):
        truth = np.array([1.0, truth])
        return compare("dq", np.array([1.0, got]), truth, truth, "float16").passed

    assert passes(np.inf, 65500.0) and passes(65504.0, 65530.0)
    assert not passes(np.inf, 60000.0) and not passes(-np.inf, 65500.0)
    assert not passes(65504.0, 7e4)


@pytest.mark.parametrize("shape", [(0, 2, 3, 4), (1, 0, 3, 4), (1, 2, 0, 4), (2, 3), (0,)])
def test_empty_tensors_are_judged_without_error(shape):
    from verify.criterion import compare

    empty = np.zeros(shape)
    assert compare("out", empty, empty, empty, "float32").passed
