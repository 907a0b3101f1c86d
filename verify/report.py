"""Results: one CaseResult per case, gathered in a Report that prints as a table (after the
failure map and the capability coverage) and saves as a JSON certificate that
`python -m verify --replay` re-runs."""
import datetime
import hashlib
import json
import os
import platform
import re
import subprocess
from dataclasses import dataclass, field

from .failure_map import conventions, failure_map

VERDICTS = ("pass", "fail", "not claimed", "skipped")


@dataclass
class CaseResult:
    case: object
    seed: int
    verdict: str  # pass, fail, not claimed, skipped (not run: an earlier case hung)
    detail: str = ""
    comparisons: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def worst_ratio(self):
        return max((c.ratio for c in self.comparisons), default=float("nan"))

    def reproducer(self, impl_spec):
        """A snippet that reruns this case with the reference beside the implementation.
        impl_spec: a built-in name or MODULE:CALLABLE; anything else (a function defined
        where it cannot be imported) leaves a line for the reader to fill in."""
        loadable = impl_spec and "<" not in impl_spec and " " not in impl_spec
        impl = (f"impl = load({impl_spec!r})\n" if loadable else
                "impl = Implementation('mine', my_attention)  # your kernel and its Supports\n")
        return (
            "from verify.cases import Case, make_inputs\n"
            "from verify.adapters import Implementation, load\n"
            "from verify.runner import run_case\n"
            f"case = Case(**{self.case.to_dict()!r})\n"
            f"q, k, v, options = make_inputs(case, seed={self.seed})  # the inputs, NumPy\n"
            + impl + f"print(run_case(impl, case, seed={self.seed}).detail)\n")

    def to_dict(self):
        return dict(case=self.case.to_dict(), seed=self.seed, verdict=self.verdict,
                    detail=self.detail, seconds=round(self.seconds, 4),
                    comparisons=[c.to_dict() for c in self.comparisons])


@dataclass
class Report:
    implementation: dict
    suite: str
    seed: int
    environment: dict
    cases: list = field(default_factory=list)
    impl_spec: str = ""
    costs: str = None  # the implementation's line on costs outside the calls (compiles)
    coverage: dict = field(default_factory=dict)  # claimed capability -> cases exercising it
    battery_hash: str = ""
    nothing_to_replay: bool = False  # a replay of a certificate that records no failure
    duration_s: float = 0.0  # the whole run, seconds

    @property
    def failures(self):
        return [c for c in self.cases if c.verdict == "fail"]

    @property
    def unexercised(self):
        """Claimed capabilities no case exercised: a bug of verify's battery."""
        return sorted(cap for cap, names in self.coverage.items() if not names)

    @property
    def passed(self):
        """True when no case failed and at least one case passed, or when a replay found no
        failed case to run. (Skipped cases, for want of memory or after a hang, are listed;
        a hang is itself a failure.)"""
        return not self.failures and (self.nothing_to_replay
                                      or any(c.verdict == "pass" for c in self.cases))

    def counts(self):
        return {v: sum(c.verdict == v for c in self.cases) for v in VERDICTS}

    def to_dict(self):
        return dict(implementation=self.implementation, impl_spec=self.impl_spec,
                    suite=self.suite, seed=self.seed, battery_hash=self.battery_hash,
                    environment=self.environment, verdict="pass" if self.passed else "fail",
                    duration_s=round(self.duration_s, 1),
                    counts=self.counts(), costs=self.costs,
                    failure_map=[f.to_dict() for f in failure_map(self.cases)],
                    fully_masked_rows=conventions(self.cases), coverage=self.coverage,
                    unexercised=self.unexercised,
                    nothing_to_replay=self.nothing_to_replay,
                    precision_measured=[dict(output=name, dtype=dtype, **m) for (name, dtype), m
                                        in self.precision().items()],
                    cases=[c.to_dict() for c in self.cases])

    def save(self, path):
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, default=str)

    def summary_lines(self):
        """The failure map, the fully-masked-row conventions and the coverage: read first."""
        lines = []
        findings = failure_map(self.cases)
        ran = sum(c.verdict in ("pass", "fail") for c in self.cases)
        if self.failures:
            lines.append(f"failure map ({len(self.failures)} of {ran} cases failed):")
            if len(self.failures) == ran:
                lines.append("  every case that ran fails")
            elif findings:
                lines += [f"  {f.sentence(len(self.failures))}" for f in findings]
            else:
                lines.append("  no trait is shared by the failures (see each case below)")
        seen = conventions(self.cases)
        if seen:
            lines.append("fully masked rows give: " + ", ".join(
                f"{name} ({n} cases)" for name, n in sorted(seen.items())))
        covered = {cap: len(names) for cap, names in self.coverage.items() if names}
        if covered:
            lines.append("claimed and exercised (cases): " + ", ".join(
                f"{cap} ({n})" for cap, n in covered.items()))
        if self.unexercised:
            lines.append("VERIFY BUG: claimed but exercised by no case: "
                         + ", ".join(self.unexercised))
        measured = self.precision()
        if measured:
            claimed = self.implementation.get("precision") or "not stated"
            lines.append(f"precision ({claimed}) on ordinary values, the worst slice, in units "
                         "of the dtype at the slice's own scale (plain same-precision beside it):")
            lines += [f"  {name} {dtype}: {m['ulps']:.3g} units, plain {m['plain_ulps']:.3g} "
                      f"({m['ulps'] / max(m['plain_ulps'], 1e-30):.3g}x); about "
                      f"{m['effective_bits']:.1f} bits kept, in {m['case']!r}"
                      for (name, dtype), m in measured.items()]
        return lines

    def precision(self):
        """{(output, dtype): the largest ulps over the cases of ordinary values (standard
        normal draws, nothing non-finite) that ran, with the plain implementation's in that
        case, its effective bits and the case's name}: the precision the kernel ran at,
        measured where the scores are of ordinary size (elsewhere the floor's score term,
        not the arithmetic, sets what a correct kernel errs by)."""
        worst = {}
        for r in self.cases:
            if r.case.values != "normal" or r.case.poison:
                continue
            for c in r.comparisons:
                key = (c.name, c.dtype)
                if key not in worst or c.ulps > worst[key]["ulps"]:
                    worst[key] = dict(ulps=c.ulps, plain_ulps=c.plain_ulps,
                                      effective_bits=c.effective_bits, case=r.case.name)
        return worst

    def __str__(self):
        if self.nothing_to_replay:
            return (f"{self.implementation.get('name')}: the certificate records no failed "
                    f"case, so there is nothing to replay -> PASS")
        lines = self.summary_lines() + [
            f"{'case':44s} {'verdict':12s} {'max abs err':>11s} {'err/bound':>9s} "
            f"{'seconds':>7s}"]
        for r in self.cases:
            err = max((c.max_abs_error for c in r.comparisons), default=float("nan"))
            lines.append(f"{r.case.name[:44]:44s} {r.verdict:12s} {err:11.2e} "
                         f"{r.worst_ratio:9.3f} {r.seconds:7.2f}")
        c = self.counts()
        version = self.implementation.get("version")
        lines.append(f"{self.implementation.get('name')}"
                     + (f" ({version})" if version else "")
                     + f" on {self.environment.get('device')}: {c['pass']} passed, "
                     f"{c['fail']} failed, {c['not claimed']} not claimed"
                     + (f", {c['skipped']} skipped" if c["skipped"] else "")
                     + f" -> {'PASS' if self.passed else 'FAIL'}"
                     + (f" in {self.duration_s:.0f} s" if self.duration_s else ""))
        if self.costs:
            lines.append(self.costs)
        for r in self.failures:
            lines.append(f"\nFAILED {r.case.name}: {r.detail}\nreproduce:\n"
                         + r.reproducer(self.impl_spec))
        return "\n".join(lines)


def battery_hash(cases):
    """sha256 of the cases' fields: two certificates with one hash ran the same battery."""
    text = json.dumps([c.to_dict() for c in cases], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def environment(impl):
    """Where and when the run happened: time, host, project and library versions, device and
    driver where they can be read."""
    env = dict(timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), python=platform.python_version(), machine=platform.machine(),
        device="cpu", project=_project_version(), commit=_commit())
    env["uncommitted_changes"] = env["commit"].endswith("+dirty") if env["commit"] else None
    for module in ("numpy", "numba", "numba_cuda", "torch", "cupy", "jax"):
        version = _loaded_version(module)
        if version:
            env[module] = version
    if impl.device == "cuda":
        try:
            import torch

            env["device"] = torch.cuda.get_device_name()
            env["cuda"] = torch.version.cuda
        except Exception:  # noqa: BLE001 - the report must not fail for want of torch
            env["device"] = "cuda"
        env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"])
    elif impl.version.endswith("(CUDA simulator)"):
        env["device"] = "cpu (CUDA simulator)"
    return env


def _loaded_version(module):
    """The version of a module that is importable (numpy is always; the others only if the
    implementation or this run already imported them, so that a report imports nothing)."""
    import sys

    if module != "numpy" and module not in sys.modules:
        return ""
    try:
        return __import__(module).__version__
    except (ImportError, AttributeError):
        return ""


def _project_version():
    from importlib import metadata

    try:
        return metadata.version("flash-conformance")
    except metadata.PackageNotFoundError:  # run from a checkout: its pyproject.toml
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        try:
            with open(os.path.join(root, "pyproject.toml")) as f:
                found = re.search(r'^version = "([^"]+)"', f.read(), re.M)
            return found.group(1) if found else ""
        except OSError:
            return ""


def _commit():
    """The git commit of this checkout (with "+dirty" if it has changes to tracked files), or
    "" where it is not a git checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.exists(os.path.join(root, ".git")):
        return ""
    commit = _run(["git", "-C", root, "rev-parse", "HEAD"])
    dirty = _run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"])
    return commit + ("+dirty" if dirty else "")


def _run(command):
    try:
        return subprocess.run(command, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
