"""Twin of cu/moe_prefill.cu: the routing bookkeeping exactly (count, exclusive scan, stable scatter by expert,
the work items), and the grouped expert products as the kernels round them: x and the SwiGLU output H on the
bf16 grid, the weights exact (ds4py.quant's values), products in float64, SwiGLU with ref.ops (float32), the
combine in slot order.

What the kernels do differently: fp32 accumulation (per scale group from zero, then scale and min applied in
fp32: w = s c - m is summed as s * sum(x c) - m * sum(x), equal to the exact values' sum up to fp32 rounding). Because H is rounded to bf16 before the down, a kernel H
that differs from the twin's in the last fp32 bit can land on the neighbouring bf16 value, so the down and the
whole MoE are compared within a bf16-level tolerance (2^-8 of the magnitude); each GEMM stage on its own
(down fed the kernel's H) within the fp32 one.

VQ-8 (exact=True: the kernels' three bf16 pieces of x and H): nothing rounded to bf16, so every stage and the whole
MoE are the fp32 reference up to summation order (the weights are the reference's fl32(g * c); the kernels sum
g * sum(c x) per k tile, equal to sum(fl32(g c) x) up to fp32 rounding)."""

from __future__ import annotations

import numpy as np

from ds4py.cuda.twins.mma import bf16_round
from ds4py.ref import ops

F32 = np.float32


def route(ids: np.ndarray, n_experts: int, bm: int, max_tiles: int) -> dict[str, np.ndarray]:
    """offsets [E + 2], sorted [P], pos [P], tile_bucket / tile_row [n_tiles], n_tiles: the pairs p = t*k + s
    sorted by bucket (the expert, or n_experts for an id outside [0, n_experts)), stably (by p within a bucket)."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    bucket = np.where((ids >= 0) & (ids < n_experts), ids, n_experts)
    counts = np.bincount(bucket, minlength=n_experts + 1)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    sorted_ = np.argsort(bucket, kind="stable").astype(np.int32)
    pos = np.empty_like(sorted_)
    pos[sorted_] = np.arange(ids.size, dtype=np.int32)
    tb, tr = [], []
    for b in range(n_experts + 1):
        for r in range(offsets[b], offsets[b + 1], bm):
            tb.append(b)
            tr.append(r)
    assert len(tb) <= max_tiles
    return {"offsets": offsets, "sorted": sorted_, "pos": pos, "tile_bucket": np.array(tb, np.int32),
            "tile_row": np.array(tr, np.int32), "n_tiles": len(tb)}


def _bucket_of_rows(offsets: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(offsets.size - 1), np.diff(offsets))


def _operand(a: np.ndarray, exact: bool) -> np.ndarray:
    """An activation as the tensor cores see it: rounded to bf16, or (exact: three bf16 pieces) as it is."""
    a = np.asarray(a, F32)
    return (a if exact else bf16_round(a)).astype(np.float64)


def gate_up(Wg: np.ndarray, Wu: np.ndarray, x: np.ndarray, wts: np.ndarray | None, r: dict, k: int,
            clamp: float, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(H [P, ff] in sorted order, magnitude). Wg / Wu: dequantised [E, ff, dim]; NaN rows for the bad bucket;
    exact: x as it is (VQ-8), else rounded to bf16."""
    E, ff, dim = Wg.shape
    P = r["sorted"].size
    tok = r["sorted"] // k
    rows = _bucket_of_rows(r["offsets"])
    xb = _operand(np.asarray(x, F32)[:, :dim], exact)
    H = np.full((P, ff), np.nan, F32)
    mag = np.zeros((P, ff))
    w = np.ones(P, F32) if wts is None else np.asarray(wts, F32).reshape(-1)[r["sorted"]]
    for e in range(E):
        sel = np.flatnonzero(rows == e)
        if sel.size == 0:
            continue
        xe = xb[tok[sel]]
        Wge, Wue = Wg[e].astype(np.float64), Wu[e].astype(np.float64)
        g64, u64 = xe @ Wge.T, xe @ Wue.T
        mg, mu = np.abs(xe) @ np.abs(Wge).T, np.abs(xe) @ np.abs(Wue).T
        g, u = g64.astype(F32), u64.astype(F32)
        if clamp > 0:
            g, u = np.minimum(g, F32(clamp)), np.clip(u, F32(-clamp), F32(clamp))
        h = ops.silu(g) * u * w[sel, None]
        H[sel] = h
        mag[sel] = (1.1 * np.abs(u) * mg + np.abs(ops.silu(g)) * mu + 4 * np.abs(h)) * np.abs(w[sel, None])
    return H, mag


def down(W: np.ndarray, H: np.ndarray, r: dict, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(Yp [P, dim] in sorted order, magnitude): bf16(H) (exact: H) @ W[e]^T per row. W: dequantised [E, dim, ff]."""
    E, dim, ff = W.shape
    rows = _bucket_of_rows(r["offsets"])
    Hb = _operand(H, exact)
    Yp = np.full((H.shape[0], dim), np.nan, F32)
    mag = np.zeros((H.shape[0], dim))
    for e in range(E):
        sel = np.flatnonzero(rows == e)
        if sel.size:
            We = W[e].astype(np.float64)
            Yp[sel] = Hb[sel] @ We.T
            mag[sel] = np.abs(Hb[sel]) @ np.abs(We).T
    return Yp, mag


def combine(Yp: np.ndarray, r: dict, T: int, k: int, add: np.ndarray | None = None) -> np.ndarray:
    """y[t] = sum_s Yp[pos[t*k + s]] in slot order (float32), + add[t]."""
    parts = np.asarray(Yp, F32)[r["pos"].reshape(T, k)]
    y = parts[:, 0].copy()
    for s in range(1, k):
        y += parts[:, s]
    if add is not None:
        y += np.asarray(add, F32)
    return y


def moe(Wg: np.ndarray, Wu: np.ndarray, Wd: np.ndarray, x: np.ndarray, ids: np.ndarray, wts: np.ndarray | None,
        clamp: float, bm: int, max_tiles: int, add: np.ndarray | None = None,
        exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(y [T, dim], magnitude): the whole grouped MoE with the kernels' roundings (exact: VQ-8's, none)."""
    T, k = np.asarray(ids).reshape(x.shape[0], -1).shape
    r = route(ids, Wg.shape[0], bm, max_tiles)
    H, hmag = gate_up(Wg, Wu, x, wts, r, k, clamp, exact)
    Yp, _ = down(Wd, H, r, exact)
    rows = _bucket_of_rows(r["offsets"])
    dmag = np.zeros_like(Yp, dtype=np.float64)
    for e in range(Wg.shape[0]):
        sel = np.flatnonzero(rows == e)
        if sel.size:
            dmag[sel] = (np.abs(H[sel]).astype(np.float64) + hmag[sel]) @ np.abs(Wd[e]).astype(np.float64).T
    y = combine(Yp, r, T, k, add)
    mag = dmag[r["pos"].reshape(T, k)].sum(1) + (np.abs(add) if add is not None else 0)
    return y, mag
