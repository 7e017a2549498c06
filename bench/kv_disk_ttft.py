"""Time to first token of one long prompt with a cold, a warm-in-memory and a warm-on-disk KV cache.

    python bench/kv_disk_ttft.py [-m MODEL.gguf] [--tokens 4200] [--sessions 1] [--json F]

Starts `serve --kv-disk-dir` on an empty folder, sends the prompt (random token ids, max_tokens 1, greedy) on
a cold server (*cold*), sends it again (*memory*: the live state), stops the server with SIGTERM and then, each
on a fresh start of the server on the same folder, sends the same prompt (*disk-same*: the shutdown checkpoint),
the prompt with 64 more tokens (*disk-extended*: an agent's next turn) and a prompt that shares only its first
`tokens - 50` tokens (*disk-shared*: another agent with the same system prompt: the cold checkpoint). Each
answer's `cached_tokens` says how much of the prompt was reused; its time is send -> complete answer of one
token, i.e. the time to first token. The greedy token of the same prompt must be the same every time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "ds4py", "serve", "--port", str(port), *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited: {proc.stderr.read()}")
        try:
            if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                return proc, base
        except OSError:
            pass
        if time.monotonic() - t0 > 300:
            raise SystemExit("serve did not become ready within 300 s")
        time.sleep(0.2)


def _ask(base: str, ids: list[int]) -> dict:
    body = json.dumps({"model": "deepseek-v4-flash", "prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    out = json.loads(urllib.request.urlopen(req, timeout=1800).read())
    return {"ttft_s": time.perf_counter() - t0, "cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"],
            "prompt_tokens": out["usage"]["prompt_tokens"], "text": out["choices"][0]["text"]}


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=str(REPO.parent / "shared" / "golden" / "ds4-tiny" / "tiny.gguf"))
    ap.add_argument("--tokens", type=int, default=4200)
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ids = np.random.default_rng(a.seed).integers(3, 500, a.tokens).tolist()
    with tempfile.TemporaryDirectory() as kv:
        args = ["-m", a.model, "--ctx", str(a.tokens + 128), "--sessions", str(a.sessions), "--kv-disk-dir", kv]
        proc, base = _serve(args)
        try:
            rows = {"cold": _ask(base, ids), "memory": _ask(base, ids)}
        finally:
            _stop(proc)
        files = sorted(p.name for p in Path(kv).glob("*.kv"))
        sizes = sum(p.stat().st_size for p in Path(kv).glob("*.kv"))
        rng = np.random.default_rng(a.seed + 1)
        others = {"disk-same": ids, "disk-extended": ids + rng.integers(3, 500, 64).tolist(),
                  "disk-shared": ids[:-50] + rng.integers(3, 500, 50).tolist()}
        for name, prompt in others.items():
            proc, base = _serve(args)
            try:
                rows[name] = _ask(base, prompt)
            finally:
                _stop(proc)
    for name, r in rows.items():
        print(f"{name:13s} ttft {r['ttft_s']:8.3f} s   cached {r['cached_tokens']:6d} / {r['prompt_tokens']} tokens")
    print(f"checkpoints after the first run: {len(files)} files, {sizes / 1e6:.1f} MB; "
          f"disk-extended / cold = {rows['disk-extended']['ttft_s'] / rows['cold']['ttft_s']:.3f}")
    same = len({rows[k]["text"] for k in ("cold", "memory", "disk-same")}) == 1
    print("greedy token of the same prompt identical cold, from memory and from disk:", same)
    if a.json:
        Path(a.json).write_text(json.dumps({"tokens": a.tokens, "sessions": a.sessions, "runs": rows,
                                            "checkpoint_files": len(files), "checkpoint_bytes": sizes}, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
