"""Numpy dequantisation of every weight format ds4py reads.

Public API (stable; other modules depend on it):
    dequantize(raw, qtype, shape) -> float32 array of `shape`
        raw: uint8 bytes of whole rows of a GGUF tensor (a row slice of the tensor is fine: rows are
        block-aligned); qtype: gguf.GGMLQuantizationType or its int; shape: numpy order (..., rows, cols),
        cols = GGUF ne0.
    row_nbytes(qtype, ncols) -> bytes per row.

TEMPORARY: delegates to gguf.quants until ds4py's own per-format implementations land (issue 2).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as _gq


def row_nbytes(qtype: int, ncols: int) -> int:
    qtype = GGMLQuantizationType(int(qtype))
    block, nbytes = GGML_QUANT_SIZES[qtype]
    if ncols % block:
        raise ValueError(f"{qtype.name}: row length {ncols} is not a multiple of the block size {block}")
    return ncols // block * nbytes


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    qtype = GGMLQuantizationType(int(qtype))
    out = _gq.dequantize(np.asarray(raw).view(np.uint8).reshape(-1), qtype)
    return np.asarray(out, dtype=np.float32).reshape(shape)
