"""The MTP draft block on the CUDA engine (MODEL.md §2.5; ds4py/ref/mtp.py is the same math on the host).

    mtp = CudaMtp(model, "model-mtp.gguf")          # model: a CudaModel; CudaMtp(model) when its GGUF holds mtp.0.*
    ds = mtp.new_state()                            # a CudaState of kv.state_layout(cfg.mtp_block()): one window ring
    logits, out = mtp.step([ds], [H], [next_ids], all_logits=True)     # RefMtp's interface

A step is a ROWS row set of ds4py/cuda/layer.py through the block's one layer (the main model's layer recorder,
against the MTP state), with the block's prologue and head:

    X   = e_proj(RMSNorm(embed(next_id); enorm)) in every hc copy  +  h_proj(RMSNorm(h_j; hnorm)) per copy
    X'  = the block (ratio 0: window only, base-theta RoPE, score-routed)
    lg  = head(RMSNorm(hc_head(X'; mtp hc_head_*); mtp norm))        # the main model's embedding and head

The prologue is two GEMV passes over the R * hc copy rows (the embedding written hc times by the embedding kernel,
e_proj with the enorm prologue into the residual, then h_proj with the hnorm prologue added on top), so no kernel
is new. Rows come in steps of at most MAX_ROWS (a long catch-up after a prefill is several steps); each step is one
graph replay per (rows' states, row count, with or without the head: GraphKey MTP_STEP in the block's own
GraphCache), captured when it comes a second time (the first run launches directly). Its workspace comes from its
own WorkspacePool (the block's config, ROWS, with the hidden-state input rows). The hidden states h_j arrive from
the host
(the main model's step_hidden downloads them) and go up into a workspace buffer before the replay; the block's
output states come back down (a chained draft feeds its last row back in).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4py import schema
from ds4py.cuda import layer, ops, synth
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.kernels import gemvs
from ds4py.cuda.graph_cache import MTP_STEP, GraphCache
from ds4py.cuda.kvstate import CudaDraftStates, CudaState
from ds4py.cuda.step_run import GraphKey, StepRun, parts_of
from ds4py.cuda.layer import MAX_ROWS, ROWS, Launcher, Recording, RowSet
from ds4py.cuda.workspaces import WorkspacePool
from ds4py.cuda.device_weights import DevTensor, check_gate_up, upload_entries
from ds4py.contract import MtpBase
from ds4py.host.rope import layer_rope_freqs
from ds4py.kv import state_layout as kv_state_layout


def _upload(rt: Any, store: Any, gguf, cfg) -> tuple[Any, dict[str, DevTensor], list[Any]]:
    """Every mtp.0.* tensor of `gguf` in one device block (device_weights.upload_entries: the file's formats, small
    vectors converted as the main model's are), and the block's RoPE table."""
    freqs = np.ascontiguousarray(layer_rope_freqs(cfg.mtp_block(), 0), np.float32)
    return upload_entries(rt, store, gguf, list(schema.mtp_entries(cfg)),
                          lambda e: e.spec.field.removeprefix("block."), (freqs,))


class CudaMtp(CudaDraftStates, MtpBase):
    """The MTP draft block of a CudaModel, on the same device, runtime and state store."""

    def __init__(self, model, path: str | None = None):
        super().__init__(model, path)           # the file, its checks, the layout and the fingerprint
        self._setup(model, lambda: _upload(model.rt, model.store, self.gguf, model.config))

    @classmethod
    def synthetic(cls, model, seed: int = 0, experts: tuple = synth.Q2_EXPERTS, vq: "synth.VqWidths | None" = None,
                  dense: str | None = None) -> "CudaMtp":
        """An MTP block of random weights at the shapes of `model` (a CudaModel, e.g. CudaModel.synthetic), in the
        storage types synth.load gives the main model, without a file: what the GPU time model plans a draft
        step with (ds4py/cuda/plan.py)."""
        self = cls.__new__(cls)
        cfg = model.config
        self.model, self.backend, self.main_config, self.config = model, model.backend, cfg, cfg.mtp_block()
        self.path, self.gguf = f"synthetic MTP block of {model.path}", None
        self.numerics, self.rollback_horizon = model.numerics, model.rollback_horizon
        self.layout = kv_state_layout(self.config, model.rollback_horizon)
        self.fingerprint = synth.fingerprint(self.config, experts, seed, vq, dense) + "-mtp"
        freqs = np.ascontiguousarray(layer_rope_freqs(self.config, 0), np.float32)
        self._setup(model, lambda: synth.load_mtp(model.rt, model.store, cfg, seed, experts, vq, dense, (freqs,)))
        return self

    def _setup(self, model, place: Any) -> None:
        """The block on the device (place() -> (device block, tensors by name, [RoPE table])) and its workspace."""
        cfg = model.config
        self.rt, self.store = model.rt, model.store
        self._block, tensors, (freqs,) = place()
        self._tensors = tensors
        self.binding = schema.bind_mtp(cfg, tensors.__getitem__)
        check_gate_up("the MTP block", self.binding.block.ffn)
        self._freqs = [freqs]
        # a ratio-0 layer attends to its window only: one plan (and one workspace) serves every position; the
        # workspace is the ROWS declaration of the block's config plus the hidden-state input rows
        self.bucket = model.min_bucket
        self.cache = GraphCache(self.store)
        self.pool = WorkspacePool(self.config, self.rt, self.store, None, lambda mode: self.cache.drop(MTP_STEP),
                                  hidden_in=True, act_quant=self.numerics.act_quant)
        self.pool.need(ROWS, self.bucket, MAX_ROWS)      # made now: the block's memory is taken when it opens

    @property
    def ws(self) -> layer.Workspace:
        """The block's workspace: the pool's ROWS one, holding the block's bucket and MAX_ROWS rows."""
        return self.pool.need(ROWS, self.bucket, MAX_ROWS)

    # ---- the interface RefMtp has (new_state / owns / _export / _import: CudaDraftStates) ----------------------
    def _step(self, states: list[CudaState], hs: list[np.ndarray], ids: list[np.ndarray], all_logits: bool,
              logits: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """MtpBase.step after its checks (hs: float32 [T, hc, dim], ids: int64 [T] per state)."""
        self.store.reclaim()
        plan = [(i, j) for i, c in enumerate(ids) for j in range(len(c))]
        n0 = [st.n_tokens for st in states]
        V = self.main_config.vocab_size
        out_h = [np.empty((len(c),) + hs[i].shape[1:], np.float32) for i, c in enumerate(ids)]
        out_l = [np.empty((len(c) if all_logits else 1, V), np.float32) for c in ids] if logits else []
        for a in range(0, len(plan), MAX_ROWS):
            part = plan[a:a + MAX_ROWS]
            want = [logits and (all_logits or j == len(ids[i]) - 1) for i, j in part]
            head = any(want)
            R = len(part)
            run, ws = self._run([states[i] for i, _ in part], head), self.ws
            self.rt.synchronize()               # the previous replay may still read h_in
            ws.h_in.view(0, (R,) + hs[0].shape[1:]).upload(np.stack([hs[i][j] for i, j in part]))
            values = [n0[i] + j for i, j in part] + [0] * (MAX_ROWS - R) + [int(ids[i][j]) for i, j in part]
            count: dict[int, int] = {}
            for i, _ in part:
                count[i] = count.get(i, 0) + 1
            for i, k in count.items():
                states[i].begin_step(k)
            run.run(values)
            for i, k in count.items():
                states[i].end_step(k)
            X = ws.X1.view(0, (R,) + hs[0].shape[1:]).download()
            lg = ws.logits.view(0, (R, V)).download() if head else None
            for r, ((i, j), w) in enumerate(zip(part, want)):
                out_h[i][j] = X[r]
                if w:
                    out_l[i][j if all_logits else 0] = lg[r]
        if not logits:
            return [], out_h
        return [o if all_logits else o[0] for o in out_l], out_h

    def weight_bytes_per_token(self) -> int:
        """Bytes one draft row reads: the MTP block (n_experts_used of n_experts routed experts), the main
        model's head and one embedding row."""
        cfg = self.main_config
        total = 0
        for e in schema.mtp_entries(cfg):
            t = self._tensors[e.name]
            if e.spec.field.startswith("block.ffn.experts."):          # VQ-8: the codebook is read by every block
                cb = ops_moe.codebook_bytes(t.kernel_format)
                total += cb + (t.array.nbytes - cb) * cfg.n_experts_used // cfg.n_experts
            else:
                total += t.array.nbytes
        B = self.model.w.binding
        return total + B.head.array.nbytes + B.embed.array.nbytes // B.embed.shape[0]

    # ---- graphs -----------------------------------------------------------------------------------------------
    def _run(self, states: list[CudaState], head: bool) -> StepRun:
        m, ws = self.model, self.ws
        key = GraphKey(MTP_STEP, ws.version, m.options.launch, (self.bucket,) * len(states),
                       tuple(parts_of(st) for st in states), head=head)

        def make() -> StepRun:
            rows = RowSet(ROWS, [dict(st.arrays) for st in states], list(key.buckets), len(states), ws.slot,
                          cap=MAX_ROWS)
            rec = Recording(self.config, self.numerics, self._freqs, ws, rows, ws.tickets)
            return StepRun(m, lambda ls: record_mtp(ls, rec, self.binding, m.w.binding, head), key, slot=ws.slot,
                           graph=False)

        return self.cache.second_use(key, make)

    def close(self) -> None:
        self.cache.close()
        self.pool.close()
        self.store.retire([self._block])
        self.store.reclaim()


def record_mtp(ls: Launcher, rec: Recording, M: Any, B: Any, head: bool) -> None:
    """One MTP step of rec.R rows: prologue into X0, the block's layer (X0 -> X1), and the head into ws.logits."""
    cfg, ws, R = rec.cfg, rec.ws, rec.R
    hc, D, eps = cfg.hc_mult, cfg.dim, cfg.norm_eps
    ops.embed(ls, ops.Embedding(B.embed.array, copies=hc), rec.rows.tokens, ws.X1, R, **ls.main())
    gemvs(ls, [(M.e_proj, ws.X0, D)], ws.X1, D, R * hc, ls.main, norm=(M.enorm.array, eps))
    gemvs(ls, [(M.h_proj, ws.X0, D)], ws.h_in, D, R * hc, ls.main, norm=(M.hnorm.array, eps), add=True)
    layer.record_layer(ls, rec, 0, M.block, ws.X0, ws.X1)
    if head:
        layer.record_head(ls, rec, ws.X1, R, M.hc_head, M.norm, B.head)
