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

from typing import Sequence

import numpy as np

from ds4py import kv, schema
from ds4py.errors import ContextLengthError, Ds4Error, GGUFError
from ds4py.fingerprint import file_fingerprint
from ds4py.gguf import GGUFFile
from ds4py.kv import state_layout
from ds4py.quant import vq
from ds4py.ref import ops
from ds4py.ref.forward import Seq, block
from ds4py.ref.state import RefState
from ds4py.ref.weights import DEFAULT_CACHE_BYTES, Weights

F32 = np.float32
# metadata an MTP file may carry (ours do, as ds4's converter may not): when present it must match the main model
SHAPE_KEYS = {"embedding_length": "dim", "vocab_size": "vocab_size", "attention.head_count": "n_heads",
              "attention.key_length": "head_dim", "hyper_connection.count": "hc_mult",
              "expert_count": "n_experts", "expert_feed_forward_length": "expert_ff",
              "attention.sliding_window": "window"}


def check_mtp_file(f: GGUFFile, cfg) -> None:
    """GGUFError / Ds4Error naming the first thing that makes `f` not an MTP file of the model `cfg`."""
    for key, field in SHAPE_KEYS.items():
        v = f.meta(f"deepseek4.{key}", None)
        if v is not None and v != getattr(cfg, field):
            raise Ds4Error(f"{f.path}: this MTP file is for another model (deepseek4.{key} is {v}, the main model's "
                           f"{field} is {getattr(cfg, field)})")
    if schema.MTP_PREFIX + "e_proj.weight" not in f:
        raise GGUFError(f"{f.path}: not an MTP draft file (no {schema.MTP_PREFIX}* tensors; convert the checkpoint "
                        "with --mtp OUT_MTP.gguf, or use ds4's MTP GGUF)")
    for name, (shape, types) in schema.expected_mtp_tensors(cfg).items():
        if name.endswith("_exps.weight") and vq.is_vq(f, name):
            vq.check_expert(f, name, shape)
        else:
            f.tensor(name, types=types, shape=shape)


class RefMtp:
    """The MTP draft block of a RefModel (numpy, fp32; the main model's numerics)."""

    backend = "ref"

    def __init__(self, model, path: str | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.model = model
        self.main_config = model.config
        self.config = model.config.mtp_block()
        self.path = model.path if path is None else str(path)
        self.gguf = model.gguf if path is None else GGUFFile(self.path)
        check_mtp_file(self.gguf, model.config)
        self.numerics = model.numerics
        self.weights = model.weights if path is None else Weights(self.gguf, cache_bytes, model.numerics.act_quant)
        self.binding = schema.bind_mtp(model.config, self.gguf.tensor)
        self.rollback_horizon = model.rollback_horizon
        self.layout = state_layout(self.config, model.rollback_horizon)
        header = min(t.offset for t in self.gguf.tensors.values())
        self.fingerprint = file_fingerprint(self.path, head_bytes=header)

    def new_state(self) -> RefState:
        return RefState(self.layout)

    def step(self, states: Sequence[RefState], hidden: Sequence[np.ndarray], next_ids: Sequence[Sequence[int]],
             all_logits: bool = False, logits: bool = True) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Advance each state by its rows (hidden[i] [T, hc, dim], next_ids[i] [T]): (logits per sequence,
        [vocab] or [T, vocab] with all_logits; [] when logits=False), block output states [T, hc, dim]."""
        hs, ids = self._check(states, hidden, next_ids)
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
            # no row stability needed: a draft's bits only change speed (greedy) or are fixed by a fixed schedule
            with ops.row_stable(False):
                lg, hid = self._forward([states[i] for i, _ in picked], [hs[i][r] for i, r in picked],
                                        [ids[i][r] for i, r in picked], all_logits, logits, last)
            for j, (i, _) in enumerate(picked):
                out_hidden[i].append(hid[j])
                if logits and (all_logits or last[j]):
                    out_logits[i].append(lg[j])
        hid = [np.concatenate(h) for h in out_hidden]
        if not logits:
            return [], hid
        return [np.concatenate(o) if all_logits else o[-1] for o in out_logits], hid

    def _check(self, states, hidden, next_ids) -> tuple[list[np.ndarray], list[np.ndarray]]:
        return check_step_inputs(self.main_config, states, hidden, next_ids,
                                 lambda st: isinstance(st, RefState) and st.layout == self.layout)

    def _forward(self, states: list[RefState], hidden: list[np.ndarray], next_ids: list[np.ndarray],
                 all_logits: bool, logits: bool, last: list[bool]) -> tuple[list[np.ndarray], list[np.ndarray]]:
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
        x = w.linear(M.e_proj, e)[:, None, :] + w.linear(M.h_proj, h.reshape(N * hc, D)).reshape(N, hc, D)
        X = block(w, cfg, self.numerics, cfg.roles(0), M.block, x, ids, pos, seqs, None)
        for s in seqs:
            s.state.end_step(len(s.pos))
        out = [X[s.rows] for s in seqs]
        if not logits:
            return [], out
        rows = [r for s, fin in zip(seqs, last) for r in (range(s.rows.start, s.rows.stop) if all_logits else
                                                            [s.rows.stop - 1] if fin else [])]
        y = ops.hc_head(X[rows], w.get(M.hc_head.fn), w.get(M.hc_head.scale), w.get(M.hc_head.base), eps,
                        cfg.hc_eps)
        lg = mw.linear(B.head, ops.rmsnorm(y, w.get(M.norm), eps))
        res, at = [], 0
        for s, fin in zip(seqs, last):
            n = len(s.pos) if all_logits else int(fin)
            res.append(lg[at:at + n] if all_logits else (lg[at] if n else None))
            at += n
        return res, out

    def save_state(self, state: RefState) -> bytes:
        """The MTP state as a DS4PYKV blob under the MTP file's fingerprint (SpecModel pairs it with the main one)."""
        if not isinstance(state, RefState) or state.layout != self.layout:
            raise Ds4Error("save_state needs a state from this MTP block's new_state()")
        return kv.encode_state(self.fingerprint, self.numerics.to_dict(), self.layout, state.n_tokens,
                               state.n_written, state.export(), self.backend)

    def load_state(self, data: bytes) -> RefState:
        n_tokens, n_written, arrays = kv.decode_state(data, self.fingerprint, self.numerics.to_dict(), self.layout)
        return RefState.from_parts(self.layout, n_tokens, n_written, arrays)

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


def check_step_inputs(cfg, states, hidden, next_ids, owns) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """An MTP step's arguments checked (one sentence per problem) and normalised: the hidden states as float32
    [n, hc, D], the ids as int64; owns(state) says whether a state is this MTP block's (both backends use it)."""
    if not (len(states) == len(hidden) == len(next_ids)) or not states:
        raise Ds4Error("an MTP step takes one hidden-state array and one id chunk per state")
    if len({id(s) for s in states}) != len(states):
        raise Ds4Error("the same MTP state appears twice in one step")
    hs, ids = [], []
    for st, h, c in zip(states, hidden, next_ids):
        if not owns(st):
            raise Ds4Error("an MTP step needs states from this MTP block's new_state()")
        h = np.asarray(h, dtype=np.float32)
        c = np.asarray(c)
        if c.ndim != 1 or c.size == 0 or not np.issubdtype(c.dtype, np.integer):
            raise Ds4Error("MTP next-token ids must be a non-empty 1-D integer sequence")
        if h.shape != (c.size, cfg.hc_mult, cfg.dim):
            raise Ds4Error(f"MTP hidden states must be [{c.size}, {cfg.hc_mult}, {cfg.dim}] (one final "
                           f"hyper-connection state per next token), got {list(h.shape)}")
        if ((c < 0) | (c >= cfg.vocab_size)).any():
            raise Ds4Error(f"an MTP next-token id is outside the vocabulary (0..{cfg.vocab_size - 1})")
        if st.n_tokens + c.size > cfg.context_length:
            raise ContextLengthError(f"{st.n_tokens} + {c.size} MTP positions exceed the context length "
                                     f"{cfg.context_length}")
        hs.append(h)
        ids.append(c.astype(np.int64))
    return hs, ids
