"""The row-set runners: how each planned row set (ds4py/cuda/planner.py) of a step is recorded by the one layer
schedule (ds4py/cuda/layer.py) and launched, and the graphs they replay.

- DECODE (positions): a chunk position by position through its state's body graph (captured per context bucket,
  replayed per token with the position and token in a device slot) and the head graph.
- ROWS (step_rows): 2 to 16 short rows of any states as one graph (direct launches the first time).
- BLOCK (prefill): a prompt in blocks of up to MAX_BLOCK rows, launched directly.
Each returns the logits and, when asked (Outputs), each row's final residual or DSpark taps."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from ds4py.cuda import layer
from ds4py.cuda.graph_cache import BODY, HEAD, ROWS_STEP, GraphCache, GraphKey
from ds4py.cuda.kvstate import CudaState
from ds4py.cuda.layer import BLOCK, DECODE, MAX_ROWS, ROWS, Recording, RowSet
from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.ops import moe_prefill as ops_moep
from ds4py.cuda.options import Outputs, bucket_for
from ds4py.cuda.step_run import StepRun
from ds4py.cuda.workspaces import WorkspacePool

Chunk = tuple[CudaState, int, Sequence[int]]     # (state, first position, tokens)


class RowSetRunner:
    """The runners of one CudaModel (its config, weights, runtime, options, slot, Engram feed and key
    publishers), their workspaces (one pool) and graphs (one cache)."""

    def __init__(self, model: Any):
        self.m, self.cfg = model, model.config
        self.cache = GraphCache(model.store)
        self.pool = WorkspacePool(model.config, model.rt, model.store, model.w.arena, self._grown,
                                  act_quant=model.numerics.act_quant)
        self._v41_inputs()
        self._rows_order: list[int] = []

    def _grown(self, mode: str) -> None:
        self.cache.drop({DECODE: HEAD, ROWS: ROWS_STEP}.get(mode, ""))

    def _v41_inputs(self) -> None:
        """V4.1's constant step inputs on the device: the first block's one-hot pre-mix and each Engram's q_w * k_w
        (multiplied as the reference does, in fp32)."""
        m, cfg = self.m, self.cfg
        self.onehot, self.engram_w, self._v41_block = None, {}, None
        if not (cfg.lagged_hc or cfg.engram_layers):
            return
        hc, D = cfg.hc_mult, cfg.dim
        self._v41_block = m.store.block(4 * hc + sum(4 * hc * D for _ in cfg.engram_layers) + 256)
        self.onehot = self._v41_block.array(0, (hc,), np.float32)
        self.onehot.upload(np.eye(1, hc, dtype=np.float32)[0], m.rt.main)
        at = 256
        for il, L in enumerate(m.w.binding.layers):
            e = cfg.roles(il).engram
            if e >= 0:
                q, k = (L.engram.q.array.download(), L.engram.k.array.download())
                self.engram_w[e] = self._v41_block.array(at, (hc, D), np.float32)
                self.engram_w[e].upload((q.astype(np.float32) * k.astype(np.float32)).reshape(hc, D), m.rt.main)
                at += 4 * hc * D

    def recording(self, ws: layer.Workspace, rows: RowSet, tickets: DeviceArray, **kw: Any) -> Recording:
        return Recording(self.cfg, self.m.numerics, self.m.w.freqs, ws, rows, tickets, onehot=self.onehot,
                         engram_weights=self.engram_w, **kw)

    def _stage_engram(self, ws: layer.Workspace, chunks: list[Chunk], upcoming: list[Chunk] | None = None) -> None:
        """Engram's rows of these chunks, in row order, into ws's input slot; upcoming: the next step's chunks when
        already known (gathered on a worker meanwhile)."""
        if self.m.engram is not None:
            self.m.engram.stage_chunks(self.m.rt, ws.engram_codes, ws.engram_scales, chunks, upcoming)

    def _extra_shape(self, out: Outputs) -> tuple[int, ...]:
        return (self.cfg.dspark_tap_dim,) if out & Outputs.TAPS else (self.cfg.hc_mult, self.cfg.dim)

    def key_layers(self, st: CudaState, p0: int, T: int) -> dict[int, int] | None:
        """The official decode bug (None without it): for a chunk of T positions from p0, the layer whose indexer
        keys each indexer scores, as the reference's v41.KeyPublishers chooses them (a key owner publishes when
        its compressor emits a row in the chunk; an indexer scores the last publisher's keys), and the state's
        record of the last publisher updated. The record lives on the host per state object (a copied or loaded
        state has none: it starts from the fixed behaviour, as on the reference); the choice is baked into the
        step's graph, one captured variant per choice (GraphKey.keys)."""
        publishers = self.m.publishers
        if publishers is None:
            return None
        seq = SimpleNamespace(state=st, key_pub=-1)
        publishers.begin([seq])
        keys = {}
        for il in range(self.cfg.n_layers):
            ro = self.cfg.roles(il)
            if ro.compressed and ro.indexer:
                emitted = ro.compressor and (p0 + T) // ro.ratio > p0 // ro.ratio
                keys[il] = publishers.keys_layer(seq, ro, emitted)
        publishers.end([seq])
        return keys

    # ---- DECODE: the body and head graphs ---------------------------------------------------------------------
    def context(self, st: CudaState | None, bucket: int, keys: dict[int, int] | None = None,
                taps: bool = False) -> Recording:
        """The DECODE recording of `st` (None: the head, which reads no state) in context bucket `bucket` (keys: the
        official decode bug's key_layers; taps: with the DSpark taps)."""
        ws = self.pool.get(DECODE)
        parts = [dict(st.arrays)] if st is not None else []
        rows = RowSet(DECODE, parts, [bucket], 1, self.m.slot, keys=None if keys is None else [keys])
        return self.recording(ws, rows, self.m.ticket, taps=ws.taps if taps else None)

    def row_bucket(self, st: CudaState, pos: int) -> int:
        """The context bucket a single-row step of `st` at `pos` runs in (its attention plan): a row keeps it."""
        need = bucket_for(pos + 1, self.cfg.context_length, self.m.options.min_bucket)
        return max([need] + [run.tag.bucket for run in st.graph if run is not None])

    def body(self, st: CudaState, pos: int, keys: dict[int, int] | None = None, taps: bool = False) -> StepRun:
        """The state's decode graph for position `pos` (captured for the bucket holding it); keys: the step's
        key_layers (the official decode bug); taps: the graph that also writes the row's DSpark taps."""
        need = bucket_for(pos + 1, self.cfg.context_length, self.m.options.min_bucket)
        ws = self.pool.get(DECODE)
        key = GraphKey(BODY, -1 if ws is None else ws.version, self.m.options.launch, (need,),
                       generation=st.generation, keys=() if keys is None else tuple(sorted(keys.items())),
                       taps=bool(taps))
        run = self.cache.body_of(st, key)
        if run is not None and ws is not None and self.cache.fits(run, key):
            return run
        bucket = self.row_bucket(st, pos)
        ws = self.pool.need(DECODE, bucket)
        st.ensure_rows(bucket)
        rec, B = self.context(st, bucket, keys, taps), self.m.w.binding
        key = GraphKey(BODY, ws.version, self.m.options.launch, (bucket,), generation=st.generation, keys=key.keys,
                       taps=key.taps)
        return self.cache.put_body(st, StepRun(self.m, lambda ls: layer.record_body(ls, rec, B), key), run)

    def head(self, sampling: tuple | None) -> StepRun:
        ws = self.pool.get(DECODE)
        ws = self.pool.need(DECODE, ws.bucket if ws is not None else
                            bucket_for(1, self.cfg.context_length, self.m.options.min_bucket))
        key = GraphKey(HEAD, ws.version, self.m.options.launch, sampling=sampling)
        run = self.cache.get(key)
        if run is not None:
            return run
        rec, B = self.context(None, ws.bucket), self.m.w.binding

        def record(ls: layer.Launcher) -> None:
            layer.record_head(ls, rec, layer.final_residual(rec), 1, B.hc_head, B.output_norm, B.head)
            if sampling is not None:
                layer.record_sample(ls, rec, sampling)

        return self.cache.put(key, StepRun(self.m, record, key))

    def positions(self, st: CudaState, ids: np.ndarray, all_logits: bool, out: Outputs = Outputs.NONE) -> Any:
        """One state's chunk position by position through its decode graph (DECODE); with out: (logits, every
        position's final residual [T, hc, D] (HIDDEN) / DSpark taps [T, n_targets * D] (TAPS))."""
        n0, T = st.n_tokens, len(ids)
        taps = bool(out & Outputs.TAPS)
        keys = self.key_layers(st, n0, T)
        body = self.body(st, n0 + T - 1, keys, taps)     # rows grown and graph captured before anything is written
        head = self.head(None)
        body = self.body(st, n0 + T - 1, keys, taps)     # (the head may have grown the workspace)
        ws = self.pool.get(DECODE)
        X = ws.taps if taps else layer.final_residual(self.context(st, body.tag.bucket))
        H = np.empty((T,) + self._extra_shape(out), np.float32) if out else None
        st.begin_step(T)
        rows = []
        for i, tok in enumerate(ids):
            st.device_hw = max(st.device_hw, n0 + i + 1)
            self._stage_engram(ws, [(st, n0 + i, [int(tok)])],    # the chunk's next token is known
                               [(st, n0 + i + 1, [int(ids[i + 1])])] if i + 1 < T else None)
            body.run([n0 + i, int(tok)])
            if out:
                H[i] = X.download().reshape(H.shape[1:])
            if all_logits or i == T - 1:
                head.run(())
                rows.append(ws.logits.download())
        st.end_step(T)
        logits = np.stack(rows) if all_logits else rows[-1]
        return (logits, H) if out else logits

    # ---- BLOCK: prefill -------------------------------------------------------------------------------------
    def prefill(self, st: CudaState, ids: np.ndarray, all_logits: bool, out: Outputs = Outputs.NONE) -> Any:
        """A chunk longer than the rollback horizon + 1 (a prompt): BLOCK row sets of up to MAX_BLOCK tokens,
        each one launch sequence over its rows, launched directly (no graph); the head runs for the rows asked
        for. The state ends as position-by-position steps leave it. HIDDEN: (logits, every position's final
        residual [T, hc, D]) for the MTP block, the same rows plain decoding computes; TAPS: their DSpark taps
        [T, n_targets * D]."""
        cfg, rt, o = self.cfg, self.m.rt, self.m.options
        n0, T = st.n_tokens, len(ids)
        bucket = bucket_for(n0 + T, cfg.context_length, o.min_bucket)
        blk = max(1, min(int(o.prefill_block), layer.MAX_BLOCK))
        expert_mma = ((o.prefill_vq_expert_mma if self.m.vq_experts else o.prefill_expert_mma)
                      and cfg.n_experts <= ops_moep.MAX_EXPERTS)
        expert_tiles = (not expert_mma and o.prefill_expert_tiles and not self.m.vq_experts
                        and cfg.n_experts <= ops_moep.MAX_EXPERTS)
        ws = self.pool.need(BLOCK, bucket, layer.block_rows(min(T, blk)))
        st.ensure_rows(bucket)
        keys = self.key_layers(st, n0, T)
        st.begin_step(T)
        logits: list[np.ndarray] = []
        H = np.empty((T,) + self._extra_shape(out), np.float32) if out else None
        B = self.m.w.binding
        for a in range(0, T, blk):
            Tb = min(blk, T - a)
            ws.slot.view(0, Tb).upload(np.arange(n0 + a, n0 + a + Tb, dtype=np.int32), rt.main)
            ws.slot.view(4 * ws.rows, Tb).upload(np.ascontiguousarray(ids[a:a + Tb], np.int32), rt.main)
            st.device_hw = max(st.device_hw, n0 + a + Tb)
            nb = a + Tb                             # the next block's rows are known: gathered while this one runs
            self._stage_engram(ws, [(st, n0 + a, ids[a:a + Tb])],
                               [(st, n0 + nb, ids[nb:nb + blk])] if nb < T else None)
            rec = self.recording(ws, RowSet(BLOCK, [dict(st.arrays)], [bucket], Tb, ws.slot, cap=ws.rows,
                                            keys=None if keys is None else [keys]),
                                 ws.tickets, mma=o.prefill_mma, x_pieces=o.prefill_x_pieces, expert_mma=expert_mma,
                                 expert_tiles=expert_tiles, taps=ws.taps if out & Outputs.TAPS else None)
            ls = layer.Launcher(rt, o.pdl)
            layer.record_body(ls, rec, B)
            X = layer.final_residual(rec)
            if out:
                src = ws.taps if out & Outputs.TAPS else X
                H[a:a + Tb] = src.view(0, (Tb,) + H.shape[1:]).download()
            heads = range(0, Tb, layer.HEAD_ROWS) if all_logits else ([Tb - 1] if a + Tb == T else [])
            for r0 in heads:
                n = min(layer.HEAD_ROWS, Tb - r0)
                layer.record_head(ls, rec, X, n, B.hc_head, B.output_norm, B.head, r0=r0)
                logits.append(ws.logits.view(0, (n, cfg.vocab_size)).download())
        st.end_step(T)
        got = np.concatenate(logits) if all_logits else logits[-1][-1].copy()
        return (got, H) if out else got

    # ---- ROWS: a multi-row step ---------------------------------------------------------------------------------
    def step_rows(self, states: list[CudaState], chunks: list[np.ndarray], all_logits: bool,
                  taps: bool = False) -> list[np.ndarray]:
        """One ROWS step: every chunk's positions as rows of one graph replay; each row's logits bit-identical to
        stepping its state position by position (taps: the graph that also writes the rows' DSpark taps)."""
        plan = [(st, st.n_tokens + i, int(t)) for st, ids in zip(states, chunks) for i, t in enumerate(ids)]
        keys = {id(st): self.key_layers(st, st.n_tokens, len(ids)) for st, ids in zip(states, chunks)}
        run, order = self.rows_run(plan, keys if self.m.publishers is not None else None, taps)
        R = len(plan)
        rows = [plan[r] for r in order]
        values = [pos for _, pos, _ in rows] + [0] * (MAX_ROWS - R) + [tok for _, _, tok in rows]
        ws = self.pool.get(ROWS)
        if self.m.engram is not None:
            self._stage_engram(ws, [(st, pos, [tok]) for st, pos, tok in rows])
        for st, ids in zip(states, chunks):
            st.begin_step(len(ids))
            st.device_hw = max(st.device_hw, st.n_tokens + len(ids))
        run.run(values)
        self._rows_order = order
        got = ws.logits.view(0, (R, self.cfg.vocab_size)).download()
        logits = np.empty_like(got)
        logits[order] = got                                # back into the caller's row order
        out, at = [], 0
        for st, ids in zip(states, chunks):
            T = len(ids)
            st.end_step(T)
            out.append(logits[at:at + T].copy() if all_logits else logits[at + T - 1].copy())
            at += T
        return out

    def rows_extra(self, chunks: list[np.ndarray], out: Outputs) -> list[np.ndarray]:
        """The final residuals [T, hc, D] (HIDDEN) or DSpark taps [T, n_targets * D] (TAPS) per chunk of the last
        ROWS step (in the caller's row order)."""
        ws = self.pool.get(ROWS)
        X = ws.taps if out & Outputs.TAPS else ws.X0 if self.cfg.n_layers % 2 == 0 else ws.X1
        R = sum(len(c) for c in chunks)
        got = X.view(0, (R,) + self._extra_shape(out)).download()
        H = np.empty_like(got)
        H[self._rows_order] = got
        res, at = [], 0
        for c in chunks:
            res.append(H[at:at + len(c)].copy())
            at += len(c)
        return res

    def rows_run(self, plan: list[tuple[CudaState, int, int]], keys: dict[int, dict[int, int]] | None = None,
                 taps: bool = False) -> tuple[StepRun, list[int]]:
        """The ROWS graph for these rows, captured on first use, and the order its rows run in (rows[order[j]] is
        its row j). The graph is keyed by what it baked in: each row's state arrays and context bucket, in a
        canonical order (rows grouped by state, states by address; a state's rows keep their position order), so
        the same states in another order or grouping of the scheduler's replay one graph. A row set's first step
        launches directly; it is captured when it comes again (one-off batches, such as a prompt chunk beside
        decode rows, cost no capture). keys: per state (by id) its key_layers (the official decode bug)."""
        buckets = [self.row_bucket(st, pos) for st, pos, _ in plan]
        ws = self.pool.need(ROWS, max(buckets), MAX_ROWS)
        per_state: dict[int, int] = {}
        for (st, _, _), b in zip(plan, buckets):
            per_state[id(st)] = max(per_state.get(id(st), 0), b)
        for st, _, _ in plan:
            st.ensure_rows(per_state[id(st)])
        order = sorted(range(len(plan)), key=lambda r: min(a.ptr for a in plan[r][0].arrays.values()))
        plan, buckets = [plan[r] for r in order], [buckets[r] for r in order]
        row_keys = None if keys is None else [keys[id(st)] for st, _, _ in plan]
        key = GraphKey(ROWS_STEP, ws.version, self.m.options.launch, tuple(buckets),
                       tuple(tuple((a.ptr, a.shape[0]) for a in st.arrays.values()) for st, _, _ in plan),
                       keys=None if row_keys is None else tuple(tuple(sorted(k.items())) for k in row_keys),
                       taps=bool(taps))
        run = self.cache.get(key)
        if run is not None:                             # seen before: worth a graph from now on
            run.use_graph()
            return run, order
        rec = self.recording(ws, RowSet(ROWS, [dict(st.arrays) for st, _, _ in plan], buckets, len(plan), ws.slot,
                                        cap=MAX_ROWS, keys=row_keys), ws.tickets, taps=ws.taps if taps else None)
        B = self.m.w.binding

        def record(ls: layer.Launcher) -> None:
            layer.record_body(ls, rec, B)
            layer.record_head(ls, rec, layer.final_residual(rec), rec.R, B.hc_head, B.output_norm, B.head)

        return self.cache.put(key, StepRun(self.m, record, key, slot=ws.slot, graph=False)), order

    def close(self) -> None:
        self.cache.close()
        self.pool.close()
        if self._v41_block is not None:
            self.m.store.retire([self._v41_block])
