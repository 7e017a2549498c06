"""Prometheus text exposition (format 0.0.4) for `GET /metrics`, written by hand: counters, gauges and
histograms. Updated from the event loop and the engine thread, so every mutation holds one lock; the engine
thread publishes the sessions' occupancy and the disk cache's figures (set_sessions, set_disk) instead of
/metrics reading engine state."""

from __future__ import annotations

import bisect
import threading
import time

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
REUSE_SOURCES = ("live", "rollback", "snapshot", "disk", "none")
AFFINITY_RESULTS = ("hit", "fallback", "none")
# vLLM's own buckets (vllm/v1/metrics/loggers.py), so that dashboards and routers built for vLLM read ours alike
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
VLLM_FINISH_REASONS = ("stop", "length", "abort")
REUSE_RESULTS = ("hit", "miss", "cold")


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

    def lines(self, name: str, labels: str = "") -> list[str]:
        """labels: extra label pairs, e.g. 'model_name="x"' (put before le, as prometheus_client does)."""
        lab, pre = (f"{{{labels}}}" if labels else ""), (labels + "," if labels else "")
        out, cum = [], 0
        for le, c in zip(self.buckets, self.counts):
            cum += c
            out.append(f'{name}_bucket{{{pre}le="{le}"}} {cum}')
        out.append(f'{name}_bucket{{{pre}le="+Inf"}} {self.count}')
        out.append(f"{name}_sum{lab} {self.sum:.6f}")
        out.append(f"{name}_count{lab} {self.count}")
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
        # model steps (serve --sessions N): sequences and rows per step, and its time
        self.batch = Histogram(BATCH_BUCKETS)
        self.step_rows = Histogram(TOKEN_BUCKETS)
        self.step_seconds = Histogram(STEP_BUCKETS)
        # KV reuse per request: where it came from, hit / miss / cold, and where a miss diverged
        self.reuse_source = dict.fromkeys(REUSE_SOURCES, 0)
        self.reuse_result = dict.fromkeys(REUSE_RESULTS, 0)
        self.missed_tokens = 0
        self.divergence = Histogram(TOKEN_BUCKETS)
        self.last_divergence = 0
        self.sessions: list[tuple[int, int, bool]] = []    # per resident session: (tokens, bytes, active)
        self.disk: dict[str, float] | None = None
        # session affinity (X-Session-ID and the agents' own session headers): hit = the request ran in its
        # session's resident state, fallback = it carried a session id but the prefix match chose, none = no id
        self.affinity = dict.fromkeys(AFFINITY_RESULTS, 0)
        self.session_displaced = 0       # a keyed request took the session of another key's conversation
        # the vLLM-compatible names (docs/server.md "/metrics"): label values and the KV capacity they need
        self.model_name = "ds4py"
        self.replica_id: str | None = None
        self.kv_capacity_tokens = 0                        # sessions x context: what kv_cache_usage_perc divides by
        self.vllm_ttft = Histogram(VLLM_TTFT_BUCKETS)
        self.vllm_itl = Histogram(VLLM_ITL_BUCKETS)
        self.vllm_e2e = Histogram(VLLM_E2E_BUCKETS)
        self.finished = dict.fromkeys(VLLM_FINISH_REASONS, 0)

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
            self.vllm_ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)
            self.vllm_itl.observe(seconds)

    def observe_finished(self, seconds: float, finish_reason: str) -> None:
        """A request that was generated has ended: arrival to its last token, and why (vLLM's reasons: stop,
        length, abort; an error or a cancellation is an abort)."""
        reason = finish_reason if finish_reason in ("stop", "length") else "abort"
        with self._lock:
            self.vllm_e2e.observe(seconds)
            self.finished[reason] += 1

    def observe_affinity(self, result: str) -> None:
        with self._lock:
            self.affinity[result] += 1

    def observe_step(self, sequences: int, rows: int, seconds: float) -> None:
        with self._lock:
            self.batch.observe(sequences)
            self.step_rows.observe(rows)
            self.step_seconds.observe(seconds)

    def observe_reuse(self, source: str, result: str, divergence: int | None, missed_tokens: int) -> None:
        with self._lock:
            self.reuse_source[source] += 1
            self.reuse_result[result] += 1
            if divergence is not None:
                self.divergence.observe(divergence)
                self.last_divergence = divergence
                self.missed_tokens += missed_tokens

    def set_sessions(self, sessions: list[tuple[int, int, bool]]) -> None:
        with self._lock:
            self.sessions = list(sessions)

    def set_disk(self, disk) -> None:
        st = disk.stats
        figures = {"entries": len(disk), "bytes": disk.nbytes(), "limit": disk.space, "hits": st.hits,
                   "load_failures": st.load_failures, "written": st.written_bytes, "read": st.read_bytes,
                   "deleted": st.deleted, "skipped": st.skipped, **{f"writes_{r}": n for r, n in st.writes.items()}}
        with self._lock:
            self.disk = figures

    def render(self) -> str:
        with self._lock:
            out = ["# HELP ds4py_requests_total HTTP requests by endpoint and status code.",
                   "# TYPE ds4py_requests_total counter"]
            for (ep, st), n in sorted(self.requests.items()):
                out.append(f'ds4py_requests_total{{endpoint="{ep}",status="{st}"}} {n}')
            for name, help_, value in (
                ("ds4py_prompt_tokens_total", "Prompt tokens of generation requests.", self.prompt_tokens),
                ("ds4py_cached_prompt_tokens_total", "Prompt tokens served from cached KV (live, snapshot, disk).",
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
                ("ds4py_running_requests", "Requests being generated (at most --sessions).", self.running),
                ("ds4py_spec_acceptance_ratio", "Accepted / verified draft tokens since start.",
                 round(self.spec_accepted / self.spec_drafted, 6) if self.spec_drafted else 0),
                ("ds4py_spec_tokens_per_round", "Tokens per speculative round since start.",
                 round(self.spec_tokens / self.spec_rounds, 6) if self.spec_rounds else 0),
                ("ds4py_spec_mean_k", "Mean draft length the scheduler chose per decode step (plain steps: 0).",
                 round(self.spec_drafted / (self.spec_rounds + self.spec_plain_steps), 6)
                 if self.spec_rounds + self.spec_plain_steps else 0),
            ):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value}"]
            for name, help_, h in (
                ("ds4py_time_to_first_token_seconds", "Request arrival to first sampled token.", self.ttft),
                ("ds4py_inter_token_latency_seconds", "Time between consecutive sampled tokens.", self.itl),
                ("ds4py_batch_sequences", "Sequences per model step (serve --sessions N).", self.batch),
                ("ds4py_batch_rows", "Token rows per model step: decode rows plus prefill chunks.", self.step_rows),
                ("ds4py_step_seconds", "Time of one batched model step.", self.step_seconds),
                ("ds4py_kv_cache_miss_divergence_tokens", "Token index where a missed prompt first diverged "
                 "from the longest cached history that shares its start.", self.divergence),
            ):
                out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + h.lines(name)
            out += ["# HELP ds4py_kv_cache_requests_total Requests by KV reuse: hit (served every cached token "
                    "the prompt shares), miss (it diverged from a cached history: see the log), cold (nothing "
                    "cached shares its start).", "# TYPE ds4py_kv_cache_requests_total counter"]
            out += [f'ds4py_kv_cache_requests_total{{result="{k}"}} {v}' for k, v in self.reuse_result.items()]
            out += ["# HELP ds4py_kv_cache_source_total Requests by where their reused prompt tokens came from.",
                    "# TYPE ds4py_kv_cache_source_total counter"]
            out += [f'ds4py_kv_cache_source_total{{source="{k}"}} {v}' for k, v in self.reuse_source.items()]
            out += ["# HELP ds4py_kv_cache_missed_tokens_total Prompt tokens re-prefilled although a cached "
                    "history shared them (misses).", "# TYPE ds4py_kv_cache_missed_tokens_total counter",
                    f"ds4py_kv_cache_missed_tokens_total {self.missed_tokens}",
                    "# HELP ds4py_kv_cache_last_miss_divergence_token Where the last missed prompt diverged.",
                    "# TYPE ds4py_kv_cache_last_miss_divergence_token gauge",
                    f"ds4py_kv_cache_last_miss_divergence_token {self.last_divergence}"]
            if self.sessions:
                for name, help_, col in (
                    ("ds4py_session_tokens", "Tokens held by each resident session's live KV state.", 0),
                    ("ds4py_session_bytes", "KV bytes held by each resident session (live state and snapshots).", 1),
                    ("ds4py_session_active", "1 while a resident session runs a request.", 2),
                ):
                    out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
                    out += [f'{name}{{session="{i}"}} {int(row[col])}' for i, row in enumerate(self.sessions)]
                out += ["# HELP ds4py_kv_cache_resident_bytes KV bytes held in memory by all sessions.",
                        "# TYPE ds4py_kv_cache_resident_bytes gauge",
                        f"ds4py_kv_cache_resident_bytes {sum(r[1] for r in self.sessions)}"]
            if self.disk is not None:
                d = self.disk
                for name, help_, kind, value in (
                    ("ds4py_kv_disk_entries", "Checkpoints in the disk KV cache.", "gauge", d["entries"]),
                    ("ds4py_kv_disk_bytes", "Bytes of the disk KV cache's checkpoints.", "gauge", d["bytes"]),
                    ("ds4py_kv_disk_limit_bytes", "--kv-disk-space-mb in bytes.", "gauge", d["limit"]),
                    ("ds4py_kv_disk_hits_total", "Checkpoints loaded from disk.", "counter", d["hits"]),
                    ("ds4py_kv_disk_load_failures_total", "Checkpoints that failed to load (ignored).", "counter",
                     d["load_failures"]),
                    ("ds4py_kv_disk_read_bytes_total", "Bytes read from the disk KV cache.", "counter", d["read"]),
                    ("ds4py_kv_disk_written_bytes_total", "Bytes written to the disk KV cache.", "counter",
                     d["written"]),
                    ("ds4py_kv_disk_deleted_total", "Checkpoints deleted to stay within the space.", "counter",
                     d["deleted"]),
                    ("ds4py_kv_disk_skipped_total", "Checkpoints not written (writer busy, or larger than the "
                     "space).", "counter", d["skipped"]),
                ):
                    out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
                out += ["# HELP ds4py_kv_disk_writes_total Checkpoints written, by moment.",
                        "# TYPE ds4py_kv_disk_writes_total counter"]
                out += [f'ds4py_kv_disk_writes_total{{reason="{k[7:]}"}} {v}' for k, v in d.items()
                        if k.startswith("writes_")]
            out += ["# HELP ds4py_session_affinity_total Requests by session affinity: hit (ran in the resident "
                    "session of its session id), fallback (carried a session id, the prefix match chose), none "
                    "(no session id: the prefix match chose).", "# TYPE ds4py_session_affinity_total counter"]
            out += [f'ds4py_session_affinity_total{{result="{k}"}} {v}' for k, v in self.affinity.items()]
            out += ["# HELP ds4py_session_displaced_total Requests with a session id that took the resident session "
                    "of another session id's conversation (more conversations than --sessions on this replica).",
                    "# TYPE ds4py_session_displaced_total counter",
                    f"ds4py_session_displaced_total {self.session_displaced}"]
            if self.replica_id is not None:
                out += ["# HELP ds4py_replica_info The replica id this server was started with (serve --replica-id).",
                        "# TYPE ds4py_replica_info gauge", f'ds4py_replica_info{{replica_id="{_esc(self.replica_id)}"}} 1']
            out += self._vllm_lines()
            return "\n".join(out) + "\n"

    def _vllm_lines(self) -> list[str]:
        """The vLLM names, types, units and labels that routers (vllm-router, sglang-router) and Kubernetes'
        inference gateway (its endpoint picker) read; same meaning as in vLLM's v1 engine. Lock held."""
        lab = f'model_name="{_esc(self.model_name)}",engine="0"'
        used = sum(r[0] for r in self.sessions)
        usage = round(min(1.0, used / self.kv_capacity_tokens), 6) if self.kv_capacity_tokens else 0.0
        out = []
        for name, kind, help_, value in (
            ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", self.running),
            ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", self.queue_depth),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use "
             "vllm:kv_cache_usage_perc instead.", usage),
            ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
             self.generated_tokens),
            ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried "
             "tokens.", self.prompt_tokens),
            ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
             self.cached_prompt_tokens),
        ):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{lab}}} {float(value)}"]
        out += ["# HELP vllm:request_success_total Count of successfully processed requests.",
                "# TYPE vllm:request_success_total counter"]
        out += [f'vllm:request_success_total{{{lab},finished_reason="{k}"}} {float(v)}'
                for k, v in self.finished.items()]
        for name, help_, h in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.vllm_ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.vllm_itl),
            ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.vllm_e2e),
        ):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"] + h.lines(name, lab)
        # no adapters: the gateway reads this gauge's labels (empty adapter lists) and takes its value as the
        # time of the sample, as vLLM's set_to_current_time() does
        out += ["# HELP vllm:lora_requests_info Running stats on lora requests.", "# TYPE vllm:lora_requests_info gauge",
                f'vllm:lora_requests_info{{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}} '
                f"{time.time():.3f}"]
        return out


def _esc(value: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
