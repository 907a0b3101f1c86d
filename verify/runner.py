"""Running one case against one implementation, defensively: verify never crashes on a bad
kernel. Everything the kernel does wrong (raising, hanging, a wrong type, shape, dtype or
device, writing its inputs, aliasing them, caching, nondeterminism, wrong values) becomes a
failed CaseResult. How an implementation is called is calling.py; the steps of a case,
pipeline.py; the call checks (cases.CHECKS), checks.py; the backward's cases, backward.py.
"""
import time

from reference.dtypes import numpy_dtype
from .backward import run_backward_case
from .calling import HUNG, Fail
from .cases import make_inputs, sample_rows
from .checks import CHECK_RUNNERS, applicable
from .pipeline import call_and_check, judge_result
from .report import CaseResult

__all__ = ["HUNG", "run_case"]


def run_case(impl, case, seed, say=None):
    """The CaseResult of one case. say(message): progress within a scale-suite case (drawing
    billions of inputs and the truth take minutes), whose phases' times go into its detail."""
    claimed, missing = impl.supports.claims(case)
    if not claimed:
        return CaseResult(case, seed, "not claimed", f"needs {missing}")
    why_not = applicable(impl, case)
    if why_not:
        return CaseResult(case, seed, "not claimed", why_not)
    short = memory_shortfall(impl, case) if case.sampled else None
    if short:
        return CaseResult(case, seed, "skipped", short)
    phases = _Phases(say if case.sampled else None)
    phases.start("drawing the inputs")
    inputs = make_inputs(case, seed)
    if case.backward:
        return run_backward_case(impl, case, seed, inputs)
    phases.start("calling")
    t0 = time.perf_counter()
    try:
        run = CHECK_RUNNERS[case.check] if case.check else call_and_check
        inputs, out, lse, notes = run(impl, case, seed, inputs)
    except Fail as e:
        if case.sampled and "out of memory" in str(e).lower():
            return CaseResult(case, seed, "skipped", f"not run to the end: {e}")
        return CaseResult(case, seed, "fail", str(e), seconds=time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    phases.start(f"the truth on {len(sample_rows(case)) if case.sampled else case.Nq} rows")
    result = judge_result(impl, case, seed, inputs, out, lse, notes, seconds)
    if case.sampled:
        result.detail = "\n".join(filter(None, [result.detail, phases.end()]))
    return result


class _Phases:
    """Seconds spent in each phase of a case, announced through say as each starts."""

    def __init__(self, say):
        self.say, self.times, self.name, self.t0 = say, [], None, None

    def start(self, name):
        now = time.perf_counter()
        if self.name:
            self.times.append((self.name, now - self.t0))
        self.name, self.t0 = name, now
        if self.say and name:
            self.say(name)

    def end(self):
        self.start(None)
        return "phases: " + ", ".join(f"{name} {t:.0f} s" for name, t in self.times)


def memory_shortfall(impl, case):
    """None, or why a scale-suite case cannot run here: the memory its inputs and output
    need (host, and device for a CUDA implementation) against what is free."""
    item = numpy_dtype(case.dtype).itemsize
    elements = case.B * (case.Hq * case.Nq * (case.D + case.Dv)
                         + case.Hk * case.Nk * (case.D + case.Dv))
    scores = case.Nq * case.Nk * (case.B * case.Hq if case.mask_shape == "head" else 1)
    extra = scores * ((1 if case.mask else 0) + (item if case.bias else 0))
    need = {"host": elements * (2 * item + 4) + 2 * extra,
            "device": elements * item + extra * 4}  # a bias may be widened to float32
    have = {"host": _host_free(), "device": _device_free(impl)}
    for where, n in need.items():
        if have[where] is not None and n > have[where]:
            return (f"not run: needs about {n / 2**30:.1f} GiB of {where} memory, "
                    f"{have[where] / 2**30:.1f} GiB free")
    return None


def _host_free():
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _device_free(impl):
    if impl.device != "cuda":
        return None
    try:
        import torch

        return torch.cuda.mem_get_info()[0]
    except Exception:  # noqa: BLE001 - no torch, or no CUDA: not known
        return None
