"""Every shipped kernel variant compiles for sm_90 without spills, local memory, float64
instructions or shared memory over the static limit (numba_kernels/ptx_report.py).

Runs in a subprocess without the CUDA simulator, which cannot compile PTX. Compiling 243
kernels takes minutes of CPU, and the simulator tests use one core: so when other tests run
in the same session, tests/conftest.py starts the report as soon as this test is collected,
on one core beside them, and runs this test last, to collect its result.
"""
import os
import subprocess
import sys
import tempfile

import pytest

GATE_TEST = "test_every_shipped_variant_compiles_clean"
_GATE = {}  # the running report: process, output file, its json path


def start_gate(jobs=None):
    """Starts the report in the background (once a session); a no-op without the cu13 extra."""
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
    _GATE.update(process=subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                          text=True, env=env), out=out)


def stop_gate():
    """Ends a report still running (the session stopped early)."""
    if _GATE and _GATE["process"].poll() is None:
        _GATE["process"].kill()
        _GATE["process"].wait()
    if _GATE:
        _GATE["out"].close()


def test_every_shipped_variant_compiles_clean():
    pytest.importorskip("cuda.bindings", reason="needs numba-cuda[cu13] (the cu13 extra)")
    start_gate()  # already running when conftest started it
    returncode = _GATE["process"].wait(timeout=1800)
    _GATE["out"].seek(0)
    output = _GATE["out"].read()
    _GATE["out"].close()
    tail = "\n".join(output.splitlines()[-15:])
    assert returncode == 0, tail
    assert " 0 failed" in output, tail
