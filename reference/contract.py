"""The attention contract, written once.

Every implementation in this project (the float64 reference, the tiled reference, the
low-precision emulation, the Numba kernel) and every checker (verify, conformance) takes its
definitions from this module: argument checking, the visible key range of a query row, and
dtype names. docs/contract.md explains the same rules with pictures.

    attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
              kv_lengths=None, window=None, return_lse=False)

    q (B, Hq, Nq, D)   k (B, Hk, Nk, D)   v (B, Hk, Nk, Dv)   ->   out (B, Hq, Nq, Dv), lse (B, Hq, Nq)

Query head h reads key head h // (Hq // Hk). A key j is *visible* to query row i of batch b when

    lo(i) <= j < hi(i)        (key_range: causal, window and kv_lengths; a contiguous interval)
    and mask[b, h, i, j]      (boolean, True = attend)
    and bias[b, h, i, j] != -inf

Everything else about a row follows from its visible keys alone: a row with none gives out = 0
and lse = -inf; an invisible key's values (NaN included) change nothing.
"""
import math
import numbers
from dataclasses import dataclass

from ._xp import to_int_list
from .bands import key_range
from .dtypes import FLOAT_DTYPES, dtype_name

BLOCK_SIZE = 128  # a block mask's default block (FlexAttention's default too)

CAUSAL_CHOICES = (False, "top_left", "bottom_right")

_CAUSAL_TRUE_MESSAGE = (
    "causal=True is ambiguous when Nq != Nk; pass causal='top_left' (PyTorch's is_causal: "
    "query i sees keys j <= i) or causal='bottom_right' (flash-attn >= 2.1: query i sees keys "
    "j <= i + Nk - Nq, so the last query sees every key). For Nq == Nk both are the same."
)

@dataclass(frozen=True)
class Problem:
    """The checked, normalised description of one attention call."""

    batch: int
    heads_q: int
    heads_k: int
    n_q: int
    n_k: int
    d: int
    dv: int
    dtype: str
    scale: float
    left: int  # window: keys at most `left` before the diagonal; -1 = unbounded
    right: int  # keys at most `right` after the diagonal; -1 = unbounded; causal makes it 0
    bottom_right: bool  # diagonal alignment of causal and window (see key_range)

    @property
    def group(self):
        """Query heads per key head (1: multi-head, Hq: multi-query)."""
        return self.heads_q // self.heads_k


def shape4(name, x, expected):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array with shape {expected}, got {type(x).__name__}")
    if len(x.shape) != 4:
        raise ValueError(f"{name} must have 4 dimensions {expected}, got shape {tuple(x.shape)}")
    return tuple(int(s) for s in x.shape)


def check_broadcast(name, x, full, dims="(B, Hq, Nq, Nk)"):
    """A ValueError where x's shape does not broadcast to `full` (named `dims`): at most 4
    dimensions, each of full's size or 1."""
    shape = tuple(int(s) for s in x.shape)
    ok = len(shape) <= 4 and all(s in (1, f) for s, f in zip(shape[::-1], full[::-1]))
    if not ok:
        raise ValueError(f"{name} of shape {shape} does not broadcast to {dims} = {full}")


def _normalise_scale(scale, D):
    """scale=None means 1/sqrt(D). Any finite real is allowed: 0 weighs every visible key
    equally, a negative scale favours the least similar keys."""
    if scale is None:
        return 1.0 / D ** 0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) \
            or type(scale).__name__ == "bool_":
        raise TypeError(f"scale must be a real number (Python or NumPy) or None, got "
                        f"{type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return float(scale)


def _normalise_causal(causal):
    """False (or None), "top_left" or "bottom_right", taken as given: 0, 0.0 or 1 are not
    read as booleans."""
    if causal is True:
        raise ValueError(_CAUSAL_TRUE_MESSAGE)
    if causal is None or causal is False:
        return False
    if not isinstance(causal, str) or causal not in CAUSAL_CHOICES:
        raise ValueError(f"causal must be one of {CAUSAL_CHOICES}, got {causal!r}")
    return causal


def _normalise_window(window):
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2 \
            or not all(is_integer(w) for w in window):
        raise TypeError(f"window must be a pair (left, right) of integers, got {window!r}")
    left, right = (int(w) for w in window)
    for side, w in (("left", left), ("right", right)):
        if w < -1:
            raise ValueError(f"window {side} must be >= 0, or -1 for unbounded; got {w}")
    return left, right


def is_integer(x):
    """Whether x is an integer (Python or NumPy), not a bool and not a float of integral
    value."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) \
        and type(x).__name__ != "bool_"


def check_flag(name, value):
    """value as a bool, where it is one (Python or NumPy): a string or a number is refused,
    never read as true."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")


def array_dtype(x):
    """dtype_name of x, with NumPy's non-native byte order set aside: a big-endian float32
    array is float32 (implementations convert it as they read it)."""
    dtype = getattr(x, "dtype", None)
    if getattr(dtype, "byteorder", "=") in "<>" and hasattr(dtype, "newbyteorder"):
        dtype = dtype.newbyteorder("=")
        return str(dtype)
    return dtype_name(x)


def check_attention_args(q, k, v, *, scale=None, causal=False, mask=None, bias=None,
                         kv_lengths=None, window=None, dtypes=FLOAT_DTYPES):
    """Validate one call against the contract and return its Problem.

    Raises TypeError or ValueError naming the argument and what was expected.
    """
    B, Hq, Nq, D = shape4("q", q, "(B, Hq, Nq, D)")
    Bk, Hk, Nk, Dk = shape4("k", k, "(B, Hk, Nk, D)")
    Bv, Hv, Nv, Dv = shape4("v", v, "(B, Hk, Nk, Dv)")
    if Bk != B or Bv != B:
        raise ValueError(f"batch sizes differ: q has B={B}, k has {Bk}, v has {Bv}")
    if Dk != D:
        raise ValueError(f"k must have head dim D={D} like q, got k.shape={(Bk, Hk, Nk, Dk)}")
    if (Hv, Nv) != (Hk, Nk):
        raise ValueError(f"v must have (Hk, Nk)={(Hk, Nk)} like k, got v.shape={(Bv, Hv, Nv, Dv)}")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"query heads Hq={Hq} must be a multiple of key heads Hk={Hk}")
    if D == 0 or Dv == 0:
        raise ValueError(f"head dims must be >= 1, got D={D}, Dv={Dv}")
    names = {n: array_dtype(x) for n, x in (("q", q), ("k", k), ("v", v))}
    for n, dt in names.items():
        if dt not in dtypes:
            raise TypeError(f"{n} must have a dtype in {dtypes}, got {dt}")
    if len(set(names.values())) != 1:
        raise TypeError(f"q, k and v must share one dtype, got {names}")

    scale = _normalise_scale(scale, D)
    causal = _normalise_causal(causal)
    left, right = _normalise_window(window)
    if causal:
        right = 0  # causal is the window (-1, 0) intersected with any other window
    full = (B, Hq, Nq, Nk)
    for name, x, kind in (("mask", mask, "a boolean"), ("bias", bias, "a float"),
                          ("kv_lengths", kv_lengths, "an integer")):
        if x is not None and not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be {kind} array (NumPy, CuPy or torch), got "
                            f"{type(x).__name__}")
    if mask is not None:
        if array_dtype(mask) != "bool":
            raise TypeError(f"mask must be boolean (True = attend), got dtype "
                            f"{array_dtype(mask)}")
        check_broadcast("mask", mask, full)
    if bias is not None:
        if array_dtype(bias) not in FLOAT_DTYPES:
            raise TypeError(f"bias must be a float array, got dtype {array_dtype(bias)}")
        check_broadcast("bias", bias, full)
    if kv_lengths is not None:
        _check_kv_lengths(kv_lengths, B, Nk)
    return Problem(B, Hq, Hk, Nq, Nk, D, Dv, names["q"], float(scale), left, right,
                   causal == "bottom_right" or (not causal and window is not None))


def block_pair(block_size):
    """block_size as the pair (block_m, block_n): an integer is a square block's side, a
    pair of them is itself (what check_block_mask then checks)."""
    if isinstance(block_size, (tuple, list)) and len(block_size) == 2:
        return tuple(block_size)
    return block_size, block_size


def check_block_mask(block_mask, block_size, problem):
    """(block_m, block_n) of a block mask for `problem` (a Problem): a
    boolean array broadcastable to (B, Hq, ceil(Nq / block_m), ceil(Nk / block_n)), True
    where the block of query rows by keys is visible, and block_size an integer (square
    blocks) or a pair (block_m, block_n) of integers >= 1. TypeError or ValueError naming
    the argument otherwise."""
    sizes = block_pair(block_size)
    if not all(is_integer(x) and x >= 1 for x in sizes):
        raise ValueError(f"block_size must be an integer >= 1 or a pair (block_m, block_n) of "
                         f"them, got {block_size!r}")
    block_m, block_n = (int(x) for x in sizes)
    if not (hasattr(block_mask, "shape") and hasattr(block_mask, "dtype")):
        raise TypeError(f"block_mask must be a boolean array (NumPy, CuPy or torch), got "
                        f"{type(block_mask).__name__}")
    if array_dtype(block_mask) != "bool":
        raise TypeError(f"block_mask must be boolean (True = the block is visible), got dtype "
                        f"{array_dtype(block_mask)}")
    blocks = (problem.batch, problem.heads_q, -(-problem.n_q // block_m),
              -(-problem.n_k // block_n))
    check_broadcast("block_mask", block_mask, blocks,
                    f"(B, Hq, ceil(Nq / {block_m}), ceil(Nk / {block_n}))")
    return block_m, block_n


def _check_kv_lengths(kv_lengths, B, Nk):
    shape = tuple(getattr(kv_lengths, "shape", (None,)))
    if shape != (B,) or "int" not in dtype_name(kv_lengths):
        raise ValueError(f"kv_lengths must be an integer array of shape (B,)=({B},), "
                         f"got shape {shape} dtype {getattr(kv_lengths, 'dtype', None)}")
    bad = [x for x in to_int_list(kv_lengths) if not 0 <= x <= Nk]
    if bad:
        raise ValueError(f"kv_lengths must lie in [0, Nk={Nk}], got {bad[:4]}")


def row_lengths(problem, kv_lengths):
    """Per-batch key count as Python ints: kv_lengths[b], or Nk."""
    if kv_lengths is None:
        return [problem.n_k] * problem.batch
    return to_int_list(kv_lengths)


def row_ranges(problem, kv_len, r0, r1):
    """(lo, hi): tuples of key_range for query rows r0 <= i < r1 of a batch with kv_len keys."""
    return ranges_of(problem, kv_len, range(r0, r1))


def ranges_of(problem, kv_len, rows):
    """(lo, hi): tuples of key_range for the query rows `rows` of a batch with kv_len keys."""
    if not len(rows):
        return (), ()
    return tuple(zip(*(key_range(i, problem.n_q, kv_len, problem.left, problem.right,
                                 problem.bottom_right) for i in rows)))


def band(lo, hi, j0, j1, xp):
    """Boolean (rows, j1 - j0): key j0 + c is in row r's range lo[r] <= j < hi[r]."""
    j = xp.arange(j0, j1)
    return (j >= xp.asarray(lo, dtype=xp.int64)[:, None]) & \
        (j < xp.asarray(hi, dtype=xp.int64)[:, None])


def dense_visible(problem, mask=None, kv_lengths=None, xp=None):
    """The whole boolean (B, Hq or 1, Nq, Nk) of visible keys (no bias): for adapters that
    hand another library one mask. Memory B * Nq * Nk (times Hq if mask varies by head)."""
    import numpy as np

    xp = xp or np
    rows = [band(*row_ranges(problem, kv_len, 0, problem.n_q), 0, problem.n_k, xp)
            for kv_len in row_lengths(problem, kv_lengths)]
    keep = xp.stack(rows)[:, None] if rows else xp.zeros((0, 1, problem.n_q, problem.n_k), bool)
    if mask is not None:
        keep = keep & xp.asarray(mask)
    return keep
