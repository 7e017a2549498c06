"""The real agents under load: Claude Code and Codex, one turn each, against one `ds4py serve` replica, against
vllm-router in front of two replicas, and against the router again while another replica on the same machine
prefills a long prompt (the machine's other core busy). Every request must be answered and both clients must
finish their turn; the report gives each client's wall time and the replicas' request counts by status.

    python bench/agents_load.py                  # the scripted tool loop (ds4py/testing/scripted.py): each
                                                 # client reads a file with its own tool and answers its secret
    python bench/agents_load.py --model demo     # the default turn ("Say hello.") on the random demo model: it
                                                 # ends at the output cap (random weights never emit EOS)

The clients install once into ~/.cache/ds4py/agents (npm). Their own timeouts are left as they are: a client that
times out waiting for a long prefill is what the server's SSE keep-alive (ds4py/server/sse.py) must prevent.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet import REPO, Fleet, free_port, http, wait_for  # noqa: E402

AGENTS = Path.home() / ".cache" / "ds4py" / "agents"
BIN = AGENTS / "node_modules" / ".bin"
ASK = {"scripted": "Read notes.txt and tell me the code in it.", "demo": "Say hello."}


def install_clients() -> None:
    if not ((BIN / "claude").exists() and (BIN / "codex").exists()):
        AGENTS.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "@anthropic-ai/claude-code",
                        "@openai/codex"], cwd=AGENTS, check=True, timeout=600)


def write_script(work: Path, path: Path) -> str:
    """The scripted model's rules (as tests/test_agents_loop.py): the client's file tool, then the secret."""
    secret = f"CODE-{uuid.uuid4().hex[:10]}"
    (work / "notes.txt").write_text(secret + "\n")
    path.write_text(json.dumps({"rules": [
        {"contains": [secret], "content": f"The code in notes.txt is {secret}."},
        {"contains": ['{"name": "Read"', "notes.txt"],
         "tool_calls": [{"name": "Read", "arguments": {"file_path": str(work / "notes.txt")}}]},
        {"contains": ['{"name": "exec_command"', "notes.txt"],
         "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "cat notes.txt"}}]},
        {"contains": ['{"name": "shell"', "notes.txt"],
         "tool_calls": [{"name": "shell", "arguments": {"command": ["cat", "notes.txt"]}}]}]}))
    return secret


def run_client(name: str, base: str, root: Path, args, secret: str) -> dict:
    home, work = root / "home", root / "work"
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(
        f'model = "deepseek-v4-flash"\nmodel_provider = "ds4py"\n[model_providers.ds4py]\nname = "ds4py"\n'
        f'base_url = "{base}/v1"\nwire_api = "responses"\nenv_key = "DS4PY_KEY"\n')
    env = {**os.environ, "HOME": str(home), "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "sk-local", "DS4PY_KEY": "sk-local"}
    if args.model == "demo":
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(args.cap)
    if name == "claude":
        cmd = [str(BIN / "claude"), "-p", ASK[args.model], "--model", "deepseek-v4-flash", "--output-format", "json",
               "--allowedTools", "Read"]
    else:
        cmd = [str(BIN / "codex"), "exec", "--skip-git-repo-check", ASK[args.model]]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=args.client_limit)
        rc, out, err = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "killed", (e.stdout or b"").decode(errors="replace"), (e.stderr or b"").decode(errors="replace")
    seconds = round(time.monotonic() - t0, 1)
    if args.model == "scripted":
        ok = rc == 0 and secret in out
    elif name == "claude":
        ok = rc in (0, 1) and out.lstrip().startswith("{") and '"type":"result"' in out.replace(" ", "")
    else:
        ok = rc in (0, 1) and "tokens used" in err
    tail = (out.strip() or err.strip())[-200:]
    return {"client": name, "seconds": seconds, "exit": rc, "finished": ok, "tail": tail}


def status_counts(urls: list[str]) -> dict:
    """ds4py_requests_total summed over the replicas, by "endpoint status" (499: the client closed the request)."""
    counts: dict = {}
    for url in urls:
        text = http("GET", url + "/metrics", timeout=30)[2].decode()
        for m in re.finditer(r'^ds4py_requests_total\{endpoint="([^"]+)",status="(\d+)"\} (\S+)$', text, re.M):
            if m.group(1) not in ("/metrics", "/health"):
                key = f"{m.group(1)} {m.group(2)}"
                counts[key] = counts.get(key, 0) + int(float(m.group(3)))
    return counts


def busy_replica(root: Path, tokens: int, ready_s: float) -> tuple[subprocess.Popen, threading.Thread, dict]:
    """A third replica (the demo model, not scripted) prefilling a long prompt in the background."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "DS4PY_SCRIPTED_MODEL"}
    log = open(root / "busy.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "ds4py", "serve", "--port", str(port), "--replica-id", "busy"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**env, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    wait_for(url + "/health", ready_s, proc)
    text = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(tokens // 14))
    result: dict = {}

    def prefill() -> None:
        t0 = time.monotonic()
        status, _, _ = http("POST", url + "/v1/chat/completions", {"model": "ds4py-demo", "max_tokens": 1,
                                                                    "messages": [{"role": "user", "content": text}]},
                            timeout=3600)
        result.update(status=status, seconds=round(time.monotonic() - t0, 1))

    th = threading.Thread(target=prefill, daemon=True)
    th.start()
    return proc, th, result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("scripted", "demo"), default="scripted")
    p.add_argument("--cap", type=int, default=48, help="demo: the output cap (serve --max-tokens)")
    p.add_argument("--busy-tokens", type=int, default=8000, help="the busy replica's prompt, in tokens (about)")
    p.add_argument("--client-limit", type=float, default=1800, help="kill a client after this many seconds")
    p.add_argument("--ready-s", type=float, default=180)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    install_clients()
    root = Path(tempfile.mkdtemp(prefix="ds4py-agents-load-"))
    (root / "work").mkdir()
    secret = ""
    if args.model == "scripted":
        secret = write_script(root / "work", root / "script.json")
        os.environ["DS4PY_SCRIPTED_MODEL"] = str(root / "script.json")
    fleet_args = argparse.Namespace(replicas=2, ctx=32768, sessions=2, model=None, disk="none", ready_s=args.ready_s,
                                    router="vllm", policy="consistent_hash")
    fleet = Fleet(fleet_args, root)
    report: dict = {"model": args.model, "runs": []}
    busy = None
    try:
        fleet.start()
        urls = [u for _, u in fleet.replicas.values()]
        for label, base, loaded in (("one replica", urls[0], False), ("router, 2 replicas", fleet.url, False),
                                    ("router, 2 replicas, other core busy", fleet.url, True)):
            if loaded:
                busy = busy_replica(root, args.busy_tokens, args.ready_s)
            before = status_counts(urls)
            for name in ("claude", "codex"):
                res = run_client(name, base, root, args, secret)
                res["setup"] = label
                if loaded:
                    res["busy_prefill_still_running"] = busy[1].is_alive()
                report["runs"].append(res)
                print(json.dumps(res), flush=True)
            after = status_counts(urls)
            report.setdefault("requests", {})[label] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            print(f"{label}: requests by status {report['requests'][label]}", flush=True)
        if busy:
            busy[1].join(timeout=1)
            report["busy_prefill"] = busy[2] or "still running at the end"
    finally:
        fleet.stop()
        if busy:
            busy[0].terminate()
            busy[0].wait(30)
    answered = all(k.endswith(" 200") for c in report.get("requests", {}).values() for k, n in c.items() if n)
    report["ok"] = answered and all(r["finished"] for r in report["runs"])
    print(json.dumps({k: report[k] for k in ("ok", "requests")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
