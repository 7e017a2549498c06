"""Twin of cu/act_quant.cu: ref.ops.q8_0_round / q8_k_round on each row's first `width` floats (the rest of a strided
row untouched)."""

from __future__ import annotations

import numpy as np

from ds4py.ref import ops as ref

ROUND = {"q8_0": ref.q8_0_round, "q8_k": ref.q8_k_round}


def act_round(kind: str, x: np.ndarray, n_rows: int, width: int, stride: int | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """x (flat float32) with rows r * stride .. + width rounded by `kind`; out: the buffer's other floats (default x)."""
    stride = width if stride is None else stride
    x = np.asarray(x, np.float32).ravel()
    y = (x if out is None else np.asarray(out, np.float32).ravel()).copy()
    for r in range(n_rows):
        y[r * stride:r * stride + width] = ROUND[kind](x[r * stride:r * stride + width][None])[0]
    return y
