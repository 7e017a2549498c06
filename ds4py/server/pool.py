"""The resident sessions of `serve` (`--sessions N`, default 1): N Sessions (each one live KV state of the engine contract and a
few snapshots) over one model, sharing one disk KV cache, and which of them a new request goes to.

Routing. A request goes to the idle session that serves the most of its prompt from its own history (its live
state extended or rolled back, or one of its snapshots), counting as lost the live tokens that the request
throws away (a session holding another conversation is not worth taking for a shared two-token chat prefix).
When no session is worth taking, or the disk cache holds a longer prefix, it goes to an empty session, else to
the least recently used idle one, whose conversation is evicted (checkpointed to the disk cache first, when
there is one: Session.start). A request waits while every session is busy: an active request is never evicted.

Engine thread only (not thread-safe), like the sessions.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from ds4py.errors import Ds4Error
from ds4py.session import Session, common_prefix

from .affinity import Affinity

DEFAULT_SNAPSHOTS = 2        # per resident session: the last two prompts' snapshot points
DEFAULT_PREFILL_CHUNK = 128  # prompt tokens per scheduler step (and the chunk grid of every prompt)


class SessionPool:
    """prefill_chunk: the prompt tokens one scheduler step may prefill. An int is a fixed grid (a prompt's chunk
    boundaries are multiples of it, never where the load cut them: what keeps greedy answers of concurrent
    requests equal to sequential ones); an object with next_len() and record(n_tokens, seconds) (the server's
    PrefillPacer, with one session) sizes each step's chunk to a time instead."""

    def __init__(self, model, tokenizer, n: int, ctx_size: int | None = None, max_snapshots: int = DEFAULT_SNAPSHOTS,
                 disk=None, prefill_chunk=DEFAULT_PREFILL_CHUNK, sessions: Sequence[Session] | None = None):
        if sessions is None and (not isinstance(n, int) or n < 1):
            raise Ds4Error(f"--sessions must be an integer >= 1, got {n!r}")
        if isinstance(prefill_chunk, bool) or (isinstance(prefill_chunk, int) and prefill_chunk < 1) \
                or not isinstance(prefill_chunk, int) and not callable(getattr(prefill_chunk, "next_len", None)):
            raise Ds4Error(f"the prefill chunk must be an integer >= 1 token, got {prefill_chunk!r}")
        self.model, self.tokenizer, self.disk = model, tokenizer, disk
        self.prefill_chunk = prefill_chunk
        self.sessions = list(sessions) if sessions is not None else \
            [Session(model, tokenizer, ctx_size, max_snapshots=max_snapshots, disk=disk) for _ in range(n)]
        n = len(self.sessions)
        self.ctx_size = self.sessions[0].ctx_size
        self.vocab_size = self.sessions[0].vocab_size
        self.busy = [False] * n
        self._clock = itertools.count(1)
        self._used = [0] * n             # when each session was last acquired (0: never)
        self.affinity = Affinity()       # session key -> the session that ran it last
        self.last_route = "none"         # how route() chose: "hit" (the key's session), "fallback", "none"
        self.last_displaced: str | None = None   # the key whose conversation the last acquire() took over

    @classmethod
    def of(cls, session: Session) -> "SessionPool":
        """A pool of one existing session (its model, tokenizer, disk cache and prefill chunking)."""
        return cls(session.model, session.tokenizer, 1, disk=session.disk, prefill_chunk=session.prefill_chunk,
                   sessions=[session])

    def __len__(self) -> int:
        return len(self.sessions)

    def route(self, prompt: Sequence[int], key: str | None = None) -> int | None:
        """The session a prompt should run in, or None when every session is busy. Pure. With a session key
        (server.affinity) its own session comes first: `last_route` says whether it did ("hit")."""
        prompt = list(prompt)

        def by_prefix() -> int | None:
            slot = self._route_by_prefix(prompt)
            if key is not None and slot is not None and self.affinity.owner(slot) not in (None, key):
                empty = [i for i, b in enumerate(self.busy) if not b and not self.sessions[i].histories()]
                if empty:               # another conversation's session: not while an empty one is idle
                    return empty[0]
            return slot
        slot, self.last_route = self.affinity.choose(
            key, lambda i: not self.busy[i], lambda i: self.sessions[i].reuse(prompt, disk=False)[0] > 0, by_prefix)
        return slot

    def _route_by_prefix(self, prompt: list[int]) -> int | None:
        idle = [i for i, b in enumerate(self.busy) if not b]
        if not idle:
            return None
        best, best_score = None, 0
        for i in idle:
            s = self.sessions[i]
            n, src = s.reuse(prompt, disk=False)
            if n == 0:
                continue
            lost = 0 if src == "live" else len(s.tokens) - min(len(s.tokens), common_prefix(s.tokens, prompt))
            score = n - lost
            if score > best_score or (score == best_score and best is not None and self._used[i] > self._used[best]):
                best, best_score = i, score
        on_disk = self.disk.reuse(prompt) if self.disk is not None else None
        if best is not None and best_score >= (on_disk[1] if on_disk is not None else 0):
            return best
        empty = [i for i in idle if not self.sessions[i].histories()]
        return empty[0] if empty else min(idle, key=lambda i: self._used[i])

    def acquire(self, i: int, key: str | None = None) -> Session:
        assert not self.busy[i], f"session {i} is busy"
        self.last_displaced = self.affinity.bind(key, i)
        self.busy[i] = True
        self._used[i] = next(self._clock)
        return self.sessions[i]

    def release(self, i: int) -> None:
        self.busy[i] = False

    def histories(self) -> list[tuple[str, Sequence[int]]]:
        return [(f"session {i}'s {what}", toks) for i, s in enumerate(self.sessions) for what, toks in s.histories()]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.sessions)
