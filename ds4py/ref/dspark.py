"""V4.1 Flash's DSpark draft on the reference backend (MODEL.md §3; golden v41-tiny-dspark README, "DSpark: what
the official code computes").

    draft = RefDSpark(model)                      # model: a RefModel of a V4.1 GGUF holding the dspark.* tensors
    ds = draft.new_state()                        # a window ring per stage: state_layout(cfg.dspark_block_config())
    logits, taps = model.step_taps([s], [ids])    # the main step also gives the taps of its rows (no second pass)
    draft.feed([ds], [taps])                      # one ring write per main position
    blk = draft.block(ds, token)                  # one call: B block positions after the state's last position
    ids, logits, conf = draft.greedy(blk, token)  # or blk.position(i, prev) per position (sampled drafts)

The math, at main position t = ds.n_tokens − 1 with `token` the token at t + 1 (block token 0):

    main_x(p) = RMSNorm(main_proj · taps(p); main_norm)                       (every fed position p)
    ring_s(p) = FP8QDQ(RoPE_p(RMSNorm(wkv_s · main_x(p); kv_norm_s)))         (stage s, kept for the window)
    X = embed([token, noise × (B − 1)]) on the hc copies, at positions t + 1 .. t + B; pre = one-hot
    per stage: a V4.1 block (lagged mHC, its own MoE) whose attention is every block query against the ring's
               positions t − W + 1 .. t and all B block keys FP8QDQ(RoPE(RMSNorm(wkv_s · x; kv_norm_s))), with sink
    h = hc_collapse(X, pre); base = head · RMSNorm(h; norm)                   (the main model's head)
    logits_i = base_i + markov_head · markov_embed[out_i]; out_{i+1} = sample(logits_i); out_0 = token
    confidence_i = confidence · [h_i, markov_embed[out_i]]                    (raw score, pre-norm h)

The ring holds main positions only (never drafts); a state's truncate / copy / save / load are RefState's. What the
official code leaves out (its README): it never drafts right after the prompt (prefill only seeds) and writes one
ring row per call; here every fed main position is written (`feed`), so a call right after the prompt, or after a
round that accepted several tokens, sees exactly the rows a one-token-per-step official run would.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import numpy as np

from ds4py import schema
from ds4py.host.dspark import DraftBlock, DSparkBase
from ds4py.ref import ops
from ds4py.ref.forward import HcLag, Seq, block, kv_store
from ds4py.ref.state import RefDraftStates, RefState

F32 = np.float32


class RefDSpark(RefDraftStates, DSparkBase):
    """The DSpark draft of a RefModel (numpy, fp32; the main model's numerics, so --no-fake-quant also turns off the
    draft's FP8 quant-dequant)."""

    def __init__(self, model):
        super().__init__(model)
        self.weights = model.weights                       # the same file: one dequant cache
        self.binding = schema.bind_dspark(self.main_config, model.gguf.tensor)

    # ---- the rings ----------------------------------------------------------------------------------------
    def feed(self, states: Sequence[RefState], taps: Sequence[np.ndarray]) -> None:
        """Write each state's rings for the main positions state.n_tokens .. + len(taps[i]) − 1 (taps[i]: their
        [T, n_targets·D] taps from model.step_taps) and advance it. Only the rows a ring keeps are computed."""
        cfg, w, D = self.config, self.weights, self.binding
        rows, seqs, at = [], [], 0
        for st, tp in zip(states, self.check_feed(states, taps)):
            n0 = st.n_tokens
            keep = min(len(tp), self.layout.parts[0].capacity)
            rows.append(tp[len(tp) - keep:])
            seqs.append((st, np.arange(n0 + len(tp) - keep, n0 + len(tp)), slice(at, at + keep), len(tp)))
            at += keep
        pos = np.concatenate([s[1] for s in seqs])
        # row by row (row-stable): a ring row is the same bits whether its position came alone (a decode step),
        # in a prompt or among a round's accepted rows, so drafts never depend on how the main positions were chunked
        seg = ops.row_groups([s[2] for s in seqs], at, row_stable=True)
        main_x = ops.rmsnorm(w.linear(D.main_proj, np.concatenate(rows), seg), w.get(D.main_norm), cfg.norm_eps)
        ks = [self._kv(L.attn, main_x, pos, s, seg) for s, L in enumerate(D.stages)]
        for s, k in enumerate(ks):
            for st, p, r, _ in seqs:
                ring = st.ring(s, "win")
                ring[p % ring.shape[0]] = k[r]
        for st, _, _, n in seqs:             # (rows written above: nothing can fail between them and this)
            st.begin_step(n)
            st.end_step(n)

    def _kv(self, A, x: np.ndarray, pos: np.ndarray, stage: int, seg=None) -> np.ndarray:
        """K = V rows of a stage: RMSNorm(wkv x; kv_norm), RoPE at pos (base theta), FP8 quant-dequant, storage."""
        cfg, w, nx = self.config, self.weights, self.numerics
        k = ops.rmsnorm(w.linear(A.kv, x, seg), w.get(A.kv_norm), cfg.norm_eps)
        k = ops.rope_tail(k, pos, ops.layer_rope_freqs(cfg, stage))
        if nx.fake_quant:
            d, blk = cfg.kv_fp8
            k[:, :d] = ops.fp8_fake_quant(k[:, :d], blk)
        return kv_store(k, nx)

    # ---- one draft call -------------------------------------------------------------------------------------
    def block(self, state: RefState, token: int) -> DraftBlock:
        """The block after the state's last fed position t (block token 0 = `token`, the token at t + 1)."""
        t = self.check_block(state, token)
        cfg, mc, w, D = self.config, self.main_config, self.weights, self.binding
        Bn = self.block_size
        ids = np.array([int(token)] + [mc.dspark_noise_id] * (Bn - 1), np.int64)
        pos = np.arange(t + 1, t + 1 + Bn)
        mw, MB = self.model.weights, self.model.binding
        X = np.repeat(mw.rows(MB.embed, ids)[:, None, :], cfg.hc_mult, axis=1)
        lag = HcLag(Bn, cfg.hc_mult)
        seqs = [Seq(state, slice(0, Bn), pos)]
        # not row-stable: a draft's bits change speed only (greedy) or are fixed by the seed
        for s, L in enumerate(D.stages):
            X = block(w, cfg, self.numerics, cfg.roles(s), L, X, ids, pos, seqs, None, lag,
                      attend_fn=partial(self._attend, state, s, L.attn, pos), row_stable=False)
        h = ops.hc_collapse(X, lag.pre)
        base = mw.linear(MB.head, ops.rmsnorm(h, w.get(D.norm), cfg.norm_eps))
        return DraftBlock(base, h, w.get(D.markov_embed), w.get(D.markov_head), w.get(D.confidence).reshape(-1))

    def _attend(self, state: RefState, s: int, A, pos: np.ndarray, x: np.ndarray) -> np.ndarray:
        """DSpark attention of stage s: every block query sees the ring's main positions t − W + 1 .. t and all
        block keys (no mask inside the block); one K = V head, sink, inverse RoPE, grouped output."""
        cfg, w = self.config, self.weights
        Bn, H, hd = x.shape[0], cfg.n_heads, cfg.head_dim
        freqs = ops.layer_rope_freqs(cfg, s)
        qr = ops.rmsnorm(w.linear(A.q_a, x), w.get(A.q_a_norm), cfg.norm_eps)
        q = w.linear(A.q_b, qr).reshape(Bn, H, hd)
        if cfg.q_head_norm:
            q = ops.rmsnorm(q, None, cfg.norm_eps)
        q = ops.rope_tail(q, pos, freqs)
        ring = state.ring(s, "win")
        t = int(pos[0]) - 1
        old = np.arange(max(0, t - cfg.window + 1), t + 1)
        keys = np.concatenate([ring[old % ring.shape[0]], self._kv(A, x, pos, s)])
        o = ops.attention_with_sink(q, keys, np.ones((Bn, len(keys)), bool), w.get(A.sinks), hd ** -0.5)
        o = ops.rope_tail(o, pos, freqs, inverse=True)
        u = w.grouped_linear(A.out_a, o.reshape(Bn, cfg.o_groups, -1))
        return w.linear(A.out_b, u.reshape(Bn, -1))
