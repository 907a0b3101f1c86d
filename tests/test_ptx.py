"""Every shipped kernel variant compiles for sm_90 without spills, local memory, float64
instructions or shared memory over the static limit (numba_kernels/ptx_report.py).

Runs in a subprocess without the CUDA simulator, which cannot compile PTX.
"""
import os
import subprocess
import sys

import pytest


def test_every_shipped_variant_compiles_clean(tmp_path):
    pytest.importorskip("cuda.bindings", reason="needs numba-cuda[cu13] (the cu13 extra)")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    run = subprocess.run([sys.executable, "-m", "numba_kernels.ptx_report", "--json",
                          str(tmp_path / "ptx.json")], capture_output=True, text=True, env=env,
                         timeout=1200)
    tail = "\n".join(run.stdout.splitlines()[-15:]) + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " 0 failed" in run.stdout, tail
