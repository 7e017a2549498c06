"""The MTP draft block on the reference backend (MODEL.md §2.5; the golden v4-tiny-mtp README's driver).

    mtp = RefMtp(model, "model-mtp.gguf")         # RefMtp(model) when the main GGUF holds the mtp.0.* tensors
    ds = mtp.new_state()                          # its own one-layer window ring: kv.state_layout(cfg.mtp_block())
    logits, out = mtp.step([ds], [H], [next_ids], all_logits=True)

Row j of a step sits at position ds.n_tokens + j. It reads the main model's final hyper-connection state h_j
(`H[j]`, from `model.step_hidden`) and the embedding of the token after it (`next_ids[j]`, token j+1), and gives
the logits of token j+2 and the block's own output state `out[j]` [hc, dim], which a chained draft reads in
place of h_j (ds4 drafts the same way). The math:

    x = e_proj(RMSNorm(embed(next_id); enorm)) broadcast to the hc copies + h_proj(RMSNorm(h_j; hnorm)) per copy
    X = one V4 block (ratio 0: window only, base-theta RoPE, score-routed; its own window ring)
    logits = head(RMSNorm(hc_head(X; mtp hc_head_*); mtp norm))      # the main model's embedding and head

The weights come from the MTP GGUF through the typed binding (ds4py.schema.bind_mtp); the embedding and the
head are the main model's. The block is ds4py.ref.forward.block, the same code as a main layer.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from ds4py import schema
from ds4py.contract import MtpBase
from ds4py.quant import vq
from ds4py.ref import ops
from ds4py.ref.forward import Seq, block
from ds4py.ref.state import RefDraftStates, RefState
from ds4py.ref.weights import DEFAULT_CACHE_BYTES, FUSED_MAX_ROWS, Weights

F32 = np.float32


class RefMtp(RefDraftStates, MtpBase):
    """The MTP draft block of a RefModel (numpy, fp32; the main model's numerics)."""

    def __init__(self, model, path: str | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES):
        super().__init__(model, path)
        self.weights = model.weights if path is None else Weights(self.gguf, cache_bytes, model.numerics.act_quant)
        self.binding = schema.bind_mtp(model.config, self.gguf.tensor)

    def _step(self, states: list[RefState], hs: list[np.ndarray], ids: list[np.ndarray], all_logits: bool,
              logits: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        m = self.model
        out_logits: list[list[np.ndarray]] = [[] for _ in states]
        out_hidden: list[list[np.ndarray]] = [[] for _ in states]
        done = [0] * len(states)
        while any(d < len(c) for d, c in zip(done, ids)):       # passes of at most max_chunk rows, as the main
            budget, picked = m.max_chunk, []
            for i, c in enumerate(ids):
                take = min(len(c) - done[i], budget)
                if take > 0:
                    picked.append((i, slice(done[i], done[i] + take)))
                    done[i] += take
                    budget -= take
                if budget == 0:
                    break
            last = [done[i] == len(ids[i]) for i, _ in picked]
            # A draft's bits only change speed (greedy) or are fixed by a fixed schedule, so row stability is not
            # needed; but a round's catch-up (the a + 1 rows a verify accepted) runs row by row like a verify:
            # a few-row BLAS product goes to a threaded sgemm, measured 3-4x a row's gemv on a loaded 2-core
            # machine (2 rows: 8 ms vs 3.4 ms row by row on the trained tiny model), which made every accepted
            # round pay more than its draft was worth (docs/spec.md "Measured: trained").
            few = max(r.stop - r.start for _, r in picked) <= FUSED_MAX_ROWS
            lg, hid = self._forward([states[i] for i, _ in picked], [hs[i][r] for i, r in picked],
                                    [ids[i][r] for i, r in picked], all_logits, logits, last, row_stable=few)
            for j, (i, _) in enumerate(picked):
                out_hidden[i].append(hid[j])
                if logits and (all_logits or last[j]):
                    out_logits[i].append(lg[j])
        hid = [np.concatenate(h) for h in out_hidden]
        if not logits:
            return [], hid
        return [np.concatenate(o) if all_logits else o[-1] for o in out_logits], hid

    def _forward(self, states: list[RefState], hidden: list[np.ndarray], next_ids: list[np.ndarray],
                 all_logits: bool, logits: bool, last: list[bool],
                 row_stable: bool = False) -> tuple[list[np.ndarray], list[np.ndarray]]:
        w, M, cfg, eps = self.weights, self.binding, self.config, self.config.norm_eps
        mw, B = self.model.weights, self.model.binding              # the shared embedding and head
        seqs, at = [], 0
        for st, c in zip(states, next_ids):
            seqs.append(Seq(st, slice(at, at + len(c)), np.arange(st.n_tokens, st.n_tokens + len(c))))
            at += len(c)
        ids, pos = np.concatenate(next_ids), np.concatenate([s.pos for s in seqs])
        H = np.concatenate(hidden)
        N, hc, D = H.shape
        for s in seqs:
            s.state.begin_step(len(s.pos))
        e = ops.rmsnorm(mw.rows(B.embed, ids), w.get(M.enorm), eps)
        h = ops.rmsnorm(H, w.get(M.hnorm), eps)                    # over dim, per hc copy
        rows_of = partial(ops.row_groups, None, row_stable=row_stable)      # each row alone when row-stable
        x = (w.linear(M.e_proj, e, rows_of(N))[:, None, :]
             + w.linear(M.h_proj, h.reshape(N * hc, D), rows_of(N * hc)).reshape(N, hc, D))
        X = block(w, cfg, self.numerics, cfg.roles(0), M.block, x, ids, pos, seqs, None, row_stable=row_stable)
        for s in seqs:
            s.state.end_step(len(s.pos))
        out = [X[s.rows] for s in seqs]
        if not logits:
            return [], out
        rows = [r for s, fin in zip(seqs, last) for r in (range(s.rows.start, s.rows.stop) if all_logits else
                                                            [s.rows.stop - 1] if fin else [])]
        y = ops.hc_head(X[rows], w.get(M.hc_head.fn), w.get(M.hc_head.scale), w.get(M.hc_head.base), eps,
                        cfg.hc_eps, rows_of(len(rows)))
        lg = mw.linear(B.head, ops.rmsnorm(y, w.get(M.norm), eps), rows_of(len(rows)))
        res, at = [], 0
        for s, fin in zip(seqs, last):
            n = len(s.pos) if all_logits else int(fin)
            res.append(lg[at:at + n] if all_logits else (lg[at] if n else None))
            at += n
        return res, out

    def weight_bytes_per_token(self) -> int:
        """Bytes one draft row reads: the MTP block (n_experts_used of n_experts routed experts), the main
        model's head and one embedding row."""
        cfg = self.main_config
        entries = list(schema.mtp_entries(cfg))
        experts = {e.name for e in entries if e.spec.field.startswith("block.ffn.experts.")}
        per_expert = experts | {vq.gain_name(n) for n in experts} | {vq.hi_name(n) for n in experts}
        total = 0
        for name, t in self.gguf.tensors.items():
            if not name.startswith(schema.MTP_PREFIX):
                continue
            total += t.nbytes * cfg.n_experts_used // cfg.n_experts if name in per_expert else t.nbytes
        head, embed = self.model.binding.head, self.model.binding.embed
        return total + head.nbytes + embed.nbytes // embed.shape[0]
