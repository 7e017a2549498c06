"""Memory-mapped GGUF reading: metadata and zero-copy numpy views of every tensor.

The header is parsed here directly (the `gguf` package's reader builds one numpy view per metadata string,
which takes ~10 s on the real 129k-token vocabulary; this takes well under a second). Every problem a user
can hit — not a GGUF, truncated, unsupported version, missing tensor, wrong type or shape — is one sentence
naming the file and the tensor.

Shapes here are numpy order: the reverse of GGUF `ne` (ne0, the fastest / input dim, is the last axis).
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
from ds4py.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

from ds4py.errors import GGUFError

SUPPORTED_VERSIONS = (2, 3)
GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                      # GGML_MAX_DIMS
_MIN_KV_BYTES = 8 + 4             # key length + value type (and at least one value byte, not counted)
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8    # name length, n_dims, type, offset

# GGUF metadata value types -> struct format
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q").unpack_from
LAZY_STRINGS = 1024               # string arrays at least this long (the vocabulary, the merges) are read on use

# element dtypes of the unquantised tensor types: `raw` is a typed view for these
_TYPED = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class _Header:
    """Sequential reader over the mapped header bytes; every overrun is a 'truncated' error."""

    def __init__(self, buf: np.ndarray, path: str):
        self.buf, self.mv, self.pos, self.path = buf, memoryview(buf), 0, path

    def unpack(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header (needs byte {self.pos + n}, file has {len(self.buf)})")
        out = struct.unpack_from(fmt, self.mv, self.pos)
        self.pos += n
        return out if len(out) > 1 else out[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header (a string runs past the end of the file)")
        raw = bytes(self.mv[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="surrogateescape")

    def skip_strings(self, count: int) -> "_LazyStrings":
        """Step over `count` strings (lengths only, nothing decoded): the arrays a model open does not read."""
        start, pos, size, mv, u64 = self.pos, self.pos, len(self.buf), self.mv, _U64
        try:
            for _ in range(count):
                pos += 8 + u64(mv, pos)[0]
        except struct.error:                 # a length field past the end
            pos = size + 1
        if pos > size:
            raise GGUFError(f"{self.path}: truncated GGUF header (a string runs past the end of the file)")
        self.pos = pos
        return _LazyStrings(start, count)

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            least = struct.calcsize(_SCALARS[etype]) if etype in _SCALARS else 8 if etype == _STRING else 12
            if count * least > len(self.buf) - self.pos:      # checked before reading a single element
                raise GGUFError(f"{self.path}: truncated or corrupt GGUF header (an array of {count} elements runs "
                                f"past the end of the file)")
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                n = struct.calcsize(fmt) * count
                if self.pos + n > len(self.buf):
                    raise GGUFError(f"{self.path}: truncated GGUF header (an array runs past the end of the file)")
                out = list(struct.unpack_from(f"<{count}{fmt[1]}", self.mv, self.pos))
                self.pos += n
                return out
            if etype == _STRING and count >= LAZY_STRINGS:
                return self.skip_strings(count)
            return [self.value(etype) for _ in range(count)]
        raise GGUFError(f"{self.path}: corrupt GGUF header (unknown metadata value type {vtype} at byte {self.pos})")


@dataclass(frozen=True)
class _LazyStrings:
    """A long string array not decoded yet: where it starts in the header and how many strings it holds."""
    pos: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]      # numpy order (reversed ne)
    raw: np.ndarray             # memory-mapped: typed view of `shape` for F32/F16/I32..., else uint8 (..., rows, row_nbytes)
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
        if os.path.isdir(self.path):
            raise GGUFError(f"{self.path}: is a directory, expected a .gguf file")
        if not os.path.isfile(self.path):
            raise GGUFError(f"{self.path}: no such file")
        self.file_size = os.path.getsize(self.path)
        with open(self.path, "rb") as fh:
            head = fh.read(8)
        if len(head) < 8 or head[:4] != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
        version = int.from_bytes(head[4:8], "little")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (supported: 2, 3)")
        self.version = version
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        h = _Header(self._map, self.path)
        h.pos = 8
        n_tensors, n_kv = h.unpack("<Q"), h.unpack("<Q")
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > self.file_size:
            raise GGUFError(f"{self.path}: corrupt or truncated GGUF header ({n_tensors} tensors and {n_kv} metadata "
                            f"entries cannot fit in {self.file_size} bytes)")
        self._meta: dict[str, Any] = {}
        self.kv_spans: dict[str, tuple[int, int]] = {}     # key -> (start, end) bytes of its entry (checksums)
        for _ in range(n_kv):
            start = h.pos
            key = h.string()
            if key in self._meta:
                raise GGUFError(f"{self.path}: corrupt GGUF header (metadata key {key!r} appears twice)")
            self._meta[key] = h.value(h.unpack("<I"))
            self.kv_spans[key] = (start, h.pos)
        infos = []
        for _ in range(n_tensors):
            name = h.string()
            n_dims = h.unpack("<I")
            if n_dims > MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (GGUF allows at most {MAX_DIMS}):"
                                f" the header is corrupt")
            ne = [h.unpack("<Q") for _ in range(n_dims)]
            infos.append((name, ne, h.unpack("<I"), h.unpack("<Q")))
        align = self._meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
            raise GGUFError(f"{self.path}: general.alignment is {align!r}; it must be a power of two (GGUF default "
                            f"{DEFAULT_ALIGNMENT})")
        data_start = (h.pos + align - 1) // align * align
        self._tensors: dict[str, TensorInfo] = {}
        spans = []
        for name, ne, tcode, rel in infos:
            if name in self._tensors:
                raise GGUFError(f"{self.path}: corrupt GGUF header (tensor {name!r} appears twice)")
            try:
                qtype = GGMLQuantizationType(tcode)
                block, bsize = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown ggml type {tcode}") from None
            shape = tuple(int(x) for x in reversed(ne)) or (1,)
            if shape[-1] % block:
                raise GGUFError(f"{self.path}: tensor {name!r} row length {shape[-1]} is not a multiple of the "
                                f"{qtype.name} block size {block}")
            nbytes = 1                              # Python ints: an absurd dimension cannot overflow
            for d in shape[:-1]:
                nbytes *= d
            nbytes *= shape[-1] // block * bsize
            if rel % align:
                raise GGUFError(f"{self.path}: tensor {name!r} starts at data offset {rel}, which is not a multiple of "
                                f"the alignment {align}: the header is corrupt")
            off = data_start + int(rel)
            if off + nbytes > self.file_size:
                raise GGUFError(f"{self.path}: truncated or corrupt: tensor {name!r} {list(shape)} ({qtype.name}) "
                                f"ends at byte {off + nbytes} but the file has {self.file_size}")
            spans.append((off, off + nbytes, name))
            flat = self._map[off:off + nbytes]
            if qtype in _TYPED:
                raw = flat.view(_TYPED[qtype]).reshape(shape)
            else:
                raw = flat.reshape(*(shape[:-1] or (1,)), -1)
            self._tensors[name] = TensorInfo(name, qtype, shape, raw, off, nbytes)
        end, last = 0, None                      # two tensors never share bytes
        for b0, b1, b in sorted(s for s in spans if s[1] > s[0]):
            if b0 < end:
                raise GGUFError(f"{self.path}: tensors {last!r} and {b!r} overlap (bytes {b0}..{min(end, b1)}): the "
                                f"header is corrupt")
            end, last = b1, b

    # ---- metadata -------------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._meta)

    def has(self, key: str) -> bool:
        return key in self._meta

    def meta(self, key: str, default: Any = ...) -> Any:
        """Metadata value as a Python scalar, str, or list. Missing key: default, else GGUFError."""
        if key not in self._meta:
            if default is ...:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        v = self._meta[key]
        if isinstance(v, _LazyStrings):
            h = _Header(self._map, self.path)
            h.pos = v.pos
            v = self._meta[key] = [h.string() for _ in range(v.count)]
        return v

    def metadata(self) -> dict[str, Any]:
        return {k: self.meta(k) for k in self._meta}

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

    def advise(self, offset: int, nbytes: int, advice: int) -> bool:
        """madvise(2) on bytes [offset, offset + nbytes) of the mapped file (the start rounded down to a page);
        False where the platform has no madvise. A hint only: results never depend on it."""
        m = getattr(self._map, "_mmap", None)
        if m is None or not hasattr(m, "madvise") or nbytes <= 0:
            return False
        start = offset - offset % mmap.PAGESIZE
        m.madvise(advice, start, min(offset + nbytes, self.file_size) - start)
        return True


    def populate(self, offset: int, nbytes: int, stop=None, step: int = 16 << 20) -> bool:
        """Map bytes [offset, offset + nbytes) into this process's page tables (madvise MADV_POPULATE_READ,
        Linux 5.14+), reading from disk what is not cached, in pieces of `step` bytes with the GIL released
        (ctypes), so a background thread can do it while the model runs. stop: a threading.Event that ends it
        early. False where the platform lacks it (then nothing more is tried) or when stopped. A hint only.
        Small pieces (~1 ms each on a cached file): the call holds the address space's lock for reading, and the
        model thread's own mmap calls (numpy's large allocations) wait for it."""
        lib = _libc()
        if lib is None or nbytes <= 0:
            return False
        base = self._map.ctypes.data
        page = mmap.PAGESIZE
        pos = offset - offset % page
        end = min(offset + nbytes, self.file_size)
        while pos < end:
            if stop is not None and stop.is_set():
                return False
            n = min(step, end - pos)
            if lib.madvise(base + pos, n, MADV_POPULATE_READ) != 0:
                return False
            pos += n
        return True


MADV_POPULATE_READ = 22                  # linux/mman.h, kernel 5.14+ (older kernels: EINVAL -> not supported)
_LIBC: list = []


def _libc():
    """libc's madvise through ctypes (which releases the GIL around the call), or None off Linux."""
    if not _LIBC:
        lib = None
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                lib = ctypes.CDLL(None, use_errno=True)
                lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
                lib.madvise.restype = ctypes.c_int
            except (OSError, AttributeError):
                lib = None
        _LIBC.append(lib)
    return _LIBC[0]


def row_nbytes(qtype: GGMLQuantizationType, ncols: int) -> int:
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(qtype))]
    return ncols // block * nbytes
