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

One driver (ds4py.driver). A session keeps the bookkeeping; the driver calls the model: `start(prompt)`,
`next_chunk(...)` and `advance(ids, logits)` around its batched model.step (or `fed(token)` under a device-side
generation, `record_round` / `unfeed` around speculative rounds), a `Completion` per request, and `end(done)`
when the request is over. `generate()` (run, chat) is the driver on this session alone (a pool of one); the
server's scheduler (ds4py/server/scheduler.py) is the same driver over a pool of sessions.

Not thread-safe: one request at a time per session (the server serialises requests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from ds4py import driver
from ds4py.completion import Completion, DoneEvent, Event, TokenEvent  # noqa: F401  (re-exported: callers' names)
from ds4py.errors import ContextLengthError, Ds4Error
from ds4py.sampling import SamplingParams

log = logging.getLogger("ds4py.session")


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

    # ---- generation: the driver's, on a pool of one ---------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 cancelled: Callable[[], bool] | None = None) -> Iterator[Event]:
        """Validate now (errors raise here, before any event), then stream TokenEvents and one DoneEvent: one
        request driven by ds4py.driver on this session alone."""
        prompt = self.check_prompt(prompt_ids)
        if self._busy:
            raise RuntimeError("this session is already generating (one request at a time)")
        return self._run(prompt, params, cancelled or (lambda: False))

    def _run(self, prompt: list[int], params: SamplingParams, cancelled: Callable[[], bool]) -> Iterator[Event]:
        if self._busy:                             # (a second generator made before the first one started)
            raise RuntimeError("this session is already generating (one request at a time)")
        self._busy = True
        try:
            yield from driver.generate(self, prompt, params, cancelled)
        finally:
            self._busy = False

    # ---- what the driver records of speculative rounds (ds4py.spec, docs/spec.md) -------------------------

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
        """The answer stopped (ended, cancelled, closed) with n fed tokens past its last one but one, inside a
        speculative round or after a decode step: forget them (a rollback within the round's own rows, so
        always exact)."""
        if n and self.state is not None and self._live_is_consistent():
            self.state.truncate(self.state.n_tokens - n)
            del self.tokens[-n:]
            self._logits = None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two histories share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64)
    return int(np.argmax(differ)) if differ.any() else n
