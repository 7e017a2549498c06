"""A synthetic model's weights written straight into the device arena: every tensor of the schema at its real
shape and in the storage types of the public q2 file (ds4's slots: Q8_0 dense, F16 compressors / indexer /
router / embedding / hc `fn`, F32 vectors, IQ2_XXS gate + up and Q2_K down experts), filled with random values
by cu/fill.cu. No GGUF file and no host copy: the device check runs a full-size 43-layer decode step this way
(an 80 GB file would take longer to write than the check may run).

The seed's V4.1 layout too (`vq=VqWidths(...)`, `dense="q4_k"`): VQ-8 routed experts in the engine's device layout
(ds4py/cuda/vq_layout.py: codebook, line-padded 12-bit index streams, the 13-bit layers' hi planes, f32 row
gains; random indices, a codebook of finite E4M3 codewords below 2 in magnitude, gains ~ 1 / sqrt(fan_in)) and
`quantize-vq --dense q4_k`'s Q4_K matrices. A V4.1 config's Engram reads a small synthetic table file
(`write_engram_table`, `engram_feed`): the real hash over a random compressed token map, each id taken modulo
the table's rows, so a step gathers the real number of rows and bytes from a file.

Magnitudes follow ds4py/tiny.py (make-tiny): projections ~ N(0, 1/fan_in)-sized, norms near 1, the IQ2_XXS /
Q2_K block scales make-tiny uses, ids below the expert count, so the forward stays finite and the router
spreads tokens over experts as a real model does. `to_host(weights)` reads every tensor back (for writing the
same model as a GGUF the reference can run: tests/test_cuda_engine_synth.py).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as QT

from ds4py import quant, schema
from ds4py.cuda.memory import DeviceArray, align_up
from ds4py.cuda.device_weights import DevTensor, DeviceWeights, place_after, role, rope_tables, upload_float32
from ds4py.cuda.ops import fill
from ds4py.vq.quantize import Q4K_SUFFIXES
from ds4py.cuda.ops.experts import VQ_FORMATS, matrix_bytes, vq_expert_bytes, vq_format, vq_row_parts

SLOT_TYPES = {"q8": QT.Q8_0, "f16": QT.F16, "f32": QT.F32, "i32": QT.I32}
Q2_EXPERTS = (QT.IQ2_XXS, QT.Q2_K)                   # the public q2 file's gate + up and down

# per block format: (block bytes, f16 scale offsets, e8m0 offset)
BLOCK_FIELDS = {QT.Q8_0: (34, (0,), -1), QT.IQ2_XXS: (66, (0,), -1), QT.Q2_K: (84, (80, 82), -1),
                QT.Q4_K: (144, (0, 2), -1), QT.MXFP4: (17, (), 0)}


@dataclass(frozen=True)
class VqWidths:
    """VQ-8 experts as the seed lays them out: `shallow` bits in the first shallow_layers layers, `bits` after."""
    bits: int = 12
    shallow: int = 13
    shallow_layers: int = 14

    def format(self, layer: int) -> str:
        fmt = vq_format(self.shallow if layer < self.shallow_layers else self.bits)
        if fmt is None:
            raise ValueError(f"no VQ-8 kernel reads {self}")
        return fmt


def tensor_type(e: schema.Entry, experts: tuple[QT, QT], dense: str | None = None) -> QT:
    if e.spec.slot == "experts":
        return experts[1] if e.spec.field.endswith(".down") else experts[0]
    if (dense == "q4_k" and e.spec.slot == "q8" and e.shape[-1] % 256 == 0
            and (e.name == "output.weight" or e.name.endswith(Q4K_SUFFIXES))):
        return QT.Q4_K                               # quantize-vq --dense q4_k's choice (vq.quantize.Q4K_SUFFIXES)
    return SLOT_TYPES[e.spec.slot]


def _dtype(qt: QT) -> np.dtype:
    return np.dtype({QT.F32: np.float32, QT.F16: np.float16, QT.I32: np.int32}.get(qt, np.uint8))


def _device_shape(qt: QT, shape: tuple[int, ...]) -> tuple[int, ...]:
    if qt in (QT.F32, QT.F16, QT.I32):
        return tuple(shape)
    return (*shape[:-1], quant.row_nbytes(qt, shape[-1]))


def fingerprint(cfg, experts: tuple[QT, QT], seed: int, vq: VqWidths | None = None, dense: str | None = None) -> str:
    text = f"{cfg!r}|{experts[0].name},{experts[1].name}|{seed}" + (f"|{vq}|{dense}" if vq or dense else "")
    return "synthetic-" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _vec_range(field: str) -> tuple[float, float]:
    leaf = field.rsplit(".", 1)[-1]
    if leaf in ("base", "sinks", "route_bias"):
        return -0.5, 0.5
    return 0.9, 1.1                                  # norms, hc scales


def _place(entries: list, experts: tuple[QT, QT], vq: "VqWidths | None", dense: str | None
           ) -> tuple[list[tuple], int]:
    """Each entry's storage type, device shape, byte offset and VQ-8 format in one blob -> (plan, blob bytes)."""
    plan, at = [], 0
    for e in entries:
        if vq is not None and e.spec.slot == "experts":
            fmt = vq.format(e.layer)
            qt, shape = QT.I8, (matrix_bytes(fmt, *e.shape),)     # the device copy vq_layout.pack lays out
        else:
            fmt, qt = None, tensor_type(e, experts, dense)
            shape = _device_shape(qt, e.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * _dtype(qt).itemsize
        plan.append((e, qt, shape, at, fmt))
        at += align_up(nbytes)
    return plan, at


def _fill_blob(rt: Any, cfg, blob: DeviceArray, plan: list[tuple], seed: int) -> dict[str, DevTensor]:
    """Every byte of `blob` random, then each planned tensor's fields made valid (_fill / _fill_vq)."""
    writable = DeviceArray(blob.ptr, blob.shape, blob.dtype, False, blob.mem)    # the model reads it, fills write
    fill.fill_random_u32(rt, writable, seed)             # every byte random (quantised blocks: valid codes)
    tensors: dict[str, DevTensor] = {}
    for i, (e, qt, shape, off, fmt) in enumerate(plan):
        tensors[e.name] = DevTensor(e.name, qt, tuple(e.shape), blob.view(off, shape, _dtype(qt)), fmt)
        if fmt is not None:
            _fill_vq(rt, e, fmt, writable.view(off, shape, np.uint8), seed * 1000003 + i)
        else:
            _fill(rt, e, qt, writable.view(off, shape, _dtype(qt)), cfg, seed * 1000003 + i)
    return tensors


def load(rt: Any, cfg, scratch_bytes: int, seed: int = 0, experts: tuple[QT, QT] = Q2_EXPERTS,
         vq: VqWidths | None = None, dense: str | None = None) -> DeviceWeights:
    """The schema's tensors of `cfg` in one arena, filled on the device; bound like a loaded GGUF. vq: VQ-8 routed
    experts at these widths (instead of `experts`); dense="q4_k": quantize-vq --dense q4_k's Q4_K matrices."""
    plan, at = _place(list(schema.entries(cfg)), experts, vq, dense)
    tables = rope_tables(cfg)
    distinct: dict[bytes, np.ndarray] = {}
    for a in tables.values():
        distinct.setdefault(a.tobytes(), a)
    extra = sum(align_up(a.nbytes) for a in distinct.values()) + 256
    arena = rt.arena(weights_bytes=at + extra, scratch_bytes=scratch_bytes)
    blob = arena.weights(at, np.uint8)                   # read-only to the model's kernels, written by the fills
    tensors = _fill_blob(rt, cfg, blob, plan, seed)
    by_bytes = {}
    for k, a in distinct.items():
        d = arena.weights(a.shape, a.dtype)
        d.upload(a)
        by_bytes[k] = d
    freqs = [by_bytes[tables[il].tobytes()] for il in range(cfg.n_layers)]
    rt.synchronize()
    return DeviceWeights(arena, schema.bind(cfg, tensors.__getitem__), freqs, at, extra)


def load_mtp(rt: Any, store: Any, cfg, seed: int = 0, experts: tuple[QT, QT] = Q2_EXPERTS,
             vq: VqWidths | None = None, dense: str | None = None, extra: tuple[np.ndarray, ...] = ()
             ) -> tuple[Any, dict[str, DevTensor], list[DeviceArray]]:
    """The MTP block's tensors (schema.mtp_entries of the main config `cfg`) in one device block of `store`, filled
    as `load` fills the main model's (its VQ-8 experts at the first layer's width), plus the float32 arrays
    `extra` after them: device_weights.upload_entries' result, without a file."""
    plan, at = _place(list(schema.mtp_entries(cfg)), experts, vq, dense)
    offs, end = place_after(extra, at)
    blk = store.block(end)
    tensors = _fill_blob(rt, cfg, blk.array(0, (max(at, 4),), np.uint8), plan, seed)
    arrays = upload_float32(blk, extra, offs)
    rt.synchronize()
    return blk, tensors, arrays


def _fill(rt: Any, e: schema.Entry, qt: QT, arr, cfg, seed: int) -> None:
    kind, fan_in = role(e.spec.field), e.shape[-1]
    a = math.sqrt(3.0 / fan_in)                      # uniform [-a, a]: variance 1 / fan_in
    if qt == QT.I32:
        fill.fill_i32_rows(rt, arr, cfg.n_experts_used, cfg.n_experts, seed)
    elif qt == QT.F32 or (qt == QT.F16 and kind in ("vec",)):
        lo, hi = _vec_range(e.spec.field) if kind == "vec" else (-0.5, 0.5)
        fill.fill_uniform(rt, arr, lo, hi, seed)
    elif qt == QT.F16:
        lim = 1.0 if kind in ("embed", "ape") else a
        fill.fill_uniform(rt, arr, -lim, lim, seed)
    else:
        block, f16_at, e8m0_at = BLOCK_FIELDS[qt]
        k = math.sqrt(256.0 / fan_in)
        scale = {QT.Q8_0: a / 128.0, QT.IQ2_XXS: 0.003 * k, QT.Q2_K: 0.004 * k, QT.Q4_K: a / 256.0}.get(qt, 1.0)
        e8 = max(0, min(254, 127 + int(round(math.log2(a / 6.0)))))
        fields = fill.BlockFields(block_bytes=block, f16_at=f16_at, scale=scale, e8m0_at=e8m0_at,
                                  e8m0_range=(e8 - 1, e8))
        fill.fix_block_fields(rt, arr.view(0, arr.nbytes, np.uint8), fields, seed)


def _finite_e4m3(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random E4M3 bytes with the exponent field in 3..7 (|v| in [1/16, 2), never NaN), from random bytes."""
    b = rng.integers(0, 256, n, dtype=np.uint8)
    e = ((b >> 3) & 0xF) % 5 + 3
    return (b & 0x87) | (e << 3).astype(np.uint8)


def _fill_vq(rt: Any, e: schema.Entry, fmt: str, arr: DeviceArray, seed: int) -> None:
    """A VQ-8 matrix in the device layout: the indices and hi planes stay the blob's random bytes (every index
    names a codeword); the codebook gets finite E4M3 codewords (exponent field 3..7: magnitudes 1/16 .. 2) and the
    gains uniform in [0.5, 1.5] / sqrt(fan_in), positive (the codewords carry the sign)."""
    X, rows, cols = e.shape
    _, _, kc = VQ_FORMATS[fmt]
    rng = np.random.default_rng(seed)
    arr.view(0, kc * 8).upload(_finite_e4m3(rng, kc * 8))
    at = kc * 8 + X * vq_expert_bytes(fmt, rows, cols) + X * rows * vq_row_parts(fmt, cols)[1]
    if at % 4:
        raise ValueError(f"{e.name}: the gains of a {fmt} matrix would start at byte {at}, not a float")
    a = 1.0 / math.sqrt(cols)
    fill.fill_uniform(rt, arr.view(at, X * rows, np.float32), 0.5 * a, 1.5 * a, seed)


def to_host(w: DeviceWeights, cfg) -> dict[str, tuple[QT, np.ndarray]]:
    """Every schema tensor back on the host: (type, array as a GGUF writer takes it)."""
    out = {}
    for e in schema.entries(cfg):
        t = _lookup(w.binding, e)
        out[e.name] = (t.qtype, t.array.download())
    return out


def _lookup(b: schema.ModelWeights, e: schema.Entry) -> DevTensor:
    obj: Any = b if e.layer is None else b.layers[e.layer]
    for part in e.spec.field.split("."):
        obj = getattr(obj, part)
    return obj


# ---- Engram from a small synthetic table (V4.1) -------------------------------------------------------------
def write_engram_table(path: str, cfg, rows: int, seed: int = 0) -> str:
    """A small Engram table file for every Engram layer of cfg: per layer [rows, head_dim] e4m3 codes (finite, as
    the codebook's) then [rows, head_dim / 32] e8m0 scales near 2^-4 .. 2^0, back to back; written in 16 MiB
    pieces (the device check writes it at check time). Returns path."""
    rng = np.random.default_rng(seed)
    W = cfg.engram_head_dim
    piece = max(1, (16 << 20) // W)
    with open(path, "wb") as f:
        for _ in cfg.engram_layers:
            for r0 in range(0, rows, piece):
                n = min(piece, rows - r0)
                f.write(_finite_e4m3(rng, n * W).tobytes())
            f.write(rng.integers(123, 128, (rows, W // 32)).astype(np.uint8).tobytes())
    return path


class SmallEngramTables:
    """EngramTables' gather interface (codes, codes_into, rows_read) over write_engram_table's file: each hash id
    is taken modulo the table's rows, so a step reads the real number of rows (and bytes) of a real table."""

    def __init__(self, cfg, path: str, rows: int):
        W = cfg.engram_head_dim
        per_layer = rows * (W + W // 32)
        if os.path.getsize(path) != per_layer * len(cfg.engram_layers):
            raise ValueError(f"{path} does not hold {len(cfg.engram_layers)} Engram tables of {rows} rows")
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        self.tables = [(mm[e * per_layer: e * per_layer + rows * W].reshape(rows, W),
                        mm[e * per_layer + rows * W: (e + 1) * per_layer].reshape(rows, W // 32))
                       for e in range(len(cfg.engram_layers))]
        self.rows, self.row_dim, self.rows_read = rows, W, 0

    def codes(self, e: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w, s = self.tables[e]
        flat = np.asarray(ids, np.int64).reshape(-1) % self.rows
        self.rows_read += len(flat)
        return w[flat].reshape(len(ids), -1), s[flat].reshape(len(ids), -1)

    def codes_into(self, e: int, ids: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
        w, s = self.tables[e]
        flat = np.asarray(ids, np.int64).reshape(-1) % self.rows
        self.rows_read += len(flat)
        np.take(w, flat, axis=0, out=codes.reshape(len(flat), -1))
        np.take(s, flat, axis=0, out=scales.reshape(len(flat), -1))


def engram_feed(cfg, path: str, rows: int, seed: int = 0):
    """The synthetic model's EngramFeed: the real hasher over a random compressed token map, the small table."""
    from ds4py.cuda.engram_feed import EngramFeed
    from ds4py.engram import NgramHasher

    token_map = np.random.default_rng(seed).integers(0, cfg.engram_compressed_vocab, cfg.vocab_size)
    token_map[cfg.engram_pad_id] = 0
    return EngramFeed(cfg, NgramHasher.from_token_map(cfg, token_map, "synthetic"),
                      SmallEngramTables(cfg, path, rows))
