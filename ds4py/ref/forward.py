"""One forward step of V4 Flash over a chunk of new tokens against a RefState (MODEL.md §2).

Prefill, chunked prefill and decode are the same code: a chunk of T tokens at positions n..n+T−1 attends to
the window rows kept in the state plus its own rows (causal), and to the compressed rows visible to each
query. Decode is a chunk of one token.
"""

from __future__ import annotations

import numpy as np

from ds4py.ref import ops
from ds4py.ref.state import CompressorState, LayerState, RefState

F32 = np.float32
QUERY_BLOCK = 256        # queries per attention block: bounds the [T, H, keys] score memory on long prompts


class Trace:
    """Optional recorder of intermediates (for golden checks). Lists are indexed by layer."""

    def __init__(self, n_layers: int):
        self.hc = []                                         # [T, hc, D] after embedding, then after each layer
        self.attn_in = [None] * n_layers                     # [T, D] attention input (after attn_norm)
        self.ffn_in = [None] * n_layers                      # [T, D] FFN input (after ffn_norm)
        self.experts = [None] * n_layers                     # [T, k] routed expert ids
        self.expert_weights = [None] * n_layers              # [T, k]
        self.indexer_selected = [None] * n_layers            # [T, Nc] bool: compressed rows chosen by top-k
        self.indexer_scores = [None] * n_layers              # [T, Nc] float (invisible rows −inf)


def ds4_numerics(w) -> bool:
    """RefModel(act_quant=True): also mirror ds4's F16 KV storage (see Weights.act for the matmul side)."""
    return bool(getattr(w, "act_quant", False))


# ---- attention ----------------------------------------------------------------------------------------------
def compressor(w, cfg, x: np.ndarray, pos: np.ndarray, buf: CompressorState, prefix: str, d: int, ratio: int,
               freqs: np.ndarray, rotate: bool, fake_quant: bool) -> np.ndarray:
    """Feed the chunk's tokens to a compressor; return the rows of every group completed in this chunk.
    Rows: RMSNorm, RoPE at g·ratio, then Hadamard + FP4 (indexer keys) or FP8 on the non-rope dims."""
    overlap = ratio == 4
    kv = w.linear(prefix + "_kv.weight", x)
    score = w.linear(prefix + "_gate.weight", x) + w.get(prefix + "_ape.weight")[pos % ratio]
    all_kv = np.concatenate([buf.kv, kv])
    all_sc = np.concatenate([buf.score, score])
    p0, p_end = int(pos[0]), int(pos[-1]) + 1
    g0, g1 = p0 // ratio, p_end // ratio                # groups completed in this chunk: [g0, g1)
    rows = np.zeros((0, d), F32)
    if g1 > g0:
        a, b = g0 * ratio - buf.start, g1 * ratio - buf.start
        prev_kv = prev_sc = None
        if overlap and g0 > 0:
            prev_kv, prev_sc = all_kv[a - ratio:a], all_sc[a - ratio:a]
        rows = ops.compress_pool(all_kv[a:b], all_sc[a:b], ratio, overlap, prev_kv, prev_sc)
        rows = ops.rmsnorm(rows, w.get(prefix + "_norm.weight"), cfg.norm_eps)
        rows = ops.rope_tail(rows, np.arange(g0, g1) * ratio, freqs)
        if rotate:
            rows = ops.hadamard(rows)
            if fake_quant:
                rows = ops.fp4_fake_quant(rows, 32)
        elif fake_quant:
            rows[:, :cfg.nope_dim] = ops.fp8_fake_quant(rows[:, :cfg.nope_dim], 64)
        if ds4_numerics(w):
            rows = ops.f16_round(rows)
    # keep what later groups still need: the current incomplete group (+ the last full group for overlap)
    keep = max(0, (g1 - overlap) * ratio)
    buf.kv, buf.score = all_kv[keep - buf.start:].copy(), all_sc[keep - buf.start:].copy()
    buf.start = keep
    return rows


def indexer_scores(w, cfg, p: str, x: np.ndarray, qr: np.ndarray, pos: np.ndarray, keys: np.ndarray,
                   freqs: np.ndarray, fake_quant: bool) -> np.ndarray:
    """score[t, g] = Σ_h w_h · relu(qI_h · K_I[g]); rows invisible to t are −inf. -> [T, Nc]"""
    ih, ihd = cfg.index_heads, cfg.index_head_dim
    q = w.linear(p + "indexer.attn_q_b.weight", qr).reshape(-1, ih, ihd)
    q = ops.hadamard(ops.rope_tail(q, pos, freqs))
    if fake_quant:
        q = ops.fp4_fake_quant(q, 32)
    wts = w.linear(p + "indexer.proj.weight", x) * F32(ihd ** -0.5 * ih ** -0.5)
    s = np.empty((len(pos), keys.shape[0]), F32)
    for a in range(0, len(pos), QUERY_BLOCK):              # bounds the [T, IH, Nc] temporary
        b = a + QUERY_BLOCK
        s[a:b] = (np.maximum(q[a:b] @ keys.T, 0) * wts[a:b, :, None]).sum(1)
    visible = np.arange(keys.shape[0])[None, :] < ((pos + 1) // 4)[:, None]
    return np.where(visible, s, F32(-np.inf))


def topk_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """True for the k best finite entries of each row (all finite entries when there are at most k)."""
    finite = np.isfinite(scores)
    if scores.shape[1] <= k:
        return finite
    kth = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    sel = np.zeros(scores.shape, bool)
    np.put_along_axis(sel, kth, True, axis=1)
    return sel & finite


def attention(w, cfg, il: int, x: np.ndarray, pos: np.ndarray, st: LayerState, fake_quant: bool,
              trace: Trace | None) -> np.ndarray:
    p = f"blk.{il}."
    T, H, hd, W = x.shape[0], cfg.n_heads, cfg.head_dim, cfg.window
    ratio = cfg.compress_ratios[il]
    freqs = ops.layer_rope_freqs(cfg, il)

    # query: low rank + q_norm, per-head RMS (no weight), RoPE on the last rd dims
    qr = ops.rmsnorm(w.linear(p + "attn_q_a.weight", x), w.get(p + "attn_q_a_norm.weight"), cfg.norm_eps)
    q = ops.rmsnorm(w.linear(p + "attn_q_b.weight", qr).reshape(T, H, hd), None, cfg.norm_eps)
    q = ops.rope_tail(q, pos, freqs)

    # the one shared K=V row per token; FP8 fake-quant of the non-rope dims
    kv = ops.rmsnorm(w.linear(p + "attn_kv.weight", x), w.get(p + "attn_kv_a_norm.weight"), cfg.norm_eps)
    kv = ops.rope_tail(kv, pos, freqs)
    if fake_quant:
        kv[:, :cfg.nope_dim] = ops.fp8_fake_quant(kv[:, :cfg.nope_dim], 64)
    if ds4_numerics(w):
        kv = ops.f16_round(kv)                             # ds4 stores KV rows as F16

    # window keys: the state's rows for positions [p0−W+1, p0) then this chunk's rows
    p0 = int(pos[0])
    old = np.arange(max(0, p0 - W + 1), p0)
    win_kv = np.concatenate([st.ring[old % W], kv])
    win_pos = np.concatenate([old, pos])
    tail = pos[-min(T, W):]
    st.ring[tail % W] = kv[-len(tail):]

    # compressed rows (and indexer keys) emitted by this chunk
    comp = sel = None
    if ratio:
        rows = compressor(w, cfg, x, pos, st.comp_buf, p + "attn_compressor", hd, ratio, freqs, False,
                          fake_quant)
        st.comp.append(rows)
        comp = st.comp.view()
        visible = np.arange(comp.shape[0])[None, :] < ((pos + 1) // ratio)[:, None]
        sel = visible
        if ratio == 4:
            keys = compressor(w, cfg, x, pos, st.index_buf, p + "indexer_compressor", cfg.index_head_dim, 4,
                              freqs, True, fake_quant)
            st.index_keys.append(keys)
            scores = indexer_scores(w, cfg, p, x, qr, pos, st.index_keys.view(), freqs, fake_quant)
            sel = topk_mask(scores, cfg.index_topk)
            if trace is not None:
                trace.indexer_selected[il], trace.indexer_scores[il] = sel, scores

    # attention with sink, in query blocks: keys = window rows ∪ selected compressed rows
    sink = w.get(p + "attn_sinks.weight")
    o = np.empty((T, H, hd), F32)
    for a in range(0, T, QUERY_BLOCK):
        b = min(a + QUERY_BLOCK, T)
        lo = max(0, int(pos[a]) - W + 1 - int(win_pos[0]))
        hi = int(pos[b - 1]) - int(win_pos[0]) + 1
        kp = win_pos[lo:hi]
        mask = (kp[None, :] <= pos[a:b, None]) & (kp[None, :] > pos[a:b, None] - W)
        keys = win_kv[lo:hi]
        if comp is not None and comp.shape[0]:
            keys = np.concatenate([keys, comp])
            mask = np.concatenate([mask, sel[a:b]], 1)
        o[a:b] = ops.attention_with_sink(q[a:b], keys, mask, sink, hd ** -0.5)

    # inverse RoPE on the output's rope dims, then the grouped low-rank output projection
    o = ops.rope_tail(o, pos, freqs, inverse=True)
    G, r = cfg.o_groups, cfg.o_lora_rank
    wo_a = w.get(p + "attn_output_a.weight").reshape(G, r, -1)
    og = w.act(p + "attn_output_a.weight", o.reshape(T, G, -1))
    u = (og.transpose(1, 0, 2) @ wo_a.transpose(0, 2, 1)).transpose(1, 0, 2)     # u_g = wo_a[g] @ o_g
    return w.linear(p + "attn_output_b.weight", u.reshape(T, G * r))


# ---- MoE ----------------------------------------------------------------------------------------------------
def route(w, cfg, il: int, x: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids [T, k] and weights [T, k]: hash table on the first layers, biased top-k after."""
    p = f"blk.{il}."
    s = ops.sqrt_softplus(w.linear(p + "ffn_gate_inp.weight", x))
    if cfg.is_hash_layer(il):
        idx = w.get(p + "ffn_gate_tid2eid.weight")[ids]
    else:
        biased = s + w.get(p + "exp_probs_b.bias")                 # the bias picks experts, never weighs them
        idx = np.argsort(-biased, axis=1, kind="stable")[:, :cfg.n_experts_used]
    wts = np.take_along_axis(s, idx, 1)
    if cfg.route_norm:
        wts = wts / wts.sum(1, keepdims=True)
    return idx, (wts * F32(cfg.route_scale)).astype(F32)


def acts(w, names: list[str]) -> tuple:
    """Activation rounding for the inputs of (gate, up) and of down; (None, None) in plain fp32."""
    if not ds4_numerics(w):
        return None, None
    return (lambda a: w.act(names[0], a)), (lambda a: w.act(names[2], a))


def moe(w, cfg, il: int, x: np.ndarray, ids: np.ndarray, trace: Trace | None) -> np.ndarray:
    p = f"blk.{il}."
    clamp = cfg.swiglu_clamp[il]
    idx, wts = route(w, cfg, il, x, ids)
    if trace is not None:
        trace.experts[il], trace.expert_weights[il] = idx, wts
    names = [p + f"ffn_{m}_shexp.weight" for m in ("gate", "up", "down")]
    y = ops.swiglu(x, *(w.get(n) for n in names), clamp, None, *acts(w, names))
    names = [p + f"ffn_{m}_exps.weight" for m in ("gate", "up", "down")]
    for e in np.unique(idx):                               # only the experts actually routed to
        tok, slot = np.nonzero(idx == e)
        y[tok] += ops.swiglu(x[tok], *(w.expert(n, e) for n in names), clamp, wts[tok, slot], *acts(w, names))
    return y


# ---- block and model ----------------------------------------------------------------------------------------
def block(w, cfg, il: int, X: np.ndarray, ids: np.ndarray, pos: np.ndarray, st: LayerState, fake_quant: bool,
          trace: Trace | None) -> np.ndarray:
    p = f"blk.{il}."
    hc_args = (cfg.norm_eps, cfg.hc_eps, cfg.sinkhorn_iters)

    x, post, comb = ops.hc_pre(X, w.get(p + "hc_attn_fn.weight"), w.get(p + "hc_attn_scale.weight"),
                               w.get(p + "hc_attn_base.weight"), *hc_args)
    x = ops.rmsnorm(x, w.get(p + "attn_norm.weight"), cfg.norm_eps)
    if trace is not None:
        trace.attn_in[il] = x
    X = ops.hc_post(attention(w, cfg, il, x, pos, st, fake_quant, trace), X, post, comb)

    x, post, comb = ops.hc_pre(X, w.get(p + "hc_ffn_fn.weight"), w.get(p + "hc_ffn_scale.weight"),
                               w.get(p + "hc_ffn_base.weight"), *hc_args)
    x = ops.rmsnorm(x, w.get(p + "ffn_norm.weight"), cfg.norm_eps)
    if trace is not None:
        trace.ffn_in[il] = x
    return ops.hc_post(moe(w, cfg, il, x, ids, trace), X, post, comb)


def forward(w, cfg, state: RefState, ids: np.ndarray, all_logits: bool, fake_quant: bool,
            trace: Trace | None = None) -> np.ndarray:
    """Run the chunk `ids` at positions state.n_tokens.. and advance the state. Returns logits
    [T, vocab] (all_logits) or [vocab] (the last position)."""
    T = len(ids)
    pos = np.arange(state.n_tokens, state.n_tokens + T)
    h = w.rows("token_embd.weight", ids)
    X = np.repeat(h[:, None, :], cfg.hc_mult, axis=1)        # [T, hc, D]
    if trace is not None:
        trace.hc.append(X)
    for il in range(cfg.n_layers):
        X = block(w, cfg, il, X, ids, pos, state.layers[il], fake_quant, trace)
        if trace is not None:
            trace.hc.append(X)
    state.n_tokens += T
    if not all_logits:
        X = X[-1:]
    y = ops.hc_head(X, w.get("output_hc_fn.weight"), w.get("output_hc_scale.weight"),
                    w.get("output_hc_base.weight"), cfg.norm_eps, cfg.hc_eps)
    logits = w.linear("output.weight", ops.rmsnorm(y, w.get("output_norm.weight"), cfg.norm_eps))
    return logits if all_logits else logits[0]
