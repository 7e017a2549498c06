"""Twin of the tensor-core tile (cu/portable.cuh mma_m16n8k16_{f16,bf16}_f32): bf16 rounding, the per-lane
fragment layout of PTX mma.m16n8k16 (row.col), and the emulator's arithmetic (double, C first then k ascending,
rounded once to fp32).

Lane l = 4g + t holds (two 16-bit values per register, the lower k / column in the low half):
    a[0] = A[g, 2t:2t+2]   a[1] = A[g+8, 2t:2t+2]   a[2] = A[g, 2t+8:2t+10]   a[3] = A[g+8, 2t+8:2t+10]
    b[0] = B[2t:2t+2, g]   b[1] = B[2t+8:2t+10, g]
    c/d[0..1] = D[g, 2t:2t+2]                       c/d[2..3] = D[g+8, 2t:2t+2]
"""

from __future__ import annotations

import numpy as np

_LANE = np.arange(32)
_G, _T = _LANE // 4, _LANE % 4


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even; NaN -> 0x7fff (as the CUDA conversion)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(np.asarray(x, np.float32)), np.uint16(0x7FFF), r)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bf16 (as float32)."""
    return bf16_value(bf16_bits(x))


def bits16(x: np.ndarray, dtype: str) -> np.ndarray:
    """16-bit patterns of x in f16 or bf16 (uint16)."""
    if dtype == "f16":
        return np.asarray(x, np.float16).view(np.uint16)
    if dtype == "bf16":
        return bf16_bits(x)
    raise ValueError(dtype)


def value16(bits: np.ndarray, dtype: str) -> np.ndarray:
    """uint16 patterns -> float64 values."""
    bits = np.asarray(bits, np.uint16)
    v = bits.view(np.float16).astype(np.float32) if dtype == "f16" else bf16_value(bits)
    return v.astype(np.float64)


def _pair(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)


def pack_a(A: np.ndarray, dtype: str) -> np.ndarray:
    """A [16, 16] -> the lanes' a registers, uint32 [32, 4]."""
    b = bits16(A, dtype).reshape(16, 16)
    g, t = _G, _T
    return np.stack([_pair(b[g, 2 * t], b[g, 2 * t + 1]), _pair(b[g + 8, 2 * t], b[g + 8, 2 * t + 1]),
                     _pair(b[g, 2 * t + 8], b[g, 2 * t + 9]), _pair(b[g + 8, 2 * t + 8], b[g + 8, 2 * t + 9])], 1)


def pack_b(B: np.ndarray, dtype: str) -> np.ndarray:
    """B [16 (k), 8 (n)] -> the lanes' b registers, uint32 [32, 2]."""
    b = bits16(B, dtype).reshape(16, 8)
    g, t = _G, _T
    return np.stack([_pair(b[2 * t, g], b[2 * t + 1, g]), _pair(b[2 * t + 8, g], b[2 * t + 9, g])], 1)


def pack_c(C: np.ndarray) -> np.ndarray:
    """C [16, 8] float32 -> the lanes' accumulators [32, 4]."""
    C = np.asarray(C, np.float32).reshape(16, 8)
    g, t = _G, _T
    return np.stack([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]], 1)


def unpack_d(d: np.ndarray) -> np.ndarray:
    """The lanes' accumulators [32, 4] -> D [16, 8]."""
    d = np.asarray(d).reshape(32, 4)
    D = np.empty((16, 8), d.dtype)
    g, t = _G, _T
    D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1] = d[:, 0], d[:, 1], d[:, 2], d[:, 3]
    return D


def unpack_a(a: np.ndarray, dtype: str) -> np.ndarray:
    """The lanes' a registers [32, 4] -> A [16, 16] (float64): the inverse of pack_a."""
    a = np.asarray(a, np.uint32).reshape(32, 4)
    A = np.empty((16, 16))
    g, t = _G, _T
    for i, (dr, dc) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
        A[g + dr, 2 * t + dc] = value16((a[:, i] & 0xFFFF).astype(np.uint16), dtype)
        A[g + dr, 2 * t + dc + 1] = value16((a[:, i] >> 16).astype(np.uint16), dtype)
    return A


def mma(A: np.ndarray, B: np.ndarray, C: np.ndarray, dtype: str) -> np.ndarray:
    """D = C + A B as the emulator computes it: A, B on the dtype's grid, the sum in double (C, then k = 0..15),
    rounded once to float32."""
    Av, Bv = value16(bits16(A, dtype), dtype).reshape(16, 16), value16(bits16(B, dtype), dtype).reshape(16, 8)
    acc = np.asarray(C, np.float32).astype(np.float64).reshape(16, 8).copy()
    for k in range(16):
        acc += Av[:, k:k + 1] * Bv[k:k + 1, :]
    return acc.astype(np.float32)
