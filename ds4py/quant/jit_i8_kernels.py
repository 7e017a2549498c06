"""The compiled int8-activation kernels (numba): y = x @ W.T with x quantised per block, integer dot products.

Imported only through ds4py.quant.jit_i8 (which quantises x and sets numba's cache first). The activation comes
as int8 codes `xq` [T, C] with one float32 scale per block `xd` [T, C / block] (Q8_K: blocks of 256 and `xbs`
[T, C / 16], the int32 sums of each 16 codes; Q8_0: blocks of 32), as ggml's CPU dot products take it.

Each kernel unpacks one stored weight block into small integers (`w`: int16, the sub-block scale folded in where
it fits), then, for every token, sums w * xq over the block in int32 (exact: the order does not matter), and adds
d_w * d_x * isum (minus the K-quants' min term) to that token's float32 accumulator, block after block in storage
order. The integer loops are written as plain reductions of sign-extended products, which LLVM turns into
`vpmovsxbw` + `vpmaddwd` on AVX2 / AVX-512 and `smull`/`sadalp` or `sdot` on aarch64 (checked with inspect_asm in
tests/test_jit_i8.py); the float side is one scalar sequence per (token, row), so y[t, r] is the same bits for
any thread count, any batch and any other rows (no fastmath: no reassociation or fused multiply-add either).
A block's weights are unpacked once for all T tokens of a step, so prefill reads and decodes each weight once.

Work split: the rows are cut into `parts` equal contiguous ranges, one per prange iteration (one thread each).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

F32 = np.float32
I32 = np.int32
I16 = np.int16
LOW2 = np.uint64(0x0303030303030303)
ONES16 = np.uint64(0x0001000100010001)
OPTS = dict(parallel=True, cache=True, nogil=True, boundscheck=False)


@intrinsic
def _load_u64(typingctx, arr, offset):
    """The 8 bytes of a C-contiguous uint8 array at flat byte `offset` as one little-endian uint64 (an
    unaligned load: GGUF blocks of 84 or 66 bytes put their words at any alignment)."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.load(builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)
    return types.uint64(arr, types.intp), codegen


@njit(cache=True, nogil=True, boundscheck=False)
def _dot(w, x):
    """sum_i w[i] * x[i] over x's length, in int32 (w int16 or int8, x int8). Both indexed by the loop
    variable alone: an index numba cannot prove non-negative gets a wraparound select per element, and the
    loop stays scalar (measured 25x slower)."""
    s = I32(0)
    for i in range(x.shape[0]):
        s = I32(s + I32(w[i]) * I32(x[i]))
    return s


@njit(**OPTS)
def q8_0(raw, q, xq, xd, y, f16, parts):
    """34-byte blocks: f16 d, 32 int8 codes (q: the same bytes as int8). Activation: Q8_0 (xd [T, C/32])."""
    R, nb, T = raw.shape[0], raw.shape[1], xq.shape[0]
    for p in prange(parts):
        acc = np.empty(T, F32)
        for r in range(p * R // parts, (p + 1) * R // parts):
            acc[:] = 0
            for b in range(nb):
                d = f16[np.int32(raw[r, b, 0]) | (np.int32(raw[r, b, 1]) << 8)]
                for t in range(T):
                    acc[t] += (d * xd[t, b]) * F32(_dot(q[r, b, 2:], xq[t, 32 * b:32 * b + 32]))
            for t in range(T):
                y[t, r] = acc[t]

@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _q2_k_words(raw, r, b, wu):
    """Block b of Q2_K row r's codes times their sub-block scales into the 32 words wu, 8 int8 weights a word
    (q2_k says how). Inlined: the prefill kernels (jit_i8_gemm_kernels) unpack a row with it too."""
    nb = raw.shape[1]
    for h in range(2):
        for j in range(4):
            for half in range(2):
                sv = np.uint64(raw[r, b, 8 * h + 2 * j + half] & 15)
                for k in range(2):
                    c = _load_u64(raw, (r * nb + b) * 84 + 16 + 32 * h + 16 * half + 8 * k)
                    wu[16 * h + 4 * j + 2 * half + k] = ((c >> np.uint64(2 * j)) & LOW2) * sv


@njit(**OPTS)
def q2_k(raw, xq, xd, xbs, y, f16, parts):
    """84-byte blocks of 256: 16 scale bytes (low nibble scale, high nibble min per 16 weights), 64 code bytes
    (weight 128h + 32j + l: bits 2j of byte 32h + l), f16 d, f16 dmin. Activation: Q8_K.
    Unpacked a word (8 weights) at a time: (word >> 2j) & 0x03.. gives 8 two-bit codes as bytes, times the
    sub-block scale (<= 15) each byte stays below 46: w is int8, no lane carries."""
    R, nb, T = raw.shape[0], raw.shape[1], xq.shape[0]
    for p in prange(parts):
        acc = np.empty(T, F32)
        wu = np.empty(32, np.uint64)
        w = wu.view(np.int8)
        for r in range(p * R // parts, (p + 1) * R // parts):
            acc[:] = 0
            for b in range(nb):
                d = f16[np.int32(raw[r, b, 80]) | (np.int32(raw[r, b, 81]) << 8)]
                dm = f16[np.int32(raw[r, b, 82]) | (np.int32(raw[r, b, 83]) << 8)]
                _q2_k_words(raw, r, b, wu)
                for t in range(T):
                    isum = _dot(w, xq[t, 256 * b:256 * b + 256])
                    m = I32(0)
                    for i in range(16):
                        m = I32(m + I32(raw[r, b, i] >> 4) * xbs[t, 16 * b + i])
                    acc[t] += xd[t, b] * (d * F32(isum) - dm * F32(m))
            for t in range(T):
                y[t, r] = acc[t]


@njit(**OPTS)
def q4_k(raw, xq, xd, xbs, y, f16, parts):
    """144-byte blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) x 8, 128 code bytes (chunk c:
    low nibbles sub-block 2c, high nibbles 2c + 1). Activation: Q8_K."""
    R, nb, T = raw.shape[0], raw.shape[1], xq.shape[0]
    for p in prange(parts):
        acc = np.empty(T, F32)
        w = np.empty(256, I16)
        sc = np.empty(8, I16)
        mn = np.empty(8, I32)
        for r in range(p * R // parts, (p + 1) * R // parts):
            acc[:] = 0
            for b in range(nb):
                d = f16[np.int32(raw[r, b, 0]) | (np.int32(raw[r, b, 1]) << 8)]
                dm = f16[np.int32(raw[r, b, 2]) | (np.int32(raw[r, b, 3]) << 8)]
                for k in range(4):
                    a, bb, cc = raw[r, b, 4 + k], raw[r, b, 8 + k], raw[r, b, 12 + k]
                    sc[k] = I16(a & 63)
                    mn[k] = I32(bb & 63)
                    sc[k + 4] = I16((cc & 15) | ((a >> 6) << 4))
                    mn[k + 4] = I32((cc >> 4) | ((bb >> 6) << 4))
                for c in range(4):
                    s1, s2 = sc[2 * c], sc[2 * c + 1]
                    for l in range(32):
                        v = raw[r, b, 16 + 32 * c + l]
                        w[64 * c + l] = I16(v & 15) * s1
                        w[64 * c + 32 + l] = I16(v >> 4) * s2
                for t in range(T):
                    isum = _dot(w, xq[t, 256 * b:256 * b + 256])
                    m = I32(0)
                    for k in range(8):
                        m = I32(m + mn[k] * (xbs[t, 16 * b + 2 * k] + xbs[t, 16 * b + 2 * k + 1]))
                    acc[t] += xd[t, b] * (d * F32(isum) - dm * F32(m))
            for t in range(T):
                y[t, r] = acc[t]


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _iq2_xxs_words(raw, r, b, wu, o, grid2, sign2):
    """Block b of IQ2_XXS row r unpacked into the 64 words wu[o:o + 64], four int16 weights grid * sign * (2 ls + 1)
    a word (iq2_xxs says how). Inlined: the prefill kernels (jit_i8_gemm_kernels) unpack a row with it too."""
    for g in range(8):
        ob = 2 + 8 * g
        aux = (np.int64(raw[r, b, ob + 4]) | (np.int64(raw[r, b, ob + 5]) << 8)
               | (np.int64(raw[r, b, ob + 6]) << 16) | (np.int64(raw[r, b, ob + 7]) << 24))
        ls = np.uint64(2 * (aux >> 28) + 1)
        for k in range(4):
            gi = np.int64(raw[r, b, ob + k])
            si = (aux >> (7 * k)) & 127
            for h in range(2):
                m = sign2[si, h]
                wu[o + 8 * g + 2 * k + h] = ((grid2[gi, h] * ls) ^ m) + (m & ONES16)


@njit(**OPTS)
def iq2_xxs(raw, xq, xd, y, f16, grid2, sign2, parts):
    """66-byte blocks of 256: f16 d, 8 groups of 32 (4 grid bytes, then a u32: 4 x 7 sign bits, 4-bit scale ls).
    w = grid * sign * (2 ls + 1) as int16 (|w| <= 43 * 31), y += d_w / 8 * d_x * isum (the dequantiser's
    d * (ls + 1/2) / 4). Activation: Q8_K.
    The unpacking works on 64-bit words, four int16 weights each: grid2 [256, 2] holds a grid entry's 8
    magnitudes as two words, sign2 [128, 2] the matching 0xFFFF lane masks. A word of magnitudes times ls stays
    within its lanes (43 * 31 < 2^16), and (v ^ m) + (m & 1 per lane) negates the masked lanes without a carry
    (v >= 8). Written as words, the unpacking is 64 loads, multiplies and stores a block; per weight, LLVM
    scalarises it (the int16 stores may alias the tables)."""
    R, nb, T = raw.shape[0], raw.shape[1], xq.shape[0]
    for p in prange(parts):
        acc = np.empty(T, F32)
        wu = np.empty(64, np.uint64)
        w = wu.view(I16)
        for r in range(p * R // parts, (p + 1) * R // parts):
            acc[:] = 0
            for b in range(nb):
                d = f16[np.int32(raw[r, b, 0]) | (np.int32(raw[r, b, 1]) << 8)] * F32(0.125)
                _iq2_xxs_words(raw, r, b, wu, 0, grid2, sign2)
                for t in range(T):
                    acc[t] += (d * xd[t, b]) * F32(_dot(w, xq[t, 256 * b:256 * b + 256]))
            for t in range(T):
                y[t, r] = acc[t]


@njit(**OPTS)
def mxfp4(raw, xq, xd, y, e8m0, kvalues, parts):
    """17-byte blocks of 32: e8m0 byte (scale e8m0[e] = 2^(e-128) on the doubled e2m1 values, kvalues int16),
    16 code bytes (low nibble weight j, high nibble weight j + 16). Activation: Q8_0."""
    R, nb, T = raw.shape[0], raw.shape[1], xq.shape[0]
    for p in prange(parts):
        acc = np.empty(T, F32)
        w = np.empty(32, I16)
        for r in range(p * R // parts, (p + 1) * R // parts):
            acc[:] = 0
            for b in range(nb):
                d = e8m0[raw[r, b, 0]]
                for j in range(16):
                    v = raw[r, b, 1 + j]
                    w[j] = kvalues[v & 15]
                    w[16 + j] = kvalues[v >> 4]
                for t in range(T):
                    acc[t] += (d * xd[t, b]) * F32(_dot(w, xq[t, 32 * b:32 * b + 32]))
            for t in range(T):
                y[t, r] = acc[t]

