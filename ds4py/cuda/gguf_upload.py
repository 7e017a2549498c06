"""A GGUF's tensors on the device: the whole tensor-data span streamed into the arena's weights region at once.

GGUF stores every tensor in one contiguous data section, each aligned (general.alignment, 32 by default), so
one chunked upload of that span (memory-mapped, two pinned chunks) places every tensor; each then is a view at
its offset. The arena's weights region is sized from the span (`weights_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4py.cuda.memory import Arena, DeviceArray, WeightUploader
from ds4py.errors import GGUFError
from ds4py.model import UnsupportedByBackend

_PLAIN = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "I8": np.int8, "I16": np.int16}


@dataclass
class DeviceTensor:
    name: str
    qtype: str                  # GGML type name: "F16", "Q8_0", ...
    shape: tuple[int, ...]      # logical shape, numpy order (as ds4py.gguf)
    array: DeviceArray          # typed for plain types; raw uint8 [rows, row_bytes] for quantized ones


def data_span(gguf) -> tuple[int, int]:
    """(first byte, end) of the tensor data in the file."""
    ts = list(gguf.tensors.values())
    if not ts:
        raise GGUFError(f"{gguf.path}: has no tensors")
    return min(t.offset for t in ts), max(t.offset + t.nbytes for t in ts)


VECTOR_ALIGN = 16       # the kernels read weights (F16, F32, Q2_K, Q4_K, ...) with 16-byte vector loads


def check_alignment(gguf) -> None:
    """A device tensor sits at its file offset from the (256-byte aligned) start of the data span, so the file's
    alignment is the tensors' alignment on the device: it must allow 16-byte loads."""
    align = int(gguf.meta("general.alignment", 32))
    if align % VECTOR_ALIGN:
        raise UnsupportedByBackend(f"{gguf.path}: general.alignment is {align}; the CUDA backend needs a multiple of "
                        f"{VECTOR_ALIGN} (its kernels load weights 16 bytes at a time), so re-write the file with "
                        f"the default alignment 32 or use --backend ref")


def weights_bytes(gguf) -> int:
    start, end = data_span(gguf)
    return end - start


def upload_gguf(gguf, arena: Arena, uploader: WeightUploader, progress: bool = True) -> dict[str, DeviceTensor]:
    """Stream every tensor of an open ds4py.gguf.GGUFFile into the arena; returns the device views by name."""
    check_alignment(gguf)
    start, end = data_span(gguf)
    blob = arena.weights(end - start, np.uint8)
    uploader.upload_file(gguf.path, start, end - start, blob, progress=progress)
    out: dict[str, DeviceTensor] = {}
    for t in gguf.tensors.values():
        rel = t.offset - start
        qname = t.qtype.name
        if qname in _PLAIN:
            dtype, shape = np.dtype(_PLAIN[qname]), t.shape
        else:
            dtype, shape = np.dtype(np.uint8), tuple(t.raw_bytes().shape)
        if rel % 16 and qname in ("F32", "F16"):
            raise GGUFError(f"{gguf.path}: tensor {t.name!r} is not 16-byte aligned in the file")
        arr = blob.view(rel, shape, dtype)
        if arr.nbytes != t.nbytes:
            raise GGUFError(f"{gguf.path}: tensor {t.name!r} holds {t.nbytes} bytes, expected {arr.nbytes}")
        out[t.name] = DeviceTensor(t.name, qname, t.shape, arr)
    return out
