"""Multi-row decode steps (issue 17): up to MAX_ROWS rows in one launch sequence - several sequences each decoding
one token, or a short chunk of one sequence (a speculative verify of 1 + k rows) - captured into one graph per
(rows' states, context buckets, row count) and replayed.

    rows = [(state_a, pos_a, token_a), (state_b, pos_b, token_b), (state_a, pos_a + 1, token_c), ...]

The weights are read once per step for all rows (at most GEMV_MAX_X rows per GEMV launch, so a step of more rows
reads the dense weights ceil(R / GEMV_MAX_X) times): the dense GEMVs are the `_rows` kernels of cu/gemv.cu, the
routed experts' gate + up is grouped by the rows' distinct experts (cu/experts.cu `moe_gate_up_rows_*`), and the
down runs per row in one launch (each row's own experts). What reads a sequence's state - the kv store, the
compressors, the indexer, top-k, attention, the hash router's token - runs per row against that row's state,
in row order on its stream, with the row's position and token in the rows slot [pos_0 .. pos_15 | tok_0 ..].

Rows of one state must come in position order. Within a layer every row's state writes (kv store, compressor
update) come before any row's attention reads; that equals stepping them one by one because a row only ever reads
positions <= its own and the rings hold window + rollback horizon slots (so a chunk of at most horizon + 1 rows
never overwrites a slot an earlier row of the chunk still reads).

Batch invariance: every kernel computes a row exactly as the single-row decode does (the `_rows` GEMVs are the
same template with more accumulator sets; the grouped gate + up runs each (row, slot) pair through the same
device function; mHC, embedding and the head are per-token launches already), and each row's attention plan is
the one its own context bucket gives - so a row's logits are bit-identical to a single-row step of that state
(tests/test_cuda_rows.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda import decode, ops
from ds4py.cuda.decode import F32, I32, Launcher, attn_plans, index_keys
from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.model_weights import GEMV_TYPES, DevTensor
from ds4py.cuda.ops import attention as ops_attn
from ds4py.cuda.ops import compressor as ops_comp
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.ops import indexer as ops_idx
from ds4py.cuda.ops import router as ops_route
from ds4py.cuda.ops import topk as ops_topk
from ds4py.cuda.ops.gemv import GEMV_MAX_X, MAX_MATS
from ds4py.cuda.ops.mhc import mix_partial_floats, mix_record
from ds4py.cuda.twins.indexer import weight_scale

MAX_ROWS = 16
U32 = np.dtype(np.uint32)


def rows_shapes(cfg, bucket: int, R: int = MAX_ROWS) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Per-row buffers of a multi-row step ([R, ...] of the single-row workspace's) and the per-row-sequential
    scratch (indexer scores, top-k, attention partials: sized for `bucket`)."""
    one = decode.workspace_shapes(cfg, bucket)
    hc, D = cfg.hc_mult, cfg.dim
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {
        "slot": ((2 * R,), I32), "tickets": ((R,), U32),
        "mix_partial": ((mix_partial_floats(R, mix_record(hc), D, hc),), F32),
    }
    for name in ("scores", "sel", "part_o", "part_ml"):
        shapes[name] = one[name]
    for name in ("X0", "X1", "mix_attn", "mix_ffn", "mix_head", "x_attn", "x_ffn", "x_head", "qa", "q", "kv", "ckv",
                 "csc", "ikv", "isc", "iq_raw", "iq", "iw", "o", "u", "router", "ids", "wts", "h_shared",
                 "y_shared", "h", "logits"):
        s, dt = one[name]
        shapes[name] = ((R,) + s, dt)
    return shapes


@dataclass
class RowsWorkspace:
    bucket: int
    version: int
    block: Any                     # the DeviceBlock holding every array (persistent, outside the arena scratch)
    a: dict[str, DeviceArray]

    def __getattr__(self, name: str) -> DeviceArray:
        try:
            return self.__dict__["a"][name]
        except KeyError:
            raise AttributeError(name) from None


def make_rows_workspace(store: Any, rt: Any, cfg, bucket: int, version: int) -> RowsWorkspace:
    blk, arrays = decode.carve_block(store, rt, rows_shapes(cfg, bucket))
    return RowsWorkspace(bucket, version, blk, arrays)


@dataclass
class RowsContext:
    cfg: Any
    nx: Any
    w: Any
    ws: RowsWorkspace
    parts: list[dict[str, DeviceArray]]     # row n's state arrays
    buckets: list[int]                      # row n's context bucket (its attention plans)

    @property
    def R(self) -> int:
        return len(self.parts)

    def pos(self, n: int) -> DeviceArray:
        return self.ws.slot.view(4 * n, 1)

    def token(self, n: int) -> DeviceArray:
        return self.ws.slot.view(4 * (MAX_ROWS + n), 1)

    @property
    def tokens(self) -> DeviceArray:
        return self.ws.slot.view(4 * MAX_ROWS, self.R)


def row(a: DeviceArray, n: int, width: int) -> DeviceArray:
    """Row n of a buffer used as [R, width] (width: this use's row length, not the buffer's widest)."""
    return a.view(4 * n * width, width)


def rows_of(a: DeviceArray, n0: int, nx: int, width: int) -> DeviceArray:
    return a.view(4 * n0 * width, nx * width)


def gemvs_rows(L: Launcher, mats: list[tuple[DevTensor, DeviceArray, int]], x: DeviceArray, cols: int, R: int,
               kw_of, norm=None, x_group_rows: int = 0, x_stride: int | None = None) -> None:
    """decode.gemvs for R activation rows x[n] = x + n * x_stride into y_m[n] = y_m + n * rows_m: up to
    GEMV_MAX_X rows and 4 matrices of one type per launch."""
    stride = x_stride if x_stride is not None else cols
    by_type: dict[Any, list] = {}
    for t, y, rows in mats:
        by_type.setdefault(t.qtype, []).append((t.array, y, rows))
    for group in by_type.values():
        for i in range(0, len(group), MAX_MATS):
            for n0 in range(0, R, GEMV_MAX_X):
                nx = min(GEMV_MAX_X, R - n0)
                outs = [(W, rows_of(y, n0, nx, rows), rows) for W, y, rows in group[i:i + MAX_MATS]]
                ops.gemv(L, outs, rows_of(x, n0, nx, stride), cols, norm=norm, x_group_rows=x_group_rows, nx=nx,
                         x_stride=stride, **kw_of())


def record_rows(L: Launcher, c: RowsContext) -> None:
    """The whole multi-row step: embedding, every layer, the head into ws.logits [R, vocab]."""
    cfg, B, ws, R = c.cfg, c.w.binding, c.ws, c.R
    hc, D = cfg.hc_mult, cfg.dim
    ops.embed(L, B.embed.array, c.tokens, ws.X0, R, copies=hc, **L.main())
    plans = [attn_plans(cfg, b) for b in c.buckets]
    X = (ws.X0, ws.X1)
    for il, lw in enumerate(B.layers):
        ro = cfg.roles(il)
        _attention(L, c, il, ro, lw, X[il % 2], [p[il] for p in plans])
        _moe(L, c, il, ro, lw, X[il % 2], X[(il + 1) % 2])
    Xf = X[cfg.n_layers % 2]
    H = B.hc_head
    ops.hc_mix(L, H.fn.array, Xf, R, D, H.scale.array, H.base.array, ws.mix_partial, ws.tickets, ws.mix_head,
               cfg.norm_eps, cfg.hc_eps, cfg.sinkhorn_iters, hc, **L.main())
    ops.hc_collapse_norm(L, Xf, ws.mix_head, R, D, B.output_norm.array, cfg.norm_eps, ws.x_head, hc, **L.main())
    gemvs_rows(L, [(B.head, ws.logits, cfg.vocab_size)], ws.x_head, D, R, L.main)


def _hc_pre(L: Launcher, c: RowsContext, hw, norm: DevTensor, X: DeviceArray, mix: DeviceArray,
            x: DeviceArray) -> None:
    cfg, R = c.cfg, c.R
    ops.hc_mix(L, hw.fn.array, X, R, cfg.dim, hw.scale.array, hw.base.array, c.ws.mix_partial, c.ws.tickets, mix,
               cfg.norm_eps, cfg.hc_eps, cfg.sinkhorn_iters, cfg.hc_mult, **L.main())
    ops.hc_collapse_norm(L, X, mix, R, cfg.dim, norm.array, cfg.norm_eps, x, cfg.hc_mult, **L.main())


def _attention(L: Launcher, c: RowsContext, il: int, ro, lw, X: DeviceArray, plans: list) -> None:
    cfg, nx, ws, A, R = c.cfg, c.nx, c.ws, lw.attn, c.R
    D, hd, rd, eps = cfg.dim, cfg.head_dim, cfg.rope_dim, cfg.norm_eps
    fq, f16 = nx.fake_quant, nx.kv_dtype == "f16"
    freqs = c.w.freqs[il]
    _hc_pre(L, c, lw.hc_attn, lw.attn_norm, X, ws.mix_attn, ws.x_attn)

    # side stream: the KV branch, GEMVs for all rows, then each row's stores into its own state (row order)
    L.fork()
    w2 = cfg.comp_width(il) if ro.compressor else 0
    wi = cfg.index_comp_width(il) if ro.indexer else 0
    side = [(A.kv, ws.kv, hd)]
    if ro.compressor:
        side += [(A.comp.kv, ws.ckv, w2), (A.comp.gate, ws.csc, w2)]
    if ro.indexer:
        side += [(A.index.comp.kv, ws.ikv, wi), (A.index.comp.gate, ws.isc, wi), (A.index.proj, ws.iw, cfg.index_heads)]
    gemvs_rows(L, side, ws.x_attn, D, R, L.side)
    for n in range(R):
        p, pos = c.parts[n], c.pos(n)
        ops_attn.kv_store(L, row(ws.kv, n, hd), A.kv_norm.array, freqs, pos, p[f"{il}.win"], hd, rd, eps, fq, f16,
                          **L.side())
        if ro.compressor:
            ops_comp.compressor_decode(L, row(ws.ckv, n, w2), row(ws.csc, n, w2), A.comp.ape.array,
                                       A.comp.norm.array, freqs, pos, p[f"{il}.comp_kv"], p[f"{il}.comp_score"],
                                       p[f"{il}.comp_rows"], ro.ratio, bool(ro.overlap), hd, rd, eps, False, fq, f16,
                                       **L.side())
        if ro.indexer:
            ops_comp.compressor_decode(L, row(ws.ikv, n, wi), row(ws.isc, n, wi), A.index.comp.ape.array,
                                       A.index.comp.norm.array, freqs, pos, p[f"{il}.idx_kv"], p[f"{il}.idx_score"],
                                       p[f"{il}.idx_keys"], ro.index_ratio, bool(ro.index_overlap),
                                       cfg.index_head_dim, rd, eps, True, fq, f16, **L.side())

    # main stream: the queries of all rows
    gemvs_rows(L, [(A.q_a, ws.qa, cfg.q_lora_rank)], ws.x_attn, D, R, L.main)
    main = [(A.q_b, ws.q, cfg.q_dim)]
    iqd = cfg.index_heads * cfg.index_head_dim
    if ro.indexer:
        main.append((A.index.q_b, ws.iq_raw, cfg.index_q_dim))
    gemvs_rows(L, main, ws.qa, cfg.q_lora_rank, R, L.main, norm=(A.q_a_norm.array, eps))
    if ro.indexer:
        for n in range(R):
            ops_idx.indexer_q_prep(L, row(ws.iq_raw, n, cfg.index_q_dim), freqs, c.pos(n), row(ws.iq, n, iqd),
                                   cfg.index_heads, cfg.index_head_dim, rd, fq, **L.main())
    L.join()

    # each row's attention over its own state
    for n in range(R):
        p, pos, plan = c.parts[n], c.pos(n), plans[n]
        comp = p[f"{ro.kv_source}.comp_rows"] if ro.compressed else None
        sel = None
        if ro.indexer:
            n_keys = c.buckets[n] // ro.index_ratio
            ops_idx.indexer_scores(L, row(ws.iq, n, iqd), row(ws.iw, n, cfg.index_heads),
                                   weight_scale(cfg.index_head_dim, cfg.index_heads), p[f"{il}.idx_keys"], pos,
                                   ws.scores.view(0, n_keys), cfg.index_heads, cfg.index_head_dim, n_keys,
                                   ro.index_ratio, **L.main())
            ops_topk.topk(L, ws.scores.view(0, n_keys), cfg.index_topk, ws.sel, pos_slot=pos, ratio=ro.index_ratio,
                          **L.main())
            sel = ws.sel
        ops_attn.decode_attention(L, plan, row(ws.q, n, cfg.q_dim), freqs, pos, p[f"{il}.win"], cfg.window, comp,
                                  ro.ratio, sel, cfg.index_topk, A.sinks.array, ws.part_o.view(0, plan.part_o_shape),
                                  ws.part_ml.view(0, plan.part_ml_shape), row(ws.o, n, cfg.q_dim), rd, eps,
                                  hd ** -0.5, **L.main())
    gemvs_rows(L, [(A.out_a, ws.u, cfg.o_dim)], ws.o, cfg.o_group_in, R, L.main, x_group_rows=cfg.o_lora_rank,
               x_stride=cfg.q_dim)
    hc, mrec = cfg.hc_mult, mix_record(cfg.hc_mult)
    for n0 in range(0, R, GEMV_MAX_X):
        k = min(GEMV_MAX_X, R - n0)
        ops.gemv_hc_post(L, A.out_b.array, rows_of(ws.u, n0, k, cfg.o_dim), rows_of(X, n0, k, hc * D),
                         rows_of(ws.mix_attn, n0, k, mrec), D, cfg.o_dim, hc=hc, nx=k, **L.main())


def _moe(L: Launcher, c: RowsContext, il: int, ro, lw, X: DeviceArray, X_out: DeviceArray) -> None:
    cfg, ws, Fw, R = c.cfg, c.ws, lw.ffn, c.R
    D, hc, clamp = cfg.dim, cfg.hc_mult, cfg.swiglu_clamp[il]
    _hc_pre(L, c, lw.hc_ffn, lw.ffn_norm, X, ws.mix_ffn, ws.x_ffn)

    # side stream: the shared expert of every row
    L.fork()
    S, sff = Fw.shared, cfg.shared_ff
    if S.gate.qtype in GEMV_TYPES:
        for n0 in range(0, R, GEMV_MAX_X):
            k = min(GEMV_MAX_X, R - n0)
            ops.gemv_swiglu(L, S.gate.array, S.up.array, rows_of(ws.x_ffn, n0, k, D), rows_of(ws.h_shared, n0, k, sff),
                            sff, D, clamp=clamp, nx=k, **L.side())
    else:
        ops_moe.moe_gate_up_rows(L, S.gate.qtype, S.gate.array, S.up.array, ws.x_ffn, None, None, ws.h_shared, 1,
                                 sff, D, 1, R, clamp, **L.side())
    if S.down.qtype in GEMV_TYPES:
        gemvs_rows(L, [(S.down, ws.y_shared, D)], ws.h_shared, sff, R, L.side)
    else:
        ops_moe.moe_down_rows(L, S.down.qtype, S.down.array, None, ws.h_shared, ws.y_shared, 1, D, sff, 1, R,
                              **L.side())

    # main stream: route each row, the routed gate + up grouped by expert over all rows
    E, k, NX, ff = Fw.experts, cfg.n_experts_used, cfg.n_experts, cfg.expert_ff
    gemvs_rows(L, [(Fw.gate_inp, ws.router, NX)], ws.x_ffn, D, R, L.main)
    for n in range(R):
        ops_route.moe_route(L, row(ws.router, n, NX), None if ro.hash_routing else Fw.route_bias.array,
                            Fw.tid2eid.array if ro.hash_routing else None, c.token(n), row(ws.ids, n, k),
                            row(ws.wts, n, k), NX, k, cfg.route_scale, cfg.route_norm, **L.main())
    ops_moe.moe_gate_up_rows(L, E.gate.qtype, E.gate.array, E.up.array, ws.x_ffn, ws.ids, ws.wts, ws.h, NX, ff, D,
                             k, R, clamp, **L.main())
    L.join()
    ops_moe.moe_down_rows(L, E.down.qtype, E.down.array, ws.ids, ws.h, X_out, NX, D, ff, k, R, add=ws.y_shared,
                          mix=ws.mix_ffn, hc=hc, hc_x=X, **L.main())


def weight_bytes_per_step(model: Any, rows: int, distinct_experts: int | None = None) -> dict[str, int]:
    """Weight bytes one multi-row step reads from memory (the bench's roofline), by the kernels' access pattern:
    dense tensors once per GEMV_MAX_X rows, the routed gate + up once per distinct expert, the routed down once
    per (row, expert), the embedding one row per row. distinct_experts: per layer (default: all rows' experts
    distinct, min(rows * k, n_experts))."""
    from ds4py import schema
    from ds4py.cuda import synth

    cfg = model.config
    k, NX = cfg.n_experts_used, cfg.n_experts
    distinct = min(rows * k, NX) if distinct_experts is None else distinct_experts
    passes = -(-rows // GEMV_MAX_X)
    out = {"dense": 0, "experts_gate_up": 0, "experts_down": 0, "embed": 0}
    for e in schema.entries(cfg):
        t = synth._lookup(model.w.binding, e)
        f = e.spec.field
        if f == "embed":
            out["embed"] += rows * (t.array.nbytes // t.shape[0])
        elif f.startswith("ffn.experts."):
            per = t.array.nbytes // NX
            out["experts_down" if f.endswith("down") else "experts_gate_up"] += per * (
                rows * k if f.endswith("down") else distinct)
        else:
            out["dense"] += t.array.nbytes * passes
    out["total"] = sum(out.values())
    return out


__all__ = ["MAX_ROWS", "RowsContext", "RowsWorkspace", "gemvs_rows", "index_keys", "make_rows_workspace",
           "record_rows", "rows_shapes", "weight_bytes_per_step"]
