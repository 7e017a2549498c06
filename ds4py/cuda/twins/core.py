"""What the twins share: the scaled tolerance every kernel is checked with, and weight-format helpers.

A twin is the kernel's math taken from ds4py/ref/ops.py (the one reference; ds4py/quant for dequantisation),
plus only what is the kernel's own: its output layout and rounding. GPU tests and the CPU emulator compare each
kernel against its twin with `assert_close_scaled`: the tolerance scales with the magnitude of the terms summed,
since fp32 accumulation error grows with them, not with the result. Numpy only (the device check needs no more).
"""

from __future__ import annotations

import numpy as np

from ds4py.quant import simple

Q8_0_BYTES = simple.Q8_0_BYTES   # f16 scale d, then 32 int8 q; value = d * q (ggml's block_q8_0)


def quant_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 -> Q8_0 bytes [n/32, 34] (llama.cpp's reference quantiser)."""
    return simple.quant_q8_0(x)


def dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q8_0 bytes -> float32 values, block after block."""
    return simple.dequant_q8_0(np.ascontiguousarray(raw).reshape(-1)).reshape(-1)


def q8_0_matrix(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q8_0 bytes [rows, cols/32 * 34] -> float32 [rows, cols]."""
    return dequant_q8_0(raw).reshape(rows, cols)


def weight_values(W: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A GEMV weight as the kernel reads it -> float64 [rows, cols]: F32, F16, or Q8_0 / Q4_K bytes (uint8, told
    apart by their size)."""
    W = np.asarray(W)
    if W.dtype == np.uint8 and cols % 256 == 0 and W.size == rows * cols // 256 * 144:      # Q4_K
        from ds4py.quant import kquants
        return kquants.dequant_q4_k(np.ascontiguousarray(W).reshape(-1)).reshape(rows, cols).astype(np.float64)
    if W.dtype == np.uint8:
        return q8_0_matrix(W, rows, cols).astype(np.float64)
    return W.astype(np.float64).reshape(rows, cols)


def assert_close_scaled(got: np.ndarray, ref: np.ndarray, magnitude: np.ndarray | float, n_terms: int,
                        what: str = "", factor: float = 8.0) -> None:
    """|got - ref| <= factor * eps32 * sqrt(n_terms) * magnitude (+ tiny absolute floor), elementwise.

    magnitude: per-element sum of |terms| (e.g. |W| @ |x| for a GEMV) or a scalar bound. factor 8 covers a twin
    with fp32 rounding of its own; against a float64 twin factor 1 still leaves a wide margin over the fp32
    error of the kernel and catches one quant off in a GEMV row."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    tol = factor * np.finfo(np.float32).eps * np.sqrt(max(n_terms, 1)) * np.asarray(magnitude, np.float64) + 1e-30
    err = np.abs(got - ref)
    bad = ~(err <= tol)
    if bad.any():
        i = int(np.flatnonzero(bad.reshape(-1))[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} values off; first at {i}: got "
                             f"{got.reshape(-1)[i]!r}, want {ref.reshape(-1)[i]!r} (tol {np.broadcast_to(tol, bad.shape).reshape(-1)[i]:.3g})")
