"""A GGUF's tensors on the device: the tensor data streamed into the arena's weights region in as few spans as the
kept tensors allow.

GGUF stores every tensor in one contiguous data section, each aligned (general.alignment, 32 by default), so a
chunked upload of a run of consecutive tensors (read straight into two pinned chunks) places each of them; each
then is a view at its offset inside its run. The tensors the device does not read as they are in the file (VQ-8
experts, which get a re-laid copy; small vectors converted to float32; another model's block) are left out: the
data is cut into runs at them, so no byte is held on the device twice. The arena's weights region is sized from
the runs (`weights_bytes`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

from ds4py.cuda.memory import Arena, DeviceArray, WeightUploader, align_up
from ds4py.errors import GGUFError, UnsupportedByBackend
from ds4py.progress import LOAD, Transfer

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


def runs(gguf, keep=None) -> list[tuple[int, int, list]]:
    """The kept tensors (keep: names; None: all) as runs of consecutive tensors of the file: (first byte, end,
    tensors) each, cut where a tensor left out lies between them."""
    out: list[tuple[int, int, list]] = []
    cut = True
    for t in sorted(gguf.tensors.values(), key=lambda t: t.offset):
        if keep is not None and t.name not in keep:
            cut = True
            continue
        if cut or not out:
            out.append((t.offset, t.offset + t.nbytes, [t]))
        else:
            a, b, ts = out[-1]
            out[-1] = (a, max(b, t.offset + t.nbytes), ts + [t])
        cut = False
    return out


def weights_bytes(gguf, keep=None) -> int:
    """Arena bytes of the kept tensors' runs (each run starts ALIGN-aligned)."""
    return sum(align_up(b - a) for a, b, _ in runs(gguf, keep))


def upload_gguf(gguf, arena: Arena, uploader: WeightUploader, progress: bool = True,
                keep=None) -> dict[str, DeviceTensor]:
    """Stream the kept tensors (keep: names; None: every tensor) of an open ds4py.gguf.GGUFFile into the arena;
    returns the device views by name."""
    check_alignment(gguf)
    if not gguf.tensors:
        raise GGUFError(f"{gguf.path}: has no tensors")
    out: dict[str, DeviceTensor] = {}
    spans = list(runs(gguf, keep))
    total = sum(end - start for start, end, _ in spans)
    # one bar for the whole file (bytes uploaded / total, rate, time left; a line every 10 s in a log or the
    # journal), and the process's load meter that /health reports while the server loads
    bar = Transfer(f"ds4py: loading {os.path.basename(gguf.path)}", total, every=10.0) if progress else None
    LOAD.begin(gguf.path, total)

    def on_bytes(n: int) -> None:
        LOAD.add(n)
        if bar is not None:
            bar.update(LOAD.done)

    for start, end, ts in spans:
        blob = arena.weights(end - start, np.uint8)
        uploader.upload_file(gguf.path, start, end - start, blob, progress=False, on_bytes=on_bytes)
        for t in ts:
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
    LOAD.end()
    if bar is not None:
        bar.close()
        took = LOAD.snapshot()["seconds"]
        print(f"ds4py: uploaded {total / 1e9:.2f} GB of weights in {took:.1f} s ({total / 1e9 / max(took, 1e-9):.2f} "
              f"GB/s)", file=sys.stderr, flush=True)
    return out
