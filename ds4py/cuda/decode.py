"""The decode step of V4 Flash as a launch sequence (MODEL.md §2; ds4py/ref/forward.py is the same math on the
host): what the CUDA engine captures into one graph per context bucket and replays per token.

    body:  embed(token) -> per layer: attention sub-layer, MoE sub-layer          (X: the hc residual, [hc, D])
    head:  hc head collapse + output norm -> head GEMV -> logits [-> sampler -> token]

Everything a step varies is read on the device: the position and the token from the model's int32 slot
[pos, token] (the sampler writes the next token there, the embedding and the hash router read it), which window
rows and compressed rows exist, whether a compressor group completes, what the indexer keeps. Only the key
capacity of the bucket is fixed at capture (attention plans, indexer score count, rows capacities).

Streams. Per attention sub-layer the KV branch (the kv, compressor and indexer-weight GEMVs, the kv store and
the compressors) runs on the side stream while the main stream computes the queries; per MoE sub-layer the
shared expert runs on the side stream while the main stream routes and runs the routed experts' gate + up; each
joins before its consumer. Every launch but the first after a fork or join on its stream is a PDL launch (when
the engine runs with PDL): it may start while its predecessor drains and waits (pdl_wait) before touching its
output. Buffers are reused from layer to layer: on one stream PDL never lets a kernel write before its
predecessor finished, and the side stream only touches buffers the main stream leaves alone between fork and
join.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as QT

from ds4py.cuda import ops
from ds4py.cuda.memory import Arena, DeviceArray, align_up
from ds4py.cuda.model_weights import GEMV_TYPES, DevTensor, DeviceWeights
from ds4py.cuda.ops import attention as ops_attn
from ds4py.cuda.ops import compressor as ops_comp
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.ops import indexer as ops_idx
from ds4py.cuda.ops import router as ops_route
from ds4py.cuda.ops import topk as ops_topk
from ds4py.cuda.ops.gemv import MAX_MATS
from ds4py.cuda.ops.mhc import mix_partial_floats, mix_record
from ds4py.cuda.twins.indexer import weight_scale

F32, I32 = np.dtype(np.float32), np.dtype(np.int32)


# ---- launches: streams, PDL, counting ------------------------------------------------------------------------
class Launcher:
    """The runtime as the record functions see it: counts kernel launches and picks each launch's stream and PDL
    flag (no PDL on the first launch after a fork / join on that stream: its other dependency is an event)."""

    def __init__(self, rt: Any, pdl: bool):
        self.rt, self.pdl = rt, pdl
        self.device = rt.device
        self.launches = 0
        self.side_launches = 0
        self._fresh = {id(rt.main): True, id(rt.side): True}

    # ops.* call rt.launch(...) and read rt.device: this object stands in for the runtime there
    def launch(self, name: str, grid: Any, block: Any, *args: Any, smem: int = 0, stream: Any = None,
               pdl: bool = False) -> None:
        self.launches += 1
        self.side_launches += stream is self.rt.side
        self.rt.launch(name, grid, block, *args, smem=smem, stream=stream, pdl=pdl)

    def on(self, stream: Any) -> dict:
        """stream= / pdl= for the next op on `stream` (main or side)."""
        fresh = self._fresh[id(stream)]
        self._fresh[id(stream)] = False
        return {"stream": stream, "pdl": self.pdl and not fresh}

    def main(self) -> dict:
        return self.on(self.rt.main)

    def side(self) -> dict:
        return self.on(self.rt.side)

    def fork(self) -> None:
        self.rt.fork()
        self._fresh[id(self.rt.side)] = True

    def join(self) -> None:
        self.rt.join()
        self._fresh[id(self.rt.main)] = True


# ---- the workspace: every per-step buffer, carved from the arena's scratch in a fixed order ------------------
def bucket_keys(cfg, ro, bucket: int) -> int:
    """Keys a decode query of this layer attends to at most, below position `bucket`: its window plus the
    compressed rows it can see (all of them, or the indexer's top-k)."""
    if not ro.compressed:
        return cfg.window
    n = bucket // ro.ratio
    return cfg.window + (min(n, cfg.index_topk) if ro.indexer else n)


def attn_plans(cfg, bucket: int) -> list[ops_attn.AttnPlan]:
    return [ops_attn.attn_plan(cfg.n_heads, cfg.head_dim, max(1, bucket_keys(cfg, cfg.roles(il), bucket)))
            for il in range(cfg.n_layers)]


def index_keys(cfg, bucket: int) -> int:
    """Indexer scores per decode step at most (the widest indexer layer)."""
    return max([bucket // cfg.roles(il).index_ratio for il in range(cfg.n_layers) if cfg.roles(il).indexer],
               default=0)


def workspace_shapes(cfg, bucket: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    hc, D = cfg.hc_mult, cfg.dim
    comp_w = max([cfg.comp_width(il) for il in range(cfg.n_layers) if cfg.roles(il).compressor], default=2)
    idx_w = max([cfg.index_comp_width(il) for il in range(cfg.n_layers) if cfg.roles(il).indexer], default=2)
    plans = attn_plans(cfg, bucket)
    po = max(int(np.prod(p.part_o_shape)) for p in plans)
    pm = max(int(np.prod(p.part_ml_shape)) for p in plans)
    k, ih = cfg.n_experts_used, cfg.index_heads
    return {
        "X0": ((hc, D), F32), "X1": ((hc, D), F32),
        "mix_attn": ((mix_record(hc),), F32), "mix_ffn": ((mix_record(hc),), F32), "mix_head": ((mix_record(hc),), F32),
        "mix_partial": ((mix_partial_floats(1, mix_record(hc), D, hc),), F32),
        "x_attn": ((D,), F32), "x_ffn": ((D,), F32), "x_head": ((D,), F32),
        "qa": ((cfg.q_lora_rank,), F32), "q": ((cfg.q_dim,), F32), "kv": ((cfg.head_dim,), F32),
        "ckv": ((comp_w,), F32), "csc": ((comp_w,), F32), "ikv": ((idx_w,), F32), "isc": ((idx_w,), F32),
        "iq_raw": ((ih * cfg.index_head_dim,), F32), "iq": ((ih * cfg.index_head_dim,), F32), "iw": ((ih,), F32),
        "scores": ((max(1, index_keys(cfg, bucket)),), F32), "sel": ((cfg.index_topk,), I32),
        "part_o": ((po,), F32), "part_ml": ((pm,), F32), "o": ((cfg.q_dim,), F32), "u": ((cfg.o_dim,), F32),
        "router": ((cfg.n_experts,), F32), "ids": ((k,), I32), "wts": ((k,), F32),
        "h_shared": ((cfg.shared_ff,), F32), "y_shared": ((D,), F32), "h": ((k, cfg.expert_ff), F32),
        "logits": ((cfg.vocab_size,), F32),
    }


def workspace_bytes(shapes: dict) -> int:
    return sum(align_up(int(np.prod(s)) * dt.itemsize) for s, dt in shapes.values()) + 256


@dataclass
class Workspace:
    bucket: int                    # the largest bucket it serves (attention partials, indexer scores)
    version: int                   # changes whenever its arrays move
    a: dict[str, DeviceArray]

    def __getattr__(self, name: str) -> DeviceArray:
        try:
            return self.__dict__["a"][name]
        except KeyError:
            raise AttributeError(name) from None


def make_workspace(arena: Arena, cfg, bucket: int, version: int) -> Workspace:
    shapes = workspace_shapes(cfg, bucket)
    arena.begin_step(workspace_bytes(shapes))
    return Workspace(bucket, version, {name: arena.scratch(s, dt) for name, (s, dt) in shapes.items()})


def carve_block(store: Any, rt: Any, shapes: dict) -> tuple[Any, dict[str, DeviceArray]]:
    """One zeroed store block holding every array of `shapes` (256-B aligned, in order), and the arrays: the
    workspaces of the multi-row step and of prefill (their tickets start, and stay, zero)."""
    offs, at = {}, 0
    for name, (s, dt) in shapes.items():
        offs[name] = at
        at += align_up(int(np.prod(s)) * dt.itemsize)
    blk = store.block(at)
    blk.zero(rt.main)
    return blk, {n: blk.array(offs[n], s, dt) for n, (s, dt) in shapes.items()}


# ---- the recorded step -----------------------------------------------------------------------------------------
@dataclass
class StepContext:
    """What one recording reads: the model (config, numerics, weights), the workspace, the slot and ticket."""
    cfg: Any
    nx: Any
    w: DeviceWeights
    ws: Workspace
    slot: DeviceArray              # int32 [pos, token]
    ticket: DeviceArray            # uint32 [1], zero (hc_mix's last-block ticket; all mixes run on main)

    @property
    def pos(self) -> DeviceArray:
        return self.slot.view(0, 1)

    @property
    def token(self) -> DeviceArray:
        return self.slot.view(4, 1)


def gemvs(L: Launcher, mats: list[tuple[DevTensor, DeviceArray, int]], x: DeviceArray, cols: int, kw_of,
          norm=None) -> None:
    """y_m = W_m x for matrices sharing x: one launch per weight type, up to 4 matrices each."""
    by_type: dict[QT, list] = {}
    for t, y, rows in mats:
        by_type.setdefault(t.qtype, []).append((t.array, y, rows))
    for group in by_type.values():
        for i in range(0, len(group), MAX_MATS):
            ops.gemv(L, group[i:i + MAX_MATS], x, cols, norm=norm, **kw_of())


def record_body(L: Launcher, c: StepContext, state_parts: dict[str, DeviceArray], bucket: int) -> None:
    """Embedding and every layer at the slot's position; the residual ends in X[n_layers % 2]."""
    cfg, B, ws = c.cfg, c.w.binding, c.ws
    ops.embed(L, B.embed.array, c.token, ws.X0, 1, copies=cfg.hc_mult, **L.main())
    plans = attn_plans(cfg, bucket)
    X = (ws.X0, ws.X1)
    for il, lw in enumerate(B.layers):
        ro = cfg.roles(il)
        attention(L, c, il, ro, lw, X[il % 2], state_parts, bucket, plans[il])
        moe(L, c, il, ro, lw, X[il % 2], X[(il + 1) % 2])


def attention(L: Launcher, c: StepContext, il: int, ro, lw, X: DeviceArray, parts: dict[str, DeviceArray],
              bucket: int, plan: ops_attn.AttnPlan) -> None:
    cfg, nx, ws, A = c.cfg, c.nx, c.ws, lw.attn
    D, hd, rd, eps, hc = cfg.dim, cfg.head_dim, cfg.rope_dim, cfg.norm_eps, cfg.hc_mult
    fq, f16 = nx.fake_quant, nx.kv_dtype == "f16"
    freqs = c.w.freqs[il]
    part = lambda layer, name: parts[f"{layer}.{name}"]   # noqa: E731
    hc_pre(L, c, lw.hc_attn, lw.attn_norm, X, ws.mix_attn, ws.x_attn)

    # side stream: the KV branch (kv row into the window ring, the compressors' inputs and emissions)
    L.fork()
    side = [(A.kv, ws.kv, hd)]
    if ro.compressor:
        w2 = cfg.comp_width(il)
        side += [(A.comp.kv, ws.ckv.view(0, w2), w2), (A.comp.gate, ws.csc.view(0, w2), w2)]
    if ro.indexer:
        wi = cfg.index_comp_width(il)
        side += [(A.index.comp.kv, ws.ikv.view(0, wi), wi), (A.index.comp.gate, ws.isc.view(0, wi), wi),
                 (A.index.proj, ws.iw, cfg.index_heads)]
    gemvs(L, side, ws.x_attn, D, L.side)
    ops_attn.kv_store(L, ws.kv, A.kv_norm.array, freqs, c.pos, part(il, "win"), hd, rd, eps, fq, f16, **L.side())
    if ro.compressor:
        w2 = cfg.comp_width(il)
        ops_comp.compressor_decode(L, ws.ckv.view(0, w2), ws.csc.view(0, w2), A.comp.ape.array, A.comp.norm.array,
                                   freqs, c.pos, part(il, "comp_kv"), part(il, "comp_score"), part(il, "comp_rows"),
                                   ro.ratio, bool(ro.overlap), hd, rd, eps, False, fq, f16, **L.side())
    if ro.indexer:
        wi, ihd = cfg.index_comp_width(il), cfg.index_head_dim
        ops_comp.compressor_decode(L, ws.ikv.view(0, wi), ws.isc.view(0, wi), A.index.comp.ape.array,
                                   A.index.comp.norm.array, freqs, c.pos, part(il, "idx_kv"), part(il, "idx_score"),
                                   part(il, "idx_keys"), ro.index_ratio, bool(ro.index_overlap), ihd, rd, eps, True,
                                   fq, f16, **L.side())

    # main stream: the queries
    gemvs(L, [(A.q_a, ws.qa, cfg.q_lora_rank)], ws.x_attn, D, L.main)
    main = [(A.q_b, ws.q, cfg.q_dim)]
    if ro.indexer:
        main.append((A.index.q_b, ws.iq_raw, cfg.index_q_dim))
    gemvs(L, main, ws.qa, cfg.q_lora_rank, L.main, norm=(A.q_a_norm.array, eps))
    if ro.indexer:
        ops_idx.indexer_q_prep(L, ws.iq_raw, freqs, c.pos, ws.iq, cfg.index_heads, cfg.index_head_dim, rd, fq,
                               **L.main())
    L.join()

    comp = sel = None
    if ro.compressed:
        comp = part(ro.kv_source, "comp_rows")
    if ro.indexer:
        n_keys = bucket // ro.index_ratio
        ops_idx.indexer_scores(L, ws.iq, ws.iw, weight_scale(cfg.index_head_dim, cfg.index_heads),
                               part(il, "idx_keys"), c.pos, ws.scores.view(0, n_keys), cfg.index_heads,
                               cfg.index_head_dim, n_keys, ro.index_ratio, **L.main())
        ops_topk.topk(L, ws.scores.view(0, n_keys), cfg.index_topk, ws.sel, pos_slot=c.pos, ratio=ro.index_ratio,
                      **L.main())
        sel = ws.sel
    ops_attn.decode_attention(L, plan, ws.q, freqs, c.pos, part(il, "win"), cfg.window, comp, ro.ratio, sel,
                              cfg.index_topk, A.sinks.array, ws.part_o.view(0, plan.part_o_shape),
                              ws.part_ml.view(0, plan.part_ml_shape), ws.o, rd, eps, hd ** -0.5, **L.main())
    ops.gemv(L, [(A.out_a.array, ws.u, cfg.o_dim)], ws.o, cfg.o_group_in, x_group_rows=cfg.o_lora_rank, **L.main())
    ops.gemv_hc_post(L, A.out_b.array, ws.u, X, ws.mix_attn, D, cfg.o_dim, hc=hc, **L.main())


def hc_pre(L: Launcher, c: StepContext, hw, norm: DevTensor, X: DeviceArray, mix: DeviceArray,
           x: DeviceArray) -> None:
    """A sub-layer's input: the mHC mix (pre, post, Sinkhorn C) of X, then RMSNorm(sum_j pre_j X_j)."""
    cfg = c.cfg
    ops.hc_mix(L, hw.fn.array, X, 1, cfg.dim, hw.scale.array, hw.base.array, c.ws.mix_partial, c.ticket, mix,
               cfg.norm_eps, cfg.hc_eps, cfg.sinkhorn_iters, cfg.hc_mult, **L.main())
    ops.hc_collapse_norm(L, X, mix, 1, cfg.dim, norm.array, cfg.norm_eps, x, cfg.hc_mult, **L.main())


def moe(L: Launcher, c: StepContext, il: int, ro, lw, X: DeviceArray, X_out: DeviceArray) -> None:
    cfg, ws, Fw = c.cfg, c.ws, lw.ffn
    D, hc, clamp = cfg.dim, cfg.hc_mult, cfg.swiglu_clamp[il]
    hc_pre(L, c, lw.hc_ffn, lw.ffn_norm, X, ws.mix_ffn, ws.x_ffn)

    # side stream: the shared expert
    L.fork()
    S, sff = Fw.shared, cfg.shared_ff
    if S.gate.qtype in GEMV_TYPES:
        ops.gemv_swiglu(L, S.gate.array, S.up.array, ws.x_ffn, ws.h_shared, sff, D, clamp=clamp, **L.side())
    else:
        ops_moe.moe_gate_up(L, S.gate.qtype, S.gate.array, S.up.array, ws.x_ffn, None, None, ws.h_shared, 1, sff, D,
                            1, clamp, **L.side())
    if S.down.qtype in GEMV_TYPES:
        ops.gemv(L, [(S.down.array, ws.y_shared, D)], ws.h_shared, sff, **L.side())
    else:
        ops_moe.moe_down(L, S.down.qtype, S.down.array, None, ws.h_shared, ws.y_shared, 1, D, sff, 1, **L.side())

    # main stream: route, routed gate + up
    E, k, NX, ff = Fw.experts, cfg.n_experts_used, cfg.n_experts, cfg.expert_ff
    gemvs(L, [(Fw.gate_inp, ws.router, NX)], ws.x_ffn, D, L.main)
    ops_route.moe_route(L, ws.router, None if ro.hash_routing else Fw.route_bias.array,
                        Fw.tid2eid.array if ro.hash_routing else None, c.token, ws.ids, ws.wts, NX, k, cfg.route_scale,
                        cfg.route_norm, **L.main())
    ops_moe.moe_gate_up(L, E.gate.qtype, E.gate.array, E.up.array, ws.x_ffn, ws.ids, ws.wts, ws.h, NX, ff, D, k, clamp,
                        **L.main())
    L.join()
    # routed down + the shared expert's output + the mHC post, into the other residual buffer
    mix = ws.mix_ffn
    ops_moe.moe_down(L, E.down.qtype, E.down.array, ws.ids, ws.h, X_out, NX, D, ff, k, add=ws.y_shared,
                     hc_post=mix.view(4 * hc, hc), hc_comb=mix.view(8 * hc, hc * hc), hc_x=X, **L.main())


def final_residual(c: StepContext) -> DeviceArray:
    return c.ws.X0 if c.cfg.n_layers % 2 == 0 else c.ws.X1


def record_head(L: Launcher, c: StepContext, sampling: tuple | None) -> None:
    """logits = head(RMSNorm(hc_head(X))); with sampling = (temperature, top_k, top_p, min_p, seed) the sampler
    then writes the next token into the slot (-1 when the logits are no distribution), its draw keyed by the
    sampled token's position (pos + 1)."""
    cfg, B, ws = c.cfg, c.w.binding, c.ws
    X = final_residual(c)
    H = B.hc_head
    ops.hc_mix(L, H.fn.array, X, 1, cfg.dim, H.scale.array, H.base.array, ws.mix_partial, c.ticket, ws.mix_head,
               cfg.norm_eps, cfg.hc_eps, cfg.sinkhorn_iters, cfg.hc_mult, **L.main())
    ops.hc_collapse_norm(L, X, ws.mix_head, 1, cfg.dim, B.output_norm.array, cfg.norm_eps, ws.x_head, cfg.hc_mult,
                         **L.main())
    gemvs(L, [(B.head, ws.logits, cfg.vocab_size)], ws.x_head, cfg.dim, L.main)
    if sampling is not None:
        temperature, top_k, top_p, min_p, seed = sampling
        ops.sample(L, ws.logits, cfg.vocab_size, c.token, temperature, top_k, top_p, min_p, seed, pos_slot=c.pos,
                   pos_offset=1, **L.main())
