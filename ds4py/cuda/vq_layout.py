"""VQ-8 routed experts (ds4py/quant/vq.py, docs/vq.md) as cu/experts.cu's VQ kernels read them: one device copy per
matrix of R = experts x rows rows, laid out at upload (the file unchanged):

    [codebook: K codewords x 8 E4M3 bytes] [R stream rows] [R hi rows: 13-bit layers] [R f32 gains]

A stream row is the file's 12-bit fields unchanged, padded to whole 128-byte lines: with the matrix 128-byte aligned
(the arena aligns to 256, the codebook is 32 or 64 KiB) every 256-index block of a row (384 bytes, 2,048 weights) is
three whole lines, so a row of V4 Flash (4,096 or 2,048 columns) is read with no partial line. A hi row is the
file's hi plane row (bit 12 of 8 indices per byte) padded to 16 bytes; the gains are the effective ones: the file's
f16 gain times any sidecar / post-training scales, multiplied in float32 in the reference's order (VQExperts.gains).
The kernels stage a block's rows of each region as one span each; the codebook rides at the head of each matrix
(copied into shared memory by every block).
"""

from __future__ import annotations

import numpy as np

from ds4py.cuda.ops.experts import VQ_FORMATS, codebook_bytes, row_bytes, vq_format, vq_row_parts
from ds4py.model import UnsupportedByBackend
from ds4py.quant import vq


def kernel_format(bits: int, where: str) -> str:
    """The experts.cu format of a layer's width; refuses a width no kernel reads, in one sentence."""
    fmt = vq_format(bits)
    if fmt is None:
        widths = " and ".join(k.removeprefix("vq") for k in VQ_FORMATS)
        raise UnsupportedByBackend(f"{where} holds {bits}-bit VQ-8 experts; the CUDA kernels read {widths}-bit "
                                   f"layers (the seed's widths); use --backend ref")
    return fmt


def device_bytes(fmt: str, X: int, rows: int, cols: int) -> int:
    return codebook_bytes(fmt) + X * rows * row_bytes(fmt, cols)


def pack(fmt: str, codes: np.ndarray, stream: np.ndarray, hi: np.ndarray | None, gains: np.ndarray,
         cols: int) -> np.ndarray:
    """The device copy (uint8, 1-D) of one VQ matrix: codes = the codebook's E4M3 bytes [K, 8], stream [X, rows,
    cols/64*12], hi [X, rows, cols/64] (13-bit layers) or None, gains float32 [X, rows] (effective)."""
    qk, nb, kc = VQ_FORMATS[fmt]
    X, rows = gains.shape
    R, n_runs = X * rows, cols // qk
    sb, hb = vq_row_parts(fmt, cols)
    streams = np.zeros((R, sb), np.uint8)
    streams[:, :n_runs * 12] = np.asarray(stream).view(np.uint8).reshape(R, n_runs * 12)
    parts = [np.zeros(kc * 8, np.uint8), streams.reshape(-1)]
    parts[0][:np.asarray(codes).size] = np.asarray(codes).view(np.uint8).reshape(-1)
    if nb == 13:
        his = np.zeros((R, hb), np.uint8)
        his[:, :n_runs] = np.asarray(hi).view(np.uint8).reshape(R, n_runs)
        parts.append(his.reshape(-1))
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
