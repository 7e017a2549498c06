"""The serving driver of `serve`, whatever `--sessions N` is (one session is N = 1): the one generation driver
(ds4py/driver.py: prefill chunks, device-side generation, speculative rounds, cancellation) fed from the job
queue. nano-vllm's split: the driver decides, its ModelRunner runs.

One loop on the engine thread. Each turn it
1. drops the requests whose client went away (their session keeps what it consumed) and admits waiting ones,
   in arrival order, while a session is idle (SessionPool.route picks which; Session.start restores its prefix);
2. runs one driver step: the decode row (or speculative round) of every request that is generating, plus
   prefill chunks of the requests still reading their prompt, oldest first, up to `pool.prefill_chunk` prompt
   tokens (at least one chunk), as one batched model step; a request decoding alone may decode by device-side
   generation instead;
3. pushes every sampled token to its job (each request has its own sampler: a seeded request does not depend
   on its neighbours), and publishes the sessions' occupancy to /metrics.

Prefill chunks: a fixed grid (pool.prefill_chunk an int: chunks end at its multiples) with several sessions;
with one, a PrefillPacer sizes each step's chunk to about a quarter second, so that a client who leaves
mid-prompt frees the engine soon.

So a long prompt never stalls the active streams: they get a token every step, and a step holds at most one
prefill chunk's worth of prompt. A prompt's chunks end at fixed multiples of the chunk (and at the
session's split points: the snapshot before its last token, disk checkpoints), never where the load happened to
cut them, and the backend computes every sequence of a step as if it were alone (docs/engine.md, batch
invariance): a request's tokens at temperature 0 are the same whether it ran alone or beside others. Greedy
tokens of a speculative request are plain decoding's for every k and every neighbour.
"""

from __future__ import annotations

import logging
from typing import Protocol

from ds4py.driver import Driver, Request
from ds4py.sampling import InvalidLogits
from ds4py.session import Session

from .protocol import Done, Started
from .worker import Engine, Job, JobOutput

log = logging.getLogger("ds4py.server")


class JobQueue(Protocol):
    """The waiting jobs as the scheduler reads them (engine_thread.Worker, which runs the scheduler)."""
    closed: bool

    def wait(self) -> bool: ...

    def peek(self) -> Job | None: ...

    def pop(self) -> Job: ...


class Scheduler(Driver):
    def __init__(self, engine: Engine, worker: JobQueue):
        pool = engine.pool
        super().__init__(pool, engine.tokenizer, aligned=isinstance(pool.prefill_chunk, int),
                         observe=engine.metrics.observe_step)
        self.engine, self.worker = engine, worker

    def run(self) -> None:
        while True:
            if not self.running and not self.worker.wait():
                return
            if self.worker.closed:
                for r in list(self.running):
                    r.out.job.cancel.set()
            self.drop_cancelled()
            self._admit()
            if self.running:
                self.step()
                self.flush()
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
        self.start(session, slot, prompt, cached, engine.sampling_params(job.req), JobOutput(engine, job),
                   job.cancel.is_set)
        engine.metrics.running = len(self.running)
        self.flush()                              # the whole prompt was cached with its logits: its first token

    # ---- the driver's hooks ------------------------------------------------------------------------------------
    def on_failure(self, e: BaseException) -> None:
        log.exception("a model step failed", exc_info=e)

    def on_invalid_logits(self, e: InvalidLogits) -> str:
        self.engine.set_broken(e)
        return self.engine.broken

    def on_finished(self, r: Request) -> None:
        if r.spec is not None:                   # speculation's share of the request: /metrics
            st = r.spec.stats
            self.engine.metrics.add(spec_rounds=st.rounds, spec_drafted=st.drafted, spec_accepted=st.accepted,
                                    spec_tokens=st.spec_tokens, spec_plain_steps=st.plain_steps)
            log.info("request done (%s tokens); %s", r.comp.n, st.summary())
        self.engine.metrics.running = len(self.running)      # before its Done goes out
