"""Every shipped kernel variant compiles for sm_90 without spills, local memory, float64
instructions or shared memory over the static (or the dynamic) limit
(numba_kernels/ptx_report.py); a variant with launch bounds may spill BOUNDED_SPILL bytes, a
careful one CAREFUL_SPILL.

Runs in a subprocess without the CUDA simulator, which cannot compile PTX. Compiling the 591
kernels (numba_kernels.specs.gate_specs) takes about 12 minutes on 2 cores: tests/conftest.py starts the report as soon as this
test is collected, on every core beside the other tests, and runs this test last, to collect
its result. The report caches each variant's figures under a key of everything they depend
on (ptx_report.py), so a run after an unchanged kernel compiles nothing; a fresh clone reads
them from the committed record (.ci/ptx_record.json) where the keys are unchanged.
"""
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest

from tests.conftest import CORES

GATE_TEST = "test_every_shipped_variant_compiles_clean"
_GATE = {}  # the running report: process, output file, its json path


def start_gate(jobs=None):
    """Starts the report in the background (once a session); a no-op without the ptx extra."""
    if _GATE:
        return
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        return
    folder = tempfile.mkdtemp(prefix="ptx_report_")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    # a file, not a pipe: a pipe nobody reads during the run could fill and block it. Closed
    # by the test or by stop_gate.
    out = open(os.path.join(folder, "report.txt"), "w+")  # noqa: SIM115
    command = [sys.executable, "-m", "numba_kernels.ptx_report", "--json",
               os.path.join(folder, "ptx.json")] + (["--jobs", str(jobs)] if jobs else [])
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True,
                               env=env)
    if CORES:  # every core, also when this worker keeps to one (tests/conftest.py); set
        os.sched_setaffinity(process.pid, CORES)  # while it imports, before its pool starts
    _GATE.update(process=process, out=out)


def stop_gate():
    """Ends a report still running (the session stopped early)."""
    if _GATE and _GATE["process"].poll() is None:
        _GATE["process"].kill()
        _GATE["process"].wait()
    if _GATE:
        _GATE["out"].close()


def test_every_shipped_variant_compiles_clean():
    pytest.importorskip("cuda.bindings", reason="needs the ptx extra (numba-cuda[cu13] and ptxas)")
    start_gate()  # already running when conftest started it
    returncode = _GATE["process"].wait(timeout=1800)
    _GATE["out"].seek(0)
    output = _GATE["out"].read()
    _GATE["out"].close()
    tail = "\n".join(output.splitlines()[-15:])
    assert returncode == 0, tail
    assert " 0 failed" in output, tail


def test_the_cache_serves_only_an_unchanged_variant(tmp_path, monkeypatch):
    from numba_kernels import ptx_report

    compiled = []

    def fake_check(args):
        compiled.append(args)
        return dict(spec=repr(args[0]), ok=True)

    monkeypatch.setattr(ptx_report, "check_variant", fake_check)
    job = ("spec", (9, 0), "ptxas", "digest", str(tmp_path))
    assert ptx_report.cached_check(job) == dict(spec="'spec'", ok=True)
    assert ptx_report.cached_check(job)["cached"] and len(compiled) == 1
    for changed in (("other spec", (9, 0), "ptxas", "digest"),  # the variant
                    ("spec", (8, 0), "ptxas", "digest"),  # compute capability
                    ("spec", (9, 0), "ptxas", "other sources")):  # a dependency
        assert "cached" not in ptx_report.cached_check(changed + (str(tmp_path),))
    assert len(compiled) == 4
    ptx_report.cached_check(job[:4] + (None,))  # no folder: no cache
    assert len(compiled) == 5


def test_the_digest_follows_the_sources(tmp_path, monkeypatch):
    pytest.importorskip("numba_cuda")
    from numba_kernels import ptx_report

    fake_ptxas = tmp_path / "ptxas"
    fake_ptxas.write_text("#!/bin/sh\necho ptxas 13.0\n")
    fake_ptxas.chmod(0o755)
    first = ptx_report.dependencies_digest(str(fake_ptxas))
    assert first == ptx_report.dependencies_digest(str(fake_ptxas))
    real_open = open

    def edited(path, mode="r", *args, **kw):  # the kernel's source, one byte more
        f = real_open(path, mode, *args, **kw)
        if str(path).endswith("flash_fwd.py") and "b" in mode:
            import io

            return io.BytesIO(f.read() + b" ")
        return f

    monkeypatch.setattr("builtins.open", edited)
    assert ptx_report.dependencies_digest(str(fake_ptxas)) != first


def test_the_record_serves_only_unchanged_keys(tmp_path, monkeypatch):
    """A committed record (.ci/ptx_record.json) gives a variant's figures only under its own
    key (the sources, versions, variant and compute capability): any other is compiled."""
    from numba_kernels import ptx_report

    figures = dict(registers=32, shared=0, stack_frame=0, spill_stores=0, spill_loads=0)
    monkeypatch.setattr(ptx_report, "cached_check",
                        lambda job: dict(spec=repr(job[0]), ok=True, compiled=True, **figures))
    monkeypatch.setattr(ptx_report, "ProcessPoolExecutor", _InProcess)
    path = str(tmp_path / "record.json")
    key = ptx_report.variant_key("digest", "a", (9, 0))
    failed = dict(spec="'a'", ok=False, error="ptxas said no")
    ptx_report.write_record({key: dict(failed, cached=True)}, path)
    record = ptx_report.read_record(path)
    assert record == {key: failed}
    keys, rows = ptx_report.run_gate(["a", "b"], (9, 0), "ptxas", "digest", None, record, 1)
    assert rows[0] == dict(failed, cached=True)  # from the record, even a FAIL
    assert rows[1]["compiled"] and keys[1] == ptx_report.variant_key("digest", "b", (9, 0))
    for digest, cc in (("other sources", (9, 0)), ("digest", (8, 0))):
        _, rows = ptx_report.run_gate(["a"], cc, "ptxas", digest, None, record, 1)
        assert rows[0]["compiled"]
    assert ptx_report.read_record(str(tmp_path / "missing.json")) == {}


class _InProcess:
    """ProcessPoolExecutor's map, in this process (the test's stand-ins are not pickled)."""

    def __init__(self, jobs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, items):
        return map(fn, items)


def test_the_gate_lists_every_variant_a_call_can_launch():
    """The variant each kernel would launch for head dims d, dv (every d up to 256, dv = d,
    d + 1, 8), each dtype and mask, is among gate_specs(): the plain kernels and the delta
    kernel pad to pad()'s widths, the tuned backward to bwd_width's, the tensor-core kernels
    (forward and backward) to mma_width's."""
    from numba_kernels.flash_bwd import BwdSpec, bwd_width
    from numba_kernels.flash_mma import MmaSpec
    from numba_kernels.mma_parts import mma_width
    from numba_kernels.plan import mma_plan
    from numba_kernels.flash_mma_bwd import MmaBwdSpec, ScanSpec, kv_parts
    from numba_kernels.halves import halves_specs
    from numba_kernels.plain_bwd import PlainBwdSpec
    from numba_kernels.plain_fwd import PlainSpec
    from numba_kernels.specs import DTYPES, MAX_HEAD_DIM, choose_spec, gate_specs, pad

    gate = set(gate_specs())
    missing = set()
    for d in range(1, MAX_HEAD_DIM + 1):
        for dv in {d, min(d + 1, MAX_HEAD_DIM), 8}:
            w = pad(max(d, dv))
            for dtype in DTYPES:
                for m in (False, True):
                    wanted = [choose_spec(d, dv, dtype, m), choose_spec(d, dv, dtype, m, True),
                              PlainSpec(w, dtype, m), PlainBwdSpec("delta", w, dtype, False),
                              PlainBwdSpec("dkdv", w, dtype, m), PlainBwdSpec("dq", w, dtype, m)]
                    wanted += [BwdSpec(part, bwd_width(d, dv), bwd_width(d, dv), dtype, m)
                               for part in ("dkdv", "dq")]
                    if mma_plan(SimpleNamespace(d=d, dv=dv, dtype=dtype), m) is None:
                        wanted += [MmaSpec(mma_width(d), mma_width(dv), dtype, m, p, c)
                                   for p in (False, True) for c in (False, True)]
                        wanted += halves_specs() if dtype == "float32" else [ScanSpec(dtype)]
                        wd, wv = mma_width(d), mma_width(dv)
                        wanted += [MmaBwdSpec(part, wd, wv, dtype, m, n)
                                   for part in kv_parts(dtype, wd, wv, m) + ("dq",)
                                   for n in (False, True)]
                    missing |= set(wanted) - gate
    assert not missing, sorted(map(str, missing))[:10]


def test_the_gate_fails_dynamic_shared_memory_over_a_blocks_limit(monkeypatch):
    """ptxas counts only static shared memory: a variant's dynamic bytes (the tuned
    backward's tiles past 48 KB) are checked against the 227 KB a block may take, and a spec
    asking for more is refused when it is made."""
    from contextlib import nullcontext

    from numba_kernels import numba_internals, ptx_report, specs
    from numba_kernels.flash_bwd import BwdSpec

    monkeypatch.setattr(numba_internals, "compiling_for", lambda cc: nullcontext())
    monkeypatch.setattr(specs, "compile_ptx", lambda spec, cc: "ptx")
    monkeypatch.setattr(ptx_report, "ptxas_figures", lambda ptx, cc, ptxas: dict(
        registers=200, spill_stores=0, spill_loads=0, stack_frame=0, shared=0,
        f64_instructions=0))
    shipped = BwdSpec("dkdv", 128, 128, "float32", False)
    row = ptx_report.check_variant((shipped, (9, 0), "ptxas"))
    assert row["ok"] and row["dynamic_shared"] == shipped.dynamic_shared_bytes > 48 * 1024
    too_big = SimpleNamespace(dynamic_shared_bytes=227 * 1024 + 4)
    row = ptx_report.check_variant((too_big, (9, 0), "ptxas"))
    assert not row["ok"] and row["problems"] == ["shared"]
    with pytest.raises(ValueError, match="inconsistent backward kernel spec"):
        BwdSpec("dkdv", 256, 256, "float32", False, (64, 64, 16, 16)).check()


@pytest.mark.parametrize("spilled, bounds, careful, ok", [
    (0, None, False, True), (8, None, False, False), (16, (128, 3), False, True),
    (20, (128, 3), False, False), (8, None, True, True), (12, None, True, False)])
def test_only_a_bounded_or_careful_variant_may_spill_and_only_a_little(monkeypatch, spilled,
                                                                       bounds, careful, ok):
    """A variant compiled with launch bounds (MmaSpec.launch_bounds) may spill up to
    BOUNDED_SPILL bytes each way, a careful one (the blocks a fast one deferred) CAREFUL_SPILL;
    any other variant not at all."""
    from contextlib import nullcontext

    from numba_kernels import numba_internals, ptx_report, specs

    monkeypatch.setattr(numba_internals, "compiling_for", lambda cc: nullcontext())
    monkeypatch.setattr(specs, "compile_ptx", lambda spec, cc: "ptx")
    monkeypatch.setattr(ptx_report, "ptxas_figures", lambda ptx, cc, ptxas: dict(
        registers=168, spill_stores=spilled, spill_loads=spilled, stack_frame=spilled,
        shared=0, f64_instructions=0))
    assert ptx_report.BOUNDED_SPILL == 16 and ptx_report.CAREFUL_SPILL == 8
    spec = SimpleNamespace(launch_bounds=bounds, careful=careful, dynamic_shared_bytes=0)
    assert ptx_report.check_variant((spec, (9, 0), "ptxas"))["ok"] == ok
