"""A streaming GGUF v3 writer: the source file's metadata records copied byte for byte, tensor data written in
pieces as it is produced, to a temporary file renamed over OUT only when complete.

gguf.GGUFWriter needs each tensor whole and the metadata re-typed from Python values; the quantiser produces a
tensor one expert at a time and must not change a single metadata byte it does not own.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as Q

from ds4py.errors import GGUFError

_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _U32 = 8, 9, 4


def kv_records(path: str) -> list[tuple[str, bytes]]:
    """Every metadata record of a GGUF (v2/v3) as (key, the record's raw bytes: key, type and value)."""
    with open(path, "rb") as fh:
        head = fh.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file")
        n_kv = struct.unpack_from("<Q", head, 16)[0]
        buf = bytearray(head)

        def need(n: int) -> None:
            while len(buf) < pos + n:
                more = fh.read(max(1 << 20, pos + n - len(buf)))
                if not more:
                    raise GGUFError(f"{path}: truncated GGUF header")
                buf.extend(more)

        def u(fmt: str) -> int:
            nonlocal pos
            need(struct.calcsize(fmt))
            v = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return v

        def skip_value(vtype: int) -> None:
            nonlocal pos
            if vtype in _SCALAR_SIZE:
                need(_SCALAR_SIZE[vtype])
                pos += _SCALAR_SIZE[vtype]
            elif vtype == _STRING:
                n = u("<Q")
                need(n)
                pos += n
            elif vtype == _ARRAY:
                etype, count = u("<I"), u("<Q")
                if etype in _SCALAR_SIZE:
                    need(_SCALAR_SIZE[etype] * count)
                    pos += _SCALAR_SIZE[etype] * count
                else:
                    for _ in range(count):
                        skip_value(etype)
            else:
                raise GGUFError(f"{path}: corrupt GGUF header (metadata value type {vtype})")

        pos, out = 24, []
        for _ in range(n_kv):
            start = pos
            n = u("<Q")
            need(n)
            key = bytes(buf[pos:pos + n]).decode("utf-8", errors="surrogateescape")
            pos += n
            skip_value(u("<I"))
            out.append((key, bytes(buf[start:pos])))
        return out


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv_record(key: str, value: Any) -> bytes:
    """A metadata record for an int (u32) or str value."""
    if isinstance(value, str):
        return _string(key) + struct.pack("<I", _STRING) + _string(value)
    return _string(key) + struct.pack("<II", _U32, int(value))


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]      # numpy order (the GGUF ne reversed)
    qtype: Q
    nbytes: int


class StreamWriter:
    """with StreamWriter(out_tmp, records, plans, alignment) as w: w.write(name, bytes...) in plan order."""

    def __init__(self, path: str, records: list[bytes], plans: list[TensorPlan], alignment: int):
        self.path, self.plans, self.align = path, plans, alignment
        self.fh = open(path, "wb")
        head = [b"GGUF", struct.pack("<IQQ", 3, len(plans), len(records)), *records]
        offset = 0
        self.offsets = []
        for t in plans:
            ne = tuple(reversed(t.shape))
            head.append(_string(t.name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, int(t.qtype), offset))
            self.offsets.append(offset)
            offset = self._pad(offset + t.nbytes)
        blob = b"".join(head)
        self.fh.write(blob + bytes(self._pad(len(blob)) - len(blob)))
        self.data_start = self.fh.tell()
        self.i, self.written = 0, 0          # tensor being written, its bytes so far

    def _pad(self, n: int) -> int:
        return (n + self.align - 1) // self.align * self.align

    def write(self, name: str, data: np.ndarray | bytes) -> None:
        """Append bytes of tensor `name` (the current one, or the next once the current is complete)."""
        if self.i < len(self.plans) and self.written == self.plans[self.i].nbytes and self.plans[self.i].name != name:
            self._next()
        t = self.plans[self.i]
        if t.name != name:
            raise AssertionError(f"writing {name!r}, but the plan's next tensor is {t.name!r}")
        b = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) else memoryview(data)
        if self.written + b.nbytes > t.nbytes:
            raise AssertionError(f"{name}: {self.written + b.nbytes} bytes written, planned {t.nbytes}")
        self.fh.write(b)
        self.written += b.nbytes

    def _next(self) -> None:
        t = self.plans[self.i]
        if self.written != t.nbytes:
            raise AssertionError(f"{t.name}: {self.written} bytes written, planned {t.nbytes}")
        end = self.data_start + self.offsets[self.i] + t.nbytes
        self.i += 1
        if self.i < len(self.plans):
            self.fh.write(bytes(self.data_start + self.offsets[self.i] - end))
        self.written = 0

    def finish(self) -> None:
        self._next()
        if self.i != len(self.plans):
            raise AssertionError(f"{len(self.plans) - self.i} planned tensors were not written")
        self.fh.close()

    def abort(self) -> None:
        self.fh.close()
        if os.path.exists(self.path):
            os.remove(self.path)
