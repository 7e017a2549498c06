"""Serving load test: `python -m ds4py bench serve --url http://127.0.0.1:8000 ...`.

Streams OpenAI chat-completion requests at a running server (ours or any OpenAI-compatible one) and reports
the figures `vllm bench serve` reports: success/failure counts, duration, req/s, output and total tok/s, and
TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99).

Definitions (as in vLLM):
  TTFT  time from sending the request to the first streamed token delta (content or reasoning)
  ITL   gaps between consecutive streamed token deltas
  TPOT  (e2e − TTFT) / (output_tokens − 1), per request
  e2e   time from sending to the end of the stream
Token counts come from the server's `usage` (stream_options.include_usage), not from counting chunks.

`--concurrency 1,4,8` runs the load once per level (each with its own prompts, so that one level does not
warm the server's KV cache for the next) and adds a table of what concurrency buys: against `serve
--sessions N` the decode rows of concurrent requests share one model step.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import numpy as np
import orjson

from ds4py.errors import Ds4Error


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    replica: str | None = None      # X-Replica-Id of the answer (serve --replica-id; through a router)


def make_prompt(words: list[str], approx_tokens: int, rng: random.Random) -> str:
    """About `approx_tokens` tokens of real words (≈ 1 token per English word piece), from a random offset."""
    n = max(1, int(approx_tokens * 0.75))
    start = rng.randrange(0, max(1, len(words) - n))
    chunk = words[start:start + n]
    while len(chunk) < n:
        chunk += words[: n - len(chunk)]
    return " ".join(chunk)


async def _one_request(session, url: str, headers: dict, body: dict, timeout: float) -> RequestResult:
    import aiohttp

    res = RequestResult(ok=False)
    t0 = time.perf_counter()
    last = None
    try:
        async with session.post(url, data=orjson.dumps(body), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            res.replica = resp.headers.get("X-Replica-Id")
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for raw in resp.content:
                buf += raw
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    chunk = orjson.loads(payload)
                    if chunk.get("usage"):
                        res.prompt_tokens = int(chunk["usage"].get("prompt_tokens", 0))
                        res.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
                            now = time.perf_counter()
                            if last is None:
                                res.ttft = now - t0
                            else:
                                res.itl.append(now - last)
                            last = now
        res.e2e = time.perf_counter() - t0
        res.ok = last is not None or res.output_tokens == 0
        if not res.ok:
            res.error = "stream ended without any token"
    except Exception as e:  # timeouts, OSError, bad JSON, aiohttp.ClientError: counted as a failed request
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _run(url: str, model: str | None, concurrency: int, requests: int, input_len: int, output_len: int,
               request_rate: float | None, api_key: str | None, seed: int, words: list[str],
               timeout: float, ignore_eos: bool) -> tuple[list[RequestResult], float, str]:
    import aiohttp

    base = url.rstrip("/")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        try:                   # reach the server once before the load: a wrong --url is one sentence, not N failures
            async with session.get(base + "/v1/models", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=30)) as r:
                if r.status != 200 and model is None:
                    raise Ds4Error(f"{base}/v1/models answered HTTP {r.status}; pass --served-model")
                if model is None:
                    data = await r.json()
                    model = data["data"][0]["id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            why = str(e) or type(e).__name__
            raise Ds4Error(f"cannot reach the server at {base} ({why}); start it with 'python3 -m ds4py serve' "
                           f"or pass the right --url") from None
        sem = asyncio.Semaphore(concurrency)
        bodies = []
        for _ in range(requests):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": make_prompt(words, input_len, rng)}],
                "max_tokens": output_len,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if ignore_eos:
                body["ignore_eos"] = True
            bodies.append(body)

        async def guarded(body):
            async with sem:
                return await _one_request(session, base + "/v1/chat/completions", headers, body, timeout)

        t0 = time.perf_counter()
        tasks = []
        arrival = random.Random(seed + 1)
        for body in bodies:
            tasks.append(asyncio.create_task(guarded(body)))
            if request_rate:  # Poisson arrivals, as vllm bench serve does
                await asyncio.sleep(arrival.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0, model


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000.0  # milliseconds
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_ms": _stats([r.e2e for r in ok]),
        "per_replica": {k: sum(r.replica == k for r in ok) for k in sorted({r.replica for r in ok if r.replica})},
    }


def format_summary(s: dict) -> str:
    lines = [
        "============ Serving Benchmark Result ============",
        f"{'Successful requests:':<40}{s['successful_requests']:>10}",
        f"{'Failed requests:':<40}{s['failed_requests']:>10}",
        f"{'Benchmark duration (s):':<40}{s['duration_s']:>10.2f}",
        f"{'Total input tokens:':<40}{s['total_input_tokens']:>10}",
        f"{'Total generated tokens:':<40}{s['total_output_tokens']:>10}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:>10.2f}",
        f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>10.2f}",
        f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>10.2f}",
    ]
    for key, name in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                      ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        lines.append(f"{name:-^50}")
        for stat in ("mean", "p50", "p90", "p99"):
            lines.append(f"{(stat.capitalize() if stat == 'mean' else stat.upper()) + ' (ms):':<40}{s[key][stat]:>10.2f}")
    for rid, n in s.get("per_replica", {}).items():
        lines.append(f"{'Requests answered by replica ' + rid + ':':<40}{n:>10}")
    for e in s["errors"]:
        lines.append(f"error: {e}")
    lines.append("=" * 50)
    return "\n".join(lines) + "\n"


def run_serve_bench(url: str, model: str | None = None, concurrency: int = 1, requests: int = 8,
                    input_len: int = 128, output_len: int = 32, request_rate: float | None = None,
                    api_key: str | None = None, seed: int = 0, prompt_text: str = "",
                    timeout: float = 600.0, ignore_eos: bool = False) -> dict:
    if concurrency < 1 or requests < 1 or input_len < 1 or output_len < 1:
        raise Ds4Error("--concurrency, --requests, --input-len and --output-len must all be >= 1")
    if request_rate is not None and request_rate <= 0:
        raise Ds4Error("--request-rate must be > 0 requests/s")
    words = prompt_text.split() or ["hello"]
    results, duration, model = asyncio.run(_run(url, model, concurrency, requests, input_len, output_len,
                                                 request_rate, api_key, seed, words, timeout, ignore_eos))
    summary = summarize(results, duration)
    summary.update({"url": url, "model": model, "concurrency": concurrency, "requests": requests,
                    "input_len": input_len, "output_len": output_len, "request_rate": request_rate})
    return summary


def dumps(summary: dict) -> str:
    return json.dumps(summary, indent=2) + "\n"


def parse_levels(text: str | int) -> list[int]:
    """`--concurrency`: one level or a comma-separated list (1,4,8)."""
    try:
        levels = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise Ds4Error(f"--concurrency takes integers separated by commas, got {text!r}") from None
    if not levels or any(c < 1 for c in levels):
        raise Ds4Error(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


def run_serve_sweep(url: str, levels: list[int], seed: int = 0, **kw) -> list[dict]:
    """run_serve_bench once per concurrency level, each with other prompts (seed + 1000 · level index)."""
    return [run_serve_bench(url, concurrency=c, seed=seed + 1000 * i, **kw) for i, c in enumerate(levels)]


def format_sweep(summaries: list[dict]) -> str:
    base = summaries[0]["output_throughput"] or float("nan")
    lines = ["| concurrency | requests | duration s | req/s | output tok/s | × first | TTFT p50 ms | TPOT mean ms "
             "| ITL p50 ms | e2e p50 ms | failed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        lines.append(f"| {s['concurrency']} | {s['requests']} | {s['duration_s']:.2f} | {s['request_throughput']:.2f} "
                     f"| {s['output_throughput']:.1f} | {s['output_throughput'] / base:.2f} "
                     f"| {s['ttft_ms']['p50']:.0f} | {s['tpot_ms']['mean']:.1f} | {s['itl_ms']['p50']:.1f} "
                     f"| {s['e2e_ms']['p50']:.0f} | {s['failed_requests']} |")
    return "\n".join(lines) + "\n"
