"""numpy twins of cu/indexer.cu: the indexer's query preparation and scores (ds4py/ref/ops.py's rope_tail, hadamard,
fp4_fake_quant; ref/forward.indexer_scores's sum)."""

from __future__ import annotations

import numpy as np

from ds4py.host.indexer import weight_scale  # noqa: F401 (the twin's name)
from ds4py.ref import ops

F32 = np.float32


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

