"""Speculation with V4's MTP block (ds4py.spec drives the rounds; this is the part that is the MTP block's own):
one draft token a block step, chained from the block's own output state.

    spec = MtpSpec(model, mtp)                   # a SpecModel whose Drafter is MtpDraft

The paired state holds the main state, the MTP state and a ring of the main model's last final HC states and
token ids by position: the MTP block's pending inputs (positions [draft.n_tokens, n_tokens) always sit in the
ring). The block lags one position behind the main model (row j reads h_j and token j + 1) and catches up
lazily: a draft's first step runs the pending rows (h_j, t_{j+1}) up to j = n − 1, the last one with the round's
`token`, in one batch; chained steps (the block's own output state and d_i, positions n..n+k−2) give d_2..d_k and
are rolled back afterwards, so the MTP state only ever keeps rows computed from the main model's h.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ds4py.errors import Ds4Error
from ds4py.spec import (F32, ByteCosts, Drafter, Proposal, SpecModel, SpecState, pair_fingerprint)


# The pending rows the ring holds at least. A plain step's row is caught up later, in a batch: on the trained tiny
# model's CPU reference an MTP step costs 0.30 ms a row in batches of 17 (the ring was rollback_horizon + 2 = 18)
# and 0.16 ms in batches of 64, against a plain step of ~10 ms: the catch-up is what plain decoding under the
# scheduler pays beyond plain decoding without a draft (issue 38, third session). 64 rows of [hc, dim] float32 is
# 4 MB per sequence at V4 Flash's widths.
CATCH_UP = 64


class MtpProposal(Proposal):
    """A round's MTP chain: the first step ran the pending rows; each next() one chained step."""

    def __init__(self, drafter: "MtpDraft", state: SpecState, token: int):
        n = state.n_tokens
        hs, ids = drafter.rows(state, state.draft.n_tokens, n, n, np.zeros((0,) + state.h.shape[1:], F32),
                               np.asarray([token], np.int64))
        self.mtp, self.state, self.n = drafter.mtp, state, n
        self.rows, self.steps, self.sigma = len(hs), 1, None
        lg, self.out = self.mtp.step([state.draft], [hs], [ids])
        self.logits = lg[0]

    def next(self, token: int) -> None:
        lg, self.out = self.mtp.step([self.state.draft], [self.out[0][-1:]], [[token]])
        self.logits = lg[0]
        self.steps += 1

    def close(self) -> None:
        self.state.draft.truncate(self.n)          # keep the rows computed from the main model's h only


class MtpDraft(Drafter):
    """V4's MTP block as a Drafter (see the module docstring)."""

    kind, what = "mtp", "MTP draft state"

    def __init__(self, model, mtp):
        self.model, self.mtp, self.path = model, mtp, mtp.path
        self.fingerprint = pair_fingerprint(model.fingerprint, mtp.fingerprint)
        self.limit = mtp.rollback_horizon + 1       # the chain (k − 1 rows) within the block's own horizon
        # ring: positions n−1..n+k of a round and R of rollback, and at least CATCH_UP rows: while the scheduler
        # decodes plainly the block catches up when the ring would overflow, in one batch of that many rows
        self.capacity = max(model.rollback_horizon + 2, CATCH_UP)

    def new_state(self, main: Any) -> SpecState:
        cfg = self.model.config
        return SpecState(self, main, self.mtp.new_state(), np.zeros((self.capacity, cfg.hc_mult, cfg.dim), F32),
                         np.zeros(self.capacity, np.int64))

    def main_step(self, mains: list, chunks: Sequence[Sequence[int]], all_logits: bool) -> tuple[list, list]:
        return self.model.step_hidden(mains, chunks, all_logits)

    def fed(self, states: Sequence[SpecState], chunks: Sequence[np.ndarray], rows: Sequence[np.ndarray]) -> None:
        """Store the chunks' rows in the ring; the MTP block catches up lazily (the next draft runs the pending
        rows in one batch) until the oldest would fall out of the ring, as after a long prefill chunk."""
        todo = []
        for s, chunk, h in zip(states, chunks, rows):
            n1 = s.main.n_tokens
            n0, d = n1 - len(chunk), s.draft.n_tokens
            if d < n1 - self.capacity + 1:
                todo.append((s, self.rows(s, d, n1 - 1, n0, h, chunk)))
            self._store(s, n0, chunk, h)
        todo = [(s, r) for s, r in todo if r is not None]
        if todo:
            self.mtp.step([s.draft for s, _ in todo], [r[0] for _, r in todo], [r[1] for _, r in todo], logits=False)

    def prepare(self, state: SpecState, token: int) -> None:
        """The prompt's pending rows but the last (which the first proposal runs with the round's token)."""
        n = state.n_tokens
        hs, ids = self.rows(state, state.draft.n_tokens, n, n, np.zeros((0,) + state.h.shape[1:], F32),
                            np.asarray([token], np.int64))
        if len(hs) > 1:
            self.mtp.step([state.draft], [hs[:-1]], [ids[:-1]], logits=False)

    def propose(self, state: SpecState, token: int) -> MtpProposal:
        return MtpProposal(self, state, token)

    def settle(self, state: SpecState, n: int, chunk: np.ndarray, rows: np.ndarray, accepted: int) -> None:
        self._store(state, n, chunk, rows)         # the MTP state stays at n with h_n..h_{n+a} pending

    def rows(self, s: SpecState, j0: int, j1: int, n0: int, h: np.ndarray, chunk: np.ndarray):
        """MTP inputs for positions [j0, j1): h_j and t_{j+1}, from the ring (below n0) or h / chunk (from n0)."""
        if j1 <= j0:
            return None
        js = np.arange(j0, j1)
        nxt, cap = js + 1, self.capacity
        hs = np.concatenate([s.h[js[js < n0] % cap], h[js[js >= n0] - n0]])
        ids = np.concatenate([s.ids[nxt[nxt < n0] % cap], chunk[nxt[nxt >= n0] - n0]])
        return hs, ids

    def _store(self, s: SpecState, n0: int, chunk: np.ndarray, h: np.ndarray) -> None:
        keep = np.arange(max(0, len(chunk) - self.capacity), len(chunk))
        slots = (n0 + keep) % self.capacity
        s.h[slots], s.ids[slots] = h[keep], chunk[keep]

    def target(self, state: SpecState, n: int) -> int:
        """MTP positions kept when the main state holds n tokens: those whose next token is among them."""
        return min(state.draft.n_tokens, max(n - 1, 0))

    def can_follow(self, state: SpecState, n: int) -> bool:
        d = self.target(state, n)
        if d < state.draft.n_tokens and d < state.draft.rollback_floor:
            return False
        return n == 0 or d >= state.main.n_written - len(state.ids)      # the pending rows [d, n) are in the ring

    def save(self, state: SpecState) -> tuple[bytes, np.ndarray, np.ndarray]:
        return self.mtp.save_state(state.draft), state.h, state.ids

    def load(self, main: Any, blob: bytes, h: np.ndarray, ids: np.ndarray) -> SpecState:
        d = self.mtp.load_state(blob)
        cfg = self.model.config
        if h.shape != (self.capacity, cfg.hc_mult, cfg.dim) or ids.shape != (self.capacity,):
            raise Ds4Error(f"this speculative state holds a pending ring of {list(h.shape)}, this pair needs "
                           f"{[self.capacity, cfg.hc_mult, cfg.dim]}")
        if not (d.n_tokens <= max(main.n_tokens - 1, 0) and main.n_tokens - d.n_tokens <= self.capacity):
            raise Ds4Error(f"this speculative state is inconsistent: the MTP state holds {d.n_tokens} positions, "
                           f"the main state {main.n_tokens}")
        return SpecState(self, main, d, h, ids)

    def byte_costs(self) -> ByteCosts:
        """From the bytes each part of the pair reads (Model.weight_bytes: the same figures on every backend): a
        draft step reads the MTP block and the head; a plain step the model and the block's catch-up row."""
        w = self.model.weight_bytes()
        return ByteCosts(int(w.decode), int(w.routed), int(self.mtp.weight_bytes_per_token()), int(w.head))


class MtpSpec(SpecModel):
    """A main model with its MTP draft block (SpecModel with MtpDraft); `mtp` the block, `capacity` its ring."""

    def __init__(self, model, mtp, fixed_k: int | None = None):
        super().__init__(model, MtpDraft(model, mtp), fixed_k)
        self.mtp, self.capacity = mtp, self.drafter.capacity
