"""Which kernel a call runs, and why: the forward's ("simt" or "mma") and the backward's
("plain", "tuned" or "mma"), at which precision float32 runs (and so which variants of the
tensor-core kernels: halves_summed), and where the tensor cores' float16 halves cannot hold
the values. One choice for both passes, so that the backward's
scores are the forward's."""
import math
from typing import NamedTuple

import numpy as np

from reference.contract import BLOCK_SIZE, check_attention_args, check_block_mask
from .mma_parts import (BLOCK_M as MMA_BLOCK_M, BLOCK_N as MMA_BLOCK_N, HALVES_MASK_WIDTH,
                        MMA_DTYPES, MMA_INPUT_DTYPES, MMA_WIDTHS, full_tiles_apply,
                        halves_ship)
from .flash_wgmma import KEYS as WGMMA_KEYS
from .prepass import table_fits
from .specs import DTYPES, choose_spec

KERNELS = ("simt", "mma", "wgmma", "auto")  # the forward's kernel=
BACKWARD_KERNELS = ("plain", "tuned", "mma", "wgmma", "auto")  # the backward's kernel=
# the backward kernel that follows each forward kernel: "tuned" rounds its scores as the SIMT
# forward does, "mma" and "wgmma" recompute their forward's (tests/test_wgmma_backward.py)
BACKWARD_KERNEL = {"simt": "tuned", "mma": "mma", "wgmma": "wgmma"}
PRECISIONS = ("highest", "high")  # PyTorch's float32 matmul precisions ("medium" as "high")
FLOAT32_MIN_ROWS = 64  # "auto": float32 with fewer query rows (decoding) stays on SIMT


class Plan(NamedTuple):
    """What a call runs: the forward kernel ("simt" or "mma"), why, and the precision of its
    float32 arithmetic ("highest": float32's accuracy; "high": the float16 halves' with
    mma.sync's own sums)."""
    kernel: str
    why: str
    precision: str


def resolve_precision(precision, q):
    """The precision a call runs float32 at (PRECISIONS): precision as given, or for None,
    PyTorch's float32 matmul precision where q is a torch tensor, else "highest". Raises
    ValueError for a name not in PRECISIONS."""
    if precision is None:
        if not type(q).__module__.startswith("torch"):
            return "highest"
        from .torch_precision import float32_matmul_precision

        return "highest" if float32_matmul_precision() == "highest" else "high"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, or None (PyTorch's float32 "
                         f"matmul precision for torch tensors, else 'highest'), got "
                         f"{precision!r}")
    return precision


def halves_summed(dtype, precision):
    """Whether the tensor-core kernels run their summed variants (MmaSpec.summed: each
    step's products summed apart, float32 at precision "highest")."""
    return dtype == "float32" and precision == "highest"


def float32_why_not(pb, has_mask):
    """Why "auto" leaves float32 problem pb to the SIMT kernels, forward and backward alike,
    or None: the tensor cores take float32 as float16 halves (halves.py) where verify's
    numba-mma-highest and numba-mma-backward certify the pair, without a mask or bias, and
    where a query tile is full: with one query row the halves' pre-pass, which reads k and v
    once more, made decoding twice as slow on the H200."""
    if has_mask:
        return ("float32 with a mask or bias takes the tensor cores only when asked, "
                "kernel='mma' (verify's numba-mma-highest and numba-mma-backward do not "
                "certify it)")
    if pb.n_q < FLOAT32_MIN_ROWS:
        return (f"float32 with fewer than {FLOAT32_MIN_ROWS} query rows (decoding) takes "
                "the tensor cores only when asked, kernel='mma' (their pre-pass reads k and "
                "v once more)")
    return None


def kernel_plan(q, k, v, *, scale=None, causal=False, mask=None, bias=None, kv_lengths=None,
                window=None, num_splits=None, spec=None, kernel="auto", precision=None,
                block_mask=None, block_size=BLOCK_SIZE):
    """Plan(kernel, why, precision): which forward kernel flash_attention runs for these
    arguments, "simt" (flash_fwd.py) or "mma" (flash_mma.py), why, and the precision of its
    float32 arithmetic. kernel="auto" takes the tensor-core kernel where it applies
    (mma_plan: head dims multiples of 8 up to 128; no spec of the SIMT kernel
    given) for float16 and bfloat16, and for float32 at either precision (float32_why_not:
    not with a mask or bias, nor for decoding; halves_range_why_not: not where a row's
    values lie too far below the tensor's largest), and says why not where it falls back;
    "mma" raises ValueError with that reason instead. num_splits is taken as flash_attention
    takes it; both kernels split the keys, so it does not decide. With a block mask, why
    also says how the kernel reads it (block_note)."""
    check_kernel(kernel)
    pb = check_attention_args(q, k, v, scale=scale, causal=causal, mask=mask, bias=bias,
                              kv_lengths=kv_lengths, window=window, dtypes=DTYPES)
    sizes = None if block_mask is None else check_block_mask(block_mask, block_size, pb)
    masked = mask is not None or bias is not None or sizes is not None
    plan = call_plan(pb, kernel, spec, masked, resolve_precision(precision, q),
                     dict(q=q, k=k, v=v))
    if sizes is None:
        return plan
    simt = spec or choose_spec(pb.d, pb.dv, pb.dtype, True)
    tile = {"mma": (MMA_BLOCK_M, MMA_BLOCK_N), "wgmma": (MMA_BLOCK_M, WGMMA_KEYS)}.get(
        plan.kernel, (simt.block_m, simt.block_n))
    note = block_note(sizes, tile, block_mask, mask)
    if plan.kernel in ("mma", "wgmma") and full_tiles_apply(
            pb.dtype, table_read(sizes, tile, block_mask, mask), mask is not None,
            bias is not None):
        note += ("; every listed tile FULL: the variants (forward and backward) that read no "
                 "mask or bias")
    return plan._replace(why=f"{plan.why}; {note}")


def table_read(sizes, tile, block_mask, mask):
    """Whether a kernel with tiles of `tile` (rows, keys) reads a block mask of blocks
    `sizes` from its table (prepass.table_fits), not written out as a boolean mask."""
    def steps(x):
        return [int(n > 1) for n in (1,) * (4 - len(x.shape)) + tuple(x.shape)]

    return table_fits(sizes, [tile], steps(block_mask), None if mask is None else steps(mask))


def block_note(sizes, tile, block_mask, mask):
    """How a kernel with tiles of `tile` (rows, keys) reads a block mask of blocks `sizes`:
    from its table (table_read), or written out as the boolean mask it stands for."""
    what = f"block mask of {sizes[0]} x {sizes[1]}"
    if table_read(sizes, tile, block_mask, mask):
        return f"{what}: tiles of {tile[0]} x {tile[1]} classed from its table, no mask read"
    return (f"{what}: written out as the boolean mask it stands for (its blocks must hold "
            f"the kernel's tiles of {tile[0]} x {tile[1]} whole, multiples of 64 do, and a "
            f"mask given with it have each of its batch and head dimensions)")


def check_kernel(kernel, kernels=KERNELS):
    """kernel is one of `kernels`, or a ValueError naming them."""
    if kernel not in kernels:
        raise ValueError(f"kernel must be one of {kernels}, got {kernel!r}")


def backward_plan(pb, kernel, has_mask, precision, named):
    """The backward kernel flash_attention_backward runs ("plain", "tuned", "mma" or
    "wgmma") for kernel= of BACKWARD_KERNELS: "auto" and "mma" make the forward's choice
    (call_plan over the tensors `named`, dout among them) and follow it (BACKWARD_KERNEL), so
    that the two passes agree; "mma" and "wgmma" raise ValueError where they do not apply
    ("wgmma": where the wgmma forward does not, wgmma_why_not)."""
    check_kernel(kernel, BACKWARD_KERNELS)
    if kernel == "wgmma":
        why_not = wgmma_why_not(pb)
        if why_not:
            raise ValueError(f"kernel='wgmma': {why_not}")
        return kernel
    if kernel not in ("auto", "mma"):
        return kernel
    return BACKWARD_KERNEL[call_plan(pb, kernel, None, has_mask, precision, named).kernel]


def shape_plan(pb, kernel, spec, has_mask, precision):
    """kernel_plan for a checked problem pb from its shapes and options alone (has_mask: a
    mask or bias is given; precision: resolve_precision's)."""
    if kernel == "simt":
        return Plan("simt", "asked for", "highest")
    if kernel == "wgmma":
        why_not = wgmma_why_not(pb, spec)
        if why_not:
            raise ValueError(f"kernel='wgmma': {why_not}")
        return Plan("wgmma", "asked for (its fast variant; blocks with a row that ends "
                    "non-finite are done again by the mma kernel's careful one)", "highest")
    why_not = mma_plan(pb, has_mask)
    if why_not is None and spec is not None:
        why_not = "a spec (a variant of the SIMT kernel) was given"
    if why_not is None and kernel == "auto" and pb.dtype == "float32":
        why_not = float32_why_not(pb, has_mask)
    if why_not is None:
        if pb.dtype != "float32":
            return Plan("mma", "asked for" if kernel == "mma" else
                        "16-bit inputs it takes" + hopper_note(pb), "highest")
        return Plan("mma", "asked for" if kernel == "mma" else
                    f"float32 inputs it takes, as float16 halves ({HALVES_WAY[precision]})",
                    precision)
    if kernel == "mma":
        raise ValueError(f"kernel='mma': {why_not}")
    return Plan("simt", f"the tensor-core kernel does not apply: {why_not}", "highest")


# binades below a tensor's largest value a row's largest may lie on float16 halves, by
# precision: where hi + lo keep 22 bits ("high"), and where the error stays a float32
# kernel's ("highest": docs/design/halves.md)
HALVES_RANGE = {"high": 16, "highest": 12}
HALVES_SPAN = 48  # the tensors' largest values within 2^-48 .. 2^48: the scales' products fit
HALVES_WAY = {"high": "precision 'high': mma.sync's own sums",
              "highest": "precision 'highest': each step's products summed apart"}


def halves_range_why_not(named, precision):
    """None, or why float16 halves with one scale per tensor (halves.py) would not hold the
    float32 tensors `named` ({name: (B, H, N, W) array of any kind}) at `precision`: a row
    (of a query, a key or a value; a head of dout, whose rows scale their own gradients
    alone) whose largest finite |x| lies more than 2^HALVES_RANGE[precision] below the
    tensor's largest (zeros are exact): after the tensor's scale its values fall toward
    float16's subnormals (hi + lo keep fewer bits), and 2^30 below nothing of them is left,
    which a head or a key whose values are small beside the others' cannot afford; or a
    tensor whose largest |x| lies outside 2^-HALVES_SPAN .. 2^HALVES_SPAN, whose scales'
    products would leave float32's range. Two passes over each tensor (on the device for
    torch and CuPy, two numbers a tensor copied back, in one copy: row_extremes)."""
    top_range = HALVES_RANGE[precision]
    tops = [row_maxima(x) for x in named.values()]
    if "dout" in named:  # a head's largest, (B, H, 1)
        at = list(named).index("dout")
        tops[at] = tops[at].amax(dim=2, keepdim=True) if hasattr(tops[at], "detach") else \
            tops[at].max(axis=2, keepdims=True)
    for name, top, (largest, lowest) in zip(named, tops, row_extremes(tops)):
        if largest and not 2.0**-HALVES_SPAN <= largest <= 2.0**HALVES_SPAN:
            return (f"float32 at precision {precision!r}: the largest value of {name} is "
                    f"2^{np.log2(largest):.0f}, outside the 2^-{HALVES_SPAN} .. "
                    f"2^{HALVES_SPAN} that float16 halves with one scale per tensor hold")
        if lowest < largest * 2.0**-top_range:
            first, low_top = first_below(top, largest * 2.0**-top_range)
            b, h, r = np.unravel_index(first, tuple(top.shape))
            where = f"(batch {b}, head {h})" if name == "dout" else \
                f"row {r} of (batch {b}, head {h})"
            return (f"float32 at precision {precision!r}: {where} of {name} holds values "
                    f"2^{np.log2(largest / low_top):.0f} below the tensor's largest, past "
                    f"the 2^{top_range} that float16 halves with one scale per tensor hold "
                    f"at that precision (halves.py)")
    return None


def row_maxima(x):
    """(B, H, N): the largest finite |x| of each row of x (B, H, N, W), float32, on the
    device in x's own library for torch and CuPy, else NumPy."""
    if hasattr(x, "detach"):  # torch
        import torch

        x = x.detach()
        if x.numel() == 0:
            return torch.zeros(tuple(x.shape[:3]), device=x.device)
        # two passes over x (nan_to_num, then a max-norm), not isfinite, where, abs, amax
        finite = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        return torch.linalg.vector_norm(finite, ord=float("inf"), dim=3).float()
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        if x.size == 0:
            return cupy.zeros(tuple(x.shape[:3]), np.float32)
        finite = cupy.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        return cupy.abs(finite).max(axis=3).astype(np.float32)
    x = x.copy_to_host() if hasattr(x, "copy_to_host") else np.asarray(x)
    if x.size == 0:
        return np.zeros(tuple(x.shape[:3]), np.float32)
    return np.where(np.isfinite(x), np.abs(x), 0).max(axis=3).astype(np.float32)


def row_extremes(tops):
    """[(largest, smallest above 0)] of each of the row maxima `tops` (row_maxima's, all of
    one library), as floats ((0.0, inf) where none is above 0). One small copy to the host
    for them all, after four reductions a tensor: each copy waits for the device, and on a
    GPU each small operation costs the host more than the device."""
    if not tops:
        return []
    if hasattr(tops[0], "detach"):  # torch
        import torch

        xp, empty = torch, lambda t: t.new_zeros(1)
    else:
        xp = np if isinstance(tops[0], np.ndarray) else __import__("cupy")
        empty = lambda t: xp.zeros(1, t.dtype)  # noqa: E731
    values = []
    for top in tops:
        top = top.reshape(-1) if math.prod(top.shape) else empty(top)
        values += [top.max(), xp.where(top > 0, top, np.inf).min()]
    found = xp.stack(values).tolist()
    return [(found[i], found[i + 1]) for i in range(0, len(found), 2)]


def first_below(top, bound):
    """(flat index, value) of the first of the row maxima `top` above 0 and below `bound`, or
    None (a copy to the host: for the message where the range check refuses)."""
    flat = top.reshape(-1)
    low = (flat > 0) & (flat < bound)
    if not bool(low.any()):
        return None
    first = int(low.nonzero()[0][0])  # torch's (n, 1) and NumPy's tuple alike
    return first, float(flat[first])


def call_plan(pb, kernel, spec, has_mask, precision, named):
    """shape_plan, and where it takes the tensor cores for float32, the range of the values
    (halves_range_why_not over the tensors `named`): past it "auto" takes the SIMT kernel
    (full float32), and "mma" raises ValueError saying why."""
    plan = shape_plan(pb, kernel, spec, has_mask, precision)
    if plan.kernel != "mma" or pb.dtype != "float32":
        return plan
    why_not = halves_range_why_not(named, precision)
    if why_not is None:
        return plan
    if kernel == "mma":
        raise ValueError(f"kernel='mma': {why_not}")
    return Plan("simt", f"the tensor-core kernel does not apply: {why_not}", "highest")


def wgmma_why_not(pb, spec=None):
    """Why the wgmma forward (flash_wgmma.py) does not apply to problem pb, or None: float16
    and bfloat16 inputs, head dims as mma_plan's, no spec of the SIMT kernel, and a GPU of
    compute capability 9.0 (Hopper; the simulator runs it anywhere)."""
    if pb.dtype not in MMA_DTYPES:
        return f"dtype {pb.dtype}: it takes {', '.join(MMA_DTYPES)}"
    why_not = mma_plan(pb)
    if why_not is None and spec is not None:
        why_not = "a spec (a variant of the SIMT kernel) was given"
    return why_not or hopper_why_not()


def hopper_note(pb):
    """For "auto" on a Hopper GPU where the wgmma forward applies: why it keeps mma.sync."""
    from .convert import SIMULATOR

    if SIMULATOR or wgmma_why_not(pb) is not None:
        return ""
    return ("; on this GPU kernel='wgmma' (Hopper's warpgroup tensor cores, forward and "
            "backward) is faster: 'auto' keeps mma.sync until verify's suites have certified "
            "the wgmma pair on a GPU")


def hopper_why_not():
    """Why this process's GPU cannot run wgmma (sm_90a alone has it), or None; the
    simulator runs it."""
    from .convert import SIMULATOR

    if SIMULATOR:
        return None
    from numba import cuda

    if not cuda.is_available():
        return "no CUDA GPU (wgmma needs compute capability 9.0, Hopper)"
    cc = cuda.get_current_device().compute_capability
    if tuple(cc) != (9, 0):
        return f"wgmma needs compute capability 9.0 (Hopper); this GPU's is {cc[0]}.{cc[1]}"
    return None


def mma_plan(pb, has_mask=False):
    """Why the tensor-core kernels do not apply to problem pb (reference.contract's), or
    None: inputs of MMA_INPUT_DTYPES (float32 as float16 halves), head dims multiples of 8
    (whole 16-byte copies) up to the widest, float32 with a mask or bias (has_mask) up to
    HALVES_MASK_WIDTH (halves_ship). The forward and the backward ask the same."""
    if pb.dtype not in MMA_INPUT_DTYPES:
        return f"dtype {pb.dtype}: it takes {', '.join(MMA_INPUT_DTYPES)}"
    if pb.d % 8 or pb.dv % 8 or max(pb.d, pb.dv) > MMA_WIDTHS[-1]:
        return (f"head dims D={pb.d}, Dv={pb.dv}: it takes multiples of 8 up to "
                f"{MMA_WIDTHS[-1]}")
    if not halves_ship(pb.dtype, has_mask, pb.d, pb.dv):
        return (f"float32 with a mask or bias at head dims D={pb.d}, Dv={pb.dv}: it takes "
                f"them up to {HALVES_MASK_WIDTH} (above, the halves' kernels spill registers)")
    return None
