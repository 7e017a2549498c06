"""The whole agent tool loop with the real clients: Claude Code and Codex against `ds4py serve` running the
scripted test model (ds4py/testing/scripted.py). The model calls the client's own file tool (Claude Code's Read,
Codex's exec_command / shell), the client runs it on a file in its scratch project and sends the result back, the
server renders that history (its own DSML call replayed) and the model answers with the file's secret, which it
can only have seen in the tool result. Needs node/npm: the clients install once into ~/.cache/ds4py/agents;
without them the tests skip and say why."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from helpers import REPO, free_port

AGENTS = Path.home() / ".cache" / "ds4py" / "agents"
BIN = AGENTS / "node_modules" / ".bin"
CLIENT_TIMEOUT = 120


def _install_clients() -> str | None:
    """None when both clients are there (installed now or before), else why not."""
    if (BIN / "claude").exists() and (BIN / "codex").exists():
        return None
    if shutil.which("npm") is None:
        return "npm is not installed"
    AGENTS.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["npm", "install", "--silent", "--no-audit", "--no-fund", "@anthropic-ai/claude-code",
                            "@openai/codex"], cwd=AGENTS, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "npm install of the clients took over 300 s"
    if r.returncode != 0 or not (BIN / "claude").exists() or not (BIN / "codex").exists():
        return f"npm install of the clients failed: {(r.stderr or r.stdout).strip()[-300:]}"
    return None


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    why = _install_clients()
    if why:
        print(f"test_agents_loop: skipped: {why}", file=sys.stderr)
        pytest.skip(why)
    root = tmp_path_factory.mktemp("agents")
    work, home = root / "work", root / "home"
    (home / ".codex").mkdir(parents=True)
    work.mkdir()
    secret = f"CODE-{uuid.uuid4().hex[:10]}"
    (work / "notes.txt").write_text(f"{secret}\n")
    answer = f"The code in notes.txt is {secret}."
    script = {"rules": [
        {"contains": [secret], "content": answer},                        # the tool result is in the history
        {"contains": ['{"name": "Read"', "notes.txt"],
         "tool_calls": [{"name": "Read", "arguments": {"file_path": str(work / "notes.txt")}}]},
        {"contains": ['{"name": "exec_command"', "notes.txt"],
         "tool_calls": [{"name": "exec_command", "arguments": {"cmd": "cat notes.txt"}}]},
        {"contains": ['{"name": "shell"', "notes.txt"],
         "tool_calls": [{"name": "shell", "arguments": {"command": ["cat", "notes.txt"]}}]},
    ]}
    (root / "script.json").write_text(json.dumps(script))
    port = free_port()
    log = open(root / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "ds4py", "serve", "--port", str(port), "--max-tokens", "256"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO), "DS4PY_SCRIPTED_MODEL": str(root / "script.json")})
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None, (root / "serve.log").read_text()
        try:
            if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                break
        except OSError:
            pass
        assert time.monotonic() - t0 < 120, "server did not become ready"
        time.sleep(0.3)
    (home / ".codex" / "config.toml").write_text(
        f'model = "deepseek-v4-flash"\nmodel_provider = "ds4py"\n[model_providers.ds4py]\nname = "ds4py"\n'
        f'base_url = "{base}/v1"\nwire_api = "responses"\nenv_key = "DS4PY_KEY"\n')
    env = {**os.environ, "HOME": str(home), "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "sk-local", "DS4PY_KEY": "sk-local"}
    yield {"base": base, "work": work, "env": env, "secret": secret, "answer": answer, "log": root / "serve.log"}
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def _rules_chosen(log: Path) -> list[int]:
    return [int(m) for m in re.findall(r"ds4py scripted model: rule (-?\d+)", log.read_text())]


def _cached_prompt_tokens(base: str) -> float:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("ds4py_cached_prompt_tokens_total"))


def _run(cmd: list[str], srv: dict) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=srv["work"], env=srv["env"], capture_output=True, text=True, timeout=CLIENT_TIMEOUT)


def test_claude_code_reads_the_file_and_answers(scripted_server):
    srv, before = scripted_server, _rules_chosen(scripted_server["log"])
    cached = _cached_prompt_tokens(srv["base"])
    r = _run([str(BIN / "claude"), "-p", "Read notes.txt and tell me the code in it.", "--model", "deepseek-v4-flash",
              "--output-format", "json", "--allowedTools", "Read"], srv)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    out = json.loads(r.stdout)
    assert out["is_error"] is False and out["result"] == srv["answer"], out
    assert out["num_turns"] >= 2                                    # the tool turn, then the answer
    rules = _rules_chosen(srv["log"])[len(before):]
    assert 1 in rules and 0 in rules and rules.index(1) < rules.index(0), rules   # Read first, the answer after
    assert _cached_prompt_tokens(srv["base"]) > cached              # the answer's prompt reused the tool turn's KV


def test_codex_runs_the_command_and_answers(scripted_server):
    srv, before = scripted_server, _rules_chosen(scripted_server["log"])
    r = _run([str(BIN / "codex"), "exec", "--skip-git-repo-check", "Read notes.txt and tell me the code in it."], srv)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    assert srv["answer"] in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    rules = _rules_chosen(srv["log"])[len(before):]
    called = [i for i in rules if i in (2, 3)]
    assert called and 0 in rules and rules.index(called[0]) < rules.index(0), rules
    assert "cat notes.txt" in r.stderr, r.stderr[-2000:]            # codex logs the command it ran


def test_scripted_model_keeps_the_engine_contract(tmp_path):
    """No clients needed: the scripted model's greedy stream is the rule's reply then EOS, and its state saves,
    loads and truncates like any backend's (the server's prefix cache and disk cache rely on it)."""
    import numpy as np

    from ds4py.chat.template import ASSISTANT, EOS
    from ds4py.cli.serve import ensure_demo_model
    from ds4py.testing.scripted import NO_MATCH, ScriptedModel

    m = ScriptedModel(str(ensure_demo_model()), {"rules": [{"contains": ["ping"], "content": "pong!"}]})
    tok = m.tokenizer

    def greedy(prompt: str, n: int = 12) -> str:
        st = m.new_state()
        logits, out = m.prefill(st, tok.encode(prompt, special=True)), []
        for _ in range(n):
            t = int(np.argmax(logits))
            out.append(t)
            if tok.decode([t]) == EOS:
                break
            logits = m.decode(st, t)
        return tok.decode(out)

    assert greedy(f"ping{ASSISTANT}") == "pong!" + EOS
    assert greedy(f"hello{ASSISTANT}", 40) == NO_MATCH + EOS
    reply = tok.encode("pong!", special=True)
    ids = tok.encode(f"ping{ASSISTANT}", special=True) + reply[:-1]     # all of the reply but its last token
    st = m.new_state()
    m.prefill(st, ids)
    back = m.load_state(m.save_state(st))                              # continues exactly like the original
    assert back.n_tokens == len(ids) and int(np.argmax(m.decode(back, reply[-1]))) == tok.encode(EOS, special=True)[0]
    assert int(np.argmax(m.decode(st.copy(), reply[-1]))) == tok.encode(EOS, special=True)[0]
    st.truncate(len(ids) - 2)                                   # roll back two tokens: the same script again
    assert int(np.argmax(m.decode(st, ids[-2]))) == ids[-1]


def test_scripted_model_remembers_a_bounded_number_of_replies(monkeypatch):
    """A long-lived scripted server (bench/soak.py) keeps at most MAX_REPLIES prompts' replies."""
    import numpy as np

    from ds4py.cli.serve import ensure_demo_model
    from ds4py.testing import scripted

    monkeypatch.setattr(scripted, "MAX_REPLIES", 3)
    m = scripted.ScriptedModel(str(ensure_demo_model()), {"rules": [{"contains": ["7"], "content": "seven"}]})
    for i in range(10):
        m._reply(np.asarray(m.tokenizer.encode(f"prompt {i}", special=True), np.int32), thinking=False)
    assert len(m._replies) == 3
    last = np.asarray(m.tokenizer.encode("prompt 7", special=True), np.int32)
    assert m._reply(last, thinking=False) == m.tokenizer.encode("seven", special=True) + m.eos


def test_scripted_model_prefill_delay():
    """`prefill_seconds_per_token` slows prompt steps only (the decode of one token is not delayed); checked."""
    import time

    from ds4py.cli.serve import ensure_demo_model
    from ds4py.errors import Ds4Error
    from ds4py.testing.scripted import ScriptedModel

    m = ScriptedModel(str(ensure_demo_model()), {"rules": [], "prefill_seconds_per_token": 0.02})
    st = m.new_state()
    t0 = time.perf_counter()
    m.prefill(st, m.tokenizer.encode("word " * 30, special=True))
    assert time.perf_counter() - t0 >= 0.02 * st.n_tokens
    t0 = time.perf_counter()
    m.decode(st, 5)
    assert time.perf_counter() - t0 < 0.02 * st.n_tokens
    for bad in (-1, "1", True, 11):
        with pytest.raises(Ds4Error, match="prefill_seconds_per_token"):
            ScriptedModel(str(ensure_demo_model()), {"rules": [], "prefill_seconds_per_token": bad})
