"""numpy twins of cu/prefill_attn.cu: a prefill block's kv rows, its ring store and its attention, built on the
decode twins (ds4py/cuda/twins/attention.py, which call ds4py/ref/ops.py)."""

from __future__ import annotations

import numpy as np

from ds4py.cuda.twins import attention as dec

F32 = np.float32


def kv_rows(kv_raw: np.ndarray, norm_w: np.ndarray, freqs: np.ndarray, pos: np.ndarray, rd: int, eps: float,
            fake_quant: bool, round_f16: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, pre-quant rows, magnitudes) [T, hd]: twins.attention.kv_row of each row at its position."""
    got = [dec.kv_row(kv_raw[t], norm_w, freqs, int(pos[t]), rd, eps, fake_quant, round_f16) for t in range(len(pos))]
    return tuple(np.stack([g[i] for g in got]) for i in range(3))


def ring_store(ring: np.ndarray, blk: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """The ring after the block's last min(T, ring rows) rows went to slot position % ring rows."""
    out = ring.copy()
    kept = min(len(pos), ring.shape[0])
    for j in range(len(pos) - kept, len(pos)):
        out[int(pos[j]) % ring.shape[0]] = blk[j]
    return out


def query_keys(ring: np.ndarray, blk: np.ndarray, p0: int, p: int, window: int, comp: np.ndarray | None, ratio: int,
               sel_row: np.ndarray | None, topk: int) -> np.ndarray:
    """The keys of the query at position p: window rows (before p0 from the ring, from p0 on from blk), then the
    compressed rows (all visible, or the selected ones), in the kernel's order."""
    first = max(0, p - window + 1)
    rows = [blk[q - p0] if q >= p0 else ring[q % ring.shape[0]] for q in range(first, p + 1)]
    keys = [np.stack(rows)]
    if ratio:
        n = (p + 1) // ratio
        if sel_row is not None:
            picks = np.asarray(sel_row[: min(n, topk)], np.int64)
            keys.append(comp[picks[picks >= 0]])           # -1: V4.1's dropped pick, no key
        elif n:
            keys.append(comp[:n])
    return np.concatenate(keys).astype(F32)


def prefill_attention(q_raw: np.ndarray, ring: np.ndarray, blk: np.ndarray, pos: np.ndarray, window: int,
                      comp: np.ndarray | None, ratio: int, sel: np.ndarray | None, topk: int, sinks: np.ndarray,
                      freqs: np.ndarray, n_heads: int, rd: int, eps: float, scale: float,
                      q_norm: bool = True) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(out [T, H, hd], magnitude, keys per query): each query's decode attention twin over its own keys (q_norm:
    the per-head RMS of the queries; V4.1 has none)."""
    outs, mags, counts = [], [], []
    for t, p in enumerate(pos):
        keys = query_keys(ring, blk, int(pos[0]), int(p), window, comp, ratio, None if sel is None else sel[t], topk)
        o, m = dec.decode_attention(q_raw[t], keys, sinks, freqs, int(p), n_heads, rd, eps, scale, q_norm)
        outs.append(o)
        mags.append(m)
        counts.append(keys.shape[0])
    return np.stack(outs), np.stack(mags), counts


def swiglu(g: np.ndarray, u: np.ndarray, clamp: float) -> np.ndarray:
    """ops.swiglu_of's activation on precomputed gate / up rows."""
    from ds4py.ref import ops

    g, u = g.astype(F32), u.astype(F32)
    if clamp > 0:
        g = np.minimum(g, F32(clamp))
        u = np.clip(u, F32(-clamp), F32(clamp))
    return ops.silu(g) * u


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bf16 (ties to even), as float32; inf / NaN unchanged."""
    u = np.asarray(x, F32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(F32)
    return np.where(np.isfinite(x), r, x).astype(F32)


def split_bf16(x: np.ndarray, pieces: int = 2) -> list[np.ndarray]:
    """x's bf16 pieces: p0 = bf16(x), p1 = bf16(x - p0), p2 = bf16(x - p0 - p1); inf / NaN in p0 only."""
    x = np.asarray(x, F32)
    h = bf16_round(x)
    with np.errstate(invalid="ignore"):
        r1 = np.where(np.isfinite(h), (x - h).astype(F32), F32(0)).astype(F32)
    m = bf16_round(r1)
    out = [h, m]
    if pieces > 2:
        out.append(bf16_round((r1 - m).astype(F32)))
    return out
