"""One forward step of V4 Flash over a batch of sequences (MODEL.md §2).

A step advances several sequences, each by its own chunk of tokens at positions n..n+T-1 of its state (a
prompt, a chunk of one for decode, k+1 rows to verify). What is per row - the embedding, norms,
hyper-connections, every projection, routing and the experts - runs over the rows of all sequences
(each weight, and each routed expert, is fetched and dequantised once per step). What reads a
sequence's past - the window, the compressors, the indexer, attention - runs per sequence against its own
state. Prefill, chunked prefill and decode are the same code. A batch equals separate calls bit for bit:
every product over rows runs once per sequence's rows (ops.mm, `seg` below; row by row in a row-stable
step: the explicit `row_stable` argument, ops.row_groups), so a sequence's results never depend on the others in
its step (docs/engine.md, "Batch invariance").

Weights come from the typed binding (ds4py.schema: `L.attn.comp.kv`), each layer's roles from the config's
predicates (`cfg.roles(l)`), the numerics from one explicit `Numerics` value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np

from ds4py.config import LayerRoles
from ds4py.contract import Numerics
from ds4py.ref import blas, ops, v41
from ds4py.ref.state import RefState
from ds4py.schema import AttentionWeights, CompressorWeights, FfnWeights, LayerWeights, ModelWeights

F32 = np.float32
QUERY_BLOCK = 256        # queries per attention block: bounds the [T, H, keys] score memory on long prompts
PREFILL_TILE = 32        # queries per attention tile of a longer chunk: a tile's keys are its window band (tile +
                         # W - 1 rows, 1.25x the W its queries need, where a 256-query block scores 3x) and the
                         # compressed rows visible to its last query; the tiles go over the kernels' threads
GATHER_BUDGET = 1 << 22  # floats of gathered compressed rows per attention block ([block, top-k, head_dim])
DENSE_ROWS = 128         # up to this many compressed rows one masked matmul over all of them is as fast as
                         # gathering each query's top-k (measured crossover 64-256 rows, 16 heads x 512)


@dataclass
class Seq:
    """One sequence of a step: its state, its rows in the step's arrays and their positions; what its layers hand
    down within the step (V4.1: each index source's selection, the candidate blocks, the last key publisher)."""
    state: RefState
    rows: slice
    pos: np.ndarray
    topk: dict = field(default_factory=dict)       # index source layer -> [T, Nc] selected compressed rows
    candidates: np.ndarray | None = None           # [T, Nc] rows inside the candidate blocks
    key_pub: int = -1                              # v41.KeyPublishers (the official decode bug, reproduced)


@dataclass
class V41Step:
    """What a V4.1 step needs besides the weights (None for V4): the Engram hash ids and table rows, and the
    switch that reproduces the official decode's index-key bug."""
    ngram: "v41.NgramIds | None" = None
    tables: object = None                          # ds4py.engram.EngramTables
    publishers: "v41.KeyPublishers | None" = None


class Trace:
    """Optional recorder of intermediates for a one-sequence step (golden checks). Lists are indexed by layer."""

    def __init__(self, n_layers: int):
        self.hc = []                                         # [T, hc, D] after embedding, then after each layer
        self.attn_in = [None] * n_layers                     # [T, D] attention input (after attn_norm)
        self.ffn_in = [None] * n_layers                      # [T, D] FFN input (after ffn_norm)
        self.experts = [None] * n_layers                     # [T, k] routed expert ids
        self.expert_weights = [None] * n_layers              # [T, k]
        self.indexer_selected = [None] * n_layers            # [T, Nc] bool: compressed rows chosen by top-k
        self.indexer_scores = [None] * n_layers              # [T, Nc] float (invisible rows −inf)
        self.ffn_post = [None] * n_layers                    # [T, hc] the FFN's hc_post weights
        # the sidecar solvers' capture (ds4py/vq/capture.py): called at the end of every MoE as
        # moe_hook(layer, x, idx, wts, parts [T, k, D] = each routed expert's weighted output, shared, y);
        # y = shared + the parts, summed in the forward's order. It may raise to stop the step there.
        self.moe_hook = None
        self.premix = [None] * n_layers                      # [T, hc] V4.1: the pre-mix each block hands on
        self.engram_out = [None] * n_layers                  # [T, hc, D] V4.1: the state after Engram (block input)
        self.engram_ids = None                               # [T, n_engram_layers, cols] V4.1 hash ids


def kv_store(x: np.ndarray, nx: Numerics) -> np.ndarray:
    """KV rows as the state stores them (ds4 keeps F16)."""
    return ops.f16_round(x) if nx.kv_dtype == "f16" else x


# ---- compressors (MODEL.md §2.3) -----------------------------------------------------------------------------
def compressor_inputs(w, C: CompressorWeights, x: np.ndarray, pos: np.ndarray, ratio: int,
                      seg: list[slice], done: dict | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Per row: kv = wkv x and the gate score s = wgate x + ape[pos mod ratio] (all sequences at once); V4.1 has
    no ape, and a ratio-1 compressor no gate (score None). done: the products of x made already (x_products)."""
    lin = (lambda t: done[id(t)]) if done is not None else (lambda t: w.linear(t, x, seg))
    if C.gate is None:
        return lin(C.kv), None
    if C.ape is None:
        return lin(C.kv), lin(C.gate)
    return lin(C.kv), lin(C.gate) + w.get(C.ape)[pos % ratio]


def x_products(w, tensors: list, x: np.ndarray, seg: list[slice] | None) -> dict:
    """{id(t): x @ t.T} for matrices that read one x, in one kernel call where they can (Weights.linear_many)."""
    return dict(zip(map(id, tensors), w.linear_many(tensors, x, seg)))


def _comp_tensors(C: CompressorWeights | None) -> list:
    return [] if C is None else [C.kv] + ([] if C.gate is None else [C.gate])


def pool_groups(w, cfg, C: CompressorWeights, kv: np.ndarray, score: np.ndarray | None, pos: np.ndarray,
                ring_kv: np.ndarray | None, ring_score: np.ndarray | None, ratio: int,
                overlap: int) -> tuple[int, int, np.ndarray | None]:
    """One sequence's chunk through a compressor's pooling: (g0, g1, the RMS-normalised rows of the groups
    [g0, g1) it completes, or None), keeping its inputs in the rings. Group g = positions [g·r, (g+1)·r)
    completes at (g+1)·r − 1 and pools them, plus group g−1's through the first half of the channels when the
    compressor overlaps (group −1: kv 0, score −inf). Without a gate (ratio 1) a row is its position's kv."""
    p0, p1 = int(pos[0]), int(pos[-1]) + 1
    g0, g1 = p0 // ratio, p1 // ratio                     # groups completed by this chunk: [g0, g1)
    rows = None
    if g1 > g0 and score is None:
        rows = ops.rmsnorm(kv, w.get(C.norm), cfg.norm_eps)
    elif g1 > g0:
        cap = ring_kv.shape[0]
        start = max(0, g0 - overlap) * ratio              # the first position those groups read
        old = np.arange(start, p0)                        # ... held in the rings
        all_kv = np.concatenate([ring_kv[old % cap], kv])
        all_sc = np.concatenate([ring_score[old % cap], score])
        a, b = g0 * ratio - start, g1 * ratio - start
        prev = (all_kv[a - ratio:a], all_sc[a - ratio:a]) if overlap and g0 > 0 else (None, None)
        rows = ops.compress_pool(all_kv[a:b], all_sc[a:b], ratio, bool(overlap), *prev)
        rows = ops.rmsnorm(rows, w.get(C.norm), cfg.norm_eps)
    if ring_kv is not None:
        cap = ring_kv.shape[0]
        keep = pos[-min(len(pos), cap):]                  # a chunk longer than the ring keeps its tail
        ring_kv[keep % cap] = kv[-len(keep):]
        ring_score[keep % cap] = score[-len(keep):]
    return g0, g1, rows


def compress(w, cfg, nx: Numerics, C: CompressorWeights, kv: np.ndarray, score: np.ndarray, pos: np.ndarray,
             ring_kv: np.ndarray, ring_score: np.ndarray, out: np.ndarray, ratio: int, overlap: int,
             freqs: np.ndarray, rotate: bool, row_stable: bool = False) -> None:
    """A V4 compressor: pool every group the chunk completes (pool_groups) into out[g]. Rows: RMSNorm, RoPE at
    g·r, then Hadamard + FP4 (indexer keys) or FP8 on the non-rope dims."""
    g0, g1, rows = pool_groups(w, cfg, C, kv, score, pos, ring_kv, ring_score, ratio, overlap)
    if rows is not None:
        rows = ops.rope_tail(rows, np.arange(g0, g1) * ratio, freqs)
        if rotate:
            rows = ops.hadamard(rows, ops.row_groups(None, len(rows), row_stable))
            if nx.fake_quant:
                rows = ops.fp4_fake_quant(rows, 32)
        elif nx.fake_quant:
            rows[:, :cfg.nope_dim] = ops.fp8_fake_quant(rows[:, :cfg.nope_dim], 64)
        out[g0:g1] = kv_store(rows, nx)


def indexer_scores(q: np.ndarray, wts: np.ndarray, pos: np.ndarray, keys: np.ndarray, ratio: int) -> np.ndarray:
    """score[t, g] = Σ_h w_h · relu(qI_h · K_I[g]); rows invisible to t are −inf. -> [T, Nc]"""
    s = np.empty((len(pos), keys.shape[0]), F32)
    for a in range(0, len(pos), QUERY_BLOCK):              # bounds the [T, IH, Nc] temporary
        b = a + QUERY_BLOCK
        s[a:b] = (np.maximum(q[a:b] @ keys.T, 0) * wts[a:b, :, None]).sum(1)
    visible = np.arange(keys.shape[0])[None, :] < ((pos + 1) // ratio)[:, None]
    return np.where(visible, s, F32(-np.inf))


def index_scores(q: np.ndarray, wts: np.ndarray, pos: np.ndarray, keys: np.ndarray, ratio: int,
                 row_stable: bool = False) -> np.ndarray:
    """indexer_scores for one sequence's queries. Row-stable: each query scores exactly the keys its own decode
    step has (its visible ones; the rest stay −inf), so the matmul has a decode step's shape."""
    if len(pos) == 1 or not row_stable:
        return indexer_scores(q, wts, pos, keys, ratio)
    scores = np.full((len(pos), keys.shape[0]), -np.inf, F32)
    for t in range(len(pos)):
        n = (int(pos[t]) + 1) // ratio
        scores[t, :n] = indexer_scores(q[t:t + 1], wts[t:t + 1], pos[t:t + 1], keys[:n], ratio)[0]
    return scores


def index_topk(scores: np.ndarray, pos: np.ndarray, ratio: int, k: int, row_stable: bool = False) -> np.ndarray:
    """topk_mask of the indexer scores; row-stable: each row over its visible keys only, as its decode step."""
    if len(pos) == 1 or not row_stable:
        return topk_mask(scores, k)
    sel = np.zeros(scores.shape, bool)
    for t in range(len(pos)):
        n = (int(pos[t]) + 1) // ratio
        sel[t, :n] = topk_mask(scores[t:t + 1, :n], k)[0]
    return sel


def topk_rows(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best finite entries of each row as (column indices [T, k'], valid [T, k']), k' = min(k, Nc): the
    rows a query attends besides its window. A row with fewer than k finite entries has invalid picks."""
    if scores.shape[1] <= k:
        return np.broadcast_to(np.arange(scores.shape[1]), scores.shape), np.isfinite(scores)
    idx = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    return idx, np.isfinite(np.take_along_axis(scores, idx, 1))


def index_picks(scores: np.ndarray, pos: np.ndarray, ratio: int, k: int, dense_rows: int, row_stable: bool = False):
    """topk_rows of the indexer scores as (indices, valid, use). Row-stable: each row picks over
    its visible keys only and takes the path its own decode step takes: picks when it sees more than dense_rows
    rows (use[t]), else the masked path (use[t] False; use is None when every row picks)."""
    if len(pos) == 1 or not row_stable:
        return (*topk_rows(scores, k), None)
    n = (pos.astype(np.int64) + 1) // ratio
    use = n > dense_rows
    idx, valid = np.zeros((len(pos), k), np.int64), np.zeros((len(pos), k), bool)
    for t in np.flatnonzero(use):
        i, v = topk_rows(scores[t:t + 1, :n[t]], k)
        idx[t], valid[t] = i[0], v[0]
    return idx, valid, None if use.all() else use


def topk_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """True for the k best finite entries of each row (all finite entries when there are at most k)."""
    idx, valid = topk_rows(scores, k)
    sel = np.zeros(scores.shape, bool)
    np.put_along_axis(sel, idx, valid, axis=1)
    return sel


# ---- attention ----------------------------------------------------------------------------------------------
def window(ring: np.ndarray, kv: np.ndarray, pos: np.ndarray, W: int) -> tuple[np.ndarray, np.ndarray]:
    """The raw rows a chunk's queries may see: the state's for [p0−W+1, p0), then the chunk's own (with their
    positions); the chunk's rows go into the ring."""
    cap, p0 = ring.shape[0], int(pos[0])
    old = np.arange(max(0, p0 - W + 1), p0)
    keys, kpos = np.concatenate([ring[old % cap], kv]), np.concatenate([old, pos])
    tail = pos[-min(len(pos), cap):]
    ring[tail % cap] = kv[-len(tail):]
    return keys, kpos


def attend(q: np.ndarray, win: np.ndarray, win_pos: np.ndarray, comp: np.ndarray | None, sel: np.ndarray | None,
           pos: np.ndarray, sink: np.ndarray, W: int, ratio: int = 0,
           picks: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None,
           row_stable: bool = False, each: Callable[[Callable[[int], None], int], None] | None = None) -> np.ndarray:
    """Attention with sink for one sequence, in query blocks (K = V). A query's keys are its window rows plus
    compressed rows: either every row `sel` marks (a [T, Nc] mask: the ratio-128 layers, which see all their
    visible rows, and indexer layers whose top-k still takes every row), or the indexer's top-k `picks`
    ((indices, valid), [T, k] each, and use: the rows that take them, None = all), gathered per query. With picks
    a query costs O(W + k) whatever the context length, so a long prefill is linear in its length instead of
    scoring every compressed row. Row-stable: one query per block, with exactly the keys its own
    decode step has (the window up to it, the compressed rows visible to it). A chunk longer than QUERY_BLOCK
    goes in tiles of PREFILL_TILE queries, each with the compressed rows visible to its last query (the rest are
    masked anyway), the tiles spread by each(fn, n) (Weights.each) when given."""
    T, hd = q.shape[0], q.shape[-1]
    block = 1 if row_stable else QUERY_BLOCK if T <= QUERY_BLOCK else PREFILL_TILE
    o = np.empty(q.shape, F32)
    if picks is not None and block > 1:            # bound the gathered [block, k, hd] rows
        block = max(1, min(block, GATHER_BUDGET // max(1, picks[0].shape[1] * hd)))

    def tile(i: int) -> None:
        a = i * block
        b = min(a + block, T)
        lo = max(0, int(pos[a]) - W + 1 - int(win_pos[0]))
        hi = int(pos[b - 1]) - int(win_pos[0]) + 1
        kp = win_pos[lo:hi]
        mask = (kp[None, :] <= pos[a:b, None]) & (kp[None, :] > pos[a:b, None] - W)
        keys = win[lo:hi]
        if picks is not None and (picks[2] is None or picks[2][a]):
            o[a:b] = attention_with_picks(q[a:b], keys, mask, comp, picks[0][a:b], picks[1][a:b], sink, hd ** -0.5)
            return
        n_comp = 0 if comp is None else comp.shape[0] if T <= QUERY_BLOCK and block > 1 else min(
            comp.shape[0], (int(pos[b - 1]) + 1) // ratio)
        if n_comp:
            keys = np.concatenate([keys, comp[:n_comp]])
            mask = np.concatenate([mask, sel[a:b, :n_comp]], 1)
        o[a:b] = ops.attention_with_sink(q[a:b], keys, mask, sink, hd ** -0.5)

    n = -(-T // block)
    if each is None or block == 1:
        for i in range(n):
            tile(i)
    else:
        each(tile, n)
    return o


def attention_with_picks(q: np.ndarray, win: np.ndarray, win_mask: np.ndarray, comp: np.ndarray, idx: np.ndarray,
                         valid: np.ndarray, sink: np.ndarray, scale: float) -> np.ndarray:
    """ops.attention_with_sink over the union of a band of window rows (win [Nw, hd], win_mask [B, Nw]) and
    each query's own compressed rows comp[idx[t]] (valid [B, k]): one softmax with the sink, the same sums,
    split into the two key sets. q: [B, H, hd] -> [B, H, hd]."""
    ninf = F32(-np.inf)
    rows = comp[idx]                                                   # [B, k, hd]
    s_w = np.where(win_mask[:, None, :], (q @ win.T) * F32(scale), ninf)            # [B, H, Nw]
    s_c = np.where(valid[:, None, :], (q @ rows.transpose(0, 2, 1)) * F32(scale), ninf)   # [B, H, k]
    m = np.maximum(s_w.max(-1), s_c.max(-1))           # every query sees at least its own window row
    p_w, p_c = np.exp(s_w - m[..., None]), np.exp(s_c - m[..., None])
    denom = p_w.sum(-1) + p_c.sum(-1) + np.exp(sink[None, :] - m)
    return (p_w @ win + p_c @ rows) / denom[..., None]


def attention(w, cfg, nx: Numerics, ro: LayerRoles, A: AttentionWeights, x: np.ndarray, pos: np.ndarray,
              seqs: list[Seq], trace: Trace | None, publishers: "v41.KeyPublishers | None" = None,
              row_stable: bool = False) -> np.ndarray:
    il, T, H, hd, W = ro.layer, x.shape[0], cfg.n_heads, cfg.head_dim, cfg.window
    freqs = ops.layer_rope_freqs(cfg, il)
    seg = ops.row_groups([s.rows for s in seqs], T, row_stable)

    # every product of x first: one kernel call in a decode step (x_products)
    xt = [A.q_a, A.kv] + (_comp_tensors(A.comp) if ro.compressor else [])
    if ro.indexer:
        xt += [A.index.proj] + _comp_tensors(A.index.comp)
    done = x_products(w, xt, x, seg)

    # query: low rank + q_norm, per-head RMS (no weight; V4 only), RoPE on the last rd dims
    qr = ops.rmsnorm(done[id(A.q_a)], w.get(A.q_a_norm), cfg.norm_eps)
    if ro.indexer:                      # both products of qr in one call
        q, iqb = w.linear_many([A.q_b, A.index.q_b], qr, seg)
    else:
        q = w.linear(A.q_b, qr, seg)
    q = q.reshape(T, H, hd)
    if cfg.q_head_norm:
        q = ops.rmsnorm(q, None, cfg.norm_eps)
    q = ops.rope_tail(q, pos, freqs)

    # the one shared K=V row per token; FP8 fake-quant (V4: the non-rope dims in blocks of 64, V4.1 all in 32)
    kv = ops.rmsnorm(done[id(A.kv)], w.get(A.kv_norm), cfg.norm_eps)
    kv = ops.rope_tail(kv, pos, freqs)
    if nx.fake_quant:
        d, block = cfg.kv_fp8
        kv[:, :d] = ops.fp8_fake_quant(kv[:, :d], block)
    kv = kv_store(kv, nx)

    # the compressors' and the indexer's per-row inputs, for every sequence at once
    if ro.compressor:
        ckv, csc = compressor_inputs(w, A.comp, x, pos, ro.ratio, seg, done)
    if ro.indexer:
        ih, ihd = cfg.index_heads, cfg.index_head_dim
        # (a [T, ih, ihd] @ [ihd, ihd] product is one BLAS call per row already: numpy loops over the stack)
        iq = ops.rope_tail(iqb.reshape(T, ih, ihd), pos, freqs)
        if cfg.index_hadamard:
            iq = ops.hadamard(iq, ops.row_groups(None, T, row_stable))
        if nx.fake_quant:
            iq = ops.fp4_fake_quant(iq, 32)
        iw = done[id(A.index.proj)] * F32(ihd ** -0.5 * ih ** -0.5)
        if A.index.comp is not None:
            ikv, isc = compressor_inputs(w, A.index.comp, x, pos, ro.index_ratio, seg, done)

    # per sequence: window, compressed rows, indexer selection, attention with sink
    sink = w.get(A.sinks)
    o = np.empty((T, H, hd), F32)
    for s in seqs:
        r, p, st = s.rows, s.pos, s.state
        win, win_pos = window(st.ring(il, "win"), kv[r], p, W)
        comp = sel = picks = None
        if ro.compressed:
            n_rows = (int(p[-1]) + 1) // ro.ratio
            emitted = False
            if ro.compressor and cfg.is_v41:         # V4.1's math: ratio 1 / 2 pooling, keys from the latent, NVFP4
                rings = (st.ring(il, "comp_kv"), st.ring(il, "comp_score")) if ro.gated else (None, None)
                g0, g1, lat = pool_groups(w, cfg, A.comp, ckv[r], None if csc is None else csc[r], p, *rings,
                                          ro.ratio, 0)
                if lat is not None:
                    v41.finish_rows(w, cfg, nx, A, ro, st, lat, g0, g1, freqs, row_stable)
                emitted = lat is not None
            elif ro.compressor:
                compress(w, cfg, nx, A.comp, ckv[r], csc[r], p, st.ring(il, "comp_kv"), st.ring(il, "comp_score"),
                         st.rows(il, "comp_rows", n_rows), ro.ratio, ro.overlap, freqs, False, row_stable)
            comp = st.rows(ro.kv_source, "comp_rows", n_rows)[:n_rows]
            sel = np.arange(n_rows)[None, :] < ((p + 1) // ro.ratio)[:, None]
            if ro.indexer:
                n_keys = (int(p[-1]) + 1) // ro.index_ratio
                if A.index.comp is not None:         # V4: the indexer's own compressor makes its keys
                    compress(w, cfg, nx, A.index.comp, ikv[r], isc[r], p, st.ring(il, "idx_kv"),
                             st.ring(il, "idx_score"), st.rows(il, "idx_keys", n_keys), ro.index_ratio,
                             ro.index_overlap, freqs, True, row_stable)
                keys_layer = ro.index_keys if publishers is None else publishers.keys_layer(s, ro, emitted)
                keys = st.rows(keys_layer, "idx_keys", n_keys)[:n_keys]
                scores = index_scores(iq[r], iw[r], p, keys, ro.index_ratio, row_stable)
                if ro.candidate_source:
                    s.candidates = v41.candidate_blocks(scores, p, ro.index_ratio, cfg.candidate_topk_blocks,
                                                        cfg.candidate_block_size)
                elif ro.uses_candidates:
                    scores = np.where(s.candidates, scores, F32(-np.inf))
                dense_rows = max(cfg.index_topk, DENSE_ROWS)
                if not ro.shares_topk and scores.shape[1] > dense_rows:   # V4: attend to each query's picks only
                    picks = index_picks(scores, p, ro.index_ratio, cfg.index_topk, dense_rows, row_stable)
                    sel = None if picks[2] is None else index_topk(scores, p, ro.index_ratio, cfg.index_topk,
                                                                   row_stable)
                else:   # few rows (or top-k takes them all), or V4.1 whose later layers reuse the [T, N] mask
                    sel = index_topk(scores, p, ro.index_ratio, cfg.index_topk, row_stable)
                    s.topk[il] = sel
                if trace is not None:
                    trace.indexer_selected[il] = sel if sel is not None else topk_mask(scores, cfg.index_topk)
                    trace.indexer_scores[il] = scores
            elif ro.index_source >= 0:               # V4.1: the latest index source's selection
                sel = s.topk[ro.index_source]
        o[r] = attend(q[r], win, win_pos, comp, sel, p, sink, W, ro.ratio, picks, row_stable, w.each)

    # inverse RoPE on the output's rope dims, then the grouped low-rank output projection
    o = ops.rope_tail(o, pos, freqs, inverse=True)
    u = w.grouped_linear(A.out_a, o.reshape(T, cfg.o_groups, -1), seg)            # u_g = wo_a[g] @ o_g
    return w.linear(A.out_b, u.reshape(T, -1), seg)


# ---- MoE ----------------------------------------------------------------------------------------------------
def route(w, cfg, ro: LayerRoles, Fw: FfnWeights, x: np.ndarray, ids: np.ndarray,
          seg: list[slice], logits: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids [T, k] and weights [T, k]: hash table on the hash layers, biased top-k after (logits: the
    router's product of x, when made already)."""
    if logits is None:
        logits = w.linear(Fw.gate_inp, x, seg)
    if cfg.gate_temp != 1.0:                                       # V4.1's gate temperature
        logits = logits / F32(cfg.gate_temp)
    s = ops.sqrt_softplus(logits)
    if ro.hash_routing:
        idx = w.get(Fw.tid2eid)[ids]
    else:
        biased = s + w.get(Fw.route_bias)                          # the bias picks experts, never weighs them
        idx = np.argsort(-biased, axis=1, kind="stable")[:, :cfg.n_experts_used]
    wts = np.take_along_axis(s, idx, 1)
    if cfg.route_normalises:
        den = wts.sum(1, keepdims=True)
        wts = wts / (den + F32(cfg.route_norm_eps) if cfg.route_norm_eps else den)
    return idx, (wts * F32(cfg.route_scale)).astype(F32)


def moe(w, cfg, ro: LayerRoles, Fw: FfnWeights, x: np.ndarray, ids: np.ndarray, seqs: list[Seq],
        trace: Trace | None, row_stable: bool = False) -> np.ndarray:
    clamp = cfg.swiglu_clamp[ro.layer]
    seg = ops.row_groups([s.rows for s in seqs], x.shape[0], row_stable)
    S, E = Fw.shared, Fw.experts
    done = x_products(w, [Fw.gate_inp, S.gate, S.up], x, seg)      # the router and the shared gate and up
    idx, wts = route(w, cfg, ro, Fw, x, ids, seg, done[id(Fw.gate_inp)])
    w.will_need_experts((Fw.experts.gate, Fw.experts.up, Fw.experts.down), np.unique(idx))   # paging hint
    if trace is not None:
        trace.experts[ro.layer], trace.expert_weights[ro.layer] = idx, wts
    g, u = done[id(S.gate)], done[id(S.up)]
    hook = trace.moe_hook if trace is not None else None
    if hook is None and w.experts_batched((E.gate, E.up, E.down), x.shape[0]):
        # the shared expert's down projection goes with the routed gate and up (one launch in a decode step)
        return routed_batched(w, E, x, idx, wts, clamp, None, None, (S.down, ops.swiglu_hidden(g, u, clamp), seg))
    y = ops.swiglu_of(x, lambda _: g, lambda _: u, partial(w.linear, S.down, seg=seg), clamp)
    if hook is not None:
        shared, parts = y.copy(), np.zeros((*idx.shape, y.shape[1]), F32)
    if w.experts_batched((E.gate, E.up, E.down), x.shape[0]):
        routed_batched(w, E, x, idx, wts, clamp, y, parts if hook is not None else None)
        if hook is not None:
            hook(ro.layer, x, idx, wts, parts, shared, y)
        return y
    group_of_row = np.repeat(np.arange(len(seg)), [g.stop - g.start for g in seg])
    for e in np.unique(idx):                     # each expert some row of the step was routed to, once
        tok, slot = np.nonzero(idx == e)         # rows in order, so each row group's (sequence's) rows are one run
        runs = np.flatnonzero(np.diff(group_of_row[tok])) + 1
        sub = [slice(a, b) for a, b in zip(np.r_[0, runs], np.r_[runs, len(tok)])]
        part = ops.swiglu_of(x[tok], *(partial(w.expert_linear, m, e, seg=sub) for m in (E.gate, E.up, E.down)),
                             clamp, wts[tok, slot])
        y[tok] += part
        if hook is not None:
            parts[tok, slot] = part
    if hook is not None:
        hook(ro.layer, x, idx, wts, parts, shared, y)
    return y


# pairs (token row, expert) per routed_batched call: bounds its activations ([pairs, 4096] float32 for the down
# projection's output is 16 MB at 1024) for a long prefill; a decode step's 6 pairs are one call
ROUTED_PAIRS_PER_CALL = 1024


def routed_batched(w, E, x: np.ndarray, idx: np.ndarray, wts: np.ndarray, clamp: float, y: np.ndarray | None,
                   parts: np.ndarray | None, shared: tuple | None = None) -> np.ndarray:
    """moe's routed experts in one kernel call per projection (gate and up together, then down:
    Weights.experts_linear), a prefill's in runs of whole experts of about ROUTED_PAIRS_PER_CALL pairs, adding
    each expert's part into y in moe's order (experts ascending, each expert's rows in order): the bits of moe's
    loop, which these kernels compute row by row the same way. shared = (the shared expert's down matrix, its
    hidden activation, seg): y is made here as its product, which goes with the first run's gate and up
    (Weights.experts_linear_and). Returns y."""
    k = idx.shape[1]
    order = np.argsort(idx, axis=None, kind="stable")      # pairs by expert, then (row, slot): np.nonzero's order
    tok, slot = np.divmod(order, k)
    e_of = idx.ravel()[order]
    starts = np.flatnonzero(np.diff(e_of)) + 1
    gs = np.concatenate(([0], starts, [len(order)]))
    g0 = 0
    while g0 < len(gs) - 1:
        g1 = g0 + 1                                          # whole experts, at least one, up to the pair bound
        while g1 < len(gs) - 1 and gs[g1 + 1] - gs[g0] <= ROUTED_PAIRS_PER_CALL:
            g1 += 1
        a0 = gs[g0]
        y = _routed_run(w, E, x, e_of[gs[g0:g1]], gs[g0:g1 + 1] - a0, tok[a0:gs[g1]], slot[a0:gs[g1]], wts,
                        clamp, y, parts, shared)
        shared = None
        g0 = g1
    if shared is not None:                                   # no rows
        y = w.linear(shared[0], shared[1], shared[2])
    return y


def _routed_run(w, E, x, ex, gs, tok, slot, wts, clamp, y, parts, shared=None) -> np.ndarray:
    if shared is None:
        g, u = w.experts_linear((E.gate, E.up), ex, gs, tok, x)
    else:
        (g, u), y = w.experts_linear_and((E.gate, E.up), ex, gs, tok, x, *shared)
    h = ops.swiglu_hidden(g, u, clamp, wts[tok, slot])   # silu(min(g, c)) * clip(u, -c, c) * the pair's weight
    d, = w.experts_linear((E.down,), ex, gs, np.arange(len(tok)), h)
    if parts is None:
        return ops.add_rows_grouped(y, d, tok, gs)
    for a, b in zip(gs[:-1], gs[1:]):
        y[tok[a:b]] += d[a:b]
        parts[tok[a:b], slot[a:b]] = d[a:b]
    return y


# ---- block and model ----------------------------------------------------------------------------------------
class HcLag:
    """V4.1's lagged hyper-connections (MODEL.md §3): the pre-mix the next sub-layer collapses with. Starts
    one-hot (layer 0); each block's attention collapses with the incoming one, its FFN with the attention's,
    and the block hands its FFN's on (to the next block, or the head)."""

    def __init__(self, rows: int, hc: int):
        self.pre = np.zeros((rows, hc), F32)
        self.pre[:, 0] = 1


def block(w, cfg, nx: Numerics, ro: LayerRoles, L: LayerWeights, X: np.ndarray, ids: np.ndarray, pos: np.ndarray,
          seqs: list[Seq], trace: Trace | None, lag: HcLag | None = None,
          publishers: "v41.KeyPublishers | None" = None, attend_fn=None, row_stable: bool = False) -> np.ndarray:
    """One block (mHC, attention, MoE). attend_fn(x) -> [T, D], when given, replaces the attention (V4.1's DSpark
    stages attend to their own ring and block: ds4py.ref.dspark). row_stable: every row as if stepped alone."""
    seg = ops.row_groups([s.rows for s in seqs], len(X), row_stable)
    hc_args = (cfg.norm_eps, cfg.hc_eps, cfg.sinkhorn_iters, seg)

    pre, post, comb = ops.hc_coeffs(X, w.get(L.hc_attn.fn), w.get(L.hc_attn.scale), w.get(L.hc_attn.base), *hc_args)
    x = ops.rmsnorm(ops.hc_collapse(X, pre if lag is None else lag.pre), w.get(L.attn_norm), cfg.norm_eps)
    if trace is not None:
        trace.attn_in[ro.layer] = x
    a = (attention(w, cfg, nx, ro, L.attn, x, pos, seqs, trace, publishers, row_stable) if attend_fn is None
         else attend_fn(x))
    X = ops.hc_post(a, X, post, comb)

    attn_pre = pre
    pre, post, comb = ops.hc_coeffs(X, w.get(L.hc_ffn.fn), w.get(L.hc_ffn.scale), w.get(L.hc_ffn.base), *hc_args)
    x = ops.rmsnorm(ops.hc_collapse(X, pre if lag is None else attn_pre), w.get(L.ffn_norm), cfg.norm_eps)
    if lag is not None:
        lag.pre = pre
        if trace is not None:
            trace.premix[ro.layer] = pre
    if trace is not None:
        trace.ffn_in[ro.layer], trace.ffn_post[ro.layer] = x, post
    return ops.hc_post(moe(w, cfg, ro, L.ffn, x, ids, seqs, trace, row_stable), X, post, comb)


@dataclass(frozen=True)
class Net:
    """What a pass runs: the weights' reader `w`, their binding `B`, the config, the numerics and what V4.1 needs
    besides weights (`extra`: key publishers, Engram tables)."""
    w: Any
    B: ModelWeights
    cfg: Any
    nx: Numerics
    extra: V41Step | None = None


@dataclass(frozen=True)
class Wanted:
    """What a pass returns: logits of every row (all_logits) or of each sequence's last; `hidden`, when given,
    receives per sequence the final hyper-connection state of every row, [T, hc, dim] (the head's input: the MTP
    block's h_j); `taps` receives per sequence V4.1's DSpark taps, [T, n_targets·dim]: the mean over the hc copies
    of each target layer's input state (after its Engram), in layer order; `trace` records per-layer
    intermediates."""
    all_logits: bool = False
    hidden: list | None = None
    taps: list | None = None
    trace: Trace | None = None


def forward(net: Net, states: list[RefState], chunks: list[np.ndarray], want: Wanted = Wanted(),
            row_stable: bool = False) -> list[np.ndarray]:
    """Run each chunk at positions state.n_tokens.. of its state and advance the states. Returns per sequence
    logits [T, vocab] (want.all_logits) or [vocab] (its last position).
    row_stable: every row bit-identical to the same row stepped alone (each product row by row: ops.row_groups;
    speculative decoding's verify rows, docs/spec.md)."""
    with blas.single_threaded(net.w.small_blas(max(map(len, chunks)))):
        return _forward(net, states, chunks, want, row_stable)


def _forward(net: Net, states: list[RefState], chunks: list[np.ndarray], want: Wanted,
             row_stable: bool) -> list[np.ndarray]:
    w, B, cfg, nx, extra = net.w, net.B, net.cfg, net.nx, net.extra
    all_logits, trace, hidden, taps = want.all_logits, want.trace, want.hidden, want.taps
    seqs, at = [], 0
    for st, c in zip(states, chunks):
        seqs.append(Seq(st, slice(at, at + len(c)), np.arange(st.n_tokens, st.n_tokens + len(c))))
        at += len(c)
    ids, pos = np.concatenate(chunks), np.concatenate([s.pos for s in seqs])
    for s in seqs:
        s.state.begin_step(len(s.pos))
    extra = extra or V41Step()
    publishers = extra.publishers
    if publishers is not None:
        publishers.begin(seqs)
    ngram = extra.ngram.step(seqs, ids) if extra.ngram is not None else None
    if trace is not None:
        trace.engram_ids = ngram
    h = w.rows(B.embed, ids)
    X = np.repeat(h[:, None, :], cfg.hc_mult, axis=1)        # [rows, hc, D]
    lag = HcLag(len(ids), cfg.hc_mult) if cfg.lagged_hc else None
    if trace is not None:
        trace.hc.append(X)
    tapped: list[np.ndarray] = []
    for il, L in enumerate(B.layers):
        ro = cfg.roles(il)
        if ro.engram >= 0:
            X = v41.engram(w, cfg, L.engram, X, extra.tables.rows(ro.engram, ngram[:, ro.engram]),
                           ops.row_groups([s.rows for s in seqs], len(ids), row_stable))
            if trace is not None:
                trace.engram_out[il] = X
        if taps is not None and il in cfg.dspark_targets:
            tapped.append(X.mean(axis=1))
        w.entering_layer(il)                                  # paging hint (the memory-budget mode)
        X = block(w, cfg, nx, ro, L, X, ids, pos, seqs, trace, lag, publishers, row_stable=row_stable)
        if trace is not None:
            trace.hc.append(X)
    if publishers is not None:
        publishers.end(seqs)
    for s in seqs:
        s.state.end_step(len(s.pos))
    if hidden is not None:
        hidden.extend(X[s.rows] for s in seqs)
    if taps is not None:
        T = np.concatenate(tapped, axis=1)
        taps.extend(T[s.rows] for s in seqs)
    last = [s.rows.stop - 1 for s in seqs]
    seg = [s.rows for s in seqs]
    if not all_logits:
        X = X[last]
        seg = [slice(i, i + 1) for i in range(len(seqs))]
    seg = ops.row_groups(seg, len(X), row_stable)
    if B.hc_head is not None:
        y = ops.hc_head(X, w.get(B.hc_head.fn), w.get(B.hc_head.scale), w.get(B.hc_head.base), cfg.norm_eps,
                        cfg.hc_eps, seg)
    else:                                                    # V4.1: the last FFN's pre-mix collapses the copies
        y = ops.hc_collapse(X, lag.pre if all_logits else lag.pre[last])
    logits = w.linear(B.head, ops.rmsnorm(y, w.get(B.output_norm), cfg.norm_eps), seg)
    return [logits[s.rows] for s in seqs] if all_logits else list(logits)
