"""Hopper's warpgroup instructions from Python (sm_90a): wgmma.mma_async with both operands in
shared memory, read through matrix descriptors, and the fences and groups that order it. On
the GPU each is one inline-PTX instruction (a Numba @intrinsic); in the simulator each is
Python with the same per-thread result, as warp.py does for mma.sync; flash_wgmma.py's forward
is made of them. The H100 and the H200 agree with the layouts below (tests/test_warpgroup.py,
tests/test_tma.py).

A warpgroup is 4 consecutive warps, 128 threads whose first is a multiple of 128; thread t of
it is in warp w = t // 32, lane 4 g + q.

wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}: D (64 x N) = A (64 x 16)
B (16 x N) + D, float32 accumulators, N a multiple of 8 from 8 to 256. A and B are in shared
memory, "K-major" (a row of A, or a column of B, along K), in one of two layouts
(operand_address):
- no swizzle: a grid of core matrices of 8 rows by 16 bytes (eight 16-bit values along K), a
  core matrix's rows 16 bytes apart; core matrices adjacent along K are LBO bytes apart, along
  the rows (M for A, N for B) SBO bytes apart; the descriptor's start 16-byte aligned;
- 128-byte swizzle (SWIZZLE): rows of 64 values (128 bytes), groups of 8 rows SBO bytes
  apart (1024: the row-major tile TMA writes), the 16-byte chunk c of row r stored at chunk
  c ^ (r % 8): the shared address's bits 4-6 XORed with its bits 7-9, so the tile must start
  1024-byte aligned. Step s of K (values 16 s ..) starts 32 s bytes in (step_start).

A may instead come from registers (mma_async_regs_*, as FlashAttention-3's P V takes P): four
uint32 a thread, warp w's rows 16 w .. 16 w + 15 as mma.sync's A fragment (a_fragments), B
from shared memory as above, or B "MN-major" (mma_async_regs_mn_*: the instruction's
transpose flag; N contiguous, as V's rows are P V's B), laid out as operand_address(...,
mn_major=True) says:
- no swizzle: core matrices of 8 rows along K by 16 bytes (eight values along N), adjacent
  along N SBO bytes apart, along K LBO bytes apart;
- 128-byte swizzle: rows along K of 64 values along N (128 bytes), 8 rows a 1024-byte group,
  groups along K SBO bytes apart, the next 64 values of N LBO bytes on; swizzled as above
  (the row-major tile TMA writes of a matrix whose rows run along K). Step s of K starts
  2 s LBO (no swizzle) or 2 s SBO bytes in.

Accumulator of thread t, N / 2 floats, like mma.sync's C fragment per warp:

    d[4 j + 0], d[4 j + 1] = D[16 w + g,     8 j + 2 q], D[16 w + g,     8 j + 2 q + 1]
    d[4 j + 2], d[4 j + 3] = D[16 w + g + 8, 8 j + 2 q], D[16 w + g + 8, 8 j + 2 q + 1]

Ordering (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"): ordinary shared
stores reach the async proxy that wgmma reads through only after fence_proxy_async (then a
barrier for other threads' stores); wgmma_fence before the first wgmma that reads registers
written since; wgmma_commit closes a group of issued products; wgmma_wait(n) returns when at
most n groups are still pending, and only then do the accumulators hold the result. The
simulator computes a product when it is issued (the earliest the hardware may read its
operands) and checks, when the first of the warpgroup's threads to wait for its group
retires it, that none of the shared words it read has changed or has a cp.async in flight
into it (the hardware may read them until then): a kernel that overwrites an operand before
any thread has waited raises there, where the simulated threads run in an order that shows
it. One that reads the accumulators before waiting reads
the result here and garbage there.

setmaxnreg_dec(n) / setmaxnreg_inc(n) (n a literal, a multiple of 8 from 24 to 256): every
thread of a warpgroup lowers, or raises, its warpgroup's registers a thread to n, so that a
producer warpgroup gives registers to consumer ones (warp specialization). The kernel must be
compiled for a known register count (launch bounds: compile_cache.jit's launch_bounds). The
simulator checks n and does nothing else.
"""
import threading
import weakref

import numpy as np
from numba import cuda

from .convert import SIMULATOR, device_function
from . import warp
from .warp import bits_value

WARPGROUP = 128
CORE_ROWS, CORE_BYTES = 8, 16  # a core matrix: 8 rows of 16 bytes (8 16-bit values)


SWIZZLE = 128  # the swizzled layout's row, in bytes


def swizzled(at):
    """Where the 128-byte swizzle stores shared byte `at`: its 16-byte chunk (bits 4-6)
    XORed with its row of 128 bytes within 1024 (bits 7-9)."""
    return at ^ ((at >> 7) & 7) << 4


def operand_address(start, row, k, lbo, sbo, swizzle, mn_major=False):
    """The shared byte address of element (row, k) of the operand a descriptor starting at
    `start` names (row: A's m or B's n; k: 0..15; 16-bit values); swizzle 0 or SWIZZLE;
    K-major, or with mn_major B read with its transpose flag."""
    if mn_major and swizzle == 0:
        return (start + (row // 8) * sbo + (k // 8) * lbo + (k % 8) * CORE_BYTES
                + (row % 8) * 2)
    if mn_major:
        return swizzled(start + (row // 64) * lbo + (k // 8) * sbo + (k % 8) * SWIZZLE
                        + (row % 64) * 2)
    if swizzle == 0:
        return (start + (row // CORE_ROWS) * sbo + (k // 8) * lbo + (row % CORE_ROWS) * CORE_BYTES
                + (k % 8) * 2)
    return swizzled(start + (row // CORE_ROWS) * sbo + (row % CORE_ROWS) * SWIZZLE + k * 2)


def step_start(s, lbo, sbo, swizzle, mn_major=False):
    """Where step s of K (values 16 s .. 16 s + 15) starts, from the operand's start: two core
    matrices along K a step without swizzle (LBO apart), 32 bytes of each 128-byte row with
    it; MN-major, two core matrices (LBO) or, with the swizzle, two 8-row groups (SBO) along
    K."""
    if mn_major:
        return s * 2 * (lbo if swizzle == 0 else sbo)
    return s * 2 * lbo if swizzle == 0 else s * 32


def operand_image(matrix, lbo, sbo, swizzle=0, mn_major=False):
    """A (rows, 16 steps) array of 16-bit values -> the uint32 words of shared memory that
    hold it, from a 1024-byte aligned start, in the layout operand_address reads step by step
    (with the swizzle: K of 64 values, one 128-byte row; MN-major, rows of 64)."""
    bits = np.ascontiguousarray(matrix).view(np.uint16)
    rows, ks = bits.shape
    whole = rows % 64 == 0 if mn_major else ks == 64
    if ks % 16 or rows % CORE_ROWS or lbo % 16 or sbo % 16 or (swizzle and not whole):
        raise ValueError(f"operand_image: rows {rows} (a multiple of 8; of 64 MN-major with "
                         f"the swizzle), K {ks} (of 16; 64 K-major with the swizzle), lbo "
                         f"{lbo} and sbo {sbo} (of 16) expected")
    where = {(r, 16 * s + k): operand_address(step_start(s, lbo, sbo, swizzle, mn_major), r,
                                              k, lbo, sbo, swizzle, mn_major)
             for s in range(ks // 16) for r in range(rows) for k in range(16)}
    image = np.zeros(-(-(max(where.values()) + 2) // 4) * 2, np.uint16)
    for (r, k), at in where.items():
        image[at // 2] = bits[r, k]
    return image.view(np.uint32)


def accumulator_matrix(frags):
    """(128, N / 2) accumulators of a warpgroup, by thread -> D (64, N)."""
    frags = np.asarray(frags)
    n = 2 * frags.shape[1]
    out = np.empty((64, n), frags.dtype)
    for t in range(WARPGROUP):
        w, g, q = t // 32, t % 32 // 4, t % 4
        for j in range(n // 8):
            for half in range(2):
                out[16 * w + g + 8 * half, 8 * j + 2 * q:8 * j + 2 * q + 2] = \
                    frags[t, 4 * j + 2 * half:4 * j + 2 * half + 2]
    return out


def a_fragments(a_bits):
    """A (64, 16) 16-bit patterns -> (128, 4) uint32: the A registers of each thread of a
    warpgroup for mma_async_regs_*: warp w holds rows 16 w .. 16 w + 15 as mma.sync's A
    fragment (warp.a_registers), each register two values, the lower column in its low half.
    The layout the accumulator's rows already have, so S's fragments become P's."""
    a_bits = np.asarray(a_bits, np.uint16)
    out = np.empty((WARPGROUP, 4), np.uint32)
    for w in range(4):
        pairs = warp.a_registers(a_bits[16 * w:16 * w + 16])
        for lane in range(warp.LANES):
            out[32 * w + lane] = [warp.pack_bits(lo, hi) for lo, hi in pairs[lane]]
    return out


def product_reference(a, b_t, c):
    """D = A B + C as the simulator computes it: A (64, 16) and B^T (N, 16) 16-bit values
    (float16, or bfloat16 as float32), C float32; products exact in float64, the sum rounded
    once to float32. (The GPU's tensor cores cut products to the accumulator's ulp instead:
    within an ulp of one product a step, warp.mma_reference says.)"""
    return (np.asarray(a, np.float64) @ np.asarray(b_t, np.float64).T
            + np.asarray(c, np.float64)).astype(np.float32)


def check_registers(n):
    """setmaxnreg's count: a multiple of 8 from 24 to 256 (PTX ISA)."""
    if n % 8 or not 24 <= n <= 256:
        raise TypeError(f"setmaxnreg: {n} registers, a multiple of 8 from 24 to 256 expected")


def _check_shape(n):
    if n % 8 or not 8 <= n <= 256:
        raise TypeError(f"wgmma m64nNk16: N = {n}, a multiple of 8 from 8 to 256 expected "
                        "(an accumulator of N / 2 float32)")


if SIMULATOR:
    def shared_address(words):
        """The shared-state-space address of a shared array's first element (the
        simulator's arrays start at 0, 16-byte aligned)."""
        return 0

    def descriptor(words, index, lbo, sbo, swizzle):
        """The matrix descriptor of the operand that starts at words[index] (a shared uint32
        array), in the layout `swizzle` (0 or SWIZZLE) names."""
        return (words, int(index) * 4, int(lbo), int(sbo), int(swizzle))

    def accumulator(n):
        """N / 2 float32 zeros (n a literal): the accumulator of an m64nNk16."""
        _check_shape(2 * n)
        return (np.float32(0),) * n

    def fragment_tuple(fragment, n):
        """The first n values (a literal) of a local array, in C order, as a tuple: an
        accumulator for the products, from the fragment array the kernel's other parts
        index."""
        return tuple(fragment.reshape(-1)[:n])

    def fragment_store(fragment, values):
        """A tuple's values into the first len(values) elements of a local array, C order."""
        fragment.reshape(-1)[:len(values)] = values

    def fence_proxy_async():
        pass

    def wgmma_fence():
        pass

    def wgmma_commit():
        groups = _groups()
        op = _group_op(groups["count"])
        with _ops_lock:
            if not op["retired"]:  # else a thread has waited for it: it is done
                op["records"].extend(groups["open"])
        groups["committed"].append(groups["count"])
        groups["open"], groups["count"] = [], groups["count"] + 1

    def wgmma_wait(n):
        """Retire all but the n newest committed groups. A group is the warpgroup's: the
        first of its threads to retire it checks that no shared word its products read (as
        far as they were issued) has changed since, nor has a cp.async in flight into it;
        once one thread's wait has returned, the group is done for all."""
        committed = _groups()["committed"]
        while len(committed) > n:
            op = _group_op(committed.pop(0))
            with _ops_lock:  # (the others' waits return once the check is done)
                first = op["retired"] == 0
                op["retired"] += 1
                if op["retired"] == op["threads"]:
                    del op["ops"][op["key"]]
                if first:
                    _check_operands(op["records"])

    def _check_operands(records):
        for words, index, seen in records:
            changed = np.flatnonzero((np.asarray(words)[index] != seen)
                                     | warp.copies_in_flight(words, index))
            if changed.size:
                raise RuntimeError(
                    f"wgmma_wait: shared word {int(index.reshape(-1)[changed[0]])} that a "
                    "product of this group reads changed, or has a cp.async in flight into "
                    "it, before the group was waited for (the GPU may read an operand until "
                    "wgmma_wait retires its group)")

    def setmaxnreg_inc(n):
        check_registers(n)

    def setmaxnreg_dec(n):
        check_registers(n)

    _THREAD_GROUPS = threading.local()  # per simulated thread: its wgmma groups
    # a launch's fake cuda module -> {(block, warpgroup, group number): the group (_group_op)}
    _ops, _ops_lock = weakref.WeakKeyDictionary(), threading.Lock()

    def _groups():
        """This thread's products since its last wgmma_commit ("open": each product's shared
        operands as read), the numbers of its committed groups not yet retired, oldest
        first, and how many it has committed ("count")."""
        groups = _THREAD_GROUPS.__dict__
        if "open" not in groups:
            groups.update(open=[], committed=[], count=0)
        return groups

    @device_function
    def _group_op(number):
        """The warpgroup's group `number` (every thread of it commits the same groups in the
        same order): its threads' records, how many threads have retired it, of how many."""
        group = cuda.threadIdx.x // WARPGROUP
        key = (cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z, group, number)
        with _ops_lock:
            ops = _ops.setdefault(cuda, {})  # (cuda: the launch's fake module)
            if key not in ops:
                ops[key] = dict(records=[], retired=0, ops=ops, key=key, threads=min(
                    WARPGROUP, cuda.blockDim.x - group * WARPGROUP))
            return ops[key]

    @device_function
    def _thread():
        """This thread's index in its warpgroup."""
        return cuda.threadIdx.x % WARPGROUP

    def _elements(desc, rows, k, dtype, mn_major=False):
        """The operand's elements (rows[i], k[j]) (NumPy arrays that broadcast), float64."""
        words, start, lbo, sbo, swizzle = desc
        at = operand_address(start, rows, k, lbo, sbo, swizzle, mn_major)
        index = at // 4
        read = np.asarray(words)[index]
        _groups()["open"].append((words, index, read.copy()))  # wgmma_wait's check
        word = read.astype(np.int64) & 0xFFFFFFFF
        return bits_value(np.where(at % 4, word >> 16, word & 0xFFFF), dtype)

    def _products(a_rows, desc_b, acc, dtype, mn_major):
        """acc + A B for this thread: a_rows (2, 16), its rows g and g + 8 of A; B's columns
        8 j + 2 q + c (c = 0, 1) for each of the N / 8 steps j; acc[4 j + 2 half + c]. The 16
        products (exact in float64) summed in float64, rounded once to float32, as
        warp.mma_reference does."""
        n = 2 * len(acc)
        _check_shape(n)
        q = _thread() % 4
        cols = (8 * np.arange(n // 8)[:, None] + 2 * q + np.arange(2)).reshape(-1)
        b = _elements(desc_b, cols[:, None], np.arange(16), dtype, mn_major)  # (N/4, 16)
        s = (a_rows @ b.T).reshape(2, n // 8, 2).transpose(1, 0, 2).reshape(-1)
        return tuple((s + np.asarray(acc, np.float64)).astype(np.float32))

    def _check_starts(*descs):
        for _, start, _, _, _ in descs:
            if start % 16:
                raise ValueError(f"wgmma: an operand's start {start} is not 16-byte aligned")

    def _mma_async(dtype, desc_a, desc_b, acc):
        _check_starts(desc_a, desc_b)
        t = _thread()
        w, g = t // 32, t % 32 // 4
        rows = np.array([16 * w + g, 16 * w + g + 8])
        return _products(_elements(desc_a, rows[:, None], np.arange(16), dtype), desc_b, acc,
                         dtype, False)

    def _mma_async_regs(dtype, a, desc_b, acc, mn_major=False):
        """The product with A from each thread's registers: the warp's lanes meet once for
        its 16 rows of A; the rest as _mma_async, B MN-major or not."""
        _check_starts(desc_b)
        lanes = np.array(warp.lane_values(tuple(int(x) for x in a)), np.uint64)
        rows16 = warp.a_matrix(warp.unpack(lanes, dtype))
        g = _thread() % 32 // 4
        return _products(rows16[[g, g + 8]], desc_b, acc, dtype, mn_major)

    def mma_async_regs_f16(a, desc_b, acc):
        """acc + A B, A from registers (a: 4 uint32, a_fragments' layout), float16."""
        return _mma_async_regs("float16", a, desc_b, acc)

    def mma_async_regs_bf16(a, desc_b, acc):
        """acc + A B, A from registers (a: 4 uint32, a_fragments' layout), bfloat16."""
        return _mma_async_regs("bfloat16", a, desc_b, acc)

    def mma_async_regs_mn_f16(a, desc_b, acc):
        """acc + A B, A from registers, B MN-major (its transpose flag), float16."""
        return _mma_async_regs("float16", a, desc_b, acc, True)

    def mma_async_regs_mn_bf16(a, desc_b, acc):
        """acc + A B, A from registers, B MN-major (its transpose flag), bfloat16."""
        return _mma_async_regs("bfloat16", a, desc_b, acc, True)

    def mma_async_f16(desc_a, desc_b, acc):
        """acc + A B for one m64nNk16 of float16 operands (N = 2 len(acc))."""
        return _mma_async("float16", desc_a, desc_b, acc)

    def mma_async_bf16(desc_a, desc_b, acc):
        """acc + A B for one m64nNk16 of bfloat16 operands (N = 2 len(acc))."""
        return _mma_async("bfloat16", desc_a, desc_b, acc)

else:
    from llvmlite import ir
    from numba.core import types
    from numba.core.extending import intrinsic

    I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()

    def inline_ptx(builder, ret, text, constraints, args):
        """One inline-PTX statement with side effects (never moved or dropped); its output."""
        fn = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(ir.InlineAsm(fn, text, constraints, side_effect=True), args)

    def shared_element(context, builder, array_type, array, index_type, index):
        """The 32-bit shared-state-space address of array[index] (a shared array)."""
        data = context.make_array(array_type)(context, builder, array).data
        at = builder.gep(data, [context.cast(builder, index, index_type, types.intp)])
        shared = builder.addrspacecast(at, ir.PointerType(at.type.pointee, 3))
        return builder.trunc(builder.ptrtoint(shared, I64), I32)

    @intrinsic
    def shared_address(typingctx, words):
        """The 32-bit shared-state-space address of a shared array's first element."""
        def codegen(context, builder, signature, args):
            return shared_element(context, builder, signature.args[0], args[0], types.intp,
                                  ir.Constant(I64, 0))

        return types.uint32(words), codegen

    @intrinsic
    def descriptor(typingctx, words, index, lbo, sbo, swizzle):
        """The 64-bit matrix descriptor of the operand that starts at words[index]: bits 0-13
        its address / 16, 16-29 LBO / 16, 32-45 SBO / 16, 62-63 the layout (1: the 128-byte
        swizzle; swizzle a literal, 0 or SWIZZLE)."""
        if not isinstance(swizzle, types.IntegerLiteral) or \
                swizzle.literal_value not in (0, SWIZZLE):
            return None
        mode = 0 if swizzle.literal_value == 0 else 1

        def codegen(context, builder, signature, args):
            at = shared_element(context, builder, signature.args[0], args[0],
                                signature.args[1], args[1])
            fields = [at] + [builder.trunc(context.cast(builder, v, ty, types.int64), I32)
                             for v, ty in zip(args[2:4], signature.args[2:4])]
            out = ir.Constant(I64, mode << 62)
            for field, shift in zip(fields, (0, 16, 32)):
                f = builder.and_(builder.lshr(builder.zext(field, I64), ir.Constant(I64, 4)),
                                 ir.Constant(I64, 0x3FFF))
                out = builder.or_(out, builder.shl(f, ir.Constant(I64, shift)))
            return out

        return types.uint64(words, index, lbo, sbo, swizzle), codegen

    @intrinsic
    def accumulator(typingctx, n):
        """N / 2 float32 zeros (n a literal): the accumulator of an m64nNk16."""
        if not isinstance(n, types.IntegerLiteral):
            return None
        _check_shape(2 * n.literal_value)
        sig = types.UniTuple(types.float32, n.literal_value)(n)

        def codegen(context, builder, signature, args):
            return context.make_tuple(builder, signature.return_type,
                                      [ir.Constant(F32, 0.0)] * n.literal_value)

        return sig, codegen

    def _flat_element(context, builder, array_type, array, i):
        """A pointer to element i (C order) of a C-contiguous array."""
        data = context.make_array(array_type)(context, builder, array).data
        return builder.gep(data, [ir.Constant(I64, i)])

    @intrinsic
    def fragment_tuple(typingctx, fragment, n):
        """The first n values (a literal) of a C-contiguous local array as a tuple: an
        accumulator for the products, from the fragment array the kernel's other parts index
        (constant indices: registers after LLVM's scalar replacement)."""
        if not (isinstance(n, types.IntegerLiteral) and isinstance(fragment, types.Array)
                and fragment.layout == "C"):
            return None
        count = n.literal_value
        sig = types.UniTuple(fragment.dtype, count)(fragment, n)

        def codegen(context, builder, signature, args):
            return context.make_tuple(builder, signature.return_type, [
                builder.load(_flat_element(context, builder, signature.args[0], args[0], i))
                for i in range(count)])

        return sig, codegen

    @intrinsic
    def fragment_store(typingctx, fragment, values):
        """A tuple's values into the first len(values) elements of a C-contiguous local array
        (C order)."""
        if not (isinstance(values, types.UniTuple) and isinstance(fragment, types.Array)
                and fragment.layout == "C" and values.dtype == fragment.dtype):
            return None

        def codegen(context, builder, signature, args):
            for i in range(values.count):
                builder.store(builder.extract_value(args[1], i),
                              _flat_element(context, builder, signature.args[0], args[0], i))
            return context.get_dummy_value()

        return types.void(fragment, values), codegen

    def _statement(text, doc):
        @intrinsic
        def emit(typingctx):
            def codegen(context, builder, signature, args):
                inline_ptx(builder, ir.VoidType(), text, "~{memory}", [])
                return context.get_dummy_value()

            return types.void(), codegen

        emit.__doc__ = doc
        return emit

    fence_proxy_async = _statement("fence.proxy.async.shared::cta;",
                                   "Shared stores so far are visible to the async proxy.")
    wgmma_fence = _statement("wgmma.fence.sync.aligned;",
                             "Registers written so far are ready for wgmma.")
    wgmma_commit = _statement("wgmma.commit_group.sync.aligned;",
                              "The products issued since the last commit form a group.")

    @intrinsic
    def wgmma_wait(typingctx, n):
        """Wait until at most n (a literal) groups of products are pending."""
        if not isinstance(n, types.IntegerLiteral):
            return None

        def codegen(context, builder, signature, args):
            inline_ptx(builder, ir.VoidType(), f"wgmma.wait_group.sync.aligned {n.literal_value};",
                 "~{memory}", [])
            return context.get_dummy_value()

        return types.void(n), codegen

    def _setmaxnreg(action):
        @intrinsic
        def setmaxnreg(typingctx, n):
            if not isinstance(n, types.IntegerLiteral):
                return None
            check_registers(n.literal_value)

            def codegen(context, builder, signature, args):
                inline_ptx(builder, ir.VoidType(),
                           f"setmaxnreg.{action}.sync.aligned.u32 {n.literal_value};", "", [])
                return context.get_dummy_value()

            return types.void(n), codegen

        way = "raised" if action == "inc" else "lowered"
        setmaxnreg.__doc__ = (f"This warpgroup's registers a thread {way} to n (a literal; "
                              "every thread of the warpgroup calls it).")
        return setmaxnreg

    setmaxnreg_inc, setmaxnreg_dec = _setmaxnreg("inc"), _setmaxnreg("dec")

    def _make_mma_async(kind, regs, mn_major=False):
        """The m64nNk16 intrinsic of 16-bit type `kind`: A through a descriptor, or with regs
        from four uint32 registers a thread (then without A's transpose flag); B's transpose
        flag set with mn_major."""
        @intrinsic
        def mma_async(typingctx, a, desc_b, acc):
            if not isinstance(acc, types.UniTuple) or acc.dtype != types.float32 or (regs and not (
                    isinstance(a, types.UniTuple) and a.count == 4
                    and isinstance(a.dtype, types.Integer))):
                return None
            r = acc.count
            _check_shape(2 * r)
            n_a = 4 if regs else 1  # A's operands
            outs = ",".join(f"${i}" for i in range(r))
            a_text = "{" + ",".join(f"${r + i}" for i in range(4)) + "}" if regs else f"${r}"
            trans_b = 1 if mn_major else 0
            # scale A, scale B, the transposes (A's only where A is in shared memory)
            flags = f"1, 1, {trans_b}" if regs else f"1, 1, 0, {trans_b}"
            # scale-d is a predicate: p = (1 != 0), D accumulates
            text = (f"{{ .reg .pred p; setp.ne.b32 p, ${r + n_a + 1}, 0;\n"
                    f"wgmma.mma_async.sync.aligned.m64n{2 * r}k16.f32.{kind}.{kind} "
                    f"{{{outs}}}, {a_text}, ${r + n_a}, p, {flags}; }}")
            constraints = ",".join(["=f"] * r + (["r"] * 4 if regs else ["l"]) + ["l", "r"]
                                   + [str(i) for i in range(r)])

            def codegen(context, builder, signature, args):
                if regs:
                    ins = [context.cast(builder, builder.extract_value(args[0], i), a.dtype,
                                        types.uint32) for i in range(4)]
                else:
                    ins = [context.cast(builder, args[0], signature.args[0], types.uint64)]
                ins += [context.cast(builder, args[1], signature.args[1], types.uint64),
                        ir.Constant(I32, 1)]
                ins += [builder.extract_value(args[2], i) for i in range(r)]
                res = inline_ptx(builder, ir.LiteralStructType([F32] * r), text, constraints, ins)
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(res, i) for i in range(r)])

            return acc(a, desc_b, acc), codegen

        return mma_async

    mma_async_f16, mma_async_bf16 = _make_mma_async("f16", False), _make_mma_async("bf16", False)
    mma_async_regs_f16 = _make_mma_async("f16", True)
    mma_async_regs_bf16 = _make_mma_async("bf16", True)
    mma_async_regs_mn_f16 = _make_mma_async("f16", True, True)
    mma_async_regs_mn_bf16 = _make_mma_async("bf16", True, True)


@device_function
def aligned_index(words, align):
    """The first index of a shared uint32 array whose address is a multiple of `align`
    bytes (a power of two: 16 for descriptors without swizzle, 1024 for the swizzle)."""
    return (align - shared_address(words) % align) % align // 4
