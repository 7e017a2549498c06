"""numpy twins of cu/indexer.cu and cu/topk.cu: the indexer's query preparation, scores and exact top-k.

The math is ds4py/ref/ops.py's (rope_tail, hadamard, fp4_fake_quant) and ref/forward.indexer_scores's; the top-k
twin spells out the kernel's documented tie rule (the lowest indices win), which ref/forward.topk_mask leaves to
numpy's argpartition.
"""

from __future__ import annotations

import numpy as np

from ds4py.ref import ops

F32 = np.float32


def weight_scale(ihd: int, ih: int) -> float:
    """The fp32 factor on proj(x): ihd^-0.5 * IH^-0.5, rounded once like the reference."""
    return float(F32(ihd ** -0.5 * ih ** -0.5))


def q_prep(q_raw: np.ndarray, freqs: np.ndarray, pos: int, fake_quant: bool
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, pre-quant q, magnitude of the pre-quant q): RoPE at pos, Hadamard, FP4 in blocks of 32. q_raw [IH, ihd]."""
    ih, ihd = q_raw.shape
    pre = ops.hadamard(ops.rope_tail(q_raw[None].astype(F32), np.array([pos]), freqs))[0]
    q = ops.fp4_fake_quant(pre, 32) if fake_quant else pre.copy()
    a = np.abs(q_raw.astype(np.float64))
    rd = 2 * freqs.size
    pair = a[:, -rd:].reshape(ih, rd // 2, 2).sum(-1)
    a[:, -rd:] = np.repeat(pair, 2, axis=-1)
    mag = np.repeat(a.sum(1, keepdims=True) / np.sqrt(ihd), ihd, axis=1)
    return q, pre, mag


def scores(q: np.ndarray, w_raw: np.ndarray, wscale: float, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(score [n], magnitude): sum_h (w_h * wscale) * relu(q_h . k) for every key row."""
    wts = (w_raw.astype(F32) * F32(wscale)).astype(F32)
    s = (np.maximum(q.astype(F32) @ keys.astype(F32).T, 0) * wts[:, None]).sum(0)
    mag = np.abs(wts.astype(np.float64)) @ (np.abs(q.astype(np.float64)) @ np.abs(keys.astype(np.float64)).T)
    return s.astype(F32), mag


def topk_key(x: np.ndarray) -> np.ndarray:
    """The kernel's order-preserving uint32 key of a float32."""
    u = np.asarray(x, F32).view(np.uint32)
    return np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, ascending; ties at the k-th value go to the lowest indices."""
    n = len(scores)
    if n <= k:
        return np.arange(n, dtype=np.int32)
    order = np.lexsort((np.arange(n), -topk_key(scores).astype(np.int64)))
    return np.sort(order[:k]).astype(np.int32)
