"""Memory-mapped weights, dequantised to float32 on use.

The GGUF stays memory-mapped; a matrix is dequantised when a forward step needs it. A small LRU cache
(default 512 MiB of float32) keeps recently used dequantised matrices: on the tiny models everything fits
and decode does not re-dequantise; on the full model the cache holds a few layers and the reference simply
re-dequantises (it is the oracle, not the fast path). Routed experts are dequantised one expert at a time
(only the experts a token was routed to); the embedding reads only the rows of the given ids; matrices too
big for the cache (the 129280-row head) are streamed through in row chunks.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from gguf import GGMLQuantizationType as Q

from ds4py.gguf import TensorInfo
from ds4py.quant import dequantize
from ds4py.quant.vq import VQExperts
from ds4py.ref.ops import q8_0_round, q8_k_round, seg_matmul

F32 = np.float32
DEFAULT_CACHE_BYTES = 512 << 20
STREAM_ROWS = 8192
# ggml's CPU dot products quantise the activation side to Q8_0 (Q8_0 / MXFP4 weights) or Q8_K (K / IQ quants)
Q8_0_ACT = (Q.Q8_0, Q.MXFP4)
Q8_K_ACT = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS)


def _dequant_rows(t, raw_rows: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantise whole rows of tensor t (raw_rows: its typed or uint8 rows) to float32 `shape`."""
    if t.qtype in (Q.F32, Q.F16, Q.I32, Q.I16, Q.I8, Q.I64, Q.F64):
        return np.asarray(raw_rows).reshape(shape)
    return dequantize(np.ascontiguousarray(raw_rows).view(np.uint8), t.qtype, shape)


class Weights:
    """The GGUF's tensors for the forward: every method takes a tensor handle from the typed binding
    (ds4py.schema.bind over GGUFFile.tensor: a TensorInfo), never a name assembled in the math."""

    def __init__(self, gguf, cache_bytes: int = DEFAULT_CACHE_BYTES, act_quant: bool = False):
        self.f = gguf
        self.act_quant = act_quant         # emulate ds4 / ggml activation rounding before quantised matmuls
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._cached = 0
        self.vq = VQExperts(gguf)          # decodes VQ-8 experts; its row gains can be rescaled at load

    # ---- cache -------------------------------------------------------------------------------------------
    def _get_cached(self, key: tuple, make) -> np.ndarray:
        a = self._cache.get(key)
        if a is not None:
            self._cache.move_to_end(key)
            return a
        a = make()
        if a.nbytes <= self.cache_bytes:
            self._cache[key] = a
            self._cached += a.nbytes
            while self._cached > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached -= old.nbytes
        return a

    # ---- access ------------------------------------------------------------------------------------------
    def get(self, t: TensorInfo) -> np.ndarray:
        """The whole tensor as float32 (ints stay ints: tid2eid)."""
        def make() -> np.ndarray:
            if t.qtype in (Q.I32, Q.I16, Q.I8, Q.I64):
                return np.asarray(t.raw).reshape(t.shape).astype(np.int64)
            if t.qtype in (Q.F32, Q.F16, Q.F64):
                return np.asarray(t.raw).reshape(t.shape).astype(F32)
            return _dequant_rows(t, t.raw_bytes(), t.shape).astype(F32, copy=False)

        return self._get_cached(("all", t.name), make)

    def rows(self, t: TensorInfo, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a 2-D matrix (the embedding lookup), without dequantising the rest."""
        raw = t.raw if t.qtype in (Q.F32, Q.F16) else t.raw_bytes()
        ids = np.asarray(ids, dtype=np.int64)
        return _dequant_rows(t, raw[ids], (len(ids), t.shape[-1])).astype(F32, copy=False)

    def expert(self, t: TensorInfo, e: int) -> np.ndarray:
        """Expert e's [out, in] matrix of a stacked [X, out, in] expert tensor: the one place routed experts
        are dequantised."""
        def make() -> np.ndarray:
            if t.qtype == Q.I8:                                   # VQ-8 index stream (ds4py.quant.vq)
                return self.vq.expert(t.name, e)
            raw = t.raw if t.qtype in (Q.F32, Q.F16) else t.raw_bytes()
            return _dequant_rows(t, raw[e], t.shape[1:]).astype(F32, copy=False)

        return self._get_cached(("expert", t.name, int(e)), make)

    def act(self, t: TensorInfo, x: np.ndarray) -> np.ndarray:
        """The activation as a quantised matmul with `t` sees it: unchanged unless act_quant is on."""
        if self.act_quant:
            if t.qtype in Q8_0_ACT:
                return q8_0_round(x)
            if t.qtype in Q8_K_ACT:
                return q8_k_round(x)
        return x

    def linear(self, t: TensorInfo, x: np.ndarray, seg: list[slice] | None = None) -> np.ndarray:
        """x @ W.T for a [out, in] matrix W, one product per sequence's rows `seg` (ops.seg_matmul: batch
        invariance); a matrix larger than the cache is streamed in row chunks."""
        x = self.act(t, x)
        out_rows, ncols = t.shape
        if ("all", t.name) in self._cache or out_rows * ncols * 4 <= self.cache_bytes:
            return seg_matmul(x, self.get(t).T, seg)
        raw = t.raw if t.qtype in (Q.F32, Q.F16) else t.raw_bytes()
        y = np.empty((x.shape[0], out_rows), F32)
        for a in range(0, out_rows, STREAM_ROWS):
            b = min(a + STREAM_ROWS, out_rows)
            w = _dequant_rows(t, raw[a:b], (b - a, ncols)).astype(F32, copy=False)
            y[:, a:b] = seg_matmul(x, w.T, seg)
        return y
