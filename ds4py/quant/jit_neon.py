"""The aarch64 NEON paths of the decode kernels (ds4py.quant.jit_decode): their byte products on `sdot`.

jit_decode's kernels write their inner loops in explicit vector IR; on x86 the byte multiply-adds call AVX2 /
AVX-512 instructions by name, elsewhere they stay LLVM's portable vector IR, which LLVM lowers on aarch64 to
widening (sshll) and 16-bit multiplies (umull, mla; smull for Q8_0): 8 byte products an instruction at best,
IQ2_XXS 573 and Q2_K 395 instructions a block (llvmlite, generic +neon). Where numba compiles for aarch64
with the dot-product extension (ARMv8.2 `dotprod`: Neoverse N1 / V1 / V2 (Graviton 2+, Grace), Cortex-A76 and
later (DGX Spark's GB10: Cortex-X925 / A725), Apple M1 and later; `ENABLED`), these builders replace them with
`sdot` (llvm.aarch64.neon.sdot: 16 signed byte products summed by 4 into 4 int32 lanes, one instruction):
IQ2_XXS 263, Q2_K 105 instructions a block.

Same bits as the portable path: the integer sums are exact (any grouping gives the same int32), so IQ2_XXS and
Q2_K, whose float epilogue takes one int32 a block, are unchanged; Q8_0's q8_0_row converts 8 partial sums a
block to float lane by lane, so `dot_s8s8` keeps the portable path's 8 lanes (lane i: bytes 2i, 2i+1, 2i+16,
2i+17), the bytes put in that order (one zip a half) before the sdot.

Each builder takes an llvmlite IRBuilder and values (no numba context), so tests/test_jit_neon.py compiles the
very IR they emit for aarch64-unknown-linux-gnu (+neon,+dotprod) on any host and checks the sdot instructions in
its assembly; bench/README.md says how the kernels were run on aarch64 (qemu-aarch64).
numba's disk cache keys a compiled kernel on its own source file (jit_decode.py) only; the default cache folder
(ds4py.quant.jit.cache_dir()) is keyed on this file too (jit.source_tag), so an edit here compiles afresh. With
$NUMBA_CACHE_DIR set, clear it after editing this file.
"""

from __future__ import annotations

import platform

from llvmlite import ir

from ds4py.quant.isa import target_features

I8, I32 = ir.IntType(8), ir.IntType(32)
B16, B32, W4, W8 = ir.VectorType(I8, 16), ir.VectorType(I8, 32), ir.VectorType(I32, 4), ir.VectorType(I32, 8)
SDOT = "llvm.aarch64.neon.sdot.v4i32.v16i8"


def enabled(machine: str | None = None, features: dict | None = None) -> bool:
    """Whether numba compiles for aarch64 with the dot-product extension: this host (or `machine`), with the
    features LLVM compiles for (isa.target_features, or `features`)."""
    machine = (machine or platform.machine()).lower()
    feats = target_features() if features is None else features
    return machine in ("aarch64", "arm64") and bool(feats.get("dotprod"))


ENABLED = enabled()


def _mask(idx):
    return ir.Constant(ir.VectorType(I32, len(idx)), list(idx))


def _splat(ty: ir.VectorType, v):
    return ir.Constant(ty, [v] * ty.count)


def sdot(builder: ir.IRBuilder, acc, a, b):
    """acc <4 x i32> + (sum of a[4i + k] * b[4i + k], k < 4) lane i, for <16 x i8> a, b (signed): one sdot."""
    fn = builder.module.globals.get(SDOT)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(W4, [W4, B16, B16]), name=SDOT)
    return builder.call(fn, [acc, a, b])


def _halves(builder, v32):
    return (builder.shuffle_vector(v32, v32, _mask(range(16))), builder.shuffle_vector(v32, v32, _mask(range(16, 32))))


def _dot32(builder, acc, w, x):
    """acc <4 x i32> plus the products of two <32 x i8> (signed): two sdot, lane i: bytes 4i.. and 16 + 4i.."""
    (wl, wh), (xl, xh) = _halves(builder, w), _halves(builder, x)
    return sdot(builder, sdot(builder, acc, wl, xl), wh, xh)


def iq2_signed_dot(builder, gv, m, x, ls):
    """One IQ2_XXS group: <32 x i8> grid magnitudes gv (<= 43), sign bytes m (+1 / -1), activation x, i16
    2 ls + 1 -> <4 x i32> partial sums of gv * m * x * ls. The signs go onto the weights (|gv m| <= 43: a byte
    multiply), two sdot, then the group's scale on the 4 sums."""
    s = _dot32(builder, ir.Constant(W4, [0] * 4), builder.mul(gv, m), x)
    return builder.mul(s, builder.shuffle_vector(builder.insert_element(ir.Constant(W4, None), builder.sext(ls, I32),
                                                                        ir.Constant(I32, 0)),
                                                 ir.Constant(W4, None), _mask([0] * 4)))


def _vload(builder, base, offset, ty):
    return builder.load(builder.bitcast(builder.gep(base, [offset]), ty.as_pointer()), align=1)


def q2k_sum_vec(builder, p, xp, xo):
    """The Q2_K block at p (16 scale bytes, 64 code bytes) against 256 activation bytes at xp[xo] -> <4 x i32>
    partial sums of scale * code * x. The sub-block scale goes into the weight byte first (code * scale <= 3 * 15),
    then 16 sdot, in two chains (the second half's while the first's latency runs)."""
    i64 = xo.type
    sc = builder.and_(_vload(builder, p, ir.Constant(ir.IntType(64), 0), B16), _splat(B16, 15))
    accs = [ir.Constant(W4, [0] * 4)] * 2
    for h in range(2):
        q = _vload(builder, p, ir.Constant(ir.IntType(64), 16 + 32 * h), B32)
        for j in range(4):
            c = builder.and_(builder.lshr(q, _splat(B32, 2 * j)) if j else q, _splat(B32, 3))
            sub = 8 * h + 2 * j                                     # bytes 0..15: sub-block sub, 16..31: sub + 1
            s = builder.shuffle_vector(sc, sc, _mask([sub] * 16 + [sub + 1] * 16))
            x = _vload(builder, xp, builder.add(xo, ir.Constant(i64, 128 * h + 32 * j)), B32)
            accs[h] = _dot32(builder, accs[h], builder.mul(c, s), x)
    return builder.add(accs[0], accs[1])


# q8_0_row's lane i: bytes 2i, 2i + 1, 2i + 16, 2i + 17 (the portable _madd pairs of the two halves added)
_Q8_ORDER = [b for i in range(8) for b in (2 * i, 2 * i + 1, 2 * i + 16, 2 * i + 17)]


def dot_s8s8(builder, w, x):
    """<32 x i8> w, x (signed) -> <8 x i32>, lane i the sum of the products of bytes 2i, 2i+1, 2i+16, 2i+17 (the
    portable path's lanes, so q8_0_row's float lanes get the same values): both put in that order, two sdot."""
    order = _mask(_Q8_ORDER)
    wp, xp = builder.shuffle_vector(w, w, order), builder.shuffle_vector(x, x, order)
    (wl, wh), (xl, xh) = _halves(builder, wp), _halves(builder, xp)
    zero = ir.Constant(W4, [0] * 4)
    return builder.shuffle_vector(sdot(builder, zero, wl, xl), sdot(builder, zero, wh, xh), _mask(range(8)))
