"""The serving driver of `serve`, whatever `--sessions N` is (one session is N = 1): nano-vllm's split, this
module decides, runner.py runs. Speculation, prefix reuse, disk checkpoints and cancellation are driven here only.

One loop on the engine thread. Each turn it
1. drops the requests whose client went away (their session keeps what it consumed) and admits waiting ones,
   in arrival order, while a session is idle (SessionPool.route picks which; Session.start restores its prefix);
2. plans one step: the decode row of every request that is generating, plus prefill chunks of the requests
   still reading their prompt, oldest first, up to `pool.prefill_chunk` prompt tokens (at least one chunk);
3. runs it as one batched model step (ModelRunner) and turns each sequence's logits into its next token
   (each request has its own sampler: a seeded request does not depend on its neighbours).

With speculative decoding (the pool's model is a ds4py.spec.SpecModel) a generating request runs a round
instead of a decode row: its drafts are made first (SpecRequest.draft: its draft's steps, the MTP block's or
DSpark's, its own calibration choosing k from the model's costs), then every drafting request's 1 + k rows are verified in one main step (ModelRunner.verify), and
each round is accepted and rolled back on its own (SpecRequest.finish); requests that decode plainly this
step (k = 0 chosen before drafting) and prompt chunks go through the batched step as before. A round's tokens
are pushed one by one: an answer that ends inside a round un-feeds the rest (exact rollback). Greedy tokens
are plain decoding's for every k and every neighbour (row stability and batch invariance).

A request decoding alone (the only one running: always so with one session; greedy ones with several, whose
tokens are the same either way) decodes by the backend's device-side generation when it has one
(ds4py.model.device_generation: 4 bytes read back per token instead of the logits); the generation is closed,
leaving the state exactly where host steps would, as soon as another request runs beside it.

Prefill chunks: a fixed grid (pool.prefill_chunk an int) with several sessions; with one, a PrefillPacer sizes
each step's chunk to about a quarter second, so that a client who leaves mid-prompt frees the engine soon.

So a long prompt never stalls the active streams: they get a token every step, and a step holds at most one
prefill chunk's worth of prompt. A prompt's chunks end at fixed multiples of the chunk (and at the
session's split points: the snapshot before its last token, disk checkpoints), never where the load happened to
cut them, and the backend computes every sequence of a step as if it were alone (docs/engine.md, batch
invariance): a request's tokens at temperature 0 are the same whether it ran alone or beside others.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from ds4py.contract import device_generation
from ds4py.sampling import InvalidLogits
from ds4py.session import Completion, Session

from .protocol import Done, Started
from .runner import ModelRunner
from .worker import Engine, Job, JobOutput

log = logging.getLogger("ds4py.server")


class JobQueue(Protocol):
    """The waiting jobs as the scheduler reads them (engine_thread.Worker, which runs the scheduler)."""
    closed: bool

    def wait(self) -> bool: ...

    def peek(self) -> Job | None: ...

    def pop(self) -> Job: ...


@dataclass(eq=False)
class _Request:
    job: Job
    slot: int
    session: Session
    prompt: list[int]
    out: JobOutput
    comp: Completion
    spec: Any = None           # its ds4py.spec.SpecRequest when the model decodes speculatively
    gen: Any = None            # its device-side generation while it decodes alone on such a backend

    @property
    def decoding(self) -> bool:
        """Past its prompt: a token was sampled, the next step feeds it (a decode row or a round)."""
        return self.comp.n > 0


class Scheduler:
    def __init__(self, engine: Engine, worker: JobQueue):
        self.engine, self.worker, self.pool = engine, worker, engine.pool
        self.prefill_chunk = self.pool.prefill_chunk
        self.paced = not isinstance(self.prefill_chunk, int)
        self.runner = ModelRunner(self.pool.model, engine.metrics)
        self.device_generation = device_generation(self.pool.model)
        self.running: list[_Request] = []

    def run(self) -> None:
        while True:
            if not self.running and not self.worker.wait():
                return
            if self.worker.closed:
                for r in list(self.running):
                    r.job.cancel.set()
            self._drop_cancelled()
            self._admit()
            if self.running:
                self._step()
            self.engine.publish()

    # ---- admission ---------------------------------------------------------------------------------------
    def _admit(self) -> None:
        m = self.engine.metrics
        while (job := self.worker.peek()) is not None:
            if job.cancel.is_set():
                self.worker.pop()
                m.add(cancelled=1)
                job.emit(Done("cancelled", len(job.ids)))
                continue
            if self.engine.broken:
                self.worker.pop()
                job.emit(Done("error", len(job.ids), error=self.engine.broken))
                continue
            slot = self.pool.route(job.ids, job.session_key)
            if slot is None:
                return                            # every session is busy: it waits, in order
            self.worker.pop()
            m.observe_affinity(self.pool.last_route)
            session = self.pool.acquire(slot, job.session_key)
            if self.pool.last_displaced is not None:
                m.add(session_displaced=1)
                log.info("session %d: conversation %r displaces %r (each of the %d sessions holds a conversation: "
                         "its next turn re-prefills what no snapshot or disk checkpoint holds; more --sessions keep "
                         "more conversations resident)", slot, job.session_key[:64], self.pool.last_displaced[:64],
                         len(self.pool))
            try:
                self._start(job, slot, session)
            except Exception as e:  # a bug or a backend failure (a bad disk checkpoint is handled inside)
                log.exception("starting a request failed")
                session.drop_live()
                self.pool.release(slot)
                job.emit(Done("error", len(job.ids), error=f"generation failed: {type(e).__name__}: {e}"))

    def _start(self, job: Job, slot: int, session: Session) -> None:
        engine = self.engine
        prompt = session.check_prompt(job.ids)
        histories = engine.histories()
        cached = session.start(prompt)
        engine.report_reuse(prompt, cached, session.last_source, histories)
        job.emit(Started(len(prompt), cached))
        comp = Completion(engine.tokenizer, engine.sampling_params(job.req), len(prompt), cached, session.ctx_size)
        spec = self.pool.model.new_request(comp.sampler.params)      # None: plain decoding
        r = _Request(job, slot, session, prompt, JobOutput(engine, job), comp, spec)
        self.running.append(r)
        self.engine.metrics.running = len(self.running)
        if session.ready:                         # the whole prompt was cached with its logits
            self._sample(r)

    # ---- one step ------------------------------------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        for r in list(self.running):
            if r.job.cancel.is_set():
                self._finish(r, r.comp.cancel())

    def _alone(self, r: _Request) -> bool:
        """r may decode by device-side generation: it is the only request running and decodes plainly (greedy
        with several sessions: its tokens then do not depend on whether a neighbour came)."""
        return self.device_generation is not None and r.spec is None and r.decoding \
            and len(self.running) == 1 and (len(self.pool) == 1 or r.comp.sampler.params.greedy)

    def _device_step(self, r: _Request) -> None:
        """One token of r's device-side generation (started when r came to decode alone)."""
        try:
            if r.gen is None:
                r.gen = self.device_generation(r.session.state, r.comp.last, r.comp.sampler.params,
                                               r.comp.limit - r.comp.n)
            t = next(r.gen)
        except InvalidLogits as e:
            self._close_generation(r)
            self.engine.set_broken(e)
            self._finish(r, None, error=self.engine.broken)
            return
        except Exception as e:  # the state may be half-advanced: it is not reused
            self._fail([r], e)
            return
        r.session.fed(r.comp.last)              # t arrives once the last token has been fed
        r.out.token(r.comp.push(t))
        if r.comp.done is not None:
            self._finish(r, r.comp.done)

    def _close_generation(self, r: _Request) -> None:
        """End r's device-side generation: the state then holds every token it yielded but the last."""
        gen, r.gen = r.gen, None
        if gen is not None:
            gen.close()

    def _step(self) -> None:
        for r in self.running:
            if r.gen is not None and not self._alone(r):
                self._close_generation(r)       # a neighbour came: back to host steps
        if len(self.running) == 1 and self._alone(self.running[0]):
            self._device_step(self.running[0])
            return
        rows: list[tuple[_Request, list[int], bool]] = []        # (request, chunk, is a decode row)
        chunk = self.prefill_chunk.next_len() if self.paced else self.prefill_chunk
        budget = chunk
        verify: list[tuple[_Request, Any]] = []                   # (request, its round's Draft)
        try:
            for r in self.running:
                if r.decoding:
                    plan = None if r.spec is None else r.spec.draft(
                        r.session.state, r.comp.last, r.comp.sampler, r.comp.limit - r.comp.n, step_plain=False)
                    if plan is None:
                        rows.append((r, [r.comp.last], True))
                    else:
                        verify.append((r, plan))
        except Exception as e:  # a draft step failed: its state may be half-advanced
            self._fail([r for r in self.running if r.decoding], e)
            return
        for r in self.running:
            if not r.decoding:
                ids = r.session.next_chunk(r.prompt, chunk, aligned=not self.paced)
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
                t0 = time.perf_counter()
                P, H = self.runner.verify([r.session.state for r, _ in verify], [p.chunk for _, p in verify])
                verify_s = time.perf_counter() - t0
        except Exception as e:  # every state of the step may be half-advanced: none is reused
            self._fail([r for r, _, _ in rows] + [r for r, _ in verify], e)
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
        for (r, plan), p, h in zip(verify, P if verify else [], H if verify else []):
            if r in self.running:
                self._accept(r, plan, p, h, verify_s)

    def _fail(self, requests: list[_Request], e: Exception) -> None:
        log.exception("a model step failed")
        for r in requests:
            self._close_generation(r)
            r.session.drop_live()
            self._finish(r, None, error=f"generation failed: {type(e).__name__}: {e}")

    def _accept(self, r: _Request, plan, P, H, seconds: float) -> None:
        """A speculative round's verify rows came back: accept, roll back, push its tokens (an answer that ends
        inside the round un-feeds the rest)."""
        try:
            r.spec.scheduler.costs.observe_verify(len(plan.chunk), seconds)
            rnd = r.spec.finish(r.session.state, plan, P, H, r.comp.sampler)
        except InvalidLogits as e:
            self.engine.set_broken(e)
            for other in list(self.running):
                self._finish(other, None, error=self.engine.broken)
            return
        tokens = r.session.record_round(r.comp.last, rnd)
        for i, t in enumerate(tokens):
            r.out.token(r.comp.push(t))
            if r.comp.done is not None:
                r.session.unfeed(len(tokens) - 1 - i)
                self._finish(r, r.comp.done)
                return

    def _sample(self, r: _Request) -> None:
        try:
            token = r.comp.sample(r.session.logits)
        except InvalidLogits as e:
            self.engine.set_broken(e)
            for other in list(self.running):      # every sequence reads the same broken weights
                self._finish(other, None, error=self.engine.broken)
            return
        r.out.token(r.comp.push(token))
        if r.comp.done is not None:
            self._finish(r, r.comp.done)

    def _finish(self, r: _Request, done, error: str | None = None) -> None:
        if r not in self.running:
            return
        self._close_generation(r)
        self.running.remove(r)
        r.session.end(None if error is not None else done)
        self.pool.release(r.slot)
        if r.spec is not None:                   # speculation's share of the request: /metrics
            st = r.spec.stats
            self.engine.metrics.add(spec_rounds=st.rounds, spec_drafted=st.drafted, spec_accepted=st.accepted,
                                    spec_tokens=st.spec_tokens, spec_plain_steps=st.plain_steps)
            log.info("request done (%s tokens); %s", r.comp.n, st.summary())
        self.engine.metrics.running = len(self.running)      # before its Done goes out
        if error is not None:
            r.job.emit(Done("error", len(r.prompt), error=error))
        else:
            r.out.finish(done)
