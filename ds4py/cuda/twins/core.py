"""numpy twins of the CUDA kernels: the same math in float64, rounded to the kernel's output type.

GPU tests and the CPU emulator compare each kernel against these with `assert_close_scaled`: the tolerance
scales with the magnitude of the terms summed, since fp32 accumulation error grows with them, not with the result.
"""

from __future__ import annotations

import numpy as np

Q8_0_BYTES = 34   # f16 scale d, then 32 int8 q; value = d * q (ggml's block_q8_0)


def dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 bytes -> float32 values, block after block. (Same as ds4py.quant.simple.dequant_q8_0; kept here so
    the device check needs numpy only.)"""
    blk = np.ascontiguousarray(raw).reshape(-1, Q8_0_BYTES)
    d = blk[:, :2].copy().view(np.float16).astype(np.float32)
    return (blk[:, 2:].view(np.int8).astype(np.float32) * d).reshape(-1)


def quant_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 -> Q8_0 bytes [n/32, 34] (llama.cpp's reference: d = amax/127, q = round half away from zero)."""
    blk = np.asarray(x, np.float32).reshape(-1, 32)
    d = np.abs(blk).max(axis=1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    y = blk * inv
    q = np.copysign(np.floor(np.abs(y) + np.float32(0.5)), y).astype(np.int8)
    out = np.empty((blk.shape[0], Q8_0_BYTES), np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = q.view(np.uint8)
    return out


def rmsnorm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """Rows of x (last axis) scaled by rsqrt(mean(x^2) + eps), times w when given."""
    x64 = np.asarray(x, np.float64)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    y = x64 * r
    if w is not None:
        y = y * np.asarray(w, np.float64)
    return y.astype(np.float32)


def gemv_f16(W: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (np.asarray(W, np.float16).astype(np.float64) @ np.asarray(x, np.float64)).astype(np.float32)


def q8_0_matrix(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q8_0 bytes [rows, cols/32 * 34] -> float32 [rows, cols]."""
    return dequant_q8_0(raw).reshape(rows, cols)


def gemv_q8_0(raw: np.ndarray, x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return (q8_0_matrix(raw, rows, cols).astype(np.float64) @ np.asarray(x, np.float64)).astype(np.float32)


def embed_f16(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows of an F16 table as float32; an id outside [0, vocab) gives a NaN row (as the kernel does)."""
    table = np.asarray(table, np.float16)
    ids = np.asarray(ids, np.int64)
    out = np.full((len(ids), table.shape[1]), np.nan, np.float32)
    ok = (ids >= 0) & (ids < table.shape[0])
    out[ok] = table[ids[ok]].astype(np.float32)
    return out


def argmax(x: np.ndarray) -> int:
    """numpy.argmax: first NaN if any, else the lowest index of the maximum."""
    return int(np.argmax(np.asarray(x, np.float32)))


def assert_close_scaled(got: np.ndarray, ref: np.ndarray, magnitude: np.ndarray | float, n_terms: int,
                        what: str = "") -> None:
    """|got - ref| <= 8 * eps32 * sqrt(n_terms) * magnitude (+ tiny absolute floor), elementwise.

    magnitude: per-element sum of |terms| (e.g. |W| @ |x| for a GEMV) or a scalar bound."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    tol = 8 * np.finfo(np.float32).eps * np.sqrt(max(n_terms, 1)) * np.asarray(magnitude, np.float64) + 1e-30
    err = np.abs(got - ref)
    bad = ~(err <= tol)
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} values off; first at {i}: got "
                             f"{got.reshape(-1)[i]!r}, want {ref.reshape(-1)[i]!r} (tol {np.broadcast_to(tol, bad.shape).reshape(-1)[i]:.3g})")
