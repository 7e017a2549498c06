"""The KV state as declared data: what a sequence's state holds, the rollback rule, and the blob format.

Every backend allocates its state from `state_layout(cfg, horizon)` (host arrays in ds4py.ref, device arrays in
the CUDA engine) and shares the bookkeeping (`StateCounters`) and the serialisation (`encode_state` /
`decode_state`). The layout is docs/engine.md's table: per layer a window ring, the compressors' input rings
and their emitted rows; nothing else is state.

Parts. A *ring* has a fixed number of slots, position p in slot p % capacity: it keeps the inputs later steps
may still read (the window's raw rows; the positions of a compressor group not yet pooled, plus the previous
group for an overlapping compressor), with `horizon` spare slots so that a rollback of up to `horizon` tokens
finds everything still there. A *rows* part holds one row per `period` tokens (an emitted compressed row per
group), rows g < n_tokens // period valid, and grows by doubling.

Rollback. `truncate(n)` only lowers n_tokens (nothing is copied or cleared): the rows of the removed positions
are rewritten when positions are fed again. Exact for n >= n_written - horizon, where n_written is the highest
n_tokens the state ever reached (its high-water mark): a slot of a ring is reused by the position `capacity`
later, so after a rollback the slots above n_tokens still hold the abandoned positions' rows, and a second
rollback measured from n_tokens alone could reach rows they overwrote.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ds4py.errors import Ds4Error

RING, ROWS = "ring", "rows"


@dataclass(frozen=True)
class StatePart:
    layer: int
    name: str            # win | comp_kv | comp_score | comp_rows | idx_kv | idx_score | idx_keys | ngram_ids
    kind: str            # RING | ROWS
    width: int           # floats per row
    capacity: int        # RING: slots; ROWS: 0 (grows by doubling)
    period: int          # tokens per row: 1 for a ring, the compress ratio for emitted rows
    dtype: str = "<f4"

    @property
    def key(self) -> str:
        return f"{self.layer}.{self.name}"

    def rows_for(self, n_tokens: int) -> int:
        """Rows a backend must hold after n_tokens (a ring: all its slots)."""
        return self.capacity if self.kind == RING else n_tokens // self.period


@dataclass(frozen=True)
class StateLayout:
    horizon: int                     # the rollback horizon R
    parts: tuple[StatePart, ...]

    def describe(self) -> dict[str, Any]:
        return {"horizon": self.horizon, "parts": [asdict(p) for p in self.parts]}


def state_layout(cfg, horizon: int) -> StateLayout:
    """One declaration of a sequence's state, from the config's predicates (never from literal ratios).

    Ring capacities: the window W + R; a compressor r·(1 + overlap) + R (the open group, the previous group
    when it overlaps, and R spare positions). V4.1 (MODEL.md §3) changes only the predicates' answers: layers
    that read another layer's rows own no comp_* parts, ratio-1 / ratio-2 compressors have no overlap, a
    ratio-1 compressor pools nothing (no input rings), indexer keys come from the kv source's latent (idx_keys
    only, on the key owners). Engram adds one model-wide ring of the last token ids (the n-gram history),
    declared on the first Engram layer."""
    if not isinstance(horizon, int) or horizon < 0:
        raise Ds4Error(f"the rollback horizon must be an integer >= 0, got {horizon!r}")
    R, hd, parts = horizon, cfg.head_dim, []
    for il in range(cfg.n_layers):
        ro = cfg.roles(il)
        if ro.engram == 0:
            parts.append(StatePart(il, "ngram_ids", RING, 1, cfg.engram_max_ngram - 1 + R, 1, "<i4"))
        parts.append(StatePart(il, "win", RING, hd, cfg.window + R, 1))
        if ro.compressor:
            cap = ro.ratio * (1 + ro.overlap) + R
            if ro.gated:
                parts += [StatePart(il, "comp_kv", RING, cfg.comp_width(il), cap, 1),
                          StatePart(il, "comp_score", RING, cfg.comp_width(il), cap, 1)]
            parts.append(StatePart(il, "comp_rows", ROWS, hd, 0, ro.ratio))
        if ro.indexer and cfg.has_index_compressor(il):
            cap = ro.index_ratio * (1 + ro.index_overlap) + R
            parts += [StatePart(il, "idx_kv", RING, cfg.index_comp_width(il), cap, 1),
                      StatePart(il, "idx_score", RING, cfg.index_comp_width(il), cap, 1)]
        if ro.owns_index_keys:
            parts.append(StatePart(il, "idx_keys", ROWS, cfg.index_head_dim, 0, ro.index_ratio))
    return StateLayout(R, tuple(parts))


def grown_capacity(have: int, need: int, minimum: int = 16) -> int:
    """Row capacity for `need` rows: doubling from `have` (at least `minimum`)."""
    cap = max(have, minimum)
    while cap < need:
        cap *= 2
    return cap


class StateCounters:
    """n_tokens and the rollback bookkeeping every backend's state shares (see the module docstring)."""

    def __init__(self, layout: StateLayout):
        self.layout = layout
        self.n_tokens = 0        # positions consumed
        self.n_written = 0       # high-water mark of n_tokens (rows of positions below it were written)

    @property
    def rollback_floor(self) -> int:
        """The smallest n that truncate(n) accepts."""
        return max(0, self.n_written - self.layout.horizon)

    def truncate(self, n: int) -> None:
        """Roll back to the first n tokens, exactly; O(1), nothing is copied."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise Ds4Error(f"truncate needs an integer token count, got {n!r}")
        n = int(n)
        if n > self.n_tokens or n < 0:
            raise Ds4Error(f"cannot truncate a state of {self.n_tokens} tokens to {n}: truncate only removes tokens")
        if n < self.rollback_floor:
            raise Ds4Error(f"cannot roll back to {n} tokens: the state keeps {self.layout.horizon} positions of "
                           f"rollback (the rollback horizon) below the {self.n_written} it reached, so "
                           f"{self.rollback_floor} is the earliest; keep a copy() for deeper rollbacks")
        self.n_tokens = n

    def begin_step(self, n_new: int) -> None:
        """Called before a step writes any row of its n_new positions."""
        self.n_written = max(self.n_written, self.n_tokens + n_new)

    def end_step(self, n_new: int) -> None:
        self.n_tokens += n_new


# ---- the blob: save_state / load_state ---------------------------------------------------------------------
MAGIC = b"DS4PYKV\0"
VERSION = 1
_PREFIX = struct.Struct("<8sIIQ")          # magic, version, header bytes, total bytes
_TRAILER = struct.Struct("<I")             # CRC-32 of every byte before it
ALIGN = 64


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def encode_state(model: str, numerics: dict[str, Any], layout: StateLayout, n_tokens: int, n_written: int,
                 arrays: dict[str, np.ndarray], backend: str = "") -> bytes:
    """One self-describing blob: prefix, JSON header, 64-byte-aligned part data in layout order, CRC-32.

    `arrays[key]`: a ring's whole slot array, or a rows part's first n_tokens // period rows (C order)."""
    entries, off = [], 0
    for p in layout.parts:
        a = arrays[p.key]
        want = (p.rows_for(n_tokens), p.width)
        if a.shape != want or a.dtype != np.dtype(p.dtype):
            raise Ds4Error(f"state part {p.key} is {a.dtype} {list(a.shape)}, the layout says {p.dtype} {list(want)}")
        entries.append({"key": p.key, "offset": off, "rows": a.shape[0]})
        off = _align(off + a.nbytes)
    header = json.dumps({"model": model, "numerics": numerics, "backend": backend, "n_tokens": int(n_tokens),
                         "n_written": int(n_written), "layout": layout.describe(), "parts": entries},
                        separators=(",", ":")).encode()
    data_start = _align(_PREFIX.size + len(header))
    total = data_start + off + _TRAILER.size
    pieces: list = [_PREFIX.pack(MAGIC, VERSION, len(header), total), header,
                    bytes(data_start - _PREFIX.size - len(header))]
    at = 0
    for p, e in zip(layout.parts, entries):
        if e["offset"] > at:
            pieces.append(bytes(e["offset"] - at))
        a = np.ascontiguousarray(arrays[p.key])
        pieces.append(a.reshape(-1).view(np.uint8))
        at = e["offset"] + a.nbytes
    pieces.append(bytes(off - at))
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    pieces.append(_TRAILER.pack(crc))
    return b"".join(pieces)


def decode_state(data: Any, model: str, numerics: dict[str, Any],
                 layout: StateLayout) -> tuple[int, int, dict[str, np.ndarray]]:
    """(n_tokens, n_written, arrays) from a blob, checked against this model; Ds4Error for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise Ds4Error(f"a saved state is bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size + _TRAILER.size:
        raise Ds4Error(f"not a ds4py KV state: {len(view)} bytes is shorter than its header")
    magic, version, hlen, total = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise Ds4Error("not a ds4py KV state (bad magic bytes)")
    if version != VERSION:
        raise Ds4Error(f"the KV state has format version {version}; this ds4py reads version {VERSION}")
    if total != len(view):
        raise Ds4Error(f"the KV state is truncated or padded: {len(view)} bytes, its header says {total}")
    (crc,) = _TRAILER.unpack_from(view, total - _TRAILER.size)
    if zlib.crc32(view[:total - _TRAILER.size]) != crc:
        raise Ds4Error("the KV state is corrupted (checksum mismatch)")
    try:
        head = json.loads(bytes(view[_PREFIX.size:_PREFIX.size + hlen]))
        saved_model, saved_nx = head["model"], head["numerics"]
        n_tokens, n_written = int(head["n_tokens"]), int(head["n_written"])
        saved_layout, entries = head["layout"], head["parts"]
    except (ValueError, KeyError, TypeError):
        raise Ds4Error("the KV state's header is malformed") from None
    if saved_model != model:
        raise Ds4Error(f"the KV state was saved by another model (fingerprint {saved_model}, this model is {model})")
    if saved_nx != numerics:
        raise Ds4Error(f"the KV state was computed with other numerics ({saved_nx}; this model runs {numerics})")
    if saved_layout != layout.describe():
        raise Ds4Error("the KV state's layout differs from this model's (another rollback horizon or ds4py version)")
    if not 0 <= n_tokens <= n_written or len(entries) != len(layout.parts):
        raise Ds4Error("the KV state's header is malformed (token counts or parts)")
    data_start = _align(_PREFIX.size + hlen)
    arrays = {}
    for p, e in zip(layout.parts, entries):
        rows = p.rows_for(n_tokens)
        nbytes = rows * p.width * np.dtype(p.dtype).itemsize
        a, b = data_start + int(e["offset"]), data_start + int(e["offset"]) + nbytes
        if e.get("key") != p.key or int(e.get("rows", -1)) != rows or a < data_start or b > total - _TRAILER.size:
            raise Ds4Error(f"the KV state's part {p.key} does not match its header")
        arrays[p.key] = np.frombuffer(view[a:b], dtype=p.dtype).reshape(rows, p.width).copy()
    return n_tokens, n_written, arrays
