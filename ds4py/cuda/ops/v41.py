"""Launch wrappers of cu/v41.cu: the kernels only V4.1 Flash needs (docs/v41.md, docs/cuda.md "V4.1"). Every
wrapper takes its rows' positions as an int32 device array (a row set's slot view), so decode (one row), a
multi-row step (one launch per row) and a prefill block (all rows) share the kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.ops.attention import KvRow, pair_threads
from ds4py.cuda.ops.compressor import CompState
from ds4py.cuda.ops.core import aligned, is_dtype, need
from ds4py.cuda.ops.indexer import IndexQuery
from ds4py.cuda.ops.topk import ScoreRows

V41_THREADS = 256          # block of v41_candidates and v41_engram


def _f32(*arrays: Any) -> bool:
    return all(a is None or is_dtype(a, np.float32) for a in arrays)


@dataclass(frozen=True)
class RawRows:
    """One call's raw key (or kv) rows: raw [n_rows, width] float32 at the int32 positions pos [n_rows]."""
    raw: Any
    pos: Any
    n_rows: int


def kv_rows(rt: Any, kr: KvRow, rows: RawRows, out: Any, ring: bool = True, stream: Any = None,
            pdl: bool = False) -> None:
    """out <- FP8_32(RoPE(RMSNorm(raw[r]; norm_w))) for n_rows rows at pos[r]: into ring slot pos % len(out)
    (ring) or row r of a block buffer."""
    kv_raw, pos, n_rows = rows.raw, rows.pos, rows.n_rows
    norm_w, freqs, hd, rd = kr.norm_w, kr.freqs, kr.hd, kr.rd
    need(hd % 64 == 0 and rd % 2 == 0 and 0 < rd <= hd, f"v41_kv_rows: head dim {hd} must be whole blocks of 64")
    need(kv_raw.size >= n_rows * hd and norm_w.size == hd and freqs.size == rd // 2 and pos.size >= n_rows,
         "v41_kv_rows: kv, norm, freqs or positions do not match")
    need(len(out.shape) == 2 and out.shape[1] == hd and (ring or out.shape[0] >= n_rows),
         f"v41_kv_rows: out {tuple(out.shape)} is not [rows, {hd}]")
    need(_f32(kv_raw, norm_w, freqs, out) and is_dtype(pos, np.int32) and aligned(8, kv_raw, norm_w, out),
         "v41_kv_rows: 8-byte aligned float32 arrays and int32 positions expected")
    rt.launch("v41_kv_rows", n_rows, pair_threads(hd), kv_raw, norm_w, freqs, pos, out,
              int(out.shape[0]) if ring else 0, hd, rd, float(kr.eps), int(kr.fake_quant), int(kr.round_f16),
              stream=stream, pdl=pdl)


def index_q(rt: Any, iq: IndexQuery, q_raw: Any, pos: Any, q: Any, n_rows: int, stream: Any = None,
            pdl: bool = False) -> None:
    """q [n_rows, n_heads, ihd] = FP4_32(RoPE(q_raw at pos[r])) (V4.1's indexer queries: no Hadamard)."""
    freqs, n_heads, ihd, rd, fake_quant = iq.freqs, iq.n_heads, iq.ihd, iq.rd, iq.fake_quant
    need(ihd % 32 == 0 and rd % 2 == 0 and 0 < rd <= ihd and freqs.size == rd // 2,
         f"v41_index_q: head dim {ihd} (whole FP4 blocks of 32) or {freqs.size} freqs for {rd} rope dims")
    need(q_raw.size >= n_rows * n_heads * ihd and q.size >= n_rows * n_heads * ihd and pos.size >= n_rows,
         f"v41_index_q: q is not [{n_rows}, {n_heads}, {ihd}]")
    need(_f32(q_raw, freqs, q) and is_dtype(pos, np.int32) and aligned(8, q_raw, q),
         "v41_index_q: 8-byte aligned float32 arrays and int32 positions expected")
    rt.launch("v41_index_q", (n_heads, n_rows), pair_threads(ihd), q_raw, freqs, pos, q, n_heads, ihd, rd,
              int(fake_quant), stream=stream, pdl=pdl)


@dataclass(frozen=True)
class CompRows:
    """One call's compressor inputs: kv_in / sc_in [n_rows, d] (sc_in None: ratio 1, no gate) at the int32
    positions pos [n_rows] (consecutive), and lat [n_rows, d] for the normalised latents (None: not kept)."""
    kv_in: Any
    sc_in: Any | None
    pos: Any
    n_rows: int
    lat: Any | None = None


def compress(rt: Any, kr: KvRow, ratio: int, st: CompState, src: CompRows, stream: Any = None,
             pdl: bool = False) -> None:
    """A kv source's compressor over n_rows consecutive positions pos[0..n): every group a row completes pooled
    (ratio 1: sc_in None, the row itself), normalised (kr's norm; lat[r] <- the latent when lat is given), roped at
    g*ratio and NVFP4-quantised into st.rows[g]. Positions before pos[0] come from st's rings (ratio > 1; None at
    ratio 1); store the rows' inputs with comp_ring_store afterwards."""
    kv_in, sc_in, pos, n_rows, lat = src.kv_in, src.sc_in, src.pos, src.n_rows, src.lat
    ring_kv, ring_sc, rows = st.ring_kv, st.ring_sc, st.rows
    norm_w, freqs, d, rd = kr.norm_w, kr.freqs, kr.hd, kr.rd
    gated = sc_in is not None
    need(ratio >= 1 and gated == (ratio > 1), f"v41_compress: ratio {ratio} {'needs' if ratio > 1 else 'has no'} "
         f"gate scores")
    need(d % 64 == 0 and rd % 2 == 0 and 0 < rd <= d and norm_w.size == d and freqs.size == rd // 2,
         f"v41_compress: d {d} (whole blocks of 64), norm or freqs do not match")
    need(kv_in.size >= n_rows * d and (not gated or sc_in.size >= n_rows * d) and pos.size >= n_rows,
         f"v41_compress: inputs are not [{n_rows}, {d}]")
    need(not gated or (ring_kv is not None and ring_sc is not None and tuple(ring_kv.shape) == tuple(ring_sc.shape)
                       and ring_kv.shape[1:] == (d,) and ring_kv.shape[0] >= ratio),
         f"v41_compress: a gated compressor needs two rings [>= {ratio}, {d}]")
    need(len(rows.shape) == 2 and rows.shape[1] == d and (lat is None or lat.size >= n_rows * d),
         f"v41_compress: rows {tuple(rows.shape)} or the latent buffer do not match d {d}")
    need(_f32(kv_in, sc_in, ring_kv, ring_sc, norm_w, freqs, rows, lat) and is_dtype(pos, np.int32)
         and aligned(8, kv_in, sc_in, ring_kv, ring_sc, norm_w, rows, lat),
         "v41_compress: 8-byte aligned float32 arrays and int32 positions expected")
    cap = int(ring_kv.shape[0]) if gated else 1
    rt.launch("v41_compress", n_rows, pair_threads(d), kv_in, sc_in, ring_kv, ring_sc, norm_w, freqs, pos, rows,
              int(rows.shape[0]), lat, int(ratio), cap, d, rd, float(kr.eps), int(kr.fake_quant),
              int(kr.round_f16), stream=stream, pdl=pdl)


def comp_ring_store(rt: Any, st: CompState, src: CompRows, stream: Any = None, pdl: bool = False) -> None:
    """The last min(n_rows, ring slots) rows' compressor inputs into st's rings at slot pos[r] % slots (st.rows is
    not touched)."""
    kv_in, sc_in, pos, n_rows, ring_kv, ring_sc = src.kv_in, src.sc_in, src.pos, src.n_rows, st.ring_kv, st.ring_sc
    need(ring_kv is not None and ring_sc is not None and len(ring_kv.shape) == 2 and sc_in is not None,
         "v41_comp_ring_store: a gated compressor's rings and gate scores expected")
    d = int(ring_kv.shape[1])
    need(tuple(ring_kv.shape) == tuple(ring_sc.shape), f"v41_comp_ring_store: rings must both be [cap, {d}]")
    need(kv_in.size >= n_rows * d and sc_in.size >= n_rows * d and pos.size >= n_rows and is_dtype(pos, np.int32)
         and _f32(kv_in, sc_in, ring_kv, ring_sc), f"v41_comp_ring_store: inputs are not float32 [{n_rows}, {d}]")
    n = min(n_rows, int(ring_kv.shape[0])) * d
    rt.launch("v41_comp_ring_store", max(1, min(64, -(-n // V41_THREADS))), V41_THREADS, kv_in, sc_in, pos, ring_kv,
              ring_sc, n_rows, int(ring_kv.shape[0]), d, stream=stream, pdl=pdl)


def index_keys(rt: Any, kr: KvRow, rows: RawRows, keys: Any, ratio: int, stream: Any = None,
               pdl: bool = False) -> None:
    """keys[g] = FP4_32(RoPE(RMSNorm(raw[r]; k_norm) at g*ratio)) for every row r completing group g (kr: the
    indexer's key norm k_norm [ihd], freqs, ihd, rd)."""
    k_raw, pos, n_rows = rows.raw, rows.pos, rows.n_rows
    k_norm, freqs, ihd, rd = kr.norm_w, kr.freqs, kr.hd, kr.rd
    need(ihd % 32 == 0 and rd % 2 == 0 and 0 < rd <= ihd and k_norm.size == ihd and freqs.size == rd // 2,
         f"v41_index_keys: head dim {ihd}, k_norm or freqs do not match")
    need(k_raw.size >= n_rows * ihd and pos.size >= n_rows and len(keys.shape) == 2 and keys.shape[1] == ihd,
         f"v41_index_keys: k_raw or keys {tuple(keys.shape)} are not [*, {ihd}]")
    need(_f32(k_raw, k_norm, freqs, keys) and is_dtype(pos, np.int32) and aligned(8, k_raw, k_norm, keys),
         "v41_index_keys: 8-byte aligned float32 arrays and int32 positions expected")
    rt.launch("v41_index_keys", n_rows, pair_threads(ihd), k_raw, k_norm, freqs, pos, keys, int(keys.shape[0]),
              int(ratio), ihd, rd, float(kr.eps), int(kr.fake_quant), int(kr.round_f16), stream=stream, pdl=pdl)


def candidates(rt: Any, sr: ScoreRows, cand: Any, n_blocks: int, block: int, mask: bool, stream: Any = None,
               pdl: bool = False) -> None:
    """mask False: cand[r] <- the rows of the n_blocks candidate blocks (of `block` rows) of scores[r]; mask True:
    scores[r] <- -inf outside cand[r]. cand [n_rows, stride] like the scores."""
    scores, pos, n_rows, stride, ratio = sr.scores, sr.pos, sr.n_rows, sr.stride, sr.ratio
    need(n_blocks >= 1 and block >= 1 and ratio >= 1, "v41_candidates: blocks, block size and ratio must be >= 1")
    need(scores.size >= n_rows * stride and cand.size >= n_rows * stride and pos.size >= n_rows,
         f"v41_candidates: scores / cand are not [{n_rows}, {stride}]")
    need(is_dtype(scores, np.float32) and is_dtype(cand, np.int32) and is_dtype(pos, np.int32),
         "v41_candidates: float32 scores, int32 cand and positions expected")
    rt.launch("v41_candidates", n_rows, V41_THREADS, scores, cand, pos, int(stride), int(ratio), int(n_blocks),
              int(block), int(mask), stream=stream, pdl=pdl)


def drop_masked(rt: Any, sr: ScoreRows, sel: Any, k: int, stream: Any = None, pdl: bool = False) -> None:
    """sel[r, c] <- -1 for the picks of the top-k of masked scores that lie outside the candidates (score -inf):
    the attention kernels skip them, as the reference keeps only finite picks. sel [n_rows, k] int32."""
    scores, pos, n_rows, stride, ratio = sr.scores, sr.pos, sr.n_rows, sr.stride, sr.ratio
    need(k >= 1 and ratio >= 1, "v41_drop_masked: k and ratio must be >= 1")
    need(scores.size >= n_rows * stride and sel.size >= n_rows * k and pos.size >= n_rows,
         f"v41_drop_masked: scores / sel are not [{n_rows}, {stride}] / [{n_rows}, {k}]")
    need(is_dtype(scores, np.float32) and is_dtype(sel, np.int32) and is_dtype(pos, np.int32),
         "v41_drop_masked: float32 scores, int32 picks and positions expected")
    rt.launch("v41_drop_masked", n_rows, 32, scores, sel, pos, int(stride), int(ratio), int(k), stream=stream,
              pdl=pdl)


@dataclass(frozen=True)
class EngramLayer:
    """One Engram's per-layer part: weight [hc, D] = q_w * k_w, the hc copies of a residual row, its width D and
    the RMSNorm eps."""
    weight: Any
    hc: int
    dim: int
    eps: float


def engram(rt: Any, layer: EngramLayer, X: Any, kv: Any, n_rows: int, stream: Any = None, pdl: bool = False) -> None:
    """X [n_rows, hc, D] += Engram's gated value (kv [n_rows, (hc + 1) D] = wkv . rows)."""
    weight, hc, D = layer.weight, layer.hc, layer.dim
    need(X.size >= n_rows * hc * D and kv.size >= n_rows * (hc + 1) * D and weight.size == hc * D,
         f"v41_engram: X, kv or weight do not match [{n_rows}, {hc}, {D}]")
    need(_f32(X, kv, weight), "v41_engram: float32 arrays expected")
    rt.launch("v41_engram", (n_rows, hc), V41_THREADS, X, kv, weight, D, float(layer.eps), stream=stream, pdl=pdl)


def engram_rows(rt: Any, codes: Any, scales: Any, rows: Any, n: int, stream: Any = None, pdl: bool = False) -> None:
    """rows [n] = bf16(e4m3(codes) * 2^(scales - 127)), one e8m0 scale per 32 codes (Engram's staged table rows)."""
    need(n % 32 == 0 and codes.size >= n and scales.size >= n // 32 and rows.size >= n,
         f"v41_engram_rows: {n} codes (whole groups of 32), their scales and rows expected")
    need(is_dtype(codes, np.uint8) and is_dtype(scales, np.uint8) and is_dtype(rows, np.float32),
         "v41_engram_rows: uint8 codes and scales, float32 rows expected")
    rt.launch("v41_engram_rows", max(1, min(64, -(-n // V41_THREADS))), V41_THREADS, codes, scales, rows, int(n),
              stream=stream, pdl=pdl)
