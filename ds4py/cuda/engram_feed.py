"""Engram's step input on CUDA (docs/cuda.md "V4.1"): the hash ids of every row of a row set and their table rows,
gathered on the host as stored (FP8 codes and e8m0 scales) into pinned staging and copied asynchronously into the
workspace's `engram_codes` / `engram_scales` slots before the step runs, so a captured graph replays unchanged
(the rows are an input, like the [pos, token] slot); the graph dequantises them (cu/v41.cu v41_engram_rows) and
runs the projection.

    feed = EngramFeed(cfg, hasher, tables)
    feed.stage_chunks(rt, ws.engram_codes, ws.engram_scales, chunks, upcoming=next_chunks)
    ids = feed.advance(rt, chunks)       # the hash ids alone (and the rings advanced), as stage_chunks does

chunks: (state, first position, tokens) in row order. The hash runs on the host (ds4py.engram.NgramHasher) from
the state's host mirror of its `ngram_ids` ring (CudaState.host_rings): each chunk reads the ring's last
max_ngram - 1 tokens and writes its own tail, exactly as the reference's NgramIds does, and the ring's new
contents are queued to the device copy (small, from pageable memory, no synchronisation) so that save, export and
copy see the same bytes as before. No step downloads anything.

Staging: two pinned (page-locked) buffers, used in turn; each copy into the slots is one cuMemcpyHtoDAsync per
Engram layer and kind on the main stream, with a fence (an event) that is waited on before that buffer is
written again. Overlap: `upcoming` names the chunks of the next step when they are already known - a prefill's
next block - and their hash and gather run on a worker thread (numpy releases the GIL in its take and integer
loops) while this step's launches are issued and run. A decode step's next rows all depend on the token this
step samples (every n-gram of position t ends at token t), so nothing of its gather can start early; there the
gain is only the removed ring download (a full stream synchronisation per step before).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from ds4py.cuda.memory import DeviceArray

Chunk = tuple[Any, int, Sequence[int]]


class _Stage:
    """One pinned staging buffer and the fence of the last copy out of it."""

    def __init__(self) -> None:
        self.buf: Any = None
        self.fence: Any = None

    def ready(self, memory: Any, nbytes: int) -> np.ndarray:
        """The buffer as bytes, at least nbytes, once the DMA engine is done with it (the main thread calls this)."""
        memory.fence_wait(self.fence)
        self.fence = None
        if self.buf is None or self.buf.nbytes < nbytes:
            if self.buf is not None:
                self.buf.free()
            self.buf = memory.pinned(max(nbytes, 2 * (self.buf.nbytes if self.buf is not None else 0)))
        return self.buf.array


class EngramFeed:
    def __init__(self, cfg: Any, hasher: Any, tables: Any):
        self.cfg, self.hasher, self.tables = cfg, hasher, tables
        self.ring_name = f"{cfg.engram_layers[0]}.ngram_ids"      # the ring's owner in the state layout
        self.n1 = cfg.engram_max_ngram - 1
        self.width = cfg.engram_in_dim
        self.n_layers = len(cfg.engram_layers)
        self._stages = [_Stage(), _Stage()]
        self._turn = 0
        self._worker: ThreadPoolExecutor | None = None
        self._pending: tuple[Any, Future] | None = None          # (the upcoming chunks' key, their gather)
        # what the feed has done: rows gathered, bytes staged, host seconds hashing / gathering, gathers that
        # ran on the worker, and the seconds the main thread waited for one
        self.stats = dict(rows=0, bytes=0, hash_s=0.0, gather_s=0.0, prefetched=0, wait_s=0.0)

    # ---- the hash ---------------------------------------------------------------------------------------------
    def _plan(self, chunks: Sequence[Chunk]) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """(history, tokens, first position) per chunk, the history read from the mirror now (main thread). A
        state's chunks come in position order, and a later chunk's history includes the earlier chunks' tokens (a
        multi-row step stages a verify chunk as one chunk per row; the mirror only gets them at the commit)."""
        out, fed = [], {}
        for st, p0, toks in chunks:
            ring = st.host_rings[self.ring_name].reshape(-1)
            pos = np.arange(max(0, p0 - self.n1), p0)
            hist = ring[pos % ring.shape[0]].astype(np.int64)
            tk = np.asarray(toks, np.int64).reshape(-1)
            earlier = fed.setdefault(id(st), {})
            for j, p in enumerate(pos.tolist()):
                if p in earlier:
                    hist[j] = earlier[p]
            earlier.update((int(p0) + j, int(t)) for j, t in enumerate(tk.tolist()))
            out.append((hist, tk, int(p0)))
        return out

    def _hash(self, plan: list[tuple[np.ndarray, np.ndarray, int]]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        ids = [self.hasher.ids(h, c, p0) for h, c, p0 in plan]
        self.stats["hash_s"] += time.perf_counter() - t0
        return ids

    def _commit(self, rt: Any, chunks: Sequence[Chunk]) -> None:
        """Each chunk's tail into its state's mirror, and the mirror queued to the device ring (no sync)."""
        touched = {}
        for st, p0, toks in chunks:
            ring = st.host_rings[self.ring_name]
            flat, chunk = ring.reshape(-1), np.asarray(toks, np.int64).reshape(-1)
            cap = flat.shape[0]
            tail = np.arange(p0, p0 + len(chunk))[-min(len(chunk), cap):]
            flat[tail % cap] = chunk[len(chunk) - len(tail):]
            touched[id(st)] = st
        for st in touched.values():        # a fresh array per upload: the driver stages it before returning
            rt.memory.upload_staged(st.arrays[self.ring_name].ptr, st.host_rings[self.ring_name].copy(), rt.main)

    def advance(self, rt: Any, chunks: Sequence[Chunk]) -> list[np.ndarray]:
        """Hash ids [T, engram layers, cols] of each chunk, in order; each state's ring gets the chunk's tail (a
        state's chunks must come in position order)."""
        ids = self._hash(self._plan(chunks))
        self._commit(rt, chunks)
        return ids

    # ---- the gather -------------------------------------------------------------------------------------------
    def _gather(self, ids: list[np.ndarray], buf: np.ndarray) -> int:
        """The rows of `ids` as stored into buf: codes [layers, R, width] then scales [layers, R, width / 32].
        Returns R. Pure host work (runs on the worker thread for a prefetch)."""
        t0 = time.perf_counter()
        all_ids = np.concatenate(ids) if len(ids) > 1 else ids[0]
        R, W, E = all_ids.shape[0], self.width, self.n_layers
        codes = buf[:E * R * W].reshape(E, R, W)
        scales = buf[E * R * W: E * R * (W + W // 32)].reshape(E, R, W // 32)
        for e in range(E):
            self.tables.codes_into(e, all_ids[:, e], codes[e], scales[e])
        self.stats["gather_s"] += time.perf_counter() - t0
        self.stats["rows"] += R
        self.stats["bytes"] += E * R * (W + W // 32)
        return R

    def _work(self, plan: list, buf: np.ndarray) -> tuple[list[np.ndarray], int]:
        ids = self._hash(plan)
        return ids, self._gather(ids, buf)

    def _nbytes(self, chunks: Sequence[Chunk]) -> int:
        return self.n_layers * sum(len(t) for _, _, t in chunks) * (self.width + self.width // 32)

    @staticmethod
    def _key(chunks: Sequence[Chunk]) -> tuple:
        return tuple((id(st), int(p0), np.asarray(t, np.int64).tobytes()) for st, p0, t in chunks)

    def stage_chunks(self, rt: Any, codes: DeviceArray, scales: DeviceArray, chunks: Sequence[Chunk],
                     upcoming: Sequence[Chunk] | None = None) -> list[np.ndarray]:
        """The rows of these chunks into the slots [layers, cap, ...] (queued on the main stream) and the rings
        advanced; `upcoming`: the next step's chunks, when known, gathered meanwhile on a worker thread (the
        next call with exactly those chunks uses that gather). Returns the hash ids."""
        got = None
        if self._pending is not None:
            key, fut = self._pending
            self._pending = None
            t0 = time.perf_counter()
            res = fut.result()                     # also when unused: the worker must be done with its buffer
            self.stats["wait_s"] += time.perf_counter() - t0
            if key == self._key(chunks):
                got = res
                self.stats["prefetched"] += 1
            # else: its buffer (this turn's) is free again: the worker is done and no copy read it
        stage = self._stages[self._turn]
        if got is None:
            buf = stage.ready(rt.memory, self._nbytes(chunks))
            ids, R = self._work(self._plan(chunks), buf)
        else:
            (ids, R), buf = got, stage.buf.array
        self._commit(rt, chunks)
        self._copy(rt, stage, buf, R, codes, scales)
        self._turn ^= 1
        if upcoming:
            nxt = self._stages[self._turn]
            nbuf = nxt.ready(rt.memory, self._nbytes(upcoming))
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="ds4py-engram")
            # the history is read now: the mirror holds this step's tail, and the worker only reads what it gets
            self._pending = (self._key(upcoming), self._worker.submit(self._work, self._plan(upcoming), nbuf))
        return ids

    def _copy(self, rt: Any, stage: _Stage, buf: np.ndarray, R: int, codes: DeviceArray,
              scales: DeviceArray) -> None:
        E, cap, W = codes.shape
        src = int(buf.ctypes.data)
        for e in range(E):                 # the slots' layer stride is their capacity, the staging's R rows
            rt.memory.upload_pinned(codes.ptr + e * cap * W, src + e * R * W, R * W, rt.main)
        src += E * R * W
        for e in range(E):                 # the last copy's fence covers the ones queued before it on the stream
            stage.fence = rt.memory.upload_pinned(scales.ptr + e * cap * (W // 32), src + e * R * (W // 32),
                                                  R * (W // 32), rt.main, fence=e == E - 1)

    def close(self, memory: Any = None) -> None:
        """Stop the worker; with the runtime's memory, also free the staging once its copies have run."""
        if self._pending is not None:
            self._pending[1].result()
            self._pending = None
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if memory is not None:
            for st in self._stages:
                memory.fence_wait(st.fence)
                if st.buf is not None:
                    st.buf.free()
                st.buf, st.fence = None, None
