"""The compiled prefill kernels (numba): many tokens times one quantised matrix, tile by tile.

Imported only through ds4py.quant.jit_i8_gemm. The int8-activation kernels here (IQ2_XXS, Q2_K, Q4_K) take the
activation as ds4py.quant.jit_i8 quantises it (int8 codes `xq` [T, C], float32 block scales `xd`, Q8_K's int32
sums of 16 codes `xbs`) and compute, for every (token, row), the very float operations of jit_i8_kernels in the
same order: an exact int32 sum per block of 256, then one scale product added to a float32 accumulator, blocks
in storage order. So y is bit for bit jit_i8's (tests/test_jit_i8_gemm.py), and row-stable the same way.

What differs is the loop order, for T tokens: a tile of ROWS rows is unpacked once into small integers (`W`
int16, the sub-block scale folded in; its float block scales beside it), then every token's dot products run
over that tile while it sits in the L1 / L2 cache, a token's codes reused across the tile's rows. Q2_K's weights
are unpacked to int16 (jit_i8's decode kernel keeps int8) and its min term is a 16-long int32 dot product: both
turn into SIMD multiply-adds (vpmaddwd / vpdpwssd), where the int8 x int8 products and the scalar min loop did
not (measured: 11 vs 21 GMAC/s a core at 32 tokens).

`q8_0_rows` dequantises Q8_0 rows to float32 (for the dense matrices' prefill: float32 BLAS on the rounded x,
ds4py.quant.jit_i8_gemm says why).

Work split: the rows are cut into `parts` equal contiguous ranges, one per prange iteration (one thread each).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ds4py.quant.jit_i8_kernels import _dot, _iq2_xxs_words, _q2_k_words

F32 = np.float32
I32 = np.int32
I16 = np.int16
ROWS = 8                      # rows per tile: 8 x 4,096 int16 = 64 KiB, in L2 beside a token's codes
OPTS = dict(parallel=True, cache=True, nogil=True, boundscheck=False)


@njit(cache=True, nogil=True, boundscheck=False)
def _unpack_iq2_xxs(raw, r, W, k, dw, f16, grid2, sign2):
    """Row r of IQ2_XXS blocks into W[k] (int16 grid * sign * (2 ls + 1)) and dw[k] (d / 8), a block at a time as
    jit_i8_kernels.iq2_xxs does (_iq2_xxs_words)."""
    nb = raw.shape[1]
    wu = W[k].view(np.uint64)
    for b in range(nb):
        dw[k, b] = f16[np.int32(raw[r, b, 0]) | (np.int32(raw[r, b, 1]) << 8)] * F32(0.125)
        _iq2_xxs_words(raw, r, b, wu, 64 * b, grid2, sign2)


@njit(**OPTS)
def iq2_xxs(raw, xq, xd, y, f16, grid2, sign2, parts):
    """raw [R, nb, 66] IQ2_XXS rows; activation Q8_K (xq, xd). y[t, r] = sum_b (d_w / 8 * d_x) * isum."""
    R, nb, T = raw.shape[0], raw.shape[1], xq.shape[0]
    for p in prange(parts):
        W = np.empty((ROWS, nb * 256), I16)
        dw = np.empty((ROWS, nb), F32)
        lo, hi = p * R // parts, (p + 1) * R // parts
        for r0 in range(lo, hi, ROWS):
            n = min(ROWS, hi - r0)
            for k in range(n):
                _unpack_iq2_xxs(raw, r0 + k, W, k, dw, f16, grid2, sign2)
            for t in range(T):
                xt = xq[t]
                for k in range(n):
                    wk = W[k]
                    acc = F32(0)
                    for b in range(nb):
                        acc += (dw[k, b] * xd[t, b]) * F32(_dot(wk[256 * b:256 * b + 256], xt[256 * b:256 * b + 256]))
                    y[t, r0 + k] = acc


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _tile_with_mins(W, dw, dm, mn, n, xq, xd, xbs, y, r0):
    """The K-quants with a min term (Q2_K, Q4_K): one unpacked tile of n rows (y's rows r0 ..) against every
    token, y[t, r0 + k] = sum_b d_x (d isum - dmin m), isum the block's int16 x int8 dot, m its sub-block mins'
    dot with the Q8_K 16-sums (the same integers and float operations, in the same order, as jit_i8_kernels).
    Inlined into the kernels (as a call it measured 1-3% slower at 32 tokens, one thread)."""
    nb, T = dw.shape[1], xq.shape[0]
    for t in range(T):
        xt = xq[t]
        bt = xbs[t]
        for k in range(n):
            wk = W[k]
            mk = mn[k]
            acc = F32(0)
            for b in range(nb):
                isum = _dot(wk[256 * b:256 * b + 256], xt[256 * b:256 * b + 256])
                m = _dot(mk[16 * b:16 * b + 16], bt[16 * b:16 * b + 16])
                acc += xd[t, b] * (dw[k, b] * F32(isum) - dm[k, b] * F32(m))
            y[t, r0 + k] = acc


@njit(cache=True, nogil=True, boundscheck=False, inline="always")
def _part_with_mins(raw, xq, xd, xbs, y, f16, p, parts, q4):
    """Part p of `parts` of the rows of a K-quant with a min term (q4: Q4_K, else Q2_K), tile by tile: ROWS rows
    unpacked (_unpack_q4_k / _unpack_q2_k), then every token against them (_tile_with_mins). Inlined into q2_k /
    q4_k, where q4 is a constant."""
    R, nb = raw.shape[0], raw.shape[1]
    W = np.empty((ROWS, nb * 256), I16)
    dw = np.empty((ROWS, nb), F32)
    dm = np.empty((ROWS, nb), F32)
    mn = np.empty((ROWS, nb * 16), I32)
    w8u = np.empty(32, np.uint64)                   # Q2_K's scratch: a block's codes as words
    sc = np.empty(8, I16)                           # Q4_K's: a block's 6-bit scales
    lo, hi = p * R // parts, (p + 1) * R // parts
    for r0 in range(lo, hi, ROWS):
        n = min(ROWS, hi - r0)
        for k in range(n):
            if q4:
                _unpack_q4_k(raw, r0 + k, W, k, dw, dm, mn, f16, sc)
            else:
                _unpack_q2_k(raw, r0 + k, W, k, dw, dm, mn, f16, w8u)
        _tile_with_mins(W, dw, dm, mn, n, xq, xd, xbs, y, r0)


@njit(cache=True, nogil=True, boundscheck=False)
def _unpack_q2_k(raw, r, W, k, dw, dm, mn, f16, w8u):
    """Row r of Q2_K blocks into W[k] (int16 code * sub-block scale), dw / dm[k] (d, dmin) and mn[k] (int32
    sub-block mins, 16 a block). A block is unpacked as jit_i8_kernels.q2_k does it (_q2_k_words: 8 bytes a word
    into the scratch w8u), then widened to int16 in one vectorisable loop."""
    nb = raw.shape[1]
    wk = W[k]
    w8 = w8u.view(np.int8)
    for b in range(nb):
        dw[k, b] = f16[np.int32(raw[r, b, 80]) | (np.int32(raw[r, b, 81]) << 8)]
        dm[k, b] = f16[np.int32(raw[r, b, 82]) | (np.int32(raw[r, b, 83]) << 8)]
        for i in range(16):
            mn[k, 16 * b + i] = I32(raw[r, b, i] >> 4)
        _q2_k_words(raw, r, b, w8u)
        wb = wk[256 * b:256 * b + 256]
        for i in range(256):
            wb[i] = I16(w8[i])


@njit(**OPTS)
def q2_k(raw, xq, xd, xbs, y, f16, parts):
    """raw [R, nb, 84] Q2_K rows; activation Q8_K (xq, xd, xbs). y[t, r] = sum_b d_x (d isum - dmin m)."""
    for p in prange(parts):
        _part_with_mins(raw, xq, xd, xbs, y, f16, p, parts, False)


@njit(cache=True, nogil=True, boundscheck=False)
def _unpack_q4_k(raw, r, W, k, dw, dm, mn, f16, sc):
    """Row r of Q4_K blocks into W[k] (int16 code * 6-bit scale), dw / dm[k] (d, dmin) and mn[k] (int32: each
    sub-block's 6-bit min twice, once per 16-sum of its 32 weights: the same integer as jit_i8's min * (sum_a +
    sum_b))."""
    nb = raw.shape[1]
    wk = W[k]
    for b in range(nb):
        dw[k, b] = f16[np.int32(raw[r, b, 0]) | (np.int32(raw[r, b, 1]) << 8)]
        dm[k, b] = f16[np.int32(raw[r, b, 2]) | (np.int32(raw[r, b, 3]) << 8)]
        for q in range(4):
            a, bb, cc = raw[r, b, 4 + q], raw[r, b, 8 + q], raw[r, b, 12 + q]
            sc[q] = I16(a & 63)
            sc[q + 4] = I16((cc & 15) | ((a >> 6) << 4))
            lo, hi = I32(bb & 63), I32((cc >> 4) | ((bb >> 6) << 4))
            mn[k, 16 * b + 2 * q] = lo
            mn[k, 16 * b + 2 * q + 1] = lo
            mn[k, 16 * b + 2 * q + 8] = hi
            mn[k, 16 * b + 2 * q + 9] = hi
        for c in range(4):
            s1, s2 = sc[2 * c], sc[2 * c + 1]
            for l in range(32):
                v = raw[r, b, 16 + 32 * c + l]
                wk[256 * b + 64 * c + l] = I16(v & 15) * s1
                wk[256 * b + 64 * c + 32 + l] = I16(v >> 4) * s2


@njit(**OPTS)
def q4_k(raw, xq, xd, xbs, y, f16, parts):
    """raw [R, nb, 144] Q4_K rows; activation Q8_K (xq, xd, xbs). y[t, r] = sum_b d_x (d isum - dmin m)."""
    for p in prange(parts):
        _part_with_mins(raw, xq, xd, xbs, y, f16, p, parts, True)


@njit(cache=True, nogil=True, boundscheck=False)
def q8_0_rows(raw, out, f16):
    """raw [R, nb, 34] Q8_0 rows -> out [R, nb * 32] float32 (d * code, as ds4py.quant.simple.dequant_q8_0).
    Serial (no prange): jit_i8_gemm.dense_q8_0 calls it from several Python threads at once, which numba's
    workqueue layer does not allow for parallel kernels."""
    R, nb = raw.shape[0], raw.shape[1]
    q = raw.view(np.int8)
    for r in range(R):
        for b in range(nb):
            d = f16[np.int32(raw[r, b, 0]) | (np.int32(raw[r, b, 1]) << 8)]
            for i in range(32):
                out[r, 32 * b + i] = F32(q[r, b, 2 + i]) * d
