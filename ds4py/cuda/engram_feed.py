"""Engram's step input on CUDA (docs/cuda.md "V4.1"): the hash ids of every row of a row set and their table rows,
gathered on the host as stored (FP8 codes and e8m0 scales) and copied into the workspace's `engram_codes` /
`engram_scales` slots before the step runs, so a captured graph replays unchanged (the rows are an input, like the
[pos, token] slot); the graph dequantises them (cu/v41.cu v41_engram_rows) and runs the projection.

    feed = EngramFeed(cfg, hasher, tables)
    ids = feed.advance(rt, chunks)        # per (state, first position, tokens): hash ids; the states' rings advanced
    feed.stage(rt, ws.engram_codes, ws.engram_scales, ids)   # the rows of every id into the slots

The tables stay memory-mapped in the official shards (ds4py.engram.EngramTables reads only the rows the ids
name). The hash runs on the host (ds4py.engram.NgramHasher: int64 products, XOR, modulo primes) from the state's
`ngram_ids` ring, which lives on the device with the rest of the state (so copy, save, load and truncate cover
it): each chunk reads the ring's last max_ngram - 1 tokens and writes its own tail back, exactly as the
reference's NgramIds does.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ds4py.cuda.memory import DeviceArray


class EngramFeed:
    def __init__(self, cfg: Any, hasher: Any, tables: Any):
        self.cfg, self.hasher, self.tables = cfg, hasher, tables
        self.ring_name = f"{cfg.engram_layers[0]}.ngram_ids"      # the ring's owner in the state layout
        self.n1 = cfg.engram_max_ngram - 1
        self.width = cfg.engram_in_dim

    def advance(self, rt: Any, chunks: Sequence[tuple[Any, int, Sequence[int]]]) -> list[np.ndarray]:
        """Hash ids [T, engram layers, cols] of each (state, first position, tokens) chunk, in order; each state's
        ring gets the chunk's tail (a state's chunks must come in position order)."""
        out = []
        for st, p0, toks in chunks:
            ring_dev: DeviceArray = st.arrays[self.ring_name]
            ring = ring_dev.download(rt.main).reshape(-1)
            cap, chunk = ring.shape[0], np.asarray(toks, np.int64)
            hist = np.arange(max(0, p0 - self.n1), p0)
            out.append(self.hasher.ids(ring[hist % cap], chunk, p0))
            tail = np.arange(p0, p0 + len(chunk))[-min(len(chunk), cap):]
            ring[tail % cap] = chunk[-len(tail):]
            ring_dev.upload(ring.reshape(ring_dev.shape).astype(np.int32), rt.main)
        return out

    def stage(self, rt: Any, codes: DeviceArray, scales: DeviceArray, ids: Sequence[np.ndarray]) -> None:
        """The rows' ids [R, engram layers, cols] (in row order): their table rows as stored (e4m3 codes, e8m0
        scales; (max_ngram - 1) · heads rows of 33 bytes per 32 values) into the slots [layers, cap, ...]."""
        all_ids = np.concatenate(ids) if len(ids) > 1 else ids[0]
        n_layers, cap, width = codes.shape
        R = all_ids.shape[0]
        for e in range(n_layers):          # fresh arrays per copy: a queued copy may still read the last ones
            c, s = self.tables.codes(e, all_ids[:, e])
            codes.view(e * cap * width, (R, width)).upload(np.ascontiguousarray(c), rt.main)
            scales.view(e * cap * (width // 32), (R, width // 32)).upload(np.ascontiguousarray(s), rt.main)
