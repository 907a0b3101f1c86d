"""The Numba backward kernels (numba_kernels/plain_bwd.py, and the tuned flash_bwd.py)
certified by verify's backward cases in the CUDA simulator: tile-edge cases, and the cases
where backward kernels break. The
simulator runs a Python thread per CUDA thread, so these are chosen to take about a minute
of CPU; scripts/gpu_verify.sh runs the whole backward suite on a GPU."""
from dataclasses import replace

import numpy as np
import pytest

import verify
from numba_kernels import flash_attention, flash_attention_backward
from verify.backward import backward_battery
from verify.cases import Case, edge_cases

EDGES = ("causal bottom_right 45x31", "GQA, Dv != D", "MQA, head dim 1", "kv_lengths 0, 1, Nk",
         "mask with empty rows", "head dim 40")
HARD = ("backward: N = 5", "backward: dout strided", "bias + mask + kv_lengths",
        "k:nan in keys some rows see", "k:-inf in keys some rows see")


def numba_with(kernel):
    """verify's numba adapter with its gradients from flash_attention_backward(kernel=)."""
    return verify.builtin("numba" if kernel == "plain" else f"numba-{kernel}-backward")


@pytest.mark.long
@pytest.mark.parametrize("kernel", ["plain", "tuned"])
@pytest.mark.parametrize("which", ["edges", "hard"])
def test_backward_kernels_pass_verify(which, kernel):
    if which == "edges":
        cases = [replace(c, backward=True) for c in edge_cases()
                 if c.name.startswith(tuple(f"edge: {e}" for e in EDGES))]
        assert len(cases) == len(EDGES)
    else:
        cases = [c for c in backward_battery("quick", ("float32",))  # (the relayout case
                 if c.name.startswith(HARD) and c.dout != "relayout"]  # matters on a GPU)
        assert len(cases) >= len(HARD)
        cases.append(Case("GQA 2:1 with a mask, twice", B=1, Hq=4, Hk=2, Nq=17, Nk=20, D=16,
                          Dv=16, dtype="float32", mask="random", repeat=True, backward=True))
    report = verify.compare(numba_with(kernel), backward=True,
                            cases=list(zip(cases, range(len(cases)))), progress=False)
    assert report.passed, str(report)
    assert all(r.verdict == "pass" for r in report.cases), str(report)


@pytest.mark.parametrize("kernel, dtype", [("plain", "bfloat16"), ("tuned", "float16")])
def test_backward_kernels_low_precision(kernel, dtype):
    cases = [c for c in backward_battery("quick", (dtype,))
             if c.name.startswith("mask random")]
    report = verify.compare(numba_with(kernel), backward=True,
                            cases=list(zip(cases, range(9))), progress=False)
    assert report.passed and len(report.cases) == 1, str(report)


def test_backward_argument_errors():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(3))
    out, lse = flash_attention(q, k, v, return_lse=True, kernel="simt")
    with pytest.raises(ValueError, match=r"lse must be a float32 array of shape \(B, Hq, Nq\)"):
        flash_attention_backward(q, k, v, out, lse[..., :3], out)
    with pytest.raises(TypeError, match="dout must have q's dtype float32, got float64"):
        flash_attention_backward(q, k, v, out, lse, out.astype(np.float64))
    with pytest.raises(ValueError, match=r"out must have shape \(B, Hq, Nq, Dv\)"):
        flash_attention_backward(q, k, v, out[:, :1], lse, out)
    with pytest.raises(ValueError, match="kernel must be one of"):
        flash_attention_backward(q, k, v, out, lse, out, kernel="fast")
    with pytest.raises(ValueError, match="out shares memory with q"):
        flash_attention_backward(q, k, v, q, lse, out)  # D == Dv: q has out's shape
    with pytest.raises(ValueError, match=r"dlse must be a float32 array of shape \(B, Hq"):
        flash_attention_backward(q, k, v, out, lse, out, dlse=lse[..., :3])
    with pytest.raises(TypeError, match="dlse: expected a NumPy array"):
        flash_attention_backward(q, k, v, out, lse, out, dlse="0")


def test_torch_cpu_tensors_take_the_backward_as_numpy_arrays():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(3))
    out, lse = flash_attention(q, k, v, return_lse=True, kernel="simt")
    want = flash_attention_backward(q, k, v, out, lse, out, kernel="plain")
    got = flash_attention_backward(*(torch.from_numpy(x) for x in (q, k, v, out, lse, out)),
                                   kernel="plain")
    assert all(isinstance(g, torch.Tensor) and np.array_equal(g.numpy(), w)
               for g, w in zip(got, want))


@pytest.mark.parametrize("tiles", [(64, 64, 8, 8), (16, 32, 4, 8), (32, 16, 8, 4)])
def test_tuned_backward_in_dynamic_shared_memory(monkeypatch, tiles):
    """Tiles beyond the 48 KB of static shared memory (105 KB, 8 x 8 micro-tiles) pass as
    static ones do (here two of BLOCK_M != BLOCK_N), reading no shared word before it is
    written: the kernel's shared array is then as long as the launch makes it."""
    from numba_kernels import flash_bwd
    from numba_kernels.numba_internals import poisoned_memory

    monkeypatch.setitem(flash_bwd.TILES, 64, dict(dkdv=tiles, dq=tiles))
    spec = flash_bwd.BwdSpec("dkdv", 64, 64, "float32", True)
    assert spec.tiles == tiles and (spec.dynamic_shared_bytes > 48 * 1024) == (tiles[0] == 64)
    assert flash_bwd.BwdSpec("dq", 64, 64, "float32", True).tiles == tiles
    names = ("causal bottom_right 45x31", "mask with empty rows", "GQA, Dv != D")
    cases = [replace(c, backward=True) for c in edge_cases()
             if c.name.startswith(tuple(f"edge: {e}" for e in names))]
    assert len(cases) == len(names)
    with poisoned_memory():  # an element read before it is written is NaN
        report = verify.compare(numba_with("tuned"), backward=True,
                                cases=list(zip(cases, range(len(cases)))), progress=False)
    assert report.passed, str(report)
    assert all(r.verdict == "pass" for r in report.cases), str(report)


@pytest.mark.long
def test_tuned_backward_at_its_wider_tiles():
    """The shipped tiles of width 128 (256 threads a block, 4 x 4 micro-tiles, 170 KB of
    dynamic shared memory): a query tile past 64 (tile + 1 rows), a causal band, Dv != D.
    (Width 256's tiles differ only in their sizes; the simulator takes two minutes there.)"""
    case = Case("width 128: 65 x 33, bottom_right", B=1, Hq=1, Hk=1, Nq=65, Nk=33, D=128,
                Dv=96, dtype="float32", causal="bottom_right", backward=True)
    report = verify.compare(numba_with("tuned"), backward=True, cases=[(case, 0)],
                            progress=False)
    assert report.passed and all(r.verdict == "pass" for r in report.cases), str(report)
