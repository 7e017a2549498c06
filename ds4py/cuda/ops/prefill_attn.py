"""Host wrappers of cu/prefill_attn.cu: the kv rows of a prefill block, its window-ring store, and the block's
attention (every query row against its window + compressed rows + sink, one pass with a running softmax).

Positions come from a device int32 array pos [T] (consecutive: pos[t] = pos[0] + t); the window ring is the
state's, read for positions before the block and written (prefill_ring_store) only after the attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.ops.attention import AttnKeys, AttnLayer, KvRow, pair_threads
from ds4py.cuda.ops.core import aligned, is_dtype, need

PFA_TILE = 16                  # keys staged per tile
PFA_HPW = 4                    # heads per warp
PFA_MAX_HD = 512               # largest head dim
DEFINES = {"PFA_TILE": PFA_TILE, "PFA_HPW": PFA_HPW, "PFA_MAX_HD": PFA_MAX_HD}   # -D values of cu/prefill_attn.cu


def kv_rows(rt: Any, kr: KvRow, kv_raw: Any, pos: Any, blk: Any, n_rows: int, stream: Any = None,
            pdl: bool = False) -> None:
    """blk[t] = FP8(RoPE(RMSNorm(kv_raw[t]; norm_w), pos[t])) for the block's n_rows rows (attn_kv_store's row)."""
    norm_w, freqs, hd, rd = kr.norm_w, kr.freqs, kr.hd, kr.rd
    need(hd % 2 == 0 and rd % 2 == 0 and 0 < rd <= hd and (hd - rd) % 64 == 0,
         f"prefill_kv_rows: head dim {hd} with {rd} rope dims needs even sizes and a non-rope part in blocks of 64")
    need(n_rows >= 1 and kv_raw.size >= n_rows * hd and blk.size >= n_rows * hd and norm_w.size == hd
         and freqs.size == rd // 2 and pos.size >= n_rows,
         f"prefill_kv_rows: kv, rows, norm or freqs do not match {n_rows} x {hd}")
    need(all(is_dtype(a, np.float32) for a in (kv_raw, norm_w, freqs, blk)) and is_dtype(pos, np.int32),
         "prefill_kv_rows: float32 arrays and int32 positions expected")
    need(aligned(8, kv_raw, norm_w, blk), "prefill_kv_rows: kv, norm weight and rows must be 8-byte aligned")
    rt.launch("prefill_kv_rows", int(n_rows), pair_threads(hd), kv_raw, norm_w, freqs, pos, blk, hd, rd,
              float(kr.eps), int(kr.fake_quant), int(kr.round_f16), stream=stream, pdl=pdl)


def ring_store(rt: Any, blk: Any, n_rows: int, pos: Any, ring: Any, stream: Any = None, pdl: bool = False) -> None:
    """The block's last min(n_rows, ring rows) kv rows into the window ring at slot position % ring rows."""
    need(len(ring.shape) == 2 and ring.shape[1] % 2 == 0, "prefill_ring_store: the ring must be [rows, even width]")
    hd = int(ring.shape[1])
    need(n_rows >= 1 and blk.size >= n_rows * hd and pos.size >= n_rows and is_dtype(pos, np.int32),
         f"prefill_ring_store: rows must be [{n_rows}, {hd}] with int32 positions")
    need(aligned(8, blk, ring), "prefill_ring_store: rows and ring must be 8-byte aligned")
    rt.launch("prefill_ring_store", min(int(n_rows), int(ring.shape[0])), 128, blk, int(n_rows), pos, ring,
              int(ring.shape[0]), hd, stream=stream, pdl=pdl)


def attn_smem(hd: int, warps: int) -> int:
    return (PFA_TILE * (hd + 4) + warps * PFA_HPW * (hd + PFA_TILE)) * 4


def prefill_warps(n_heads: int, warps: int = 4) -> int:
    return max(1, min(warps, -(-n_heads // PFA_HPW)))


@dataclass(frozen=True)
class PrefillRows:
    """One block attention's per-call arrays: the queries [T, H, hd], the int32 positions [T] (consecutive), the
    block's kv rows [T, hd] and the output [T, H, hd], for T = n_rows."""
    q_raw: Any
    pos: Any
    blk: Any
    out: Any
    n_rows: int


def prefill_attention(rt: Any, layer: AttnLayer, keys: AttnKeys, rows: PrefillRows, stream: Any = None,
                      pdl: bool = False, block_keys: bool = False, warps: int = 4) -> None:
    """out [T, H, hd] = attention of each query row of the block over its window (the ring before the block,
    rows.blk inside it) + compressed rows (all visible, or keys.sel [T, topk]) + sink; one launch. block_keys
    (V4.1's DSpark draft): every query row sees the ring's window before the block (positions pos[0] - window ..
    pos[0] - 1, from 0) and all T block rows (ratio 0, no sel)."""
    ring, comp, ratio, sel, topk = keys.ring, keys.comp, keys.ratio, keys.sel, keys.topk
    q_raw, pos, blk, out, n_rows = rows.q_raw, rows.pos, rows.blk, rows.out, rows.n_rows
    n_heads, rd, window = layer.n_heads, layer.rope_dim, layer.window
    hd = int(ring.shape[1]) if len(ring.shape) == 2 else 0
    need(hd % 8 == 0 and 0 < hd <= PFA_MAX_HD, f"prefill attention: head dim {hd} must be a multiple of 8 up to "
         f"{PFA_MAX_HD}")
    need(n_rows >= 1 and q_raw.size >= n_rows * n_heads * hd and out.size >= n_rows * n_heads * hd
         and blk.size >= n_rows * hd and pos.size >= n_rows and is_dtype(pos, np.int32),
         f"prefill attention: q, out or rows are not [{n_rows}, {n_heads}, {hd}]")
    need(ring.shape[0] >= window >= 1, f"prefill attention: window ring {tuple(ring.shape)} must hold {window} rows")
    need(ratio >= 0 and (ratio == 0 or (comp is not None and comp.shape[-1] == hd)),
         "prefill attention: a compressed layer needs its compressed rows [n, hd]")
    need(sel is None or (ratio > 0 and is_dtype(sel, np.int32) and topk >= 1 and sel.size >= n_rows * topk),
         "prefill attention: sel must be int32 [rows, topk]")
    need(not block_keys or (ratio == 0 and sel is None), "prefill attention: block keys take no compressed rows")
    need(layer.freqs.size == rd // 2 and (hd - rd) % 2 == 0 and layer.sinks.size == n_heads,
         "prefill attention: freqs or sinks mismatch")
    need(aligned(16, q_raw, ring, blk, comp, out), "prefill attention: q, ring, rows and out must be 16-byte aligned")
    w = prefill_warps(n_heads, warps)
    groups = -(-n_heads // (PFA_HPW * w))
    rt.launch("attn_prefill", (groups, int(n_rows)), 32 * w, q_raw, layer.freqs, pos, ring, int(ring.shape[0]), blk,
              int(window), comp if comp is not None else ring, int(ratio), sel, int(topk), layer.sinks, out,
              int(n_heads), hd, int(rd), float(layer.eps), float(layer.scale), int(layer.q_norm),
              int(n_rows) if block_keys else 0, smem=attn_smem(hd, w), stream=stream, pdl=pdl)


def swiglu(rt: Any, g: Any, u: Any, h: Any, n: int, clamp: float, stream: Any = None, pdl: bool = False) -> None:
    """h[:n] = silu(min(g, c)) * clamp(u, -c, c) (clamp <= 0: none), elementwise."""
    need(n >= 1 and g.size >= n and u.size >= n and h.size >= n
         and all(is_dtype(a, np.float32) for a in (g, u, h)), f"prefill_swiglu: float32 arrays of {n} values")
    rt.launch("prefill_swiglu", -(-int(n) // 256), 256, g, u, h, int(n), float(clamp), stream=stream, pdl=pdl)


def split_bf16(rt: Any, x: Any, pieces: list, n: int, stream: Any = None, pdl: bool = False) -> None:
    """pieces (2 or 3 float32 arrays)[:n] = x's bf16 pieces (p0 = bf16(x), p1 = bf16(x - p0), p2 = bf16(rest))."""
    need(len(pieces) in (2, 3), "prefill_split_bf16: 2 or 3 pieces")
    need(n >= 1 and x.size >= n and all(p.size >= n for p in pieces)
         and all(is_dtype(a, np.float32) for a in (x, *pieces)),
         f"prefill_split_bf16: float32 arrays of {n} values")
    p2 = pieces[2] if len(pieces) == 3 else None
    rt.launch("prefill_split_bf16", -(-int(n) // 256), 256, x, pieces[0], pieces[1], p2, int(n), len(pieces),
              stream=stream, pdl=pdl)
