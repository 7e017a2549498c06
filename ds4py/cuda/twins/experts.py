"""numpy twins of cu/experts.cu: exact dequantisation (ds4py.quant, bit for bit), and the expert products with the
reference's SwiGLU (ops.silu and the clamps of ops.swiglu), each with the magnitude of its rounding error."""

from __future__ import annotations

import numpy as np

from ds4py.quant import dequantize
from ds4py.ref import ops

F32 = np.float32


def dequant(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    """The exact float32 values of a GGUF tensor's bytes (what moe_dequant_* must reproduce bit for bit)."""
    return dequantize(np.ascontiguousarray(raw).view(np.uint8).reshape(-1), qtype, shape)


def gate_up(Wg: np.ndarray, Wu: np.ndarray, x: np.ndarray, ids: np.ndarray | None, route_w: np.ndarray | None,
            clamp: float, n_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(h [n_slots, ff], magnitude). Wg / Wu: dequantised [n_experts, ff, dim]."""
    ids = np.arange(n_slots) if ids is None else np.asarray(ids[:n_slots], np.int64)
    wts = np.ones(n_slots, F32) if route_w is None else np.asarray(route_w[:n_slots], F32)
    x = x.astype(F32)
    g = np.stack([Wg[e] @ x for e in ids]).astype(F32)
    u = np.stack([Wu[e] @ x for e in ids]).astype(F32)
    x64 = np.abs(x.astype(np.float64))
    mg = np.stack([np.abs(Wg[e].astype(np.float64)) @ x64 for e in ids])
    mu = np.stack([np.abs(Wu[e].astype(np.float64)) @ x64 for e in ids])
    if clamp > 0:
        g = np.minimum(g, F32(clamp))
        u = np.clip(u, F32(-clamp), F32(clamp))
    h = ops.silu(g) * u * wts[:, None]
    mag = (1.1 * np.abs(u) * mg + np.abs(ops.silu(g)) * mu + 4 * np.abs(h)) * np.abs(wts[:, None])
    return h.astype(F32), mag


def down(W: np.ndarray, ids: np.ndarray | None, h: np.ndarray, n_slots: int, add: np.ndarray | None = None,
         hc_post: np.ndarray | None = None, hc_comb: np.ndarray | None = None, hc_x: np.ndarray | None = None
         ) -> tuple[np.ndarray, np.ndarray]:
    """(out, magnitude): y = sum_s W[ids[s]] h[s] (+ add), then optionally ops.hc_post. W: [n_experts, dim, ff]."""
    ids = np.arange(n_slots) if ids is None else np.asarray(ids[:n_slots], np.int64)
    h = h.reshape(-1, W.shape[2])[:n_slots].astype(F32)
    y = np.zeros(W.shape[1], F32)
    mag = np.zeros(W.shape[1])
    for s, e in enumerate(ids):
        y += W[e] @ h[s]
        mag += np.abs(W[e].astype(np.float64)) @ np.abs(h[s].astype(np.float64))
    if add is not None:
        y += add.astype(F32)
        mag += np.abs(add)
    if hc_post is None:
        return y, mag
    hc = hc_post.size
    X = hc_x.reshape(1, hc, -1).astype(F32)
    out = ops.hc_post(y[None], X, hc_post.reshape(1, hc).astype(F32), hc_comb.reshape(1, hc, hc).astype(F32))[0]
    mag_out = np.abs(hc_post)[:, None] * mag[None] + np.abs(hc_comb.reshape(hc, hc)).T @ np.abs(X[0]) + np.abs(out)
    return out, mag_out


def vq_dequant(codes: np.ndarray, stream: np.ndarray, hi: np.ndarray | None, gains: np.ndarray,
               bits: int) -> np.ndarray:
    """VQ-8 experts [X, rows, cols] as the reference decodes them (ds4py.quant.vq.decode_rows: fl32(g * c)), from
    the codebook's E4M3 bytes [K, 8], the index stream [X, rows, nb], the hi plane (13 bits) and gains [X, rows]."""
    from ds4py.quant import vq

    cb = vq.E4M3_F32[np.asarray(codes).view(np.uint8)].astype(F32)
    X = stream.shape[0]
    return np.stack([vq.decode_rows(stream[e], None if hi is None else hi[e], np.asarray(gains[e], F32), cb, bits)
                     for e in range(X)])


# ---- int8 activations (experts.cu moe_gate_up_i8_<fmt> / moe_down_i8_<fmt>, Numerics.act_quant) ----------------
def gate_up_i8(Wg: np.ndarray, Wu: np.ndarray, x: np.ndarray, ids: np.ndarray | None, route_w: np.ndarray | None,
               clamp: float, n_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """gate_up on x rounded as the reference's act_quant mode rounds it for these formats (ops.q8_k_round)."""
    return gate_up(Wg, Wu, ops.q8_k_round(np.asarray(x, F32).reshape(1, -1))[0], ids, route_w, clamp, n_slots)


def down_i8(W: np.ndarray, ids: np.ndarray | None, h: np.ndarray, n_slots: int, add: np.ndarray | None = None,
            hc_post: np.ndarray | None = None, hc_comb: np.ndarray | None = None, hc_x: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """down with each slot's h rounded as ops.q8_k_round (the reference's act_quant mode)."""
    h = ops.q8_k_round(np.asarray(h, F32).reshape(-1, W.shape[2])[:n_slots])
    return down(W, ids, h, n_slots, add, hc_post, hc_comb, hc_x)
