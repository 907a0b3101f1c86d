"""Hopper's asynchronous bulk copies and the transaction barriers that say when they landed
(sm_90a), from Python: on the GPU each is one inline-PTX instruction (a Numba @intrinsic), in
the simulator Python with the same semantics, as warp.py and warpgroup.py do. No shipped
kernel uses them yet; tests/test_tma.py runs a producer warp filling a ring of stages for 128
consumer threads, the shape of FlashAttention-3's K and V loads.

A barrier (mbarrier) is a 64-bit word in shared memory, an element of a shared uint64 array.
barrier_init(bars, i, count) (one thread, then a block barrier before any other use) expects
`count` arrivals a phase. A phase completes when all its arrivals have come and every byte
announced for it (arrive_expect_tx) has landed; the barrier then starts the next phase, whose
parity is the other. wait(bars, i, parity) returns once the phase of that parity has
completed: the r-th use of a stage (r = 0, 1, ...) waits with parity r % 2.

bulk_copy(words, at, src, index, n_bytes, bars, i): one thread copies n_bytes (a multiple of
16; both ends 16-byte aligned) from src's flat element `index` to words[at] (a shared uint32
array) without registers, and counts them against barrier i's transaction bytes when they land.
The copy is done by the async proxy: the shared words it overwrites must not be read by an
earlier ordinary load still in flight, which a consumer's arrive on an "empty" barrier, waited
for by the producer, rules out.

tensor_copy(words, at, tmap, col, row, bars, i): one thread copies a box of a 2-D array of
16-bit values (TMA), the box's first element at (row, col), into words[at]: box rows of
box_cols values one after another, elements outside the array as zeros, and with SWIZZLE
(box_cols = 64: rows of 128 bytes) each row's 16-byte chunks placed as warpgroup.swizzled says,
the layout wgmma's swizzled descriptors read; the start 1024-byte aligned then, else 128. col
must be a multiple of BOX_COL_ALIGN (8 values: 16 bytes; measured on an H100, any other column
stops the kernel with an illegal instruction); row may be any int32, negative too. The box's
bytes, zeros included, count against barrier i. tmap is what tensor_map made on the host:
a device array holding the driver's 128-byte CUtensorMap.

The simulator copies at once and counts the bytes as landed then; it keeps each barrier's
state beside the array (keyed by the array and index), not in the word, and a wait that
nothing completes ends in an error after WAIT_TIMEOUT_S instead of hanging.
"""
import itertools
import threading
import weakref

import numpy as np

from .convert import SIMULATOR, device_function
from .warpgroup import SWIZZLE, swizzled

WAIT_TIMEOUT_S = 120
BULK_ALIGN = 16  # bytes: a bulk copy's size, source and destination


BOX_COL_ALIGN = 8  # tensor_copy's first column: a multiple of 8 16-bit values (16 bytes)


def check_bulk(n_bytes):
    """A bulk copy's size: a positive multiple of 16 bytes."""
    if n_bytes <= 0 or n_bytes % BULK_ALIGN:
        raise ValueError(f"bulk_copy: n_bytes {n_bytes}, a positive multiple of 16 expected")


def check_box(shape, box_rows, box_cols, swizzle):
    """A tensor map's box: at most 256 by 256, a row of 16 bytes or more, and with SWIZZLE a
    row of exactly 128 bytes (64 values); the array 2-D."""
    if len(shape) != 2:
        raise ValueError(f"tensor_map: a 2-D array expected, got shape {tuple(shape)}")
    if swizzle not in (0, SWIZZLE):
        raise ValueError(f"tensor_map: swizzle {swizzle}, 0 or {SWIZZLE} expected")
    if not (1 <= box_rows <= 256 and 8 <= box_cols <= 256 and box_cols % 8 == 0) or \
            (swizzle and box_cols != 64):
        raise ValueError(f"tensor_map: box ({box_rows}, {box_cols}): rows 1..256, columns a "
                         "multiple of 8 up to 256 (64 with the swizzle) expected")


def box_image(array, row, col, box_rows, box_cols, swizzle):
    """The shared image (uint16) tensor_copy writes of the box at (row, col) of a 2-D array
    of 16-bit values: NumPy, for the simulator and the tests."""
    bits = np.asarray(array).view(np.uint16)
    image = np.zeros(box_rows * box_cols, np.uint16)
    for r, c in itertools.product(range(box_rows), range(box_cols)):
        if 0 <= row + r < bits.shape[0] and 0 <= col + c < bits.shape[1]:
            at = (r * box_cols + c) * 2
            image[(swizzled(at) if swizzle else at) // 2] = bits[row + r, col + c]
    return image


if SIMULATOR:
    # (id(array), i) -> (a weak reference to the array, its barrier): a later array given a
    # dead one's id finds the reference dead, not the dead array's barriers.
    _states, _states_lock = {}, threading.Lock()
    _maps = {}  # key -> (array, box_rows, box_cols, swizzle): the simulator's tensor maps

    class _Barrier:
        """One mbarrier: arrivals still expected this phase, bytes announced and not landed,
        the phase's parity."""

        def __init__(self, count):
            self.count, self.pending, self.tx, self.phase = count, count, 0, 0
            self.changed = threading.Condition()

        def _complete_if_done(self):
            if self.pending == 0 and self.tx == 0:
                self.pending, self.phase = self.count, 1 - self.phase
                self.changed.notify_all()

        def arrive(self, tx_bytes=0):
            with self.changed:
                if self.pending == 0:
                    raise RuntimeError("mbarrier: more arrivals than its count this phase")
                self.tx += tx_bytes
                self.pending -= 1
                self._complete_if_done()

        def landed(self, n_bytes):
            with self.changed:
                self.tx -= n_bytes
                self._complete_if_done()

        def wait(self, parity):
            with self.changed:
                if not self.changed.wait_for(lambda: self.phase != parity, WAIT_TIMEOUT_S):
                    raise RuntimeError(f"mbarrier: phase of parity {parity} never completed "
                                       f"({self.pending} arrivals and {self.tx} bytes missing)")

    def _barrier(bars, i):
        with _states_lock:
            held, state = _states.get((id(bars), int(i)), (None, None))
        if held is None or held() is not bars:
            raise RuntimeError(f"mbarrier {i} used before barrier_init")
        return state

    def barrier_init(bars, i, count):
        with _states_lock:
            for key in [key for key, (held, _) in _states.items() if held() is None]:
                del _states[key]
            _states[(id(bars), int(i))] = (weakref.ref(bars), _Barrier(int(count)))

    def arrive(bars, i):
        _barrier(bars, i).arrive()

    def arrive_expect_tx(bars, i, n_bytes):
        _barrier(bars, i).arrive(int(n_bytes))

    def wait(bars, i, parity):
        _barrier(bars, i).wait(int(parity))

    def bulk_copy(words, at, src, index, n_bytes, bars, i):
        check_bulk(n_bytes)
        flat = np.asarray(src).reshape(-1)
        start = int(index) * flat.itemsize
        if int(at) * 4 % BULK_ALIGN or start % BULK_ALIGN:
            raise ValueError("bulk_copy: source and destination must be 16-byte aligned")
        data = flat.view(np.uint8)[start:start + n_bytes].view(np.uint32)
        words[int(at):int(at) + n_bytes // 4] = data
        _barrier(bars, i).landed(int(n_bytes))

    def tensor_map(array, box_rows, box_cols, swizzle=0):
        """The simulator's tensor map: 16 words whose first is a key to what it describes."""
        check_box(array.shape, box_rows, box_cols, swizzle)
        with _states_lock:
            key = len(_maps) + 1
            _maps[key] = (array, box_rows, box_cols, swizzle)
        out = np.zeros(16, np.uint64)
        out[0] = key
        return out

    def tensor_copy(words, at, tmap, col, row, bars, i):
        array, box_rows, box_cols, swizzle = _maps[int(tmap[0])]
        if int(at) * 4 % (1024 if swizzle else 128):
            raise ValueError("tensor_copy: the destination must be 1024-byte aligned with "
                             "the swizzle, 128 without")
        if int(col) % BOX_COL_ALIGN:
            raise ValueError(f"tensor_copy: col {int(col)}, a multiple of {BOX_COL_ALIGN} "
                             "(16 bytes) expected; the GPU stops on an illegal instruction")
        image = box_image(array, int(row), int(col), box_rows, box_cols, swizzle)
        words[int(at):int(at) + image.size // 2] = image.view(np.uint32)
        _barrier(bars, i).landed(image.size * 2)

else:
    from llvmlite import ir
    from numba import cuda
    from numba.core import types
    from numba.core.extending import intrinsic

    from .warpgroup import inline_ptx, shared_element

    I32, I64 = ir.IntType(32), ir.IntType(64)

    def _u32(context, builder, ty, value):
        return context.cast(builder, value, ty, types.uint32)

    @intrinsic
    def barrier_init(typingctx, bars, i, count):
        """Barrier i expects `count` arrivals a phase (one thread; a block barrier after)."""
        def codegen(context, builder, sig, args):
            at = shared_element(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            inline_ptx(builder, ir.VoidType(), "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r,~{memory}",
                 [at, _u32(context, builder, sig.args[2], args[2])])
            return context.get_dummy_value()

        return types.void(bars, i, count), codegen

    @intrinsic
    def arrive(typingctx, bars, i):
        """This thread's arrival at barrier i."""
        def codegen(context, builder, sig, args):
            at = shared_element(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            inline_ptx(builder, ir.VoidType(), "mbarrier.arrive.shared::cta.b64 _, [$0];",
                 "r,~{memory}", [at])
            return context.get_dummy_value()

        return types.void(bars, i), codegen

    @intrinsic
    def arrive_expect_tx(typingctx, bars, i, n_bytes):
        """This thread's arrival at barrier i, announcing n_bytes more to land this phase."""
        def codegen(context, builder, sig, args):
            at = shared_element(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            inline_ptx(builder, ir.VoidType(),
                 "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", "r,r,~{memory}",
                 [at, _u32(context, builder, sig.args[2], args[2])])
            return context.get_dummy_value()

        return types.void(bars, i, n_bytes), codegen

    @intrinsic
    def try_wait(typingctx, bars, i, parity):
        """1 if barrier i's phase of this parity has completed (the hardware may wait a
        while first), else 0."""
        def codegen(context, builder, sig, args):
            at = shared_element(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            text = ("{ .reg .pred done; "
                    "mbarrier.try_wait.parity.shared::cta.b64 done, [$1], $2; "
                    "selp.u32 $0, 1, 0, done; }")
            return inline_ptx(builder, I32, text, "=r,r,r,~{memory}",
                        [at, _u32(context, builder, sig.args[2], args[2])])

        return types.uint32(bars, i, parity), codegen

    @device_function
    def wait(bars, i, parity):
        """Return once barrier i's phase of this parity has completed."""
        while try_wait(bars, i, parity) == 0:
            pass

    @intrinsic
    def bulk_copy(typingctx, words, at, src, index, n_bytes, bars, i):
        """n_bytes from src's flat element `index` to words[at], landing on barrier i."""
        def codegen(context, builder, sig, args):
            dst = shared_element(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            data = context.make_array(sig.args[2])(context, builder, args[2]).data
            src_at = builder.ptrtoint(builder.gep(data, [context.cast(
                builder, args[3], sig.args[3], types.intp)]), I64)
            bar = shared_element(context, builder, sig.args[5], args[5], sig.args[6], args[6])
            inline_ptx(builder, ir.VoidType(),
                 "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[$0], [$1], $2, [$3];", "r,l,r,r,~{memory}",
                 [dst, src_at, _u32(context, builder, sig.args[4], args[4]), bar])
            return context.get_dummy_value()

        return types.void(words, at, src, index, n_bytes, bars, i), codegen

    def tensor_map(array, box_rows, box_cols, swizzle=0):
        """A device array holding the CUtensorMap of a 2-D C-contiguous device array of
        16-bit values (float16, bfloat16 as int16/uint16) for boxes of box_rows by box_cols,
        out-of-bounds elements read as zeros."""
        from cuda.bindings import driver

        check_box(array.shape, box_rows, box_cols, swizzle)
        rows, cols = array.shape
        if array.dtype.itemsize != 2 or array.strides[1] != 2:
            raise ValueError("tensor_map: a C-contiguous array of 16-bit values expected")
        err, tmap = driver.cuTensorMapEncodeTiled(
            driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 2,
            array.__cuda_array_interface__["data"][0],
            [driver.cuuint64_t(int(n)) for n in (cols, rows)],
            [driver.cuuint64_t(int(array.strides[0]))],
            [driver.cuuint32_t(int(n)) for n in (box_cols, box_rows)],
            [driver.cuuint32_t(1), driver.cuuint32_t(1)],
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if swizzle
            else driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_NONE,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"tensor_map: cuTensorMapEncodeTiled failed: {err}")
        return cuda.to_device(np.array([int(x) for x in tmap.opaque], np.uint64))

    @intrinsic
    def tensor_copy(typingctx, words, at, tmap, col, row, bars, i):
        """The box at (row, col) of tmap's array to words[at], landing on barrier i."""
        def codegen(context, builder, sig, args):
            dst = shared_element(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            data = context.make_array(sig.args[2])(context, builder, args[2]).data
            bar = shared_element(context, builder, sig.args[5], args[5], sig.args[6], args[6])
            coords = [context.cast(builder, v, ty, types.int32)
                      for v, ty in zip(args[3:5], sig.args[3:5])]
            inline_ptx(builder, ir.VoidType(),
                 "cp.async.bulk.tensor.2d.shared::cluster.global.tile"
                 ".mbarrier::complete_tx::bytes [$0], [$1, {$2, $3}], [$4];",
                 "r,l,r,r,r,~{memory}",
                 [dst, builder.ptrtoint(data, I64)] + coords + [bar])
            return context.get_dummy_value()

        return types.void(words, at, tmap, col, row, bars, i), codegen
