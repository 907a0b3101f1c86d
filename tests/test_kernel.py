"""The Numba kernel against the reference, under the project's error criterion.

Without a GPU this runs in the CUDA simulator (tests/conftest.py), so sizes are tiny; the
sizes are still chosen around the tiles of the variants they select (BLOCK_M = 64, BLOCK_N = 32
for D <= 64; 64 x 16 up to 128, 32 x 32 for D = 96 with a mask; 16 x 16 up to 256): verify's
edge cases (verify.cases.edge_cases), with the kernel's own checks.
tests/test_gpu.py runs the standard battery on a GPU.
"""
import zlib

import numpy as np
import pytest

from numba_kernels import api, arrays, plain_attention
from reference.dtypes import numpy_dtype
from verify.cases import edge_cases, make_inputs
from verify.criterion import judge


def flash_attention(q, k, v, **options):
    """These tests are of the SIMT kernel (flash_fwd.py); tests/test_mma.py has the other."""
    return api.flash_attention(q, k, v, kernel="simt", **options)


def inputs(seed, B=1, Hq=2, Hk=1, Nq=5, Nk=7, D=16, Dv=None, dtype="float32"):
    rng = np.random.default_rng(seed)
    t = numpy_dtype(dtype)
    return (rng.standard_normal((B, Hq, Nq, D)).astype(t),
            rng.standard_normal((B, Hk, Nk, D)).astype(t),
            rng.standard_normal((B, Hk, Nk, Dv or D)).astype(t))


@pytest.fixture
def poisoned(monkeypatch):
    """Every output buffer starts as NaN, so an element the kernel never writes shows up."""
    original = arrays.Pending.__init__

    def init(self, shape, dtype):
        original(self, shape, dtype)
        fill = np.full(shape, np.nan, np.float32).astype(self.device.dtype) \
            if dtype != "bfloat16" else np.full(shape, 0x7FC0, np.int16)
        self.device.copy_to_device(fill)

    monkeypatch.setattr(arrays.Pending, "__init__", init)


def check(q, k, v, **options):
    out, lse = flash_attention(q, k, v, return_lse=True, **options)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    assert out.shape == q.shape[:3] + v.shape[3:] and lse.shape == q.shape[:3]
    for c in judge(q, k, v, out, lse, **options):
        assert c.passed, c.message()
    return out, lse


EDGES = {case.name: case for case in edge_cases()}


@pytest.mark.parametrize("name", list(EDGES))
def test_against_reference(name, poisoned):
    """verify's edge cases (verify.cases.edge_cases), every output buffer poisoned."""
    q, k, v, options = make_inputs(EDGES[name], zlib.crc32(name.encode()))
    out, lse = check(q, k, v, **options)
    if "mask" in options:  # a row that sees no key: out = 0, lse = -inf (the contract)
        empty = ~np.broadcast_to(options["mask"], lse.shape + k.shape[2:3]).any(-1)
        assert (out[empty] == 0).all() and (lse[empty] == -np.inf).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_inputs(dtype, poisoned):
    q, k, v = inputs(1, Nq=33, Nk=40, dtype=dtype)
    check(q, k, v, causal="bottom_right")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_plain_kernel_low_precision_with_mask_and_bias(dtype, poisoned):
    """The plain kernel (plain_fwd.py) on 16-bit inputs; verify's quick suite certifies it in
    float32 (tests/test_verify.py)."""
    q, k, v = inputs(3, B=2, Hq=4, Hk=2, Nq=21, Nk=37, Dv=24, dtype=dtype)
    rng = np.random.default_rng(3)
    options = dict(mask=rng.random((2, 4, 21, 37)) < 0.7, causal="bottom_right",
                   bias=rng.standard_normal((1, 4, 21, 37)).astype(numpy_dtype(dtype)))
    out, lse = plain_attention(q, k, v, return_lse=True, **options)
    assert out.dtype == q.dtype and out.shape == (2, 4, 21, 24)
    for c in judge(q, k, v, out, lse, **options):
        assert c.passed, c.message()


def test_invisible_garbage_changes_nothing():
    q, k, v = inputs(2, B=2, Nq=5, Nk=36)
    lengths = np.array([3, 33])
    clean = flash_attention(q, k, v, kv_lengths=lengths, return_lse=True)
    k2, v2 = k.copy(), v.copy()
    k2[0, :, 3:], v2[0, :, 3:] = np.nan, np.inf  # padding past kv_lengths
    k2[1, :, 33:], v2[1, :, 33:] = -np.inf, np.nan
    q2 = q.copy()
    got = flash_attention(q2, k2, v2, kv_lengths=lengths, return_lse=True)
    for a, b in zip(got, clean):
        assert np.array_equal(a, b, equal_nan=False)
    # Masked by causal inside a tile: key 4 is hidden from rows 0..3 (top-left).
    v3 = v.copy()
    v3[:, :, 4, 0] = np.nan
    out, lse = flash_attention(q, k, v3, causal="top_left", return_lse=True)
    assert np.isfinite(out[:, :, :4]).all() and np.isnan(out[:, :, 4, 0]).all()
    assert np.isfinite(out[:, :, 4, 1:]).all() and np.isfinite(lse).all()
    check(q, k, v3, causal="top_left")


def test_nan_in_a_visible_key_reaches_its_rows():
    q, k, v = inputs(3, Nq=6, Nk=6)
    k[0, 0, 2, 5] = np.nan
    out, lse = check(q, k, v, causal="top_left")
    assert np.isnan(out[0, :, 2:]).all() and np.isfinite(out[0, :, :2]).all()


SPLITS = {  # name: (input shape arguments, options, num_splits)
    "decode": (dict(Nq=1, Nk=100), {}, 3),
    "causal-tails": (dict(Nq=5, Nk=70), dict(causal="bottom_right"), 2),
    "more-splits-than-tiles": (dict(Nq=3, Nk=40), {}, 7),
    # split 2 of batch 0 and every split of batch 1 see no key; batch 2 keeps one key
    "kv-lengths": (dict(B=3, Nq=2, Nk=96), dict(kv_lengths=np.array([50, 0, 1])), 3),
    "mask": (dict(Nq=4, Nk=70), "mask", 3),
    "window": (dict(Nq=6, Nk=80), dict(window=(40, 0), causal="bottom_right"), 3),
    "float16": (dict(Nq=2, Nk=70, dtype="float16"), {}, 2),
    "bfloat16": (dict(Nq=2, Nk=70, dtype="bfloat16", D=100), {}, 4),
}


@pytest.mark.parametrize("name", list(SPLITS))
def test_split_kv(name, poisoned):
    """Keys split across blocks and merged by lse give the contract's answer, and the answer
    of one block per query tile up to rounding."""
    shape, options, n_splits = SPLITS[name]
    q, k, v = inputs(zlib.crc32(name.encode()), **shape)
    if options == "mask":
        mask = np.random.default_rng(1).random((q.shape[2], k.shape[2])) < 0.3
        mask[0] = False  # fully masked
        mask[1] = False
        mask[1, 66] = True  # one key, in the last split
        options = dict(mask=mask)
    out, lse = flash_attention(q, k, v, return_lse=True, num_splits=n_splits, **options)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    for c in judge(q, k, v, out, lse, **options):
        assert c.passed, c.message()
    whole, whole_lse = flash_attention(q, k, v, return_lse=True, num_splits=1, **options)
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if q.dtype == np.float32 else 1e-2
    np.testing.assert_allclose(out.astype(np.float32), whole.astype(np.float32),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("blocks, n_k, resident, want", [
    (64, 32768, 4, 8),  # decoding, 64 (b, h): 8 splits fill 132 SMs x 4 blocks
    (64, 32768, 3, 6),  # 8 would be 1.3 waves of 3 blocks an SM: one wave of 6
    (64, 32768, 2, 4),  # 2 an SM (the wgmma forward's shared memory at D = 128)
    (64, 128, 4, 2),  # 8 key tiles of 16: at least 4 tiles a split
    (264, 8192, 4, 2),  # half the resident blocks: two splits fill the GPU
    (264, 8192, 2, 1),  # a wave already
    (512, 1024, 4, 1),  # 512 of 528 resident blocks: a split would only add the merge
    (4096, 8192, 4, 1),
])
def test_choose_splits_fills_one_wave_of_resident_blocks(blocks, n_k, resident, want):
    from numba_kernels.split_kv import choose_splits

    assert choose_splits(blocks, n_k, 16, n_sm=132, resident=resident) == want


@pytest.mark.parametrize("first, last, n_splits, split_keys", [
    (28672, 32768, 8, 64),  # decoding in a window of the last 4096 keys
    (96, 32768, 8, 32),  # a band starting past key 0
    (0, 200, 3, 64),  # fewer pieces than...
    (0, 130, 8, 64),  # ... splits: the last splits empty
    (64, 64, 4, 16),  # no key at all
])
def test_split_shares_cut_the_band_itself(first, last, n_splits, split_keys):
    """split-KV's shares (schedule.split_share) are disjoint, in order, cover the keys
    first .. last exactly, meet at multiples of split_keys, and each holds at most
    ceil(pieces / n_splits) of the band's pieces of split_keys: a window's keys go to every
    split (cut from key 0, the window of decoding fell to one split)."""
    from numba_kernels.schedule import split_share

    shares = [split_share(first, last, s, n_splits, split_keys) for s in range(n_splits)]
    held = [(a, b) for a, b in shares if a < b]
    keys = [j for a, b in held for j in range(a, b)]
    assert keys == list(range(first, last))
    assert all(b % split_keys == 0 for _, b in held[:-1])
    pieces = -(-(last - first // split_keys * split_keys) // split_keys)
    assert all(b - a <= -(-pieces // n_splits) * split_keys for a, b in held)
    if pieces >= n_splits:
        assert len(held) > n_splits // 2


def test_split_kv_nan_reaches_only_its_rows():
    q, k, v = inputs(6, Nq=3, Nk=90)
    v[0, 0, 80, 3] = np.nan  # the last split; row 0 (top-left causal) never sees key 80
    out, lse = flash_attention(q, k, v, return_lse=True, num_splits=3, causal="bottom_right")
    assert np.isnan(out[0, :, :, 3]).all() and np.isfinite(np.delete(out, 3, axis=3)).all()
    out, lse = flash_attention(q, k, v, return_lse=True, num_splits=3, causal="top_left")
    assert np.isfinite(out).all() and np.isfinite(lse).all()


@pytest.mark.parametrize("shape", [(0, 5), (5, 0)], ids=["Nq=0", "Nk=0"])
def test_empty(shape):
    q, k, v = inputs(4, Nq=shape[0], Nk=shape[1])
    out, lse = flash_attention(q, k, v, return_lse=True)
    assert out.shape == (1, 2, shape[0], 16) and (out == 0).all() and (lse == -np.inf).all()


def test_empty_batch():
    q = np.zeros((0, 2, 4, 16), np.float32)
    out, lse = flash_attention(q, q, q, return_lse=True)
    assert out.shape == (0, 2, 4, 16) and lse.shape == (0, 2, 4)


def test_strided_inputs_deterministic_and_untouched():
    rng = np.random.default_rng(5)
    # (B, N, H, D) storage viewed as (B, H, N, D): non-contiguous.
    q = rng.standard_normal((1, 20, 2, 16)).astype(np.float32).transpose(0, 2, 1, 3)
    k = rng.standard_normal((1, 33, 1, 16)).astype(np.float32).transpose(0, 2, 1, 3)
    v = rng.standard_normal((1, 33, 1, 16)).astype(np.float32).transpose(0, 2, 1, 3)
    before = [x.copy() for x in (q, k, v)]
    a = check(q, k, v)
    b = flash_attention(q, k, v, return_lse=True)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)), "two runs differ"
    assert all(np.array_equal(x, y) for x, y in zip((q, k, v), before)), "inputs were written"


BAD = {
    "head-dim": (dict(D=300), {}, ValueError, "at most 256"),
    "float64": ("float64", {}, TypeError, "dtype in"),
    "causal-true": ({}, dict(causal=True), ValueError, "top_left"),
    "mask-shape": ({}, dict(mask=np.ones((3, 3), bool)), ValueError, "does not broadcast"),
    "lengths-range": ({}, dict(kv_lengths=np.array([9])), ValueError, "lie in"),
    "num-splits": ({}, dict(num_splits=0), ValueError, "num_splits must be"),
    "mask-list": ({}, dict(mask=[[True]]), TypeError, "mask must be a boolean array"),
    "scale-nan": ({}, dict(scale=float("nan")), ValueError, "scale must be a finite"),
    "spec-str": ({}, dict(spec="bogus"), TypeError, "spec must be a KernelSpec"),
    "return-lse-str": ({}, dict(return_lse="no"), TypeError, "return_lse must be True or"),
    "window-floats": ({}, dict(window=(1.5, 2.7)), TypeError, "window must be a pair"),
    "causal-zero": ({}, dict(causal=0.0), ValueError, "causal must be one of"),
    "scale-past-float32": ({}, dict(scale=1e38), ValueError, "scores can pass float32's range"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    shape, options, err, pattern = BAD[case]
    if shape == "float64":
        q, k, v = (x.astype(np.float64) for x in inputs(0))
    else:
        q, k, v = inputs(0, **shape)
    with pytest.raises(err, match=pattern):
        flash_attention(q, k, v, **options)


def test_mixed_array_kinds_rejected():
    from numba import cuda

    q, k, v = inputs(0)
    with pytest.raises(TypeError, match="same kind of array"):
        flash_attention(q, cuda.to_device(k), v)


def test_a_torch_mask_with_numpy_inputs_is_refused_by_name():
    torch = pytest.importorskip("torch")
    q, k, v = inputs(0)
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    with pytest.raises(TypeError, match="mask is a torch array and q a numpy one"):
        flash_attention(q, k, v, mask=mask)


def test_a_large_scale_within_float32_is_taken():
    """scale 1e30 on inputs of ordinary size: scores up to about 1e32, within float32; the
    check reads the inputs' largest values and lets the call run."""
    q, k, v = inputs(0)
    out = flash_attention(q, k, v, scale=1e30)
    assert np.isfinite(out).all()


def test_legal_spellings_give_the_same_answer():
    """A NumPy float32 scale and big-endian arrays are taken: the same bits as the plain
    spelling."""
    q, k, v = inputs(0)
    want = flash_attention(q, k, v, scale=0.5)
    got = flash_attention(*(x.astype(">f4") for x in (q, k, v)), scale=np.float32(0.5))
    assert np.array_equal(got, want)


def test_strided_numba_device_array_rejected():
    """Strided torch and CuPy inputs are copied contiguous; a strided Numba device array is
    refused by name (every variant is compiled for C-contiguous arrays only)."""
    from numba import cuda

    q, k, v = (cuda.to_device(x) for x in inputs(0))
    with pytest.raises(ValueError, match="k: a strided Numba device array"):
        flash_attention(q, k[:, :, ::2], v[:, :, ::2])


def test_compile_time_is_recorded_only_when_a_launch_compiles(monkeypatch):
    """launch adds a launch's seconds to COMPILE_SECONDS only when Numba compiled a new
    version of the kernel (its overloads grew); the simulator compiles nothing."""
    from numba_kernels import compile_times, launch

    monkeypatch.setattr(launch, "COMPILE_SECONDS", {})

    class Kernel:  # a dispatcher as launch sees it: kernel[config](*args), .overloads
        def __init__(self):
            self.overloads = {}

        def __getitem__(self, config):
            def run(*args):
                self.overloads.setdefault(type(args[0]), "compiled")
            return run

    kernel = Kernel()
    launch.launch(kernel, "k", 1, 1, 0, np.zeros(1))
    assert list(compile_times()) == ["k"]
    first = compile_times()["k"]
    launch.launch(kernel, "k", 1, 1, 0, np.zeros(1))  # same types: no compile
    assert compile_times()["k"] == first
    launch.launch(kernel, "k", 1, 1, 0, [0.0])  # new argument types: a second version
    assert compile_times()["k"] > first


def test_one_description_of_the_kernels_arguments():
    """ARGS names the kernels' parameters, their Numba types and every launch's arguments:
    the kernel functions take exactly those names, and a launch given a missing or an unknown
    name fails instead of shifting the arguments."""
    import inspect

    from numba_kernels.common import ARG_NAMES, ARGS, kernel_args
    from numba_kernels.flash_fwd import kernel_source
    from numba_kernels.plain_fwd import PLAIN_ARG_NAMES, plain_kernel_source
    from numba_kernels.specs import plain_signature, shipped_specs, signature

    spec = shipped_specs()[0]
    assert tuple(inspect.signature(kernel_source(spec)).parameters) == ARG_NAMES
    assert tuple(inspect.signature(plain_kernel_source(64, 64, "float32", True)).parameters) \
        == PLAIN_ARG_NAMES
    assert len(signature(spec)) == len(ARGS)
    from numba_kernels.plain_fwd import PlainSpec

    assert len(plain_signature(PlainSpec(64, "float32", True))) == len(PLAIN_ARG_NAMES)
    values = {name: i for i, name in enumerate(ARG_NAMES)}
    assert kernel_args(**values) == tuple(range(len(ARG_NAMES)))
    with pytest.raises(TypeError, match=r"missing \['n_splits'\], unknown \['nsplits'\]"):
        kernel_args(**{("nsplits" if n == "n_splits" else n): v for n, v in values.items()})


def test_a_kernel_whose_parameters_drift_from_its_args_is_refused():
    from numba_kernels.common import check_parameters

    def kernel(q, k, v):
        pass

    check_parameters(kernel, ("q", "k", "v"))
    with pytest.raises(TypeError, match="takes"):
        check_parameters(kernel, ("q", "v", "k"))


@pytest.mark.parametrize("kernel", ["plain", "tuned"])
def test_a_key_whose_score_is_minus_inf_takes_no_part(kernel):
    """The contract: a score of -inf, however it arose, hides the key; its values, NaN
    included, reach nothing."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 4, 16)).astype(np.float32) for _ in range(3))
    q[..., 0] = np.abs(q[..., 0]) + 0.1  # every row's score with key 2 is -inf
    k[0, 0, 2, 0] = -np.inf
    v[0, 0, 2, :] = np.nan
    attention = plain_attention if kernel == "plain" else flash_attention
    assert np.isfinite(attention(q, k, v)).all()


@pytest.mark.parametrize("impl", ["numba", "numba-plain", "numba-mma"])
def test_no_kernel_reads_shared_or_local_memory_it_did_not_write(impl):
    """With the simulator's new arrays full of NaN, the kernels still pass tile-edge and
    hidden-NaN cases: no element is read before it is written (on a GPU such a read gives
    whatever the memory held, which may pass by luck)."""
    from numba_kernels.numba_internals import poisoned_memory
    from verify.adapters import load
    from verify.cases import battery, edge_cases
    from verify.runner import run_case

    dtype = "float16"
    names = ("mask empty rows", "kv_lengths 0, 1, Nk", "v:nan in keys some rows see")
    cases = [c for c in battery("quick", dtypes=(dtype,)) if c.name.startswith(names)]
    cases += [c for c in edge_cases(dtype) if "45x31" in c.name or "9x33" in c.name]
    if impl == "numba-mma":  # 32 threads an instruction in the simulator: one case
        cases = [c for c in cases if "9x33" in c.name]
    implementation = load(impl)
    with poisoned_memory():
        for case in cases:
            if implementation.supports.claims(case)[0]:
                result = run_case(implementation, case, seed=7)
                assert result.verdict == "pass", (case.name, result.detail)
