"""Results: one CaseResult per case, gathered in a Report that prints as a table and saves as
a JSON certificate."""
import json
import platform
from dataclasses import dataclass, field

VERDICTS = ("pass", "fail", "not claimed")


@dataclass
class CaseResult:
    case: object
    seed: int
    verdict: str  # pass, fail, not claimed
    detail: str = ""
    comparisons: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def worst_ratio(self):
        return max((c.ratio for c in self.comparisons), default=float("nan"))

    def reproducer(self, impl_spec):
        """A snippet that reruns this case with the reference beside the implementation."""
        return (
            "from verify.cases import Case, make_inputs\n"
            "from verify.adapters import load\n"
            "from verify.runner import run_case\n"
            f"case = Case(**{self.case.to_dict()!r})\n"
            f"q, k, v, options = make_inputs(case, seed={self.seed})\n"
            f"print(run_case(load({impl_spec!r}), case, seed={self.seed}).detail)\n")

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

    @property
    def failures(self):
        return [c for c in self.cases if c.verdict == "fail"]

    @property
    def passed(self):
        """True when no case failed and at least one case was run."""
        return not self.failures and any(c.verdict == "pass" for c in self.cases)

    def counts(self):
        return {v: sum(c.verdict == v for c in self.cases) for v in VERDICTS}

    def to_dict(self):
        return dict(implementation=self.implementation, suite=self.suite, seed=self.seed,
                    environment=self.environment, verdict="pass" if self.passed else "fail",
                    counts=self.counts(), costs=self.costs,
                    cases=[c.to_dict() for c in self.cases])

    def save(self, path):
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, default=str)

    def __str__(self):
        lines = [f"{'case':44s} {'verdict':12s} {'max abs err':>11s} {'err/bound':>9s} "
                 f"{'seconds':>7s}"]
        for r in self.cases:
            err = max((c.max_abs_error for c in r.comparisons), default=float("nan"))
            lines.append(f"{r.case.name[:44]:44s} {r.verdict:12s} {err:11.2e} "
                         f"{r.worst_ratio:9.3f} {r.seconds:7.2f}")
        c = self.counts()
        lines.append(f"{self.implementation.get('name')} ({self.implementation.get('version')})"
                     f" on {self.environment.get('device')}: {c['pass']} passed, "
                     f"{c['fail']} failed, {c['not claimed']} not claimed -> "
                     f"{'PASS' if self.passed else 'FAIL'}")
        if self.costs:
            lines.append(self.costs)
        for r in self.failures:
            lines.append(f"\nFAILED {r.case.name}: {r.detail}\nreproduce:\n"
                         + r.reproducer(self.impl_spec))
        return "\n".join(lines)


def environment(impl):
    """Where the run happened: host, device and driver where they can be read."""
    env = dict(python=platform.python_version(), machine=platform.machine(), device="cpu")
    if impl.device == "cuda":
        try:
            import torch

            env["device"] = torch.cuda.get_device_name()
            env["cuda"] = torch.version.cuda
        except Exception:  # noqa: BLE001 - the report must not fail for want of torch
            env["device"] = "cuda"
        try:
            import subprocess

            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    elif impl.version.endswith("(CUDA simulator)"):
        env["device"] = "cpu (CUDA simulator)"
    return env
