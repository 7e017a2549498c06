"""Host wrappers of cu/act_quant.cu: an activation rounded as the reference's act_quant numerics rounds the input of a
quantised matmul (Numerics.act_quant; ds4py/ref/weights.py Weights.act), before the fp32 GEMVs / GEMMs read it.

    kind = rounding(W.qtype)                      # "q8_0", "q8_k" or None (F16 / F32 / VQ-8: unrounded)
    act_round(rt, kind, TokenRows(x, y, T=n_rows, ldx=stride), width)   # rows of x and y `stride` floats apart
"""

from __future__ import annotations

from typing import Any

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as QT

from ds4py.cuda.ops.core import TokenRows, aligned, ceil_div, is_dtype, need

THREADS = 256
BLOCK = {"q8_0": 32, "q8_k": 256}            # floats per rounding block
# the reference's act_quant classes (ds4py/ref/weights.py Q8_0_ACT / Q8_K_ACT): the weight formats whose matmuls see
# their activation rounded, and how
_Q8_0 = frozenset({QT.Q8_0, QT.MXFP4})
_Q8_K = frozenset({QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ2_XXS})


def rounding(qtype: Any) -> str | None:
    """How a matmul with weights of `qtype` sees its activation under act_quant: "q8_0", "q8_k" or None (F16, F32,
    VQ-8 and the other formats the reference leaves unrounded)."""
    if isinstance(qtype, str) or qtype is None:              # VQ-8 format keys ("vq13"): fp32, as the reference
        return None
    q = int(qtype)
    if q in {int(t) for t in _Q8_0}:
        return "q8_0"
    if q in {int(t) for t in _Q8_K}:
        return "q8_k"
    return None


def act_round(rt: Any, kind: str, io: TokenRows, width: int, stream: Any = None, pdl: bool = False) -> None:
    """y[r, :width] = x[r, :width] rounded by `kind` ("q8_0": ops.q8_0_round, "q8_k": ops.q8_k_round) for the io.T
    rows r of x = io.x and y = io.y (None: x, in place), both io.ldx floats apart (None: width; io.ldy must be
    None or the same)."""
    x, y, n_rows = io.x, io.x if io.y is None else io.y, io.T
    stride = width if io.ldx is None else int(io.ldx)
    need(io.ldy is None or int(io.ldy) == stride, "act_round: x and y rows must be the same stride apart")
    need(io.add is None, "act_round: nothing is added to a rounded copy")
    need(kind in BLOCK, f"act_round: rounding {kind!r} unknown (q8_0, q8_k)")
    need(n_rows >= 1 and width > 0 and width % BLOCK[kind] == 0,
         f"act_round: a row of {width} floats is not whole {kind} blocks of {BLOCK[kind]}")
    need(stride >= width and stride % 8 == 0, f"act_round: stride {stride} must be >= {width} and a multiple of 8")
    need(is_dtype(x, np.float32) and is_dtype(y, np.float32), "act_round: x and y must be float32")
    span = (n_rows - 1) * stride + width
    need(x.size >= span and y.size >= span, f"act_round: x and y need {span} floats")
    need(aligned(16, x, y), "act_round: x and y must be 16-byte aligned")
    name = f"act_round_{kind}"
    threads = n_rows * width // 8
    grid = ceil_div(threads, THREADS)               # one thread per 8 floats
    rt.launch(name, grid, THREADS, x, y, n_rows, width, stride, stream=stream, pdl=pdl)
