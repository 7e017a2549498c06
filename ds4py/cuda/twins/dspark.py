"""numpy twins of V4.1's DSpark kernels (cu/dspark.cu, and cu/prefill_attn.cu's block-keys attention), from
ds4py/ref/ops.py's pieces in ref/forward.py's and ref/dspark.py's order."""

from __future__ import annotations

import numpy as np

from ds4py.cuda.twins import attention as dec
from ds4py.ref import ops

F32 = np.float32


def hc_sum(X: np.ndarray, mix: np.ndarray | None, scale: float) -> np.ndarray:
    """[T, D]: the taps' mean over the copies (mix None, scale 1 / hc: ref/forward.py's X.mean(1)) or the hidden
    sum_j pre_j X_j (ops.hc_collapse) times scale."""
    X = np.asarray(X, F32)
    if mix is None:
        return (X.mean(axis=1) if scale == 1.0 / X.shape[1] else X.sum(axis=1) * F32(scale)).astype(F32)
    return (ops.hc_collapse(X, np.asarray(mix, F32)) * F32(scale)).astype(F32)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A block position's logits: its base logits plus its Markov bias (ref/dspark.py's DraftBlock.position)."""
    return (np.asarray(a, F32) + np.asarray(b, F32)).astype(F32)


def block_keys(ring: np.ndarray, blk: np.ndarray, t: int, window: int) -> np.ndarray:
    """Every block query's keys (ref/dspark.py's _attend): the ring's positions max(0, t - W + 1) .. t (slot
    position % ring rows), then all block rows."""
    old = np.arange(max(0, t - window + 1), t + 1)
    return np.concatenate([ring[old % ring.shape[0]], blk]).astype(F32)


def dspark_attention(q_raw: np.ndarray, ring: np.ndarray, blk: np.ndarray, pos: np.ndarray, window: int,
                     sinks: np.ndarray, freqs: np.ndarray, n_heads: int, rd: int, eps: float,
                     scale: float) -> tuple[np.ndarray, np.ndarray, int]:
    """(out [B, H, hd], magnitude, keys per query): each block query's decode attention twin (no per-head q norm)
    over block_keys (pos[0] = t + 1)."""
    keys = block_keys(ring, blk, int(pos[0]) - 1, window)
    outs, mags = [], []
    for i, p in enumerate(pos):
        o, m = dec.decode_attention(q_raw[i], keys, sinks, freqs, int(p), n_heads, rd, eps, scale, q_norm=False)
        outs.append(o)
        mags.append(m)
    return np.stack(outs), np.stack(mags), keys.shape[0]
