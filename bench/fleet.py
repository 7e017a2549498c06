"""A fleet on one machine (docs/deploy.md): N `ds4py serve` replicas behind an existing router (vllm-router or
sglang-router from PyPI), several multi-turn conversations at once, and one replica SIGKILLed mid-run.

    python bench/fleet.py                          # 2 replicas, vllm-router consistent_hash, 4 conversations
    python bench/fleet.py --router sglang --conversations 8 --turns 6 --disk shared
    python bench/fleet.py --no-kill --json out.json

Every process listens on a free 127.0.0.1 port; nothing else is contacted. Each conversation sends its turns
with `X-Session-ID: conv-<i>` (what vllm-router's consistent hash reads first, and the replica's session
affinity) and `X-SMG-Routing-Key` (what sglang-router's manual policy reads) and a system prompt long enough (~700 tokens) for a cold disk checkpoint. After turn --kill-turn of
every conversation, the next turns start and the replica that holds the first conversation is SIGKILLed while
its requests run. A failed turn is retried by its conversation (up to 4 times, as a client would); the report
says which requests failed, where each turn ran and what it reused:
- answered: every turn got an answer in the end;
- affinity: of each conversation's turns, the share served by the replica it was on (before the kill, and on
  its new replica after it), >= 95% wanted;
- cached: prompt tokens served from cache on later turns (per-request usage), and on the first turn after a
  move: cold (--disk own / none), or from the dead replica's checkpoints (--disk shared);
- failures: only requests in flight on the killed replica may fail;
- displaced: per surviving replica, the turns that took another conversation's resident session
  (`ds4py_session_displaced_total`): more conversations than --sessions on it, whose later turns then re-prefill
  what no snapshot or disk checkpoint (prompts of 512 tokens or more) holds.
It also counts the requests each replica served (X-Replica-Id), like `bench serve --base-url <router>`.
"""

from __future__ import annotations

import argparse
import http.client as http_client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RULES = ("You are a careful assistant working in a repository. Follow the project's rules, keep answers short, "
         "name the files you touch, and explain why a change is needed before making it. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_command(kind: str) -> list[str] | None:
    """How to start the router, or None when it is not installed."""
    import importlib.util

    if kind == "vllm":
        exe = shutil.which("vllm-router")
        if exe:
            return [exe]
        return [sys.executable, "-m", "vllm_router.launch_router"] if importlib.util.find_spec("vllm_router") else None
    if kind == "sglang":
        return [sys.executable, "-m", "sglang_router.launch_router"] \
            if importlib.util.find_spec("sglang_router") else None
    raise ValueError(f"unknown router {kind!r} (vllm or sglang)")


def http(method: str, url: str, body: dict | None = None, headers: dict | None = None,
         timeout: float = 120) -> tuple[int, dict, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def wait_for(url: str, seconds: float, proc: subprocess.Popen | None = None) -> None:
    t0 = time.monotonic()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{' '.join(proc.args[:3])} exited with {proc.returncode} before {url} answered")
        try:
            if http("GET", url, timeout=5)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() - t0 > seconds:
            raise RuntimeError(f"{url} did not answer 200 within {seconds:.0f} s")
        time.sleep(0.2)


class Fleet:
    """The replicas and the router as child processes; stop() ends every one still running."""

    def __init__(self, args, workdir: Path):
        self.args, self.workdir = args, workdir
        self.replicas: dict[str, tuple[subprocess.Popen, str]] = {}
        self.router: subprocess.Popen | None = None
        self.url = ""
        self.logs: list = []

    def start(self) -> None:
        a = self.args
        for i in range(a.replicas):
            rid, port = f"r{i}", free_port()
            cmd = [sys.executable, "-m", "ds4py", "serve", "--port", str(port), "--replica-id", rid,
                   "--ctx", str(a.ctx), "--sessions", str(a.sessions)]
            if a.model:
                cmd += ["-m", a.model]
            if a.disk != "none":
                d = self.workdir / ("kv" if a.disk == "shared" else f"kv-{rid}")
                cmd += ["--kv-disk-dir", str(d)]
            log = open(self.workdir / f"{rid}.log", "w")
            self.logs.append(log)
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": str(REPO)})
            self.replicas[rid] = (proc, f"http://127.0.0.1:{port}")
        for rid, (proc, url) in self.replicas.items():
            wait_for(url + "/health", a.ready_s, proc)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        urls = [u for _, u in self.replicas.values()]
        cmd = router_command(a.router)
        if cmd is None:
            raise RuntimeError(f"{a.router}-router is not installed (pip install {a.router}-router)")
        if a.router == "vllm":
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", a.policy,
                    "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
                    "--health-failure-threshold", "1", "--prometheus-host", "127.0.0.1",
                    "--prometheus-port", str(free_port()), "--log-level", "warning"]
        else:
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", a.policy,
                    "--worker-startup-check-interval", "1", "--health-check-interval-secs", "1",
                    "--health-failure-threshold", "1", "--prometheus-host", "127.0.0.1",
                    "--prometheus-port", str(free_port()), "--log-level", "warn"]
        log = open(self.workdir / "router.log", "w")
        self.logs.append(log)
        self.router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        wait_for(self.url + "/v1/models", a.ready_s, self.router)

    def kill(self, rid: str) -> None:
        proc, _ = self.replicas[rid]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in [p for p, _ in self.replicas.values()] + ([self.router] if self.router else []):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [p for p, _ in self.replicas.values()] + ([self.router] if self.router else []):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for log in self.logs:
            log.close()


class Conversation(threading.Thread):
    """One multi-turn chat through the router; waits at `gate` before turn `gate_turn`."""

    def __init__(self, i: int, fleet: Fleet, args, gate: threading.Event | None, deadline: float):
        super().__init__(name=f"conv-{i}", daemon=True)
        self.i, self.fleet, self.args, self.gate, self.deadline = i, fleet, args, gate, deadline
        self.key = f"conv-{i}"
        self.records: list[dict] = []
        self.turns_done = 0
        self.at_gate = threading.Event()

    def run(self) -> None:
        a = self.args
        # each conversation's own system prompt (a project name first): a moved conversation can only reuse its
        # own checkpoints, not another conversation's
        system = f"Project {self.i * 7919 % 1000:03d}. " + RULES * a.system_repeat
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Task {self.i}: start."}]
        for turn in range(a.turns):
            if self.gate is not None and turn == a.kill_turn + 1:
                self.at_gate.set()
                self.gate.wait(600)
            for attempt in range(5):
                if time.monotonic() > self.deadline:
                    self.records.append({"turn": turn, "attempt": attempt, "status": "deadline"})
                    return
                rec = self.request(messages, turn, attempt)
                self.records.append(rec)
                if rec["status"] == 200:
                    break
                time.sleep(1.0)
            else:
                return
            messages += [{"role": "assistant", "content": rec["text"] or "(empty)"},
                         {"role": "user", "content": f"Task {self.i}: next step {turn + 1}."}]
            self.turns_done += 1
        self.at_gate.set()

    def request(self, messages, turn: int, attempt: int) -> dict:
        """One turn through the router (streamed unless --no-stream)."""
        body = {"model": "deepseek-v4-flash", "messages": messages, "max_tokens": self.args.max_tokens,
                "temperature": 0, "reasoning_effort": "none", "stream": self.args.stream}
        if self.args.stream:
            body["stream_options"] = {"include_usage": True}
        t0 = time.monotonic()
        rec = {"turn": turn, "attempt": attempt, "t0": t0}
        req = urllib.request.Request(self.fleet.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Session-ID": self.key,
                                              "X-SMG-Routing-Key": self.key})
        try:
            with urllib.request.urlopen(req, timeout=self.args.request_timeout) as r:
                rec.update(status=200, replica=r.headers.get("x-replica-id"))
                out = read_stream(r) if self.args.stream else json.loads(r.read())
        except urllib.error.HTTPError as e:
            rec.update(status=e.code, replica=e.headers.get("x-replica-id"), t1=time.monotonic(),
                       error=e.read()[:200].decode("utf-8", "replace"))
            return rec
        except (OSError, ValueError, http_client.HTTPException) as e:   # reset, cut stream, no [DONE]
            rec.update(status="broken", t1=time.monotonic(), error=f"{type(e).__name__}: {e}")
            return rec
        rec.update(t1=time.monotonic(), text=out["text"], prompt_tokens=out["usage"]["prompt_tokens"],
                   cached=(out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        return rec


def read_stream(r) -> dict:
    """{'text', 'usage'} of an OpenAI chat SSE stream; ValueError when it ends without `data: [DONE]`."""
    text, usage = [], None
    for raw in r:
        line = raw.decode().rstrip("\r\n")
        if not line.startswith("data: "):
            continue                                   # blank lines, keep-alive comments
        if line == "data: [DONE]":
            if usage is None:
                raise ValueError("the stream ended without usage")
            return {"text": "".join(text), "usage": usage}
        chunk = json.loads(line[6:])
        for ch in chunk.get("choices", []):
            text.append(ch.get("delta", {}).get("content") or "")
        usage = chunk.get("usage") or usage
    raise ValueError("the stream ended without data: [DONE]")


def metric_sum(url: str, name: str) -> float | None:
    """The sum of one metric's samples on a replica (None when it does not answer)."""
    try:
        st, _, data = http("GET", url + "/metrics", timeout=5)
    except OSError:
        return None
    if st != 200:
        return None
    return sum(float(line.rsplit(" ", 1)[1]) for line in data.decode().splitlines()
               if line.startswith((name + " ", name + "{")))


def running_on(url: str) -> float:
    """vllm:num_requests_running + waiting of a replica (0 when it does not answer)."""
    try:
        st, _, data = http("GET", url + "/metrics", timeout=5)
    except OSError:
        return 0
    n = 0.0
    for line in data.decode().splitlines():
        if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")):
            n += float(line.rsplit(" ", 1)[1])
    return n


def run(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="ds4py-fleet-"))
    fleet = Fleet(args, workdir)
    t_start = time.monotonic()
    deadline = t_start + args.time_limit
    report: dict = {"router": args.router, "policy": args.policy, "replicas": args.replicas, "disk": args.disk}
    try:
        fleet.start()
        report["startup_s"] = round(time.monotonic() - t_start, 1)
        gate = threading.Event() if args.kill else None
        convs = [Conversation(i, fleet, args, gate, deadline) for i in range(args.conversations)]
        for c in convs:
            c.start()
        victim, killed_at = None, None
        if args.kill:
            for c in convs:
                c.at_gate.wait(max(1.0, deadline - time.monotonic()))
            first = [r for r in convs[0].records if r["status"] == 200]
            victim = first[-1]["replica"] if first else None
            gate.set()
            vurl = fleet.replicas[victim][1] if victim in fleet.replicas else None
            t0 = time.monotonic()
            while vurl and running_on(vurl) < 1 and time.monotonic() - t0 < 30:
                time.sleep(0.02)
            if victim in fleet.replicas:
                killed_at = time.monotonic()
                fleet.kill(victim)
        for c in convs:
            c.join(max(1.0, deadline - time.monotonic()))
        report.update(check(convs, victim, killed_at, args))
        # conversations that took another one's resident session (more of them than --sessions on a replica)
        report["displaced"] = {rid: metric_sum(url, "ds4py_session_displaced_total")
                               for rid, (proc, url) in fleet.replicas.items() if proc.poll() is None}
    finally:
        fleet.stop()
        report["wall_s"] = round(time.monotonic() - t_start, 1)
        report["workdir"] = str(workdir)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


def check(convs: list[Conversation], victim: str | None, killed_at: float | None, args) -> dict:
    per_replica = Counter()
    failures, stay, moves, cached_later, cached_after_move, turns, in_flight = [], [], [], [], [], 0, []
    for c in convs:
        ok = [r for r in c.records if r["status"] == 200]
        per_replica.update(r["replica"] for r in ok)
        turns += len(ok)
        before = [r["replica"] for r in ok if killed_at is None or r["t1"] < killed_at]
        after = [r["replica"] for r in ok if killed_at is not None and r["t1"] >= killed_at]
        for part in (before, after):
            if part:
                stay.append((Counter(part).most_common(1)[0][1], len(part)))
        first_after = next((r for r in ok if killed_at is not None and r["t1"] >= killed_at), None)
        moved = bool(before) and first_after is not None and first_after["replica"] != before[-1]
        if moved:                      # its first turn on the new replica: cold, or the shared disk's checkpoint
            moves.append(c.key)
            cached_after_move.append(first_after["cached"])
        cached_later += [r["cached"] for r in ok if r["turn"] >= 1 and not (moved and r is first_after)]
        for r in c.records:
            if killed_at is not None and r["t0"] <= killed_at <= r["t1"]:
                in_flight.append({"conversation": c.key, "turn": r["turn"], "status": r["status"],
                                  "replica": r.get("replica")})
            if r["status"] != 200:
                on_victim = bool(before) and before[-1] == victim and killed_at is not None and \
                    r["t0"] <= killed_at + args.detect_s
                failures.append({"conversation": c.key, "turn": r["turn"], "status": r["status"],
                                 "error": r.get("error", "")[:120], "in_flight_on_killed": on_victim})
    answered = all(c.turns_done == args.turns for c in convs)
    seconds = sorted(r["t1"] - r["t0"] for c in convs for r in c.records if r["status"] == 200)
    resumed = [min(r["t1"] for r in c.records if r["status"] == 200 and r["t1"] > killed_at) - killed_at
               for c in convs if killed_at is not None and c.key in moves
               and any(r["status"] == 200 and r["t1"] > killed_at for r in c.records)]
    kept = sum(k for k, _ in stay)
    return {
        "answered": answered, "turns_answered": turns, "turns_wanted": args.turns * len(convs),
        "turn_s_median": round(seconds[len(seconds) // 2], 2) if seconds else None,
        "turn_s_max": round(seconds[-1], 2) if seconds else None,
        "moved_resumed_after_kill_s": [round(x, 1) for x in resumed],
        "affinity": round(kept / max(1, sum(n for _, n in stay)), 4),
        "per_replica_requests": dict(sorted(per_replica.items())), "killed": victim,
        "in_flight_at_kill": in_flight, "failures": failures, "failures_outside_killed": sum(not f["in_flight_on_killed"] for f in failures),
        "moved_conversations": moves, "cached_after_move": cached_after_move,
        "cached_later_turns_min": min(cached_later) if cached_later else None,
        "cached_later_turns_mean": round(sum(cached_later) / len(cached_later), 1) if cached_later else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--router", choices=("vllm", "sglang"), default="vllm")
    p.add_argument("--policy", default=None,
                   help="router policy (default: consistent_hash for vllm-router, manual for sglang-router: both "
                        "keep a session id on its replica)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--sessions", type=int, default=2, help="--sessions of each replica (default 2)")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--system-repeat", type=int, default=18,
                   help="repeats of the rules in each system prompt (18: about 700 tokens, past the 544 of a cold "
                        "disk checkpoint)")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming requests")
    p.add_argument("--model", default=None, help="GGUF (default: the demo model)")
    p.add_argument("--disk", choices=("own", "shared", "none"), default="own",
                   help="a --kv-disk-dir per replica (default), one shared by all, or none")
    p.add_argument("--no-kill", dest="kill", action="store_false", help="do not kill a replica")
    p.add_argument("--kill-turn", type=int, default=1, help="kill after this turn of every conversation (0-based)")
    p.add_argument("--detect-s", type=float, default=5.0,
                   help="requests started this long after the kill may still be routed to the dead replica")
    p.add_argument("--request-timeout", type=float, default=300)
    p.add_argument("--ready-s", type=float, default=180)
    p.add_argument("--time-limit", type=float, default=900, help="stop the run after this many seconds")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs, disk caches)")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    args.policy = args.policy or {"vllm": "consistent_hash", "sglang": "manual"}[args.router]
    if args.kill and not 0 <= args.kill_turn < args.turns - 1:
        p.error("--kill-turn must leave at least one turn after it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a SIGTERM (timeout, Ctrl-C of a wrapper) unwinds through the `finally` that stops the child servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
