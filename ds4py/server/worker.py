"""The engine side of the server: prompt rendering, one worker thread running the blocking numpy/CUDA model,
and a bounded FIFO queue in front of it.

The event loop never runs model code. A request handler renders its prompt in a thread pool, puts a `Job` on
the queue and awaits the job's asyncio.Queue; the worker thread runs the jobs and posts `Reasoning` / `Text` /
`ToolCallOut` / `Done` events back with call_soon_threadsafe (`JobOutput`). The thread (engine_thread.py's
Worker) runs the Scheduler (scheduler.py: the one generation driver, ds4py/driver.py, fed from the queue) over
the engine's SessionPool: one session runs one job at a time,
`serve --sessions N` up to N together, their decode rows in one batched model step. A handler whose client goes
away sets `job.cancel`; the scheduler checks it before every step (so within one token) and between prefill
chunks.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ds4py.session import common_prefix

from .affinity import Affinity
from .metrics import Metrics
from .protocol import MID_SYSTEM, ApiError, Done, GenRequest, Reasoning, Text, ToolCallOut
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
    t_first: float | None = None          # when the handler saw the first token (the access log's speeds)
    done: Done | None = None              # the final event, as the handler saw it
    session_key: str | None = None         # its conversation (server.affinity): routed to that session first

    def emit(self, ev) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:      # the event loop is gone (server shutting down): nobody is listening
            self.cancel.set()


class Engine:
    """Everything between a GenRequest and its events: rendering, tokenizing, sampling, DSML parsing.

    `sessions` is a SessionPool (`serve --sessions N`), or one Session (a pool of one: SessionPool.of); the
    Scheduler drives it either way."""

    def __init__(self, sessions, tokenizer, *, metrics: Metrics | None = None, tool_memory: ToolMemory | None = None,
                 encode_prompt: Callable | None = None, parser_factory: Callable | None = None,
                 native_mid_system: bool = False):
        from ds4py.server.pool import SessionPool

        self.pool = sessions if isinstance(sessions, SessionPool) else SessionPool.of(sessions)
        self.tokenizer = tokenizer
        self.ctx_size = int(sessions.ctx_size)
        self.vocab_size = self.pool.vocab_size
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
        self.affinity = self.pool.affinity if self.pool is not None else Affinity()

    @property
    def disk(self):
        return self.pool.disk

    @property
    def model(self):
        """The model the sessions step (a SpecModel when decoding speculatively)."""
        return self.pool.model

    @property
    def session(self):
        """The one session of a one-session server (None with several)."""
        return self.pool.sessions[0] if len(self.pool) == 1 else None

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
        vocab = self.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param="prompt")

    # ---- generation (engine thread) ---------------------------------------------------------------------

    @staticmethod
    def sampling_params(req: GenRequest):
        from ds4py.sampling import SamplingParams

        return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, min_p=req.min_p,
                              seed=req.seed, max_tokens=req.max_tokens, stop=list(req.stop), ignore_eos=req.ignore_eos)

    def histories(self) -> list[tuple[str, object]]:
        """Every token history a prompt could have been served from (the miss report's candidates)."""
        out = self.pool.histories() if len(self.pool) > 1 else list(self.pool.sessions[0].histories())
        if self.disk is not None:
            out += [(f"disk checkpoint {e.key[:12]} ({e.reason})", e.tokens) for e in self.disk.entries()]
        return out

    def report_reuse(self, prompt: list[int], cached: int, source: str, histories) -> None:
        """Count the request's reuse and, when it reused less than some cached history shares with it, say where
        the prompt first diverged from the best candidate (the cause of most cold re-prefills under agents)."""
        k, what, cand = 0, None, None
        for name, toks in histories:
            c = common_prefix(toks, prompt)
            if c > k:
                k, what, cand = c, name, toks
        if k == 0 and cached == 0:
            result = "cold"
        elif cached > 0 and cached >= min(k, len(prompt) - 1):
            result = "hit"
        else:
            result = "miss"
        self.metrics.observe_reuse(source, result, k if result == "miss" else None, max(0, k - cached))
        if result == "miss":
            def text(toks, a, b):
                return repr(self.tokenizer.decode([int(t) for t in toks[max(0, a):b]]))[:120]
            log.info("kv cache miss: the prompt (%d tokens) first diverged from %s (%d tokens) at token %d: after "
                     "%s the cached history has %s, the prompt %s; %d tokens reused, %d prefilled", len(prompt),
                     what, len(cand), k, text(prompt, k - 16, k), text(cand, k, k + 16), text(prompt, k, k + 16),
                     cached, len(prompt) - cached)

    def set_broken(self, e: Exception) -> None:
        # a correct model never gives non-finite logits for valid token ids: the weights are broken in a way the
        # load-time checks did not sample. Say so on /health and on every request, not a 500 each.
        self.broken = (f"the model produced invalid logits ({e}); its weights are corrupt: run "
                       f"'python -m ds4py inspect MODEL --verify' and restart with a good file")
        log.error("%s", self.broken)

    def publish(self) -> None:
        """Hand the sessions' occupancy and the disk cache's figures to /metrics (engine thread)."""
        self.metrics.set_sessions([(len(s.tokens), s.nbytes(), b) for s, b in zip(self.pool.sessions, self.pool.busy)])
        if self.disk is not None:
            self.metrics.set_disk(self.disk)

    def close(self) -> None:
        """The server stops: checkpoint every live state to the disk cache (engine thread, or after it ended)."""
        if self.disk is None:
            return
        for s in self.pool.sessions:
            try:
                s.close()
            except Exception:  # one bad state must not stop the others' checkpoints
                log.exception("kv cache: shutdown checkpoint failed")
        self.disk.close()


class JobOutput:
    """What one job's sampled tokens become on its event queue: Reasoning / Text / ToolCallOut events (DSML
    parsed), the reasoning count, the latency metrics, and the final Done."""

    def __init__(self, engine: Engine, job: Job):
        req = job.req
        self.engine, self.job, self.m = engine, job, engine.metrics
        # a continued (prefilled) assistant message is past its </think> already
        in_reasoning = req.thinking and not req.continue_final
        self.parser = engine._parser_factory(in_reasoning) if req.messages is not None else None
        self.n_tokens = self.n_reasoning = 0
        self.answering = not in_reasoning      # past </think>: tokens stop counting as reasoning
        self.think_tail = ""                   # end of the reasoning text (finds a split </think>)
        self.t_last: float | None = None

    def token(self, ev) -> None:
        job, m = self.job, self.m
        now = time.monotonic()
        if self.t_last is None:
            m.observe_ttft(now - job.t_arrival)
        else:
            m.observe_itl(now - self.t_last)
        self.t_last = now
        self.n_tokens += 1
        m.add(generated_tokens=1)
        if self.parser is None:
            if ev.text:
                job.emit(Text(ev.text))
            return
        if not self.answering:                 # tokens up to and including the one that closes </think>
            self.n_reasoning += 1
            self.think_tail += ev.text
            self.answering = END_THINK in self.think_tail
            self.think_tail = self.think_tail[-len(END_THINK):]
        for out in self.parser.feed(ev.text):
            self._emit(out)

    def finish(self, done) -> None:
        """done: the session's DoneEvent, or None when the generation stopped without one."""
        job, m = self.job, self.m
        m.observe_finished(time.monotonic() - job.t_arrival,
                           "abort" if done is None or job.cancel.is_set() else done.finish_reason)
        if done is None or done.finish_reason == "cancelled" or job.cancel.is_set():
            m.add(cancelled=1)
            job.emit(Done("cancelled", len(job.ids), 0, self.n_tokens, self.n_reasoning))
            return
        if self.parser is not None:
            tail = self.parser.feed(EOS_TEXT) if done.finish_reason == "stop" and done.stop_string is None else []
            for out in tail + self.parser.finish():
                if done.finish_reason == "length" and type(out).__name__ == "ParseIssue":
                    continue      # a turn cut off by max_tokens or the context is not malformed DSML
                self._emit(out)
        m.add(prompt_tokens=done.prompt_tokens, cached_prompt_tokens=done.cached_tokens)
        job.emit(Done(done.finish_reason, done.prompt_tokens, done.cached_tokens, done.completion_tokens,
                      self.n_reasoning, done.stop_string))

    def fail(self, error: str) -> None:
        """The generation failed (a model step, broken weights): the job ends with the error."""
        self.job.emit(Done("error", len(self.job.ids), error=error))

    def _emit(self, out) -> None:
        kind, job = type(out).__name__, self.job
        if kind == "ReasoningDelta":
            job.emit(Reasoning(out.text))
        elif kind == "ContentDelta":
            job.emit(Text(out.text))
        elif kind == "ToolCall":
            tid = ToolMemory.new_id(job.id_prefix)
            self.engine.tool_memory.remember(tid, StoredCall(out.name, out.arguments, out.raw_dsml))
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
