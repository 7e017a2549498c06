"""Twin of cu/mhc.cu, from ref.ops: hc_mixes and sinkhorn give the mix record, hc_head the head's collapse,
hc_post the residual update. tests/test_cu_emu_mhc.py pins the record to ref.ops.hc_pre (x, post, comb)."""

from __future__ import annotations

import numpy as np

from ds4py.cuda.twins.gemv import mix_parts
from ds4py.ref import ops as ref

F32 = np.float32


def hc_mix(X: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, norm_eps: float, hc_eps: float,
           iters: int) -> np.ndarray:
    """X [T, hc, D] -> mix records [T, (2+hc)*hc]: pre, post, C (fn with (2+hc)*hc rows), or pre only in the
    first hc entries (the head's fn with hc rows; the rest zero)."""
    X = np.asarray(X, F32)
    T, hc = X.shape[0], X.shape[1]
    fn = np.asarray(fn, F32)
    m = ref.hc_mixes(X, fn, norm_eps)
    out = np.zeros((T, (2 + hc) * hc), F32)
    out[:, :hc] = ref.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + F32(hc_eps)
    if fn.shape[0] > hc:
        out[:, hc:2 * hc] = 2 * ref.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
        comb = ref.sinkhorn((m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc), iters, hc_eps)
        out[:, 2 * hc:] = comb.reshape(T, -1)
    return out


def hc_collapse_norm(X: np.ndarray, mix: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm(sum_j pre_j X_j; w) per token."""
    X = np.asarray(X, F32)
    hc = X.shape[1]
    pre = np.asarray(mix, F32).reshape(X.shape[0], -1)[:, :hc]
    return ref.rmsnorm((pre[:, :, None] * X).sum(1), w, eps)


def hc_post(f: np.ndarray, X: np.ndarray, mix: np.ndarray) -> np.ndarray:
    X = np.asarray(X, F32)
    hc = X.shape[1]
    recs = np.asarray(mix, F32).reshape(X.shape[0], -1)
    parts = [mix_parts(r, hc) for r in recs]
    post = np.stack([p[1] for p in parts])
    comb = np.stack([p[2] for p in parts])
    return ref.hc_post(np.asarray(f, F32), X, post, comb)


def hc_head(X: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, norm_w: np.ndarray | None,
            norm_eps: float, hc_eps: float) -> np.ndarray:
    """The head's input: RMSNorm(hc_head(X); output_norm)."""
    return ref.rmsnorm(ref.hc_head(np.asarray(X, F32), np.asarray(fn, F32), scale, base, norm_eps, hc_eps), norm_w,
                       norm_eps)
