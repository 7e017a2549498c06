"""Twin of cu/gemm.cu: y = bf16(x) @ W^T with the weights exact (ds4py.quant / the F16 / F32 values) and the
product in float64, plus its magnitude sum |bf16(x)| @ |W|^T for the tolerance.

What the kernel does differently: fp32 accumulation (the tensor cores' within each k16 step, then across k
tiles; Q8_0: each 32-column block's partial P is an fp32 sum scaled by d and added in fp32). So kernel vs twin is
fp32-rounding level (assert_close_scaled with n_terms = K). Against the scalar fp32 path (twins/gemv.py, x not
rounded) the difference is the bf16 rounding of x: |dy| <= 2^-9 * sum_k |x_k W_nk| (measured in
tests/test_cu_emu_gemm.py; docs/cuda.md)."""

from __future__ import annotations

import numpy as np

from ds4py.cuda.twins.core import weight_values
from ds4py.cuda.twins.mma import bf16_round


def gemm(W: np.ndarray, x: np.ndarray, T: int, N: int, K: int, x_group_rows: int = 0,
         y0: np.ndarray | None = None, precise_x: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(y [T, N] float32, magnitude [T, N]): W [N, K] as ops.gemm takes it (F32 / F16 / Q8_0 bytes), x [T, >= K *
    groups] float32; y0: the accumulate case's prior y; precise_x: x as bf16(x) + bf16(x - bf16(x))."""
    Wv = weight_values(W, N, K)
    x32 = np.asarray(x, np.float32)[:T]
    hi = bf16_round(x32)
    xb = hi.astype(np.float64) + (bf16_round(x32 - hi).astype(np.float64) if precise_x else 0.0)
    y = np.empty((T, N))
    mag = np.empty((T, N))
    cols = x_group_rows or N
    for g in range(-(-N // cols)):
        a, b = g * cols, min(N, (g + 1) * cols)
        xg = xb[:, g * K:(g + 1) * K] if x_group_rows else xb[:, :K]
        y[:, a:b] = xg @ Wv[a:b].T
        mag[:, a:b] = np.abs(xg) @ np.abs(Wv[a:b]).T
    if y0 is not None:
        y = y + np.asarray(y0, np.float32)[:T, :N]
        mag = mag + np.abs(np.asarray(y0, np.float32)[:T, :N])
    return y.astype(np.float32), mag
