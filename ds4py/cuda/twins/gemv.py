"""Twin of cu/gemv.cu: y = W x on the dequantised weights (float64, so the twin's own rounding is negligible),
the RMSNorm prologue, hc_post and SwiGLU epilogues from ref.ops."""

from __future__ import annotations

import numpy as np

from ds4py.cuda.twins.core import weight_values
from ds4py.ref import ops as ref


CHUNK_ROWS = 8192          # rows dequantised at a time (the head is 129,280 x 4096)


def _rows_dot(W: np.ndarray, x: np.ndarray, rows: int, cols: int, x_group_rows: int, absolute: bool) -> np.ndarray:
    """sum_c W[r, c] x_r[c] in float64, chunk by chunk (|W| with absolute)."""
    W = np.asarray(W).reshape(rows, -1)
    out = np.empty(rows, np.float64)
    for a in range(0, rows, CHUNK_ROWS):
        b = min(rows, a + CHUNK_ROWS)
        Wv = weight_values(W[a:b], b - a, cols)
        if absolute:
            Wv = np.abs(Wv)
        if not x_group_rows:
            out[a:b] = Wv @ x[:cols].astype(np.float64)
        else:
            g = np.arange(a, b) // x_group_rows
            out[a:b] = np.einsum("rc,rc->r", Wv, x[: (g[-1] + 1) * cols].reshape(-1, cols).astype(np.float64)[g])
    return out


def gemv(W: np.ndarray, x: np.ndarray, rows: int, cols: int, norm: tuple[np.ndarray | None, float] | None = None,
         x_group_rows: int = 0) -> np.ndarray:
    """W [rows, cols] (F32 / F16 / Q8_0 bytes) @ x -> float32 [rows]; norm=(w, eps): x RMS-normalised first;
    x_group_rows: row block g reads x[g*cols:(g+1)*cols]."""
    x = np.asarray(x, np.float32).reshape(-1)
    if norm is not None:
        x = ref.rmsnorm(x[:cols], norm[0], norm[1])
    return _rows_dot(W, x, rows, cols, x_group_rows, False).astype(np.float32)


def magnitude(W: np.ndarray, x: np.ndarray, rows: int, cols: int, x_group_rows: int = 0) -> np.ndarray:
    """sum_c |W[r, c] x[c]| per row: what the fp32 tolerance scales with."""
    return _rows_dot(W, np.abs(np.asarray(x, np.float32).reshape(-1)), rows, cols, x_group_rows, True)


def hc_post(f: np.ndarray, X: np.ndarray, mix: np.ndarray, hc: int = 4) -> np.ndarray:
    """X [hc, D] after the epilogue: ref.ops.hc_post with post, comb taken from the mix record."""
    post, comb = mix_parts(mix, hc)[1:]
    return ref.hc_post(np.asarray(f, np.float32)[None], np.asarray(X, np.float32)[None], post[None], comb[None])[0]


def swiglu(g: np.ndarray, u: np.ndarray, clamp: float) -> np.ndarray:
    """silu(min(g, c)) * clamp(u, -c, c), as ref.ops.swiglu applies it (clamp <= 0: none)."""
    g, u = np.asarray(g, np.float32), np.asarray(u, np.float32)
    if clamp > 0:
        g = np.minimum(g, np.float32(clamp))
        u = np.clip(u, np.float32(-clamp), np.float32(clamp))
    return ref.silu(g) * u


def mix_parts(mix: np.ndarray, hc: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A mix record [pre(hc), post(hc), C(hc*hc)] -> (pre, post, comb [hc, hc])."""
    mix = np.asarray(mix, np.float32).reshape(-1)
    return mix[:hc], mix[hc:2 * hc], mix[2 * hc:2 * hc + hc * hc].reshape(hc, hc)


ROUNDINGS = {"q8_0": ref.q8_0_round, "q8_k": ref.q8_k_round}     # Q8_0 weights' x / the K-quants' (Q4_K) x


def act_x(x: np.ndarray, cols: int, norm: tuple[np.ndarray | None, float] | None = None,
          rounding: str = "q8_0") -> np.ndarray:
    """What the int8-activation kernels compute with: x (RMS-normalised first with norm) rounded as the reference's
    act_quant mode rounds the product's input: Q8_0 weights (gemv_q8_0_i8*) ref.ops.q8_0_round, Q4_K
    (gemv_q4_k_i8*, rounding "q8_k") ref.ops.q8_k_round."""
    x = np.asarray(x, np.float32).reshape(-1)[:cols]
    if norm is not None:
        x = ref.rmsnorm(x, norm[0], norm[1])
    return ROUNDINGS[rounding](x[None])[0]


def gemv_i8(W: np.ndarray, x: np.ndarray, rows: int, cols: int,
            norm: tuple[np.ndarray | None, float] | None = None,
            x_group_rows: int = 0, rounding: str = "q8_0") -> tuple[np.ndarray, np.ndarray]:
    """gemv_q8_0_i8 (x_group_rows > 0: gemv_q8_0_i8_grouped, row block g reading group g's x, each group rounded on
    its own) or, rounding "q8_k", gemv_q4_k_i8: (y [rows], sum_c |W x_r| per row) for the rounded x_r = act_x(x):
    the fp32 product the kernel's exact integer block dots equal up to the rounding of its sums."""
    if x_group_rows:
        groups = -(-rows // x_group_rows)
        x = np.asarray(x, np.float32).reshape(-1)[:groups * cols].reshape(groups, cols)
        xr = np.concatenate([act_x(xg, cols, rounding=rounding) for xg in x])
    else:
        xr = act_x(x, cols, norm, rounding)
    return (gemv(W, xr, rows, cols, x_group_rows=x_group_rows),
            magnitude(W, xr, rows, cols, x_group_rows=x_group_rows))
