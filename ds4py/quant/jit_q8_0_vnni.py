"""The dense Q8_0 prefill product in int8 on AVX-512 VNNI hosts (vpdpbusd) and on aarch64 with the dot-product
extension (sdot: ds4py.quant.jit_neon): many tokens times one Q8_0 matrix.

Imported only through ds4py.quant.jit_i8_gemm (`q8_0_matmul`), which takes it where the host has AVX-512 VNNI or
aarch64 sdot (AVAILABLE) and keeps the dequantise-and-BLAS product (jit_i8_gemm.dense_q8_0) elsewhere.

Why: float32 BLAS on the rounded activation ran at ~38 GMAC/s a core here (OpenBLAS sgemm, plus ~10% to
dequantise the tiles); Q8_0's blocks of 32 weights made a per-(row, token) int8 dot product end in a horizontal sum
per block. Here the rows are the vector lanes instead ("outer product" order): a tile of 16 rows is repacked so
one 64-byte register holds 4 consecutive weights of each of the 16 rows, and vpdpbusd adds the 4 products of a
broadcast 4-byte piece of one token's codes into each row's int32 lane; 8 of them make a block's 16 exact integer
sums with no horizontal sum, for 4 tokens at once (the weights loaded once for the 4).
vpdpbusd multiplies unsigned by signed bytes: the activation codes go in as x + 128 (1..255), the weights as
signed bytes, and 128 * (the block's weight sum) is taken off after: the block's sum is exact either way.
On aarch64 (NEON) the tile is four 128-bit registers of 4 rows: sdot multiplies signed by signed bytes, so the
broadcast piece goes in as the codes themselves (xu ^ 0x80) and nothing is taken off; 2 tokens a pass (their
sums and float accumulators, 16 registers, stay within NEON's 32). The same exact block sums, the same bits.

Numerics: the int8-activation mode's (ds4py.quant.jit_i8: x quantised per block of 32 as ops.q8_0_round does,
codes and f16-rounded scales): per (token, row) acc += (d_w * d_x) * isum over the blocks in order, isum the exact
int32 block sum, float32 throughout, no contraction; the same bits for any token count, tile or thread count
(each lane is its own row and each token its own accumulator).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ds4py.quant import jit_neon
from ds4py.quant.isa import target_features

F32 = np.float32
I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)


def _host_vnni() -> bool:
    """Whether numba compiles for a target with AVX-512 F / BW and VNNI (vpdpbusd on 512-bit registers): the host,
    or $NUMBA_CPU_FEATURES (ds4py.quant.isa)."""
    f = target_features()
    return all(f.get(k) for k in ("avx512f", "avx512bw", "avx512vnni"))


VNNI = _host_vnni()
NEON = jit_neon.ENABLED and not VNNI
AVAILABLE = VNNI or NEON
LANES = 16                   # rows per tile: one 512-bit register of int32 sums (NEON: four of 128 bits)
TOKENS = 2 if NEON else 4    # tokens per pass over a tile


def _data(context, builder, ty, val):
    return context.make_array(ty)(context, builder, val)


def _sdot16(builder, acc, w, x):
    """vpdpbusd's shape on NEON: <16 x i32> acc plus, lane l, the 4 signed byte products of dword l of w and x
    (<16 x i32> each): four sdot on 4 lanes each."""
    b64 = ir.VectorType(I8, 64)
    wb, xb = builder.bitcast(w, b64), builder.bitcast(x, b64)
    parts = []
    for k in range(4):
        sel = ir.Constant(ir.VectorType(I32, 16), list(range(16 * k, 16 * k + 16)))
        a4 = builder.shuffle_vector(acc, acc, ir.Constant(ir.VectorType(I32, 4), list(range(4 * k, 4 * k + 4))))
        wk, xk = builder.shuffle_vector(wb, wb, sel), builder.shuffle_vector(xb, xb, sel)
        parts.append(jit_neon.sdot(builder, a4, wk, xk))
    lo = builder.shuffle_vector(parts[0], parts[1], ir.Constant(ir.VectorType(I32, 8), list(range(8))))
    hi = builder.shuffle_vector(parts[2], parts[3], ir.Constant(ir.VectorType(I32, 8), list(range(8))))
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, 16), list(range(16))))


@intrinsic
def q8_0_tile(typingctx, pk, corr, dw, xu, xd, ts, out):
    """out[i, l] = sum over blocks b of (dw[b, l] * xd[ts[i], b]) * isum(b, l, ts[i]), i < TOKENS, l < LANES, for a
    packed tile (q8_0_pack: pk the weights as [nb, 8, LANES, 4] bytes, corr [nb, LANES] int32 = 128 * the block's
    weight sum, dw [nb, LANES] float32) and the tokens ts (int64 [TOKENS]) of xu [T, C] (codes + 128, uint8),
    xd [T, nb] (their block scales)."""
    def codegen(context, builder, sig, args):
        pk_p = _data(context, builder, sig.args[0], args[0]).data
        corr_p = _data(context, builder, sig.args[1], args[1]).data
        dw_p = _data(context, builder, sig.args[2], args[2]).data
        xu_a = _data(context, builder, sig.args[3], args[3])
        xd_a = _data(context, builder, sig.args[4], args[4])
        ts_p = _data(context, builder, sig.args[5], args[5]).data
        out_p = _data(context, builder, sig.args[6], args[6]).data
        C = builder.extract_value(xu_a.shape, 1)
        nb = builder.extract_value(xd_a.shape, 1)
        v16 = ir.VectorType(I32, LANES)
        f16v = ir.VectorType(ir.FloatType(), LANES)
        fn = builder.module.globals.get("llvm.x86.avx512.vpdpbusd.512")
        if fn is None and not NEON:
            fn = ir.Function(builder.module, ir.FunctionType(v16, [v16, v16, v16]), name="llvm.x86.avx512.vpdpbusd.512")
        i32p = I32.as_pointer()
        ts = [builder.load(builder.gep(ts_p, [ir.Constant(I64, i)])) for i in range(TOKENS)]
        xrow = [builder.mul(t, C) for t in ts]
        xdrow = [builder.mul(t, nb) for t in ts]
        zero_f = ir.Constant(f16v, [0.0] * LANES)
        zero_i = ir.Constant(v16, [0] * LANES)
        entry = builder.block
        loop = builder.append_basic_block("q8_0_tile_loop")
        done = builder.append_basic_block("q8_0_tile_done")
        builder.branch(loop)
        builder.position_at_end(loop)
        b = builder.phi(I64)
        b.add_incoming(ir.Constant(I64, 0), entry)
        accs = []
        for i in range(TOKENS):
            a = builder.phi(f16v)
            a.add_incoming(zero_f, entry)
            accs.append(a)
        isums = [zero_i] * TOKENS
        for q in range(8):
            wo = builder.mul(builder.add(builder.mul(b, ir.Constant(I64, 8)), ir.Constant(I64, q)),
                             ir.Constant(I64, 4 * LANES))
            w = builder.load(builder.bitcast(builder.gep(pk_p, [wo]), v16.as_pointer()), align=1)
            for i in range(TOKENS):
                xo = builder.add(xrow[i], builder.add(builder.mul(b, ir.Constant(I64, 32)), ir.Constant(I64, 4 * q)))
                xv = builder.load(builder.bitcast(builder.gep(xu_a.data, [xo]), i32p), align=1)
                xs = builder.shuffle_vector(builder.insert_element(ir.Constant(v16, None), xv, ir.Constant(I32, 0)),
                                            ir.Constant(v16, None), ir.Constant(v16, [0] * LANES))
                if NEON:                            # signed codes: xu ^ 0x80 in each byte (0x80808080)
                    xs = builder.xor(xs, ir.Constant(v16, [-0x7F7F7F80] * LANES))
                    isums[i] = _sdot16(builder, isums[i], w, xs)
                else:
                    isums[i] = builder.call(fn, [isums[i], xs, w])
        lo = builder.mul(b, ir.Constant(I64, LANES))
        cr = builder.load(builder.bitcast(builder.gep(corr_p, [lo]), v16.as_pointer()), align=4)
        dwv = builder.load(builder.bitcast(builder.gep(dw_p, [lo]), f16v.as_pointer()), align=4)
        nxt_accs = []
        for i in range(TOKENS):
            s = builder.sitofp(isums[i] if NEON else builder.sub(isums[i], cr), f16v)
            xdv = builder.load(builder.gep(xd_a.data, [builder.add(xdrow[i], b)]))
            xds = builder.shuffle_vector(builder.insert_element(ir.Constant(f16v, None), xdv, ir.Constant(I32, 0)),
                                         ir.Constant(f16v, None), ir.Constant(v16, [0] * LANES))
            nxt_accs.append(builder.fadd(accs[i], builder.fmul(builder.fmul(dwv, xds), s)))
        nxt = builder.add(b, ir.Constant(I64, 1))
        b.add_incoming(nxt, builder.block)
        for a, n in zip(accs, nxt_accs):
            a.add_incoming(n, builder.block)
        builder.cbranch(builder.icmp_signed("<", nxt, nb), loop, done)
        builder.position_at_end(done)
        for i, a in enumerate(nxt_accs):
            o = builder.gep(out_p, [ir.Constant(I64, i * LANES)])
            builder.store(a, builder.bitcast(o, f16v.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.none(pk, corr, dw, xu, xd, ts, out), codegen


@njit(cache=True, nogil=True, boundscheck=False)
def q8_0_pack(raw, r0, n, pk, corr, dw, f16):
    """Rows r0..r0 + n (n <= LANES; the rest of the tile zero) of raw [R, nb, 34] into pk [nb, 8, LANES, 4]
    (signed bytes as uint8), corr [nb, LANES] (128 * each block's weight sum) and dw [nb, LANES] (the scales)."""
    nb = raw.shape[1]
    for b in range(nb):
        for l in range(LANES):
            if l < n:
                r = r0 + l
                dw[b, l] = f16[np.int32(raw[r, b, 0]) | (np.int32(raw[r, b, 1]) << 8)]
                s = np.int32(0)
                for q in range(8):
                    for k in range(4):
                        c = raw[r, b, 2 + 4 * q + k]
                        pk[b, q, l, k] = c
                        s += np.int32(np.int8(c))
                corr[b, l] = np.int32(128) * s
            else:
                dw[b, l] = F32(0)
                corr[b, l] = np.int32(0)
                for q in range(8):
                    for k in range(4):
                        pk[b, q, l, k] = np.uint8(0)


@njit(parallel=True, cache=True, nogil=True, boundscheck=False)
def q8_0_vnni(raw, xu, xd, y, f16, parts):
    """y [T, R] = the Q8_0 rows raw [R, nb, 34] times the tokens of xu [T, C] (codes + 128) / xd [T, nb]: the rows
    in tiles of LANES, `parts` contiguous ranges of tiles, one per thread."""
    R, nb, T = raw.shape[0], raw.shape[1], xu.shape[0]
    tiles = (R + LANES - 1) // LANES
    for p in prange(parts):
        pk = np.empty((nb, 8, LANES, 4), np.uint8)
        corr = np.empty((nb, LANES), np.int32)
        dw = np.empty((nb, LANES), F32)
        out = np.empty((TOKENS, LANES), F32)
        ts = np.empty(TOKENS, np.int64)
        for tile in range(p * tiles // parts, (p + 1) * tiles // parts):
            r0 = tile * LANES
            n = min(LANES, R - r0)
            q8_0_pack(raw, r0, n, pk, corr, dw, f16)
            for t0 in range(0, T, TOKENS):
                m = min(TOKENS, T - t0)
                for i in range(TOKENS):
                    ts[i] = t0 + min(i, m - 1)
                q8_0_tile(pk, corr, dw, xu, xd, ts, out)
                for i in range(m):
                    for l in range(n):
                        y[t0 + i, r0 + l] = out[i, l]
