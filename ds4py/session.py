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
the horizon), and a repeated prompt (retry, regenerate) reuses all but one token. With a disk KV cache
(ds4py.disk_cache) its checkpoints are one more source. Whatever the source, the longest reuse wins; the live
state wins ties (no copy), then snapshots, then the disk.

Checkpoints (disk cache only; the policy is disk_cache.KVCachePolicy): *cold* when a long prompt that started from
nothing reaches its cold point (a chunk boundary a little before its end), *continued* whenever the state
reaches a multiple of the policy's interval, *evict* before an unrelated prompt replaces the live state, and
*shutdown* from close(). Prefill chunks end at those points, so the state is saved exactly there.

Generation. The last sampled token is never decoded (nobody needs its logits), so after a request the live
tokens are prompt + completion[:-1]; the next turn prefills that token as part of its suffix. Every sampled
token, EOS included, yields one TokenEvent (completion_tokens == number of TokenEvents); EOS never contributes
its spelling, only text still held back. Text is a UTF-8-safe delta; text that could still become one of the
stop strings is held back until it cannot, and the stop string itself is never emitted (`Completion`).

Two drivers. `generate()` runs one request to its end, calling the model itself (run, chat; the loop is
`_generate`). The server's scheduler (ds4py/server/scheduler.py, whatever `serve --sessions` is) drives its
sessions through the same steps instead: `start(prompt)`, `next_chunk(...)` and `advance(ids, logits)` around
its own batched model.step (or `fed(token)` under a device-side generation), a `Completion` per request, and
`end(done)` when the request is over.

Not thread-safe: one request at a time per session (the server serialises requests).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Sequence

import numpy as np

from ds4py.errors import ContextLengthError, Ds4Error
from ds4py.contract import device_generation
from ds4py.sampling import Sampler, SamplingParams

log = logging.getLogger("ds4py.session")


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
    cached_tokens: int = 0       # of those, reused from the live state, a snapshot or the disk
    prefilled_tokens: int = 0    # prompt tokens stepped (model.step)
    prefill_calls: int = 0
    decoded_tokens: int = 0      # one-token steps of sampled tokens
    snapshots_taken: int = 0
    snapshots_restored: int = 0
    truncations: int = 0         # live state rolled back to a diverging prompt's common prefix
    spec_rounds: int = 0         # speculative verify rounds (ds4py.spec), their drafts and accepted drafts
    spec_drafted: int = 0
    spec_accepted: int = 0
    disk_restored: int = 0       # checkpoints loaded from the disk cache
    checkpoints: int = 0         # checkpoints handed to the disk cache
    finished: dict = field(default_factory=dict)   # finish reason -> answers that ended so (end())


@dataclass(eq=False)          # compared by identity (list.index), never by its arrays
class _Snapshot:
    tokens: tuple[int, ...]
    state: object
    logits: np.ndarray | None    # after the last of `tokens`, so an exact match needs no prefill (None when the
                                 # live state had been truncated there: serves longer prompts only)


# Where a prompt's reused tokens come from (Session.last_source; the server's /metrics counts them)
SOURCES = ("live", "rollback", "snapshot", "disk", "none")


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


class Session:
    def __init__(self, model, tokenizer, ctx_size: int | None = None, max_snapshots: int = 4,
                 prefill_chunk: int = 2048, disk=None):
        model_ctx = int(model.config.context_length)
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
        self.disk = disk                           # a disk_cache.DiskCache shared by the sessions of a server, or None
        self.stats = SessionStats()
        self.last_source = "none"                  # where the last prompt's reused tokens came from (SOURCES)
        self.last_cached = 0                       # and how many
        self._busy = False
        self.spec_stats = None
        self._plan: tuple[int, ...] = ()           # split points of the prompt being prefilled (next_chunk)
        self._cold: int | None = None              # its cold checkpoint point
        self._prompt_len = 0                       # length of the last prompt started (what "unrelated" means)
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
        return self.reuse(list(prompt_ids))[0]

    def nbytes(self) -> int:
        """Bytes of KV held: the live state and the snapshots."""
        live = self.state.nbytes() if self.state is not None else 0
        return live + sum(s.state.nbytes() for s in self._snapshots)

    def histories(self) -> list[tuple[str, Sequence[int]]]:
        """(what, tokens) of every token history this session could serve from: the live state, the snapshots.
        For the server's report of where a missed prompt diverged."""
        out = [("live state", self.tokens)] if self._live_is_consistent() and self.tokens else []
        return out + [("snapshot", snap.tokens) for snap in self._snapshots]

    def _live_is_consistent(self) -> bool:
        """False when a model call was interrupted between advancing the state and its bookkeeping."""
        return self.state is not None and self.state.n_tokens == len(self.tokens)

    def reuse(self, prompt: list[int], disk: bool = True) -> tuple[int, _Snapshot | str | object | None]:
        """(tokens reused, source): "live" (extend the live state), "truncate" (roll the live state back to
        the common prefix), a snapshot to restore, a disk-cache entry to load, or None (start over). The
        longest reuse wins. Pure."""
        best, src = 0, None
        if self._live_is_consistent():
            live = self.tokens
            k = common_prefix(live, prompt)
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
                r = min(common_prefix(snap.tokens, prompt), len(prompt) - 1)
                if r > best and r >= snap.state.rollback_floor:
                    best, src = r, snap
        if disk and self.disk is not None:
            found = self.disk.reuse(prompt)        # a prefix checkpoint, or one truncated to the shared prefix
            if found is not None and found[1] > best:
                best, src = found[1], found[0]
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

    # ---- disk checkpoints ---------------------------------------------------------------------------------

    def checkpoint(self, reason: str, block: bool = False) -> bool:
        """Hand the live state to the disk cache (if any, if long enough and not there already)."""
        if self.disk is None or not self._live_is_consistent() or len(self.tokens) < self.disk.policy.min_tokens \
                or self.disk.has(self.tokens):
            return False
        if self.disk.save(reason, self.tokens, self.model.save_state(self.state), self._logits, block=block,
                          floor=self.state.rollback_floor):
            self.stats.checkpoints += 1
            return True
        return False

    def close(self) -> None:
        """The server is stopping: checkpoint the live state (waits for the disk)."""
        self.checkpoint("shutdown", block=True)

    def _leaving(self, prompt: list[int], src) -> None:
        """Before the live state is replaced or rolled back: checkpoint it when the new prompt is unrelated (it
        does not keep what the last prompt held, bar its last token: that one is a thinking turn's re-render)."""
        if self.disk is not None and src != "live" and self._live_is_consistent() \
                and common_prefix(self.tokens, prompt) < self._prompt_len - 1:
            self.checkpoint("evict")

    # ---- model calls: keep (state, tokens, logits) consistent even if a call is interrupted --------------

    def advance(self, ids: Sequence[int], logits: np.ndarray, decoded: bool = False) -> None:
        """Record a model step of `ids` on the live state (made by the caller) and its last logits; writes the
        cold and continued checkpoints when the state reaches their points."""
        self.tokens.extend(int(t) for t in ids)
        self._logits = np.asarray(logits)
        if decoded:
            self.stats.decoded_tokens += len(ids)
        else:
            self.stats.prefilled_tokens += len(ids)
            self.stats.prefill_calls += 1
        if self.disk is not None:
            n, p = len(self.tokens), self.disk.policy
            if n == self._cold:
                self.checkpoint("cold")
            elif p.continued_interval and n % p.continued_interval == 0:
                self.checkpoint("continued")

    def _prefill(self, ids: list[int]) -> None:
        try:
            logits = self.model.step([self.state], [ids])[0]
        except BaseException:
            self.drop_live()                      # a half-advanced state must never be reused
            raise
        self.advance(ids, logits)

    def _decode(self, token: int) -> None:
        try:
            logits = self.model.step([self.state], [[token]])[0]
        except BaseException:
            self.drop_live()
            raise
        self.advance([token], logits, decoded=True)

    def drop_live(self) -> None:
        self.state, self.tokens, self._logits = None, [], None

    def fed(self, token: int) -> None:
        """A device-side generation (ds4py.model.device_generation) fed `token` to the live state: recorded,
        without logits (the host never saw them)."""
        self.tokens.append(int(token))
        self._logits = None
        self.stats.decoded_tokens += 1

    def end(self, done: DoneEvent | None) -> None:
        """The request that ran here ended (its DoneEvent; None when it failed): counted by finish reason."""
        reason = "error" if done is None else done.finish_reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1


    # ---- one prompt, step by step -------------------------------------------------------------------------

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

    def start(self, prompt: list[int]) -> int:
        """Bring the live state to the longest reusable prefix of `prompt` (a checked prompt) and plan its
        prefill; no model call. Returns the cached tokens (`ready`: the prompt is complete already)."""
        if self.state is not None and not self._live_is_consistent():
            self.drop_live()
        while True:
            cached, src = self.reuse(prompt)
            self._leaving(prompt, src)
            if isinstance(src, _Snapshot):
                self.state, self.tokens = src.state.copy(), list(src.tokens)
                self._logits = None if src.logits is None else src.logits.copy()
                if cached < len(src.tokens):          # restored, then rolled back to the common prefix
                    self.state.truncate(cached)
                    self.tokens, self._logits = self.tokens[:cached], None
                    self.stats.truncations += 1
                self._snapshots.append(self._snapshots.pop(self._snapshots.index(src)))
                self.stats.snapshots_restored += 1
                self.last_source = "snapshot"
            elif src == "truncate":
                self.state.truncate(cached)
                self.tokens, self._logits = self.tokens[:cached], None
                self.stats.truncations += 1
                self.last_source = "rollback"
            elif src == "live":
                self.last_source = "live"
            elif src is None:
                self.state, self.tokens, self._logits = self.model.new_state(), [], None
                self.last_source = "none"
            elif not self._restore_checkpoint(src, cached):
                continue                           # unreadable: dropped from the disk cache, look again
            break
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt)
        self.stats.cached_tokens += cached
        self.last_cached = cached
        self._prompt_len = len(prompt)
        # chunks end at the snapshot point (before the last prompt token), the cold point and continued frontiers
        splits = {len(prompt) - 1}
        self._cold = None
        if self.disk is not None:
            p = self.disk.policy
            cold = p.cold_point(len(prompt))
            if cold is not None and cached < cold and self.last_source in ("none", "disk"):
                self._cold = cold
                splits.add(cold)
            if p.continued_interval:
                splits.update(range((cached // p.continued_interval + 1) * p.continued_interval, len(prompt),
                                    p.continued_interval))
        self._plan = tuple(sorted(x for x in splits if x > cached))
        return cached

    def _restore_checkpoint(self, entry, n: int) -> bool:
        """Load a checkpoint and keep its first n tokens (fewer than it holds: it ran past the prompt's shared
        prefix, within its rollback horizon)."""
        loaded = self.disk.load(entry)
        if loaded is None:
            return False
        tokens, blob, logits = loaded
        try:
            state = self.model.load_state(blob)
            if n < len(tokens):
                state.truncate(n)                  # raises below the floor: the header lied, the file is bad
                tokens, logits = tokens[:n], None
                self.stats.truncations += 1
        except Ds4Error as e:
            self.disk.discard(entry, str(e))
            return False
        self.state, self.tokens, self._logits = state, tokens, logits
        self.stats.disk_restored += 1
        self.last_source = "disk"
        return True

    @property
    def ready(self) -> bool:
        """The started prompt is complete: its next token can be sampled from `logits`."""
        return self._logits is not None and len(self.tokens) >= self._prompt_len

    @property
    def logits(self) -> np.ndarray | None:
        return self._logits

    def next_chunk(self, prompt: list[int], max_len: int, aligned: bool = False) -> list[int] | None:
        """The next prefill chunk of the started prompt (None: complete): at most max_len tokens, ending at the
        next split point; `aligned` ends it at a multiple of max_len instead (the scheduler's fixed chunks, so
        that a prompt's chunk boundaries, and so its arithmetic, never depend on the load). Takes the snapshot
        when the state is at the snapshot point."""
        n = len(self.tokens)
        if n >= len(prompt):
            return None
        if n == len(prompt) - 1 and n > 0:
            self._take_snapshot()
        end = (n // max_len + 1) * max_len if aligned else n + max_len
        end = min([end, len(prompt)] + [x for x in self._plan if x > n])
        return prompt[n:end]

    # ---- generation -------------------------------------------------------------------------------------

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
        cached = self.start(prompt)
        paced = not isinstance(self.prefill_chunk, int)
        while True:
            if cancelled():
                return cached, False
            n = len(self.tokens)
            ids = self.next_chunk(prompt, self.prefill_chunk.next_len() if paced else self.prefill_chunk)
            if ids is None:
                return cached, True
            t0 = time.perf_counter()
            self._prefill(ids)
            if paced:
                self.prefill_chunk.record(len(self.tokens) - n, time.perf_counter() - t0)

    def _generate(self, prompt: list[int], params: SamplingParams,
                  cancelled: Callable[[], bool]) -> Iterator[Event]:
        cached, ready = self._prepare(prompt, cancelled)
        if not ready:
            yield DoneEvent("cancelled", len(prompt), cached, 0)
            return
        out = Completion(self.tokenizer, params, len(prompt), cached, self.ctx_size)
        tokens = self._tokens(out.sampler, params, out.limit)
        try:
            while True:
                if cancelled():                   # before every token: a gone client stops within one token
                    yield out.cancel()
                    return
                yield out.push(next(tokens))
                if out.done is not None:
                    yield out.done
                    return
        finally:
            tokens.close()                        # (a device generation leaves the state consistent here)

    # ---- the speculative-decoding hook (ds4py.spec, docs/spec.md): the only place generation knows of it ----

    def _speculation(self, params: SamplingParams):
        """A model whose `new_request` gives a round runner (ds4py.spec.SpecModel) decodes in speculative rounds;
        others (new_request gives None) one token a step. `spec_stats` is the running request's speculation
        statistics (None without speculation)."""
        spec = self.model.new_request(params)
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
            self.drop_live()
            raise
        return self.record_round(last, r)

    def record_round(self, last: int, r) -> list[int]:
        """A speculative round (ds4py.spec.Round) the live state ran from `last`: the tokens it fed and the
        logits of the next step; returns its sampled tokens (the state holds all but the last)."""
        self.tokens += [last] + r.tokens[:-1]
        self._logits = np.asarray(r.logits)
        self.stats.decoded_tokens += r.stats.plain_steps
        self.stats.spec_rounds += r.stats.rounds
        self.stats.spec_drafted += r.stats.drafted
        self.stats.spec_accepted += r.stats.accepted
        return list(r.tokens)

    def unfeed(self, n: int) -> None:
        """The answer stopped n tokens before the end of a speculative round: forget those fed tokens."""
        self._unfeed(n)

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
                self.fed(last)
                last = t
                yield t
        except GeneratorExit:
            raise
        except BaseException:
            inner.close()
            self.drop_live()                      # a half-advanced state must never be reused
            raise
        finally:
            inner.close()                          # the state's counters are final from here on


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two histories share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    return int(np.argmax(differ)) if differ.any() else n


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
