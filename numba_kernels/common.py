"""What every kernel shares: constants, fast-math flags, shared-memory limits, the argument
table and its checks, and the contract's visibility of a (row, key) pair as a device function.

Below every kernel module (plain_fwd, flash_fwd, flash_bwd, plain_bwd, flash_mma,
flash_mma_bwd, halves, split_kv); imports nothing of them.
"""
import inspect
import math

from .convert import device_function, float32

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): exp2 is one ex2.approx instruction
LN2 = 0.6931471805599453
# Fused multiply-add, approximate exp2/log2 and reciprocal. Not nnan/ninf: -inf marks masked
# scores and NaN must propagate, so the compiler may not assume them away.
FASTMATH = {"contract", "afn", "arcp"}
STATIC_SHARED_LIMIT = 48 * 1024  # bytes; above it numba-cuda needs dynamic shared memory
DYNAMIC_SHARED_LIMIT = 227 * 1024  # bytes a block may opt in to on sm_80 / sm_90 (launch.py)

# The kernel's parts: inlined device functions with the kernel's fastmath flags.
kernel_part = device_function(fastmath=FASTMATH)


NEG_INF, ZERO = float32(-math.inf), float32(0.0)
F_LN2, F_LOG2E = float32(LN2), float32(LOG2E)
# P of a (row, key) pair that takes no part (hidden, or a score of -inf): -0.0. Every P that
# takes part is +0.0 or more (or NaN), so the slow products (a V tile, or in the backward a
# Q or dO tile, holding a NaN or an inf) tell them apart by the sign: 0 * NaN would be NaN.
# The fast products add -0.0 * x = -0.0 where x is finite. FASTMATH keeps signed zeros.
NO_PART = float32(-0.0)


@kernel_part
def takes_part(p):
    """Whether a pair with probability p takes part (p is not NO_PART)."""
    return not (p == ZERO and math.copysign(float32(1.0), p) < ZERO)


def make_masked_score(sizes):
    HAS_MASK = sizes["HAS_MASK"]

    @kernel_part
    def masked_score(x, mask, bias, mask_steps, bias_steps, b, h, row, col, lo, hi,
                     interior, n_q, read_mask, read_bias):
        """x (a scaled score, log2 units) plus the bias if query row `row` sees key `col`,
        else -inf (the contract: key_range, the mask, bias != -inf). Selected, not added: a
        NaN score of a hidden key must vanish. interior: the tile is inside every row's
        band, so lo and hi need no test; read_mask False: the mask shows every pair of the
        tile (block_sparse.py's FULL), so it is not read; read_bias False: the bias is the
        zeros that stand for none (bias_given), so it is not read."""
        if not (row < n_q and (interior or (col >= lo and col < hi))):
            return NEG_INF
        if HAS_MASK:
            ms, bs = mask_steps, bias_steps  # 0 along broadcast dimensions
            if read_mask and mask[b * ms[0], h * ms[1], row * ms[2], col * ms[3]] == 0:
                return NEG_INF
            if read_bias:
                add = bias[b * bs[0], h * bs[1], row * bs[2], col * bs[3]]
                if add == NEG_INF:
                    return NEG_INF
                x += add * F_LOG2E
        return x

    return masked_score


@kernel_part
def bias_given(bias, bias_steps):
    """Whether the bias can change a score: False for a single 0.0 broadcast everywhere (the
    constant a call without a bias passes), whose sum leaves every score as it is."""
    return not (bias_steps[0] == 0 and bias_steps[1] == 0 and bias_steps[2] == 0
                and bias_steps[3] == 0 and bias[0, 0, 0, 0] == ZERO)


# The kernel's arguments, in order: the one description from which its parameter list
# (checked when it is built), its Numba types (specs.signature) and every launch's argument
# tuple (kernel_args) come. kind names a Numba type in specs.ARG_TYPES.
ARGS = (
    ("q", "input", "(B, Hq, Nq, D) queries"),
    ("k", "input", "(B, Hk, Nk, D) keys"),
    ("v", "input", "(B, Hk, Nk, DV) values"),
    ("mask", "mask", "uint8, 0 hides a key; broadcast by zero strides (all ones if none)"),
    ("visible", "visible", "int32 (B or 1, Hq or 1, query tiles, 2 + key tiles): each query "
     "tile's count of key tiles the mask does not skip, then those tiles, 2 j + 1 where "
     "partly visible, 2 j where fully, then 2 * key tiles (block_sparse.py); read with a "
     "mask"),
    ("bias", "bias", "float32, added to the scores (natural log); broadcast likewise"),
    ("kv_lengths", "lengths", "(B,) int32: the keys each batch element has"),
    ("out", "output", "(B, Hq, Nq, DV); with split-KV (splits * B, ...) float32 partials"),
    ("lse", "lse", "(B, Hq, Nq) float32, natural log; with split-KV (splits * B, ...)"),
    ("n_q", "int", "query rows"),
    ("d", "int", "head dim of q and k before padding to D"),
    ("d_v", "int", "head dim of v before padding to DV"),
    ("group", "int", "query heads per key head (grouped-query attention)"),
    ("heads_q", "int", "query heads"),
    ("n_tiles", "int", "query tiles of BLOCK_M rows per (batch, head)"),
    ("n_splits", "int", "split-KV: the shares each block's band of keys is cut into "
     "(schedule.key_tiles); 1 without"),
    ("split_keys", "int", "split-KV: a share is whole multiples of this many keys, a multiple "
     "of the key tile of every kernel the call launches"),
    ("qk_scale", "float", "the contract's scale times log2(e): scores in log2 units"),
    ("left", "int", "key_range's window to the left (-1: none)"),
    ("right", "int", "key_range's window to the right (-1: none)"),
    ("bottom_right", "int", "1: the causal band and window align to the last key"),
    ("mask_steps", "steps", "index multipliers of mask over (batch, head, row, key): 0 where it "
     "broadcasts, else 1"),
    ("bias_steps", "steps", "the same for bias"),
)
ARG_NAMES = tuple(name for name, _, _ in ARGS)


# The backward kernels' arguments: the forward's where the name is shared, and these.
_BACKWARD_OWN = {  # beyond the forward's ARGS: (kind, meaning)
    "out": ("input", "(B, Hq, Nq, Dv) the forward's output"),
    "dout": ("input", "(B, Hq, Nq, Dv) the gradient of the output"),
    "lse_in": ("lse", "(B, Hq, Nq) float32 the forward's lse (natural log)"),
    "delta": ("lse", "(B, Hq, Nq) float32 rowsum(dout * out)"),
    "dq": ("output", "(B, Hq, Nq, D) the gradient of q"),
    "dk": ("output", "(B, Hk, Nk, D) the gradient of k, summed over the group's heads"),
    "dv": ("output", "(B, Hk, Nk, Dv) the gradient of v, likewise"),
    "scale": ("float", "the contract's scale (dS carries it into dq and dk)"),
}
_FORWARD = {name: (kind, meaning) for name, kind, meaning in ARGS}


def _args(*names):
    """Argument descriptions (name, kind, meaning), the forward's where the name is shared."""
    return tuple((n,) + (_BACKWARD_OWN[n] if n in _BACKWARD_OWN else _FORWARD[n])
                 for n in names)


DELTA_ARGS = _args("out", "dout", "delta", "n_q")
_SIDES = ("mask", "bias", "kv_lengths", "dout", "lse_in", "delta")
_BAND = ("n_q", "group", "qk_scale", "scale", "left", "right", "bottom_right", "mask_steps",
         "bias_steps")
DKDV_ARGS = _args("q", "k", "v", *_SIDES, "dk", "dv", *_BAND)
DQ_ARGS = _args("q", "k", "v", *_SIDES, "dq", *_BAND)

def with_visible(args, meaning):
    """args with the visible lists a kernel walks (block_sparse.py) after "mask"."""
    return tuple(x for a in args
                 for x in ((a, ("visible", "visible", meaning)) if a[0] == "mask" else (a,)))


def kernel_args(names=ARG_NAMES, **values):
    """A launch's arguments in the order of `names` (a kernel's ARG_NAMES), from keywords;
    a missing or unknown name is an error, never a shifted argument."""
    if set(values) != set(names):
        raise TypeError(f"kernel arguments: missing {sorted(set(names) - set(values))}, "
                        f"unknown {sorted(set(values) - set(names))}")
    return tuple(values[name] for name in names)


def check_parameters(fn, names):
    """The kernel function `fn` takes exactly `names`, in order."""
    got = tuple(inspect.signature(fn).parameters)
    if got != names:
        raise TypeError(f"{fn.__name__} takes {got}; its ARGS say {names}")
    return fn
