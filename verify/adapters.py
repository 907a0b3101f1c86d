"""What verify calls: an Implementation wraps any attention kernel with its declared support.

The callable takes (q, k, v) in its own array type and layout, with the contract's keyword
options (scale, causal, mask, bias, kv_lengths, window), and returns out; when Supports.lse is
claimed it is also called with return_lse=True and must then return (out, lse). Supports says
what it claims; cases that need anything else are reported "not claimed", not failed.

Built-in adapters (imported lazily, by name): reference, numba, numba-plain,
numba-tuned-backward (numba's forward, gradients from numba_kernels/flash_bwd.py: what
flash_attention runs for float32 by default where the tensor cores do not apply),
numba-mma-highest (float32 on the tensor cores as float16 halves, each step's products
summed apart, forward and gradients: flash_mma.py and flash_mma_bwd.py with kernel="mma",
what "auto" runs for float32 by default, precision "highest", from 64 query rows without a
mask or bias), numba-mma-backward (the same at precision "high", mma.sync's own sums),
numba-mma (the tensor-core kernels alone:
flash_mma.py's forward, flash_mma_bwd.py's backward), numba-wgmma (the forward on Hopper's
warpgroup tensor cores, flash_wgmma.py, and the backward on them,
flash_wgmma_bwd.py), numba-ring and numba-allgather (ring attention and the seed's all-gather
scheme across ranks: with world_size, verify/distributed.py), torch-math, torch-efficient,
torch-flash, torch-cudnn (PyTorch's SDPA backends), torch-cp-efficient, torch-cp-flash,
torch-cp-cudnn (PyTorch's context_parallel over them, per rank: with world_size),
torch-flex (FlexAttention, with the case's mask as a BlockMask and bias as a score_mod),
flash-attn, jax-xla, jax-cudnn. Each states the conventions of its library: PyTorch's is_causal is top-left (bottom-right goes through
causal_lower_right), flash-attn's causal is bottom-right; neither returns lse from these
entry points except flash-attn.
"""
import importlib
from dataclasses import asdict, dataclass, field

import numpy as np

from reference.contract import check_attention_args, dense_visible
from reference.dtypes import KERNEL_DTYPES


@dataclass
class Supports:
    dtypes: tuple = KERNEL_DTYPES
    causal: tuple = ("top_left", "bottom_right")
    mask: bool = True  # boolean masks in every broadcast form (B or 1, Hq or 1, Nq, Nk)
    bias: bool = True  # additive float bias, in the same forms
    kv_lengths: bool = True
    window: bool = True
    gqa: bool = True
    dv_differs: bool = True
    lse: bool = True  # returns (out, lse) when called with return_lse=True
    nonfinite_hidden: bool = True  # claims that hidden NaN/inf values change nothing
    max_head_dim: int = 256
    head_dim_multiple: int = 1  # head dims it takes are multiples of this
    scale: tuple = ("positive", "zero", "negative")  # explicit scales it takes
    fully_masked: str = "zeros"  # rows with no visible key: "zeros" (the contract), "nan", "mean"
    batch_invariant: bool = True  # each (batch, head) alone gives bitwise the batched result
    hidden_bitwise: bool = True  # keys a row does not see change none of its output's bits
    out_buffer: bool = False  # takes out= (a caller's array, possibly a view) and fills it
    backward: bool = False  # gives dq, dk, dv (Implementation.grad): the backward suites
    # What it takes beyond features: refusals of other inputs are "not claimed", not failed
    equal_lengths: bool = False  # takes Nq == Nk only
    length_multiple: int = 1  # takes Nq and Nk that are multiples of this only
    head_dims: tuple = None  # takes these head dims only (D and Dv), e.g. (16, 32, 64, 128)

    def __post_init__(self):
        self.check()

    def check(self):
        """Raise TypeError or ValueError naming the field that is not what it must be: a
        certificate must not rest on a typo (a string where a tuple is meant, "no" for
        False)."""
        for name in ("dtypes", "causal", "scale"):
            check_names(f"Supports.{name}", getattr(self, name), CHOICES[name])
        for name in BOOLEAN_CLAIMS:
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"Supports.{name} must be True or False, got {value!r}")
        for name in ("max_head_dim", "head_dim_multiple", "length_multiple"):
            _positive_int(f"Supports.{name}", getattr(self, name))
        if self.head_dims is not None:
            if isinstance(self.head_dims, (str, bytes)) or not hasattr(self.head_dims,
                                                                       "__iter__"):
                raise TypeError(f"Supports.head_dims must be None or a tuple of head dims, "
                                f"got {self.head_dims!r}")
            for d in self.head_dims:
                _positive_int("Supports.head_dims' entries", d)
        if self.fully_masked not in CHOICES["fully_masked"]:
            raise ValueError(f"Supports.fully_masked must be one of "
                             f"{CHOICES['fully_masked']}, got {self.fully_masked!r}")

    def claims(self, case):
        """(True, "") or (False, the feature this case needs and the implementation lacks)."""
        for f in sorted(case.features()):
            kind, _, value = f.partition(":")
            ok = {"dtype": lambda: value in self.dtypes,
                  "causal": lambda: value in self.causal,
                  "scale": lambda: value in self.scale,
                  "window": lambda: self.window, "mask": lambda: self.mask,
                  "bias": lambda: self.bias,
                  "kv_lengths": lambda: self.kv_lengths, "gqa": lambda: self.gqa,
                  "dv_differs": lambda: self.dv_differs,
                  "nonfinite_hidden": lambda: self.nonfinite_hidden,
                  "out_buffer": lambda: self.out_buffer,
                  "backward": lambda: self.backward}[kind]()
            if not ok:
                return False, f
        if max(case.D, case.Dv) > self.max_head_dim:
            return False, f"head dim > {self.max_head_dim}"
        if case.D % self.head_dim_multiple or case.Dv % self.head_dim_multiple:
            return False, f"head dims that are multiples of {self.head_dim_multiple}"
        if self.head_dims is not None and not {case.D, case.Dv} <= set(self.head_dims):
            return False, (f"head dims {sorted({case.D, case.Dv})} (takes "
                           f"{', '.join(map(str, self.head_dims))} only)")
        if self.equal_lengths and case.Nq != case.Nk:
            return False, "Nq != Nk (takes equal query and key lengths only)"
        m = self.length_multiple
        if case.Nq % m or case.Nk % m:
            return False, f"lengths {case.Nq} x {case.Nk} (takes multiples of {m} only)"
        return True, ""

    def capabilities(self):
        """Every capability claimed, by the names exercised_by uses: each must be exercised
        by some case of every suite (a test says so)."""
        caps = [f"dtype:{d}" for d in self.dtypes] + [f"causal:{c}" for c in self.causal]
        caps += [f"scale:{s}" for s in self.scale] + [f"head_dim:{self.max_head_dim}"]
        caps += [name for name in ("mask", "bias", "kv_lengths", "window", "gqa", "dv_differs",
                                   "lse", "nonfinite_hidden", "out_buffer", "backward")
                 if getattr(self, name)]
        return caps

    def coverage(self, cases, dtypes=None, backward=False):
        """{claimed capability: names of the claimed cases among `cases` exercising it}; the
        dtype capabilities only for `dtypes` when given (a run limited to some dtypes). A
        backward suite answers for every claim but lse and out_buffer (forward outputs), a
        forward suite for every claim but backward."""
        skip = ("lse", "out_buffer") if backward else ("backward",)
        cov = {cap: [] for cap in self.capabilities() if cap not in skip and (
               dtypes is None or not cap.startswith("dtype:")
               or cap[len("dtype:"):] in dtypes)}
        for case in cases:
            if self.claims(case)[0]:
                for cap in self.exercised_by(case) & set(cov):
                    cov[cap].append(case.name)
        return cov

    def exercised_by(self, case):
        """The claimed capabilities a case (that is claimed) exercises."""
        caps = set(case.features())
        if self.lse and not case.backward:
            caps.add("lse")
        if max(case.D, case.Dv) == self.max_head_dim:
            caps.add(f"head_dim:{self.max_head_dim}")
        return caps & set(self.capabilities())


CHOICES = {"dtypes": KERNEL_DTYPES, "causal": ("top_left", "bottom_right"),
           "scale": ("positive", "zero", "negative"),
           "fully_masked": ("zeros", "nan", "mean"), "array": ("numpy", "torch", "cupy", "jax"),
           "device": ("cpu", "cuda"), "layout": ("bhnd", "bnhd")}
BOOLEAN_CLAIMS = ("mask", "bias", "kv_lengths", "window", "gqa", "dv_differs", "lse",
                  "nonfinite_hidden", "batch_invariant", "hidden_bitwise", "out_buffer",
                  "backward", "equal_lengths")


def check_names(what, value, allowed):
    """A tuple of names from `allowed` (a string alone is refused: it would be read letter by
    letter)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list, set,
                                                                   frozenset)):
        raise TypeError(f"{what} must be a tuple of names from {allowed}, got {value!r}"
                        + (f" (write ({value!r},))" if isinstance(value, str) else ""))
    unknown = [v for v in value if v not in allowed]
    if unknown:
        raise ValueError(f"{what}: {unknown[0]!r} is not one of {allowed}")
    return tuple(value)


def _positive_int(what, value):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")


@dataclass
class Implementation:
    name: str
    fn: object
    supports: Supports = field(default_factory=Supports)
    array: str = "numpy"  # numpy, torch, cupy, jax
    device: str = "cpu"  # cpu, cuda
    layout: str = "bhnd"  # bhnd: (B, H, N, D); bnhd: (B, N, H, D)
    version: str = ""
    timeout_s: float = 120.0
    # Optional: a callable returning a line on costs outside the calls' own time (compiles).
    costs: object = None
    # Optional: grad(q, k, v, dout, **options) -> (dq, dk, dv), in the implementation's array
    # type and layout (verify.backward: torch_grad and jax_grad make one from a forward).
    grad: object = None
    differentiable: bool = True  # fn can be differentiated by its framework (torch, JAX)
    # What arithmetic it claims to run, in words, recorded in the certificate beside the
    # precision verify measures (Report.precision): "float32" for full float32, "float32 as
    # float16 halves", "TF32", ...; "" when not stated
    precision: str = ""
    # Optional: warm(backward, say) prepares what the calls will need before the first one
    # (ours compile their kernel variants on every core); backward: gradients will be asked
    # for too; say(line) reports progress. pytest conformance calls it once a session.
    warm: object = None
    # Optional: prepare() runs before each call, outside the call's time (a spread
    # implementation starts its ranks there: a process importing torch takes seconds)
    prepare: object = None
    # fn follows verify/distributed.py's per-rank protocol (called on every rank with its
    # shards): certified with world_size only
    per_rank: bool = False

    def __post_init__(self):
        self.check()

    def check(self):
        """Raise TypeError or ValueError naming the field that is not what it must be."""
        if not callable(self.fn):
            raise TypeError(f"the implementation {self.name!r} is not callable: got "
                            f"{type(self.fn).__name__}")
        if not isinstance(self.supports, Supports):
            raise TypeError(f"supports must be a verify.Supports, got "
                            f"{type(self.supports).__name__}")
        self.supports.check()
        for name in ("array", "device", "layout"):
            if getattr(self, name) not in CHOICES[name]:
                raise ValueError(f"{name} must be one of {CHOICES[name]}, got "
                                 f"{getattr(self, name)!r}")
        if not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool) \
                or not self.timeout_s > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got "
                             f"{self.timeout_s!r}")
        for name in ("grad", "warm", "costs", "prepare"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"{name} must be callable or None, got "
                                f"{type(getattr(self, name)).__name__}")

    def describe(self):
        d = asdict(self)
        for name in ("fn", "costs", "grad", "warm", "prepare"):
            d.pop(name)
        return d

    def costs_line(self):
        return self.costs() if self.costs else None


BUILTIN_NAMES = ("reference", "numba", "numba-plain", "numba-tuned-backward",
                 "numba-mma-backward", "numba-mma-highest", "numba-mma", "numba-wgmma",
                 "numba-ring",
                 "numba-allgather",
                 "torch-math",
                 "torch-efficient", "torch-flash", "torch-cudnn", "torch-flex",
                 "torch-cp-efficient", "torch-cp-flash", "torch-cp-cudnn", "flash-attn",
                 "jax-xla", "jax-cudnn")


def builtin(name):
    """A built-in adapter by name (BUILTIN_NAMES; the module docstring says what each is)."""
    factories = {"reference": _reference, "numba": _numba, "numba-plain": lambda: _numba(True),
                 "numba-tuned-backward": lambda: _numba(backward_kernel="tuned"),
                 "numba-mma-backward": lambda: _numba(backward_kernel="mma",
                                                      precision="high"),
                 "numba-mma-highest": lambda: _numba(backward_kernel="mma"),
                 "numba-mma": _numba_mma, "numba-wgmma": _numba_wgmma, "numba-ring": lambda: _numba_split("ring"),
                 "numba-allgather": lambda: _numba_split("allgather"),
                 "torch-flex": _torch_flex,
                 "flash-attn": _flash_attn}
    for backend in ("math", "efficient", "flash", "cudnn"):
        factories[f"torch-{backend}"] = lambda b=backend: _torch_sdpa(b)
    for backend in ("efficient", "flash", "cudnn"):
        factories[f"torch-cp-{backend}"] = lambda b=backend: _torch_context_parallel(b)
    for impl in ("xla", "cudnn"):
        factories[f"jax-{impl}"] = lambda i=impl: _jax(i)
    assert sorted(factories) == sorted(BUILTIN_NAMES)
    if name not in factories:
        raise ValueError(f"unknown implementation {name!r}: use one of "
                         f"{', '.join(BUILTIN_NAMES)}, or MODULE:CALLABLE")
    return factories[name]()


def load(spec, **kw):
    """A built-in name, or MODULE:CALLABLE (a function, or an Implementation object)."""
    if ":" not in spec:
        return builtin(spec)
    module, _, attr = spec.partition(":")
    obj = getattr(importlib.import_module(module), attr)
    if isinstance(obj, Implementation):
        return obj
    version = getattr(importlib.import_module(module.split(".")[0]), "__version__", "")
    return Implementation(name=spec, fn=obj, version=version, **kw)


def _version(module):
    try:
        return importlib.import_module(module).__version__
    except (ImportError, AttributeError):
        return ""


def _reference():
    import reference

    def fn(q, k, v, return_lse=False, **options):
        out, lse = reference.attention(q, k, v, return_lse=True, **options)
        out = out.astype(q.dtype)
        return (out, lse.astype(np.float32)) if return_lse else out

    def grad(q, k, v, dout, **options):
        grads = reference.attention_backward(q, k, v, dout, **options)
        return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))

    return Implementation("reference", fn, Supports(backward=True),
                          version="float64, flash-conformance", grad=grad)


def _numba(plain=False, backward_kernel="plain", precision="highest"):
    """Our tuned SIMT kernel (flash_attention(kernel="simt"): the tensor-core kernel that
    kernel="auto" picks for 16-bit inputs is numba-mma), or (plain) the plain one of
    numba_kernels/plain_fwd.py; gradients from the backward kernels `backward_kernel`
    (flash_attention_backward's kernel=). backward_kernel "mma" (float32 alone) takes the
    tensor-core forward too, at `precision`: the backward's scores are then the
    forward's."""
    from numba_kernels import (SIMULATOR, flash_attention, flash_attention_backward,
                               halves_range_why_not, plain_attention)

    def halves(**named):  # "mma" (float32 as halves) where their range holds the values
        return "mma" if halves_range_why_not(named, precision) is None else "simt"

    def attention(q, k, v, **options):
        if plain:
            return plain_attention(q, k, v, **options)
        return flash_attention(q, k, v, kernel=halves(q=q, k=k, v=v)
                               if backward_kernel == "mma" else "simt", precision=precision,
                               **options)

    def fn(q, k, v, **options):
        return attention(q, k, v, **options)

    def grad(q, k, v, dout, **options):  # plain_bwd.py or flash_bwd.py
        out, lse = attention(q, k, v, return_lse=True, **options)
        kernel = backward_kernel
        if kernel == "mma" and halves(q=q, k=k, v=v, dout=dout) != "mma":
            kernel = "tuned"  # what "auto" runs there
        return flash_attention_backward(q, k, v, out, lse, dout, kernel=kernel,
                                        precision=precision, **options)

    def warm(backward=False, say=None):
        forward = "plain" if plain else "mma" if backward_kernel == "mma" else "simt"
        _warm_kernels(forward, backward_kernel if backward else None, say)

    on_gpu = not SIMULATOR
    # On a GPU the number of key splits (split_kv.py) depends on the grid, so one (batch,
    # head) alone may be split where the batch is not: equal within the bound, not bitwise.
    # The plain kernel never splits.
    name = "numba-plain" if plain else "numba" if backward_kernel == "plain" else \
        "numba-mma-highest" if precision == "highest" and backward_kernel == "mma" else \
        f"numba-{backward_kernel}-backward"
    # float32 on the tensor cores (float16 halves): head dims as flash_mma's, no mask or bias
    # (they take them only up to 64); the 16-bit kernels are numba-mma's
    limits = dict(dtypes=("float32",), max_head_dim=128, head_dim_multiple=8, mask=False,
                  bias=False) if backward_kernel == "mma" else {}
    # the simulator emulates each warp instruction of the tensor-core kernels with 32 threads
    slow = dict(timeout_s=900.0) if backward_kernel == "mma" and not on_gpu else {}
    arithmetic = "float32"
    if backward_kernel == "mma":
        arithmetic = ("float32 as float16 halves, one scale per tensor, where their range holds "
                      f"every head (else the SIMT kernels): precision {precision!r}, "
                      + ("each 16-term step's products summed apart, added in float32"
                         if precision == "highest" else "mma.sync's own sums"))
    return Implementation(name, fn,
                          Supports(batch_invariant=plain or not on_gpu, backward=True,
                                   **limits), precision=arithmetic,
                          array="torch" if on_gpu else "numpy",
                          device="cuda" if on_gpu else "cpu",
                          version=f"numba-cuda {_version('numba_cuda')}"
                          + ("" if on_gpu else " (CUDA simulator)"), costs=_numba_costs,
                          grad=grad, differentiable=False, warm=warm, **slow)


def _numba_costs():
    """The line on our kernels' compile time (Implementation.costs)."""
    from numba_kernels import compile_times

    times = compile_times()
    if not times:
        return None
    return (f"numba: {len(times)} kernel variants compiled or loaded from the disk cache "
            f"in {sum(times.values()):.0f} s (once each per process, at its first call)")


def _warm_kernels(forward, backward, say):
    """Our kernels' variants that calls of `forward` and `backward` can launch
    (numba_kernels.warm_variants), compiled into the disk cache on every core
    (Implementation.warm)."""
    from numba_kernels import warm_variants

    warm_variants(forward, backward, say=say)


def _numba_mma():
    """Our tensor-core kernels alone: the forward of numba_kernels/flash_mma.py (blocks
    where a row ends non-finite are done again by its careful variant) and the backward of
    flash_mma_bwd.py (flash_attention_backward(kernel="mma"): tiles holding a NaN or an inf
    take its nonfinite variant); float16 and bfloat16, head dims multiples of 8 up to 128."""
    from numba_kernels import (MMA_DTYPES, MMA_WIDTHS, SIMULATOR, flash_attention_backward,
                               mma_attention)

    def grad(q, k, v, dout, **options):
        out, lse = mma_attention(q, k, v, return_lse=True, **options)
        return flash_attention_backward(q, k, v, out, lse, dout, kernel="mma", **options)

    def warm(backward=False, say=None):
        _warm_kernels("mma", "mma" if backward else None, say)

    on_gpu = not SIMULATOR
    return Implementation("numba-mma", lambda q, k, v, **options: mma_attention(q, k, v,
                                                                               **options),
                          Supports(dtypes=MMA_DTYPES, max_head_dim=MMA_WIDTHS[-1],
                                   head_dim_multiple=8, backward=True),
                          precision="16-bit products exact, float32 sums",
                          array="torch" if on_gpu else "numpy",
                          device="cuda" if on_gpu else "cpu",
                          version=f"numba-cuda {_version('numba_cuda')}"
                          + ("" if on_gpu else " (CUDA simulator)"), costs=_numba_costs,
                          # the simulator emulates each warp instruction with 32 threads
                          timeout_s=120.0 if on_gpu else 900.0, grad=grad,
                          differentiable=False, warm=warm)


def _numba_wgmma():
    """Our kernels on Hopper's warpgroup tensor cores: the forward of
    numba_kernels/flash_wgmma.py (flash_attention(kernel="wgmma"): blocks where a row ends
    non-finite are done again by flash_mma.py's careful variant) and the backward of
    flash_attention_backward(kernel="wgmma") (flash_wgmma_bwd.py; the blocks whose tiles
    hold a NaN or an inf by flash_mma_bwd.py's nonfinite variants); float16 and bfloat16,
    head dims multiples of 8 up to 128, a GPU of compute capability 9.0 or the simulator."""
    from numba_kernels import (MMA_DTYPES, MMA_WIDTHS, SIMULATOR, flash_attention,
                               flash_attention_backward)

    def grad(q, k, v, dout, **options):
        out, lse = flash_attention(q, k, v, return_lse=True, kernel="wgmma", **options)
        return flash_attention_backward(q, k, v, out, lse, dout, kernel="wgmma", **options)

    def warm(backward=False, say=None):
        _warm_kernels("wgmma", "wgmma" if backward else None, say)

    on_gpu = not SIMULATOR
    return Implementation("numba-wgmma", lambda q, k, v, **options: flash_attention(
                              q, k, v, kernel="wgmma", **options),
                          Supports(dtypes=MMA_DTYPES, max_head_dim=MMA_WIDTHS[-1],
                                   head_dim_multiple=8, backward=True),
                          precision="16-bit products exact, float32 sums",
                          array="torch" if on_gpu else "numpy",
                          device="cuda" if on_gpu else "cpu",
                          version=f"numba-cuda {_version('numba_cuda')}"
                          + ("" if on_gpu else " (CUDA simulator)"), costs=_numba_costs,
                          timeout_s=120.0 if on_gpu else 900.0, grad=grad,
                          differentiable=False, warm=warm)


def _numba_split(scheme):
    """Our attention split across ranks (numba_kernels/distributed/): scheme "ring"
    (ring.ring_attention) or "allgather" (allgather.allgather_attention, the seed's), as
    the per-rank protocol of verify/distributed.py takes it: run it with world_size
    (verify.compare, --world-size). Gradients by autograd through it on every rank."""
    from numba_kernels import SIMULATOR

    def fn(q, k, v, *, layout="contiguous", group=None, **options):
        import importlib

        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(f"numba-{scheme} runs on the ranks of a group: certify it "
                               "with world_size (verify.compare(..., world_size=N), "
                               "--world-size)")
        module = importlib.import_module(f"numba_kernels.distributed.{scheme}")
        call = getattr(module, f"{scheme}_attention")
        return call(q, k, v, layout=layout, group=group, **options)

    on_gpu = not SIMULATOR
    return Implementation(f"numba-{scheme}", fn, Supports(mask=False, bias=False),
                          precision="the forward's, parts merged in float32",
                          array="torch", device="cuda" if on_gpu else "cpu",
                          version=f"numba-cuda {_version('numba_cuda')}"
                          + ("" if on_gpu else " (CUDA simulator)"),
                          timeout_s=120.0 if on_gpu else 900.0, per_rank=True)


BOTH = ("top_left", "bottom_right")
TORCH_BACKENDS = {  # backend: (dtypes, max head dim, masks, gqa, Dv != D, causal alignments)
    "math": (KERNEL_DTYPES, 1024, True, True, True, BOTH),
    "efficient": (KERNEL_DTYPES, 256, True, False, True, BOTH),
    # flash takes is_causal only when Nq == Nk ("No available kernel" otherwise), where the
    # two alignments agree: it is claimed as bottom-right (causal_lower_right) alone.
    "flash": (("float16", "bfloat16"), 256, False, True, False, ("bottom_right",)),
    "cudnn": (("float16", "bfloat16"), 128, True, False, False, BOTH),
}


def _torch_sdpa(backend):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    chosen = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    dtypes, max_d, masks, gqa, dv, causal = TORCH_BACKENDS[backend]

    def fn(q, k, v, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
           window=None):
        kw = dict(scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        if mask is None and bias is None and kv_lengths is None and window is None:
            if causal == "top_left":
                kw["is_causal"] = True  # PyTorch's is_causal is top-left aligned
            elif causal == "bottom_right":
                kw["attn_mask"] = causal_lower_right(q.shape[2], k.shape[2])
        else:  # one boolean mask built from the contract's definitions, or a float one
            pb = check_attention_args(q, k, v, causal=causal, window=window, mask=mask,
                                      kv_lengths=kv_lengths)
            keep = dense_visible(pb, mask, kv_lengths, xp=_TorchXP(q.device))
            if bias is not None:  # additive: -inf where hidden (SDPA takes q's dtype)
                keep = torch.where(keep, bias.to(q.dtype), float("-inf"))
            kw["attn_mask"] = keep
        with sdpa_kernel(chosen):
            return F.scaled_dot_product_attention(q, k, v, **kw)

    return Implementation(
        f"torch-{backend}", fn,
        # Masks are added as -inf to the scores, and NaN + -inf = NaN: a NaN in a hidden key
        # reaches every row (pytorch/pytorch#101967), so containment is not claimed.
        # Bitwise batch invariance is not promised: cuBLAS and the fused kernels pick their
        # algorithms by problem size (measured: math on an H200 differs in the last bits).
        Supports(dtypes=dtypes, causal=causal, mask=masks, bias=masks, kv_lengths=masks,
                 window=masks, gqa=gqa, dv_differs=dv, lse=False, max_head_dim=max_d,
                 nonfinite_hidden=False, batch_invariant=False),
        array="torch", device="cuda" if torch.cuda.is_available() else "cpu",
        version=f"torch {torch.__version__}",
        precision=f"torch's float32 matmul precision "
                  f"{torch.get_float32_matmul_precision()!r}")


def _torch_context_parallel(backend):
    """PyTorch's context parallelism (torch.distributed.tensor.experimental.context_parallel)
    over an SDPA backend, in verify/distributed.py's per-rank protocol: each rank takes the
    whole q, k and v from the ranks' shards (sharding.unsharded), context_parallel shards
    them its own way (its load balancing on for causal calls, as by default; off for the
    others, which it refuses with it) and runs its ring of the
    backend's kernel, and the output, unsharded, gives the rank its rows. The gathers move
    values only: the result is context_parallel's. CUDA only: its ring takes the flash,
    efficient and cudnn SDPA operators (on a CPU SDPA's own raises NotImplementedError)."""
    import torch

    chosen = {"efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION",
              "cudnn": "CUDNN_ATTENTION"}[backend]
    dtypes, max_d = TORCH_BACKENDS[backend][:2]

    def fn(q, k, v, *, layout, group, scale=None, causal=False):
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import (  # torch 2.13's home
            context_parallel_unshard)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from numba_kernels.distributed.sharding import shard_ranges, take, unsharded

        mesh = DeviceMesh.from_group(group, q.device.type)
        buffers = [unsharded(x, layout, group).contiguous() for x in (q, k, v)]
        options = _cp_options()  # its load balancing takes causal calls only (it raises
        kept, options.enable_load_balance = options.enable_load_balance, bool(causal)
        try:  # "Load balancing requires is_causal=True" otherwise): off for the others
            with sdpa_kernel(getattr(SDPBackend, chosen)), context_parallel(
                    mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2]):
                out = F.scaled_dot_product_attention(*buffers, is_causal=bool(causal),
                                                     scale=scale)
        finally:
            options.enable_load_balance = kept
        (out,) = context_parallel_unshard(mesh, [out], [2])
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        return take(out, shard_ranges(out.shape[2], world, layout)[rank])

    return Implementation(
        f"torch-cp-{backend}", fn,
        # one sequence (Nq == Nk: both causal alignments are is_causal), sharded into 2 W
        # chunks by its load balancer: lengths multiples of 16 (up to 8 ranks)
        Supports(dtypes=dtypes, causal=BOTH, mask=False, bias=False, kv_lengths=False,
                 window=False, gqa=False, dv_differs=False, lse=False, max_head_dim=max_d,
                 nonfinite_hidden=False, batch_invariant=False, equal_lengths=True,
                 length_multiple=16),
        array="torch", device="cuda" if torch.cuda.is_available() else "cpu",
        version=f"torch {torch.__version__}", differentiable=False, per_rank=True)


def _cp_options():
    """context_parallel's options object (private in torch: its home moved between
    releases); AttributeError names both places where neither has it."""
    import importlib

    for home in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            return importlib.import_module(home)._cp_options
        except (ImportError, AttributeError):
            continue
    raise AttributeError("torch's context_parallel options (_cp_options) are in neither "
                         "place this adapter knows")


def _torch_flex():
    """FlexAttention (torch.nn.attention.flex_attention), compiled by torch.compile on a GPU,
    its eager path elsewhere. The case's visible pairs (band, kv_lengths, mask, a bias's -inf:
    reference.contract.dense_visible) become one boolean tensor that a mask_mod reads and
    create_block_mask turns into a BlockMask, so that blocks no row sees are skipped, as
    FlexAttention's users do; a bias is a score_mod adding it in float32."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    on_gpu = torch.cuda.is_available()
    run = torch.compile(flex_attention) if on_gpu else flex_attention

    def fn(q, k, v, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
           window=None, return_lse=False):
        pb = check_attention_args(q, k, v, scale=scale, causal=causal, window=window,
                                  mask=mask, bias=bias, kv_lengths=kv_lengths)
        kw = dict(scale=pb.scale, enable_gqa=pb.group > 1, return_lse=return_lse)
        if causal or window is not None or mask is not None or bias is not None \
                or kv_lengths is not None:
            keep = dense_visible(pb, mask, kv_lengths, xp=_TorchXP(q.device))
            if bias is not None:
                keep = keep & (bias != float("-inf"))
            keep = keep.expand(pb.batch, keep.shape[1], pb.n_q, pb.n_k).contiguous()
            heads = keep.shape[1]

            def mask_mod(b, h, q_idx, kv_idx):
                return keep[b, h if heads > 1 else 0, q_idx, kv_idx]

            kw["block_mask"] = create_block_mask(mask_mod, pb.batch, heads if heads > 1
                                                 else None, pb.n_q, pb.n_k, device=q.device)
        if bias is not None:
            added = bias.float().expand(pb.batch, pb.heads_q, pb.n_q, pb.n_k)

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + added[b, h, q_idx, kv_idx]

            kw["score_mod"] = score_mod
        return run(q, k, v, **kw)

    return Implementation(
        "torch-flex", fn,
        # Bitwise batch invariance is not promised (the compiled kernels' tiles and
        # algorithms are chosen per problem size). A NaN or an inf in V at a key a row does
        # not see reaches that row (0 * NaN in P V, as in PyTorch's SDPA backends; measured on
        # an H200: docs/findings.md), so hidden non-finite values are not claimed.
        Supports(batch_invariant=False, nonfinite_hidden=False),
        array="torch", device="cuda" if on_gpu else "cpu",
        version=f"torch {torch.__version__}" + ("" if on_gpu else ", eager"),
        timeout_s=300.0,  # a new shape is compiled at its first call
        differentiable=on_gpu,  # FlexAttention has no backward on a CPU (torch 2.13)
        precision=f"torch's float32 matmul precision "
                  f"{torch.get_float32_matmul_precision()!r}")


class _TorchXP:
    """The few array functions dense_visible needs, on torch tensors of one device."""

    def __init__(self, device):
        import torch

        self.torch, self.device, self.int64 = torch, device, torch.int64

    def arange(self, start, stop):
        return self.torch.arange(start, stop, device=self.device)

    def asarray(self, x, dtype=None):
        return self.torch.as_tensor(x, device=self.device, dtype=dtype)

    def stack(self, xs):
        return self.torch.stack(xs)

    def zeros(self, shape, dtype):
        return self.torch.zeros(shape, dtype=self.torch.bool, device=self.device)


def _flash_attn():
    import flash_attn

    def fn(q, k, v, scale=None, causal=False, window=None, return_lse=False):
        # flash-attn's causal is bottom-right aligned; window_size likewise.
        out, lse, _ = flash_attn.flash_attn_func(
            q, k, v, softmax_scale=scale, causal=causal == "bottom_right",
            window_size=window if window is not None else (-1, -1), return_attn_probs=True)
        return (out, lse) if return_lse else out

    return Implementation("flash-attn", fn,
                          Supports(dtypes=("float16", "bfloat16"), causal=("bottom_right",),
                                   mask=False, bias=False, kv_lengths=False, dv_differs=False),
                          array="torch", device="cuda", layout="bnhd",
                          version=f"flash-attn {flash_attn.__version__}")


def _jax(implementation):
    import jax
    import jax.numpy as jnp

    def fn(q, k, v, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
           window=None):
        kw = dict(scale=scale, implementation=implementation, bias=bias)
        if causal == "top_left" and mask is None:
            kw["is_causal"] = True  # jax's causal mask is a lower triangle: top-left
        elif causal or mask is not None or window is not None:
            mask = None if mask is None else np.asarray(mask)
            pb = check_attention_args(*(_bhnd_shape(x) for x in (q, k, v)), causal=causal,
                                      window=window, mask=mask)
            kw["mask"] = jnp.asarray(dense_visible(pb, mask))
        if kv_lengths is not None:
            kw["key_value_seq_lengths"] = kv_lengths
        return jax.nn.dot_product_attention(q, k, v, **kw)

    # The XLA path masks with a large finite negative score: a row that sees no key averages
    # V, and NaN in a hidden key still reaches the softmax (as in PyTorch).
    return Implementation(f"jax-{implementation}", fn,
                          Supports(lse=False, dv_differs=False, nonfinite_hidden=False,
                                   batch_invariant=False,
                                   head_dim_multiple=1 if implementation == "xla" else 8,
                                   fully_masked="mean" if implementation == "xla" else "zeros",
                                   dtypes=KERNEL_DTYPES if implementation == "xla"
                                   else ("float16", "bfloat16")),
                          array="jax", device="cuda" if jax.default_backend() == "gpu" else "cpu",
                          layout="bnhd", version=f"jax {jax.__version__}",
                          precision="jax's default matmul precision "
                                    f"{jax.config.jax_default_matmul_precision or 'default'!r}")


def _bhnd_shape(x):
    """A zero-stride float32 stand-in with x's (B, N, H, D) shape as (B, H, N, D): enough for
    check_attention_args, which reads shapes and dtypes only."""
    b, n, h, d = x.shape
    return np.broadcast_to(np.float32(0), (b, h, n, d))
