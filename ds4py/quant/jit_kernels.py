"""The compiled decode kernels (numba): y = x @ W.T straight from a GGUF matrix's stored bytes, one pass.

Imported only through ds4py.quant.jit, which sets numba's cache folder first. Each kernel takes the stored rows
as blocks (`raw`: uint8 [R, blocks, block_bytes]), the activation rows grouped the same way (`x`: float32
[T, blocks, block_weights]) and writes `y` (float32 [T, R]).

Work split: the rows are cut into `parts` equal contiguous ranges, one per prange iteration (one thread each),
and a row is computed whole by one thread, block after block in storage order. Within a row, one accumulator
per lane (weight position within a block, 32 or 64 lanes) gathers scale * code * x over every block, and the
lanes are summed at the end in a fixed order; the K-quant minimums go to one scalar. So y[t, r] is one fixed
sequence of float32 operations on row r's bytes and x[t] alone: the same for any thread count, any other rows
of x (batch invariance, row stability) and any other rows of W. fastmath lets LLVM vectorise the lanes (its
choices are made at compile time, not per call). (A horizontal sum per block would cost ~4x the whole kernel.)

Scales are float32 before they multiply (f16 via a 65,536-entry table, exact for every code, inf / NaN too),
so the products equal the dequantised matrix's up to float32 summation order, as ds4py.quant.dot's do.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

F32 = np.float32
OPTS = dict(parallel=True, cache=True, fastmath=True, nogil=True, boundscheck=False)


@njit(**OPTS)
def q8_0(raw, q, x, y, f16, parts):
    """34-byte blocks: f16 d, 32 int8 codes (q: the same bytes as int8)."""
    R, nb, T = raw.shape[0], raw.shape[1], x.shape[0]
    for p in prange(parts):
        acc = np.empty(32, F32)
        for r in range(p * R // parts, (p + 1) * R // parts):
            for t in range(T):
                acc[:] = 0
                for b in range(nb):
                    d = f16[np.int32(raw[r, b, 0]) | (np.int32(raw[r, b, 1]) << 8)]
                    for i in range(32):
                        acc[i] += d * (F32(q[r, b, 2 + i]) * x[t, b, i])
                y[t, r] = acc.sum()


@njit(**OPTS)
def f16_rows(raw, x, y, f16, parts):
    """float16 weights of any row length: raw uint16 [R, C], x [T, C]. Weight i goes to lane i % 64 (the whole
    64-wide runs first, then the tail of C % 64 into lanes 0..), so a row is still one fixed sequence."""
    R, C, T = raw.shape[0], raw.shape[1], x.shape[0]
    whole = C - C % 64
    for p in prange(parts):
        acc = np.empty(64, F32)
        for r in range(p * R // parts, (p + 1) * R // parts):
            for t in range(T):
                acc[:] = 0
                for b in range(0, whole, 64):
                    for i in range(64):
                        acc[i] += f16[raw[r, b + i]] * x[t, b + i]
                for i in range(C - whole):
                    acc[i] += f16[raw[r, whole + i]] * x[t, whole + i]
                y[t, r] = acc.sum()


@njit(**OPTS)
def iq2_xxs(raw, x, y, f16, grid, signs, parts):
    """66-byte blocks of 256: f16 d, 8 groups of 32 (4 grid bytes, then a u32: 4 x 7 sign bits, 4-bit scale).
    grid: float32 [256, 8] magnitudes, signs: float32 [128, 8] of +-1; x [T, C/32, 32]."""
    R, nb, T = raw.shape[0], raw.shape[1], x.shape[0]
    for p in prange(parts):
        acc = np.empty(32, F32)
        for r in range(p * R // parts, (p + 1) * R // parts):
            for t in range(T):
                acc[:] = 0
                for b in range(nb):
                    d = f16[np.int32(raw[r, b, 0]) | (np.int32(raw[r, b, 1]) << 8)]
                    for g in range(8):
                        o = 2 + 8 * g
                        aux = (np.uint32(raw[r, b, o + 4]) | (np.uint32(raw[r, b, o + 5]) << 8)
                               | (np.uint32(raw[r, b, o + 6]) << 16) | (np.uint32(raw[r, b, o + 7]) << 24))
                        db = d * ((F32(aux >> 28) + F32(0.5)) * F32(0.25))
                        for k in range(4):
                            gi = raw[r, b, o + k]
                            si = (aux >> (7 * k)) & 127
                            for j in range(8):
                                acc[8 * k + j] += db * (grid[gi, j] * signs[si, j] * x[t, 8 * b + g, 8 * k + j])
                y[t, r] = acc.sum()


@njit(**OPTS)
def q2_k(raw, x, xs16, y, f16, parts):
    """84-byte blocks of 256: 16 scale bytes (low nibble scale, high nibble min per 16 weights), 64 code bytes
    (weight 128h + 32j + l: bits 2j of byte 32h + l), f16 d, f16 dmin. x [T, C/32, 32] (block b's 32-weight
    groups 4h + j), xs16: [T, C/16] sums of x. (One 32-lane loop per plane, the two sub-block scales picked
    per lane: two 16-lane loops do not vectorise and cost 3.5x.)"""
    R, nb, T = raw.shape[0], raw.shape[1], x.shape[0]
    for p in prange(parts):
        acc = np.empty(32, F32)
        for r in range(p * R // parts, (p + 1) * R // parts):
            for t in range(T):
                acc[:] = 0
                mins = F32(0)
                for b in range(nb):
                    d = f16[np.int32(raw[r, b, 80]) | (np.int32(raw[r, b, 81]) << 8)]
                    dm = f16[np.int32(raw[r, b, 82]) | (np.int32(raw[r, b, 83]) << 8)]
                    m = F32(0)
                    for i in range(16):
                        m += F32(raw[r, b, i] >> 4) * xs16[t, 16 * b + i]
                    mins += dm * m
                    for h in range(2):
                        for j in range(4):
                            s1 = d * F32(raw[r, b, 8 * h + 2 * j] & 15)
                            s2 = d * F32(raw[r, b, 8 * h + 2 * j + 1] & 15)
                            for l in range(32):
                                sv = s1 if l < 16 else s2
                                acc[l] += sv * (F32((raw[r, b, 16 + 32 * h + l] >> (2 * j)) & 3)
                                                * x[t, 8 * b + 4 * h + j, l])
                y[t, r] = acc.sum() - mins


@njit(**OPTS)
def q4_k(raw, x, xs32, y, f16, parts):
    """144-byte blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) x 8, 128 code bytes (chunk c:
    low nibbles sub-block 2c, high nibbles 2c + 1). x [T, C/64, 64], xs32: [T, C/32] sums of x."""
    R, nb, T = raw.shape[0], raw.shape[1], x.shape[0]
    for p in prange(parts):
        acc = np.empty(64, F32)
        sc = np.empty(8, F32)
        mn = np.empty(8, np.int32)
        for r in range(p * R // parts, (p + 1) * R // parts):
            for t in range(T):
                acc[:] = 0
                mins = F32(0)
                for b in range(nb):
                    d = f16[np.int32(raw[r, b, 0]) | (np.int32(raw[r, b, 1]) << 8)]
                    dm = f16[np.int32(raw[r, b, 2]) | (np.int32(raw[r, b, 3]) << 8)]
                    for k in range(4):
                        a, bb, cc = raw[r, b, 4 + k], raw[r, b, 8 + k], raw[r, b, 12 + k]
                        sc[k] = d * F32(a & 63)
                        mn[k] = bb & 63
                        sc[k + 4] = d * F32((cc & 15) | ((a >> 6) << 4))
                        mn[k + 4] = (cc >> 4) | ((bb >> 6) << 4)
                    m = F32(0)
                    for k in range(8):
                        m += F32(mn[k]) * xs32[t, 8 * b + k]
                    mins += dm * m
                    for c in range(4):
                        s1, s2 = sc[2 * c], sc[2 * c + 1]
                        for l in range(32):
                            v = raw[r, b, 16 + 32 * c + l]
                            acc[l] += s1 * (F32(v & 15) * x[t, 4 * b + c, l])
                            acc[32 + l] += s2 * (F32(v >> 4) * x[t, 4 * b + c, 32 + l])
                y[t, r] = acc.sum() - mins


@njit(**OPTS)
def mxfp4(raw, x, y, e8m0, kvalues, parts):
    """17-byte blocks of 32: e8m0 byte (scale e8m0[e] = 2^(e-128) on the doubled e2m1 values), 16 code bytes
    (low nibble weight j, high nibble weight j + 16). x [T, C/32, 32]."""
    R, nb, T = raw.shape[0], raw.shape[1], x.shape[0]
    for p in prange(parts):
        acc = np.empty(32, F32)
        for r in range(p * R // parts, (p + 1) * R // parts):
            for t in range(T):
                acc[:] = 0
                for b in range(nb):
                    d = e8m0[raw[r, b, 0]]
                    for j in range(16):
                        v = raw[r, b, 1 + j]
                        acc[j] += d * (kvalues[v & 15] * x[t, b, j])
                        acc[16 + j] += d * (kvalues[v >> 4] * x[t, b, 16 + j])
                y[t, r] = acc.sum()


@njit(**OPTS)
def vq8(stream, hi, gains, codebook, x, y, sb, parts):
    """VQ-8 rows: index j of a row at bits [j*sb, j*sb + sb) of its LSB-first stream (+ bit 12 from the hi plane
    when it has columns), w[8j:8j+8] = gains[r] * codebook[index]. x [T, C/64, 64]."""
    R, nbytes, T = stream.shape[0], stream.shape[1], x.shape[0]
    n_runs = x.shape[1]
    mask = (1 << sb) - 1
    has_hi = hi.shape[1] > 0
    for p in prange(parts):
        acc = np.empty(64, F32)
        idx = np.empty(8, np.int64)
        for r in range(p * R // parts, (p + 1) * R // parts):
            for t in range(T):
                acc[:] = 0
                for run in range(n_runs):
                    for jj in range(8):
                        bit = (8 * run + jj) * sb
                        q = bit >> 3
                        v = np.int64(stream[r, q])
                        if q + 1 < nbytes:
                            v |= np.int64(stream[r, q + 1]) << 8
                        if q + 2 < nbytes:
                            v |= np.int64(stream[r, q + 2]) << 16
                        ix = (v >> (bit & 7)) & mask
                        if has_hi:
                            ix |= ((np.int64(hi[r, run]) >> jj) & 1) << 12
                        idx[jj] = ix
                    for jj in range(8):
                        for i in range(8):
                            acc[8 * jj + i] += codebook[idx[jj], i] * x[t, run, 8 * jj + i]
                y[t, r] = acc.sum() * gains[r]
