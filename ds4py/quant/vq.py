"""VQ-8: routed-expert weights as 8-dimensional vector-quantised indices (docs/vq.md, seed 000 §4.1).

    w[r, 8j:8j+8] = g_r * C[idx[r, j]]        one float32 product per weight (exact: f16 gain x E4M3 codeword)

C is one codebook per layer (2^bits codewords x 8, E4M3 "fn" bytes) shared by every expert and by the gate, up
and down matrices; g_r is one f16 gain per row. Everything is a standard GGUF tensor type, so every GGUF tool
opens the file and an engine that does not know VQ fails on the expert tensors' type instead of running:

    blk.L.ffn_vq.header               I8  [32]                   magic b"DSVQ", format version, bits, ...
    blk.L.ffn_vq.codebook             I8  [2^bits, 8]            E4M3 codes
    blk.L.ffn_{m}_exps.weight         I8  [X, rows, cols/64*Bs]  index stream, Bs = bits (12 for 13-bit layers)
    blk.L.ffn_{m}_exps.vq_hi          I8  [X, rows, cols/64]     bit 12 of every index (13-bit layers only)
    blk.L.ffn_{m}_exps.vq_gain        F16 [X, rows]              row gains

Index stream: LSB-first; each run of 8 indices is Bs whole bytes, index j of a row at bits [j*Bs, j*Bs+Bs) of
the row. At 12 bits a 256-index block is 384 bytes (three 128-byte lines). 13-bit layers use the "12 + 1"
layout: the low 12 bits in a stream with exactly the 12-bit geometry, bit 12 in a separate LSB-first plane.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as Q

from ds4py.errors import GGUFError
from ds4py.quant.official import E4M3

MAGIC = b"DSVQ"
VERSION = 1
SUPPORTED_VERSIONS = (1,)          # the loader's whitelist: anything else is refused, never guessed at
HEADER_BYTES = 32
HEADER_FMT = "<4sHBBBBBBI16x"      # magic, version, bits, stream bits, group, codebook type, gain type, flags, K
GROUP = 8                          # weights per index
ROW_QUANTUM = 64                   # a row is whole runs of 8 indices (8 x 8 weights)
MIN_BITS, MAX_BITS = 6, 13
CODEBOOK_E4M3 = 1
GAIN_F16 = 1
MATRICES = ("gate", "up", "down")

E4M3_F32 = E4M3                    # code -> float32 (NaN at 0x7F / 0xFF)
_POS = E4M3[:0x7F].astype(np.float64)          # the 127 finite non-negative values, increasing with the code
E4M3_MAX = float(_POS[-1])                     # 448


# ---------------------------------------------------------------------------------------------- names
# A block is a backbone layer (an int: "blk.L") or any other block prefix of the file ("dspark.S": V4.1's draft
# stages); each block with VQ experts has its own header and codebook under that prefix.
def block_prefix(layer: int | str) -> str:
    return layer if isinstance(layer, str) else f"blk.{layer}"


def block_of(name: str) -> str:
    """The block prefix of a routed-expert tensor name: "blk.3.ffn_up_exps.weight" -> "blk.3"."""
    return ".".join(name.split(".")[:2])


def header_name(layer: int | str) -> str:
    return f"{block_prefix(layer)}.ffn_vq.header"


def codebook_name(layer: int | str) -> str:
    return f"{block_prefix(layer)}.ffn_vq.codebook"


def payload_name(layer: int | str, m: str) -> str:
    return f"{block_prefix(layer)}.ffn_{m}_exps.weight"


def gain_name(payload: str) -> str:
    return payload.removesuffix(".weight") + ".vq_gain"


def hi_name(payload: str) -> str:
    return payload.removesuffix(".weight") + ".vq_hi"


def stream_bits(bits: int) -> int:
    return 12 if bits == 13 else bits


def row_bytes(cols: int, bits: int) -> int:
    """Bytes of one row's index stream (the hi plane, at 13 bits, adds cols/64 more)."""
    return cols // ROW_QUANTUM * stream_bits(bits)


def is_vq(f, name: str) -> bool:
    """Whether a routed-expert tensor of GGUF `f` is stored as VQ-8 (an I8 index stream)."""
    t = f.tensors.get(name)
    return t is not None and t.qtype == Q.I8


# ---------------------------------------------------------------------------------------------- header
@dataclass(frozen=True)
class Header:
    bits: int
    version: int = VERSION

    @property
    def n_codewords(self) -> int:
        return 1 << self.bits

    def pack(self) -> np.ndarray:
        raw = struct.pack(HEADER_FMT, MAGIC, self.version, self.bits, stream_bits(self.bits), GROUP,
                          CODEBOOK_E4M3, GAIN_F16, 0, self.n_codewords)
        return np.frombuffer(raw, np.uint8).copy()

    @classmethod
    def parse(cls, raw: np.ndarray, where: str) -> "Header":
        """Header bytes -> Header; a foreign, newer or inconsistent header is one GGUFError sentence."""
        b = np.asarray(raw).view(np.uint8).reshape(-1).tobytes()
        if len(b) != HEADER_BYTES:
            raise GGUFError(f"{where}: VQ header has {len(b)} bytes, expected {HEADER_BYTES}")
        magic, version, bits, sbits, group, cb, gain, flags, k = struct.unpack(HEADER_FMT, b)
        if magic != MAGIC:
            raise GGUFError(f"{where}: not a ds4py VQ-8 payload (magic {magic!r}, expected {MAGIC!r})")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{where}: VQ format version {version} is not supported by this ds4py "
                            f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))})")
        if (not MIN_BITS <= bits <= MAX_BITS or sbits != stream_bits(bits) or group != GROUP or cb != CODEBOOK_E4M3
                or gain != GAIN_F16 or flags or k != 1 << bits or any(b[16:])):
            raise GGUFError(f"{where}: corrupt VQ header (bits {bits}, stream bits {sbits}, group {group}, "
                            f"codebook type {cb}, gain type {gain}, flags {flags}, codewords {k})")
        return cls(bits, version)


# ---------------------------------------------------------------------------------------------- E4M3
def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float -> E4M3 (fn) codes: round to nearest, ties to the even code, saturating at +-448; 0 -> 0x00."""
    x = np.asarray(x, dtype=np.float64)
    if not np.isfinite(x).all():
        raise ValueError("E4M3 encode: the input holds NaN or inf")
    a = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(_POS, a), 1, len(_POS) - 1)     # _POS[hi-1] < a <= _POS[hi] (a > 0)
    lo = hi - 1
    mid = (_POS[lo] + _POS[hi]) / 2                               # exact in float64
    code = np.where(a < mid, lo, np.where(a > mid, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a == 0, 0, code).astype(np.uint8)
    return np.where((x < 0) & (code != 0), code | 0x80, code).astype(np.uint8)


# ---------------------------------------------------------------------------------------------- bit packing
def _layout(bits: int) -> list[tuple[int, int, int]]:
    """For each of the 8 indices of a run: (first byte, bit shift, bytes spanned) in the Bs-byte run."""
    sb = stream_bits(bits)
    return [((j * sb) >> 3, (j * sb) & 7, (((j * sb) & 7) + sb + 7) >> 3) for j in range(GROUP)]


def pack_indices(idx: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Indices (..., n), n a multiple of 8, each < 2^bits -> (stream uint8 (..., n/8*Bs), hi plane or None)."""
    idx = np.asarray(idx).astype(np.uint32, copy=False)
    *lead, n = idx.shape
    if n % GROUP:
        raise ValueError(f"VQ pack: {n} indices per row is not a multiple of {GROUP}")
    if idx.size and int(idx.max()) >> bits:
        raise ValueError(f"VQ pack: an index does not fit in {bits} bits")
    sb = stream_bits(bits)
    runs = idx.reshape(-1, n // GROUP, GROUP)
    low = runs & np.uint32((1 << sb) - 1)
    out = np.zeros((*runs.shape[:2], sb), np.uint8)
    for j, (q, s, span) in enumerate(_layout(bits)):
        v = low[..., j] << np.uint32(s)
        for k in range(span):
            out[..., q + k] |= ((v >> np.uint32(8 * k)) & np.uint32(0xFF)).astype(np.uint8)
    stream = out.reshape(*lead, n // GROUP * sb)
    if bits <= 12:
        return stream, None
    hb = ((runs >> np.uint32(12)) & np.uint32(1)).astype(np.uint8)          # (-1, n/8, 8)
    hi = np.packbits(hb, axis=-1, bitorder="little").reshape(*lead, n // GROUP)
    return stream, hi


def unpack_indices(stream: np.ndarray, hi: np.ndarray | None, bits: int) -> np.ndarray:
    """Inverse of pack_indices: stream uint8 (..., n/8*Bs) [+ hi (..., n/8)] -> int32 indices (..., n)."""
    sb = stream_bits(bits)
    stream = np.asarray(stream).view(np.uint8)
    *lead, nb = stream.shape
    if nb % sb:
        raise ValueError(f"VQ unpack: a row of {nb} bytes is not whole runs of {sb} bytes")
    runs = stream.reshape(-1, nb // sb, sb)
    out = np.empty((*runs.shape[:2], GROUP), np.uint32)
    mask = np.uint32((1 << sb) - 1)
    for j, (q, s, span) in enumerate(_layout(bits)):
        v = runs[..., q].astype(np.uint32)
        for k in range(1, span):
            v |= runs[..., q + k].astype(np.uint32) << np.uint32(8 * k)
        out[..., j] = (v >> np.uint32(s)) & mask
    if bits > 12:
        if hi is None:
            raise ValueError("VQ unpack: a 13-bit stream needs its hi bit plane")
        hb = np.unpackbits(np.asarray(hi).view(np.uint8).reshape(-1, nb // sb, 1), axis=-1, bitorder="little")
        out |= hb.astype(np.uint32) << np.uint32(12)
    return out.reshape(*lead, nb // sb * GROUP).view(np.int32)


def decode_rows(stream: np.ndarray, hi: np.ndarray | None, gains: np.ndarray, codebook: np.ndarray,
                bits: int) -> np.ndarray:
    """Rows of a VQ matrix -> float32 (rows, cols): gains[r] * codebook[idx[r, j]] (codebook: float32 [K, 8])."""
    idx = unpack_indices(stream, hi, bits)
    rows, n = idx.shape
    w = np.take(codebook, idx, axis=0).reshape(rows, n * GROUP)
    w *= np.asarray(gains, dtype=np.float32).reshape(rows, 1)
    return w


# ---------------------------------------------------------------------------------------------- reading a GGUF
@dataclass(frozen=True)
class Layer:
    header: Header
    codebook: np.ndarray            # float32 [K, 8], decoded E4M3


def read_layer(f, layer: int | str) -> Layer:
    """Parse and check layer `layer`'s header and codebook (GGUFError naming the tensor on any problem)."""
    hname, cname = header_name(layer), codebook_name(layer)
    where = f"{f.path}: {hname}"
    if hname not in f.tensors:
        raise GGUFError(f"{f.path}: layer {layer} has VQ expert tensors but no {hname!r} tensor")
    h = f.tensors[hname]
    if h.qtype != Q.I8:
        raise GGUFError(f"{where}: has type {h.qtype.name}, expected I8")
    header = Header.parse(h.raw, where)
    cb = f.tensor(cname, types=(Q.I8,), shape=(header.n_codewords, GROUP))
    codes = np.asarray(cb.raw).view(np.uint8)
    if ((codes & 0x7F) == 0x7F).any():
        raise GGUFError(f"{f.path}: {cname}: the codebook holds NaN codes")
    return Layer(header, np.ascontiguousarray(E4M3_F32[codes]))


def check_expert(f, name: str, shape: tuple[int, ...]) -> Layer:
    """Check a VQ routed-expert tensor against its logical numpy-order shape (X, rows, cols)."""
    X, rows, cols = shape
    lay = read_layer(f, block_of(name))
    bits = lay.header.bits
    if cols % ROW_QUANTUM:
        raise GGUFError(f"{f.path}: {name}: VQ rows must be a multiple of {ROW_QUANTUM} weights, the model's are {cols}")
    f.tensor(name, types=(Q.I8,), shape=(X, rows, row_bytes(cols, bits)))
    f.tensor(gain_name(name), types=(Q.F16,), shape=(X, rows))
    hname = hi_name(name)
    if bits == 13:
        f.tensor(hname, types=(Q.I8,), shape=(X, rows, cols // ROW_QUANTUM))
    elif hname in f.tensors:
        raise GGUFError(f"{f.path}: {hname}: a {bits}-bit layer has no hi bit plane (only 13-bit layers do)")
    return lay


class VQExperts:
    """Decodes VQ routed experts of one open GGUF; row gains can be rescaled at load (sidecars)."""

    def __init__(self, f):
        self.f = f
        self._layers: dict[str, Layer] = {}
        self._scales: dict[str, list[np.ndarray]] = {}

    def layer(self, layer: int | str) -> Layer:
        key = block_prefix(layer)
        if key not in self._layers:
            self._layers[key] = read_layer(self.f, key)
        return self._layers[key]

    def bits(self, name: str) -> int:
        return self.layer(block_of(name)).header.bits

    def scale_rows(self, name: str, scale: np.ndarray) -> None:
        """Multiply the row gains of expert tensor `name` by scale [X, rows] (applied in call order:
        g_eff = fl32(fl32(g_base * s1) * s2) ...). Call before the first forward: decoded experts are cached."""
        X, rows = self.f.tensor(gain_name(name)).shape
        s = np.asarray(scale, dtype=np.float32)
        if s.shape != (X, rows):
            raise GGUFError(f"{name}: a row-gain scale must be [{X}, {rows}], got {list(s.shape)}")
        self._scales.setdefault(name, []).append(s)

    def gains(self, name: str, e: int) -> np.ndarray:
        """Expert e's effective row gains (float32 [rows])."""
        g = np.asarray(self.f.tensor(gain_name(name)).raw[e]).astype(np.float32)
        for s in self._scales.get(name, ()):
            g = g * s[e]
        return g

    def expert(self, name: str, e: int) -> np.ndarray:
        """Expert e's float32 [out, in] matrix."""
        lay = self.layer(block_of(name))
        bits = lay.header.bits
        stream = self.f.tensor(name).raw_bytes()[e]
        hi = self.f.tensor(hi_name(name)).raw_bytes()[e] if bits == 13 else None
        return decode_rows(stream, hi, self.gains(name, e), lay.codebook, bits)


def tensor_roles(f) -> dict[str, tuple[str, int]]:
    """For `inspect`: every VQ tensor -> (label like 'VQ8x12', logical weights it holds; 0 for overhead)."""
    out: dict[str, tuple[str, int]] = {}
    for name, t in f.tensors.items():
        if not name.endswith(".ffn_vq.header") or t.qtype != Q.I8:
            continue
        layer = block_of(name)
        try:
            bits = Header.parse(t.raw, f"{f.path}: {name}").bits
        except GGUFError:
            continue
        label = f"VQ8x{bits}"
        out[name] = (label, 0)
        out[codebook_name(layer)] = (label, 0)
        for m in MATRICES:
            p = payload_name(layer, m)
            if p in f.tensors and f.tensors[p].qtype == Q.I8:
                X, rows, nb = f.tensors[p].shape
                out[p] = (label, X * rows * nb // stream_bits(bits) * ROW_QUANTUM)
                for extra in (gain_name(p), hi_name(p)):
                    if extra in f.tensors:
                        out[extra] = (label, 0)
    return out
