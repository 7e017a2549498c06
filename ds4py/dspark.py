"""Speculation with V4.1's DSpark draft (docs/dspark.md; ds4py.spec drives the rounds, this is the part that is
DSpark's own): one draft call proposes a block of up to B positions with a confidence each.

    spec = DSparkSpec(model, model.open_dspark())   # ds4py.drafts.speculative does this for a V4.1 file with a draft

The paired state holds the main state and the draft's rings, always at the same position: every main position a
step feeds is written into the rings once (`feed`, from the taps of the main step), a verify's rows only once
accepted, so the rings hold exactly the main positions fed (never drafts).
A round at main position n: one draft call on the rings (they hold main positions up to n − 1) gives the block of
B positions after n − 1 with block token 0 = `token`; for i = 0, 1, .. the Markov bias of out_i gives q_{i+1} and
the confidence c_i (σ_{i+1} = sigmoid(c_i), the scheduler's confidence), out_{i+1} = d_{i+1}. The verify is one
main step of [token, d_1..d_k] with all logits and the draft taps of every row (step_taps).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ds4py.errors import Ds4Error
from ds4py.spec import ByteCosts, Drafter, Proposal, SpecModel, SpecState, pair_fingerprint


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class DSparkProposal(Proposal):
    """A round's DSpark block: one draft call; next() reads the block's next position (host work, no call)."""

    def __init__(self, block, token: int):
        self.block, self.i = block, 0
        self.rows, self.steps = 1, 1
        self._read(int(token))

    def _read(self, prev: int) -> None:
        self.logits, c = self.block.position(self.i, prev)
        self.sigma = sigmoid(c)

    def next(self, token: int) -> None:
        self.i += 1
        self._read(int(token))


class DSparkDraft(Drafter):
    """V4.1's DSpark draft as a Drafter (see the module docstring)."""

    kind, what = "dspark", "DSpark rings"

    def __init__(self, model, draft):
        self.model, self.draft, self.path = model, draft, model.path
        self.fingerprint = pair_fingerprint(model.fingerprint, "dspark:" + draft.fingerprint)
        self.limit = draft.block_size
        self._byte_costs: ByteCosts | None = None

    def new_state(self, main: Any) -> SpecState:
        return SpecState(self, main, self.draft.new_state())

    def main_step(self, mains: list, chunks: Sequence[Sequence[int]], all_logits: bool) -> tuple[list, list]:
        return self.model.step_taps(mains, chunks, all_logits)

    def fed(self, states: Sequence[SpecState], chunks: Sequence[np.ndarray], rows: Sequence[np.ndarray]) -> None:
        self.draft.feed([s.draft for s in states], rows)

    def propose(self, state: SpecState, token: int) -> DSparkProposal:
        return DSparkProposal(self.draft.block(state.draft, token), token)

    def settle(self, state: SpecState, n: int, chunk: np.ndarray, rows: np.ndarray, accepted: int) -> None:
        self.draft.feed([state.draft], [rows[:accepted + 1]])       # one ring write per accepted main position

    def target(self, state: SpecState, n: int) -> int:
        return n

    def can_follow(self, state: SpecState, n: int) -> bool:
        return n >= state.draft.rollback_floor

    def save(self, state: SpecState) -> tuple[bytes, np.ndarray, np.ndarray]:
        return self.draft.save_state(state.draft), np.zeros(0, np.float32), np.zeros(0, np.int64)

    def load(self, main: Any, blob: bytes, h: np.ndarray, ids: np.ndarray) -> SpecState:
        d = self.draft.load_state(blob)
        if d.n_tokens != main.n_tokens:
            raise Ds4Error(f"this speculative state is inconsistent: the DSpark rings hold {d.n_tokens} positions, "
                           f"the main state {main.n_tokens}")
        return SpecState(self, main, d)

    def byte_costs(self) -> ByteCosts:
        """From the file's bytes: a verify of r rows reads the backbone once and r rows' routed experts; a draft
        call reads the draft (call_bytes), a further block position nothing; a plain step the backbone."""
        if self._byte_costs is None:
            routed, call = self.draft.routed_bytes_per_row(), self.draft.call_bytes()
            self._byte_costs = ByteCosts(int(self.model.weight_bytes_per_token()), int(routed), int(call), int(call),
                                         chain_bytes=0)
        return self._byte_costs


class DSparkSpec(SpecModel):
    """A V4.1 model with its DSpark draft (SpecModel with DSparkDraft); `draft` the draft."""

    def __init__(self, model, draft, fixed_k: int | None = None):
        super().__init__(model, DSparkDraft(model, draft), fixed_k)
        self.draft = draft
