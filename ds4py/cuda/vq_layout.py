"""VQ-8 routed experts (ds4py/quant/vq.py, docs/vq.md) as cu/experts.cu's VQ kernels read them: one device copy per
matrix of X experts x rows, laid out at upload (the file unchanged):

    [codebook: K codewords x 8 E4M3 bytes] [X expert streams] [X * rows hi rows: 13-bit layers] [X * rows f32 gains]

An expert's stream is its rows' 12-bit fields back to back, as in the file, padded to whole 128-byte lines: with
the matrix 128-byte aligned (the arena aligns to 256, the codebook is 32 or 64 KiB) every expert's stream starts on
a line and every 256-index block of it (384 bytes, 2,048 weights) is three whole lines - for any row width (V4.1's
2,304-wide down rows are 432 bytes: blocks cross rows, not lines). The hi rows are the file's hi plane (bit 12 of 8
indices per byte); the gains are the effective ones: the file's f16 gain times any sidecar / post-training scales,
multiplied in float32 in the reference's order (VQExperts.gains). The kernels stage a block's rows of each region
as one span each; the codebook rides at the head of each matrix (copied into shared memory once by every
persistent block). Every width quantize-vq writes (6 .. 13 bits) has a kernel format; the stream of a b-bit layer
is b bytes per run of 8 indices (12 at 13 bits), so a 256-index block is whole lines only at 12 / 13 bits.
"""

from __future__ import annotations

import numpy as np

from ds4py.cuda.ops.experts import VQ_FORMATS, matrix_bytes, vq_expert_bytes, vq_format, vq_row_parts
from ds4py.errors import UnsupportedByBackend
from ds4py.quant import vq


def kernel_format(bits: int, where: str) -> str:
    """The experts.cu format of a layer's width; refuses a width no kernel reads, in one sentence."""
    fmt = vq_format(bits)
    if fmt is None:
        widths = ", ".join(k.removeprefix("vq") for k in VQ_FORMATS)
        raise UnsupportedByBackend(f"{where} holds {bits}-bit VQ-8 experts; the CUDA kernels read {widths}-bit "
                                   f"layers; use --backend ref")
    return fmt


def device_bytes(fmt: str, X: int, rows: int, cols: int) -> int:
    return matrix_bytes(fmt, X, rows, cols)


def pack(fmt: str, codes: np.ndarray, stream: np.ndarray, hi: np.ndarray | None, gains: np.ndarray,
         cols: int) -> np.ndarray:
    """The device copy (uint8, 1-D) of one VQ matrix: codes = the codebook's E4M3 bytes [K, 8], stream [X, rows,
    cols/64*12], hi [X, rows, cols/64] (13-bit layers) or None, gains float32 [X, rows] (effective)."""
    qk, nb, kc = VQ_FORMATS[fmt]
    X, rows = gains.shape
    sb, _ = vq_row_parts(fmt, cols)
    streams = np.zeros((X, vq_expert_bytes(fmt, rows, cols)), np.uint8)
    streams[:, :rows * sb] = np.asarray(stream).view(np.uint8).reshape(X, rows * sb)
    parts = [np.zeros(kc * 8, np.uint8), streams.reshape(-1)]
    parts[0][:np.asarray(codes).size] = np.asarray(codes).view(np.uint8).reshape(-1)
    if nb == 13:
        parts.append(np.ascontiguousarray(hi, np.uint8).reshape(-1))
    parts.append(np.ascontiguousarray(gains, np.float32).reshape(-1).view(np.uint8))
    return np.concatenate(parts)


def from_file(gguf, name: str, row_scales=None) -> tuple[str, np.ndarray]:
    """(format, device copy) of VQ expert tensor `name` of an open GGUF (checked as the reference checks it);
    row_scales: float32 [X, rows] arrays multiplied into the gains in order (sidecars)."""
    X, rows, nb = gguf.tensors[name].shape
    block = vq.block_of(name)                   # "blk.L", or an MTP block's "mtp.0"
    bits = vq.read_layer(gguf, block).header.bits
    cols = nb // vq.stream_bits(bits) * vq.ROW_QUANTUM
    vq.check_expert(gguf, name, (X, rows, cols))
    fmt = kernel_format(bits, name)
    codes = np.asarray(gguf.tensor(vq.codebook_name(block)).raw).view(np.uint8)
    hi = gguf.tensor(vq.hi_name(name)).raw_bytes() if bits == 13 else None
    g = np.asarray(gguf.tensor(vq.gain_name(name)).raw).astype(np.float32)
    for s in row_scales or ():
        g = g * np.asarray(s, np.float32)
    return fmt, pack(fmt, codes, gguf.tensor(name).raw_bytes(), hi, g, cols)


def plan(gguf, name: str) -> tuple[str, int]:
    """(format, device bytes) of VQ expert tensor `name`, from the shapes alone (the arena is sized first)."""
    X, rows, nb = gguf.tensors[name].shape
    bits = vq.read_layer(gguf, vq.block_of(name)).header.bits
    fmt = kernel_format(bits, name)
    return fmt, device_bytes(fmt, X, rows, nb // vq.stream_bits(bits) * vq.ROW_QUANTUM)
