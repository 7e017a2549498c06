"""The one generation driver of `run`, `chat` and `serve`: prefill chunks, the switch into device-side generation,
speculative rounds and cancellation are driven here and nowhere else.

The driver steps the requests running on a pool of sessions (ds4py.session.Session: the KV bookkeeping of
`start`, `next_chunk`, `advance`, `fed`, `record_round`, `unfeed`, `end`). `serve`'s scheduler
(ds4py/server/scheduler.py) is a Driver that admits jobs from its queue into a SessionPool; `run` and `chat`
call `Session.generate`, which is `generate()` below: one request on a pool of one session, one event per next().

Each `step()`
1. runs a request decoding alone (the only one running: always so with one session; greedy ones with several,
   whose tokens are the same either way) by the backend's device-side generation when it has one
   (ds4py.contract.device_generation: 4 bytes read back per token instead of the logits); the generation is
   closed, leaving the state exactly where host steps would, as soon as another request runs beside it;
2. otherwise plans one batched model step: the decode row of every generating request (or, with speculative
   decoding, a round: SpecRequest.draft makes its drafts and every drafting request's 1 + k rows are verified in
   one main step, then each round is accepted and rolled back on its own, SpecRequest.finish), plus prefill
   chunks of the requests still reading their prompt, oldest first, up to one chunk of prompt tokens;
3. queues each request's sampled tokens (a round's accepted drafts and its next token). `push()` turns the next
   queued token into a TokenEvent on the request's Output; an answer that ends, is cancelled or fails with tokens
   still queued un-feeds them (an exact rollback within the round's own rows).

A request alone with speculation runs its plain rounds itself (SpecRequest.draft(step_plain=True): the main
step is timed apart from the draft's feed); beside others its decode row joins the batched step.

Prefill chunks: `aligned` ends them at multiples of the chunk (the server with several sessions: a prompt's
chunk boundaries, and so its arithmetic, never depend on the load), else they run from where the prompt's reuse
ended; an int chunk is fixed, an object with next_len() / record(n_tokens, seconds) (the server's
PrefillPacer) sizes each step's chunk to a time.

Engine thread only (or the caller's thread for generate()); not thread-safe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from ds4py import spec as spec_module
from ds4py.completion import Completion, DoneEvent, Event, TokenEvent
from ds4py.contract import device_generation
from ds4py.sampling import InvalidLogits, SamplingParams


class Output(Protocol):
    """Where one request's events go (the server's JobOutput: SSE events and metrics; generate(): a list)."""

    def token(self, ev: TokenEvent) -> None: ...

    def finish(self, done: DoneEvent) -> None: ...

    def fail(self, error: str) -> None: ...


class LiveSession(Protocol):
    """What the driver uses of a session (ds4py.session.Session): its live state and the bookkeeping around it."""
    state: Any
    ctx_size: int
    spec_stats: Any
    tokenizer: Any

    @property
    def ready(self) -> bool: ...

    @property
    def logits(self) -> np.ndarray | None: ...

    def start(self, prompt: list[int]) -> int: ...

    def next_chunk(self, prompt: list[int], max_len: int, aligned: bool = False) -> list[int] | None: ...

    def advance(self, ids: Sequence[int], logits: np.ndarray, decoded: bool = False) -> None: ...

    def fed(self, token: int) -> None: ...

    def record_round(self, last: int, r: Any) -> list[int]: ...

    def unfeed(self, n: int) -> None: ...

    def drop_live(self) -> None: ...

    def end(self, done: DoneEvent | None) -> None: ...


class Pool(Protocol):
    """The sessions the driver's requests run in (server.pool.SessionPool, or generate()'s pool of one)."""
    model: Any
    prefill_chunk: Any

    def __len__(self) -> int: ...

    def release(self, slot: int) -> None: ...


class ModelRunner:
    """Runs the step the driver planned as one batched model call over the sequences' states and reports its
    size and time to `observe(sequences, rows, seconds)` (the server's metrics)."""

    def __init__(self, model, observe: Callable[[int, int, float], None] | None = None):
        self.model, self.observe = model, observe

    def step(self, states: Sequence, chunks: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """The last logits of each sequence after feeding it its chunk (a decode token or a prefill chunk)."""
        t0 = time.perf_counter()
        out = self.model.step(list(states), [list(c) for c in chunks])
        self.observed(len(states), sum(len(c) for c in chunks), time.perf_counter() - t0)
        return out

    def verify(self, states: Sequence, chunks: Sequence[Sequence[int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Speculative verify rows of several sessions in one main step (the speculative model's verify: every
        row's logits and what its rounds' finish reads: MTP final hidden states, DSpark draft taps)."""
        t0 = time.perf_counter()
        out = self.model.verify(list(states), chunks)
        self.observed(len(states), sum(len(c) for c in chunks), time.perf_counter() - t0)
        return out

    def observed(self, sequences: int, rows: int, seconds: float) -> None:
        if self.observe is not None:
            self.observe(sequences, rows, seconds)


@dataclass(eq=False)
class Request:
    session: LiveSession       # started on `prompt`
    slot: int                  # its place in the pool (released when the request ends)
    prompt: list[int]
    out: Output
    comp: Completion
    cancelled: Callable[[], bool]
    spec: Any = None           # its ds4py.spec.SpecRequest when the model decodes speculatively
    gen: Any = None            # its device-side generation while it decodes alone on such a backend
    queue: list[int] = field(default_factory=list)   # sampled tokens not pushed yet (see `extra`)
    error: BaseException | None = None               # why it failed (generate() raises it)

    @property
    def decoding(self) -> bool:
        """Past its prompt: a token was pushed, the next step feeds it (a decode row or a round)."""
        return self.comp.n > 0

    @property
    def extra(self) -> int:
        """Fed tokens past the answer's last one but one: every queued token of a decode step or round (the
        state holds the last pushed token and all queued ones but the last); none for the prompt's first."""
        return len(self.queue) if self.decoding else 0


class Driver:
    def __init__(self, pool: Pool, tokenizer, aligned: bool, observe: Callable[[int, int, float], None] | None = None):
        self.pool, self.tokenizer, self.aligned = pool, tokenizer, aligned
        self.prefill_chunk = pool.prefill_chunk
        self.paced = not isinstance(self.prefill_chunk, int)
        self.runner = ModelRunner(pool.model, observe)
        self.device_generation = device_generation(pool.model)
        self.running: list[Request] = []

    # ---- what a caller of the driver may change (the server: logging, its broken state, metrics) ---------
    def on_failure(self, e: BaseException) -> None:
        """A model step failed (its requests end with an error)."""

    def on_invalid_logits(self, e: InvalidLogits) -> str:
        """The model gave non-finite logits: every running request ends with the returned error."""
        return str(e)

    def on_finished(self, r: Request) -> None:
        """r left the running set (before its final event goes out)."""

    # ---- requests -------------------------------------------------------------------------------------------
    def start(self, session: LiveSession, slot: int, prompt: list[int], cached: int, params: SamplingParams, out: Output,
              cancelled: Callable[[], bool]) -> Request:
        """Run a request on `session`, already started on `prompt` (Session.start gave `cached`)."""
        comp = Completion(self.tokenizer, params, len(prompt), cached, session.ctx_size)
        spec = self.pool.model.new_request(comp.sampler.params)      # None: plain decoding
        session.spec_stats = None if spec is None else spec.stats
        r = Request(session, slot, prompt, out, comp, cancelled, spec)
        self.running.append(r)
        if session.ready:                         # the whole prompt was cached with its logits
            self._sample(r)
        return r

    def drop_cancelled(self) -> None:
        for r in list(self.running):
            if r.cancelled():
                self.cancel(r)

    def cancel(self, r: Request) -> None:
        self._finish(r, r.comp.cancel())

    def push(self, r: Request) -> None:
        """r's next queued token out as a TokenEvent; an answer that ends here un-feeds the rest of the queue."""
        r.out.token(r.comp.push(r.queue.pop(0)))
        if r.comp.done is not None:
            self._finish(r, r.comp.done)

    def flush(self) -> None:
        """Push every queued token of every running request (the server, after each step)."""
        for r in list(self.running):
            while r.queue and r in self.running:
                self.push(r)

    def abandon(self, r: Request) -> None:
        """r's consumer stopped listening (generate() closed): leave its state consistent, no more events."""
        if r in self.running:
            self._close_generation(r)
            self._unqueue(r)
            self.running.remove(r)
            self.pool.release(r.slot)

    # ---- one step -------------------------------------------------------------------------------------------
    def _alone(self, r: Request) -> bool:
        """r may decode by device-side generation: it is the only request running and decodes plainly (greedy
        with several sessions: its tokens then do not depend on whether a neighbour came)."""
        return self.device_generation is not None and r.spec is None and r.decoding \
            and len(self.running) == 1 and (len(self.pool) == 1 or r.comp.sampler.params.greedy)

    def step(self) -> None:
        """One step of every running request whose queue is empty (see the module docstring)."""
        for r in self.running:
            if r.gen is not None and not self._alone(r):
                self._close_generation(r)       # a neighbour came: back to host steps
        ready = [r for r in self.running if not r.queue]
        if len(self.running) == 1 and ready and self._alone(ready[0]):
            self._device_step(ready[0])
            return
        rows: list[tuple[Request, list[int], bool]] = []        # (request, chunk, is a decode row)
        verify: list[tuple[Request, Any]] = []                   # (request, its round's Draft)
        rounds: list[tuple[Request, Any]] = []                   # (request, the plain Round it ran alone)
        decoding = [r for r in ready if r.decoding]
        try:
            for r in decoding:
                if r.spec is None:
                    rows.append((r, [r.comp.last], True))
                    continue
                t0 = time.perf_counter()
                plan = r.spec.draft(r.session.state, r.comp.last, r.comp.sampler, r.comp.limit - r.comp.n,
                                    step_plain=len(self.running) == 1)
                if plan is None:
                    rows.append((r, [r.comp.last], True))
                elif isinstance(plan, spec_module.Round):
                    self.runner.observed(1, 1, time.perf_counter() - t0)
                    rounds.append((r, plan))
                else:
                    verify.append((r, plan))
        except InvalidLogits as e:
            self._invalid(e)
            return
        except BaseException as e:  # a draft step failed: its state may be half-advanced
            self._fail(decoding, e)
            return
        chunk = self.prefill_chunk.next_len() if self.paced else self.prefill_chunk
        budget = chunk
        for r in ready:
            if not r.decoding:
                ids = r.session.next_chunk(r.prompt, chunk, aligned=self.aligned)
                if ids is None:
                    continue
                if len(ids) > budget and budget < chunk:
                    break                         # oldest first: a later prompt never overtakes this one
                rows.append((r, ids, False))
                budget -= len(ids)
        try:
            t0 = time.perf_counter()
            logits = self.runner.step([r.session.state for r, _, _ in rows], [ids for _, ids, _ in rows]) \
                if rows else []
            seconds = time.perf_counter() - t0
            if verify:
                t0 = spec_module.CLOCK()
                P, H = self.runner.verify([r.session.state for r, _ in verify], [p.chunk for _, p in verify])
                verify_s = spec_module.CLOCK() - t0
        except BaseException as e:  # every state of the step may be half-advanced: none is reused
            self._fail([r for r, _, _ in rows] + [r for r, _ in verify] + [r for r, _ in rounds], e)
            return
        prompt_tokens = sum(len(ids) for _, ids, decoded in rows if not decoded)
        if self.paced and prompt_tokens:
            self.prefill_chunk.record(prompt_tokens, seconds)
        for (r, ids, decoded), lg in zip(rows, logits):
            r.session.advance(ids, lg, decoded=decoded)
            if decoded and r.spec is not None:
                r.spec.plain_step(seconds)
        for r, _, _ in rows:
            if r in self.running and r.session.ready:     # (a broken model's logits finish them all)
                self._sample(r)
        for r, rnd in rounds:
            if r in self.running:
                r.queue += r.session.record_round(r.comp.last, rnd)
        for (r, plan), p, h in zip(verify, P if verify else [], H if verify else []):
            if r in self.running:
                self._accept(r, plan, p, h, verify_s)

    def _device_step(self, r: Request) -> None:
        """One token of r's device-side generation (started when r came to decode alone)."""
        try:
            if r.gen is None:
                r.gen = self.device_generation(r.session.state, r.comp.last, r.comp.sampler.params,
                                               r.comp.limit - r.comp.n)
            t = next(r.gen)
        except InvalidLogits as e:
            self._close_generation(r)
            self._invalid(e)
            return
        except BaseException as e:  # the state may be half-advanced: it is not reused
            self._fail([r], e)
            return
        r.session.fed(r.comp.last)              # t arrives once the last token has been fed
        r.queue.append(int(t))

    def _close_generation(self, r: Request) -> None:
        """End r's device-side generation: the state then holds every token it yielded but the last."""
        gen, r.gen = r.gen, None
        if gen is not None:
            gen.close()

    def _accept(self, r: Request, plan, P, H, seconds: float) -> None:
        """A speculative round's verify rows came back: accept, roll back, queue its tokens."""
        try:
            r.spec.scheduler.costs.observe_verify(len(plan.chunk), seconds)
            rnd = r.spec.finish(r.session.state, plan, P, H, r.comp.sampler)
        except InvalidLogits as e:
            self._invalid(e)
            return
        r.queue += r.session.record_round(r.comp.last, rnd)

    def _sample(self, r: Request) -> None:
        try:
            r.queue.append(r.comp.sample(r.session.logits))
        except InvalidLogits as e:
            self._invalid(e)

    # ---- endings --------------------------------------------------------------------------------------------
    def _fail(self, requests: list[Request], e: BaseException) -> None:
        """A model call failed: the states it touched are dropped (a half-advanced state is never reused) and
        the requests end with an error; a KeyboardInterrupt and the like go on up to the caller."""
        self.on_failure(e)
        for r in requests:
            self._close_generation(r)
            r.session.drop_live()
            r.queue.clear()
            r.error = e
            self._finish(r, None, error=f"generation failed: {type(e).__name__}: {e}")
        if not isinstance(e, Exception):
            raise e

    def _invalid(self, e: InvalidLogits) -> None:
        error = self.on_invalid_logits(e)
        for r in list(self.running):              # every sequence reads the same broken weights
            r.error = e
            self._finish(r, None, error=error)

    def _unqueue(self, r: Request) -> None:
        """Forget the fed tokens past the answer's last one (it ended with tokens still queued)."""
        r.session.unfeed(r.extra)
        r.queue.clear()

    def _finish(self, r: Request, done: DoneEvent | None, error: str | None = None) -> None:
        if r not in self.running:
            return
        self._close_generation(r)
        self._unqueue(r)
        self.running.remove(r)
        r.session.end(None if error is not None else done)
        self.pool.release(r.slot)
        self.on_finished(r)
        if error is not None:
            r.out.fail(error)
        else:
            r.out.finish(done)


# ---- run / chat: one request on a pool of one --------------------------------------------------------------
class _PoolOfOne:
    def __init__(self, session: LiveSession):
        self.model, self.prefill_chunk = session.model, session.prefill_chunk

    def __len__(self) -> int:
        return 1

    def release(self, slot: int) -> None:
        pass


class _Events:
    """generate()'s Output: the events of the last push, taken one batch per next(); errors are raised."""

    def __init__(self):
        self.events: list[Event] = []

    def token(self, ev: TokenEvent) -> None:
        self.events.append(ev)

    def finish(self, done: DoneEvent) -> None:
        self.events.append(done)

    def fail(self, error: str) -> None:
        pass

    def take(self) -> list[Event]:
        out, self.events = self.events, []
        return out


def generate(session: LiveSession, prompt: list[int], params: SamplingParams,
             cancelled: Callable[[], bool]) -> Iterator[Event]:
    """One request on `session` alone (Session.generate: run, chat): TokenEvents and one DoneEvent, each token
    computed when it is asked for. `cancelled()` is checked between prefill chunks and before every token (a gone
    client stops within one token); a failed model call raises, its state dropped."""
    out = _Events()
    driver = Driver(_PoolOfOne(session), session.tokenizer, aligned=False)
    cached = session.start(prompt)
    r = driver.start(session, 0, prompt, cached, params, out, cancelled)
    try:
        while True:
            if r.error is not None:
                raise r.error
            if cancelled():
                driver.cancel(r)
                yield from out.take()
                return
            if not r.queue:
                prefilling = not r.decoding
                driver.step()
                if r.error is not None:
                    raise r.error
                if prefilling:                    # a prompt chunk (or the first token): checked before it goes out
                    continue
            driver.push(r)
            yield from out.take()
            if r not in driver.running:
                return
    finally:
        driver.abandon(r)
