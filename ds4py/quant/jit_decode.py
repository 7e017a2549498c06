"""The decode kernels (a few tokens: int8 activations for IQ2_XXS, Q2_K and Q8_0; F16 rows), in explicit
vector IR (numba intrinsics emitting llvmlite IR). Imported only through ds4py.quant.jit_i8 and ds4py.quant.jit,
like ds4py.quant.jit_i8_kernels (whose block-buffer kernels serve prefill: a block unpacked once for all
tokens).

numba's autovectoriser leaves table-driven unpacking scalar (a computed table index, an int16 store that may
alias the table) and cannot carry a vector float accumulator across blocks. These intrinsics write the vector
code directly, in LLVM's portable vector types (<32 x i8>, <16 x i32>, <8 x float>, <64 x half>): LLVM lowers
them to NEON on aarch64 and SSE / AVX on x86-64. On AVX2 hosts the byte products call pmaddubsw / pmaddwd /
psignb by name (LLVM did not form them from the portable IR: it widened to 32-bit multiplies); a cross-target
build ($NUMBA_CPU_NAME) takes the portable IR (tested: the same results). On aarch64 with the dot-product extension
they call sdot (ds4py.quant.jit_neon: NEON; LLVM did not form it from the portable IR either), the same bits.
Integer block sums are exact, so IQ2_XXS / Q2_K give ds4py.quant.jit_i8_kernels' bits. The intrinsics live in
this file with the kernels that inline them: numba's disk cache keys a kernel on its own source file only, so an
intrinsic edited elsewhere would leave stale compiled kernels behind (seen while writing these).

- iq2_block / iq2_block_pairs: one IQ2_XXS block of 256 against one token / several (ggml's scheme: the grid
  magnitudes stay unsigned, the signs go onto the activation (psign); magnitudes x activation pairs, then
  times each group's 2 ls + 1), iq2_block_pairs doing the table lookups once for all the tokens. On AVX-512
  VBMI + GFNI + VNNI hosts (AVX512: Zen 4, Ice Lake and later) the block is decoded without table loads
  (_iq2_decode512, on x in x_perm's order): ~2x the AVX2 path's GB/s a core.
- q2k_block / q2k_mins: one Q2_K block's sum of scale * (2-bit code . x), and its min term from the
  activation's 16-sums. On AVX512 hosts the scale is folded into the weight byte by a table (_q2k_dot512, on x
  in x_perm_q2k's order).
- q8_0_row: a whole Q8_0 row, 8 float lanes carried across its blocks, summed once at the end.
- f16_runs: an F16 row's 64-wide runs, converted by fpext (where half converts in hardware).
- quant_q8_k_rows / quant_q8_0_rows: the activation quantisers, numpy's operations in one pass.
- *_ex_rows / *_ex_dec: the same kernels over a layer's routed experts (one or two stacked matrices) in one call.
"""

from __future__ import annotations

from llvmlite import ir
import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from ds4py.quant import jit_neon
from ds4py.quant.isa import target_features

F32, I32N = np.float32, np.int32
OPTS = dict(parallel=True, cache=True, nogil=True, boundscheck=False)
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)


_FEATURES = target_features()           # what LLVM compiles for (isa.py)


def _host_avx2() -> bool:
    """Whether numba compiles for a target with AVX2 (this host's features, or $NUMBA_CPU_FEATURES: isa.py): then
    the byte products use pmaddubsw + pmaddwd (LLVM does not form them from the portable IR: it widened to
    vpmulld); a cross-target build ($NUMBA_CPU_NAME alone) and other CPUs get the portable IR."""
    return bool(_FEATURES.get("avx2"))


AVX2 = _host_avx2()


def _host_avx512() -> bool:
    """Whether the target has the AVX-512 set the IQ2_XXS kernel uses: BW + VL (byte multiply-adds and masks on 512
    bits), VBMI (vpmultishiftqb: a block's 32 sign fields cut out in one instruction), GFNI (vgf2p8affineqb: the
    parity bit of each of them in one). Zen 4, Ice Lake and later."""
    return AVX2 and all(_FEATURES.get(k) for k in ("avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512vnni",
                                                   "gfni"))


AVX512 = _host_avx512()
# aarch64 with the dot-product extension: the byte products on sdot (ds4py.quant.jit_neon), else the portable IR
NEON = jit_neon.ENABLED and not AVX2


def _native_half() -> bool:
    """Whether LLVM converts half to float in hardware here (F16C on x86-64, always on aarch64); elsewhere
    fpext becomes a call to compiler-rt's __extendhfsf2, which numba's JIT does not link (LLVM ERROR at the
    first compile: measured with NUMBA_CPU_NAME=generic). Then F16 keeps jit_kernels.f16_rows' table."""
    import platform

    if platform.machine().lower() in ("aarch64", "arm64"):
        return True
    return bool(_FEATURES.get("f16c"))


NATIVE_HALF = _native_half()


def _const(ty, v):
    return ir.Constant(ty, v)


def _splat(ty: ir.VectorType, v: int):
    return ir.Constant(ty, [v] * ty.count)


def _data(context, builder, sig, args, i):
    return context.make_array(sig.args[i])(context, builder, args[i]).data


def _vload(builder, base, offset, ty: ir.VectorType):
    """An unaligned vector load at element `offset` of the pointer `base`."""
    return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=1)


def _madd(builder, a16, b16):
    """<2n x i16> a, b -> <n x i32>: a[2i] b[2i] + a[2i+1] b[2i+1], written in the shape LLVM matches to one
    pmaddwd (x86-64) / smull + smlal2 pairs (aarch64)."""
    n = a16.type.count // 2
    vt = ir.VectorType(I32, n)
    ev = ir.Constant(ir.VectorType(I32, n), list(range(0, 2 * n, 2)))
    od = ir.Constant(ir.VectorType(I32, n), list(range(1, 2 * n, 2)))

    def half(v, mask):
        return builder.sext(builder.shuffle_vector(v, v, mask), vt)

    return builder.add(builder.mul(half(a16, ev), half(b16, ev)), builder.mul(half(a16, od), half(b16, od)))


def _x86(builder, name: str, ret, *args):
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name=name)
    return builder.call(fn, list(args))


def _dot_u8s8(builder, u, s, scale16):
    """<32 x i8> u (unsigned, small), s (signed) and a <16 x i16> scale per pair of lanes ->
    <8 x i32> (AVX2) / <16 x i32> (portable) partial sums of u * s * scale. Callers keep |u s| pair sums
    below 2^15 (pmaddubsw saturates there)."""
    if AVX2:
        h16, w8 = ir.VectorType(I16, 16), ir.VectorType(I32, 8)
        p = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", h16, u, s)
        return _x86(builder, "llvm.x86.avx2.pmadd.wd", w8, p, scale16)
    h32 = ir.VectorType(I16, 32)
    sc = builder.shuffle_vector(scale16, scale16, ir.Constant(ir.VectorType(I32, 32), [i // 2 for i in range(32)]))
    return _madd(builder, builder.mul(builder.zext(u, h32), sc), builder.sext(s, h32))


def _hsum(builder, v):
    """The lanes of an integer vector (a power-of-two count) added, by halving."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n, 2 * n))))
        v = builder.add(lo, hi)
    return builder.extract_element(v, _const(I32, 0))


def _iq2_gather(builder, p, grid, signs):
    """One IQ2_XXS group (8 bytes at p: 4 grid indices, a u32 of 4 x 7 sign-pattern bits and the 4-bit ls) ->
    (<32 x i8> grid magnitudes, <32 x i8> signs as +1 / -1 bytes, i16 2 ls + 1)."""
    aux = builder.load(builder.bitcast(builder.gep(p, [_const(I64, 4)]), I32.as_pointer()), align=1)
    v4 = ir.VectorType(I64, 4)
    gv, sv = ir.Constant(v4, None), ir.Constant(v4, None)
    for k in range(4):
        gi = builder.zext(builder.load(builder.gep(p, [_const(I64, k)])), I64)
        gv = builder.insert_element(gv, builder.load(builder.gep(grid, [gi])), _const(I32, k))
        si = builder.zext(builder.and_(builder.lshr(aux, _const(I32, 7 * k)), _const(I32, 127)), I64)
        sv = builder.insert_element(sv, builder.load(builder.gep(signs, [si])), _const(I32, k))
    b32 = ir.VectorType(I8, 32)
    ls = builder.trunc(builder.add(builder.shl(builder.lshr(aux, _const(I32, 28)), _const(I32, 1)),
                                   _const(I32, 1)), I16)
    return builder.bitcast(gv, b32), builder.bitcast(sv, b32), ls


def _iq2_signed_dot(builder, gv, m, x, ls):
    """<16 x i32> / <8 x i32> partial sums of grid magnitudes gv times the activation bytes x signed by the
    sign bytes m (+1 / -1), times ls."""
    if NEON:
        return jit_neon.iq2_signed_dot(builder, gv, m, x, ls)
    if AVX2:
        xs = _x86(builder, "llvm.x86.avx2.psign.b", x.type, x, m)      # one instruction (|x| <= 127)
    else:
        mm = builder.ashr(m, _splat(m.type, 7))                          # 0x00 / 0xFF
        xs = builder.sub(builder.xor(x, mm), mm)                         # x, or -x where the sign is -1
    h16 = ir.VectorType(I16, 16)
    lsv = builder.insert_element(ir.Constant(h16, None), ls, _const(I32, 0))
    lsv = builder.shuffle_vector(lsv, lsv, ir.Constant(ir.VectorType(I32, 16), [0] * 16))
    return _dot_u8s8(builder, gv, xs, lsv)                       # pairs: 2 * 43 * 127 < 2^15



# ---- IQ2_XXS on AVX2 (+ FMA; no AVX-512: most laptops): the signs and scales of a block decoded in vector registers
# ggml's AVX2 scheme (_iq2_gather: 4 grid rows and 4 keven sign patterns a group by scalar loads, the ls by scalar
# shifts) measured 3.3-4.0 GB/s a core here: ~330 instructions a block, its scalar index arithmetic spilling, and
# ~60 of them on the shuffle ports (vpunpcklqdq, vinserti128, vpbroadcastw). Here the block is 8 units of 32
# weights, unit (j, r) = rows 2 r, 2 r + 1 of group _AUX_GROUPS[j] in lane 0 and of group _AUX_GROUPS[4 + j] in
# lane 1 (x permuted to match once a call: x_perm), so every per-unit move stays inside a lane:
# - grid: rows stay 64-bit table rows (a 256-entry table of 16-bit rows has no fast AVX2 lookup: vpshufb is 16
#   entries a lane; gathers are slow on Zen and microcode-slowed on Intel since Downfall): a byte load of the
#   index and a 16-byte load at 8 x index from a padded copy of the table (one addressing mode, no index
#   arithmetic), two rows paired by vpblendd (no shuffle port), one vinserti128 a unit;
# - signs, all 8 groups at once: the 8 aux words in one <8 x i32> (dword k: group _AUX_GROUPS[k], no lane
#   crossing to get there: the block's critical path starts here); each 7-bit field
#   e moved to byte e (field e sits at bit 7 e); its parity as bit 7 from a 16-entry nibble table (two vpshufb and
#   a xor: ggml's ksigns_iq2xs without the 128-entry table); each sign byte s paired with s >> 1 in a word. A
#   unit's word w then takes (s, s >> 1) of its entry by one vpshufb, and one vpmullw by 2^(7 - i) (i = 2 (w % 4):
#   the weight of the word's low byte) moves bit i of s into the low byte's bit 7 and bit i + 1 into the high
#   byte's; vpsignb(x, that | 1) signs x (4 instructions a unit, where and / compare / xor / sub took 6);
# - scales: 2 ls + 1 = (aux >> 28) * 2 + 1, one vpshufb for two units (their lanes' groups);
# - the 8 units' sums added as a tree (the block's latency, not 8 adds in a row).
# Measured one thread from memory (bench/cpu_kernel_gbs.py --isa avx2, Zen 4 built without AVX-512): 3.3 -> 4.2
# GB/s a core; ~220 instructions a block (ggml's ~330).
# The dot product is ggml's: pmaddubsw (magnitudes x signed x, pairs |.| <= 2 * 43 * 127 < 2^15) and pmaddwd by the
# group's 2 ls + 1. The integer block sum is the other paths' exactly: the same bits.
_B32, _H16, _W8 = ir.VectorType(I8, 32), ir.VectorType(I16, 16), ir.VectorType(I32, 8)
_PARITY_NIBBLE = [0x80 * (bin(i).count("1") & 1) for i in range(16)]
_SHIFT_WORDS = [1 << (7 - 2 * (w % 4)) for w in range(16)]       # word w: 2^(7 - i), i = its low byte's weight
_AUX_GROUPS = (0, 4, 1, 5, 2, 6, 3, 7)      # the group in dword k of _iq2_decode256's aux vector (lane k // 4)
_AUX_SLOT = np.argsort(np.array(_AUX_GROUPS))               # group g -> its dword


def _pshufb(builder, table, idx):
    return _x86(builder, "llvm.x86.avx2.pshuf.b", _B32, table, idx)


def _iq2_decode256(builder, p):
    """The block of 64 code bytes at p -> 8 units (j, r) as (<32 x i8> grid magnitudes, <32 x i8> bytes whose sign
    is the weight's (never 0: for vpsignb), <16 x i16> the 2 ls + 1 of the lanes' groups), unit
    2 j + r reading x_perm's 32 bytes 32 (2 j + r) of the block."""
    q0 = _vload(builder, p, _const(I64, 0), ir.VectorType(I64, 4))
    q1 = _vload(builder, p, _const(I64, 32), ir.VectorType(I64, 4))
    # the 8 aux words without a lane crossing (short latency: the block's critical path starts here): dwords
    # [0, 4, 1, 5 | 2, 6, 3, 7] hold groups _AUX_GROUPS (q0's aux shifted down a dword, q1's in place)
    aux = builder.bitcast(builder.shuffle_vector(builder.bitcast(builder.lshr(q0, _splat(q0.type, 32)), _W8),
                                                 builder.bitcast(q1, _W8),
                                                 ir.Constant(_W8, [0, 9, 2, 11, 4, 13, 6, 15])), _W8)
    t = builder.and_(aux, _splat(_W8, 0x7F))
    for e in (1, 2, 3):                                         # field e (bits 7 e ..) to byte e (bits 8 e ..)
        t = builder.or_(t, builder.and_(builder.shl(aux, _splat(_W8, e)), _splat(_W8, 0x7F << (8 * e))))
    tb = builder.bitcast(t, _B32)
    lo = builder.and_(tb, _splat(_B32, 15))
    hi = builder.bitcast(builder.lshr(builder.bitcast(tb, _H16), _splat(_H16, 4)), _B32)
    hi = builder.and_(hi, _splat(_B32, 15))
    par = ir.Constant(_B32, _PARITY_NIBBLE * 2)
    sgn = builder.or_(tb, builder.xor(_pshufb(builder, par, lo), _pshufb(builder, par, hi)))   # byte 4 g + e
    half = builder.lshr(sgn, _splat(_B32, 1))
    # words (s, s >> 1) of the lane's sign bytes 0..7 (pairs[0]: dwords 0, 1 of each lane), 8..15 (pairs[1])
    pairs = [builder.shuffle_vector(sgn, half, ir.Constant(ir.VectorType(I32, 32),
                                                           [16 * (i // 16) + 8 * h + (i % 16) // 2 + 32 * (i % 2)
                                                            for i in range(32)])) for h in range(2)]
    sc = builder.or_(builder.shl(builder.lshr(aux, _splat(_W8, 28)), _splat(_W8, 1)), _splat(_W8, 1))
    scb = builder.bitcast(sc, _B32)                             # dword k: group _AUX_GROUPS[k]
    shifts = ir.Constant(_H16, _SHIFT_WORDS)
    out = []
    for j in range(4):                                          # unit pair j: dword j of each lane
        sw = builder.bitcast(_pshufb(builder, scb, ir.Constant(_B32, [4 * j + i % 2 for i in range(32)])), _H16)
        for r in range(2):
            gv = _iq2_unit_rows(builder, p, j, r)
            # word w of a lane: entry 2 r + w // 4 of the lane's dword j = byte 4 (j % 2) + ... of pairs[j // 2]
            ctl = [2 * (4 * (j % 2) + 2 * r + (i % 16) // 8) + i % 2 for i in range(32)]
            e = _pshufb(builder, pairs[j // 2], ir.Constant(_B32, ctl))
            top = builder.bitcast(builder.mul(builder.bitcast(e, _H16), shifts), _B32)
            out.append((gv, builder.or_(top, _splat(_B32, 1)), sw))
    return out


class _ByteLoad(ir.instructions.LoadInstr):
    """A volatile scalar load: kept a load, where LLVM would take the bytes out of the block's vector load (vpextrb:
    2 micro-ops each, 32 a block)."""

    def descr(self, buf):
        [val] = self.operands
        buf.append(f"load volatile {self.type}, {val.type} {val.get_reference()}, align 1\n")



def _iq2_unit_rows(builder, p, j, r):
    """Unit (j, r)'s grid rows as <32 x i8> magnitudes: qwords = rows 2 r, 2 r + 1 of group _AUX_GROUPS[j], then of
    group _AUX_GROUPS[4 + j] (group g's index bytes at p + 8 g): per row one byte load and one 16-byte table load
    at 8 x index (one address each: (row a, row a + 1) and (row b - 1, row b)), a blend takes (row a, row b) (no
    shuffle port), one vinserti128 the two lanes."""
    v2 = ir.VectorType(I64, 2)
    table = builder.gep(_grid_padded(builder.module), [_const(I64, 0), _const(I64, 1)])      # row 0
    ga, gb = _AUX_GROUPS[j], _AUX_GROUPS[4 + j]
    rows = []
    for n, (g, k) in enumerate(((ga, 2 * r), (ga, 2 * r + 1), (gb, 2 * r), (gb, 2 * r + 1))):
        ld = _ByteLoad(builder.block, builder.gep(p, [_const(I64, 8 * g + k)]), typ=I8)
        builder._insert(ld)
        i = builder.sub(builder.zext(ld, I64), _const(I64, n % 2))          # the second row of a pair: at 8 (i - 1)
        row = _ByteLoad(builder.block, builder.bitcast(builder.gep(table, [i]), v2.as_pointer()), typ=v2)
        builder._insert(row)                    # volatile: kept one 16-byte load (not narrowed to a qword + insert)
        rows.append(row)
    pair = ir.Constant(ir.VectorType(I32, 2), [0, 3])
    lo, hi = builder.shuffle_vector(rows[0], rows[1], pair), builder.shuffle_vector(rows[2], rows[3], pair)
    return builder.bitcast(builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 4), [0, 1, 2, 3])), _B32)


def _grid_padded(module):
    """IQ2_XXS's 256 grid rows as qwords with one zero qword before and after (16-byte loads at 8 (index - 1) and
    8 index stay inside), a constant of the module."""
    name = "ds4py_iq2xxs_grid_padded"
    if name in module.globals:
        return module.globals[name]
    from ds4py.quant.iq2 import GRID

    rows = np.ascontiguousarray(GRID.astype(np.uint8)).view(np.int64).ravel()
    ty = ir.ArrayType(I64, 258)
    gv = ir.GlobalVariable(module, ty, name=name)
    gv.initializer = ir.Constant(ty, [0] + [int(v) for v in rows] + [0])
    gv.global_constant = True
    gv.linkage = "internal"
    gv.align = 16
    return gv


def _iq2_dot256(builder, dec, xp, xo):
    """<8 x i32> partial sums of a decoded block (_iq2_decode256) times its 256 activation bytes at xp[xo]."""
    vs = []
    for u, (gv, sb, sw) in enumerate(dec):
        x = _vload(builder, xp, builder.add(xo, _const(xo.type, 32 * u)), _B32)
        xs = _x86(builder, "llvm.x86.avx2.psign.b", _B32, x, sb)      # x, or -x where the weight's sign is minus
        pr = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _H16, gv, xs)
        vs.append(_x86(builder, "llvm.x86.avx2.pmadd.wd", _W8, pr, sw))
    while len(vs) > 1:                                          # a tree: the block's latency, not 8 adds in a row
        vs = [builder.add(vs[i], vs[i + 1]) for i in range(0, len(vs), 2)]
    return vs[0]


# ---- IQ2_XXS on AVX-512 (VBMI + GFNI + VNNI): a block's signs, scales and grid rows decoded in vector registers
# A block's 64 code bytes are 8 groups of (4 grid-index bytes, u32 aux: 4 x 7 sign bits at bits 0 / 7 / 14 / 21 and
# ls at 28..31), i.e. group g is qword g of one <64 x i8> load. The AVX2 path above spends ~30 instructions a group
# on scalar table lookups (4 grid rows, 4 sign patterns; 3.8-4.0 GB/s a core on Zen 4); here (7.5 GB/s):
# - signs: vpmultishiftqb copies each qword's bits 32 + 7 e .. +7 into byte e (e = 0..3) and vgf2p8affineqb maps
#   each byte to its 7 bits plus their parity as bit 7 (ggml's even-parity sign patterns, ksigns_iq2xs), so
#   group g's 4 sign bytes are the negation bits of its 32 weights; vpshufbitqmb picks entry e's 8 bits of every
#   group into one <64 x i1> and the activation is negated under it (vpsubb with a mask);
# - scales: 2 ls + 1 = (qword >> 59) | 1, on both dwords of the qword (one vpshufd), applied once per group after
#   the dot product (vpmulld: dwords 2 g, 2 g + 1 hold group g's sum);
# - grid rows: 256 x 8 magnitudes in {8, 25, 43} are 256 x 16 bits of 2-bit codes; two 256-byte tables (codes of
#   weights 0..3, 4..7) looked up by vpermi2b (128-byte halves; bit 7 picks the half) for every index byte at once,
#   vpmultishiftqb cuts entry e's 8 codes into 8 bytes and a GF(2) affine map (vgf2p8affineqb) makes the levels;
# - x in entry-major order (x_perm: zmm e = grid entry e of the 8 groups), so masks and scales need no lane moves;
#   vpdpbusd (magnitudes unsigned x signed activation, 4 products a dword) is the dot product.
# The integer block sum is the other paths' exactly, so the float sequence and the bits are unchanged.
# code c (bits c0, c1; never both) -> 8 + 17 c0 + 35 c1 = 8 ^ (c0 * 0b010001) ^ (c1 * 0b100011), a GF(2) affine map:
# out bit 0 = c0 ^ c1, bit 1 = c1, bit 4 = c0, bit 5 = c1 (matrix byte 7 - i is output bit i's row), bit 3 from 8
_GF2_LEVELS = 0x0302000001020000
_GF2_PARITY7 = 0x010204081020407F          # vgf2p8affineqb matrix: out bits 0..6 = in bits 0..6, bit 7 = their parity
_B64, _H32, _W16 = ir.VectorType(I8, 64), ir.VectorType(I16, 32), ir.VectorType(I32, 16)


def _grid_codes() -> tuple[list[int], list[int]]:
    """IQ2_XXS's 256 grid rows (magnitudes 8 / 25 / 43 -> codes 0 / 1 / 2) as two bytes of 4 x 2 bits each:
    weights 0..3, weights 4..7 (weight i at bits 2 (i % 4))."""
    from ds4py.quant.iq2 import GRID

    codes = np.searchsorted(np.array([8, 25, 43]), GRID.astype(np.int64))
    assert (np.array([8, 25, 43])[codes] == GRID).all()
    byte = lambda c: int(sum(int(v) << (2 * i) for i, v in enumerate(c)))     # noqa: E731
    return [byte(r[:4]) for r in codes], [byte(r[4:]) for r in codes]


_GRID_CODES = _grid_codes()


def _table_half(builder, table: list[int], half: int, idx):
    """table[128 half + (idx & 127)] per byte lane of idx (one vpermi2b over two 64-byte table registers)."""
    t = table[128 * half:128 * half + 128]
    return _x86(builder, "llvm.x86.avx512.vpermi2var.qi.512", _B64, ir.Constant(_B64, t[:64]), idx,
                ir.Constant(_B64, t[64:]))


def _iq2_decode512(builder, p):
    """The block of 64 code bytes at p -> (4 x (<64 x i8> magnitudes of grid entry k of the 8 groups, qword g
    for group g; <64 x i1> their negation masks), <32 x i16> 2 ls_g + 1 at words 4 g .. 4 g + 3): the order of
    x_perm's zmm k."""
    q = _vload(builder, p, _const(I64, 0), _B64)
    ctrl = ir.Constant(_B64, [32, 39, 46, 53, 0, 0, 0, 0] * 8)
    fields = _x86(builder, "llvm.x86.avx512.pmultishift.qb.512", _B64, ctrl, q)
    gf = ir.Constant(ir.VectorType(I64, 8), [_GF2_PARITY7] * 8)
    sgn = _x86(builder, "llvm.x86.vgf2p8affineqb.512", _B64, fields, builder.bitcast(gf, _B64), _const(I8, 0))
    q64 = builder.bitcast(q, ir.VectorType(I64, 8))
    # 2 ls + 1 = (qword >> 59) | 1 (bit 59 is the last sign field's top bit: the | 1 covers it), on both dwords
    ls = builder.bitcast(builder.or_(builder.lshr(q64, _splat(q64.type, 59)), _splat(q64.type, 1)), _W16)
    sc = builder.shuffle_vector(ls, ls, ir.Constant(_W16, [2 * (w // 2) for w in range(16)]))
    # the grid rows as 2-bit codes, a group's 4 rows in its qword (row e at bits 16 e: weight i at 16 e + 2 i):
    # each index byte twice (lane 8 g + 2 e + h = index e of group g), looked up in the lo-half (h = 0) or hi-half
    # (h = 1) code table (128-byte halves by vpermi2b on the low 7 bits, the upper half where bit 7 is set)
    idx = builder.shuffle_vector(q, q, ir.Constant(ir.VectorType(I32, 64), [8 * (j // 8) + (j % 8) // 2
                                                                           for j in range(64)]))
    top = builder.icmp_signed("<", idx, ir.Constant(_B64, [0] * 64))
    lo, hi = (builder.select(top, _table_half(builder, t, 1, idx), _table_half(builder, t, 0, idx))
              for t in _GRID_CODES)
    odd = ir.Constant(ir.VectorType(ir.IntType(1), 64), [j % 2 for j in range(64)])
    codes = builder.select(odd, hi, lo)
    gmap = builder.bitcast(ir.Constant(ir.VectorType(I64, 8), [_GF2_LEVELS] * 8), _B64)
    out = []
    for k in range(4):
        # weight i of entry k of group g: sign bit 8 k + i of the group's 4 sign bytes (qword g of sgn)
        m = _x86(builder, "llvm.x86.avx512.vpshufbitqmb.512", ir.VectorType(ir.IntType(1), 64), sgn,
                 ir.Constant(_B64, [8 * k + i for _ in range(8) for i in range(8)]))
        # row k's 2-bit codes into the low bits of each weight's byte, then to the magnitudes 8 / 25 / 43
        ck = _x86(builder, "llvm.x86.avx512.pmultishift.qb.512", _B64,
                  ir.Constant(_B64, [16 * k + 2 * i for _ in range(8) for i in range(8)]), codes)
        out.append((_x86(builder, "llvm.x86.vgf2p8affineqb.512", _B64, ck, gmap, _const(I8, 8)), m))
    return out, sc


def _iq2_dot512(builder, dec, xp, xo):
    """<16 x i32> partial sums of a decoded block (_iq2_decode512) times its 256 activation bytes at xp[xo], in
    x_perm's order."""
    rows, sc = dec
    acc = ir.Constant(_W16, [0] * 16)
    for k, (g, m) in enumerate(rows):
        x = _vload(builder, xp, builder.add(xo, _const(xo.type, 64 * k)), _B64)
        xs = builder.select(m, builder.sub(ir.Constant(_B64, [0] * 64), x), x)
        acc = _x86(builder, "llvm.x86.avx512.vpdpbusd.512", _W16, acc, builder.bitcast(g, _W16),
                   builder.bitcast(xs, _W16))       # dwords 2 g, 2 g + 1: group g (|sum| < 2^31)
    return builder.mul(acc, sc)                     # times each group's 2 ls + 1


@intrinsic
def iq2_block(typingctx, raw, off, xq, xo, grid8, sign8):
    """sum_i w_i * xq[xo + i] over one IQ2_XXS block of 256 (its 8 groups of 8 bytes from flat byte `off` of raw,
    as iq2_block_pairs): one token, the lookups straight into its dot product. The groups' partial sums stay in
    one vector register; one horizontal sum per block."""
    def codegen(context, builder, sig, args):
        p = builder.gep(_data(context, builder, sig, args, 0), [args[1]])
        xp = _data(context, builder, sig, args, 2)
        grid, signs = _data(context, builder, sig, args, 4), _data(context, builder, sig, args, 5)
        if AVX512:
            return _hsum(builder, _iq2_dot512(builder, _iq2_decode512(builder, p), xp, args[3]))
        if AVX2:
            return _hsum(builder, _iq2_dot256(builder, _iq2_decode256(builder, p), xp, args[3]))
        b32 = ir.VectorType(I8, 32)
        acc = None
        for g in range(8):
            gv, m, ls = _iq2_gather(builder, builder.gep(p, [_const(I64, 8 * g)]), grid, signs)
            x = _vload(builder, xp, builder.add(args[3], _const(args[3].type, 32 * g)), b32)
            v = _iq2_signed_dot(builder, gv, m, x, ls)
            acc = v if acc is None else builder.add(acc, v)
        return _hsum(builder, acc)
    return types.int32(raw, off, xq, xo, grid8, sign8), codegen


def _hsum4(builder, vs):
    """The lanes of four <16 x i32> added, each, by one reduction tree -> 4 x i32."""
    m = lambda idx: ir.Constant(_W16, idx)                                       # noqa: E731
    lo8, hi8 = list(range(8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))
    ab, cd = (builder.add(builder.shuffle_vector(u, v, m(lo8)), builder.shuffle_vector(u, v, m(hi8)))
              for u, v in (vs[:2], vs[2:]))
    lo4 = [i + 4 * (i // 4) for i in range(16)]                 # 0..3, 8..11, 16..19, 24..27
    s = builder.add(builder.shuffle_vector(ab, cd, m(lo4)), builder.shuffle_vector(ab, cd, m([i + 4 for i in lo4])))
    for step in (2, 1):
        s = builder.add(s, builder.shuffle_vector(s, s, m([i ^ step for i in range(16)])))
    return [builder.extract_element(s, _const(I32, 4 * i)) for i in range(4)]


def _hsum2(builder, a, b):
    """The lanes of two <16 x i32> added, each: one reduction tree for both (a's partial sums in lanes 0..7, b's
    in 8..15) -> (i32, i32)."""
    m = lambda idx: ir.Constant(_W16, idx)                                       # noqa: E731
    s = builder.add(builder.shuffle_vector(a, b, m(list(range(8)) + list(range(16, 24)))),
                    builder.shuffle_vector(a, b, m(list(range(8, 16)) + list(range(24, 32)))))
    for step in (4, 2, 1):
        s = builder.add(s, builder.shuffle_vector(s, s, m([i ^ step for i in range(16)])))
    return builder.extract_element(s, _const(I32, 0)), builder.extract_element(s, _const(I32, 8))


@intrinsic
def iq2_block2(typingctx, raw, off, xq, xo, grid8, sign8):
    """iq2_block of the blocks at flat bytes off and off + 66 (one row's blocks b, b + 1) against xq[xo ...] and
    xq[xo + 256 ...] -> (isum_b, isum_b+1). On AVX512 hosts the two blocks' sums share one reduction tree."""
    def codegen(context, builder, sig, args):
        p = builder.gep(_data(context, builder, sig, args, 0), [args[1]])
        xp = _data(context, builder, sig, args, 2)
        xo = args[3]
        if AVX512:
            va = _iq2_dot512(builder, _iq2_decode512(builder, p), xp, xo)
            vb = _iq2_dot512(builder, _iq2_decode512(builder, builder.gep(p, [_const(I64, 66)])), xp,
                             builder.add(xo, _const(xo.type, 256)))
            sums = _hsum2(builder, va, vb)
        elif AVX2:
            sums = [_hsum(builder, _iq2_dot256(builder, _iq2_decode256(builder, builder.gep(p, [_const(I64, 66 * i)])),
                                               xp, builder.add(xo, _const(xo.type, 256 * i)))) for i in range(2)]
        else:
            grid, signs = _data(context, builder, sig, args, 4), _data(context, builder, sig, args, 5)
            b32 = ir.VectorType(I8, 32)
            sums = []
            for blk in range(2):
                acc = None
                for g in range(8):
                    gv, m, ls = _iq2_gather(builder, builder.gep(p, [_const(I64, 66 * blk + 8 * g)]), grid, signs)
                    x = _vload(builder, xp, builder.add(xo, _const(xo.type, 256 * blk + 32 * g)), b32)
                    v = _iq2_signed_dot(builder, gv, m, x, ls)
                    acc = v if acc is None else builder.add(acc, v)
                sums.append(_hsum(builder, acc))
        return context.make_tuple(builder, sig.return_type, list(sums))
    return types.UniTuple(types.int32, 2)(raw, off, xq, xo, grid8, sign8), codegen


@intrinsic
def iq2_block_pairs(typingctx, raw, off, d, b, xq, xr, j0, j1, xd, accs, grid8, sign8):
    """One IQ2_XXS block (flat byte `off` of raw: 8 groups of 8 bytes, 4 grid indices then a u32 of 4 x 7
    sign-pattern bits and the group's 4-bit ls; w = grid * sign * (2 ls + 1)) against the pairs j0..j1: for
    each, t = xr[j] and accs[j - j0] += (d * xd[t, b]) * isum, isum = sum_i w_i * xq[t, 256 b + i] exact in
    int32; j0 < j1 (the first pair runs unconditionally). The table lookups (ggml's scheme: grid8 [256] a grid entry's 8 magnitudes as the bytes of one
    uint64, sign8 [128] a sign pattern as +1 / -1 bytes; the signs go onto the activation: psign, as ggml)
    are done once and kept in vector registers for every pair: they are most of the work. The float
    operations are plain fmul / fadd in that order (no contraction, as numba's), so a pair's accumulator gets
    the bits of the scalar loop `acc += (d * xd[t, b]) * F32(isum)`."""
    def codegen(context, builder, sig, args):
        p = builder.gep(_data(context, builder, sig, args, 0), [args[1]])
        dsc, blk = args[2], args[3]
        xq_ary = context.make_array(sig.args[4])(context, builder, args[4])
        xd_ary = context.make_array(sig.args[8])(context, builder, args[8])
        xr_p, accs_p = _data(context, builder, sig, args, 5), _data(context, builder, sig, args, 9)
        grid, signs = _data(context, builder, sig, args, 10), _data(context, builder, sig, args, 11)
        C = builder.extract_value(xq_ary.shape, 1)
        NB = builder.extract_value(xd_ary.shape, 1)
        if AVX512:
            dec = _iq2_decode512(builder, p)
        elif AVX2:
            dec = _iq2_decode256(builder, p)
        else:
            groups = [_iq2_gather(builder, builder.gep(p, [_const(I64, 8 * g)]), grid, signs) for g in range(8)]
        b32 = ir.VectorType(I8, 32)
        j0, j1 = args[6], args[7]

        def pair(j):
            t = builder.load(builder.gep(xr_p, [j]))
            xo = builder.add(builder.mul(t, C), builder.mul(blk, _const(I64, 256)))
            if AVX512:
                acc = _iq2_dot512(builder, dec, xq_ary.data, xo)
            elif AVX2:
                acc = _iq2_dot256(builder, dec, xq_ary.data, xo)
            else:
                acc = None
                for g, (gv, m, ls) in enumerate(groups):
                    x = _vload(builder, xq_ary.data, builder.add(xo, _const(I64, 32 * g)), b32)
                    v = _iq2_signed_dot(builder, gv, m, x, ls)
                    acc = v if acc is None else builder.add(acc, v)
            isum = builder.sitofp(_hsum(builder, acc), ir.FloatType())
            xdv = builder.load(builder.gep(xd_ary.data, [builder.add(builder.mul(t, NB), blk)]))
            ap = builder.gep(accs_p, [builder.sub(j, j0)])
            builder.store(builder.fadd(builder.load(ap), builder.fmul(builder.fmul(dsc, xdv), isum)), ap)

        pair(j0)                  # the first pair straight after the lookups (one basic block: interleaved)
        j1st = builder.add(j0, _const(I64, 1))
        entry = builder.block
        loop = builder.append_basic_block("iq2_pairs")
        done = builder.append_basic_block("iq2_pairs_done")
        builder.cbranch(builder.icmp_signed("<", j1st, j1), loop, done)
        builder.position_at_end(loop)
        j = builder.phi(I64)
        j.add_incoming(j1st, entry)
        pair(j)
        nxt = builder.add(j, _const(I64, 1))
        j.add_incoming(nxt, builder.block)
        builder.cbranch(builder.icmp_signed("<", nxt, j1), loop, done)
        builder.position_at_end(done)
        return context.get_dummy_value()
    return types.none(raw, off, d, b, xq, xr, j0, j1, xd, accs, grid8, sign8), codegen


def _q2k_dot512(builder, p, xp, xo):
    """AVX-512 (VBMI + VNNI) Q2_K block at p: <16 x i32> partial sums of scale * code * x, x in x_perm_q2k's
    order (zmm j: weights 32 j .. 32 j + 31, then 128 + 32 j ..). The scale goes into the weight byte before
    the dot product: code * scale <= 3 * 15 fits an unsigned byte, so a 64-entry table T[4 s + c] = c * scale_s
    (one vpermb by code | 4 sub-block) gives each weight's scaled code and one vpdpbusd a zmm does the rest."""
    b16 = ir.VectorType(I8, 16)
    lo = builder.and_(_vload(builder, p, _const(I64, 0), b16), _splat(b16, 15))
    rep = builder.shuffle_vector(lo, lo, ir.Constant(ir.VectorType(I32, 64), [i // 4 for i in range(64)]))
    c1 = ir.Constant(_B64, [0xFF if i % 4 in (1, 3) else 0 for i in range(64)])
    c2 = ir.Constant(_B64, [0xFF if i % 4 >= 2 else 0 for i in range(64)])
    table = builder.add(builder.and_(rep, c1), builder.and_(builder.add(rep, rep), c2))     # <= 45
    q = _vload(builder, p, _const(I64, 16), _B64)
    acc = ir.Constant(_W16, [0] * 16)
    for j in range(4):
        c = builder.and_(builder.lshr(q, _splat(_B64, 2 * j)) if j else q, _splat(_B64, 3))
        sub = ir.Constant(_B64, [4 * (8 * (i // 32) + 2 * j + (i % 32) // 16) for i in range(64)])
        w = _x86(builder, "llvm.x86.avx512.permvar.qi.512", _B64, table, builder.or_(c, sub))
        x = _vload(builder, xp, builder.add(xo, _const(xo.type, 64 * j)), _B64)
        acc = _x86(builder, "llvm.x86.avx512.vpdpbusd.512", _W16, acc, builder.bitcast(w, _W16),
                   builder.bitcast(x, _W16))
    return acc


def _q2k_sum_vec(builder, p, xp, xo):
    """The Q2_K block at p against x at xp[xo]: the integer partial sums of scale * code * x, one vector."""
    if AVX512:
        return _q2k_dot512(builder, p, xp, xo)
    if NEON:
        return jit_neon.q2k_sum_vec(builder, p, xp, xo)
    b16, b32 = ir.VectorType(I8, 16), ir.VectorType(I8, 32)
    h16 = ir.VectorType(I16, 16)
    sc = builder.zext(builder.and_(_vload(builder, p, _const(I64, 0), b16), _splat(b16, 15)), h16)
    mask16 = ir.VectorType(I32, 16)
    acc = None
    for h in range(2):
        q = _vload(builder, p, _const(I64, 16 + 32 * h), b32)
        for j in range(4):
            c = builder.and_(builder.lshr(q, _splat(b32, 2 * j)), _splat(b32, 3))
            x = _vload(builder, xp, builder.add(xo, _const(xo.type, 128 * h + 32 * j)), b32)
            sub = 8 * h + 2 * j
            s = builder.shuffle_vector(sc, sc, ir.Constant(mask16, [sub] * 8 + [sub + 1] * 8))   # per lane pair
            pr = _dot_u8s8(builder, c, x, s)                                # pairs: 2 * 3 * 127 < 2^15
            acc = pr if acc is None else builder.add(acc, pr)
    return acc


def _q2k_mins_vec(builder, p, bsp, bo):
    """<16 x i32> (scale byte i >> 4) * bsp[bo + i] of the Q2_K block at p."""
    b16, w16 = ir.VectorType(I8, 16), ir.VectorType(I32, 16)
    mn = builder.zext(builder.lshr(_vload(builder, p, _const(I64, 0), b16), _splat(b16, 4)), w16)
    return builder.mul(mn, _vload(builder, bsp, bo, w16))


@intrinsic
def q2k_block(typingctx, raw, off, xq, xo):
    """sum over a Q2_K block (84 bytes at flat byte `off`: 16 scale bytes, 64 code bytes, f16 d, f16 dmin) of
    (scale nibble of the sub-block) * code * xq[xo + i]. Weight 128 h + 32 j + l is bits 2j of code byte
    32 h + l; its sub-block is 8 h + 2 j + (l >= 16)."""
    def codegen(context, builder, sig, args):
        p = builder.gep(_data(context, builder, sig, args, 0), [args[1]])
        return _hsum(builder, _q2k_sum_vec(builder, p, _data(context, builder, sig, args, 2), args[3]))
    return types.int32(raw, off, xq, xo), codegen


@intrinsic
def q2k_mins(typingctx, raw, off, xbs, bo):
    """sum_i (scale byte i >> 4) * xbs[bo + i] over a Q2_K block's 16 sub-blocks (xbs: int32 sums of each 16
    activation codes)."""
    def codegen(context, builder, sig, args):
        p = builder.gep(_data(context, builder, sig, args, 0), [args[1]])
        return _hsum(builder, _q2k_mins_vec(builder, p, _data(context, builder, sig, args, 2), args[3]))
    return types.int32(raw, off, xbs, bo), codegen


@intrinsic
def q2k_block2(typingctx, raw, off, xq, xo, xbs, bo):
    """q2k_block and q2k_mins of two consecutive blocks of a row (flat bytes off, off + 84; x at xo, xo + 256;
    sums at bo, bo + 16) -> (isum_b, mins_b, isum_b+1, mins_b+1); on AVX512 hosts one reduction tree for the
    four."""
    def codegen(context, builder, sig, args):
        p = builder.gep(_data(context, builder, sig, args, 0), [args[1]])
        xp, bsp = _data(context, builder, sig, args, 2), _data(context, builder, sig, args, 4)
        xo, bo = args[3], args[5]
        vs = []
        for i in range(2):
            pb = builder.gep(p, [_const(I64, 84 * i)])
            vs.append(_q2k_sum_vec(builder, pb, xp, builder.add(xo, _const(xo.type, 256 * i))))
            vs.append(_q2k_mins_vec(builder, pb, bsp, builder.add(bo, _const(bo.type, 16 * i))))
        sums = _hsum4(builder, vs) if AVX512 else [_hsum(builder, v) for v in vs]
        return context.make_tuple(builder, sig.return_type, sums)
    return types.UniTuple(types.int32, 4)(raw, off, xq, xo, xbs, bo), codegen


def _dot_s8s8(builder, w, x):
    """<32 x i8> w, x (both signed, |.| <= 127 or w = -128) -> <8 x i32> partial sums of w * x."""
    if NEON:
        return jit_neon.dot_s8s8(builder, w, x)
    if AVX2:
        b32, h16, w8 = ir.VectorType(I8, 32), ir.VectorType(I16, 16), ir.VectorType(I32, 8)
        aw = _x86(builder, "llvm.x86.avx2.psign.b", b32, w, w)            # |w| (as unsigned bytes)
        sx = _x86(builder, "llvm.x86.avx2.psign.b", b32, x, w)            # x * sign(w)
        p = _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", h16, aw, sx)       # pairs: 2 * 128 * 127 < 2^15
        return _x86(builder, "llvm.x86.avx2.pmadd.wd", w8, p, _splat(h16, 1))
    h32 = ir.VectorType(I16, 32)
    v = _madd(builder, builder.sext(w, h32), builder.sext(x, h32))               # <16 x i32>
    lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 8), list(range(8))))
    hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 8), list(range(8, 16))))
    return builder.add(lo, hi)


@intrinsic
def q8_0_row(typingctx, raw, off, xq, xo, xd, do, nb, f16):
    """sum over nb Q8_0 blocks (34 bytes each from flat byte `off` of raw: f16 d, 32 int8 codes) of
    d_w * xd[do + b] * (w . xq[xo + 32 b ...]), the products of each block in 8 float lanes (the integer dot's
    8 partial sums, converted exactly), added lane by lane block after block, the 8 lanes summed at the end
    (fixed order: the same bits for any thread count or batch). f16: the float32 of every f16 bit pattern."""
    def codegen(context, builder, sig, args):
        raw_p, xq_p = _data(context, builder, sig, args, 0), _data(context, builder, sig, args, 2)
        xd_p, f16_p = _data(context, builder, sig, args, 4), _data(context, builder, sig, args, 7)
        off, xo, do, nb = args[1], args[3], args[5], args[6]
        f8 = ir.VectorType(ir.FloatType(), 8)
        b32 = ir.VectorType(I8, 32)
        entry = builder.block
        loop = builder.append_basic_block("q8_0_loop")
        done = builder.append_basic_block("q8_0_done")
        builder.branch(loop)
        builder.position_at_end(loop)
        b = builder.phi(I64)
        acc = builder.phi(f8)
        b.add_incoming(_const(I64, 0), entry)
        acc.add_incoming(ir.Constant(f8, [0.0] * 8), entry)
        p = builder.gep(raw_p, [builder.add(off, builder.mul(b, _const(I64, 34)))])
        bits = builder.load(builder.bitcast(p, I16.as_pointer()), align=1)
        d = builder.load(builder.gep(f16_p, [builder.zext(bits, I64)]))
        scale = builder.fmul(d, builder.load(builder.gep(xd_p, [builder.add(do, b)])))
        w = _vload(builder, p, _const(I64, 2), b32)
        x = _vload(builder, xq_p, builder.add(xo, builder.mul(b, _const(I64, 32))), b32)
        prod = builder.sitofp(_dot_s8s8(builder, w, x), f8)
        sv = builder.insert_element(ir.Constant(f8, None), scale, _const(I32, 0))
        sv = builder.shuffle_vector(sv, sv, ir.Constant(ir.VectorType(I32, 8), [0] * 8))
        nxt_acc = builder.fadd(acc, builder.fmul(prod, sv))
        nxt = builder.add(b, _const(I64, 1))
        b.add_incoming(nxt, builder.block)
        acc.add_incoming(nxt_acc, builder.block)
        builder.cbranch(builder.icmp_signed("<", nxt, nb), loop, done)
        builder.position_at_end(done)
        v, n = nxt_acc, 8
        while n > 1:
            n //= 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, n), list(range(n, 2 * n))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, _const(I32, 0))
    return types.float32(raw, off, xq, xo, xd, do, nb, f16), codegen


@intrinsic
def f16_runs(typingctx, raw, off, x, xo, runs, lanes):
    """lanes[0:64] = sum over `runs` runs of 64 of f16(raw[off + 64 k + i]) * x[xo + 64 k + i], lane i, run after
    run (each product rounded, then added: no fused multiply-add). The conversion is LLVM's fpext of <64 x half>
    (vcvtph2ps with F16C, fcvtl on aarch64): exact, like the f16 table."""
    def codegen(context, builder, sig, args):
        raw_p, x_p = _data(context, builder, sig, args, 0), _data(context, builder, sig, args, 2)
        lanes_p = _data(context, builder, sig, args, 5)
        off, xo, runs = args[1], args[3], args[4]
        f64v, h64v, i64v = ir.VectorType(ir.FloatType(), 64), ir.VectorType(ir.HalfType(), 64), ir.VectorType(I16, 64)
        entry = builder.block
        loop = builder.append_basic_block("f16_loop")
        done = builder.append_basic_block("f16_done")
        zero = ir.Constant(f64v, [0.0] * 64)
        builder.cbranch(builder.icmp_signed(">", runs, _const(I64, 0)), loop, done)
        builder.position_at_end(loop)
        k = builder.phi(I64)
        acc = builder.phi(f64v)
        k.add_incoming(_const(I64, 0), entry)
        acc.add_incoming(zero, entry)
        o = builder.mul(k, _const(I64, 64))
        w = builder.fpext(builder.bitcast(_vload(builder, raw_p, builder.add(off, o), i64v), h64v), f64v)
        xv = builder.load(builder.bitcast(builder.gep(x_p, [builder.add(xo, o)]), f64v.as_pointer()), align=4)
        nxt_acc = builder.fadd(acc, builder.fmul(w, xv))
        nxt = builder.add(k, _const(I64, 1))
        k.add_incoming(nxt, builder.block)
        acc.add_incoming(nxt_acc, builder.block)
        builder.cbranch(builder.icmp_signed("<", nxt, runs), loop, done)
        builder.position_at_end(done)
        res = builder.phi(f64v)
        res.add_incoming(zero, entry)
        res.add_incoming(nxt_acc, loop)
        builder.store(res, builder.bitcast(lanes_p, f64v.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(raw, off, x, xo, runs, lanes), codegen


# ---- the kernels ---------------------------------------------------------------------------------------------
# ds4py.quant.jit_i8_kernels unpacks a block once into a buffer for all T tokens (prefill); for a decode step
# that unpacking is most of the work and stays scalar. These unpack in vector registers per token instead: the
# same integer block sums and the same float sequence per (token, row), so y is the same bits.

# Each kernel is a serial row range (_*_rows: a small matrix is one call on the calling thread; numba's parallel
# launch costs ~0.1 ms of CPU, as much as reading a 1 MB matrix) and a parallel one over `parts` row ranges.
SERIAL = dict(cache=True, nogil=True, boundscheck=False)

# The parallel kernels hand out their rows in CHUNKS_PER_THREAD x threads pieces, each thread taking the next
# piece from a shared counter until none is left (dynamic scheduling): with one equal piece a thread, a thread
# that the OS deschedules (another process, the page-cache writeback, ...) holds the whole step up while the other
# idles. Rows are independent, so the bits are the same for any cut. That piece loop is written once per kernel,
# as `<name>_grab(*the _dec arguments, ctr)`: it takes pieces from the counter ctr until none is left. `<name>_dec`
# runs it on numba's pool (a prange of `parts` copies over one counter); jit._call runs it on the calling thread and
# jit.Crew's helper threads instead (GRAB). Same pieces, same row kernels: the same bits. The x_perm'd kernels'
# grab takes the permuted codes (GRAB_PERM: the argument's index and its permutation, applied once by the caller).
CHUNKS_PER_THREAD = 8


@intrinsic
def _grab(typingctx, ctr):
    """The old value of ctr[0] (an int64 array), incremented atomically: the next piece for this thread."""
    sig = types.int64(ctr)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", ary.data, ir.Constant(ir.IntType(64), 1), "monotonic")

    return sig, codegen


@njit(**SERIAL)
def _pieces(parts, R):
    """The number of row pieces for `parts` threads over R rows."""
    return max(1, min(R, parts * CHUNKS_PER_THREAD))


@njit(**SERIAL)
def x_perm(xq):
    """The activation codes xq [T, C] in the order the IQ2_XXS kernels read them: on the AVX-512 path, per block
    of 256, its 32 runs of 8 (run 4 g + e: grid entry e of group g) as entry-major (zmm e holds entry e of
    every group, so a block's sign masks and scales need no cross-lane moves); on the AVX2 path unit (j, r) =
    entries 2 r, 2 r + 1 of group _AUX_GROUPS[j], then of group _AUX_GROUPS[4 + j] (_iq2_decode256); elsewhere xq
    itself. Integer block
    sums are exact in any order: the same bits."""
    if not AVX2:
        return xq
    T, C = xq.shape
    out = np.empty((T, C), np.int8)
    for t in range(T):
        for b in range(C // 256):
            for g in range(8):
                for e in range(4):
                    for i in range(8):
                        if AVX512:
                            out[t, 256 * b + 64 * e + 8 * g + i] = xq[t, 256 * b + 32 * g + 8 * e + i]
                        else:       # AVX2: unit (j, e // 2), lane L (_iq2_decode256's order)
                            k = _AUX_SLOT[g]
                            u, L = 2 * (k % 4) + e // 2, k // 4
                            out[t, 256 * b + 32 * u + 16 * L + 8 * (e % 2) + i] = xq[t, 256 * b + 32 * g + 8 * e + i]
    return out


@njit(**SERIAL)
def iq2_xxs_rows(raw, xq, xd, y, f16, grid8, sign8, r0, r1):
    """iq2_xxs for a few tokens, rows r0..r1: raw [R, nb, 66], grid8 [256] / sign8 [128] uint64 (iq2_block_pairs)."""
    T = xq.shape[0]
    _iq2_xxs_pairs(raw, x_perm(xq), xd, np.arange(T), 0, T, y, f16, grid8, sign8, r0, r1)


@njit(**SERIAL)
def iq2_xxs_grab(raw, xp, xd, y, f16, grid8, sign8, parts, ctr):
    R, T = raw.shape[0], xp.shape[0]
    n = _pieces(parts, R)
    while True:
        c = _grab(ctr)
        if c >= n:
            break
        _iq2_xxs_pairs(raw, xp, xd, np.arange(T), 0, T, y, f16, grid8, sign8, c * R // n, (c + 1) * R // n)


@njit(**OPTS)
def iq2_xxs_dec(raw, xq, xd, y, f16, grid8, sign8, parts):
    ctr = np.zeros(1, np.int64)
    xp = x_perm(xq)
    for p in prange(parts):
        iq2_xxs_grab(raw, xp, xd, y, f16, grid8, sign8, parts, ctr)


@njit(**SERIAL)
def x_perm_q2k(xq):
    """The activation codes xq [T, C] in the order the Q2_K kernels read them: on the AVX-512 path, per block of
    256, zmm j = weights 32 j .. 32 j + 31 then 128 + 32 j .. 128 + 32 j + 31 (the weights of code bits 2 j of
    the block's 64 code bytes); elsewhere xq itself. Exact integer sums: the same bits."""
    if not AVX512:
        return xq
    T, C = xq.shape
    out = np.empty((T, C), np.int8)
    for t in range(T):
        for b in range(C // 256):
            for j in range(4):
                for h in range(2):
                    for i in range(32):
                        out[t, 256 * b + 64 * j + 32 * h + i] = xq[t, 256 * b + 128 * h + 32 * j + i]
    return out


@njit(**SERIAL)
def q2_k_rows(raw, xq, xd, xbs, y, f16, r0, r1):
    """q2_k for a few tokens, rows r0..r1: raw [R, nb, 84] (q2k_block / q2k_mins)."""
    T = xq.shape[0]
    _q2_k_pairs(raw, x_perm_q2k(xq), xd, xbs, np.arange(T), 0, T, y, f16, r0, r1)


@njit(**SERIAL)
def q2_k_grab(raw, xp, xd, xbs, y, f16, parts, ctr):
    R, T = raw.shape[0], xp.shape[0]
    n = _pieces(parts, R)
    while True:
        c = _grab(ctr)
        if c >= n:
            break
        _q2_k_pairs(raw, xp, xd, xbs, np.arange(T), 0, T, y, f16, c * R // n, (c + 1) * R // n)


@njit(**OPTS)
def q2_k_dec(raw, xq, xd, xbs, y, f16, parts):
    ctr = np.zeros(1, np.int64)
    xp = x_perm_q2k(xq)
    for p in prange(parts):
        q2_k_grab(raw, xp, xd, xbs, y, f16, parts, ctr)


@njit(**SERIAL)
def q8_0_rows(raw, xq, xd, y, f16, r0, r1):
    """Q8_0 for a few tokens, rows r0..r1: raw [R, nb, 34], xq [T, C] int8, xd [T, nb] (q8_0_row, nb >= 1)."""
    T = xq.shape[0]
    _q8_0_pairs(raw, xq, xd, np.arange(T), 0, T, y, f16, r0, r1)


@njit(**SERIAL)
def q8_0_grab(raw, xq, xd, y, f16, parts, ctr):
    R = raw.shape[0]
    n = _pieces(parts, R)
    while True:
        c = _grab(ctr)
        if c >= n:
            break
        q8_0_rows(raw, xq, xd, y, f16, c * R // n, (c + 1) * R // n)


@njit(**OPTS)
def q8_0_dec(raw, xq, xd, y, f16, parts):
    ctr = np.zeros(1, np.int64)
    for p in prange(parts):
        q8_0_grab(raw, xq, xd, y, f16, parts, ctr)


@njit(**SERIAL)
def f16_rows(raw, x, y, f16, r0, r1):
    """F16 rows r0..r1 of any length C: raw uint16 [R, C], x float32 [T, C]. jit_kernels.f16_rows' lanes (weight
    i to lane i % 64, the tail of C % 64 into lanes 0..) with the whole 64-wide runs in vector IR and no fastmath:
    one fixed order per row (bit-stable for any thread count and batch); jit_kernels.f16_rows, built with
    fastmath, may contract and reorder, so the two agree to float rounding, not bit for bit."""
    C, T = raw.shape[1], x.shape[0]
    whole = C - C % 64
    acc = np.empty(64, F32)
    for r in range(r0, r1):
        for t in range(T):
            f16_runs(raw, r * C, x, t * C, whole // 64, acc)
            for i in range(C - whole):
                acc[i] += f16[raw[r, whole + i]] * x[t, whole + i]
            y[t, r] = acc.sum()


@njit(**SERIAL)
def f16_grab(raw, x, y, f16, parts, ctr):
    R = raw.shape[0]
    n = _pieces(parts, R)
    while True:
        c = _grab(ctr)
        if c >= n:
            break
        f16_rows(raw, x, y, f16, c * R // n, (c + 1) * R // n)


@njit(**OPTS)
def f16_dec(raw, x, y, f16, parts):
    ctr = np.zeros(1, np.int64)
    for p in prange(parts):
        f16_grab(raw, x, y, f16, parts, ctr)


# ---- a layer's routed experts in one call (jit_i8.experts_matmul: the MoE of a decode step) -------------------
# One task per (matrix, group, row) of a flattened space: matrix 0 = wa -> ya, 1 = wb -> yb (gate and up, one
# quantised x; wb is wa for one matrix); wa / wb [X, R, nb, block bytes] stacked experts; group g is expert ex[g]
# with the pairs gs[g]..gs[g+1], pair j reading activation row xr[j] into y[j, r]. Each (pair, row) is the float
# sequence of the one-expert kernel above (*_rows on raw = w[e], x = its rows), so y is the same bits; the
# parallel form runs the task ranges bounds[c]..bounds[c + 1] on `parts` threads, each taking the next range from a
# shared counter (one launch for the layer's routed experts, not one each; jit_i8.experts_matmul cuts
# CHUNKS_PER_THREAD ranges a thread by work, pairs x rows, for a prefill's unevenly loaded experts).

@njit(**SERIAL)
def _ex_segments(k0, k1, R, GR):
    """The tasks k0..k1 as (matrix, group, first row, end row) runs within one (matrix, group)."""
    out = []
    k = k0
    while k < k1:
        m, gr = k // GR, k % GR
        g, r = gr // R, gr % R
        r1 = min(R, r + (k1 - k))
        out.append((m, g, r, r1))
        k += r1 - r
    return out


@njit(**SERIAL)
def _iq2_xxs_pairs(w, xq, xd, xr, j0, j1, y, f16, grid8, sign8, r0, r1):
    """IQ2_XXS rows r0..r1 of one matrix w [R, nb, 66] times the pairs j0..j1 (activation row xr[j] -> y[j, r]):
    a block's table lookups once for all its pairs (iq2_block_pairs; one pair: iq2_block), each (pair, row) the
    float sequence acc += (d_w / 8 * d_x) * isum, blocks in order."""
    nb, C = w.shape[1], xq.shape[1]
    if j1 - j0 == 1:                    # one token (decode): measured faster with the sum in a register
        t = xr[j0]
        for r in range(r0, r1):
            acc = F32(0)
            for b in range(0, nb - 1, 2):           # two blocks a call: one reduction tree for both sums
                s0, s1 = iq2_block2(w, (r * nb + b) * 66 + 2, xq, t * C + 256 * b, grid8, sign8)
                d = f16[np.int32(w[r, b, 0]) | (np.int32(w[r, b, 1]) << 8)] * F32(0.125)
                acc += (d * xd[t, b]) * F32(s0)
                d = f16[np.int32(w[r, b + 1, 0]) | (np.int32(w[r, b + 1, 1]) << 8)] * F32(0.125)
                acc += (d * xd[t, b + 1]) * F32(s1)
            if nb % 2:
                b = nb - 1
                d = f16[np.int32(w[r, b, 0]) | (np.int32(w[r, b, 1]) << 8)] * F32(0.125)
                isum = iq2_block(w, (r * nb + b) * 66 + 2, xq, t * C + 256 * b, grid8, sign8)
                acc += (d * xd[t, b]) * F32(isum)
            y[j0, r] = acc
        return
    accs = np.empty(max(0, j1 - j0), F32)
    for r in range(r0, r1):
        accs[:] = F32(0)
        for b in range(nb):
            d = f16[np.int32(w[r, b, 0]) | (np.int32(w[r, b, 1]) << 8)] * F32(0.125)
            iq2_block_pairs(w, (r * nb + b) * 66 + 2, d, b, xq, xr, j0, j1, xd, accs, grid8, sign8)
        for j in range(j0, j1):
            y[j, r] = accs[j - j0]


@njit(**SERIAL)
def iq2_xxs_ex_rows(wa, wb, ex, gs, xr, xq, xd, ya, yb, f16, grid8, sign8, k0, k1):
    _iq2_xxs_ex(wa, wb, ex, gs, xr, x_perm(xq), xd, ya, yb, f16, grid8, sign8, k0, k1)


@njit(**SERIAL)
def _iq2_xxs_ex(wa, wb, ex, gs, xr, xq, xd, ya, yb, f16, grid8, sign8, k0, k1):
    """iq2_xxs_ex_rows on x_perm's codes."""
    R = wa.shape[1]
    for m, g, r0, r1 in _ex_segments(k0, k1, R, (gs.shape[0] - 1) * R):
        if m == 0:
            _iq2_xxs_pairs(wa[ex[g]], xq, xd, xr, gs[g], gs[g + 1], ya, f16, grid8, sign8, r0, r1)
        else:
            _iq2_xxs_pairs(wb[ex[g]], xq, xd, xr, gs[g], gs[g + 1], yb, f16, grid8, sign8, r0, r1)


@njit(**SERIAL)
def iq2_xxs_ex_grab(wa, wb, ex, gs, xr, xp, xd, ya, yb, f16, grid8, sign8, bounds, parts, ctr):
    n = bounds.shape[0] - 1
    while True:
        c = _grab(ctr)
        if c >= n:
            break
        _iq2_xxs_ex(wa, wb, ex, gs, xr, xp, xd, ya, yb, f16, grid8, sign8, bounds[c], bounds[c + 1])


@njit(**OPTS)
def iq2_xxs_ex_dec(wa, wb, ex, gs, xr, xq, xd, ya, yb, f16, grid8, sign8, bounds, parts):
    ctr = np.zeros(1, np.int64)
    xp = x_perm(xq)
    for p in prange(min(bounds.shape[0] - 1, parts)):
        iq2_xxs_ex_grab(wa, wb, ex, gs, xr, xp, xd, ya, yb, f16, grid8, sign8, bounds, parts, ctr)


@njit(**SERIAL)
def _q2_k_pairs(w, xq, xd, xbs, xr, j0, j1, y, f16, r0, r1):
    """q2_k_rows' loop for one expert's rows w [R, nb, 84], pairs j0..j1 (activation row xr[j] -> y[j])."""
    nb, C = w.shape[1], xq.shape[1]
    for r in range(r0, r1):
        for j in range(j0, j1):
            t = xr[j]
            acc = F32(0)
            for b in range(0, nb - 1, 2):          # two blocks a call (one reduction tree), then as below
                i0, m0, i1, m1 = q2k_block2(w, (r * nb + b) * 84, xq, t * C + 256 * b, xbs, t * (C // 16) + 16 * b)
                d = f16[np.int32(w[r, b, 80]) | (np.int32(w[r, b, 81]) << 8)]
                dm = f16[np.int32(w[r, b, 82]) | (np.int32(w[r, b, 83]) << 8)]
                acc += xd[t, b] * (d * F32(i0) - dm * F32(m0))
                d = f16[np.int32(w[r, b + 1, 80]) | (np.int32(w[r, b + 1, 81]) << 8)]
                dm = f16[np.int32(w[r, b + 1, 82]) | (np.int32(w[r, b + 1, 83]) << 8)]
                acc += xd[t, b + 1] * (d * F32(i1) - dm * F32(m1))
            for b in range(nb - nb % 2, nb):
                d = f16[np.int32(w[r, b, 80]) | (np.int32(w[r, b, 81]) << 8)]
                dm = f16[np.int32(w[r, b, 82]) | (np.int32(w[r, b, 83]) << 8)]
                o = (r * nb + b) * 84
                isum = q2k_block(w, o, xq, t * C + 256 * b)
                mn = q2k_mins(w, o, xbs, t * (C // 16) + 16 * b)
                acc += xd[t, b] * (d * F32(isum) - dm * F32(mn))
            y[j, r] = acc


@njit(**SERIAL)
def q2_k_ex_rows(wa, wb, ex, gs, xr, xq, xd, xbs, ya, yb, f16, k0, k1):
    _q2_k_ex(wa, wb, ex, gs, xr, x_perm_q2k(xq), xd, xbs, ya, yb, f16, k0, k1)


@njit(**SERIAL)
def _q2_k_ex(wa, wb, ex, gs, xr, xq, xd, xbs, ya, yb, f16, k0, k1):
    """q2_k_ex_rows on x_perm_q2k's codes."""
    R = wa.shape[1]
    for m, g, r0, r1 in _ex_segments(k0, k1, R, (gs.shape[0] - 1) * R):
        if m == 0:
            _q2_k_pairs(wa[ex[g]], xq, xd, xbs, xr, gs[g], gs[g + 1], ya, f16, r0, r1)
        else:
            _q2_k_pairs(wb[ex[g]], xq, xd, xbs, xr, gs[g], gs[g + 1], yb, f16, r0, r1)


@njit(**SERIAL)
def q2_k_ex_grab(wa, wb, ex, gs, xr, xp, xd, xbs, ya, yb, f16, bounds, parts, ctr):
    n = bounds.shape[0] - 1
    while True:
        c = _grab(ctr)
        if c >= n:
            break
        _q2_k_ex(wa, wb, ex, gs, xr, xp, xd, xbs, ya, yb, f16, bounds[c], bounds[c + 1])


@njit(**OPTS)
def q2_k_ex_dec(wa, wb, ex, gs, xr, xq, xd, xbs, ya, yb, f16, bounds, parts):
    ctr = np.zeros(1, np.int64)
    xp = x_perm_q2k(xq)
    for p in prange(min(bounds.shape[0] - 1, parts)):
        q2_k_ex_grab(wa, wb, ex, gs, xr, xp, xd, xbs, ya, yb, f16, bounds, parts, ctr)


@njit(**SERIAL)
def _q8_0_pairs(w, xq, xd, xr, j0, j1, y, f16, r0, r1):
    """q8_0_rows' loop for one expert's rows w [R, nb, 34], pairs j0..j1 (activation row xr[j] -> y[j])."""
    nb, C = w.shape[1], xq.shape[1]
    for r in range(r0, r1):
        for j in range(j0, j1):
            t = xr[j]
            y[j, r] = q8_0_row(w, r * nb * 34, xq, t * C, xd, t * nb, nb, f16)


@njit(**SERIAL)
def q8_0_ex_rows(wa, wb, ex, gs, xr, xq, xd, ya, yb, f16, k0, k1):
    R = wa.shape[1]
    for m, g, r0, r1 in _ex_segments(k0, k1, R, (gs.shape[0] - 1) * R):
        if m == 0:
            _q8_0_pairs(wa[ex[g]], xq, xd, xr, gs[g], gs[g + 1], ya, f16, r0, r1)
        else:
            _q8_0_pairs(wb[ex[g]], xq, xd, xr, gs[g], gs[g + 1], yb, f16, r0, r1)


@njit(**SERIAL)
def q8_0_ex_grab(wa, wb, ex, gs, xr, xq, xd, ya, yb, f16, bounds, parts, ctr):
    n = bounds.shape[0] - 1
    while True:
        c = _grab(ctr)
        if c >= n:
            break
        q8_0_ex_rows(wa, wb, ex, gs, xr, xq, xd, ya, yb, f16, bounds[c], bounds[c + 1])


@njit(**OPTS)
def q8_0_ex_dec(wa, wb, ex, gs, xr, xq, xd, ya, yb, f16, bounds, parts):
    ctr = np.zeros(1, np.int64)
    for p in prange(min(bounds.shape[0] - 1, parts)):
        q8_0_ex_grab(wa, wb, ex, gs, xr, xq, xd, ya, yb, f16, bounds, parts, ctr)


# ---- the activation quantisers (ds4py.quant.jit_i8.quant_q8_0 / quant_q8_k: numpy's operations, one pass) ------

@njit(**SERIAL)
def quant_q8_k_rows(x, q, d, bsums):
    """x [T, C] float32 -> Q8_K codes q [T, C], d [T, C/256], bsums [T, C/16], as jit_i8's numpy quantiser
    computes them (the first value of largest magnitude, float32 -127/max, rint, clipped at 127). False, with
    the outputs unfinished, where x holds a non-finite value: the caller then takes numpy's."""
    T, C = x.shape
    for t in range(T):
        for b in range(C // 256):
            o = 256 * b
            amax, mx = F32(-1), F32(0)
            for i in range(256):
                v = x[t, o + i]
                if not np.isfinite(v):
                    return False
                if abs(v) > amax:
                    amax, mx = abs(v), v
            iscale = F32(-127) / mx if mx != 0 else F32(0)
            d[t, b] = F32(1) / iscale if iscale != 0 else F32(0)
            for g in range(16):
                s = I32N(0)
                for i in range(16):
                    v = np.rint(x[t, o + 16 * g + i] * iscale)
                    c = np.int8(min(v, F32(127)))
                    q[t, o + 16 * g + i] = c
                    s += I32N(c)
                bsums[t, 16 * b + g] = s
    return True


@njit(**SERIAL)
def quant_q8_0_rows(x, q, d):
    """x [T, C] float32 -> Q8_0 codes q [T, C] and the unrounded d = max|x| / 127 [T, C/32] (the caller rounds
    d to f16), as jit_i8's numpy quantiser. False where x holds a non-finite value (then numpy's)."""
    T, C = x.shape
    for t in range(T):
        for b in range(C // 32):
            o = 32 * b
            amax = F32(0)
            for i in range(32):
                v = x[t, o + i]
                if not np.isfinite(v):
                    return False
                amax = max(amax, abs(v))
            dd = amax / F32(127)
            d[t, b] = dd
            div = dd if dd > 0 else F32(1)
            for i in range(32):
                q[t, o + i] = np.int8(np.rint(x[t, o + i] / div))
    return True


# ---- several matrices that read one activation, in one call (jit_i8.matmul_many) -----------------------------
# A decode step's projections of one x (attention: q_a, kv, the compressors' and the indexer's; FFN: the router
# and the shared expert's gate and up) each paid a parallel launch (~0.05-0.1 ms of CPU on the calling thread,
# plus the workers' wake-ups) and, for Q8_0, a quantisation of x. Here they are one launch: Q8_0 matrices
# q0..q3 (x quantised once: xq, xd; the first nq used) then F16 matrices h0..h5 (the fp32 x; the first nh used),
# their rows laid end to end, cut into pieces of about equal weight bytes that the threads take from a shared
# counter. Each row is q8_0_rows' / f16_rows' own float sequence, so every y is the bits of the one-matrix
# kernels. The matrices come as separate arguments, the unused ones empty: numba types a tuple argument in
# Python (~30 us a call, measured), an array in C; the kernels make the tuples inside. One compiled variant
# serves every layer.
MANY_Q8, MANY_F16 = 4, 6


@njit(**SERIAL)
def _many_row_at(b, rows, rbytes):
    """The first row (of all the matrices' rows, end to end) that starts at or after byte b of their weights."""
    g = 0
    for m in range(rows.shape[0]):
        nb = rows[m] * rbytes[m]
        if b < nb:
            return g + (b + rbytes[m] - 1) // rbytes[m]
        b -= nb
        g += rows[m]
    return g


@njit(**SERIAL)
def _many_pieces(rows, rbytes, parts):
    """(weight bytes of all the matrices, the number of pieces for `parts` threads)."""
    total = 0
    for m in range(rows.shape[0]):
        total += rows[m] * rbytes[m]
    return total, max(1, min(parts * CHUNKS_PER_THREAD, total // 4096))


@njit(**SERIAL)
def _q8_0_many_piece(qs, ys, xq, xd, f16, nq, rows, g0, g1):
    s = 0
    for m in range(nq):
        a, b = max(g0 - s, 0), min(g1 - s, rows[m])
        if a < b:
            q8_0_rows(qs[m], xq, xd, ys[m], f16, a, b)
        s += rows[m]


@njit(**SERIAL)
def q8_0_many_rows(q0, q1, q2, q3, y0, y1, y2, y3, xq, xd, f16, nq, rows, g0, g1):
    """Rows g0..g1 (end to end over the Q8_0 matrices q0..q3, the first nq) of x @ W.T: q8_0_rows on each."""
    _q8_0_many_piece((q0, q1, q2, q3), (y0, y1, y2, y3), xq, xd, f16, nq, rows, g0, g1)


@njit(**SERIAL)
def q8_0_many_grab(q0, q1, q2, q3, y0, y1, y2, y3, xq, xd, f16, nq, rows, rbytes, parts, ctr):
    qs, ys = (q0, q1, q2, q3), (y0, y1, y2, y3)
    total, n = _many_pieces(rows, rbytes, parts)
    while True:
        c = _grab(ctr)
        if c >= n:
            break
        _q8_0_many_piece(qs, ys, xq, xd, f16, nq, rows, _many_row_at(c * total // n, rows, rbytes),
                         _many_row_at((c + 1) * total // n, rows, rbytes))


@njit(**OPTS)
def q8_0_many_dec(q0, q1, q2, q3, y0, y1, y2, y3, xq, xd, f16, nq, rows, rbytes, parts):
    ctr = np.zeros(1, np.int64)
    for p in prange(parts):
        q8_0_many_grab(q0, q1, q2, q3, y0, y1, y2, y3, xq, xd, f16, nq, rows, rbytes, parts, ctr)


@njit(**SERIAL)
def _mixed_many_piece(qs, yq, xq, xd, hs, yh, x, f16, nq, nh, rows, g0, g1):
    s = 0
    for m in range(nq + nh):
        a, b = max(g0 - s, 0), min(g1 - s, rows[m])
        if a < b:
            if m < nq:
                q8_0_rows(qs[m], xq, xd, yq[m], f16, a, b)
            else:
                f16_rows(hs[m - nq], x, yh[m - nq], f16, a, b)
        s += rows[m]


@njit(**SERIAL)
def mixed_many_rows(q0, q1, q2, q3, y0, y1, y2, y3, xq, xd, h0, h1, h2, h3, h4, h5, z0, z1, z2, z3, z4, z5, x,
                    f16, nq, nh, rows, g0, g1):
    """Rows g0..g1 over the Q8_0 matrices q0..q3 (the first nq; products y0..) then the F16 matrices h0..h5 (the
    first nh; products z0..), end to end: q8_0_rows / f16_rows on each."""
    _mixed_many_piece((q0, q1, q2, q3), (y0, y1, y2, y3), xq, xd, (h0, h1, h2, h3, h4, h5),
                      (z0, z1, z2, z3, z4, z5), x, f16, nq, nh, rows, g0, g1)


@njit(**SERIAL)
def mixed_many_grab(q0, q1, q2, q3, y0, y1, y2, y3, xq, xd, h0, h1, h2, h3, h4, h5, z0, z1, z2, z3, z4, z5, x,
                    f16, nq, nh, rows, rbytes, parts, ctr):
    qs, yq = (q0, q1, q2, q3), (y0, y1, y2, y3)
    hs, yh = (h0, h1, h2, h3, h4, h5), (z0, z1, z2, z3, z4, z5)
    total, n = _many_pieces(rows, rbytes, parts)
    while True:
        c = _grab(ctr)
        if c >= n:
            break
        _mixed_many_piece(qs, yq, xq, xd, hs, yh, x, f16, nq, nh, rows, _many_row_at(c * total // n, rows, rbytes),
                          _many_row_at((c + 1) * total // n, rows, rbytes))


@njit(**OPTS)
def mixed_many_dec(q0, q1, q2, q3, y0, y1, y2, y3, xq, xd, h0, h1, h2, h3, h4, h5, z0, z1, z2, z3, z4, z5, x,
                   f16, nq, nh, rows, rbytes, parts):
    ctr = np.zeros(1, np.int64)
    for p in prange(parts):
        mixed_many_grab(q0, q1, q2, q3, y0, y1, y2, y3, xq, xd, h0, h1, h2, h3, h4, h5, z0, z1, z2, z3, z4, z5,
                        x, f16, nq, nh, rows, rbytes, parts, ctr)


# ---- the shared expert's down projection with the routed experts' gate and up, in one call --------------------
# (jit_i8.experts_matmul's `plain`): pieces 0..n8 are row ranges of one Q8_0 matrix q8 times its own activation
# (xq8, xd8; q8_0_rows), the rest iq2_xxs_ex_rows' task ranges bounds[c - n8]..bounds[c - n8 + 1]: both products'
# bits, one launch instead of two.
@njit(**SERIAL)
def q8_0_iq2_xxs_ex_grab(q8, xq8, xd8, y8, n8, wa, wb, ex, gs, xr, xp, xd, ya, yb, f16, grid8, sign8, bounds, parts,
                         ctr):
    R = q8.shape[0]
    n = n8 + bounds.shape[0] - 1
    while True:
        c = _grab(ctr)
        if c >= n:
            break
        if c < n8:
            q8_0_rows(q8, xq8, xd8, y8, f16, c * R // n8, (c + 1) * R // n8)
        else:
            _iq2_xxs_ex(wa, wb, ex, gs, xr, xp, xd, ya, yb, f16, grid8, sign8, bounds[c - n8], bounds[c - n8 + 1])


@njit(**OPTS)
def q8_0_iq2_xxs_ex_dec(q8, xq8, xd8, y8, n8, wa, wb, ex, gs, xr, xq, xd, ya, yb, f16, grid8, sign8, bounds, parts):
    ctr = np.zeros(1, np.int64)
    xp = x_perm(xq)
    for p in prange(parts):
        q8_0_iq2_xxs_ex_grab(q8, xq8, xd8, y8, n8, wa, wb, ex, gs, xr, xp, xd, ya, yb, f16, grid8, sign8,
                             bounds, parts, ctr)


# each pooled `<name>_dec` -> its piece loop, and the x argument its caller permutes first (jit._grab_args)
GRAB = {"q8_0_dec": q8_0_grab, "f16_dec": f16_grab, "iq2_xxs_dec": iq2_xxs_grab, "q2_k_dec": q2_k_grab,
        "iq2_xxs_ex_dec": iq2_xxs_ex_grab, "q2_k_ex_dec": q2_k_ex_grab, "q8_0_ex_dec": q8_0_ex_grab,
        "q8_0_many_dec": q8_0_many_grab, "mixed_many_dec": mixed_many_grab,
        "q8_0_iq2_xxs_ex_dec": q8_0_iq2_xxs_ex_grab}
GRAB_PERM = {"iq2_xxs_dec": (1, x_perm), "q2_k_dec": (1, x_perm_q2k), "iq2_xxs_ex_dec": (5, x_perm),
             "q2_k_ex_dec": (5, x_perm_q2k), "q8_0_iq2_xxs_ex_dec": (10, x_perm)}
