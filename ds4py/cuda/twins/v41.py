"""numpy twins of cu/v41.cu, from ds4py/ref/ops.py's pieces in ref/forward.py's and ref/v41.py's order: the window
kv row (RMSNorm, RoPE, FP8 in blocks of 32), the indexer query (RoPE, FP4), the compressor's group row (pool,
RMSNorm, RoPE at g·r, NVFP4) and latent, the indexer key from the latent, the candidate blocks, Engram's gate."""

from __future__ import annotations

import numpy as np

from ds4py import engram as engram_tables
from ds4py.ref import ops, v41

F32 = np.float32


def kv_row(kv_raw: np.ndarray, norm_w: np.ndarray, freqs: np.ndarray, pos: int, eps: float,
           fake_quant: bool) -> tuple[np.ndarray, np.ndarray]:
    """(row, pre-quant row) of one position."""
    pre = ops.rope_tail(ops.rmsnorm(kv_raw[None], norm_w, eps), np.array([pos]), freqs)[0]
    return (ops.fp8_fake_quant(pre, 32) if fake_quant else pre.copy()), pre


def index_q(q_raw: np.ndarray, freqs: np.ndarray, pos: int, fake_quant: bool) -> tuple[np.ndarray, np.ndarray]:
    """(q, pre-quant q) for q_raw [IH, ihd] at pos."""
    pre = ops.rope_tail(q_raw[None].astype(F32), np.array([pos]), freqs)[0]
    return (ops.fp4_fake_quant(pre, 32) if fake_quant else pre.copy()), pre


def group_row(kv: np.ndarray, sc: np.ndarray | None, g: int, ratio: int, norm_w: np.ndarray, freqs: np.ndarray,
              eps: float, fake_quant: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, pre-quant row, latent) of group g from every position's inputs kv / sc [positions, d]."""
    k = kv[g * ratio:(g + 1) * ratio]
    pooled = k if sc is None else ops.compress_pool(k, sc[g * ratio:(g + 1) * ratio], ratio, False)
    lat = ops.rmsnorm(pooled, norm_w, eps)
    pre = ops.rope_tail(lat, np.array([g * ratio]), freqs)
    return (ops.nvfp4_fake_quant(pre, 16) if fake_quant else pre.copy())[0], pre[0], lat[0]


def index_key(k_raw: np.ndarray, k_norm: np.ndarray, freqs: np.ndarray, g: int, ratio: int, eps: float,
              fake_quant: bool) -> tuple[np.ndarray, np.ndarray]:
    """(key, pre-quant key) of group g from wk . latent."""
    pre = ops.rope_tail(ops.rmsnorm(k_raw[None], k_norm, eps), np.array([g * ratio]), freqs)
    return (ops.fp4_fake_quant(pre, 32) if fake_quant else pre.copy())[0], pre[0]


def candidates(scores: np.ndarray, pos: int, ratio: int, n_blocks: int, block: int) -> np.ndarray:
    """int32 [n visible]: 1 inside the candidate blocks (ref/v41.candidate_blocks over the visible scores)."""
    n = (pos + 1) // ratio
    return v41.candidate_blocks(scores[None, :n], np.array([pos]), ratio, n_blocks, block)[0].astype(np.int32)


def drop_masked(scores: np.ndarray, sel: np.ndarray, pos: int, ratio: int, k: int) -> np.ndarray:
    """int32 [k]: the picks sel of one row with those at a -inf score (outside the candidates) set to -1; the
    first min(k, visible) are read, the rest kept (ref/forward.topk_mask keeps only finite picks)."""
    out = np.array(sel, np.int32)
    n = min(k, (pos + 1) // ratio)
    out[:n] = np.where(np.isneginf(scores[out[:n]]), -1, out[:n])
    return out


def engram(X: np.ndarray, kv: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """ref/v41.engram's update of X [T, hc, D] from kv = wkv . rows [T, (hc + 1) D] and weight = q_w * k_w."""
    T, hc, D = X.shape
    key, value = kv[:, :hc * D].reshape(T, hc, D), kv[:, hc * D:]
    rstd = (F32(1) / np.sqrt((X * X).mean(-1) + F32(eps))) * (F32(1) / np.sqrt((key * key).mean(-1) + F32(eps)))
    dot = (X * weight * key).sum(-1) * rstd * F32(D ** -0.5)
    gate = ops.sigmoid(np.copysign(np.sqrt(np.maximum(np.abs(dot), F32(1e-6))), dot))
    return X + gate[:, :, None] * value[:, None, :]


def engram_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Engram table rows from their stored codes [T, n] and scales [T, n / 32] (the reference's dequantisation)."""
    return engram_tables.dequantise_rows(codes, scales)
