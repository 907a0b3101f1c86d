"""The failure map: what the failed cases of a report have in common, which a kernel author
reads before the table ("every case with Nk % 64 != 0 fails; aligned cases pass").

Each case has traits (its dtype, whether Nk is a multiple of 64, whether it has fully masked
rows, ...). A trait explains the failures when every failure has it; it is exact when, on top
of that, every case with it fails. The map lists the exact traits first, then the others that
every failure shares, the most telling (highest share of failing cases) first.
"""
from dataclasses import asdict, dataclass

TILES = (16, 32, 64, 128)


def traits(case):
    """The traits of a case, as short phrases."""
    t = {f"dtype {case.dtype}", f"D = {case.D}" if case.D == case.Dv else "Dv != D"}
    for tile in TILES:
        for name, n in (("Nq", case.Nq), ("Nk", case.Nk)):
            t.add(f"{name} % {tile} {'!=' if n % tile else '=='} 0")
    t.add("Nq == 1" if case.Nq == 1 else "Nq > 1")
    t.add("Nq != Nk" if case.Nq != case.Nk else "Nq == Nk")
    t.add(f"causal {case.causal}" if case.causal else "not causal")
    if case.causal:
        t.add("causal (either alignment)")
    for name, present in (("a mask", case.mask), ("a bias", case.bias),
                          ("kv_lengths", case.kv_lengths), ("a window", case.window is not None),
                          ("GQA", case.Hq != case.Hk), ("an explicit scale",
                                                        case.scale is not None),
                          ("strided inputs", case.strided), ("non-finite inputs",
                                                             case.poison or "nan" in case.values
                                                             or "inf" in case.values)):
        t.add(f"{'with' if present else 'without'} {name}")
    if case.scale is not None and case.scale <= 0:
        t.add("scale <= 0")
    if case.check:
        t.add(f"call check {case.check}")
    return t


@dataclass
class Finding:
    trait: str
    failed: int  # failed cases with the trait
    run: int  # cases with the trait that ran (passed or failed)
    all_failures: bool  # every failure has the trait

    @property
    def exact(self):
        """Every failure has the trait and every case with it fails."""
        return self.all_failures and self.failed == self.run

    def sentence(self, total_failed):
        if self.exact:
            return f"every case with {self.trait!r} fails ({self.failed}); every other passes"
        if self.all_failures:
            return (f"all {total_failed} failures have {self.trait!r}; {self.failed} of the "
                    f"{self.run} cases with it fail")
        return (f"every case with {self.trait!r} fails ({self.failed} of the {total_failed} "
                f"failures)")

    def to_dict(self):
        return dict(asdict(self), exact=self.exact)


def failure_map(results, limit=5):
    """Findings for the failed results among those that ran, most telling first: traits every
    failure shares, else traits whose every case fails."""
    ran = [r for r in results if r.verdict in ("pass", "fail")]
    failed = [r for r in ran if r.verdict == "fail"]
    if not failed:
        return []
    counts = {}
    for r in ran:
        for trait in traits(r.case):
            n_failed, n_run = counts.get(trait, (0, 0))
            counts[trait] = (n_failed + (r.verdict == "fail"), n_run + 1)
    findings = [Finding(t, f, n, f == len(failed)) for t, (f, n) in counts.items()
                if n < len(ran) and (f == len(failed) or (f == n and n >= 2))]
    findings.sort(key=lambda f: (not f.exact, not f.all_failures, f.run if f.all_failures
                                 else -f.failed, f.trait))
    return findings[:limit]


def conventions(results):
    """{convention: number of cases} of what fully masked rows gave, from the case notes."""
    seen = {}
    for r in results:
        for line in r.detail.splitlines():
            if line.startswith("fully masked rows give "):
                name = line.removeprefix("fully masked rows give ")
                seen[name] = seen.get(name, 0) + 1
    return seen
