"""Does a long-lived replica stay flat? Thousands of streamed requests at a held concurrency (half of the clients
disconnect after their first event), in rounds, against `python -m ds4py serve`; the server's RSS is sampled
after every round, once it is idle.

    python bench/soak.py                                   # ds4-tiny golden model, 8 rounds of 250 requests
    python bench/soak.py -m model.gguf --rounds 20 --requests 500 --concurrency 64 --json out.json
    DS4PY_SCRIPTED_MODEL=script.json python bench/soak.py --rounds 20 --requests 500   # no forward pass: the
                                           # server's own per-request structures at scale (script {"rules": []})

Every request is distinct (its own conversation id, a varying prompt, a fresh session header, an unknown field
name, a tool call id to replay), so whatever the server keeps per request, per header or per field would show.
The verdict compares the growth of the last half of the rounds with the first round's: flat means the last
rounds grew less than --flat-kb per request. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one(session, url: str, i: int, disconnect: bool, max_tokens: int) -> str:
    import aiohttp

    api = ("chat", "messages", "responses")[i % 3]
    text = f"request {i}: " + "tell me something " * (1 + i % 7)
    headers = {"Content-Type": "application/json", "X-Session-ID": f"soak-{i}"}
    if api == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
    elif api == "messages":
        path, body = "/v1/messages", {"messages": [{"role": "user", "content": text}],
                                      "thinking": {"type": "disabled"}}
    else:
        path, body = "/v1/responses", {"input": text}
    body.update(model="deepseek-v4-flash", stream=True, max_tokens=max_tokens, **{f"x_unknown_{i}": 1})
    if api == "responses":
        body["max_output_tokens"] = body.pop("max_tokens")
    try:
        async with session.post(url + path, data=json.dumps(body), headers=headers,
                                timeout=aiohttp.ClientTimeout(total=300)) as r:
            if r.status != 200:
                return f"http {r.status}"
            async for _ in r.content.iter_any():
                if disconnect:
                    return "gone"            # closing the response drops the connection mid-stream
            return "ok"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return type(e).__name__


async def round_(url: str, start: int, n: int, concurrency: int, max_tokens: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency, force_close=True)) as s:
        async def guarded(i):
            async with sem:
                return await one(s, url, i, i % 2 == 1, max_tokens)
        outs = await asyncio.gather(*(guarded(i) for i in range(start, start + n)))
    counts: dict[str, int] = {}
    for o in outs:
        counts[o] = counts.get(o, 0) + 1
    return counts


def wait_idle(url: str, seconds: float = 120) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("ds4py_running_requests ", "ds4py_queue_depth ")))
        if busy == 0:
            return
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=str(REPO.parent / "shared" / "golden" / "ds4-tiny" / "tiny.gguf"))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--requests", type=int, default=250, help="requests per round")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=3)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--flat-kb", type=float, default=2.0, help="KB per request the last rounds may grow")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    port = free_port()
    # a SIGTERM (timeout, Ctrl-C of a wrapper) unwinds through the `finally` that stops the child servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cmd = [sys.executable, "-m", "ds4py", "serve", "-m", args.model, "--port", str(port), "--ctx", "1024",
           "--sessions", str(args.sessions), "--max-queue", str(args.concurrency * 2)]
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    samples, outcomes = [], []
    try:
        t0 = time.monotonic()
        while True:
            try:
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() - t0 > 120 or proc.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        samples.append(rss_kb(proc.pid))
        t_run = time.monotonic()
        for r in range(args.rounds):
            outcomes.append(asyncio.run(round_(url, r * args.requests, args.requests, args.concurrency,
                                               args.max_tokens)))
            wait_idle(url)
            samples.append(rss_kb(proc.pid))
            print(f"round {r + 1}: RSS {samples[-1] / 1024:.1f} MB, {outcomes[-1]}", flush=True)
        seconds = time.monotonic() - t_run
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    half = len(samples) // 2
    last_kb_per_req = (samples[-1] - samples[half]) / max(1, (len(samples) - 1 - half) * args.requests)
    first_kb_per_req = (samples[1] - samples[0]) / args.requests
    report = {"requests": args.rounds * args.requests, "concurrency": args.concurrency, "seconds": round(seconds, 1),
              "rss_mb": [round(s / 1024, 1) for s in samples], "first_round_kb_per_request": round(first_kb_per_req, 2),
              "last_rounds_kb_per_request": round(last_kb_per_req, 3), "flat": last_kb_per_req <= args.flat_kb,
              "outcomes": outcomes}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
