"""numba_kernels/compile_cache.py: what the disk cache files a kernel under, on the CPU.

Loading a cached kernel needs a GPU (scripts/gpu_run.sh times a first and a second process);
here: the folder names every source a kernel is made from, the key Numba files an entry
under is the same in every process (Numba's own is not, for our kernels), and processes
compiling one variant take turns.
"""
import ast
import os
import subprocess
import sys
import threading
import time

import pytest

from numba_kernels import compile_cache

ROOT = compile_cache.ROOT


def _project_imports(path):
    """The project's modules that the file at `path` (relative to ROOT) imports."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    package = os.path.dirname(path).replace("/", ".")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package if node.level == 1 else (node.module or "")
            names = [f"{base}.{node.module}"] if node.level and node.module else [base]
            if node.level and not node.module:
                names = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            rel = name.replace(".", "/") + ".py"
            if os.path.exists(os.path.join(ROOT, rel)):
                found.add(rel)
    return found


def test_sources_hold_every_module_a_kernel_is_made_from():
    seen, todo = set(), ["numba_kernels/specs.py"]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += _project_imports(path)
    assert seen <= set(compile_cache.SOURCES), sorted(seen - set(compile_cache.SOURCES))


def test_each_variant_has_a_folder_of_its_own(monkeypatch, tmp_path):
    from numba_kernels.specs import choose_spec

    monkeypatch.setenv("FLASH_KERNEL_CACHE", str(tmp_path))
    a, b = choose_spec(64, 64, "float16", False), choose_spec(64, 64, "float16", True)
    folders = {compile_cache.variant_folder(k) for k in (a, b, ("merge", "float16"))}
    assert len(folders) == 3 and all(f.startswith(str(tmp_path)) for f in folders)
    assert compile_cache.sources_digest()[:24] in compile_cache.variant_folder(a)
    monkeypatch.setenv("FLASH_KERNEL_CACHE", "off")
    assert compile_cache.variant_folder(a) is None


# Run without the simulator (Numba's real dispatcher; nothing is compiled): the key of one
# entry, as a process files it, and the folder Numba was told.
KEY_SCRIPT = r"""
import hashlib, sys
from types import SimpleNamespace
from numba_kernels import specs
spec = specs.choose_spec(64, 64, "bfloat16", True)
kernel = specs.build_kernel(spec)
codegen = SimpleNamespace(magic_tuple=lambda: ("nvptx64-nvidia-cuda", "sm_90", ""))
key = kernel._cache._index_key(specs.signature(spec), codegen)
print(kernel._cache.cache_path)
print(hashlib.sha256(repr(key).encode()).hexdigest())
"""


def _key_in_new_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env.update(FLASH_KERNEL_CACHE=str(tmp_path), PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", KEY_SCRIPT], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.split()[-2:]


@pytest.mark.skipif(sys.platform == "win32", reason="the cache's lock is POSIX flock")
def test_an_entry_has_the_same_key_in_every_process(tmp_path):
    (path1, key1), (path2, key2) = (_key_in_new_process(tmp_path) for _ in range(2))
    assert path1 == path2 and path1.startswith(str(tmp_path))
    assert key1 == key2


class _Kernel:
    """Stands for a dispatcher (compiling only looks it up)."""


@pytest.mark.skipif(sys.platform == "win32", reason="the cache's lock is POSIX flock")
def test_compiles_of_one_variant_take_turns(tmp_path):
    kernel, events = _Kernel(), []
    compile_cache._FOLDERS[kernel] = str(tmp_path / "variant")

    def compile_once(name):
        with compile_cache.compiling(kernel):
            events.append(f"{name} start")
            time.sleep(0.2)
            events.append(f"{name} end")

    threads = [threading.Thread(target=compile_once, args=(n,)) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e.split()[1] for e in events] == ["start", "end", "start", "end"], events


def test_warmed_signatures_are_what_launches_pass():
    """Every launch passes C-contiguous arrays (arrays.py copies strided torch and CuPy inputs),
    so the signatures warm() compiles must say C for every array, one dimension included (a
    1-D kv_lengths typed F made every launch miss the warmed entry and compile again). Every
    variant of every kernel: warm() takes any of them (specs.compiled)."""
    from numba.core import types

    from numba_kernels.specs import compiled, gate_specs

    sigs = [compiled(s)[1] for s in gate_specs()]
    layouts = {t.layout for sig in sigs for t in sig if isinstance(t, types.Array)}
    assert layouts == {"C"}, layouts


def test_the_warm_lists_are_variants_the_gate_checks():
    """What the numba adapters warm is a subset of what the PTX gate compiles, and each list
    holds what its calls need: the delta kernel with either backward, the merges and the
    halves' pre-pass with the tensor-core forward; with the tensor-core backward the pre-pass
    that flags tiles holding a NaN or an inf."""
    from numba_kernels.flash_bwd import BwdSpec
    from numba_kernels.flash_mma import MmaSpec
    from numba_kernels.flash_mma_bwd import MmaBwdSpec, ScanSpec
    from numba_kernels.plain_bwd import PlainBwdSpec
    from numba_kernels.halves import halves_specs
    from numba_kernels.specs import gate_specs, variants

    gate = set(gate_specs())
    for forward in ("simt", "plain", "mma"):
        for backward in (None, "plain", "tuned", "mma"):
            wanted = variants(forward, backward)
            assert set(wanted) <= gate, (forward, backward)
            assert len(set(wanted)) == len(wanted), (forward, backward)
            parts = {s.part for s in wanted if isinstance(s, PlainBwdSpec)}
            assert parts == {None: set(), "plain": {"delta", "dkdv", "dq"},
                             "tuned": {"delta"}, "mma": {"delta"}}[backward]
            assert any(isinstance(s, BwdSpec) for s in wanted) == (backward == "tuned")
            assert {s.part for s in wanted if isinstance(s, MmaBwdSpec)} == (
                {"dkdv", "dk", "dv", "dq"} if backward == "mma" else set())  # kv_parts
            assert (ScanSpec("float16") in wanted) == (backward == "mma")
            assert any(isinstance(s, MmaSpec) for s in wanted) == (forward == "mma")
    # the tensor-core forward takes float32 too (kernel="mma"): its merge and the halves'
    # pre-pass
    assert "float32" in variants("mma") and "bfloat16" in variants("mma")
    assert set(halves_specs()) <= set(variants("mma"))
