"""One request's answer as it is sampled (`Completion`) and the events it streams (`TokenEvent`, `DoneEvent`):
what the driver (ds4py.driver) pushes each sampled token through, below the session and the server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ds4py.sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str


@dataclass(frozen=True)
class DoneEvent:
    finish_reason: Literal["stop", "length", "cancelled"]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    stop_string: str | None = None


Event = TokenEvent | DoneEvent


class Completion:
    """One request's answer as it is sampled: its sampler (a seeded request is reproducible whatever runs beside
    it), and what each sampled token becomes — a UTF-8-safe TokenEvent, with text that could still start a stop
    string held back — until a DoneEvent (EOS, a stop string, max_tokens or a full context)."""

    def __init__(self, tokenizer, params: SamplingParams, prompt_tokens: int, cached_tokens: int, ctx_size: int):
        self.sampler = Sampler(params)
        self.stream = tokenizer.stream()
        self.eos = None if params.ignore_eos else tokenizer.eos_id
        self.stops = params.stop
        self.limit = ctx_size - prompt_tokens              # prompt + completion <= context
        if params.max_tokens is not None:
            self.limit = min(self.limit, params.max_tokens)
        self.prompt_tokens, self.cached_tokens = prompt_tokens, cached_tokens
        self.n = 0                     # tokens sampled
        self.last: int | None = None   # the last one (not yet fed to the model)
        self.done: DoneEvent | None = None
        self._held = ""                # decoded text not yet emitted (a possible stop-string start)

    def sample(self, logits: np.ndarray) -> int:
        return self.sampler.sample(logits)

    def push(self, token: int) -> TokenEvent:
        """The event of a sampled token; sets `done` when it ends the answer."""
        self.last, self.n = int(token), self.n + 1
        if self.last == self.eos:
            self.done = DoneEvent("stop", self.prompt_tokens, self.cached_tokens, self.n)
            return TokenEvent(self.last, self._held + self.stream.flush())
        self._held += self.stream.push(self.last)
        hit = _find_stop(self._held, self.stops)
        if hit is not None:
            at, s = hit
            self.done = DoneEvent("stop", self.prompt_tokens, self.cached_tokens, self.n, stop_string=s)
            return TokenEvent(self.last, self._held[:at])
        if self.n >= self.limit:
            self.done = DoneEvent("length", self.prompt_tokens, self.cached_tokens, self.n)
            return TokenEvent(self.last, self._held + self.stream.flush())
        keep = _stop_prefix_len(self._held, self.stops)
        text, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return TokenEvent(self.last, text)

    def cancel(self) -> DoneEvent:
        self.done = DoneEvent("cancelled", self.prompt_tokens, self.cached_tokens, self.n)
        return self.done


def _find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string in text (ties: the shorter, which completed first)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i, len(s)) < (best[0], len(best[1]))):
            best = (i, s)
    return best


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of some stop string (must be held back)."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return keep
