"""What the kernel must show on a GPU, in one run: verify's battery, and sanitizers.

    python scripts/dev/gpu_check.py [--out DIR] [--quick] [--no-sanitize]

1. verify's battery (the full suite, every dtype; --quick: the standard suite) on
   flash_attention's default (kernel="auto": the tensor-core kernel for the 16-bit cases it
   takes, the SIMT kernel for the rest), with what only a GPU run of our own kernels shows:
   every output buffer poisoned with NaN first (every element must be written), and every call preceded by a call of the same
   layout on other tensors, so that the judged call reuses that launch plan (launch.py) and
   must take every pointer from its own arguments. verify does the rest (the float64 truth,
   determinism, inputs unchanged, strided inputs, streams, fully masked rows).
2. compute-sanitizer racecheck and memcheck on small launches of several variants.
Timings are benchmarks/attention_speed.py's job.
Writes DIR/gpu_check.json (verify's report) and prints verify's summary last. Exit code 0
only if all passed.
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from numba import config  # noqa: E402

config.CUDA_LOW_OCCUPANCY_WARNINGS = 0
import torch  # noqa: E402

import verify  # noqa: E402
from numba_kernels import api, flash_attention, launch  # noqa: E402


def poison_outputs():
    """Every output buffer the kernel gets starts as NaN."""
    def empty(self, shape, dtype):
        return torch.full(shape, float("nan"), dtype=getattr(torch, dtype), device="cuda")

    api._TorchIO.empty = empty


def after_a_call_on_other_tensors(q, k, v, **options):
    """flash_attention(q, k, v), after the same call on fresh tensors of the same layout."""
    others = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
              .copy_(torch.randn_like(x)) for x in (q, k, v)]
    flash_attention(*others, **options)
    return flash_attention(q, k, v, **options)


def battery(quick):
    impl = verify.builtin("numba")
    impl.fn = after_a_call_on_other_tensors
    return verify.compare(impl, suite="standard" if quick else "full")


SANITIZE = """
import torch
from numba_kernels import flash_attention
g = torch.Generator(device="cuda").manual_seed(0)
def r(*s, dt=torch.float32):
    return torch.randn(*s, device="cuda", generator=g).to(dt)
m = torch.rand(2, 1, 200, 77, device="cuda", generator=g) < 0.5
flash_attention(r(2, 2, 200, 64), r(2, 1, 77, 64), r(2, 1, 77, 64), mask=m, causal="top_left")
flash_attention(r(1, 2, 100, 128, dt=torch.bfloat16), r(1, 2, 150, 128, dt=torch.bfloat16),
                r(1, 2, 150, 128, dt=torch.bfloat16), causal="bottom_right",
                kv_lengths=torch.tensor([111], device="cuda", dtype=torch.int32))
flash_attention(r(1, 1, 40, 256, dt=torch.float16), r(1, 1, 70, 256, dt=torch.float16),
                r(1, 1, 70, 256, dt=torch.float16), window=(9, 3), return_lse=True)
flash_attention(r(1, 3, 33, 40), r(1, 1, 65, 40), r(1, 1, 65, 24))
flash_attention(r(2, 4, 1, 64, dt=torch.float16), r(2, 4, 900, 64, dt=torch.float16),
                r(2, 4, 900, 64, dt=torch.float16), num_splits=5, causal="bottom_right",
                kernel="simt")
flash_attention(r(2, 4, 1, 64, dt=torch.float16), r(2, 4, 900, 64, dt=torch.float16),
                r(2, 4, 900, 64, dt=torch.float16), num_splits=5, causal="bottom_right")
# the tensor-core kernel: cp.async double buffering, ldmatrix, a partial last key tile, a
# V tile holding NaN (the slow path), Dv != D
vn = r(1, 2, 150, 64, dt=torch.bfloat16)
vn[0, 0, 70] = float("nan")
flash_attention(r(1, 4, 100, 128, dt=torch.bfloat16), r(1, 2, 150, 128, dt=torch.bfloat16),
                vn, causal="bottom_right", mask=m[:1, :, :100, :77].repeat(1, 1, 1, 2)[..., :150],
                kernel="mma")
flash_attention(r(2, 2, 200, 64, dt=torch.float16), r(2, 2, 77, 64, dt=torch.float16),
                r(2, 2, 77, 64, dt=torch.float16), window=(9, 3), kernel="mma")
torch.cuda.synchronize()
print("sanitize launches done")
"""


def sanitize(out_dir):
    results = {}
    path = os.path.join(out_dir, "sanitize_case.py")
    with open(path, "w") as f:
        f.write(SANITIZE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    for tool in ("racecheck", "memcheck"):
        t0 = time.time()
        # Host API errors are cuda-bindings probing driver entry points at start-up, not
        # memory errors of any kernel: leave them out of the summary.
        run = subprocess.run(["compute-sanitizer", "--tool", tool, "--report-api-errors", "no",
                              sys.executable, path],
                             capture_output=True, text=True, env=env, timeout=240)
        text = run.stdout + run.stderr
        with open(os.path.join(out_dir, f"sanitize_{tool}.log"), "w") as f:
            f.write(text)
        summary = [ln for ln in text.splitlines() if "ERROR SUMMARY" in ln or "RACECHECK" in ln]
        results[tool] = dict(rc=run.returncode, seconds=round(time.time() - t0, 1),
                             summary=summary[-3:], done="launches done" in text)
        print(f"compute-sanitizer {tool}: rc={run.returncode} {summary[-3:]} "
              f"({results[tool]['seconds']} s)", flush=True)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--quick", action="store_true", help="verify's standard suite, not full")
    ap.add_argument("--no-sanitize", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    poison_outputs()
    report = battery(a.quick)
    report.save(os.path.join(a.out, "gpu_check.json"))
    sanitized = {} if a.no_sanitize else sanitize(a.out)
    with open(os.path.join(a.out, "sanitize.json"), "w") as f:
        json.dump(sanitized, f, indent=1)
    print(report)
    fast = launch.FAST_LAUNCHES[0]
    print(f"launches that reused a plan (launch.py): {fast}" + ("" if fast else
          " (FAIL: every call took Numba's launch)"))
    san_ok = all(s["rc"] == 0 and s["done"] for s in sanitized.values())
    print("sanitizers:", {t: s["summary"] for t, s in sanitized.items()})
    return 0 if report.passed and san_ok and fast else 1


if __name__ == "__main__":
    sys.exit(main())
