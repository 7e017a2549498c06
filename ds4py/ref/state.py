"""Per-sequence KV state of the reference engine (implements ds4py.model.State).

Per layer:
  * window ring: the last `window` raw kv rows (slot = position mod window), fake-quantised as attended;
  * ratio > 0: compressed attention rows emitted so far, and the compressor's pending tokens
    (kv and ape-shifted scores of the current incomplete group, plus the previous group for ratio-4 overlap);
  * ratio 4: the indexer's compressed keys and its own compressor pending tokens.
"""

from __future__ import annotations

import copy as _copy
from dataclasses import dataclass

import numpy as np

F32 = np.float32


class Rows:
    """An append-only [n, width] float32 array with amortised growth."""

    def __init__(self, width: int):
        self._a = np.zeros((0, width), F32)
        self.n = 0

    def append(self, rows: np.ndarray) -> None:
        k = rows.shape[0]
        if self.n + k > self._a.shape[0]:
            grown = np.zeros((max(2 * self._a.shape[0], self.n + k, 16), self._a.shape[1]), F32)
            grown[: self.n] = self._a[: self.n]
            self._a = grown
        self._a[self.n: self.n + k] = rows
        self.n += k

    def view(self) -> np.ndarray:
        return self._a[: self.n]

    def nbytes(self) -> int:
        return self.n * self._a.shape[1] * 4


@dataclass
class CompressorState:
    """Tokens not yet fully consumed by the compressor: positions [start, start + len(kv))."""
    width: int                    # c·d (c = 2 for the overlapping ratio-4 compressor)
    start: int = 0
    kv: np.ndarray = None         # [n, c·d]
    score: np.ndarray = None      # [n, c·d], ape already added

    def __post_init__(self):
        if self.kv is None:
            self.kv = np.zeros((0, self.width), F32)
            self.score = np.zeros((0, self.width), F32)

    def nbytes(self) -> int:
        return self.kv.nbytes + self.score.nbytes


@dataclass
class LayerState:
    ring: np.ndarray                                 # [window, hd] raw kv rows, slot = pos % window
    comp: Rows | None = None                         # compressed attention rows [n, hd]
    comp_buf: CompressorState | None = None
    index_keys: Rows | None = None                   # indexer compressed keys [n, index_head_dim]
    index_buf: CompressorState | None = None

    def nbytes(self) -> int:
        n = self.ring.nbytes
        for part in (self.comp, self.comp_buf, self.index_keys, self.index_buf):
            n += part.nbytes() if part is not None else 0
        return n


@dataclass
class RefState:
    layers: list[LayerState]
    n_tokens: int = 0

    @classmethod
    def empty(cls, cfg) -> "RefState":
        layers = []
        for il in range(cfg.n_layers):
            ratio = cfg.compress_ratios[il]
            st = LayerState(ring=np.zeros((cfg.window, cfg.head_dim), F32))
            if ratio:
                coff = 2 if ratio == 4 else 1
                st.comp = Rows(cfg.head_dim)
                st.comp_buf = CompressorState(coff * cfg.head_dim)
            if ratio == 4:
                st.index_keys = Rows(cfg.index_head_dim)
                st.index_buf = CompressorState(2 * cfg.index_head_dim)
            layers.append(st)
        return cls(layers)

    def copy(self) -> "RefState":
        return _copy.deepcopy(self)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
