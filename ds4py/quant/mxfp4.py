"""MXFP4 (ggml): 32 weights per 17-byte block = e8m0 exponent byte e + 16 bytes of 4-bit codes.

qs[j] low nibble = weight j, high nibble = weight j+16 (ggml's order, not the official interleaving).
Code c -> e2m1 value doubled (0,1,2,3,4,6,8,12, then negatives) times 2^(e-128), i.e. e2m1 * 2^(e-127):
exactly the official FP4 + e8m0 value, so official expert weights repack into MXFP4 with no loss.
"""

from __future__ import annotations

import numpy as np

MXFP4_BYTES = 17
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)
# byte -> value of its low / high nibble (one table lookup per byte instead of a mask, a shift and a lookup)
LOW = KVALUES[np.arange(256) & 15]
HIGH = KVALUES[np.arange(256) >> 4]


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """2^(e-128) as float32, exact for every byte (e < 2 lands in the subnormals), like ggml."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << 23)
    return bits.astype(np.uint32).view(np.float32)


def dequant_mxfp4(raw: np.ndarray) -> np.ndarray:
    blk = raw.reshape(-1, MXFP4_BYTES)
    n = blk.shape[0]
    d = e8m0_half(blk[:, :1])                                    # (n, 1)
    qs = blk[:, 1:]
    out = np.empty((n, 32), np.float32)
    out[:, :16] = np.take(LOW, qs)                               # weight j: low nibble of qs[j]
    out[:, 16:] = np.take(HIGH, qs)                              # weight j+16: high nibble
    out *= d
    return out


def mxfp4_from_official(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Official FP4 expert weight -> MXFP4 bytes, losslessly.

    packed: uint8/int8 [out, in/2], low nibble = even weight; scale: e8m0 bytes [out, in/32].
    Returns uint8 [out, in/32 * 17].
    """
    p = np.asarray(packed).view(np.uint8)
    rows, half = p.shape
    nb = half // 16
    codes = np.empty((rows, half * 2), np.uint8)
    codes[:, 0::2] = p & 15
    codes[:, 1::2] = p >> 4
    codes = codes.reshape(rows, nb, 32)
    out = np.empty((rows, nb, MXFP4_BYTES), np.uint8)
    out[:, :, 0] = np.asarray(scale).view(np.uint8).reshape(rows, nb)
    out[:, :, 1:] = codes[:, :, :16] | (codes[:, :, 16:] << 4)
    return out.reshape(rows, nb * MXFP4_BYTES)
