"""The engine side of the server: prompt rendering, one worker thread running the blocking numpy/CUDA session,
and a bounded FIFO queue in front of it.

The event loop never runs model code. A request handler renders its prompt in a thread pool, puts a `Job` on
the queue and awaits the job's asyncio.Queue; the worker thread runs one job at a time (the session has one
live KV state) and posts `Reasoning` / `Text` / `ToolCallOut` / `Done` events back with call_soon_threadsafe.
A handler whose client goes away sets `job.cancel`; the session checks it before every token.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ds4py.sampling import InvalidLogits

from .metrics import Metrics
from .protocol import MID_SYSTEM, ApiError, Done, GenRequest, Reasoning, Started, Text, ToolCallOut
from .toolmemory import StoredCall, ToolMemory

log = logging.getLogger("ds4py.server")

EOS_TEXT = "<｜end▁of▁sentence｜>"
END_THINK = "</think>"


@dataclass
class Job:
    req: GenRequest
    ids: list[int]
    loop: asyncio.AbstractEventLoop
    id_prefix: str = "call_"
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    t_arrival: float = field(default_factory=time.monotonic)

    def emit(self, ev) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:      # the event loop is gone (server shutting down): nobody is listening
            self.cancel.set()


class Engine:
    """Everything between a GenRequest and its events: rendering, tokenizing, sampling, DSML parsing."""

    def __init__(self, session, tokenizer, *, metrics: Metrics | None = None, tool_memory: ToolMemory | None = None,
                 encode_prompt: Callable | None = None, parser_factory: Callable | None = None,
                 native_mid_system: bool = False):
        self.session, self.tokenizer = session, tokenizer
        self.ctx_size = int(session.ctx_size)
        self.broken: str | None = None          # set when the model proved broken while serving (see Worker)
        self.metrics = metrics or Metrics()
        self.tool_memory = tool_memory or ToolMemory()
        if encode_prompt is None or parser_factory is None:
            from ds4py import chat
            encode_prompt = encode_prompt or chat.encode_prompt
            parser_factory = parser_factory or chat.DSMLParser
        self._encode_prompt, self._parser_factory = encode_prompt, parser_factory
        # the chat format renders a system message after the first turn itself (V4.1's <｜System｜>); V4 gets
        # such messages as user text (protocol.place_system)
        self.native_mid_system = native_mid_system

    # ---- rendering (called from a thread pool, never on the event loop) ----------------------------------

    def prompt_ids(self, req: GenRequest) -> list[int]:
        if req.messages is None:                                   # raw /v1/completions
            if isinstance(req.prompt, list):
                return list(req.prompt)
            bos = getattr(self.tokenizer, "bos_id", None)
            return ([bos] if bos is not None else []) + self.tokenizer.encode(req.prompt)
        options = {"thinking_mode": "thinking" if req.thinking else "chat", "reasoning_effort": req.reasoning_effort,
                   "drop_thinking": True, "add_default_bos_token": True}
        messages = self.tool_memory.replay(req.messages)
        if self.native_mid_system:
            messages = [{"role": "system", "content": m["content"]} if m.get(MID_SYSTEM) else m for m in messages]
        messages = [{k: v for k, v in m.items() if k != MID_SYSTEM} for m in messages]
        return list(self._encode_prompt(messages, options, self.tokenizer))

    def check_fits(self, ids: list[int]) -> None:
        if len(ids) + 1 > self.ctx_size:
            # "prompt is too long: N tokens > M maximum" is Anthropic's wording, which Claude Code looks for
            raise ApiError(400, f"prompt is too long: {len(ids)} tokens > {self.ctx_size - 1} maximum (the context "
                                f"holds {self.ctx_size} tokens: the prompt and at least 1 generated token); "
                                f"shorten it or restart with a larger --ctx",
                           code="context_length_exceeded", param="messages")
        vocab = getattr(self.session, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param="prompt")

    # ---- generation (worker thread) ---------------------------------------------------------------------

    def run(self, job: Job) -> None:
        from ds4py.sampling import SamplingParams

        req, m = job.req, self.metrics
        params = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                                seed=req.seed, max_tokens=req.max_tokens, stop=list(req.stop),
                                ignore_eos=req.ignore_eos)
        # a continued (prefilled) assistant message is past its </think> already
        in_reasoning = req.thinking and not req.continue_final
        parser = self._parser_factory(in_reasoning) if req.messages is not None else None
        n_tokens = n_reasoning = 0
        answering = not in_reasoning           # past </think>: tokens stop counting as reasoning
        think_tail = ""                        # end of the reasoning text (finds a split </think>)
        t_last = None
        done = None
        # the session is not thread-safe: even this look-up happens here, on the engine thread
        job.emit(Started(len(job.ids), int(self.session.prompt_cache_tokens(job.ids))))
        gen = self.session.generate(job.ids, params, cancelled=job.cancel.is_set)
        try:
            for ev in gen:
                if hasattr(ev, "finish_reason"):
                    done = ev
                    break
                now = time.monotonic()
                if t_last is None:
                    m.observe_ttft(now - job.t_arrival)
                else:
                    m.observe_itl(now - t_last)
                t_last = now
                n_tokens += 1
                m.add(generated_tokens=1)
                if parser is None:
                    if ev.text:
                        job.emit(Text(ev.text))
                    continue
                if not answering:                  # tokens up to and including the one that closes </think>
                    n_reasoning += 1
                    think_tail += ev.text
                    answering = END_THINK in think_tail
                    think_tail = think_tail[-len(END_THINK):]
                for out in parser.feed(ev.text):
                    self._emit(job, out)
                if job.cancel.is_set():
                    break
        finally:
            gen.close()
        self._spec_report(done)
        if done is None or done.finish_reason == "cancelled" or job.cancel.is_set():
            m.add(cancelled=1)
            job.emit(Done("cancelled", len(job.ids), 0, n_tokens, n_reasoning))
            return
        if parser is not None:
            tail = parser.feed(EOS_TEXT) if done.finish_reason == "stop" and done.stop_string is None else []
            for out in tail + parser.finish():
                self._emit(job, out)
        m.add(prompt_tokens=done.prompt_tokens, cached_prompt_tokens=done.cached_tokens)
        job.emit(Done(done.finish_reason, done.prompt_tokens, done.cached_tokens, done.completion_tokens,
                      n_reasoning, done.stop_string))

    def _spec_report(self, done) -> None:
        """Speculative decoding's share of the request (ds4py.spec): /metrics counters and the request log."""
        st = getattr(self.session, "spec_stats", None)
        if st is None:
            return
        self.metrics.add(spec_rounds=st.rounds, spec_drafted=st.drafted, spec_accepted=st.accepted,
                         spec_tokens=st.spec_tokens, spec_plain_steps=st.plain_steps)
        log.info("request done (%s, %s tokens); %s", getattr(done, "finish_reason", "interrupted"),
                 getattr(done, "completion_tokens", "?"), st.summary())

    def _emit(self, job: Job, out) -> None:
        kind = type(out).__name__
        if kind == "ReasoningDelta":
            job.emit(Reasoning(out.text))
        elif kind == "ContentDelta":
            job.emit(Text(out.text))
        elif kind == "ToolCall":
            tid = ToolMemory.new_id(job.id_prefix)
            self.tool_memory.remember(tid, StoredCall(out.name, out.arguments, out.raw_dsml))
            job.emit(ToolCallOut(tid, out.name, out.arguments))
        elif kind == "ParseIssue":
            log.info("DSML parse issue: %s", out.reason)


class PrefillPacer:
    """Prefill chunk sizes that keep one chunk near `seconds`, so that a client who disconnects during a long
    prefill frees the engine within about that long (the session checks for cancellation between chunks).

    The time of a chunk is modelled as a + b*n (a fixed cost per model call, b per token), fitted to the last
    few chunks. A chunk is (seconds - a) / b tokens, but never so small that the fixed cost is more than half of
    its time (n >= a / b): when one call costs more than `seconds` anyway (the numpy reference on a full-size
    model re-reads its weights every call), throughput wins over latency.
    """

    def __init__(self, seconds: float = 0.25, min_len: int = 16, max_len: int = 2048, start_len: int = 64):
        if seconds <= 0 or not 1 <= min_len <= start_len <= max_len:
            raise ValueError("PrefillPacer needs seconds > 0 and 1 <= min_len <= start_len <= max_len")
        self.seconds, self.min_len, self.max_len = seconds, min_len, max_len
        self.len = start_len
        self._samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=8)

    def next_len(self) -> int:
        return self.len

    def record(self, n: int, seconds: float) -> None:
        self._samples.append((n, max(seconds, 1e-6)))
        a, b = self._fit()
        want = max((self.seconds - a) / b, a / b)
        # at most double per chunk: one fast chunk (a cached prefix, a warm cache) must not make the next huge
        self.len = int(min(self.max_len, self.len * 2, max(self.min_len, want)))

    def _fit(self) -> tuple[float, float]:
        ns = [n for n, _ in self._samples]
        ts = [t for _, t in self._samples]
        if len(set(ns)) < 2:                       # one size seen: no way to tell a from b; assume a = 0
            return 0.0, sum(ts) / sum(ns)
        mn, mt = sum(ns) / len(ns), sum(ts) / len(ts)
        var = sum((n - mn) ** 2 for n in ns)
        b = sum((n - mn) * (t - mt) for n, t in zip(ns, ts)) / var
        if b <= 0:                                 # noise (or a cache effect) dominates: per-token cost only
            return 0.0, mt / mn
        return max(0.0, mt - b * mn), b


class QueueFull(ApiError):
    pass


class Worker:
    """One engine thread and a bounded FIFO of waiting jobs (the running job is not counted)."""

    def __init__(self, engine: Engine, max_queue: int = 64):
        self.engine, self.max_queue = engine, max_queue
        self._pending: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._running: Job | None = None
        self._thread = threading.Thread(target=self._loop, name="ds4py-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if len(self._pending) >= self.max_queue:
                retry = max(1, len(self._pending) // 2)
                raise QueueFull(429, f"the server is busy: {len(self._pending)} requests are waiting "
                                     f"(--max-queue {self.max_queue}); retry later",
                                kind="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)})
            self._pending.append(job)
            self.engine.metrics.queue_depth = len(self._pending)
            self._cv.notify()

    def close(self) -> None:
        """Stop taking jobs and cancel every job, the running one too: a prefill stops at its next chunk."""
        with self._cv:
            self._closed = True
            for job in self._pending:
                job.cancel.set()
            if self._running is not None:
                self._running.cancel.set()
            self._cv.notify_all()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread to finish (after close()); True when it did within the timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        m = self.engine.metrics
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed and not self._pending:
                    return
                job = self._pending.popleft()
                m.queue_depth = len(self._pending)
                self._running = job
                if self._closed:
                    job.cancel.set()
            if job.cancel.is_set():
                m.add(cancelled=1)
                job.emit(Done("cancelled", len(job.ids)))
                continue
            m.running = 1
            try:
                self.engine.run(job)
            except InvalidLogits as e:
                # a correct model never gives non-finite logits for valid token ids: the weights are broken in a
                # way the load-time checks did not sample. Say so on /health and on every request, not a 500 each.
                self.engine.broken = (f"the model produced invalid logits ({e}); its weights are corrupt: run "
                                      f"'python -m ds4py inspect MODEL --verify' and restart with a good file")
                log.error("%s", self.engine.broken)
                job.emit(Done("error", len(job.ids), error=self.engine.broken))
            except Exception as e:  # a bug or a backend failure: fail this request, keep serving
                log.exception("generation failed")
                job.emit(Done("error", len(job.ids), error=f"generation failed: {type(e).__name__}: {e}"))
            finally:
                m.running = 0
                with self._cv:
                    self._running = None
