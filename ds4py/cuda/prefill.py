"""Prefill on CUDA (issue 17): a block of up to MAX_BLOCK tokens of one sequence as one launch sequence.

    ws = make_prefill_workspace(store, rt, cfg, bucket, rows)
    ctx = PrefillContext(cfg, numerics, weights, ws, state_arrays, bucket, n_rows)
    record_prefill(L, ctx)               # positions ws.pos[:T] and tokens ws.tokens[:T] uploaded before

What runs over the block's T rows (ds4py/ref/forward.py over a chunk is the same math):
- embedding, the mHC mixes / collapses / posts (cu/mhc.cu takes T rows); every dense projection and the shared
  expert's on tensor cores (`dense`, `gemm`: cu/gemm.cu, with x split into three bf16 pieces accumulated so the
  product sees x exactly; `prefill_mma=False`: the `_rows` GEMVs of cu/gemv.cu, GEMV_MAX_X rows per launch); the
  routing (`moe_route_rows`); the routed experts (`routed_experts`): cu/experts.cu's rows kernels grouped by
  expert (fp32, the default), or cu/moe_prefill.cu on tensor cores (`expert_mma`: x and h rounded to bf16);
- the kv rows of the block (`prefill_kv_rows`, into a block buffer), the compressors (compressor_prefill_pool
  emits every group the block completes, each from its window of ring + block inputs, in parallel; then
  compressor_prefill_store keeps the block's tail in the rings), the indexer for all T queries (q prep, scores,
  per-query top-k: the `_rows` kernels of cu/indexer.cu and cu/topk.cu, each row bit-identical to its decode
  launch);
- attention for every query row (cu/prefill_attn.cu `attn_prefill`: the query's window rows - the state's ring
  before the block, the block buffer inside it - plus its compressed rows and the sink), and only then the
  block's last window-ring rows into the ring (`prefill_ring_store`), so no query reads a slot a later row of
  the block overwrote;
- the head only for the rows asked for (`record_head_rows`).

The state ends as T single steps leave it: ring slots p % cap of the last cap positions, every compressed row
and indexer key g < n // ratio, the compressor rings' tail (kvstate.py's layout, docs/engine.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda import ops
from ds4py.cuda.decode import F32, I32, Launcher, carve_block, index_keys
from ds4py.cuda.memory import DeviceArray, align_up
from ds4py.cuda.model_weights import GEMV_TYPES, DevTensor
from ds4py.cuda.ops import compressor as ops_comp
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.ops import gemm as ops_gemm
from ds4py.cuda.ops import indexer as ops_idx
from ds4py.cuda.ops import moe_prefill as ops_moep
from ds4py.cuda.ops import prefill_attn as ops_pfa
from ds4py.cuda.ops import router as ops_route
from ds4py.cuda.ops import topk as ops_topk
from ds4py.cuda.ops.gemv import GEMV_MAX_X
from ds4py.cuda.ops.rmsnorm import rmsnorm
from ds4py.cuda.ops.mhc import mix_partial_floats, mix_record
from ds4py.cuda.rows import gemvs_rows, rows_of
from ds4py.cuda.twins.indexer import weight_scale

MAX_BLOCK = 2048          # tokens per prefill block
HEAD_ROWS = 16            # rows per head pass (all_logits runs the head in passes of this many rows)
U32 = np.dtype(np.uint32)


def block_rows(n: int) -> int:
    """The workspace row bucket of a block of n tokens: a power of two >= 32, at most MAX_BLOCK."""
    b = 32
    while b < n:
        b *= 2
    return min(b, MAX_BLOCK)


def prefill_shapes(cfg, bucket: int, T: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    hc, D, k = cfg.hc_mult, cfg.dim, cfg.n_experts_used
    comp_w = max([cfg.comp_width(il) for il in range(cfg.n_layers) if cfg.roles(il).compressor], default=2)
    idx_w = max([cfg.index_comp_width(il) for il in range(cfg.n_layers) if cfg.roles(il).indexer], default=2)
    ih, mrec = cfg.index_heads, mix_record(hc)
    n_keys = max(1, index_keys(cfg, bucket))
    return {
        "pos": ((T,), I32), "tokens": ((T,), I32), "tickets": ((T,), U32),
        "mix_partial": ((mix_partial_floats(T, mrec, D, hc),), F32),
        "X0": ((T, hc, D), F32), "X1": ((T, hc, D), F32),
        "mix_attn": ((T, mrec), F32), "mix_ffn": ((T, mrec), F32), "mix_head": ((HEAD_ROWS, mrec), F32),
        "x_attn": ((T, D), F32), "x_ffn": ((T, D), F32), "x_head": ((HEAD_ROWS, D), F32),
        "qa": ((T, cfg.q_lora_rank), F32), "q": ((T, cfg.q_dim), F32), "kv": ((T, cfg.head_dim), F32),
        "kvb": ((T, cfg.head_dim), F32), "ckv": ((T, comp_w), F32), "csc": ((T, comp_w), F32),
        "ikv": ((T, idx_w), F32), "isc": ((T, idx_w), F32),
        "iq_raw": ((T, ih * cfg.index_head_dim), F32), "iq": ((T, ih * cfg.index_head_dim), F32),
        "iw": ((T, ih), F32), "scores": ((T, n_keys), F32), "sel": ((T, max(1, cfg.index_topk)), I32),
        "o": ((T, cfg.q_dim), F32), "u": ((T, cfg.o_dim), F32),
        "router": ((T, cfg.n_experts), F32), "ids": ((T, k), I32), "wts": ((T, k), F32),
        "h_shared": ((T, cfg.shared_ff), F32), "y_shared": ((T, D), F32), "h": ((T * k, cfg.expert_ff), F32),
        "logits": ((HEAD_ROWS, cfg.vocab_size), F32),
        # the tensor-core path: normalised q_a rows, the sub-layer outputs before hc_post, the shared expert's gate
        # and up, the grouped MoE's scratch
        "qa_n": ((T, cfg.q_lora_rank), F32), "f": ((T, D), F32), "hs_g": ((T, cfg.shared_ff), F32),
        "hs_u": ((T, cfg.shared_ff), F32),
        **{f"xp{i}": ((T * max(D, cfg.q_lora_rank, cfg.q_dim, cfg.o_dim, cfg.shared_ff),), F32) for i in range(3)},
        **{f"moe.{n}": v for n, v in ops_moep.MoePrefillBuffers.shapes(T, k, cfg.n_experts, cfg.expert_ff, D).items()},
    }


@dataclass
class PrefillWorkspace:
    bucket: int                    # context bucket it serves (indexer score rows)
    rows: int                      # block rows it holds
    block: Any                     # the DeviceBlock holding every array
    a: dict[str, DeviceArray]

    def __getattr__(self, name: str) -> DeviceArray:
        try:
            return self.__dict__["a"][name]
        except KeyError:
            raise AttributeError(name) from None


def prefill_bytes(cfg, bucket: int, T: int) -> int:
    return sum(align_up(int(np.prod(s)) * dt.itemsize) for s, dt in prefill_shapes(cfg, bucket, T).values())


def make_prefill_workspace(store: Any, rt: Any, cfg, bucket: int, T: int) -> PrefillWorkspace:
    blk, arrays = carve_block(store, rt, prefill_shapes(cfg, bucket, T))
    return PrefillWorkspace(bucket, T, blk, arrays)


@dataclass
class PrefillContext:
    cfg: Any
    nx: Any
    w: Any
    ws: PrefillWorkspace
    parts: dict[str, DeviceArray]   # the state's arrays
    bucket: int                     # context bucket of the block's last position
    T: int                          # rows of this block
    mma: bool = True                # dense products on tensor cores (cu/gemm.cu), else the GEMVs
    x_pieces: int = 3               # ... with x as this many bf16 pieces (1: x rounded to bf16; 3: x exact)
    expert_mma: bool = False        # the experts on tensor cores too (cu/moe_prefill.cu: x and h rounded to bf16)
    final: DeviceArray | None = None    # the residual after the last layer (set by record_prefill)

    def moe_bufs(self) -> "ops_moep.MoePrefillBuffers":
        return ops_moep.MoePrefillBuffers(**{n: self.ws.a[f"moe.{n}"] for n in
                                             ops_moep.MoePrefillBuffers.shapes(1, 1, 1, 32, 32)})


# ---- the products (one function each: the tensor-core GEMM / grouped experts replace their bodies) -------------
def mma_ok(W: DevTensor) -> bool:
    return W.qtype in GEMV_TYPES            # the GEMM reads what the GEMVs read (Q8_0 / F16 / F32)


def dense(L: Launcher, c: PrefillContext, mats: list[tuple[DevTensor, DeviceArray, int]], x: DeviceArray, cols: int,
          T: int, norm=None, x_group_rows: int = 0, x_stride: int | None = None) -> None:
    """y_m[t] = W_m x[t] for the block's T rows (matrices sharing x; norm = (w, eps): x[t] RMS-normalised first)."""
    if not c.mma or not all(mma_ok(W) for W, _, _ in mats):
        gemvs_rows(L, mats, x, cols, T, L.main, norm=norm, x_group_rows=x_group_rows, x_stride=x_stride)
        return
    if norm is not None:
        xn = c.ws.qa_n.view(0, T * cols)
        rmsnorm(L, x.view(0, T * cols), norm[0], xn, cols, norm[1], **L.main())
        x = xn
    gemm(L, c, [(W, y, rows) for W, y, rows in mats], x, cols, T, x_group_rows, x_stride)


def gemm(L: Launcher, c: PrefillContext, mats: list, x: DeviceArray, cols: int, T: int, x_group_rows: int = 0,
         x_stride: int | None = None) -> None:
    """y = W x on tensor cores, x as c.x_pieces bf16 pieces accumulated (hi first): the weights are exact in the
    GEMM (Q8_0 codes and scale, F16 / F32 as bf16 pieces), so with three pieces the product sees x exactly and
    differs from the fp32 GEMV by the summation order only."""
    groups = -(-mats[0][2] // x_group_rows) if x_group_rows else 1
    ld = x_stride if x_stride is not None else cols * groups
    n = (T - 1) * ld + cols * groups
    if c.x_pieces <= 1:
        xs = [x]
    else:
        xs = [c.ws.a[f"xp{i}"].view(0, n) for i in range(min(3, c.x_pieces))]
        ops_pfa.split_bf16(L, x.view(0, n), xs, n, **L.main())
    for W, y, rows in mats:
        for i, xi in enumerate(xs):
            ops_gemm.gemm(L, W, xi, y, T, rows, cols, accumulate=i > 0, x_group_rows=x_group_rows, ldx=ld,
                          **L.main())


def dense_hc_post(L: Launcher, c: PrefillContext, W: DevTensor, u: DeviceArray, X: DeviceArray, mix: DeviceArray,
                  D: int, cols: int, hc: int, T: int) -> None:
    """X[t] <- post_k (W u[t]) + sum_j C[j,k] X[t, j]: the output projection into the residual."""
    if c.mma and mma_ok(W):
        f = c.ws.f
        gemm(L, c, [(W, f, D)], u, cols, T)
        ops.hc_post(L, f, mix, X, T, D, hc, **L.main())
        return
    mrec = mix_record(hc)
    for n0 in range(0, T, GEMV_MAX_X):
        k = min(GEMV_MAX_X, T - n0)
        ops.gemv_hc_post(L, W.array, rows_of(u, n0, k, cols), rows_of(X, n0, k, hc * D), rows_of(mix, n0, k, mrec),
                         D, cols, hc=hc, nx=k, **L.main())


def shared_expert(L: Launcher, c: PrefillContext, S, x: DeviceArray, h: DeviceArray, y: DeviceArray, D: int,
                  sff: int, clamp: float, T: int) -> None:
    """y[t] = down(silu(min(gate x[t], c)) * clamp(up x[t], c)) for the block's rows."""
    if c.mma and mma_ok(S.gate) and mma_ok(S.up):
        gemm(L, c, [(S.gate, c.ws.hs_g, sff), (S.up, c.ws.hs_u, sff)], x, D, T)
        ops_pfa.swiglu(L, c.ws.hs_g, c.ws.hs_u, h, T * sff, clamp, **L.main())
    elif S.gate.qtype in GEMV_TYPES:
        for n0 in range(0, T, GEMV_MAX_X):
            k = min(GEMV_MAX_X, T - n0)
            ops.gemv_swiglu(L, S.gate.array, S.up.array, rows_of(x, n0, k, D), rows_of(h, n0, k, sff), sff, D,
                            clamp=clamp, nx=k, **L.main())
    else:
        step = ops_moe.MAX_PAIRS
        for n0 in range(0, T, step):
            k = min(step, T - n0)
            ops_moe.moe_gate_up_rows(L, S.gate.qtype, S.gate.array, S.up.array, rows_of(x, n0, k, D), None, None,
                                     rows_of(h, n0, k, sff), 1, sff, D, 1, k, clamp, **L.main())
    if S.down.qtype in GEMV_TYPES:
        dense(L, c, [(S.down, y, D)], h, sff, T)
    else:
        ops_moe.moe_down_rows(L, S.down.qtype, S.down.array, None, h, y, 1, D, sff, 1, T, **L.main())


def routed_experts(L: Launcher, c: PrefillContext, E, x: DeviceArray, ids: DeviceArray, wts: DeviceArray,
                   add: DeviceArray, mix: DeviceArray, X: DeviceArray, X_out: DeviceArray, NX: int, ff: int, D: int,
                   k: int, hc: int, clamp: float, T: int) -> DeviceArray:
    """The routed experts of the block plus `add` (the shared expert), through the mHC post: returns the buffer
    holding the new residual (X itself, in place, on the tensor-core path; X_out otherwise)."""
    if c.expert_mma:
        ops_moep.moe_prefill(L, (E.gate.qtype, E.gate.array), (E.up.qtype, E.up.array),
                             (E.down.qtype, E.down.array), x, ids, wts, c.ws.f, T, k, NX, ff, D, clamp, c.moe_bufs(),
                             add=add, **L.main())
        ops.hc_post(L, c.ws.f, mix, X, T, D, hc, **L.main())
        return X
    step = max(1, ops_moe.MAX_PAIRS // k)
    for n0 in range(0, T, step):
        n = min(step, T - n0)
        ops_moe.moe_gate_up_rows(L, E.gate.qtype, E.gate.array, E.up.array, rows_of(x, n0, n, D),
                                 ids.view(4 * n0 * k, n * k), wts.view(4 * n0 * k, n * k),
                                 c.ws.h.view(4 * n0 * k * ff, n * k * ff), NX, ff, D, k, n, clamp, **L.main())
    ops_moe.moe_down_rows(L, E.down.qtype, E.down.array, ids, c.ws.h, X_out, NX, D, ff, k, T, add=add, mix=mix, hc=hc,
                          hc_x=X, **L.main())
    return X_out


# ---- the recorded block ----------------------------------------------------------------------------------------
def record_prefill(L: Launcher, c: PrefillContext) -> None:
    """Embedding and every layer over the block's rows; the residual ends in final_residual(c)."""
    cfg, B, ws, T = c.cfg, c.w.binding, c.ws, c.T
    ops.embed(L, B.embed.array, ws.tokens.view(0, T), ws.X0, T, copies=cfg.hc_mult, **L.main())
    X, other = ws.X0, ws.X1
    for il, lw in enumerate(B.layers):
        ro = cfg.roles(il)
        _attention(L, c, il, ro, lw, X)
        Y = _moe(L, c, il, ro, lw, X, other)
        if Y is not X:
            X, other = Y, X
    c.final = X


def final_residual(c: PrefillContext) -> DeviceArray:
    return c.final


def _hc_pre(L: Launcher, c: PrefillContext, hw, norm: DevTensor, X: DeviceArray, mix: DeviceArray,
            x: DeviceArray) -> None:
    cfg, T = c.cfg, c.T
    ops.hc_mix(L, hw.fn.array, X, T, cfg.dim, hw.scale.array, hw.base.array, c.ws.mix_partial, c.ws.tickets, mix,
               cfg.norm_eps, cfg.hc_eps, cfg.sinkhorn_iters, cfg.hc_mult, **L.main())
    ops.hc_collapse_norm(L, X, mix, T, cfg.dim, norm.array, cfg.norm_eps, x, cfg.hc_mult, **L.main())


def _attention(L: Launcher, c: PrefillContext, il: int, ro, lw, X: DeviceArray) -> None:
    cfg, nx, ws, A, T = c.cfg, c.nx, c.ws, lw.attn, c.T
    D, hd, rd, eps = cfg.dim, cfg.head_dim, cfg.rope_dim, cfg.norm_eps
    fq, f16 = nx.fake_quant, nx.kv_dtype == "f16"
    freqs = c.w.freqs[il]
    part = lambda name: c.parts[f"{il}.{name}"]   # noqa: E731
    pos = ws.pos.view(0, T)
    _hc_pre(L, c, lw.hc_attn, lw.attn_norm, X, ws.mix_attn, ws.x_attn)

    # the KV branch: the block's kv rows, the compressors' inputs and every group the block completes
    w2 = cfg.comp_width(il) if ro.compressor else 0
    wi = cfg.index_comp_width(il) if ro.indexer else 0
    mats = [(A.kv, ws.kv, hd)]
    if ro.compressor:
        mats += [(A.comp.kv, ws.ckv, w2), (A.comp.gate, ws.csc, w2)]
    if ro.indexer:
        mats += [(A.index.comp.kv, ws.ikv, wi), (A.index.comp.gate, ws.isc, wi), (A.index.proj, ws.iw, cfg.index_heads)]
    dense(L, c, mats, ws.x_attn, D, T)
    ops_pfa.kv_rows(L, ws.kv, A.kv_norm.array, freqs, pos, ws.kvb, T, hd, rd, eps, fq, f16, **L.main())
    if ro.compressor:
        ops_comp.compressor_prefill(L, ws.ckv.view(0, T * w2), ws.csc.view(0, T * w2), T, A.comp.ape.array,
                                    A.comp.norm.array, freqs, pos, part("comp_kv"), part("comp_score"),
                                    part("comp_rows"), ro.ratio, bool(ro.overlap), hd, rd, eps, False, fq, f16,
                                    **L.main())
    if ro.indexer:
        ihd = cfg.index_head_dim
        ops_comp.compressor_prefill(L, ws.ikv.view(0, T * wi), ws.isc.view(0, T * wi), T, A.index.comp.ape.array,
                                    A.index.comp.norm.array, freqs, pos, part("idx_kv"), part("idx_score"),
                                    part("idx_keys"), ro.index_ratio, bool(ro.index_overlap), ihd, rd, eps, True, fq,
                                    f16, **L.main())

    # the queries
    dense(L, c, [(A.q_a, ws.qa, cfg.q_lora_rank)], ws.x_attn, D, T)
    mats = [(A.q_b, ws.q, cfg.q_dim)]
    if ro.indexer:
        mats.append((A.index.q_b, ws.iq_raw, cfg.index_q_dim))
    dense(L, c, mats, ws.qa, cfg.q_lora_rank, T, norm=(A.q_a_norm.array, eps))

    comp = sel = None
    if ro.compressed:
        comp = c.parts[f"{ro.kv_source}.comp_rows"]
    if ro.indexer:
        ih, ihd = cfg.index_heads, cfg.index_head_dim
        n_keys = c.bucket // ro.index_ratio
        stride = int(ws.scores.shape[1])
        ops_idx.indexer_q_prep_rows(L, ws.iq_raw, freqs, pos, ws.iq, ih, ihd, rd, T, fq, **L.main())
        ops_idx.indexer_scores_rows(L, ws.iq, ws.iw, weight_scale(ihd, ih), part("idx_keys"), pos, ws.scores, stride,
                                    ih, ihd, n_keys, T, ro.index_ratio, **L.main())
        ops_topk.topk_rows(L, ws.scores, stride, cfg.index_topk, ws.sel, pos, T, ro.index_ratio, **L.main())
        sel = ws.sel
    ops_pfa.prefill_attention(L, ws.q, freqs, pos, part("win"), ws.kvb, cfg.window, comp, ro.ratio, sel,
                              cfg.index_topk, A.sinks.array, ws.o, T, cfg.n_heads, rd, eps, hd ** -0.5, **L.main())
    ops_pfa.ring_store(L, ws.kvb, T, pos, part("win"), **L.main())
    dense(L, c, [(A.out_a, ws.u, cfg.o_dim)], ws.o, cfg.o_group_in, T, x_group_rows=cfg.o_lora_rank,
          x_stride=cfg.q_dim)
    dense_hc_post(L, c, A.out_b, ws.u, X, ws.mix_attn, D, cfg.o_dim, cfg.hc_mult, T)


def _moe(L: Launcher, c: PrefillContext, il: int, ro, lw, X: DeviceArray, X_out: DeviceArray) -> DeviceArray:
    cfg, ws, Fw, T = c.cfg, c.ws, lw.ffn, c.T
    D, hc, clamp = cfg.dim, cfg.hc_mult, cfg.swiglu_clamp[il]
    _hc_pre(L, c, lw.hc_ffn, lw.ffn_norm, X, ws.mix_ffn, ws.x_ffn)
    shared_expert(L, c, Fw.shared, ws.x_ffn, ws.h_shared, ws.y_shared, D, cfg.shared_ff, clamp, T)
    E, k, NX, ff = Fw.experts, cfg.n_experts_used, cfg.n_experts, cfg.expert_ff
    dense(L, c, [(Fw.gate_inp, ws.router, NX)], ws.x_ffn, D, T)
    ops_route.moe_route_rows(L, ws.router, None if ro.hash_routing else Fw.route_bias.array,
                             Fw.tid2eid.array if ro.hash_routing else None, ws.tokens.view(0, T), ws.ids, ws.wts, NX,
                             k, T, cfg.route_scale, cfg.route_norm, **L.main())
    return routed_experts(L, c, E, ws.x_ffn, ws.ids, ws.wts, ws.y_shared, ws.mix_ffn, X, X_out, NX, ff, D, k, hc,
                          clamp, T)


def record_head_rows(L: Launcher, c: PrefillContext, r0: int, n: int) -> None:
    """logits[:n] = head(RMSNorm(hc_head(X[r0 .. r0+n)))) of the block's final residual (n <= HEAD_ROWS)."""
    cfg, B, ws = c.cfg, c.w.binding, c.ws
    hc, D = cfg.hc_mult, cfg.dim
    Xf = final_residual(c).view(4 * r0 * hc * D, (n, hc, D))
    H = B.hc_head
    ops.hc_mix(L, H.fn.array, Xf, n, D, H.scale.array, H.base.array, ws.mix_partial, ws.tickets, ws.mix_head,
               cfg.norm_eps, cfg.hc_eps, cfg.sinkhorn_iters, hc, **L.main())
    ops.hc_collapse_norm(L, Xf, ws.mix_head, n, D, B.output_norm.array, cfg.norm_eps, ws.x_head, hc, **L.main())
    dense(L, c, [(B.head, ws.logits, cfg.vocab_size)], ws.x_head, D, n)


__all__ = ["HEAD_ROWS", "MAX_BLOCK", "PrefillContext", "PrefillWorkspace", "block_rows", "dense", "dense_hc_post",
           "final_residual", "gemm", "make_prefill_workspace", "prefill_bytes", "prefill_shapes", "record_head_rows",
           "record_prefill", "routed_experts", "shared_expert"]
