"""Host wrapper of cu/topk.cu: the exact top-k of a score vector by radix select (the indexer's selection)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.ops.core import is_dtype, need

TOPK_THREADS = 1024            # the block (the kernel's launch bounds)
TOPK_REG = 16                  # keys per thread kept in registers: 16384 scores read once
DEFINES = {"TOPK_REG": TOPK_REG}                                                   # -D values of cu/topk.cu


@dataclass(frozen=True)
class Visible:
    """How many leading scores a top-k sees: (pos+1)//ratio with pos read from the int32 device slot pos_slot
    (decode: a graph replay reads the step's position), else n."""
    pos_slot: Any = None
    ratio: int = 4
    n: int = 0


def topk(rt: Any, scores: Any, k: int, out: Any, visible: Visible, stream: Any = None, pdl: bool = False) -> None:
    """out[:min(n, k)] = indices of the k best of the n visible scores, ascending (ties: lowest index)."""
    pos_slot, ratio, n = visible.pos_slot, visible.ratio, visible.n
    need(k >= 1 and out.size >= k and is_dtype(out, np.int32), f"topk: out must be int32 with room for k = {k}")
    need(pos_slot is not None or 0 <= n <= scores.size, f"topk: n = {n} scores asked of {scores.size}")
    rt.launch("topk_radix_select", 1, TOPK_THREADS, scores, pos_slot, int(ratio), int(n), int(k), out,
              stream=stream, pdl=pdl)


@dataclass(frozen=True)
class ScoreRows:
    """The indexer's scores of one call: scores [n_rows, stride] float32, row r at the int32 position pos[r], its
    (pos[r]+1)//ratio visible keys first."""
    scores: Any
    pos: Any
    n_rows: int
    stride: int
    ratio: int = 4


def topk_rows(rt: Any, sr: ScoreRows, k: int, out: Any, stream: Any = None, pdl: bool = False) -> None:
    """out[r, :min(n_r, k)] = topk of scores[r, :n_r], n_r = (pos[r]+1)//ratio, for n_rows rows (prefill)."""
    scores, score_stride, pos, n_rows, ratio = sr.scores, sr.stride, sr.pos, sr.n_rows, sr.ratio
    need(k >= 1 and n_rows >= 1 and out.size >= n_rows * k and is_dtype(out, np.int32),
         f"topk_rows: out must be int32 with room for {n_rows} x {k}")
    need(scores.size >= n_rows * score_stride and pos.size >= n_rows and is_dtype(pos, np.int32),
         "topk_rows: scores or positions do not cover the rows")
    rt.launch("topk_radix_select_rows", int(n_rows), TOPK_THREADS, scores, int(score_stride), pos, int(ratio), int(k),
              out, stream=stream, pdl=pdl)
