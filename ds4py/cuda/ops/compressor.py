"""Host wrappers of cu/compressor.cu (decode update with on-device emission, prefill pooling + ring store).

The rings and row arrays are the device KV state of one layer (KV_LAYOUT): ring_kv / ring_sc [cap, (1+overlap)*d],
rows [capacity, d]. The caller keeps `rows` large enough for (position+1) // ratio rows (the state grows between
steps; a row past the capacity is dropped rather than written out of bounds); the kernels read the position from
pos_slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.ops.attention import pair_threads
from ds4py.cuda.ops.core import aligned, is_dtype, need

COMP_MAX_THREADS = 1024        # block size limit (merge buffers)
COMP_MAX_D = 1024              # largest rotated row (Hadamard buffer)
DEFINES = {"COMP_MAX_THREADS": COMP_MAX_THREADS, "COMP_MAX_D": COMP_MAX_D}          # -D values of cu/compressor.cu


def comp_threads(d: int, ratio: int, overlap: bool, subs: int | None = None) -> int:
    """Block size: `subs` copies of the 32*ceil(d/64) pair threads; by default one sub per slot of a group, within
    1024 threads (ratio 4 + overlap: 4 subs at d = 512, 8 at d = 128; ratio 128: 4 at d = 512, 16 at d = 128).
    The kernel is one block whose loads are the group's slots: more subs = more of them in flight at once (a
    latency-bound launch on the decode critical path), and the merge over subs stays in sub order."""
    P = pair_threads(d)
    if subs is None:
        subs = max(1, ratio * (1 + int(overlap)))
    return P * max(1, min(subs, COMP_MAX_THREADS // P))


@dataclass(frozen=True)
class CompLayer:
    """One compressor of one layer, the same for every call: its arrays (ape [ratio, (1+overlap)*d] F16 or F32,
    the norm weight [d], RoPE freqs [rd/2]), shapes and numerics. rotate: the indexer's keys (Hadamard-rotated,
    FP4); else the attention's rows (FP8 non-rope part). subs: the block's sub count (None: comp_threads' default)."""
    ape: Any
    norm_w: Any
    freqs: Any
    ratio: int
    overlap: bool
    d: int
    rd: int
    eps: float
    rotate: bool
    fake_quant: bool = True
    round_f16: bool = False
    subs: int | None = None

    @property
    def width(self) -> int:
        return (1 + int(self.overlap)) * self.d

    @property
    def threads(self) -> int:
        return comp_threads(self.d, self.ratio, self.overlap, self.subs)


@dataclass(frozen=True)
class CompState:
    """One compressor's device state: the rings ring_kv / ring_sc [cap, (1+overlap)*d] and its rows [capacity, d]
    (V4.1's v41.compress: no rings at ratio 1; v41.comp_ring_store reads no rows)."""
    ring_kv: Any
    ring_sc: Any
    rows: Any


def _check(where: str, c: CompLayer, st: CompState) -> int:
    ape, norm_w, freqs, ratio, overlap, d, rd = c.ape, c.norm_w, c.freqs, c.ratio, c.overlap, c.d, c.rd
    ring_kv, ring_sc, rows = st.ring_kv, st.ring_sc, st.rows
    width = c.width
    need(ratio >= 1 and d % 2 == 0 and rd % 2 == 0 and 0 < rd <= d, f"{where}: bad ratio {ratio}, d {d} or rd {rd}")
    if c.rotate:
        need(d & (d - 1) == 0 and 32 <= d <= COMP_MAX_D, f"{where}: a rotated (indexer) row needs d a power of two "
             f"in 32..{COMP_MAX_D}, got {d}")
    else:
        need((d - rd) % 64 == 0, f"{where}: the non-rope part ({d - rd}) must be whole FP8 blocks of 64")
    need(tuple(ring_kv.shape[1:]) == (width,) and tuple(ring_sc.shape) == tuple(ring_kv.shape),
         f"{where}: rings must both be [cap, {width}], got {tuple(ring_kv.shape)} and {tuple(ring_sc.shape)}")
    need(ring_kv.shape[0] >= ratio * (1 + int(overlap)), f"{where}: a ring of {ring_kv.shape[0]} slots cannot hold "
         f"a group ({ratio * (1 + int(overlap))} positions)")
    need(tuple(ape.shape) == (ratio, width), f"{where}: ape must be [{ratio}, {width}], got {tuple(ape.shape)}")
    need(np.dtype(ape.dtype) in (np.dtype(np.float16), np.dtype(np.float32)), f"{where}: ape must be F16 or F32")
    need(norm_w.size == d and freqs.size == rd // 2 and len(rows.shape) == 2 and rows.shape[1] == d,
         f"{where}: norm ({norm_w.size}), freqs ({freqs.size}) or rows {tuple(rows.shape)} do not match d {d}")
    need(all(is_dtype(a, np.float32) for a in (norm_w, freqs, ring_kv, ring_sc, rows)),
         f"{where}: rings, rows, norm weight and freqs must be float32")
    need(aligned(8, ape, norm_w, ring_kv, ring_sc, rows), f"{where}: arrays must be 8-byte aligned")
    return width


def compressor_decode(rt: Any, c: CompLayer, st: CompState, kv_in: Any, sc_in: Any, pos_slot: Any,
                      stream: Any = None, pdl: bool = False) -> None:
    """Store this position's kv / score (+ ape) in the rings; emit row pos // ratio when its group completes."""
    width = _check("compressor_decode", c, st)
    need(kv_in.size == width and sc_in.size == width, f"compressor_decode: kv and score inputs must hold {width}")
    rt.launch("compressor_decode", 1, c.threads, kv_in, sc_in, c.ape, int(np.dtype(c.ape.dtype) == np.float32),
              c.norm_w, c.freqs, pos_slot, st.ring_kv, st.ring_sc, st.rows, int(st.rows.shape[0]), int(c.ratio),
              int(c.overlap), int(st.ring_kv.shape[0]), c.d, c.rd, float(c.eps), int(c.rotate), int(c.fake_quant),
              int(c.round_f16), stream=stream, pdl=pdl)


@dataclass(frozen=True)
class CompChunk:
    """One prefill call's chunk: kv / score inputs [n_tok, (1+overlap)*d] of n_tok tokens from the position in
    the int32 device slot pos_slot."""
    kv: Any
    sc: Any
    n_tok: int
    pos_slot: Any


def compressor_prefill(rt: Any, c: CompLayer, st: CompState, chunk: CompChunk, stream: Any = None,
                       pdl: bool = False) -> None:
    """A chunk of n_tok tokens from the position in pos_slot: emit every group it completes, then keep its last
    positions in the rings (two launches, in that order)."""
    chunk_kv, chunk_sc, n_tok, pos_slot = chunk.kv, chunk.sc, chunk.n_tok, chunk.pos_slot
    width = _check("compressor_prefill", c, st)
    need(n_tok >= 1 and chunk_kv.size >= n_tok * width and chunk_sc.size >= n_tok * width,
         f"compressor_prefill: chunk arrays must hold {n_tok} x {width}")
    ape_f32 = int(np.dtype(c.ape.dtype) == np.float32)
    cap = int(st.ring_kv.shape[0])
    rt.launch("compressor_prefill_pool", n_tok // c.ratio + 1, c.threads, chunk_kv, chunk_sc, int(n_tok), c.ape,
              ape_f32, c.norm_w, c.freqs, pos_slot, st.ring_kv, st.ring_sc, st.rows, int(st.rows.shape[0]),
              int(c.ratio), int(c.overlap), cap, c.d, c.rd, float(c.eps), int(c.rotate), int(c.fake_quant),
              int(c.round_f16), stream=stream, pdl=pdl)
    rt.launch("compressor_prefill_store", min(n_tok, cap), 256, chunk_kv, chunk_sc, int(n_tok), c.ape, ape_f32,
              pos_slot, st.ring_kv, st.ring_sc, int(c.ratio), cap, width, stream=stream, pdl=pdl)
