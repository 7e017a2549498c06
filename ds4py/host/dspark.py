"""The host part of V4.1's DSpark draft both backends share (MODEL.md §3, ds4py/ref/dspark.py for the math): a
draft call's block and its Markov / confidence head, the greedy chain over it, the bytes a call reads, and
DSparkBase (the checks and the state on disk every backend's draft class shares). Neither backend imports the
other for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ds4py import schema
from ds4py.contract import DraftBase
from ds4py.errors import Ds4Error
from ds4py.kv import state_layout
from ds4py.quant import vq

F32 = np.float32


@dataclass
class DraftBlock:
    """One draft call's block: what does not depend on the drafted tokens (the base logits and the last stage's
    pre-norm hidden state), and the Markov / confidence head that does."""
    base: np.ndarray             # [B, V] head logits before the Markov bias
    hidden: np.ndarray           # [B, D] h = hc_collapse(X, pre), the confidence head's input
    embed: np.ndarray            # [V, r] markov_embed
    head: np.ndarray             # [V, r] markov_head
    confidence_w: np.ndarray     # [D + r]

    @property
    def size(self) -> int:
        return self.base.shape[0]

    def position(self, i: int, prev: int) -> tuple[np.ndarray, float]:
        """(logits of block position i [V]: the draft distribution of the token at t + 2 + i, given out_i =
        `prev`, the raw confidence score c_i)."""
        e = self.embed[int(prev)]
        logits = self.base[i] + self.head @ e
        conf = float(np.dot(self.confidence_w[:self.hidden.shape[1]], self.hidden[i])
                     + np.dot(self.confidence_w[self.hidden.shape[1]:], e))
        return logits.astype(F32), conf


def greedy_chain(blk: DraftBlock, token: int, ids: Sequence[int] | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The greedy chain of a block (the official driver at temperature 0): out [B + 1] = [token, d_1..d_B],
    logits [B, V] (Markov bias included), confidence [B]. `ids`, when given, are the out_i the Markov bias
    and the confidence read instead of the chain's own (a teacher, to compare position by position)."""
    out, logits, conf = [int(token)], [], []
    for i in range(blk.size):
        lg, c = blk.position(i, out[i] if ids is None else ids[i])
        logits.append(lg)
        conf.append(c)
        out.append(int(np.argmax(lg)))
    return np.array(out, np.int64), np.stack(logits).astype(F32), np.array(conf, F32)


def routed_bytes_per_row(mc: Any, f: Any) -> int:
    """Bytes of routed experts one more main-model verify row reads (n_experts_used per backbone layer) of the
    model `mc` (its config) in GGUF `f`."""
    return sum(f.tensor(e.name).nbytes * mc.n_experts_used // mc.n_experts for e in schema.entries(mc)
               if e.spec.field.startswith("ffn.experts."))


def call_bytes(mc: Any, f: Any, block_size: int) -> int:
    """Bytes one draft call reads: the stages' dense tensors, the routed experts B rows pick (at most all of
    them), the shared head and B embedding rows; a ring feed reads main_proj and the stages' wkv."""
    per_row = min(mc.dspark_experts, block_size * mc.dspark_experts_used)
    experts = {e.name for e in schema.dspark_entries(mc) if e.spec.field.startswith("ffn.experts.")}
    experts |= {vq.gain_name(n) for n in experts} | {vq.hi_name(n) for n in experts}
    total = sum(t.nbytes * per_row // mc.dspark_experts if name in experts else t.nbytes
                for name, t in f.tensors.items() if name.startswith(schema.DSPARK_PREFIX))
    names = {e.spec.field: e.name for e in schema.entries(mc) if e.spec.field in ("head", "embed")}
    head, embed = f.tensor(names["head"]), f.tensor(names["embed"])
    return total + head.nbytes + block_size * embed.nbytes // embed.shape[0]


class DSparkBase(DraftBase):
    """What every backend's DSpark draft shares: the draft's configuration from its model's, the checks of a feed
    and of a draft call (one sentence per problem), the greedy chain, the bytes it reads and its state on disk
    (DraftBase). A backend calls `DSparkBase.__init__(self, model)` and implements feed's ring writes, block's
    forward and the state methods (its backend's DraftStates class)."""

    noun = "DSpark draft"

    def __init__(self, model: Any):
        cfg = model.config
        if not cfg.has_dspark:
            raise Ds4Error(f"{model.path}: this model has no DSpark draft (no dspark.* tensors; convert a V4.1 "
                           "checkpoint whose config declares one)")
        self.model, self.main_config = model, cfg
        self.config = cfg.dspark_block_config()
        self.backend, self.numerics, self.fingerprint = model.backend, model.numerics, model.fingerprint
        self.rollback_horizon = model.rollback_horizon
        self.layout = state_layout(self.config, model.rollback_horizon)
        self.block_size = cfg.dspark_block

    def check_feed(self, states: Sequence[Any], taps: Sequence[np.ndarray]) -> list[np.ndarray]:
        """A feed's taps checked against its states: float32 [T, n_targets·D] each, within the context."""
        mc = self.main_config
        if len(states) != len(taps) or not states:
            raise Ds4Error("a DSpark feed takes one taps array per state")
        out = []
        for st, tp in zip(states, taps):
            if not self.owns(st):
                raise Ds4Error("a DSpark feed needs states from this draft's new_state()")
            tp = np.asarray(tp, F32)
            if tp.ndim != 2 or tp.shape[1] != mc.dspark_tap_dim or not len(tp):
                raise Ds4Error(f"DSpark taps must be [T, {mc.dspark_tap_dim}], got {list(tp.shape)}")
            if st.n_tokens + len(tp) > mc.context_length:
                raise Ds4Error(f"{st.n_tokens} + {len(tp)} DSpark ring positions exceed the context length "
                               f"{mc.context_length}")
            out.append(tp)
        return out

    def check_block(self, state: Any, token: int) -> int:
        """A draft call's arguments checked: the state's last fed position t."""
        if not self.owns(state):
            raise Ds4Error("a DSpark draft call needs a state from this draft's new_state()")
        t = state.n_tokens - 1
        if t < 0:
            raise Ds4Error("a DSpark draft call needs at least one fed main position")
        if isinstance(token, bool) or not 0 <= int(token) < self.main_config.vocab_size:
            raise Ds4Error(f"DSpark block token {token!r} is outside the vocabulary "
                           f"(0..{self.main_config.vocab_size - 1})")
        return t

    def greedy(self, blk: DraftBlock, token: int, ids: Sequence[int] | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """greedy_chain(blk, token, ids): out [B + 1], logits [B, V], confidence [B]."""
        return greedy_chain(blk, token, ids)

    def routed_bytes_per_row(self) -> int:
        """Bytes of routed experts one more main-model verify row reads."""
        return routed_bytes_per_row(self.main_config, self.model.gguf)

    def call_bytes(self) -> int:
        """Bytes one draft call reads (the stages' dense tensors, the routed experts B rows pick, the shared head
        and B embedding rows)."""
        return call_bytes(self.main_config, self.model.gguf, self.block_size)
