"""Numpy (de)quantisation of every weight format ds4py reads or writes.

Public API (stable; other modules depend on it):
    dequantize(raw, qtype, shape) -> float32 array of `shape`
        raw: uint8 bytes of whole rows of a GGUF tensor (a row slice of the tensor is fine: rows are
        block-aligned); qtype: gguf.GGMLQuantizationType or its int; shape: numpy order (..., rows, cols),
        cols = GGUF ne0.
    row_nbytes(qtype, ncols) -> bytes per row.
    quantize(x, qtype) -> uint8 bytes (..., rows, row_nbytes) for F32, F16, BF16, Q8_0, Q4_K, Q2_K, IQ2_XXS.

One module per family: simple (F32/F16/BF16/Q8_0), kquants (Q2_K/Q4_K), iq2 (IQ2_XXS), mxfp4 (MXFP4),
official (the DeepSeek checkpoint's FP8 e4m3 / FP4 e2m1 / e8m0). Every decoder works on whole blocks at
once (no per-block Python loops); results are bit-identical to ggml's reference dequantisers.
"""

from __future__ import annotations

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as QT

from ds4py.quant import iq2, kquants, mxfp4, simple
from ds4py.quant.official import dequant_fp4, dequant_fp8, e4m3_to_f32, e8m0_to_f32, fp8_block_size

__all__ = ["dequantize", "row_nbytes", "quantize", "BLOCK", "MATRIX_TYPES", "FLOAT_TYPES", "INT_TYPES", "dequant_fp8", "dequant_fp4", "e4m3_to_f32",
           "e8m0_to_f32", "fp8_block_size", "mxfp4_from_official"]

mxfp4_from_official = mxfp4.mxfp4_from_official

# qtype -> (weights per block, bytes per block, decoder(raw uint8) -> float32 (n_blocks, block))
BLOCK = {
    QT.F32: (1, 4, simple.dequant_f32),
    QT.F16: (1, 2, simple.dequant_f16),
    QT.BF16: (1, 2, simple.dequant_bf16),
    QT.Q8_0: (32, simple.Q8_0_BYTES, simple.dequant_q8_0),
    QT.Q4_K: (256, kquants.Q4_K_BYTES, kquants.dequant_q4_k),
    QT.Q2_K: (256, kquants.Q2_K_BYTES, kquants.dequant_q2_k),
    QT.IQ2_XXS: (256, iq2.IQ2_XXS_BYTES, iq2.dequant_iq2_xxs),
    QT.MXFP4: (32, mxfp4.MXFP4_BYTES, mxfp4.dequant_mxfp4),
}

# The types a model's tensors may be stored in (ds4py.schema declares each tensor's from these). A weight matrix:
# whatever this package decodes (ds4 files use F16/Q8_0/IQ2_XXS/Q2_K/Q4_K; our converter adds MXFP4/F32).
MATRIX_TYPES = tuple(BLOCK)
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)   # norms, hc parameters, sinks, biases, ape, compressor/indexer linears
INT_TYPES = (QT.I32, QT.I64, QT.I16)      # tid2eid


def _qtype(qtype: int) -> QT:
    qt = QT(int(qtype))
    if qt not in BLOCK:
        supported = ", ".join(t.name for t in BLOCK)
        raise ValueError(f"weight type {qt.name} is not supported (supported: {supported})")
    return qt


def row_nbytes(qtype: int, ncols: int) -> int:
    qt = _qtype(qtype)
    block, nbytes, _ = BLOCK[qt]
    if ncols % block:
        raise ValueError(f"{qt.name}: row length {ncols} is not a multiple of the block size {block}")
    return ncols // block * nbytes


def dequantize(raw: np.ndarray, qtype: int, shape: tuple[int, ...]) -> np.ndarray:
    qt = _qtype(qtype)
    shape = tuple(int(s) for s in shape)
    ncols = shape[-1] if shape else 1
    nrows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    flat = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    need = nrows * row_nbytes(qt, ncols)
    if flat.size != need:
        raise ValueError(f"{qt.name}: {flat.size} bytes given for shape {list(shape)}, expected {need}")
    return BLOCK[qt][2](flat).reshape(shape)


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    """float array (..., cols) -> uint8 (..., row_nbytes(qtype, cols)) in the GGUF block layout."""
    qt = QT(int(qtype))
    x = np.asarray(x, dtype=np.float32)
    rows = x.shape[:-1]
    nb = row_nbytes(qt, x.shape[-1])
    if qt == QT.F32:
        raw = x.view(np.uint8)
    elif qt == QT.F16:
        raw = x.astype(np.float16).view(np.uint8)
    elif qt == QT.BF16:
        raw = simple.quant_bf16(x).view(np.uint8)
    elif qt == QT.Q8_0:
        raw = simple.quant_q8_0(x)
    elif qt == QT.Q4_K:
        raw = kquants.quant_q4_k(x)
    elif qt == QT.Q2_K:
        raw = kquants.quant_q2_k(x)
    elif qt == QT.IQ2_XXS:
        raw = iq2.quant_iq2_xxs(x)
    else:
        raise ValueError(f"quantising to {qt.name} is not supported (MXFP4 comes only from official FP4 weights)")
    return np.ascontiguousarray(raw).reshape(*rows, nb)
