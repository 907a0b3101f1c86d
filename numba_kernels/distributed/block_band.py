"""The band of one block of a sharded problem, as the kernel's own arguments for that block.

A rank computes attention for a block: its query rows qo <= i < qo + nq of the whole problem
against keys ko <= j < ko + nk. The whole problem's band (causal, window, kv_lengths:
reference.contract's key ranges) shows some pairs of the block; the kernel, called on the block
alone, must show the same ones with its own causal, window and kv_lengths. In local
coordinates row i's diagonal key is i + D, D = qo - ko (+ L - Nq under bottom-right
alignment), which the kernel's arguments express where the shift leaves each bounded side of
the window at 0 or more. Where they cannot (a window narrower than the shift: its keys lie
wholly after or before the diagonal), `block_plan` halves the block's keys until each part can
be said so (the parts' results merged by their lse), or is at most MASK_KEYS keys, which take a
boolean mask.
"""
from dataclasses import dataclass

import numpy as np

from reference.contract import band, ranges_of, row_ranges

MASK_KEYS = 64  # keys of the widest part block_plan gives a mask


@dataclass(frozen=True)
class LocalBand:
    """flash_attention's causal and window for a block, and its keys that exist (kv_len)."""

    causal: object  # False or "top_left"
    window: object  # None or (left, right)
    kv_len: int


def block_band(problem, kv_len, q_range, k_range):
    """How a block sees the whole problem's band, for one batch element.

    problem: the whole problem (reference.contract.Problem: its n_q and band); kv_len: its
    keys for this batch element (Nk, or kv_lengths[b]); q_range, k_range: the block's rows
    and keys, (start, stop). Returns None where no pair of the block is visible, a LocalBand
    whose call on the block shows exactly the pairs the band shows, or "mask" where the
    kernel's arguments cannot (block_mask gives the pairs)."""
    (qo, q_stop), (ko, k_stop) = q_range, k_range
    nq, kl = q_stop - qo, max(0, min(kv_len - ko, k_stop - ko))
    if nq <= 0 or kl == 0:
        return None
    (lo_first, lo_last), (hi_first, hi_last) = ranges_of(problem, kv_len, (qo, q_stop - 1))
    # the rows' ranges move right with the row and overlap: their union is [first lo, last hi)
    if lo_first >= ko + kl or hi_last <= ko:
        return None
    if lo_last <= ko and hi_first >= ko + kl:  # every row sees every key of the block
        return LocalBand(False, None, kl)
    left, right = problem.left, problem.right
    # row i's diagonal key, in the block's own coordinates: i + shift
    shift = qo - ko + (kv_len - problem.n_q if problem.bottom_right else 0)
    for causal, diagonal in ((False, kl - nq), ("top_left", 0)):  # the kernel's alignments
        s = shift - diagonal
        window = (left - s if left >= 0 else -1, right + s if right >= 0 else -1)
        if causal and not (right >= 0 and window[1] == 0):
            continue  # a causal call's right side is 0
        if (left < 0 or window[0] >= 0) and (right < 0 or window[1] >= 0):
            if causal:
                window = (window[0], -1)
            return LocalBand(causal, None if window == (-1, -1) else window, kl)
    return "mask"


def block_mask(problem, kv_len, q_range, k_range):
    """The block's visible pairs under the band, (nq, nk) NumPy booleans (for the blocks
    block_band answers "mask"): reference.contract's band of the rows' key ranges."""
    (qo, q_stop), (ko, k_stop) = q_range, k_range
    return band(*row_ranges(problem, kv_len, qo, q_stop), ko, k_stop, np)


def block_plan(problem, kv_len, q_range, k_range):
    """The calls that give a block's result, for one batch element: a list of (keys, how),
    keys a (start, stop) part of k_range, how a LocalBand or a mask (block_mask's); the
    parts' results merged by lse make the block's (an empty list: no pair is visible)."""
    how = block_band(problem, kv_len, q_range, k_range)
    if how is None:
        return []
    if not isinstance(how, str):
        return [(k_range, how)]
    start, stop = k_range
    if stop - start <= MASK_KEYS:
        return [(k_range, block_mask(problem, kv_len, q_range, k_range))]
    middle = (start + stop) // 2
    return [part for keys in ((start, middle), (middle, stop))
            for part in block_plan(problem, kv_len, q_range, keys)]
