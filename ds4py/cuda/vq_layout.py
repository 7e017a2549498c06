"""VQ-8 routed experts (ds4py/quant/vq.py, docs/vq.md) as cu/experts.cu's VQ kernels read them: one device copy per
matrix, repacked at upload (the file unchanged):

    [codebook: K codewords x 8 E4M3 bytes] [row 0] [row 1] ...      rows in the file's order (expert, row)
    row = per run of 8 indices its 12 stream bytes (+ the run's hi byte at 13 bits), the f32 row gain 4-byte
          aligned after them, zero padding to 16 bytes

so a row's stream, top bits and gain are one contiguous span the kernel stages at once, and the codebook rides at
the head of each matrix (copied into shared memory by every block). The gain is the effective one: the file's f16
gain times any sidecar / post-training scales, multiplied in float32 in the reference's order (VQExperts.gains).
"""

from __future__ import annotations

import numpy as np

from ds4py.cuda.ops.experts import VQ_FORMATS, codebook_bytes, row_bytes, vq_format
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
    n_runs = cols // qk
    runs = np.asarray(stream).view(np.uint8).reshape(X * rows, n_runs, 12)
    if nb == 13:
        runs = np.concatenate([runs, np.asarray(hi).view(np.uint8).reshape(X * rows, n_runs, 1)], axis=2)
    rb = row_bytes(fmt, cols)
    at = (n_runs * nb + 3) // 4 * 4
    body = np.zeros((X * rows, rb), np.uint8)
    body[:, :n_runs * nb] = runs.reshape(X * rows, n_runs * nb)
    body[:, at:at + 4] = np.ascontiguousarray(gains, np.float32).reshape(X * rows, 1).view(np.uint8)
    cb = np.zeros(kc * 8, np.uint8)
    c = np.asarray(codes).view(np.uint8).reshape(-1)
    cb[:c.size] = c
    return np.concatenate([cb, body.reshape(-1)])


def from_file(gguf, name: str, row_scales=None) -> tuple[str, np.ndarray]:
    """(format, device copy) of VQ expert tensor `name` of an open GGUF (checked as the reference checks it);
    row_scales: float32 [X, rows] arrays multiplied into the gains in order (sidecars)."""
    X, rows, nb = gguf.tensors[name].shape
    bits = vq.read_layer(gguf, int(name.split(".")[1])).header.bits
    cols = nb // vq.stream_bits(bits) * vq.ROW_QUANTUM
    vq.check_expert(gguf, name, (X, rows, cols))
    fmt = kernel_format(bits, name)
    codes = np.asarray(gguf.tensor(vq.codebook_name(int(name.split(".")[1]))).raw).view(np.uint8)
    hi = gguf.tensor(vq.hi_name(name)).raw_bytes() if bits == 13 else None
    g = np.asarray(gguf.tensor(vq.gain_name(name)).raw).astype(np.float32)
    for s in row_scales or ():
        g = g * np.asarray(s, np.float32)
    return fmt, pack(fmt, codes, gguf.tensor(name).raw_bytes(), hi, g, cols)


def plan(gguf, name: str) -> tuple[str, int]:
    """(format, device bytes) of VQ expert tensor `name`, from the shapes alone (the arena is sized first)."""
    X, rows, nb = gguf.tensors[name].shape
    bits = vq.read_layer(gguf, int(name.split(".")[1])).header.bits
    fmt = kernel_format(bits, name)
    return fmt, device_bytes(fmt, X, rows, nb // vq.stream_bits(bits) * vq.ROW_QUANTUM)
