"""Scripts that compile kernels for a real GPU (sm_90a) on any machine: in a process of their
own, without the CUDA simulator, which cannot compile PTX."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_compiler_script(script, *args):
    """stdout of `python -c script args` with the simulator off and the repository and tests/
    importable; the test fails with its stderr when it exits non-zero, and is skipped where
    the ptx extra (numba-cuda[cu13] and ptxas) is not installed."""
    pytest.importorskip("cuda.bindings", reason="needs the ptx extra (numba-cuda[cu13] and ptxas)")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"),
                                           os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout
