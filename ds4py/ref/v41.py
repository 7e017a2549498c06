"""The parts of the forward only V4.1 Flash has (MODEL.md §3), called from ref/forward.py where a predicate says so.

* compressed rows: a ratio-r compressor without overlap or ape (ratio 1: no gate, the normalised projection is
  the row), RoPE at g·r, then the NVFP4-like fake-quant (e2m1 in blocks of 16, e4m3 scales);
* indexer keys from the kv source's pre-RoPE latent: k = RMSNorm(wk · latent; k_norm), RoPE, FP4 (blocks of 32);
* candidate blocks: the candidate source scores blocks of positions by their best row and keeps the top ones
  (the block holding the query's newest row always); the indexers after it score only inside them;
* Engram: the n-gram rows gate a value into every hc copy before the block.

Cross-layer sharing itself is in the roles (`kv_source`, `index_source`, `index_keys`): a layer reads another
layer's state rows and top-k, computed earlier in the same step.

The official code publishes a key owner's indexer keys only on steps where its compressor emits a row, so in
decode a ratio-2 owner scores the last publisher's keys on every other step (golden v41-tiny README). The
engine implements the fixed behaviour (decode agrees with prefill); `KeyPublishers` (RefModel(...,
official_decode_bug=True)) reproduces the official decode for comparison.
"""

from __future__ import annotations

import numpy as np

from ds4py.contract import Numerics
from ds4py.host.keys import KeyPublishers  # noqa: F401 (ref.v41's name)
from ds4py.ref import ops

F32 = np.float32


def kv_store(x: np.ndarray, nx: Numerics) -> np.ndarray:
    return ops.f16_round(x) if nx.kv_dtype == "f16" else x


def finish_rows(w, cfg, nx: Numerics, A, ro, st, lat: np.ndarray, g0: int, g1: int, freqs: np.ndarray,
                row_stable: bool = False) -> None:
    """A kv source's emitted latents [g1 - g0, hd] (after the compressor's RMSNorm): indexer keys first (key owners,
    from the pre-RoPE latent), then RoPE at g·r and the NVFP4-like fake-quant into comp_rows."""
    r, il = ro.ratio, ro.layer
    gpos = np.arange(g0, g1) * r
    if ro.owns_index_keys:
        k = ops.rmsnorm(w.linear(A.index.k, lat, ops.row_groups(None, len(lat), row_stable)), w.get(A.index.k_norm),
                        cfg.norm_eps)
        k = ops.rope_tail(k, gpos, freqs)
        if nx.fake_quant:
            k = ops.fp4_fake_quant(k, 32)
        st.rows(il, "idx_keys", g1)[g0:g1] = kv_store(k, nx)
    rows = ops.rope_tail(lat, gpos, freqs)
    if nx.fake_quant:
        rows = ops.nvfp4_fake_quant(rows, 16)
    st.rows(il, "comp_rows", g1)[g0:g1] = kv_store(rows, nx)


def candidate_blocks(scores: np.ndarray, pos: np.ndarray, ratio: int, n_blocks: int, block: int) -> np.ndarray:
    """[T, Nc] bool: the rows of the n_blocks best blocks of `block` consecutive rows per query, a block scored by
    its best row (invisible rows are -inf already); the block with the query's newest row is always kept."""
    T, nc = scores.shape
    nb = -(-nc // block)
    padded = np.full((T, nb * block), -np.inf, F32)
    padded[:, :nc] = scores
    bs = padded.reshape(T, nb, block).max(-1)
    last = ((pos + 1) // ratio - 1) // block                  # -1 when the query sees no row yet
    pin = last >= 0
    bs[np.nonzero(pin)[0], last[pin]] = np.inf
    keep = bs > -np.inf
    if nb > n_blocks:
        top = np.argpartition(-bs, n_blocks - 1, axis=1)[:, :n_blocks]
        chosen = np.zeros(bs.shape, bool)
        np.put_along_axis(chosen, top, True, axis=1)
        keep &= chosen
    return np.repeat(keep, block, axis=1)[:, :nc]


def engram(w, cfg, E, X: np.ndarray, rows: np.ndarray, seg: list[slice] | None = None) -> np.ndarray:
    """Engram's update of the hc state X [T, hc, D] from its table rows [T, cols · row]: one key per copy and a
    shared value from wkv; per copy a normalised dot of the stream with the key (q_w · k_w weighted) gates the
    value: gate = sigmoid(sign(dot) · sqrt(max(|dot|, 1e-6))), X_j += gate_j · value. seg: the rows' sequences
    (one product per sequence: docs/engine.md, batch invariance)."""
    T, hc, D = X.shape
    kv = w.linear(E.kv, rows, seg)
    key, value = kv[:, :hc * D].reshape(T, hc, D), kv[:, hc * D:]
    weight = w.get(E.q) * w.get(E.k)
    eps = F32(cfg.norm_eps)
    rstd = (F32(1) / np.sqrt((X * X).mean(-1) + eps)) * (F32(1) / np.sqrt((key * key).mean(-1) + eps))
    dot = (X * weight * key).sum(-1) * rstd * F32(D ** -0.5)
    gate = ops.sigmoid(np.copysign(np.sqrt(np.maximum(np.abs(dot), F32(1e-6))), dot))
    return X + gate[:, :, None] * value[:, None, :]


class NgramIds:
    """Per step: the Engram hash ids of every row (all sequences), from each state's `ngram_ids` ring."""

    def __init__(self, cfg, hasher):
        self.cfg, self.hasher = cfg, hasher
        self.layer = cfg.engram_layers[0] if cfg.engram_layers else -1     # the ring's owner in the layout
        self.n1 = cfg.engram_max_ngram - 1

    def step(self, seqs, ids: np.ndarray) -> np.ndarray:
        """[rows, n_engram_layers, cols] for the step's rows; stores each chunk's tail in its state's ring."""
        out = []
        for s in seqs:
            ring, p0, chunk = s.state.ring(self.layer, "ngram_ids"), int(s.pos[0]), ids[s.rows]
            cap = ring.shape[0]
            hist = np.arange(max(0, p0 - self.n1), p0)
            out.append(self.hasher.ids(ring[hist % cap, 0], chunk, p0))
            tail = s.pos[-min(len(chunk), cap):]
            ring[tail % cap, 0] = chunk[-len(tail):]
        return np.concatenate(out)
