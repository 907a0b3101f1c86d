"""Compile every shipped kernel variant for a real GPU, on any machine, and check the result.

    python -m numba_kernels.ptx_report [--cc 9.0] [--jobs 2] [--json PATH] [--no-cache]
                                       [--record]

For each variant of the tuned kernel, the split-KV merge kernel of each dtype, the plain
kernels (plain_fwd.py and the backward's plain_bwd.py) and the tuned backward (flash_bwd.py),
with the argument types every launch passes (C-contiguous arrays: arrays.py makes strided
inputs contiguous): numba.cuda.compile_ptx
for the compute capability, then `ptxas -v`, which reports registers, spills, stack frame and
shared memory. A variant fails when it spills, needs a stack frame (arrays that fell out of
registers into local memory; the plain kernels keep a row or a key there by design, so for
them only the rest counts; a variant compiled with launch bounds, which ask ptxas for a
register count that gives more blocks an SM, may spill up to BOUNDED_SPILL bytes each way;
a careful variant, which runs only the blocks its fast one deferred, CAREFUL_SPILL),
uses more static shared memory than 48 KB (or more dynamic shared memory, the tuned
backward's larger tiles, than the 227 KB a block may take), or has a float64 instruction in
its PTX (a bare Python float turns float32 arithmetic into float64). The CUDA simulator
cannot show any of this.
Exit code 0 only when every variant passes.

Each variant's figures are cached (FLASH_PTX_CACHE, default ~/.cache/flash-conformance/ptx)
under a key made of everything its PTX and ptxas's verdict depend on: the sources it is
compiled from (SOURCES: reference/contract.py too, whose key_range is in the kernel), the
variant, the compute capability, the numba and numba-cuda versions and ptxas's
own version. A change to any of them is a new key, so a cached figure is never stale.

The record (.ci/ptx_record.json, written by --record and committed with the kernels) holds
the figures of a whole run under the same keys: a fresh clone, CI's, takes a variant's figures
from it only where its key is unchanged (the same sources, numba, numba-cuda, ptxas and
compute capability), and compiles every other variant. A kernel change without a new record
costs CI the compile (about 9 minutes on 2 cores for all of gate_specs), never a stale verdict.
"""
import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

from numba_kernels.compile_cache import SOURCES as KERNEL_SOURCES


def find_ptxas():
    """ptxas of the same CUDA release as the NVVM that wrote the PTX, else the one on PATH."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else []):
        for path in sorted(glob.glob(os.path.join(root, "cu*", "bin", "ptxas")), reverse=True):
            return path
    found = shutil.which("ptxas")
    if not found:
        raise RuntimeError("ptxas not found: pip install 'flash-conformance[ptx]' (it brings "
                           "nvidia-cuda-nvcc), or put a CUDA toolkit's bin folder on PATH")
    return found


CACHE = os.environ.get("FLASH_PTX_CACHE",
                       os.path.join(os.path.expanduser("~"), ".cache", "flash-conformance", "ptx"))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, ".ci", "ptx_record.json")


# Every file the compiled variants are made from (compile_cache.SOURCES), and this one.
SOURCES = KERNEL_SOURCES + ("numba_kernels/ptx_report.py",)
# Bytes a variant with launch bounds may spill (stores, and loads): a few registers, which
# L1 serves once a step; more would be a slow kernel.
BOUNDED_SPILL = 16
# Bytes a careful variant (MmaSpec.careful: it does again only the blocks the fast one
# deferred, a row that ended non-finite, most calls none) may spill: the float32 summed ones
# sit at the register limit, and split-KV's shares (schedule.key_tiles) push them past it
# (docs/design/tensor_cores.md).
CAREFUL_SPILL = 8


def dependencies_digest(ptxas):
    """sha256 of what every variant's result depends on besides the variant itself."""
    import numba
    import numba_cuda

    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(ROOT, name), "rb") as f:
            h.update(name.encode() + f.read())
    version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    h.update(f"{numba.__version__} {numba_cuda.__version__} {version}".encode())
    return h.hexdigest()


def cached_check(args):
    """check_variant, through the cache when args carry a digest (args[4]) and a folder."""
    spec, cc, ptxas, digest, folder = args
    if not folder:
        return check_variant(args[:3])
    path = os.path.join(folder, variant_key(digest, spec, cc) + ".json")
    try:
        with open(path) as f:
            return dict(json.load(f), cached=True)
    except (OSError, ValueError):
        pass
    row = check_variant(args[:3])
    os.makedirs(folder, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(row, f)
    os.replace(path + ".tmp", path)  # whole or absent, whatever runs beside it
    return row


def variant_key(digest, spec, cc):
    """The cache's and the record's key of a variant's figures."""
    return hashlib.sha256(f"{digest} {spec!r} {cc}".encode()).hexdigest()


def read_record(path=RECORD):
    """{key: figures} of the committed record ({} when there is none)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def ptxas_figures(ptx, cc=(9, 0), ptxas=None):
    """What `ptxas -v` says of one PTX module for compute capability cc ((9, 0), or
    (9, 0, "a") for sm_90a's own instructions): registers, spill stores and loads, stack frame,
    shared bytes, and the count of .f64 instructions in the PTX. RuntimeError with ptxas's
    message when it rejects the module."""
    ptxas = ptxas or find_ptxas()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-arch=sm_" + "".join(map(str, cc)), "-v", path, "-o",
                              path + ".cubin"], capture_output=True, text=True)
    text = run.stdout + run.stderr
    if run.returncode != 0:
        raise RuntimeError(text.strip()[-500:])

    def number(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0

    return dict(registers=number(r"Used (\d+) registers"),
                spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"),
                stack_frame=number(r"(\d+) bytes stack frame"),
                shared=number(r"(\d+) bytes smem"),
                f64_instructions=len(re.findall(r"\.f64\b", ptx)))


def check_variant(args):
    spec, cc, ptxas = args
    from numba_kernels.common import DYNAMIC_SHARED_LIMIT, STATIC_SHARED_LIMIT
    from numba_kernels.numba_internals import compiling_for
    from numba_kernels.specs import compile_ptx

    with compiling_for(cc):  # this worker process launches nothing
        ptx = compile_ptx(spec, cc)
    name = f"merge_splits({spec})" if isinstance(spec, str) else repr(spec)
    try:
        row = dict(spec=name, **ptxas_figures(ptx, getattr(spec, "cc", cc), ptxas))
    except RuntimeError as e:
        return dict(spec=name, ok=False, error=str(e))
    # the plain kernels keep a row (or a key) in local memory by design
    plain = type(spec).__name__ in ("PlainSpec", "PlainBwdSpec")
    room = BOUNDED_SPILL if getattr(spec, "launch_bounds", None) else \
        CAREFUL_SPILL if getattr(spec, "careful", False) else 0
    allowed = dict(spill_stores=room, spill_loads=room, stack_frame=room)
    problems = [k for k in ("spill_stores", "spill_loads", "stack_frame", "f64_instructions")
                if row[k] > allowed.get(k, 0) and not (plain and k != "f64_instructions")]
    row["dynamic_shared"] = getattr(spec, "dynamic_shared_bytes", 0)
    if row["shared"] > STATIC_SHARED_LIMIT or row["dynamic_shared"] > DYNAMIC_SHARED_LIMIT:
        problems.append("shared")
    row.update(ok=not problems, problems=problems)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", default="9.0", help="compute capability, e.g. 9.0 (default)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write the per-variant figures here")
    ap.add_argument("--no-cache", action="store_true",
                    help=f"compile every variant, and read or write no cache ({CACHE}) and "
                         "no record")
    ap.add_argument("--record", action="store_true",
                    help=f"write every variant's figures to the record ({RECORD})")
    a = ap.parse_args(argv)
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        sys.exit("unset NUMBA_ENABLE_CUDASIM: the simulator cannot compile PTX")
    from numba_kernels.specs import gate_specs

    cc = tuple(int(x) for x in a.cc.split("."))
    ptxas = find_ptxas()
    specs = gate_specs()  # the plain kernels may use local memory (check_variant)
    folder = None if a.no_cache else CACHE
    digest = dependencies_digest(ptxas) if folder else None
    print(f"compiling {len(specs)} kernels for sm_{cc[0]}{cc[1]} with {ptxas}"
          + (f" (cache {folder})" if folder else ""), flush=True)
    record = read_record() if folder else {}
    keys, rows = run_gate(specs, cc, ptxas, digest, folder, record, a.jobs)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.record and folder:
        write_record({k: r for k, r in zip(keys, rows)})
    failed = [r for r in rows if not r["ok"]]
    cached = sum(bool(r.get("cached")) for r in rows)
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed ({cached} from the cache "
          f"or the record)")
    return 1 if failed else 0


def run_gate(specs, cc, ptxas, digest, folder, record, jobs):
    """(keys, rows): each variant's figures, from the record where its key is there, else
    from cached_check on `jobs` processes; a line printed per variant, in order."""
    keys = [variant_key(digest, s, cc) for s in specs]
    rows = []
    with ProcessPoolExecutor(jobs) as pool:
        computed = pool.map(cached_check, [(s, cc, ptxas, digest, folder)
                                           for s, k in zip(specs, keys) if k not in record])
        for i, key in enumerate(keys):
            row = dict(record[key], cached=True) if key in record else next(computed)
            rows.append(row)
            status = "ok" if row["ok"] else "FAIL " + ",".join(row.get("problems", ["ptxas"]))
            figures = row.get("error") or _figures(row)
            print(f"[{i + 1}/{len(specs)}] {row['spec']}: {figures} {status}"
                  + (" (cached)" if row.get("cached") else ""), flush=True)
    return keys, rows


def _figures(row):
    smem = row["shared"] + row.get("dynamic_shared", 0)
    return (f"{row['registers']:3d} regs {smem:6d} B smem stack {row['stack_frame']} spills "
            f"{row['spill_stores']}/{row['spill_loads']}")


def write_record(rows, path=RECORD):
    """The record: {key: figures} of a whole run (flags of where they came from dropped)."""
    with open(path, "w") as f:
        json.dump({k: {n: v for n, v in r.items() if n != "cached"} for k, r in rows.items()},
                  f, indent=0, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
