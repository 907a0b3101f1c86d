"""verify: certify any attention kernel against the float64 reference.

    import verify
    report = verify.compare("numba")                 # a built-in adapter, or
    report = verify.compare(my_fn, supports=verify.Supports(dtypes=("float16",)))
    print(report); report.save("certificate.json")
    verify.assert_conforms(my_fn)                    # raises AssertionError with the report

The error criterion is verify.criterion (one rule for the whole project); the battery is
verify.cases; python -m verify is the command line.
"""
import sys
import time

from .adapters import Implementation, Supports, builtin, load
from .cases import Case, battery
from .criterion import compare as compare_arrays
from .report import CaseResult, Report, environment
from .runner import run_case

__all__ = ["compare", "assert_conforms", "Implementation", "Supports", "Case", "Report",
           "CaseResult", "builtin", "load", "battery", "compare_arrays"]


def compare(impl, *, array=None, device=None, layout=None, dtypes=None, supports=None,
            suite="quick", seed=0, progress=True):
    """Run a suite against `impl` and return a Report.

    impl: a built-in name ("numba", "torch-efficient", ...), "MODULE:CALLABLE", an
    Implementation, or a callable fn(q, k, v, **options) -> out or (out, lse). array, device,
    layout and supports override the implementation's own; dtypes limits the battery.
    """
    impl_spec = impl if isinstance(impl, str) else getattr(impl, "name", repr(impl))
    if isinstance(impl, str):
        impl = load(impl)
    elif not isinstance(impl, Implementation):
        if not callable(impl):
            raise TypeError(f"impl must be a name, an Implementation or a callable, got "
                            f"{type(impl).__name__}")
        impl = Implementation(getattr(impl, "__name__", "callable"), impl)
    for name, value in (("array", array), ("device", device), ("layout", layout),
                        ("supports", supports)):
        if value is not None:
            setattr(impl, name, value)
    dtypes = tuple(dtypes or impl.supports.dtypes)
    cases = battery(suite, dtypes)
    report = Report(impl.describe(), suite, seed, environment(impl), impl_spec=impl_spec)
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        result = run_case(impl, case, seed + i)
        report.cases.append(result)
        if progress:
            print(f"\r[{i + 1}/{len(cases)} {time.perf_counter() - t0:5.0f}s] "
                  f"{result.verdict:11s} {case.name[:50]:50s}", end="", file=sys.stderr,
                  flush=True)
    if progress:
        print(file=sys.stderr)
    report.costs = impl.costs_line()
    return report


def assert_conforms(impl, **kw):
    """compare(impl, **kw), raising AssertionError with the report's text on any failure."""
    report = compare(impl, **kw)
    if not report.passed:
        raise AssertionError(str(report))
    return report
