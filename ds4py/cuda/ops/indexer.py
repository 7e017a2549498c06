"""Host wrappers of cu/indexer.cu (query preparation, scores) and cu/topk.cu (exact top-k by radix select)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4py.cuda.ops.attention import aligned, dtype_is, need, pair_threads

IDX_MAX_DIM = 1024             # = IDX_MAX_DIM in cu/indexer.cu
IDX_MAX_HEADS = 256            # = IDX_MAX_HEADS
IDX_KT = 64                    # = IDX_KT: keys per tile
IDX_THREADS = 256              # = IDX_THREADS
TOPK_THREADS = 1024            # = TOPK_THREADS in cu/topk.cu


def indexer_q_prep(rt: Any, q_raw: Any, freqs: Any, pos_slot: Any, q: Any, n_heads: int, ihd: int, rd: int,
                   fake_quant: bool = True, stream: Any = None, pdl: bool = False) -> None:
    """q [IH, ihd] = FP4(Hadamard(RoPE(q_raw at the slot's position)))."""
    need(ihd & (ihd - 1) == 0 and 32 <= ihd <= IDX_MAX_DIM, f"indexer: head dim {ihd} must be a power of two in "
         f"32..{IDX_MAX_DIM}")
    need(rd % 2 == 0 and 0 < rd <= ihd and freqs.size == rd // 2, f"indexer: {freqs.size} freqs for {rd} rope dims")
    need(q_raw.size == n_heads * ihd and q.size == n_heads * ihd, f"indexer: q is not [{n_heads}, {ihd}]")
    need(all(dtype_is(a, np.float32) for a in (q_raw, freqs, q)) and aligned(8, q_raw, q),
         "indexer: float32 arrays, 8-byte aligned")
    rt.launch("indexer_q_prep", n_heads, pair_threads(ihd), q_raw, freqs, pos_slot, q, ihd, rd, int(fake_quant),
              stream=stream, pdl=pdl)


def scores_smem(n_heads: int, ihd: int) -> int:
    return (n_heads * ihd + IDX_KT * (ihd + 4)) * 4


def indexer_scores(rt: Any, q: Any, w_raw: Any, wscale: float, keys: Any, pos_slot: Any, scores: Any,
                   n_heads: int, ihd: int, max_keys: int, ratio: int = 4, max_blocks: int = 264,
                   stream: Any = None, pdl: bool = False) -> None:
    """scores[g] for the (pos+1)//ratio visible keys (at most max_keys, the bucket's capacity)."""
    need(n_heads % 4 == 0 and 4 <= n_heads <= IDX_MAX_HEADS and ihd % 4 == 0,
         f"indexer_scores: {n_heads} heads (a multiple of 4 up to {IDX_MAX_HEADS}) of dim {ihd} (a multiple of 4)")
    need(q.size == n_heads * ihd and w_raw.size == n_heads, "indexer_scores: q or weights do not match the heads")
    need(len(keys.shape) == 2 and keys.shape[1] == ihd and keys.shape[0] >= max_keys and scores.size >= max_keys,
         f"indexer_scores: keys {tuple(keys.shape)} / scores ({scores.size}) smaller than the {max_keys} keys")
    need(aligned(16, q, keys), "indexer_scores: q and keys must be 16-byte aligned")
    grid = max(1, min(-(-max_keys // IDX_KT), max_blocks))
    rt.launch("indexer_scores", grid, IDX_THREADS, q, w_raw, float(wscale), keys, pos_slot, int(ratio), scores,
              n_heads, ihd, smem=scores_smem(n_heads, ihd), stream=stream, pdl=pdl)


def topk(rt: Any, scores: Any, k: int, out: Any, pos_slot: Any = None, ratio: int = 4, n: int = 0,
         stream: Any = None, pdl: bool = False) -> None:
    """out[:min(n, k)] = indices of the k best scores, ascending (ties: lowest index). n = (pos+1)//ratio from the
    slot when pos_slot is given (decode), else the n given."""
    need(k >= 1 and out.size >= k and dtype_is(out, np.int32), f"topk: out must be int32 with room for k = {k}")
    need(pos_slot is not None or 0 <= n <= scores.size, f"topk: n = {n} scores asked of {scores.size}")
    rt.launch("topk_radix_select", 1, TOPK_THREADS, scores, pos_slot, int(ratio), int(n), int(k), out,
              stream=stream, pdl=pdl)
