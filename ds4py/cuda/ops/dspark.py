"""Launch wrappers of cu/dspark.cu: the weighted sum over the hc copies that V4.1's DSpark draft reads (its taps, the
mean over the copies of a target layer's input state; its pre-norm hidden, the last FFN pre-mix's collapse), and
the elementwise add of its greedy chain (a position's base logits plus its Markov bias)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.ops.core import is_dtype, need

HC_SUM_THREADS = 128


@dataclass(frozen=True)
class HcSum:
    """What one hc_sum writes: y rows y_stride apart (None: D), scale times the sum over the copies weighted by
    mix[t * mix_stride + j] (mix None: 1 each, so scale 1 / hc gives the mean over the copies)."""
    y: Any
    scale: float
    y_stride: int | None = None
    mix: Any | None = None
    mix_stride: int = 0


def hc_sum(rt: Any, X: Any, n_tok: int, D: int, s: HcSum, hc: int = 4, stream: Any = None,
           pdl: bool = False) -> None:
    """y[t * y_stride : + D] = scale * sum_j w_j X[t, j] for n_tok rows of X [T, hc, D]."""
    y, mix, mix_stride, scale = s.y, s.mix, s.mix_stride, s.scale
    ys = D if s.y_stride is None else int(s.y_stride)
    need(n_tok >= 1 and D >= 1 and ys >= D, f"dspark_hc_sum: {n_tok} rows of {D} values, row stride {ys}")
    need(is_dtype(X, np.float32) and X.size >= n_tok * hc * D, f"dspark_hc_sum: X must be float32 [{n_tok}, {hc}, {D}]")
    need(mix is None or (is_dtype(mix, np.float32) and mix_stride >= 0 and mix.size >= (n_tok - 1) * mix_stride + hc),
         "dspark_hc_sum: mix too small")
    need(is_dtype(y, np.float32) and y.size >= (n_tok - 1) * ys + D, "dspark_hc_sum: y too small")
    rt.launch("dspark_hc_sum", (-(-int(D) // HC_SUM_THREADS), int(n_tok)), HC_SUM_THREADS, X, mix, int(mix_stride),
              int(D), float(scale), y, ys, stream=stream, pdl=pdl)


def add(rt: Any, a: Any, b: Any, out: Any, n: int, stream: Any = None, pdl: bool = False) -> None:
    """out[:n] = a[:n] + b[:n] (float32)."""
    need(n >= 1 and all(is_dtype(x, np.float32) and x.size >= n for x in (a, b, out)),
         f"dspark_add: float32 arrays of {n} values")
    rt.launch("dspark_add", -(-int(n) // HC_SUM_THREADS), HC_SUM_THREADS, a, b, out, int(n), stream=stream, pdl=pdl)
