"""Warp-level instructions from Python: tensor-core mma.sync, ldmatrix, warp shuffles and
votes (ballot: bit l of the word is lane l's predicate; popc counts a word's bits) and
asynchronous copies. On the GPU each is one inline-PTX instruction (a Numba @intrinsic); in the
simulator each is Python with the same per-lane semantics, so a kernel written with them runs
unchanged on a CPU and a reader can step through it lane by lane.

A warp is 32 lanes; lane = 4 * g + t, g = lane // 4 (the "group", 0..7), t = lane % 4. A 32-bit
register holds two 16-bit values (float16 or bfloat16), the lower index in the low half.

mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D (16x8) = A (16x16) B (16x8) + C, float32
accumulators (PTX ISA, "Matrix Fragments for mma.m16n8k16"):

    A, 16x16, four registers            B, 16x8, two registers      C and D, 16x8, four floats
         k: 0 .. 7   8 .. 15                 n: 0 .. 7                    n: 0 .. 7
    row g    [ a0   |   a2 ]          k 0..7   [ b0 ]              row g    [ c0 c1 ]
    row g+8  [ a1   |   a3 ]          k 8..15  [ b1 ]              row g+8  [ c2 c3 ]

    a0 = A[g, 2t:2t+2]     a1 = A[g+8, 2t:2t+2]     a2 = A[g, 2t+8:2t+10]   a3 = A[g+8, 2t+8:2t+10]
    b0 = B[2t:2t+2, g]     b1 = B[2t+8:2t+10, g]
    c0, c1 = C[g, 2t], C[g, 2t+1]                   c2, c3 = C[g+8, 2t], C[g+8, 2t+1]

ldmatrix.sync.aligned.m8n8.x4.shared.b16: four 8x8 matrices of 16-bit values from shared
memory. Lanes 8m .. 8m+7 each give the address of one row (8 values, 16 bytes, 16-byte
aligned) of matrix m; lane 4g + t receives register m = row g's values 2t, 2t+1. With .trans
it receives column g's values 2t, 2t+1 (rows 2t and 2t+1 of column g) instead: the layout of B
above when the rows in memory are B's k (keys of V).

cp.async.cg.shared.global: 16 bytes from global to shared memory without passing through
registers, zero-filled past n_bytes; copies are grouped by cp_async_commit and waited for by
cp_async_wait(n) (all but the newest n groups have landed), then a barrier makes them visible
to the other threads. The simulator performs a group's copies when it is waited for, the
latest moment the hardware may: a kernel that reads before it waits reads stale data there too;
copies_in_flight tells which shared words have a copy issued into them and not landed, where
the hardware may write at any moment (warpgroup.wgmma_wait refuses operands with one).
"""
import threading

import numpy as np
from numba import cuda

from .convert import (SIMULATOR, bf16_to_float, device_function, float32, float_to_bf16,
                      uint32)

LANES = 32
FULL_MASK = 0xFFFFFFFF
MEETING_TIMEOUT_S = 120  # a lane that never arrives (a divergent warp) ends in an error


# The layouts, as NumPy: (32, r) registers by lane <-> the matrices. The simulator's
# instructions are built on them and the tests check them against the table above.

def _a_layout(A):
    """a_registers as the table above draws it, lane by lane."""
    out = np.empty((LANES, 4, 2), A.dtype)
    for lane in range(LANES):
        g, t = divmod(lane, 4)
        out[lane] = A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2], \
            A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10]
    return out


def _b_layout(B):
    """b_registers as the table above draws it, lane by lane."""
    out = np.empty((LANES, 2, 2), B.dtype)
    for lane in range(LANES):
        g, t = divmod(lane, 4)
        out[lane] = B[2 * t:2 * t + 2, g], B[2 * t + 8:2 * t + 10, g]
    return out


def _c_layout(C):
    """c_registers as the table above draws it, lane by lane."""
    out = np.empty((LANES, 4), C.dtype)
    for lane in range(LANES):
        g, t = divmod(lane, 4)
        out[lane] = C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]
    return out


# Where each register's value sits in its matrix (row-major flat index), from the layouts
# above: the conversions below are one gather or scatter each.
A_INDEX = _a_layout(np.arange(16 * 16).reshape(16, 16))
B_INDEX = _b_layout(np.arange(16 * 8).reshape(16, 8))
C_INDEX = _c_layout(np.arange(16 * 8).reshape(16, 8))


def a_registers(A):
    """A (16, 16) 16-bit values -> (32, 4) pairs: a0..a3 of each lane (pair = 2 values)."""
    return np.asarray(A).reshape(16 * 16)[A_INDEX]


def b_registers(B):
    """B (16, 8) -> (32, 2) pairs: b0, b1 of each lane."""
    return np.asarray(B).reshape(16 * 8)[B_INDEX]


def c_registers(C):
    """C (16, 8) float32 -> (32, 4): c0..c3 of each lane."""
    return np.asarray(C).reshape(16 * 8)[C_INDEX]


def _scattered(values, index, shape):
    out = np.empty(shape[0] * shape[1], values.dtype)
    out[index] = values
    return out.reshape(shape)


def c_matrix(regs):
    """The inverse of c_registers: (32, 4) -> C (16, 8)."""
    return _scattered(np.asarray(regs), C_INDEX, (16, 8))


def a_matrix(pairs):
    """The inverse of a_registers: (32, 4, 2) -> A (16, 16)."""
    return _scattered(np.asarray(pairs), A_INDEX, (16, 16))


def b_matrix(pairs):
    """The inverse of b_registers: (32, 2, 2) -> B (16, 8)."""
    return _scattered(np.asarray(pairs), B_INDEX, (16, 8))


def _ldmatrix_layout(rows, trans):
    """ldmatrix_rows lane by lane."""
    out = np.empty((LANES, 4, 2), rows.dtype)
    for lane in range(LANES):
        g, t = divmod(lane, 4)
        for m in range(4):
            out[lane, m] = rows[m, 2 * t:2 * t + 2, g] if trans else rows[m, g, 2 * t:2 * t + 2]
    return out


LDMATRIX_INDEX = {trans: _ldmatrix_layout(np.arange(4 * 8 * 8).reshape(4, 8, 8), trans)
                  for trans in (False, True)}


def ldmatrix_rows(rows, trans):
    """What ldmatrix.x4 gives each lane: rows (4, 8, 8) 16-bit values, matrix m's row r at
    rows[m, r] (the row lane 8m + r pointed at) -> (32, 4, 2) pairs."""
    return np.asarray(rows).reshape(4 * 8 * 8)[LDMATRIX_INDEX[bool(trans)]]


# 16-bit values <-> 32-bit registers (two values, the lower index in the low half).

def pack_bits(lo, hi):
    return (int(lo) & 0xFFFF) | (int(hi) & 0xFFFF) << 16


def value_bits(x, dtype):
    """A float as the 16-bit pattern of `dtype` ("float16" or "bfloat16"), rounded to nearest
    even as cvt.rn does (bfloat16 by the kernels' own rounding, convert.float_to_bf16, which
    is Python where this runs: in the simulator)."""
    if dtype == "float16":
        return int(np.float16(x).view(np.uint16))
    return int(float_to_bf16(float32(x))) & 0xFFFF


def bits_value(bits, dtype):
    """A 16-bit pattern of `dtype` (an int, or an array of them) as float64 (exact)."""
    halves = (np.asarray(bits, np.int64) & 0xFFFF).astype(np.uint16)
    if dtype == "float16":
        values = halves.view(np.float16).astype(np.float64)
    else:
        values = (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return values if values.ndim else float(values)


def unpack(regs, dtype):
    """32-bit registers (any shape) -> their values (shape + (2,), low half first), float64."""
    halves = np.array(regs, np.uint32).view(np.uint16).reshape(
        np.shape(regs) + (2,))
    if dtype == "float16":
        return halves.view(np.float16).astype(np.float64)
    return (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def mma_reference(a, b, c, dtype):
    """D of mma.m16n8k16 for a warp: a (32, 4), b (32, 2) registers, c (32, 4) float32 ->
    (32, 4) float32. Products of 16-bit values are exact in float64 and the sum is rounded
    once to float32, to nearest. The H200 does not round so: it cuts each product to the
    ulp of the largest addend (C, in a long sum) before adding, toward zero
    (tests/test_gpu.py measures it; tests/test_halves.py models it), within an ulp of
    this a product. A long chain of mma.sync on one accumulator drifts on the GPU where it
    does not here (halves.py, dV's step sums)."""
    A, B = a_matrix(unpack(a, dtype)), b_matrix(unpack(b, dtype))
    C = c_matrix(np.asarray(c, np.float64))
    return c_registers((A @ B + C).astype(np.float32))


if SIMULATOR:
    import weakref

    # a launch's meetings, by its fake cuda module: a launch that raised may leave lanes
    # waiting in a meeting (till MEETING_TIMEOUT_S), which the next launch must not join
    _meetings, _meetings_lock = weakref.WeakKeyDictionary(), threading.Lock()
    _pending = threading.local()  # a thread's asynchronous copies not yet landed
    # id of a shared array's memory -> (a weak reference to it, a count a word of the copies
    # into it issued and not landed), for copies_in_flight
    _flights, _flights_lock = {}, threading.Lock()

    class _Meeting:
        """Where the lanes of one simulated warp exchange values: each puts its own in and
        waits for all; the last to arrive computes the result before any lane goes on. One
        wait a meeting suffices: a lane that goes on to the next meeting may overwrite its
        value, but the result is replaced only when every lane, each having read this one,
        has arrived there. A lane waits on a lock of its own that the last one releases (a
        threading.Barrier wakes every lane onto one lock, three times slower here). A lane
        that waits MEETING_TIMEOUT_S, or a combine that raises, breaks the meeting: every
        lane waiting there, or arriving later, raises threading.BrokenBarrierError."""

        def __init__(self, lanes):
            self.values, self.combine, self.result = [None] * lanes, None, None
            self.lock, self.waiting, self.broken = threading.Lock(), [], False

        def _break(self):
            """(with self.lock held)"""
            self.broken = True
            for waiter in self.waiting:
                waiter.release()
            self.waiting = []

        def wait(self):
            with self.lock:
                if self.broken:
                    raise threading.BrokenBarrierError
                if len(self.waiting) == len(self.values) - 1:
                    try:
                        self.result = self.combine(self.values)
                    except BaseException:
                        self._break()
                        raise
                    for waiter in self.waiting:
                        waiter.release()
                    self.waiting = []
                    return
                waiter = threading.Lock()
                waiter.acquire()
                self.waiting.append(waiter)
            if not waiter.acquire(timeout=MEETING_TIMEOUT_S):
                with self.lock:
                    if waiter in self.waiting:  # not released since: this lane times out
                        self._break()
                        raise threading.BrokenBarrierError
            if self.broken:
                raise threading.BrokenBarrierError

    def _meet(launch, key, lanes, lane, value, combine):
        """Every lane's value -> combine(values), computed once (by one lane) for all."""
        with _meetings_lock:
            meetings = _meetings.setdefault(launch, {})
            meeting = meetings.get(key)
            if meeting is None or meeting.broken or len(meeting.values) != lanes:
                meeting = meetings[key] = _Meeting(lanes)
        meeting.values[lane] = value
        meeting.combine = combine  # (every lane's is the same operation)
        meeting.wait()
        return meeting.result

    def lane_values(value):
        """Every lane's value, lane by lane (the warp meets once): how the simulator's
        warp-wide instructions elsewhere (warpgroup.py) gather their operands."""
        return _warp_values(value)[1]

    @device_function
    def _warp_values(value, combine=list):
        """(lane, combine(every lane's value)): the calling warp meets (1-D blocks)."""
        tid, threads = cuda.threadIdx.x, cuda.blockDim.x
        warp = tid // LANES
        key = (cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z, warp)
        return tid % LANES, _meet(cuda, key, min(LANES, threads - warp * LANES), tid % LANES,
                                  value, combine)  # (cuda: the launch's fake module)

    def _mma(dtype, a, b, c):
        def combine(regs):
            return mma_reference([r[0] for r in regs], [r[1] for r in regs],
                                 [r[2] for r in regs], dtype)

        lane, d = _warp_values((a, b, c), combine)
        return tuple(d[lane])  # float32 scalars (mma_reference rounds)

    def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma("float16", (a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        return _mma("bfloat16", (a0, a1, a2, a3), (b0, b1), (c0, c1, c2, c3))

    def _ldmatrix(words, index, trans):
        def combine(addresses):
            # lane 8m + r's address: row r of matrix m, 4 words = 8 values
            at = np.asarray(addresses, np.int64)[:, None] + np.arange(4)
            row_words = np.asarray(words)[at].astype(np.int64) & 0xFFFFFFFF
            rows = np.stack([row_words & 0xFFFF, row_words >> 16], axis=-1).reshape(4, 8, 8)
            pairs = ldmatrix_rows(rows, trans)
            return [tuple(lane) for lane in (pairs[..., 0] | pairs[..., 1] << 16)
                    .astype(np.uint32)]

        lane, registers = _warp_values(int(index), combine)
        return registers[lane]

    def ldmatrix_x4(words, index):
        return _ldmatrix(words, index, False)

    def ldmatrix_x4_trans(words, index):
        return _ldmatrix(words, index, True)

    def shfl_xor(value, lane_mask):
        lane, values = _warp_values(value)
        return values[lane ^ lane_mask]

    def shfl_idx(value, src_lane):
        _, values = _warp_values(value)
        return values[src_lane]

    def ballot(predicate):
        _, values = _warp_values(bool(predicate))
        return np.uint32(sum(1 << lane for lane, x in enumerate(values) if x))

    def popc(word):
        return bin(int(word) & 0xFFFFFFFF).count("1")

    def unpack_f16(word):
        word = int(word)
        return (float32(bits_value(word & 0xFFFF, "float16")),
                float32(bits_value(word >> 16 & 0xFFFF, "float16")))

    def unpack_bf16(word):
        word = int(word)
        return (float32(bits_value(word & 0xFFFF, "bfloat16")),
                float32(bits_value(word >> 16 & 0xFFFF, "bfloat16")))

    def pack_f16(lo, hi):
        return np.uint32(pack_bits(value_bits(lo, "float16"), value_bits(hi, "float16")))

    def pack_bf16(lo, hi):
        return np.uint32(pack_bits(value_bits(lo, "bfloat16"), value_bits(hi, "bfloat16")))

    def _groups():
        if not hasattr(_pending, "groups"):
            _pending.groups, _pending.open = [], []
        return _pending

    def _flight(words):
        """(the count a word of copies in flight into the memory words is a view of, the
        word of that memory words[0] is)."""
        memory = words
        while isinstance(memory.base, np.ndarray):
            memory = memory.base
        offset = (words.__array_interface__["data"][0]
                  - memory.__array_interface__["data"][0]) // 4
        with _flights_lock:
            held, counts = _flights.get(id(memory), (None, None))
            if held is None or held() is not memory:
                for key in [key for key, (ref, _) in _flights.items() if ref() is None]:
                    del _flights[key]
                counts = np.zeros(memory.nbytes // 4, np.int64)
                _flights[id(memory)] = (weakref.ref(memory), counts)
        return counts, offset

    def copies_in_flight(words, index):
        """Whether a cp.async into words[index] (an array of word indices) has been issued
        and has not landed (the simulator's; warpgroup.wgmma_wait checks its operands)."""
        counts, offset = _flight(words)
        return counts[offset + index] > 0

    def _count_flight(words, w_index, change):
        counts, offset = _flight(words)
        with _flights_lock:
            counts[offset + w_index:offset + w_index + 4] += change

    def cp_async16(words, w_index, src, s_index, n_bytes):
        """Read now (the inputs do not change during a kernel), written when waited for."""
        flat = np.asarray(src).reshape(-1)  # s_index: a flat element index (C order)
        bits = flat[s_index:s_index + n_bytes // 2].view(np.uint16)
        values = [int(x) for x in bits] + [0] * (8 - n_bytes // 2)
        _groups().open.append((words, w_index, values))
        _count_flight(words, w_index, 1)

    def cp_async_commit():
        p = _groups()
        p.groups.append(p.open)
        p.open = []

    def cp_async_wait(n):
        p = _groups()
        while len(p.groups) > n:
            for words, at, values in p.groups.pop(0):
                for w in range(4):
                    words[at + w] = np.uint32(pack_bits(values[2 * w], values[2 * w + 1]))
                _count_flight(words, at, -1)

else:
    from llvmlite import ir
    from numba.core import types
    from numba.core.extending import intrinsic

    I32, F32, I64 = ir.IntType(32), ir.FloatType(), ir.IntType(64)

    def _asm(builder, outputs, text, constraints, args, side_effect=False):
        """One inline-PTX statement; returns its outputs (a list)."""
        ret = ir.LiteralStructType(outputs) if len(outputs) > 1 else \
            outputs[0] if outputs else ir.VoidType()
        fn = ir.FunctionType(ret, [a.type for a in args])
        value = builder.call(ir.InlineAsm(fn, text, constraints, side_effect=side_effect),
                             args)
        if len(outputs) > 1:
            return [builder.extract_value(value, i) for i in range(len(outputs))]
        return [value] if outputs else []

    def _u32(context, builder, ty, value):
        return context.cast(builder, value, ty, types.uint32)

    def _address(context, builder, array_type, array, index_type, index):
        """The generic address of flat element `index` of a C-contiguous array, as a 64-bit
        integer."""
        data = context.make_array(array_type)(context, builder, array).data
        at = builder.gep(data, [context.cast(builder, index, index_type, types.intp)])
        return builder.ptrtoint(at, I64)

    def _shared_address(context, builder, array_type, array, index_type, index):
        """The 32-bit shared-state-space address of flat element `index` of a shared uint32
        array: base + 4 index in 32 bits (a shared window is under 4 GB), so that no 64-bit
        generic address is formed and converted (cvta) per access, and ptxas can fold a
        constant part of the index into the instruction's offset."""
        data = context.make_array(array_type)(context, builder, array).data
        shared = builder.addrspacecast(data, ir.PointerType(data.type.pointee, 3))
        base = builder.trunc(builder.ptrtoint(shared, I64), I32)
        offset = builder.shl(builder.trunc(context.cast(builder, index, index_type, types.intp),
                                           I32), ir.Constant(I32, 2))
        return builder.add(base, offset)

    def _make_mma(kind):
        text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            regs, accs = (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3)
            if not all(isinstance(r, types.Integer) for r in regs):
                return None
            sig = types.UniTuple(types.float32, 4)(*regs, *accs)

            def codegen(context, builder, signature, args):
                ins = [_u32(context, builder, ty, v) for ty, v in zip(signature.args[:6],
                                                                      args[:6])]
                ins += [context.cast(builder, v, ty, types.float32)
                        for ty, v in zip(signature.args[6:], args[6:])]
                outs = _asm(builder, [F32] * 4, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", ins)
                return context.make_tuple(builder, signature.return_type, outs)

            return sig, codegen

        return mma

    mma_f16, mma_bf16 = _make_mma("f16"), _make_mma("bf16")

    def _make_ldmatrix(trans):
        text = (f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 "
                "{$0,$1,$2,$3}, [$4];")

        @intrinsic
        def ldmatrix(typingctx, words, index):
            if not (isinstance(words, types.Array) and words.ndim == 1
                    and words.dtype == types.uint32 and isinstance(index, types.Integer)):
                return None
            sig = types.UniTuple(types.uint32, 4)(words, index)

            def codegen(context, builder, signature, args):
                at = _shared_address(context, builder, signature.args[0], args[0],
                                     signature.args[1], args[1])
                outs = _asm(builder, [I32] * 4, text, "=r,=r,=r,=r,r,~{memory}", [at],
                            side_effect=True)
                return context.make_tuple(builder, signature.return_type, outs)

            return sig, codegen

        return ldmatrix

    ldmatrix_x4, ldmatrix_x4_trans = _make_ldmatrix(False), _make_ldmatrix(True)

    @device_function
    def shfl_xor(value, lane_mask):
        return cuda.shfl_xor_sync(FULL_MASK, value, lane_mask)

    @device_function
    def shfl_idx(value, src_lane):
        return cuda.shfl_sync(FULL_MASK, value, src_lane)

    @device_function
    def ballot(predicate):  # Numba's ballot_sync is an int32: lane 31 would be its sign
        return uint32(cuda.ballot_sync(FULL_MASK, predicate))

    @device_function
    def popc(word):
        return cuda.popc(word)

    @intrinsic
    def unpack_f16(typingctx, word):
        """A register of two float16 values -> (low, high) as float32."""
        sig = types.UniTuple(types.float32, 2)(word)

        def codegen(context, builder, signature, args):
            outs = _asm(builder, [F32, F32], "{ .reg .b16 l, h; mov.b32 {l, h}, $2; "
                        "cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }", "=f,=f,r",
                        [_u32(context, builder, signature.args[0], args[0])])
            return context.make_tuple(builder, signature.return_type, outs)

        return sig, codegen

    @device_function
    def unpack_bf16(word):
        """A register of two bfloat16 values -> (low, high) as float32."""
        return bf16_to_float(word & 0xFFFF), bf16_to_float(word >> 16)

    def _make_pack(kind):
        text = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"  # $1 goes to the high half

        @intrinsic
        def pack(typingctx, lo, hi):
            sig = types.uint32(lo, hi)

            def codegen(context, builder, signature, args):
                lo_, hi_ = (context.cast(builder, v, ty, types.float32)
                            for ty, v in zip(signature.args, args))
                return _asm(builder, [I32], text, "=r,f,f", [hi_, lo_])[0]

            return sig, codegen

        return pack

    pack_f16, pack_bf16 = _make_pack("f16"), _make_pack("bf16")

    @intrinsic
    def cp_async16(typingctx, words, w_index, src, s_index, n_bytes):
        """16 bytes from flat element s_index of src (global, 16-bit values, C-contiguous, any
        number of dimensions) to words[w_index:] (shared, uint32), zero-filled past n_bytes
        (0 or 16 here)."""
        if not (isinstance(words, types.Array) and words.dtype == types.uint32
                and isinstance(src, types.Array) and src.dtype.bitwidth == 16
                and src.layout == "C"):
            return None
        sig = types.void(words, w_index, src, s_index, n_bytes)

        def codegen(context, builder, signature, args):
            dst = _shared_address(context, builder, signature.args[0], args[0],
                                  signature.args[1], args[1])
            at = _address(context, builder, signature.args[2], args[2], signature.args[3],
                          args[3])
            n = _u32(context, builder, signature.args[4], args[4])
            _asm(builder, [], "{ .reg .u64 g; cvta.to.global.u64 g, $1; "
                 "cp.async.cg.shared.global [$0], [g], 16, $2; }",
                 "r,l,r,~{memory}", [dst, at, n], side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_commit(typingctx):
        def codegen(context, builder, signature, args):
            _asm(builder, [], "cp.async.commit_group;", "~{memory}", [], side_effect=True)
            return context.get_dummy_value()

        return types.void(), codegen

    @intrinsic
    def cp_async_wait(typingctx, n):
        """Wait until at most n (a constant) of this thread's newest groups are in flight."""
        if not isinstance(n, types.IntegerLiteral):
            return None
        text = f"cp.async.wait_group {n.literal_value};"

        def codegen(context, builder, signature, args):
            _asm(builder, [], text, "~{memory}", [], side_effect=True)
            return context.get_dummy_value()

        return types.void(n), codegen
