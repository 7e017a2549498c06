"""numpy twins of cu/compressor.cu: ring stores and the row of a completed group, with ops.compress_pool & co.

The twin works from the whole history of a compressor's inputs (kv and ape-shifted scores of every position so
far) instead of its rings: the kernels must give the same rows whatever the ring holds beyond what a group needs.
"""

from __future__ import annotations

import numpy as np

from ds4py.cuda.twins.attention import rope_tail_mag
from ds4py.ref import ops

F32 = np.float32


def ring_capacity(ratio: int, overlap: bool, spare: int) -> int:
    """Slots a compressor's input rings need (KV_LAYOUT): ratio * (1 + overlap) + the rollback horizon."""
    return ratio * (1 + int(overlap)) + spare


def scores_with_ape(sc_raw: np.ndarray, ape: np.ndarray, positions: np.ndarray, ratio: int) -> np.ndarray:
    """wgate x + ape[p % ratio], in fp32 like the kernels and the reference."""
    return (sc_raw.astype(F32) + ape.astype(F32)[np.asarray(positions) % ratio]).astype(F32)


def group_row(kv_hist: np.ndarray, sc_hist: np.ndarray, g: int, ratio: int, overlap: bool, norm_w: np.ndarray,
              freqs: np.ndarray, rd: int, eps: float, rotate: bool, fake_quant: bool, round_f16: bool = False
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, pre-quant row, magnitude of the pre-quant row) of group g from the per-position history
    kv_hist / sc_hist [positions, (1+overlap)*d] (scores with ape)."""
    lo, hi = g * ratio, (g + 1) * ratio
    prev_kv = prev_sc = None
    if overlap and g > 0:
        prev_kv, prev_sc = kv_hist[lo - ratio:lo], sc_hist[lo - ratio:lo]
    c = ops.compress_pool(kv_hist[lo:hi].astype(F32), sc_hist[lo:hi].astype(F32), ratio, overlap, prev_kv, prev_sc)
    x = ops.rmsnorm(c, norm_w, eps)
    pre = ops.rope_tail(x, np.array([g * ratio]), freqs)
    if rotate:
        pre = ops.hadamard(pre)
    pre = pre[0]
    row = pre.copy()
    d = row.size
    if fake_quant:
        if rotate:
            row = ops.fp4_fake_quant(pre[None], 32)[0]
        else:
            row[: d - rd] = ops.fp8_fake_quant(pre[None, : d - rd], 64)[0]
    if round_f16:
        row = ops.f16_round(row)
    return row, pre, _row_magnitude(kv_hist, sc_hist, g, ratio, overlap, c[0], x[0], norm_w, rd, rotate)


def _row_magnitude(kv_hist, sc_hist, g, ratio, overlap, c, x, norm_w, rd, rotate) -> np.ndarray:
    """First-order bound of the fp32 rounding in pool -> norm -> RoPE (-> Hadamard): the softmax-weighted |kv|
    inflated by |score - max| (through exp), propagated through the norm's scale and its sum of squares."""
    d = c.size
    kv, sc = [], []
    for v in range(ratio * (1 + int(overlap))):
        if overlap and v < ratio:
            p, half = (g - 1) * ratio + v, slice(0, d)
        else:
            p, half = g * ratio + v - (ratio if overlap else 0), slice(d, 2 * d) if overlap else slice(0, d)
        if p >= 0:
            kv.append(kv_hist[p, half])
            sc.append(sc_hist[p, half])
    kv, sc = np.asarray(kv, np.float64), np.asarray(sc, np.float64)
    m = sc.max(0)
    w = np.exp(sc - m)
    mag_c = (w * np.abs(kv) * (2 + np.abs(sc - m))).sum(0) / w.sum(0)
    c64 = c.astype(np.float64)
    r = 1 / np.sqrt(np.mean(c64 * c64) + 1e-30)
    rel = (np.abs(c64) * mag_c).sum() / max((c64 * c64).sum(), 1e-300)
    mag = r * np.abs(norm_w) * mag_c + np.abs(x.astype(np.float64)) * (1 + rel)
    mag = rope_tail_mag(mag, rd)
    if rotate:
        mag = np.full(d, mag.sum() / np.sqrt(d))
    return mag
