"""The pre-passes, launched before the kernels with no wait for the host: a mask's or a block
table's tile classes (or the mask a block table stands for) and each query tile's list of
visible key tiles, or each key tile's of query tiles (block_sparse.py), for the kernels that
walk them, and for the tensor-core kernels float32
inputs split into float16 halves (halves.py) and 16-bit inputs' tiles flagged where they
hold a NaN or an inf (flash_mma_bwd.py's scan)."""
import numpy as np

from reference.memory import span

from .block_sparse import (BLOCKS_THREADS, CLASS_THREADS, CLASS_WARPS, LIST_THREADS, LIST_WARPS,
                           BlocksSpec, ClassesSpec, ListsSpec, blocks_kernel, classes_kernel,
                           lists_kernel)
from .flash_mma_bwd import SCAN_THREADS, ScanSpec, scan_kernel
from .halves import ABS_BLOCKS, SLOTS, THREADS as HALVES_THREADS, HalvesSpec, halves_kernel
from .launch import launch
from .mma_parts import FLAG_ROWS


def class_prepass(io, pb, mask_dev, mask_steps, has_mask, block_m, block_n, blocks=None):
    """The tile classes of a kernel with tiles of block_m x block_n (block_sparse.py):
    (B or 1, Hq or 1, query tiles, key tiles) uint8 on the device, the batch and head
    dimensions the mask's (mask_dev, as side_inputs gives it, with its steps), and with
    blocks (a BlockTable, after fit_blocks) its hidden blocks' tiles SKIP; without a mask,
    bias or block table (has_mask False) None. No wait for the host."""
    if not has_mask:
        return None
    tiles_m, tiles_n = -(-pb.n_q // block_m), -(-pb.n_k // block_n)
    batch, heads = (pb.batch if mask_steps[0] else 1), (pb.heads_q if mask_steps[1] else 1)
    classes = io.scratch((batch, heads, max(tiles_m, 1), max(tiles_n, 1)))
    if tiles_m * tiles_n == 0:
        return classes
    if blocks is None or blocks.masked:
        words = mask_words(mask_dev, pb.n_k)
        spec = ClassesSpec(block_m, block_n, words is not None)
        grid = (-(-tiles_n // CLASS_WARPS), tiles_m, batch * heads)
        launch(classes_kernel(spec), spec, grid, CLASS_THREADS, io.stream,
               mask_dev if words is None else words,
               tuple(int(x) for x in mask_steps), pb.n_q, pb.n_k, classes)
    if blocks is not None:
        spec = BlocksSpec()
        launch(blocks_kernel(spec), spec, (-(-tiles_m * tiles_n // BLOCKS_THREADS),
                                           batch * heads), BLOCKS_THREADS, io.stream,
               blocks.dev, blocks.steps, blocks.block_m // block_m, blocks.block_n // block_n,
               blocks.masked, classes)
    return classes


def table_fits(block_size, tiles, block_steps, mask_steps=None):
    """Whether kernels with tiles of each (rows, keys) of `tiles` walk a block table's
    tiles from the table itself: every block of block_size (rows, keys) holds whole tiles,
    and a mask given with it (its steps; None without one) has each batch or head
    dimension the table has (block_steps: the kernels find a tile's list by the mask's
    dimensions)."""
    whole = bool(tiles) and all(block_size[0] % m == 0 and block_size[1] % n == 0
                                for m, n in tiles)
    return whole and (mask_steps is None or all(
        m or not b for m, b in zip(mask_steps[:2], block_steps[:2])))


def fit_blocks(io, pb, mask_dev, steps, blocks, tiles=()):
    """(mask_dev, steps, blocks) for kernels with tiles of each (rows, keys) of `tiles`
    (steps: side_inputs's). Unchanged without a block table (blocks None); where the
    kernels read the table itself (table_fits), without a mask the all-true mask in the
    table's batch and head dimensions (the kernels find a tile's list by the mask's);
    else the boolean mask the table stands for, and'ed with the mask, written out on the
    device (block_sparse.BlocksSpec(expand=True)) in the mask's place, and no table:
    kernels without visible lists (tiles empty) read that mask pair by pair."""
    if blocks is None:
        return mask_dev, steps, blocks
    lead = [(pb.batch, pb.heads_q)[i] if steps["mask_steps"][i] or blocks.steps[i] else 1
            for i in range(2)]
    if table_fits((blocks.block_m, blocks.block_n), tiles, blocks.steps,
                  steps["mask_steps"] if blocks.masked else None):
        if blocks.masked:
            return mask_dev, steps, blocks
        mask_dev, mask_steps = io.mask(None, lead)
        return mask_dev, dict(steps, mask_steps=mask_steps), blocks
    keep = io.scratch((*lead, pb.n_q, pb.n_k))
    if lead[0] * lead[1] * pb.n_q * pb.n_k:
        spec = BlocksSpec(expand=True)
        launch(blocks_kernel(spec), spec, (-(-pb.n_q * pb.n_k // BLOCKS_THREADS),
                                           lead[0] * lead[1]), BLOCKS_THREADS, io.stream,
               blocks.dev, blocks.steps, blocks.block_m, blocks.block_n, mask_dev,
               tuple(int(x) for x in steps["mask_steps"]), keep)
    keep_steps = tuple(int(n > 1) for n in keep.shape)
    return keep, dict(steps, mask_steps=keep_steps), None


def list_prepass(io, classes, transposed=False):
    """The visible lists a kernel walks (block_sparse.lists_source): int32 on the device,
    (B or 1, Hq or 1, query tiles, 2 + key tiles) for the classes class_prepass made, or
    with transposed (B or 1, Hq or 1, key tiles, 2 + query tiles) (the dK, dV kernel's);
    for None (no mask or bias) an array the kernel does not read. No wait for the host."""
    if classes is None:
        return io.scratch((1, 1, 1, 1), "int32")
    batch, heads, tiles_m, tiles_n = classes.shape
    tiles, others = (tiles_n, tiles_m) if transposed else (tiles_m, tiles_n)
    visible = io.scratch((batch, heads, tiles, 2 + others), "int32")
    rows, spec = batch * heads * tiles, ListsSpec(transposed)
    launch(lists_kernel(spec), spec, -(-rows // LIST_WARPS), LIST_THREADS, io.stream,
           classes, visible)
    return visible


def mask_words(mask_dev, n_k):
    """mask_dev (uint8 on the device, C-contiguous, 4-D) as int32 words of four keys along
    its last dimension, no copy, where that dimension is the n_k keys, a multiple of 4, and
    starts 4-byte aligned; else None (the pre-pass reads a byte a load)."""
    start = span(mask_dev)
    if mask_dev.shape[3] != n_k or n_k % 4 or start is None or start[0] % 4:
        return None
    if type(mask_dev).__module__.startswith("torch"):
        import torch
        return mask_dev.view(torch.int32)
    return mask_dev.view(np.int32)  # Numba and CuPy device arrays


def halves_prepass(io, named, names=SLOTS):
    """(named with the tensors `names` (of q, k, v, dout) as float16 halves on the device
    (2B, H, N, W): hi at b, lo at B + b; {x_flags} of each, and the scales' `factors`), from
    halves.py's pre-pass: one absmax launch for them all, a split launch each. No wait for
    the host. The forward and the backward split q and k alike: the same halves."""
    assert names == SLOTS[:len(names)], names  # blockIdx.y and `slot` index SLOTS
    largest = max(int(np.prod(named[n].shape)) for n in names)
    blocks = max(1, min(ABS_BLOCKS, -(-largest // HALVES_THREADS)))  # each a stride of them
    partial = io.dev(io.empty((len(SLOTS), blocks), "float32"))
    factors = io.dev(io.empty((2 * len(SLOTS),), "float32"))
    spec = HalvesSpec("absmax")  # rows of partial past len(names) are not written
    tensors = [io.flat(named[n]) for n in names]
    launch(halves_kernel(spec), spec, (blocks, len(names)), HALVES_THREADS, io.stream,
           *(tensors + tensors[-1:] * (len(SLOTS) - len(names))), partial)
    named, flags, spec = dict(named), {"factors": factors}, HalvesSpec("split")
    for slot, name in enumerate(names):
        x = named[name]
        batch, heads, rows, width = x.shape
        tiles = -(-rows // FLAG_ROWS)
        named[name] = io.dev(io.empty((2 * batch, heads, rows, width), "float16"))
        flags[f"{name}_flags"] = io.scratch((batch, heads, max(tiles, 1)))
        if batch * heads * rows:
            launch(halves_kernel(spec), spec, (tiles, batch * heads), HALVES_THREADS,
                   io.stream, x, named[name], partial, factors, flags[f"{name}_flags"], slot)
    return named, flags


def flag_prepass(io, pb, x):
    """(B, H, rows / FLAG_ROWS) uint8 on the device: 1 where FLAG_ROWS rows of x (16-bit,
    C-contiguous on the device, an even last dim) hold a NaN or an inf (flash_mma_bwd's
    pre-pass; no wait for it)."""
    batch, heads, rows, width = x.shape
    tiles = -(-rows // FLAG_ROWS)
    flags = io.scratch((batch, heads, max(tiles, 1)))
    if batch * heads * rows:
        scan = ScanSpec(pb.dtype)
        launch(scan_kernel(scan), scan, (tiles, batch * heads), SCAN_THREADS, io.stream,
               io.words(x), flags, rows, width // 2)
    return flags
