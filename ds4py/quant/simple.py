"""Plain float types and Q8_0: the formats whose decode is a cast or one multiply.

Block layouts (ggml):
    F32 / F16 / BF16  one value per element, little-endian
    Q8_0              32 weights: f16 d, 32 x int8 q          value = q * d
"""

from __future__ import annotations

import numpy as np

Q8_0_BLOCK = 32
Q8_0_BYTES = 2 + 32


def dequant_f32(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float32)


def dequant_f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def dequant_bf16(raw: np.ndarray) -> np.ndarray:
    # bf16 is the top half of an f32: shift the 16 bits into place.
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    blk = raw.reshape(-1, Q8_0_BYTES)
    d = blk[:, :2].copy().view(np.float16).astype(np.float32)       # (n, 1)
    q = blk[:, 2:].view(np.int8).astype(np.float32)                  # (n, 32)
    q *= d
    return q


def round_half_away(x: np.ndarray) -> np.ndarray:
    """C roundf(): halves go away from zero (np.rint would round them to even)."""
    return np.copysign(np.floor(np.abs(x) + np.float32(0.5)), x)


def quant_q8_0(x: np.ndarray) -> np.ndarray:
    """llama.cpp quantize_row_q8_0_ref: d = amax/127, q = roundf(x/d); bytes (n_blocks, 34)."""
    blk = np.asarray(x, dtype=np.float32).reshape(-1, Q8_0_BLOCK)
    d = np.abs(blk).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = round_half_away(blk * inv).astype(np.int8)
    out = np.empty((blk.shape[0], Q8_0_BYTES), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = q.view(np.uint8)
    return out


def quant_bf16(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bits with round-to-nearest-even (NaN kept quiet)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = np.where(nan, (u >> 16) | 0x40, r)
    return r.astype(np.uint16)
