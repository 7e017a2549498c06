"""Host wrappers of cu/indexer.cu: the indexer query preparation and its scores over the visible keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.ops.attention import pair_threads
from ds4py.cuda.ops.core import aligned, is_dtype, need

IDX_MAX_DIM = 1024             # Hadamard buffer
IDX_MAX_HEADS = 256            # weight buffer
IDX_THREADS = 256              # block of indexer_scores: 16 key lanes x 16 head groups
IDX_KT = 64                    # = IDX_KT in cu/indexer.cu: keys per tile (16 key lanes x 4)
IDX_KT_SMALL = 16              # the decode launch's tile while the blocks it gives fit the grid cap (one key a lane)
DEFINES = {"IDX_MAX_DIM": IDX_MAX_DIM, "IDX_MAX_HEADS": IDX_MAX_HEADS, "IDX_THREADS": IDX_THREADS}  # cu/indexer.cu


@dataclass(frozen=True)
class IndexQuery:
    """How one layer makes its indexer queries: RoPE freqs [rd/2], heads, head dim, rope dims, the FP4 round trip."""
    freqs: Any
    n_heads: int
    ihd: int
    rd: int
    fake_quant: bool = True


@dataclass(frozen=True)
class IndexScorer:
    """One layer's indexer scoring: heads, head dim, the weights' scale and the compression ratio of its keys."""
    n_heads: int
    ihd: int
    wscale: float
    ratio: int = 4


@dataclass(frozen=True)
class ScoreBuffers:
    """One scoring call's arrays: queries q, raw head weights w_raw, keys [>= max_keys, ihd], the int32 position
    (a slot, or one per row), the scores out; max_keys: the bucket's key capacity."""
    q: Any
    w_raw: Any
    keys: Any
    pos: Any
    scores: Any
    max_keys: int


def indexer_q_prep(rt: Any, iq: IndexQuery, q_raw: Any, pos_slot: Any, q: Any, stream: Any = None,
                   pdl: bool = False) -> None:
    """q [IH, ihd] = FP4(Hadamard(RoPE(q_raw at the slot's position)))."""
    freqs, n_heads, ihd, rd, fake_quant = iq.freqs, iq.n_heads, iq.ihd, iq.rd, iq.fake_quant
    need(ihd & (ihd - 1) == 0 and 32 <= ihd <= IDX_MAX_DIM, f"indexer: head dim {ihd} must be a power of two in "
         f"32..{IDX_MAX_DIM}")
    need(rd % 2 == 0 and 0 < rd <= ihd and freqs.size == rd // 2, f"indexer: {freqs.size} freqs for {rd} rope dims")
    need(q_raw.size == n_heads * ihd and q.size == n_heads * ihd, f"indexer: q is not [{n_heads}, {ihd}]")
    need(all(is_dtype(a, np.float32) for a in (q_raw, freqs, q)) and aligned(8, q_raw, q),
         "indexer: float32 arrays, 8-byte aligned")
    rt.launch("indexer_q_prep", n_heads, pair_threads(ihd), q_raw, freqs, pos_slot, q, ihd, rd, int(fake_quant),
              stream=stream, pdl=pdl)


def scores_smem(n_heads: int, ihd: int, tile: int = IDX_KT) -> int:
    return (n_heads * ihd + tile * (ihd + 4)) * 4


def decode_tile(max_keys: int, max_blocks: int) -> int:
    """indexer_scores' keys per tile: 16 while ceil(max_keys / 16) blocks fit max_blocks (4x the blocks of 64-key
    tiles: at 2K context 32 blocks, not 8, share the ~0.3 MB of keys, so 4x the loads are in flight), else 64
    (long contexts: enough tiles already; a block then loops over fewer, larger tiles). Same bits either way."""
    return IDX_KT_SMALL if -(-max_keys // IDX_KT_SMALL) <= max_blocks else IDX_KT


def indexer_scores(rt: Any, ix: IndexScorer, buf: ScoreBuffers, max_blocks: int = 264, stream: Any = None,
                   pdl: bool = False, tile: int | None = None) -> None:
    """scores[g] for the (pos+1)//ratio visible keys (at most max_keys, the bucket's capacity; buf.pos a slot);
    tile: keys per tile (16 or 64; default decode_tile)."""
    q, w_raw, keys, scores, max_keys = buf.q, buf.w_raw, buf.keys, buf.scores, buf.max_keys
    n_heads, ihd = ix.n_heads, ix.ihd
    need(n_heads % 4 == 0 and 4 <= n_heads <= IDX_MAX_HEADS and ihd % 4 == 0,
         f"indexer_scores: {n_heads} heads (a multiple of 4 up to {IDX_MAX_HEADS}) of dim {ihd} (a multiple of 4)")
    need(q.size == n_heads * ihd and w_raw.size == n_heads, "indexer_scores: q or weights do not match the heads")
    need(len(keys.shape) == 2 and keys.shape[1] == ihd and keys.shape[0] >= max_keys and scores.size >= max_keys,
         f"indexer_scores: keys {tuple(keys.shape)} / scores ({scores.size}) smaller than the {max_keys} keys")
    need(aligned(16, q, keys), "indexer_scores: q and keys must be 16-byte aligned")
    tile = decode_tile(max_keys, max_blocks) if tile is None else int(tile)
    need(tile in (IDX_KT_SMALL, IDX_KT), f"indexer_scores: a tile is {IDX_KT_SMALL} or {IDX_KT} keys, got {tile}")
    grid = max(1, min(-(-max_keys // tile), max_blocks))
    rt.launch("indexer_scores", grid, IDX_THREADS, q, w_raw, float(ix.wscale), keys, buf.pos, int(ix.ratio), scores,
              n_heads, ihd, tile, smem=scores_smem(n_heads, ihd, tile), stream=stream, pdl=pdl)



def indexer_q_prep_rows(rt: Any, iq: IndexQuery, q_raw: Any, pos: Any, q: Any, n_rows: int, stream: Any = None,
                        pdl: bool = False) -> None:
    """indexer_q_prep of n_rows rows (prefill): q_raw, q [n_rows, IH, ihd], row r at pos[r]."""
    freqs, n_heads, ihd, rd, fake_quant = iq.freqs, iq.n_heads, iq.ihd, iq.rd, iq.fake_quant
    need(ihd & (ihd - 1) == 0 and 32 <= ihd <= IDX_MAX_DIM, f"indexer: head dim {ihd} must be a power of two in "
         f"32..{IDX_MAX_DIM}")
    need(rd % 2 == 0 and 0 < rd <= ihd and freqs.size == rd // 2, f"indexer: {freqs.size} freqs for {rd} rope dims")
    need(n_rows >= 1 and q_raw.size >= n_rows * n_heads * ihd and q.size >= n_rows * n_heads * ihd
         and pos.size >= n_rows and is_dtype(pos, np.int32), f"indexer: q is not [{n_rows}, {n_heads}, {ihd}]")
    need(all(is_dtype(a, np.float32) for a in (q_raw, freqs, q)) and aligned(8, q_raw, q),
         "indexer: float32 arrays, 8-byte aligned")
    rt.launch("indexer_q_prep_rows", (n_heads, int(n_rows)), pair_threads(ihd), q_raw, freqs, pos, q, n_heads, ihd,
              rd, int(fake_quant), stream=stream, pdl=pdl)


def indexer_scores_rows(rt: Any, ix: IndexScorer, buf: ScoreBuffers, n_rows: int, score_stride: int,
                        max_blocks: int = 264, stream: Any = None, pdl: bool = False) -> None:
    """scores[r, g] for each of n_rows queries (prefill) over its (pos[r]+1)//ratio visible keys (at most max_keys
    <= score_stride; scores [n_rows, score_stride]); each row bit-identical to its decode indexer_scores."""
    q, w_raw, keys, pos, scores, max_keys = buf.q, buf.w_raw, buf.keys, buf.pos, buf.scores, buf.max_keys
    n_heads, ihd = ix.n_heads, ix.ihd
    need(n_heads % 4 == 0 and 4 <= n_heads <= IDX_MAX_HEADS and ihd % 4 == 0,
         f"indexer_scores: {n_heads} heads (a multiple of 4 up to {IDX_MAX_HEADS}) of dim {ihd} (a multiple of 4)")
    need(n_rows >= 1 and q.size >= n_rows * n_heads * ihd and w_raw.size >= n_rows * n_heads
         and pos.size >= n_rows, "indexer_scores_rows: q, weights or positions do not match the rows")
    need(len(keys.shape) == 2 and keys.shape[1] == ihd and keys.shape[0] >= max_keys and score_stride >= max_keys
         and scores.size >= n_rows * score_stride,
         f"indexer_scores_rows: keys {tuple(keys.shape)} / scores ({scores.size}) smaller than the {max_keys} keys")
    need(aligned(16, q, keys), "indexer_scores: q and keys must be 16-byte aligned")
    grid = max(1, min(-(-max_keys // IDX_KT), max_blocks))
    rt.launch("indexer_scores_rows", (grid, int(n_rows)), IDX_THREADS, q, w_raw, float(ix.wscale), keys, pos,
              int(ix.ratio), scores, int(score_stride), n_heads, ihd, smem=scores_smem(n_heads, ihd), stream=stream,
              pdl=pdl)
