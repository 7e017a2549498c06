"""A minimal GGUF reader/writer for building corrupt files in tests: every header field under the test's control
(alignment 0, misaligned or overlapping offsets, absurd dimensions, metadata of the wrong type, relabelled
tensors), which a real writer would refuse to produce."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

_FMT = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
        GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f",
        GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
        GGUFValueType.FLOAT64: "<d"}
S, A = GGUFValueType.STRING, GGUFValueType.ARRAY
U32, F32, I32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.INT32


@dataclass
class Tensor:
    name: str
    ne: list[int]             # GGUF order (fastest first)
    qtype: int
    data: bytes
    offset: int | None = None     # relative to the data start; None = laid out in order, aligned


@dataclass
class Gguf:
    kv: dict[str, tuple]              # key -> (vtype, value) or (ARRAY, (element vtype, values))
    tensors: list[Tensor] = field(default_factory=list)
    alignment: int = 32               # used for layout; write general.alignment yourself to change the header

    @classmethod
    def read(cls, path) -> "Gguf":
        from ds4py.gguf import GGUFFile

        r = GGUFReader(str(path))
        kv = {}
        for name, f in r.fields.items():
            if name.startswith("GGUF."):
                continue
            t = GGUFValueType(f.types[0])
            kv[name] = (A, (GGUFValueType(f.types[1]), f.contents())) if t == A else (t, f.contents())
        g = GGUFFile(path)
        tensors = [Tensor(t.name, list(t.ne), int(t.qtype), t.raw.view(np.uint8).tobytes())
                   for t in g.tensors.values()]
        return cls(kv, tensors, int(g.meta("general.alignment", 32)))

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def write(self, path) -> Path:
        out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(self.tensors), len(self.kv)))
        for key, (vt, val) in self.kv.items():
            out += _str(key) + struct.pack("<I", vt) + _value(vt, val)
        offsets, at = [], 0
        for t in self.tensors:
            if t.offset is None:
                at = (at + self.alignment - 1) // self.alignment * self.alignment
                offsets.append(at)
                at += len(t.data)
            else:
                offsets.append(t.offset)
        for t, off in zip(self.tensors, offsets):
            out += _str(t.name) + struct.pack("<I", len(t.ne)) + b"".join(struct.pack("<Q", d) for d in t.ne)
            out += struct.pack("<IQ", t.qtype, off)
        align = max(self.alignment, 1)
        out += b"\0" * (-len(out) % align)
        base = len(out)
        end = base + max([off + len(t.data) for t, off in zip(self.tensors, offsets)] or [0])
        out += b"\0" * (end - base)
        for t, off in zip(self.tensors, offsets):
            out[base + off: base + off + len(t.data)] = t.data
        Path(path).write_bytes(bytes(out))
        return Path(path)


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _value(vt, val) -> bytes:
    if vt == S:
        return _str(val)
    if vt == A:
        et, items = val
        return struct.pack("<IQ", et, len(items)) + b"".join(_value(et, x) for x in items)
    return struct.pack(_FMT[GGUFValueType(vt)], val)
