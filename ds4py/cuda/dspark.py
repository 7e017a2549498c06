"""V4.1's DSpark draft on the CUDA engine (MODEL.md §3, docs/dspark.md "On CUDA"; ds4py/ref/dspark.py is the same
math on the host, and the interface).

    draft = CudaDSpark(model)                     # model: a CudaModel of a V4.1 GGUF holding the dspark.* tensors
    ds = draft.new_state()                        # a CudaState of kv.state_layout(cfg.dspark_block_config())
    logits, taps = model.step_taps([s], [ids])    # the taps come from the main step's own row sets
    draft.feed([ds], [taps])                      # one ring write per main position (device)
    blk = draft.block(ds, token)                  # base logits and hidden of the B block positions (device)
    ids, logits, conf = draft.greedy(blk, token)  # the Markov bias and confidence chain (host, as the reference's)

The draft's tensors go up in their file formats in one block of the state store (device_weights.upload_entries,
as the MTP block's: VQ-8 experts re-laid); its rings are a CudaState in device memory, so truncate / copy and the
state blob are the engine's (a ring saved on cuda-emu loads on ref and back: one layout, one fingerprint).

feed: the taps rows go up, then main_x = RMSNorm(main_proj · taps; main_norm) is the stages' wkv GEMV prologue
(one launch for all stages), and cu/v41.cu's kv row kernel writes RMSNorm + RoPE + FP8 + storage into each ring
slot; the `_rows` GEMVs give every row the bits of a single-row product, so a ring row never depends on how the main
positions were chunked (direct launches: a feed is 2 + S kernels).

block: one BLOCK recording of the main layer recorder over B rows at positions t + 1 .. t + B (tokens [token,
noise ..]) through the S stages against the rings, dense products on the exact `_rows` GEMVs (mma off), with the
DSpark attention in place of the block attention: cu/prefill_attn.cu's attn_prefill with block_keys (every block
query sees the ring's positions t − W + 1 .. t and all B block keys, sink, inverse RoPE); the block keys stay in
the workspace (never in the ring). Then h = Σ pre_j X_j (cu/dspark.cu), the draft's output norm and the main
model's head into [B, V] base logits. Then the greedy chain, in the same recording: per position i, e_i =
markov_embed[out_i] (the embedding kernel; out_0 = token), the Markov bias markov_head · e_i (a GEMV), logits_i =
base_i + bias (cu/dspark.cu) and out_{i+1} = argmax (cu/argmax.cu, into a device slot the next position's embedding
reads); then every confidence c_i = confidence · [h_i, e_i] in one GEMV (h_i and e_i side by side in one row). One
graph per ring state (GraphKey DSPARK_BLOCK in the draft's own GraphCache; its workspace from its own
WorkspacePool), captured when it comes a second time (the first call launches directly); what comes back:
base and chain logits [B, V], h [B, D], the chain's ids and confidences.

ChainBlock.position(i, prev) returns the chain's row when prev is the chain's out_i (greedy drafts, and a sampled
draft while it agrees with the argmax); another prev (a sampled draft that left the chain, a teacher) is computed on
the host from base and h as the reference does (DraftBlock.position; the Markov tables then read once to the host).
"""

from __future__ import annotations

from functools import cached_property
from types import SimpleNamespace
from typing import Any, Sequence

import numpy as np

from ds4py import schema
from ds4py.cuda import kernels, layer, ops
from ds4py.cuda.device_weights import EMBED_TYPES, _float, check_gate_up, upload_entries
from ds4py.cuda.kernels import BLOCK, gemvs
from ds4py.cuda.graph_cache import DSPARK_BLOCK, GraphCache
from ds4py.cuda.kvstate import CudaDraftStates, CudaState
from ds4py.cuda.step_run import GraphKey, StepRun, parts_of
from ds4py.cuda.layer import Launcher, Recording, RowSet
from ds4py.cuda.ops import dspark as ops_dspark
from ds4py.cuda.ops.argmax import argmax_parts
from ds4py.cuda.ops import prefill_attn as ops_pfa
from ds4py.cuda.ops.attention import AttnKeys, KvRow
from ds4py.cuda.ops import v41 as ops_v41
from ds4py.cuda.ops.mhc import mix_record
from ds4py.cuda.workspaces import WorkspacePool
from ds4py.errors import UnsupportedByBackend
from ds4py.host.dspark import DraftBlock, DSparkBase
from ds4py.host.rope import layer_rope_freqs

F32 = np.float32


def dspark_attend(ls: Launcher, rec: Recording, il: int, ro: Any, A: Any) -> None:
    """Stage il's DSpark attention: every block query against the ring's window before the block and all block
    keys (ws.kvb, from the V4.1 kv row kernel); nothing is stored into the ring."""
    cfg, ws = rec.cfg, rec.ws
    ops_pfa.prefill_attention(ls, kernels.attn_layer(rec, il, A, q_norm=bool(cfg.q_head_norm)),
                              AttnKeys(rec.rows.state(0)[f"{il}.win"]),
                              ops_pfa.PrefillRows(ws.q, rec.rows.positions, ws.kvb, ws.o, rec.R), **ls.main(),
                              block_keys=True)


# the block's operations: V4.1's BLOCK table (kv rows into ws.kvb, row-grouped experts) with the DSpark attention
TABLE = SimpleNamespace(**{**vars(kernels.of(BLOCK, "v41")), "attend": dspark_attend})


class CudaDSpark(CudaDraftStates, DSparkBase):
    """The DSpark draft of a CudaModel, on the same device, runtime and state store (RefDSpark's interface)."""

    def __init__(self, model):
        super().__init__(model)
        mc, cfg, B = self.main_config, self.config, self.block_size
        self.rt, self.store = model.rt, model.store
        S, gguf = cfg.n_layers, model.gguf
        freqs = tuple(np.ascontiguousarray(layer_rope_freqs(cfg, s), F32) for s in range(S))
        self._block, self._tensors, self._freqs = upload_entries(self.rt, self.store, gguf,
                                                                 list(schema.dspark_entries(mc)), extra=freqs)
        self.binding = D = schema.bind_dspark(mc, self._tensors.__getitem__)
        for s, L in enumerate(D.stages):
            check_gate_up(f"DSpark stage {s}", L.ffn)
        if D.markov_embed.qtype not in EMBED_TYPES:     # the chain reads its rows with the embedding kernel
            raise UnsupportedByBackend(f"dspark.markov_embd is {D.markov_embed.qtype.name}; the CUDA backend reads "
                                       f"it as an embedding table ({', '.join(t.name for t in EMBED_TYPES)}); use "
                                       "--backend ref")
        self._host = HostMarkov(gguf, mc)       # the Markov / confidence tables on the host, read when first needed
        # the block's workspace (BLOCK declaration of B rows), the feed's buffers (one ring's rows at most) and the
        # chain's: [h_i | e_i] rows, the bias, the chain's logits, ids and confidences, the argmax partials
        self.bucket = model.min_bucket
        self.cache = GraphCache(self.store)
        self.pool = WorkspacePool(cfg, self.rt, self.store, None, lambda mode: self.cache.drop(DSPARK_BLOCK),
                                  act_quant=self.numerics.act_quant)
        self.pool.need(BLOCK, self.bucket, B)          # made now: the draft's memory is taken when it opens
        self.feed_rows = F = self.layout.parts[0].capacity
        parts = argmax_parts(self.rt, mc.vocab_size)
        shapes = {"taps": ((F, mc.dspark_tap_dim), F32), "main_x": ((F, cfg.dim), F32),
                  "pos": ((F,), np.int32), "chain_x": ((B, mc.dspark_conf_dim), F32),
                  "bias": ((mc.vocab_size,), F32), "chain_logits": ((B, mc.vocab_size), F32),
                  "chain_ids": ((B,), np.int32), "conf": ((B,), F32), "part_val": ((parts,), F32),
                  "part_idx": ((parts,), np.int32), "ticket": ((1,), np.uint32),
                  **{f"kv{s}": ((F, cfg.head_dim), F32) for s in range(S)}}
        self._bufs_block, self.bufs = layer.zeroed_block(self.store, self.rt, shapes)

    @property
    def ws(self) -> layer.Workspace:
        """The block's workspace: the pool's BLOCK one, holding the draft's bucket and block_size rows."""
        return self.pool.need(BLOCK, self.bucket, self.block_size)

    # ---- the rings ----------------------------------------------------------------------------------------
    def feed(self, states: Sequence[CudaState], taps: Sequence[np.ndarray]) -> None:
        """Write each state's rings for the main positions state.n_tokens .. + len(taps[i]) − 1 (taps[i]: their
        [T, n_targets·D] taps from model.step_taps) and advance it. Only the rows a ring keeps are computed."""
        work = []
        for st, tp in zip(states, self.check_feed(states, taps)):
            keep = min(len(tp), self.feed_rows)
            work.append((st, tp[len(tp) - keep:], st.n_tokens + len(tp) - keep, len(tp)))
        self.store.reclaim()
        for st, rows, p0, _ in work:
            self._write_rings(st, rows, p0)
        for st, _, _, n in work:             # (rows written above: nothing can fail between them and this)
            st.begin_step(n)
            st.end_step(n)

    def _write_rings(self, st: CudaState, rows: np.ndarray, p0: int) -> None:
        """The ring rows of positions p0 .. p0 + len(rows) − 1 of every stage (len(rows) <= feed_rows)."""
        cfg, D, b, n = self.config, self.binding, self.bufs, len(rows)
        fq, f16 = self.numerics.fake_quant, self.numerics.kv_dtype == "f16"
        self.rt.synchronize()                # the previous feed may still read the buffers
        b["taps"].view(0, rows.shape).upload(np.ascontiguousarray(rows), self.rt.main)
        b["pos"].view(0, n).upload(np.arange(p0, p0 + n, dtype=np.int32), self.rt.main)
        ls = Launcher(self.rt, self.model.pdl)
        gemvs(ls, [(D.main_proj, b["main_x"], cfg.dim)], b["taps"], self.main_config.dspark_tap_dim, n, ls.main)
        gemvs(ls, [(L.attn.kv, b[f"kv{s}"], cfg.head_dim) for s, L in enumerate(D.stages)], b["main_x"], cfg.dim, n,
              ls.main, norm=(D.main_norm.array, cfg.norm_eps))
        for s, L in enumerate(D.stages):
            kr = KvRow(L.attn.kv_norm.array, self._freqs[s], cfg.head_dim, cfg.rope_dim, cfg.norm_eps, fq, f16)
            ops_v41.kv_rows(ls, kr, ops_v41.RawRows(b[f"kv{s}"], b["pos"], n), st.arrays[f"{s}.win"], **ls.main())

    # ---- one draft call -------------------------------------------------------------------------------------
    def block(self, state: CudaState, token: int) -> "ChainBlock":
        """The block after the state's last fed position t (block token 0 = `token`, the token at t + 1)."""
        t = self.check_block(state, token)
        mc, B = self.main_config, self.block_size
        self.store.reclaim()
        run = self._run(state)
        self.rt.synchronize()                # the previous call's outputs are read; its inputs may be rewritten
        run.run(list(range(t + 1, t + 1 + B)) + [int(token)] + [mc.dspark_noise_id] * (B - 1))
        b = self.bufs
        base = self.ws.logits.view(0, (B, mc.vocab_size)).download()
        hidden = b["chain_x"].download()[:, :mc.dim].copy()
        ids = np.concatenate([[int(token)], b["chain_ids"].download()]).astype(np.int64)
        return ChainBlock(base, hidden, self._host, ids, b["chain_logits"].download(), b["conf"].download())

    def greedy(self, blk: DraftBlock, token: int, ids: Sequence[int] | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """greedy_chain (as RefDSpark.greedy): out [B + 1], logits [B, V], confidence [B]; the device's chain as it is when no
        teacher `ids` are given."""
        if ids is None and isinstance(blk, ChainBlock) and int(blk.chain_ids[0]) == int(token):
            return blk.chain_ids.copy(), blk.chain_logits.copy(), blk.chain_conf.copy()
        return DSparkBase.greedy(self, blk, token, ids)

    def _run(self, state: CudaState) -> StepRun:
        m, ws = self.model, self.ws
        key = GraphKey(DSPARK_BLOCK, ws.version, m.options.launch, (ws.bucket,), (parts_of(state),))

        def make() -> StepRun:
            rows = RowSet(BLOCK, [dict(state.arrays)], [ws.bucket], self.block_size, ws.slot, cap=ws.rows)
            rec = Recording(self.config, self.numerics, self._freqs, ws, rows, ws.tickets, onehot=m._onehot,
                            mma=False, table=TABLE)
            D, b, MB = self.binding, self.bufs, m.w.binding

            def record(ls: Launcher) -> None:
                record_block(ls, rec, D, MB, b["chain_x"])
                record_chain(ls, rec, D, b, self.main_config.dspark_rank)

            return StepRun(m, record, key, slot=ws.slot, graph=False)

        return self.cache.second_use(key, make)

    def launches_per_call(self) -> int:
        """Kernels of one draft call (a fresh state's block recording, counted)."""
        return self._run(self.new_state()).count()[0]

    def close(self) -> None:
        self.cache.close()
        self.pool.close()
        self.store.retire([self._bufs_block, self._block])
        self.store.reclaim()


def record_block(ls: Launcher, rec: Recording, D: Any, MB: Any, hidden: Any) -> None:
    """One draft call of rec.R block rows: the main embedding on the hc copies, the S stages (V4.1 blocks, lagged
    mHC from the one-hot pre-mix, the DSpark attention), h = Σ pre_j X_j into the rows of `hidden` ([R, D + r]:
    h_i first), then the draft's norm and the main head into ws.logits (the base logits)."""
    cfg, ws, R = rec.cfg, rec.ws, rec.R
    hc, Dm = cfg.hc_mult, cfg.dim
    ops.embed(ls, ops.Embedding(MB.embed.array, copies=hc), rec.rows.tokens, ws.X0, R, **ls.main())
    X, other = ws.X0, ws.X1
    for s, L in enumerate(D.stages):
        Y = layer.record_layer(ls, rec, s, L, X, other)
        if Y is not X:
            X, other = Y, X
    ops_dspark.hc_sum(ls, X, R, Dm, ops_dspark.HcSum(hidden, 1.0, int(hidden.shape[-1]), ws.mix_ffn, mix_record(hc)),
                      hc, **ls.main())
    layer.record_head(ls, rec, X, R, None, D.norm, MB.head)


def record_chain(ls: Launcher, rec: Recording, D: Any, b: dict, r: int) -> None:
    """The greedy chain after record_block: per block position i, e_i = markov_embed[out_i] into the tail of row i
    of b["chain_x"] (out_0: the slot's token 0, out_{i>0}: b["chain_ids"][i - 1]), logits_i = base_i + markov_head ·
    e_i into b["chain_logits"], out_{i+1} = argmax into b["chain_ids"][i]; then conf = confidence · [h_i, e_i]."""
    cfg, ws, R = rec.cfg, rec.ws, rec.R
    V, Dm = cfg.vocab_size, cfg.dim
    w = Dm + r
    for i in range(R):
        tok = rec.rows.token(0) if i == 0 else b["chain_ids"].view(4 * (i - 1), 1)
        e = b["chain_x"].view(4 * (i * w + Dm), r)
        ops.embed(ls, ops.Embedding(D.markov_embed.array), tok, e, 1, **ls.main())
        gemvs(ls, [(D.markov_head, b["bias"], V)], e, r, 1, ls.main)
        row = b["chain_logits"].view(4 * i * V, V)
        ops_dspark.add(ls, ws.logits.view(4 * i * V, V), b["bias"], row, V, **ls.main())
        parts = ops.ArgmaxParts(val=b["part_val"], idx=b["part_idx"], ticket=b["ticket"])
        ops.argmax(ls, row, V, parts, b["chain_ids"].view(4 * i, 1), **ls.main())
    gemvs(ls, [(D.confidence, b["conf"], 1)], b["chain_x"], w, R, ls.main)


class HostMarkov:
    """The Markov and confidence tables as float32 on the host (DraftBlock.position off the device chain), read
    from the file the first time one is needed."""

    def __init__(self, gguf: Any, mc: Any):
        self._names = {e.spec.field: (e.name, e.shape) for e in schema.dspark_entries(mc)
                       if e.spec.field in ("markov_embed", "markov_head", "confidence")}
        self._gguf = gguf

    def _read(self, field: str) -> np.ndarray:
        name, shape = self._names[field]
        return np.asarray(_float(self._gguf, self._gguf.tensor(name)), F32).reshape(shape)

    @cached_property
    def embed(self) -> np.ndarray:
        return self._read("markov_embed")

    @cached_property
    def head(self) -> np.ndarray:
        return self._read("markov_head")

    @cached_property
    def confidence_w(self) -> np.ndarray:
        return self._read("confidence").reshape(-1)


class ChainBlock(DraftBlock):
    """A CUDA draft call's block: base [B, V] and h [B, D] as DraftBlock's, the device's greedy chain (chain_ids
    [B + 1] = [token, d_1..d_B], its logits [B, V] and confidences [B]); position(i, prev) is the chain's row when
    prev is its out_i, else the reference's host computation."""

    def __init__(self, base: np.ndarray, hidden: np.ndarray, host: HostMarkov, chain_ids: np.ndarray,
                 chain_logits: np.ndarray, chain_conf: np.ndarray):
        self.base, self.hidden, self._host = base, hidden, host
        self.chain_ids, self.chain_logits, self.chain_conf = chain_ids, chain_logits, chain_conf

    embed = property(lambda self: self._host.embed)
    head = property(lambda self: self._host.head)
    confidence_w = property(lambda self: self._host.confidence_w)

    def position(self, i: int, prev: int) -> tuple[np.ndarray, float]:
        if int(prev) == int(self.chain_ids[i]):
            return self.chain_logits[i].copy(), float(self.chain_conf[i])
        return DraftBlock.position(self, i, prev)
