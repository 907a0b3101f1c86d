"""Kernel variants compiled into the disk cache (compile_cache.py) before a run needs them, on
every core: worker processes compile them, and the run's own first launches load them.
conformance does this through an implementation's warm hook (verify.adapters' numba
adapters)."""
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor

from numba import cuda

from .compile_cache import cache_root, compiling, folder_of
from .convert import SIMULATOR
from .specs import compiled, variants


def warm_variants(forward, backward=None, jobs=None, say=None):
    """warm() the variants that calls of forward kernel `forward` ("simt", "plain" or "mma")
    and backward kernel `backward` (None, "plain", "tuned" or "mma") can launch
    (specs.variants). Returns the number compiled now."""
    return warm(variants(forward, backward), jobs=jobs, say=say)


def warm(specs, jobs=None, say=None):
    """Compile `specs` (any of specs.gate_specs(): kernel variants, merge kernels by dtype)
    into the disk cache, with the argument types every launch passes (specs.compiled), on
    `jobs` processes (default: every core), skipping those compiled there before.
    say(line): progress. Returns the number compiled now."""
    if SIMULATOR or cache_root() is None:
        return 0
    cc = cuda.get_current_device().compute_capability
    todo = [s for s in dict.fromkeys(specs) if not _warmed(s, cc)]
    if not todo:
        return 0
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    if say:
        say(f"compiling {len(todo)} kernel variants on {jobs} processes, once for this "
            f"machine (kept in {cache_root()})")
    t0 = time.perf_counter()
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for done, _ in enumerate(pool.map(_warm_one, todo), 1):
            if say and (done % 10 == 0 or done == len(todo)):
                say(f"  {done}/{len(todo)} compiled ({time.perf_counter() - t0:.0f} s)")
    return len(todo)


def _marker(kernel, cc):
    """The file that says `kernel` was warmed for cc, in its cache folder (None: not cached)."""
    folder = folder_of(kernel)
    return folder and os.path.join(folder, f"warm-sm{cc[0]}{cc[1]}")


def _warmed(spec, cc):
    """Whether `spec` needs no warming: compiled for cc before, or not kept on disk at all."""
    marker = _marker(compiled(spec)[0], cc)
    return marker is None or os.path.exists(marker)


def _warm_one(spec):
    """In a worker process: compile `spec` into the cache."""
    kernel, types = compiled(spec)
    with compiling(kernel):
        kernel.compile(types)
    open(_marker(kernel, cc=cuda.get_current_device().compute_capability), "w").close()
    return spec
