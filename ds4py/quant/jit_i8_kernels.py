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
from numba import njit, prange

F32 = np.float32
I32 = np.int32
I16 = np.int16
OPTS = dict(parallel=True, cache=True, nogil=True, boundscheck=False)


@njit(cache=True, nogil=True, boundscheck=False)
def _dot(w, xq, t, o, n):
    """sum_i w[i] * xq[t, o + i] for i < n, in int32 (w int16 or int8, xq int8)."""
    s = I32(0)
    for i in range(n):
        s = I32(s + I32(w[i]) * I32(xq[t, o + i]))
    return s


@njit(cache=True, nogil=True, boundscheck=False)
def _dot8(q, r, b, xq, t, o):
    """sum over one Q8_0 block's 32 int8 codes q[r, b, 2:34] times xq[t, o:o + 32], in int32."""
    s = I32(0)
    for i in range(32):
        s = I32(s + I32(q[r, b, 2 + i]) * I32(xq[t, o + i]))
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
                    acc[t] += (d * xd[t, b]) * F32(_dot8(q, r, b, xq, t, 32 * b))
            for t in range(T):
                y[t, r] = acc[t]


@njit(**OPTS)
def q2_k(raw, xq, xd, xbs, y, f16, parts):
    """84-byte blocks of 256: 16 scale bytes (low nibble scale, high nibble min per 16 weights), 64 code bytes
    (weight 128h + 32j + l: bits 2j of byte 32h + l), f16 d, f16 dmin. Activation: Q8_K."""
    R, nb, T = raw.shape[0], raw.shape[1], xq.shape[0]
    for p in prange(parts):
        acc = np.empty(T, F32)
        w = np.empty(256, I16)
        for r in range(p * R // parts, (p + 1) * R // parts):
            acc[:] = 0
            for b in range(nb):
                d = f16[np.int32(raw[r, b, 80]) | (np.int32(raw[r, b, 81]) << 8)]
                dm = f16[np.int32(raw[r, b, 82]) | (np.int32(raw[r, b, 83]) << 8)]
                for h in range(2):
                    for j in range(4):
                        s1 = I16(raw[r, b, 8 * h + 2 * j] & 15)
                        s2 = I16(raw[r, b, 8 * h + 2 * j + 1] & 15)
                        o = 128 * h + 32 * j
                        for l in range(16):
                            w[o + l] = I16((raw[r, b, 16 + 32 * h + l] >> (2 * j)) & 3) * s1
                        for l in range(16, 32):
                            w[o + l] = I16((raw[r, b, 16 + 32 * h + l] >> (2 * j)) & 3) * s2
                for t in range(T):
                    isum = _dot(w, xq, t, 256 * b, 256)
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
                    isum = _dot(w, xq, t, 256 * b, 256)
                    m = I32(0)
                    for k in range(8):
                        m = I32(m + mn[k] * (xbs[t, 16 * b + 2 * k] + xbs[t, 16 * b + 2 * k + 1]))
                    acc[t] += xd[t, b] * (d * F32(isum) - dm * F32(m))
            for t in range(T):
                y[t, r] = acc[t]


@njit(**OPTS)
def iq2_xxs(raw, xq, xd, y, f16, grid, signs, parts):
    """66-byte blocks of 256: f16 d, 8 groups of 32 (4 grid bytes, then a u32: 4 x 7 sign bits, 4-bit scale ls).
    grid: int16 [256, 8] magnitudes, signs: int16 [128, 8] of +-1. w = grid * sign * (2 ls + 1) (|w| <= 43 * 31),
    y += d_w / 8 * d_x * isum (the dequantiser's d * (ls + 1/2) / 4). Activation: Q8_K."""
    R, nb, T = raw.shape[0], raw.shape[1], xq.shape[0]
    for p in prange(parts):
        acc = np.empty(T, F32)
        w = np.empty(256, I16)
        for r in range(p * R // parts, (p + 1) * R // parts):
            acc[:] = 0
            for b in range(nb):
                d = f16[np.int32(raw[r, b, 0]) | (np.int32(raw[r, b, 1]) << 8)] * F32(0.125)
                for g in range(8):
                    o = 2 + 8 * g
                    aux = (np.uint32(raw[r, b, o + 4]) | (np.uint32(raw[r, b, o + 5]) << 8)
                           | (np.uint32(raw[r, b, o + 6]) << 16) | (np.uint32(raw[r, b, o + 7]) << 24))
                    ls = I16(2 * (aux >> 28) + 1)
                    for k in range(4):
                        gi = raw[r, b, o + k]
                        si = (aux >> (7 * k)) & 127
                        for j in range(8):
                            w[32 * g + 8 * k + j] = grid[gi, j] * signs[si, j] * ls
                for t in range(T):
                    acc[t] += (d * xd[t, b]) * F32(_dot(w, xq, t, 256 * b, 256))
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
                    acc[t] += (d * xd[t, b]) * F32(_dot(w, xq, t, 32 * b, 32))
            for t in range(T):
                y[t, r] = acc[t]
