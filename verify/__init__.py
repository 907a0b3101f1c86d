"""verify: certify any attention kernel against the float64 reference.

    import verify
    report = verify.compare("numba")                 # a built-in adapter, or
    report = verify.compare(my_fn, supports=verify.Supports(dtypes=("float16",)))
    print(report); report.save("certificate.json")
    verify.replay("certificate.json")                # re-run its failures, same seeds
    verify.assert_conforms(my_fn)                    # raises AssertionError with the report

The error criterion is verify.criterion (one rule for the whole project); the battery is
verify.cases; python -m verify is the command line.
"""
import json
import sys
import time

import numpy as np

from reference.dtypes import KERNEL_DTYPES
from .adapters import Implementation, Supports, builtin, check_names, load
from .backward import backward_battery, for_backward
from .cases import Case, battery
from .criterion import compare as compare_arrays
from .report import CaseResult, Report, battery_hash, environment
from .runner import HUNG, run_case

__all__ = ["compare", "replay", "assert_conforms", "Implementation", "Supports", "Case",
           "Report", "CaseResult", "builtin", "load", "battery", "compare_arrays"]


def compare(impl, *, array=None, device=None, layout=None, dtypes=None, supports=None,
            suite="quick", seed=0, progress=True, timeout=None, cases=None, backward=False,
            grad=None, world_size=None, shard_layout="contiguous"):
    """Run a suite against `impl` and return a Report.

    impl: a built-in name ("numba", "torch-efficient", ...), "MODULE:CALLABLE", an
    Implementation, or a callable fn(q, k, v, **options) -> out, and (out, lse) when called
    with return_lse=True if it claims lse. array, device, layout and supports override the
    implementation's own; dtypes limits the battery; timeout (seconds) bounds each call (a
    case whose call hangs fails, and the cases after it are skipped: a hung GPU serves no
    more calls). cases: run these (a list of (Case, seed)) instead of the suite.
    backward: certify dq, dk, dv instead of the forward (verify.backward), on the suite's
    backward battery; grad: fn(q, k, v, dout, **options) -> (dq, dk, dv) in impl's array
    type, where impl is not a differentiable torch or JAX forward.
    world_size: run impl on this many ranks (verify/distributed.py: impl follows its per-rank
    protocol; each case's inputs sharded by shard_layout, "contiguous" or "zigzag", and its
    rows put back in place before they are judged; grad, if given, is then the per-rank
    grad). The battery gains its cases for sharding (cases.battery's `sharded`).
    """
    impl_spec = impl if isinstance(impl, str) else getattr(impl, "name", None) or _spec(impl)
    if world_size is not None:
        from .distributed import spread, where_it_fails
        impl, grad = spread(impl, world_size, shard_layout, grad), None
    impl = _implementation(impl)
    if impl.per_rank:
        raise ValueError(f"{impl.name} runs on the ranks of a group: pass world_size "
                         f"(--world-size N)")
    for name, value in (("array", array), ("device", device), ("layout", layout),
                        ("supports", supports), ("timeout_s", timeout)):
        if value is not None:
            setattr(impl, name, value)
    impl.check()
    _check_arguments(dtypes, seed, cases, backward)
    if any(case.backward for case, _ in cases or []):  # a replay of a backward suite
        backward = True
    if backward or grad is not None:
        if suite == "scale":
            raise ValueError("backward=True: the scale suite has no backward cases")
        impl = for_backward(impl, grad)
        backward = True
    dtypes = tuple(dtypes or impl.supports.dtypes)
    # Claimed capabilities must be covered by the standard batteries; a replay's few cases
    # and the scale suite's six are not meant to cover them.
    explicit = cases is not None or suite == "scale"
    if cases is None:
        make = backward_battery if backward else battery
        cases = [(c, seed + i) for i, c in enumerate(
            make(suite, dtypes, max_head_dim=impl.supports.max_head_dim,
                 sharded=world_size is not None))]
    suite = f"{suite} backward" if backward and not explicit else suite
    report = Report(impl.describe(), suite, seed, environment(impl), impl_spec=impl_spec,
                    battery_hash=battery_hash([c for c, _ in cases]))
    t0, hung = time.perf_counter(), None
    for i, (case, case_seed) in enumerate(cases):
        if hung:
            result = CaseResult(case, case_seed, "skipped", f"not run: {hung!r} hung")
        else:
            result = run_case(impl, case, case_seed, say=_progress_line(
                i, len(cases), t0, case) if progress else None)
            if result.verdict == "fail" and result.detail.startswith(HUNG):
                hung = case.name
            if result.verdict == "fail" and world_size is not None:  # which ranks' rows
                where = where_it_fails(result, world_size, shard_layout)
                result.detail += f"\nranks: {where}" if where else ""
        report.cases.append(result)
        if progress:
            _progress(f"[{i + 1}/{len(cases)} {time.perf_counter() - t0:5.0f}s] "
                      f"{result.verdict:11s} {case.name[:50]:50s}", done=True)
            if result.verdict == "fail":  # the first line now; the whole detail in the report
                _progress(f"  {result.detail.splitlines()[0][:200]}", done=True, keep=True)
            if case.sampled and "phases: " in result.detail:
                _progress("  " + result.detail.splitlines()[-1], done=True, keep=True)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    report.duration_s = time.perf_counter() - t0
    if not explicit:  # what the cases that ran exercised, of this run's dtypes
        report.coverage = impl.supports.coverage(
            [r.case for r in report.cases if r.verdict in ("pass", "fail")], dtypes,
            backward=backward)
    report.costs = impl.costs_line()
    return report


def _check_arguments(dtypes, seed, cases, backward):
    """compare's own arguments, each refused by name when it is not what it must be."""
    if dtypes is not None:
        check_names("dtypes", dtypes, KERNEL_DTYPES)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    if not isinstance(backward, bool):
        raise TypeError(f"backward must be True or False, got {backward!r}")
    if cases is not None and not all(isinstance(c, tuple) and len(c) == 2
                                     and isinstance(c[0], Case) for c in cases):
        raise TypeError("cases must be a list of (verify.Case, seed) pairs")


def _progress_line(i, n, t0, case):
    def say(phase):
        _progress(f"[{i + 1}/{n} {time.perf_counter() - t0:5.0f}s] {phase[:22]:22s}... "
                  f"{case.name[:38]:38s}", done=False)
    return say


def _progress(line, done, keep=False):
    """A progress line on stderr. On a terminal each line overwrites the last (kept: a new
    line of its own); in a log every finished line is a line, and the phases within a case
    (done=False) are left out."""
    if sys.stderr.isatty():  # a kept line ends its own line: the next one starts below it
        print(("\n" if keep else "\r") + line, end="\n" if keep else "", file=sys.stderr,
              flush=True)
    elif done:
        print(line.rstrip(), file=sys.stderr, flush=True)


def _spec(fn):
    """MODULE:CALLABLE for an importable function, else its repr."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    return f"{module}:{name}" if module and name and "<" not in name else repr(fn)


def _implementation(impl):
    if isinstance(impl, str):
        return load(impl)
    if isinstance(impl, Implementation):
        return impl
    if not callable(impl):
        raise TypeError(f"impl must be a name, an Implementation or a callable, got "
                        f"{type(impl).__name__}")
    return Implementation(getattr(impl, "__name__", "callable"), impl)


def replay(certificate, impl=None, **kw):
    """Re-run the failed cases of a saved certificate (a path or its dict), with their seeds,
    against impl (default: the implementation the certificate names). Returns a Report."""
    where = "certificate" if isinstance(certificate, dict) else str(certificate)
    try:
        if not isinstance(certificate, dict):
            with open(certificate) as f:
                certificate = json.load(f)
        failed = [(_case(c["case"]), c["seed"]) for c in certificate["cases"]
                  if c["verdict"] == "fail"]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where} is not a verify certificate (written by --json or "
                         f"Report.save): {type(e).__name__}: {e}") from None
    impl = impl or certificate.get("impl_spec") or certificate["implementation"]["name"]
    report = compare(impl, cases=failed, suite=f"replay of {certificate.get('suite')}", **kw)
    report.nothing_to_replay = not failed
    return report


def _case(fields):
    fields = dict(fields)
    if fields.get("window") is not None:
        fields["window"] = tuple(fields["window"])
    return Case(**fields)


def assert_conforms(impl, **kw):
    """compare(impl, **kw), raising AssertionError with the report's text on any failure."""
    report = compare(impl, **kw)
    if not report.passed:
        raise AssertionError(str(report))
    return report
