"""Host wrapper of cu/topk.cu: the exact top-k of a score vector by radix select (the indexer's selection)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4py.cuda.ops.attention import dtype_is, need

TOPK_THREADS = 1024            # the block (the kernel's launch bounds)
TOPK_REG = 16                  # keys per thread kept in registers: 16384 scores read once
DEFINES = {"TOPK_REG": TOPK_REG}                                                   # -D values of cu/topk.cu


def topk(rt: Any, scores: Any, k: int, out: Any, pos_slot: Any = None, ratio: int = 4, n: int = 0,
         stream: Any = None, pdl: bool = False) -> None:
    """out[:min(n, k)] = indices of the k best scores, ascending (ties: lowest index). n = (pos+1)//ratio from the
    slot when pos_slot is given (decode), else the n given."""
    need(k >= 1 and out.size >= k and dtype_is(out, np.int32), f"topk: out must be int32 with room for k = {k}")
    need(pos_slot is not None or 0 <= n <= scores.size, f"topk: n = {n} scores asked of {scores.size}")
    rt.launch("topk_radix_select", 1, TOPK_THREADS, scores, pos_slot, int(ratio), int(n), int(k), out,
              stream=stream, pdl=pdl)
