"""One live KV state and the generation loop around it, with prompt-prefix reuse.

    session = Session(model, tokenizer, ctx_size=32768)
    for ev in session.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=64)):
        if isinstance(ev, TokenEvent): print(ev.text, end="")
        else: print(ev.finish_reason, ev.cached_tokens)

Reuse. The session remembers which tokens its live state has consumed. A prompt that extends them prefills
only the new suffix. A prompt that diverges from them within the state's rollback horizon (a regenerated
answer, an edited last message: `state.rollback_floor`) truncates the live state to the common prefix, in
O(1). Where truncation cannot reach, the session keeps a few snapshots (copies) and restores the longest one
that is a prefix of the new prompt. A snapshot is taken just before the *last* prompt token of each request:
a thinking-mode chat re-renders the previous turn as `<｜Assistant｜></think>answer` where the prompt ended in
`<｜Assistant｜><think>`, so the next prompt diverges exactly at that last token (usually further back than
the horizon), and a repeated prompt (retry, regenerate) reuses all but one token. Whatever the source, the
longest reuse wins; the live state wins ties (no copy).

Generation. The last sampled token is never decoded (nobody needs its logits), so after a request the live
tokens are prompt + completion[:-1]; the next turn prefills that token as part of its suffix. Every sampled
token, EOS included, yields one TokenEvent (completion_tokens == number of TokenEvents); EOS never contributes
its spelling, only text still held back. Text is a UTF-8-safe delta; text that could still become one of the
stop strings is held back until it cannot, and the stop string itself is never emitted.

Not thread-safe: one generate() at a time per session (the server serialises requests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, Sequence

import numpy as np

from ds4py.errors import ContextLengthError, Ds4Error
from ds4py.model import device_generation
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


@dataclass
class SessionStats:
    """Running totals since the session was created (reset() keeps them): what tests and --verbose read."""
    requests: int = 0
    prompt_tokens: int = 0       # prompt tokens asked for
    cached_tokens: int = 0       # of those, reused from the live state or a snapshot
    prefilled_tokens: int = 0    # prompt tokens stepped (model.step)
    prefill_calls: int = 0
    decoded_tokens: int = 0      # one-token steps of sampled tokens
    snapshots_taken: int = 0
    snapshots_restored: int = 0
    truncations: int = 0         # live state rolled back to a diverging prompt's common prefix
    spec_rounds: int = 0         # speculative verify rounds (ds4py.spec), their drafts and accepted drafts
    spec_drafted: int = 0
    spec_accepted: int = 0


@dataclass(eq=False)          # compared by identity (list.index), never by its arrays
class _Snapshot:
    tokens: tuple[int, ...]
    state: object
    logits: np.ndarray | None    # after the last of `tokens`, so an exact match needs no prefill (None when the
                                 # live state had been truncated there: serves longer prompts only)


class Session:
    def __init__(self, model, tokenizer, ctx_size: int | None = None, max_snapshots: int = 4,
                 prefill_chunk: int = 2048):
        model_ctx = int(getattr(model.config, "context_length", 0) or 0)
        if ctx_size is None:
            ctx_size = model_ctx
        if ctx_size < 2:
            raise Ds4Error(f"context size must be at least 2 tokens, got {ctx_size}")
        if model_ctx and ctx_size > model_ctx:
            raise Ds4Error(f"context size {ctx_size} exceeds the model's context length {model_ctx}")
        self.model = model
        self.tokenizer = tokenizer
        self.ctx_size = int(ctx_size)
        self.vocab_size = int(model.config.vocab_size)
        self.max_snapshots = max_snapshots
        # cancellation is checked between chunks of a long prefill. An int is a fixed chunk; an object with
        # next_len() and record(n_tokens, seconds) sizes each chunk (the server's PrefillPacer bounds its time)
        self.prefill_chunk = prefill_chunk
        self.stats = SessionStats()
        self._busy = False
        self.spec_stats = None
        self.reset()

    # ---- cache bookkeeping -----------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the live state and every snapshot (the next prompt is prefilled from scratch)."""
        self.state = None
        self.tokens: list[int] = []
        self._logits: np.ndarray | None = None
        self._snapshots: list[_Snapshot] = []   # least recently used first

    def prompt_cache_tokens(self, prompt_ids: Sequence[int]) -> int:
        """How many leading tokens of this prompt would be reused instead of prefilled. Read-only; the session
        is not thread-safe, so call it from the thread that runs generate()."""
        return self._best_source(list(prompt_ids))[0]

    def _live_is_consistent(self) -> bool:
        """False when a model call was interrupted between advancing the state and its bookkeeping."""
        return self.state is not None and self.state.n_tokens == len(self.tokens)

    def _best_source(self, prompt: list[int]) -> tuple[int, _Snapshot | str | None]:
        """(tokens reused, source): "live" (extend the live state), "truncate" (roll the live state back to
        the common prefix), a snapshot to restore, or None (start over). The longest reuse wins. Pure."""
        best, src = 0, None
        if self._live_is_consistent():
            live = self.tokens
            k = _common_prefix(live, prompt)
            if k == len(live) and (k < len(prompt) or self._logits is not None):
                best, src = k, "live"
            else:                                  # keep at least one prompt token to step (its logits)
                r = min(k, len(prompt) - 1)
                if r > 0 and r >= self.state.rollback_floor:
                    best, src = r, "truncate"
        for snap in self._snapshots:
            n = len(snap.tokens)
            if n > best and (n < len(prompt) or (n == len(prompt) and snap.logits is not None)) \
                    and snap.tokens == tuple(prompt[:n]):
                best, src = n, snap
            elif n > best:
                # a copy of the snapshot rolled back within its horizon: the previous answer rendered to nothing
                # (its reasoning dropped, or no assistant message at all) ends the next prompt's common prefix a
                # token or two before the snapshot point, at the old `<｜Assistant｜>`
                r = min(_common_prefix(snap.tokens, prompt), len(prompt) - 1)
                if r > best and r >= snap.state.rollback_floor:
                    best, src = r, snap
        return best, src

    def _take_snapshot(self) -> None:
        key = tuple(self.tokens)
        for i, snap in enumerate(self._snapshots):
            if snap.tokens == key:                 # already have it: mark as recently used
                self._snapshots.append(self._snapshots.pop(i))
                return
        logits = None if self._logits is None else self._logits.copy()
        self._snapshots.append(_Snapshot(key, self.state.copy(), logits))
        self.stats.snapshots_taken += 1
        del self._snapshots[:-self.max_snapshots]

    # ---- model calls: keep (state, tokens, logits) consistent even if a call is interrupted --------------

    def _prefill(self, ids: list[int]) -> None:
        try:
            logits = self.model.step([self.state], [ids])[0]
        except BaseException:
            self._drop_live()                     # a half-advanced state must never be reused
            raise
        self.tokens.extend(ids)
        self._logits = np.asarray(logits)
        self.stats.prefilled_tokens += len(ids)
        self.stats.prefill_calls += 1

    def _decode(self, token: int) -> None:
        try:
            logits = self.model.step([self.state], [[token]])[0]
        except BaseException:
            self._drop_live()
            raise
        self.tokens.append(token)
        self._logits = np.asarray(logits)
        self.stats.decoded_tokens += 1

    def _drop_live(self) -> None:
        self.state, self.tokens, self._logits = None, [], None

    # ---- generation -------------------------------------------------------------------------------------

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """Validate a prompt (ContextLengthError / Ds4Error) and return it as a list of ints."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise Ds4Error("the prompt is empty")
        if len(prompt) + 1 > self.ctx_size:
            raise ContextLengthError(f"the prompt has {len(prompt)} tokens but the context holds {self.ctx_size} "
                                     f"(prompt + at least 1 generated token)")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise Ds4Error(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return prompt

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 cancelled: Callable[[], bool] | None = None) -> Iterator[Event]:
        """Validate now (errors raise here, before any event), then stream TokenEvents and one DoneEvent."""
        prompt = self.check_prompt(prompt_ids)
        if self._busy:
            raise RuntimeError("this session is already generating (one request at a time)")
        return self._run(prompt, params, cancelled or (lambda: False))

    def _run(self, prompt: list[int], params: SamplingParams, cancelled: Callable[[], bool]) -> Iterator[Event]:
        if self._busy:
            raise RuntimeError("this session is already generating (one request at a time)")
        self._busy = True
        try:
            yield from self._generate(prompt, params, cancelled)
        finally:
            self._busy = False

    def _prepare(self, prompt: list[int], cancelled: Callable[[], bool]) -> tuple[int, bool]:
        """Bring the live state to `prompt`. Returns (cached tokens, completed)."""
        if self.state is not None and not self._live_is_consistent():
            self._drop_live()
        cached, src = self._best_source(prompt)
        if isinstance(src, _Snapshot):
            self.state, self.tokens = src.state.copy(), list(src.tokens)
            self._logits = None if src.logits is None else src.logits.copy()
            if cached < len(src.tokens):              # restored, then rolled back to the common prefix
                self.state.truncate(cached)
                self.tokens, self._logits = self.tokens[:cached], None
                self.stats.truncations += 1
            self._snapshots.append(self._snapshots.pop(self._snapshots.index(src)))
            self.stats.snapshots_restored += 1
        elif src == "truncate":
            self.state.truncate(cached)
            self.tokens, self._logits = self.tokens[:cached], None
            self.stats.truncations += 1
        elif src is None:
            self.state, self.tokens, self._logits = self.model.new_state(), [], None
        self.stats.cached_tokens += cached

        split = len(prompt) - 1                   # snapshot point: before the last prompt token
        while len(self.tokens) < len(prompt):
            if cancelled():
                return cached, False
            n = len(self.tokens)
            if n == split and split > 0:
                self._take_snapshot()
            paced = not isinstance(self.prefill_chunk, int)
            end = min(len(prompt), n + (self.prefill_chunk.next_len() if paced else self.prefill_chunk))
            if n < split:
                end = min(end, split)
            t0 = time.perf_counter()
            self._prefill(prompt[n:end])
            if paced:
                self.prefill_chunk.record(end - n, time.perf_counter() - t0)
        return cached, True

    def _generate(self, prompt: list[int], params: SamplingParams,
                  cancelled: Callable[[], bool]) -> Iterator[Event]:
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt)
        cached, ready = self._prepare(prompt, cancelled)
        if not ready:
            yield DoneEvent("cancelled", len(prompt), cached, 0)
            return

        sampler = Sampler(params)
        stream = self.tokenizer.stream()
        eos = None if params.ignore_eos else self.tokenizer.eos_id
        limit = self.ctx_size - len(prompt)       # prompt + completion <= context
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens)
        tokens = self._tokens(sampler, params, limit)
        try:
            yield from self._events(tokens, prompt, params, cached, cancelled, stream, eos, limit)
        finally:
            tokens.close()                        # (a device generation leaves the state consistent here)

    def _events(self, tokens: Iterator[int], prompt: list[int], params: SamplingParams, cached: int,
                cancelled: Callable[[], bool], stream, eos: int | None, limit: int) -> Iterator[Event]:
        held, n = "", 0                           # decoded text not yet emitted (possible stop-string start)
        while True:
            if cancelled():                       # before every token: a gone client stops within one token
                yield DoneEvent("cancelled", len(prompt), cached, n)
                return
            last = next(tokens)
            n += 1
            if last == eos:
                yield TokenEvent(last, held + stream.flush())
                yield DoneEvent("stop", len(prompt), cached, n)
                return
            held += stream.push(last)
            hit = _find_stop(held, params.stop)
            if hit is not None:
                at, s = hit
                yield TokenEvent(last, held[:at])
                yield DoneEvent("stop", len(prompt), cached, n, stop_string=s)
                return
            if n >= limit:
                yield TokenEvent(last, held + stream.flush())
                yield DoneEvent("length", len(prompt), cached, n)
                return
            keep = _stop_prefix_len(held, params.stop)
            text, held = held[:len(held) - keep], held[len(held) - keep:]
            yield TokenEvent(last, text)

    # ---- the speculative-decoding hook (ds4py.spec, docs/spec.md): the only place generation knows of it ----

    def _speculation(self, params: SamplingParams):
        """A model with `new_request` (ds4py.spec.SpecModel) decodes in speculative rounds; others one token a
        step. `spec_stats` is the running request's speculation statistics (None without speculation)."""
        new = getattr(self.model, "new_request", None)
        spec = None if new is None else new(params)
        self.spec_stats = None if spec is None else spec.stats
        return spec

    def _spec_tokens(self, sampler: Sampler, last: int, spec, limit: int) -> Iterator[int]:
        """The tokens after `last` in speculative rounds: each round's accepted drafts and its next token (the
        state then holds every one of them but the last, as after plain steps). Closed inside a round, the fed
        tokens past the last one taken are forgotten."""
        n = 1
        while True:
            queue = self._round(sampler, last, spec, limit - n)
            try:
                while queue:
                    last = queue.pop(0)
                    n += 1
                    yield last
            finally:
                self._unfeed(len(queue))

    def _round(self, sampler: Sampler, last: int, spec, remaining: int) -> list[int]:
        try:
            r = spec.round(self.state, last, sampler, remaining)
        except BaseException:
            self._drop_live()
            raise
        self.tokens += [last] + r.tokens[:-1]
        self._logits = np.asarray(r.logits)
        self.stats.decoded_tokens += r.stats.plain_steps
        self.stats.spec_rounds += r.stats.rounds
        self.stats.spec_drafted += r.stats.drafted
        self.stats.spec_accepted += r.stats.accepted
        return list(r.tokens)

    def _unfeed(self, n: int) -> None:
        """Generation stopped inside a round: forget the n fed tokens past the answer's last one (a rollback
        within the round's own rows, so always exact)."""
        if n and self.state is not None and self._live_is_consistent():
            self.state.truncate(self.state.n_tokens - n)
            del self.tokens[-n:]
            self._logits = None

    def _tokens(self, sampler: Sampler, params: SamplingParams, limit: int) -> Iterator[int]:
        """The sampled tokens, one per next(). The first comes from the prompt's logits (CPU sampler). The rest:
        from the backend's device-side generation when it has one (ds4py.model.device_generation: the host
        never sees logits), else from step() and the CPU sampler (the reference path)."""
        last = sampler.sample(self._logits)
        yield last
        spec = self._speculation(params)
        if spec is not None:
            yield from self._spec_tokens(sampler, last, spec, limit)
            return
        gen = device_generation(self.model)
        if gen is None:
            while True:
                self._decode(last)
                last = sampler.sample(self._logits)
                yield last
        if limit <= 1:
            return
        inner = gen(self.state, last, params, limit - 1)
        try:
            for t in inner:                        # t arrives once `last` has been fed
                self.tokens.append(last)
                self._logits = None
                self.stats.decoded_tokens += 1
                last = t
                yield t
        except GeneratorExit:
            raise
        except BaseException:
            inner.close()
            self._drop_live()                      # a half-advanced state must never be reused
            raise
        finally:
            inner.close()                          # the state's counters are final from here on


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return int(np.argmin(np.asarray(a[:n]) == np.asarray(b[:n])))


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
