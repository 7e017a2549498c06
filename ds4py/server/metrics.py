"""Prometheus text exposition (format 0.0.4) for `GET /metrics`, written by hand: a few counters, a gauge, and
two histograms. Updated from the event loop and the engine thread, so every mutation holds one lock."""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)     # last slot: +Inf only
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip(self.buckets, self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{le}"}} {cum}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.count}")
        return out


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}     # (endpoint, status code) → count
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generated_tokens = 0
        self.cancelled = 0
        self.queue_depth = 0
        self.running = 0
        self.spec_rounds = 0            # speculative decoding (ds4py.spec): verify rounds with drafts
        self.spec_drafted = 0           # drafts verified
        self.spec_accepted = 0          # drafts accepted
        self.spec_tokens = 0            # tokens those rounds produced
        self.spec_plain_steps = 0       # one-token steps the scheduler chose instead
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def request_done(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def add(self, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)

    def render(self) -> str:
        with self._lock:
            out = ["# HELP ds4py_requests_total HTTP requests by endpoint and status code.",
                   "# TYPE ds4py_requests_total counter"]
            for (ep, st), n in sorted(self.requests.items()):
                out.append(f'ds4py_requests_total{{endpoint="{ep}",status="{st}"}} {n}')
            for name, help_, value in (
                ("ds4py_prompt_tokens_total", "Prompt tokens of generation requests.", self.prompt_tokens),
                ("ds4py_cached_prompt_tokens_total", "Prompt tokens served from the live KV state.",
                 self.cached_prompt_tokens),
                ("ds4py_generated_tokens_total", "Tokens sampled.", self.generated_tokens),
                ("ds4py_cancelled_generations_total", "Generations stopped because the client went away.",
                 self.cancelled),
                ("ds4py_spec_rounds_total", "Speculative decoding rounds (one verify step of drafts).",
                 self.spec_rounds),
                ("ds4py_spec_draft_tokens_total", "Draft tokens verified.", self.spec_drafted),
                ("ds4py_spec_accepted_tokens_total", "Draft tokens accepted.", self.spec_accepted),
                ("ds4py_spec_round_tokens_total", "Tokens produced by speculative rounds.", self.spec_tokens),
                ("ds4py_spec_plain_steps_total", "One-token steps the speculative scheduler chose.",
                 self.spec_plain_steps),
            ):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
            for name, help_, value in (
                ("ds4py_queue_depth", "Requests waiting for the engine.", self.queue_depth),
                ("ds4py_running_requests", "Requests being generated (0 or 1).", self.running),
                ("ds4py_spec_acceptance_ratio", "Accepted / verified draft tokens since start.",
                 round(self.spec_accepted / self.spec_drafted, 6) if self.spec_drafted else 0),
                ("ds4py_spec_tokens_per_round", "Tokens per speculative round since start.",
                 round(self.spec_tokens / self.spec_rounds, 6) if self.spec_rounds else 0),
            ):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value}"]
            for name, help_, h in (
                ("ds4py_time_to_first_token_seconds", "Request arrival to first sampled token.", self.ttft),
                ("ds4py_inter_token_latency_seconds", "Time between consecutive sampled tokens.", self.itl),
            ):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + h.lines(name)
            return "\n".join(out) + "\n"
