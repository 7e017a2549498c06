"""Memory-mapped GGUF reading: metadata and zero-copy numpy views of every tensor.

Built on the `gguf` package's reader; this module adds the checks a user needs when a file is wrong
(not a GGUF, truncated, unsupported version, missing tensor, wrong type or shape), each as one sentence
naming the file and the tensor.

Shapes here are numpy order: the reverse of GGUF `ne` (ne0, the fastest / input dim, is the last axis).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from ds4py.errors import GGUFError

SUPPORTED_VERSIONS = (2, 3)
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]      # numpy order (reversed ne)
    raw: np.ndarray             # memory-mapped bytes, shape (..., rows, row_nbytes) as uint8 (or typed for float/int)
    offset: int                 # absolute byte offset in the file
    nbytes: int

    @property
    def ne(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape))

    def raw_bytes(self) -> np.ndarray:
        """The tensor's bytes as uint8 with shape (..., rows, row_nbytes)."""
        rows = self.shape[:-1] if len(self.shape) > 1 else (1,)
        return self.raw.view(np.uint8).reshape(*rows, -1)


class GGUFFile:
    """An open GGUF file. `f.meta(key)` for metadata, `f.tensor(name)` for a TensorInfo."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise GGUFError(f"{self.path}: no such file")
        with open(self.path, "rb") as fh:
            head = fh.read(8)
        if len(head) < 8 or head[:4] != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
        version = int.from_bytes(head[4:8], "little")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (supported: 2, 3)")
        try:
            self._reader = GGUFReader(self.path, "r")
        except (ValueError, IndexError, OSError, KeyError) as e:
            raise GGUFError(f"{self.path}: corrupt or truncated GGUF header ({e})") from e
        self.version = version
        self.file_size = os.path.getsize(self.path)
        self._tensors: dict[str, TensorInfo] = {}
        for t in self._reader.tensors:
            qtype = GGMLQuantizationType(int(t.tensor_type))
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            end = int(t.data_offset) + int(t.n_bytes)
            if end > self.file_size:
                raise GGUFError(
                    f"{self.path}: truncated: tensor {t.name!r} ends at byte {end} but the file has {self.file_size}"
                )
            self._tensors[t.name] = TensorInfo(t.name, qtype, shape, t.data, int(t.data_offset), int(t.n_bytes))

    # ---- metadata -------------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return [k for k in self._reader.fields if not k.startswith("GGUF.")]

    def has(self, key: str) -> bool:
        return key in self._reader.fields

    def meta(self, key: str, default: Any = ...) -> Any:
        """Metadata value as a Python scalar, str, or list. Missing key: default, else GGUFError."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        value = field.contents()
        if field.types and field.types[0] == GGUFValueType.ARRAY and isinstance(value, list):
            return list(value)
        return value

    def metadata(self) -> dict[str, Any]:
        return {k: self.meta(k) for k in self.keys()}

    # ---- tensors --------------------------------------------------------------------------------------
    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self._tensors

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def tensor(
        self,
        name: str,
        types: Iterable[GGMLQuantizationType] | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> TensorInfo:
        """Look a tensor up, checking its type and numpy-order shape when given."""
        t = self._tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing")
        if types is not None:
            types = tuple(types)
            if t.qtype not in types:
                want = " or ".join(x.name for x in types)
                raise GGUFError(f"{self.path}: tensor {name!r} has type {t.qtype.name}, expected {want}")
        if shape is not None and tuple(shape) != t.shape:
            raise GGUFError(
                f"{self.path}: tensor {name!r} has shape {list(t.shape)} (numpy order), expected {list(shape)}"
            )
        return t

    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())


def row_nbytes(qtype: GGMLQuantizationType, ncols: int) -> int:
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(qtype))]
    return ncols // block * nbytes
