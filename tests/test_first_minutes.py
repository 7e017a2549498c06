"""A new user's first ten minutes: the walls they used to hit, one test each (install, serve, curl, run, chat,
bench, convert, inspect). Each command runs as a user types it, from the repository, on the demo model."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers import REPO, start_serve


def ds4py(*args, stdin=None, timeout=180, cwd=REPO, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4py", *map(str, args)], cwd=cwd, input=stdin, text=True,
                          capture_output=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "error:" in last and all(n in last for n in needles), r.stderr
    return last


def post(base: str, path: str, body: dict):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---- serve on the demo model: max_tokens, the access log, the DSML note, /v1/models ----------------------------

@pytest.fixture(scope="module")
def demo_server():
    proc, base = start_serve(["--ctx", "96", "-v"])
    yield {"base": base, "proc": proc}
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def stop_and_read_log(demo_server) -> str:
    proc = demo_server["proc"]
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=30)[1]


def test_max_tokens_beyond_the_context_is_a_400_and_beyond_what_is_left_is_clamped(demo_server):
    base = demo_server["base"]
    msgs = [{"role": "user", "content": "hi"}]
    status, body = post(base, "/v1/chat/completions", {"messages": msgs, "max_tokens": 100_000_000})
    assert status == 400 and "100000000" in body["error"]["message"] and "1048576" in body["error"]["message"]
    assert body["error"]["param"] == "max_tokens"
    status, body = post(base, "/v1/messages", {"messages": msgs, "max_tokens": 100_000_000})
    assert status == 400 and body["type"] == "error" and "1048576" in body["error"]["message"]
    # Claude Code's 32,000 on a 96-token context: clamped to what is left, answered (not refused)
    status, body = post(base, "/v1/messages", {"messages": msgs, "max_tokens": 32000, "thinking": {"type": "disabled"}})
    assert status == 200 and body["stop_reason"] == "max_tokens"
    assert body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"] + \
        body["usage"]["output_tokens"] <= 96


def test_the_demo_model_has_a_default_output_cap_and_says_so(demo_server):
    req = urllib.request.Request(demo_server["base"] + "/", headers={"Accept": "application/json"})
    index = json.loads(urllib.request.urlopen(req, timeout=30).read())
    from ds4py.cli.serve import DEMO_MAX_TOKENS

    assert index["default_max_tokens"] == DEMO_MAX_TOKENS == 256
    assert index["backend"] == "ref" and index["context_length"] == 96


def test_the_models_entry_documents_the_thinking_default(demo_server):
    with urllib.request.urlopen(demo_server["base"] + "/v1/models/deepseek-v4-flash", timeout=30) as r:
        entry = json.loads(r.read())
    assert "thinking on by default" in entry["description"] and "reasoning_content" in entry["description"]


def test_serve_v_logs_token_counts_and_speeds_and_no_dsml_noise(demo_server):
    """Last of the server's tests: it stops the server to read its log."""
    base = demo_server["base"]
    for stream in (False, True):
        req = urllib.request.Request(base + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"messages": [{"role": "user", "content": "hello"}],
                                                      "max_tokens": 3, "stream": stream}).encode())
        urllib.request.urlopen(req, timeout=120).read()
    log = stop_and_read_log(demo_server)
    assert "requests without max_tokens stop at 256 tokens" in log and "in a browser to chat" in log   # the banner
    lines = [ln for ln in log.splitlines() if '"POST /v1/chat/completions' in ln and " 200 " in ln]
    assert len(lines) == 2, log
    for ln in lines:
        assert re.search(r"prompt \d+ tokens \(\d+ cached\), generated \d+", ln), ln
        assert re.search(r"first token [\d.]+ s, [\d.]+ tok/s", ln), ln
    assert "DSML parse issue" not in log          # a turn cut off by max_tokens is not malformed DSML


# ---- the commands -----------------------------------------------------------------------------------------------

def test_python_m_ds4py_works_from_the_folder_that_holds_a_clone_named_ds4py(tmp_path):
    """There `import ds4py` finds the clone's own folder first (no __init__.py: an empty namespace package) and the
    editable install's __main__ used to fail with a raw ImportError. Reproduced without an install: the namespace
    package in sys.modules, then the real __main__.py run as `python -m` runs it."""
    (tmp_path / "ds4py").mkdir()
    code = ("import runpy, sys, types\n"
            "ns = types.ModuleType('ds4py'); ns.__path__ = [sys.argv[1]]; sys.modules['ds4py'] = ns\n"
            "sys.argv = ['ds4py', '--version']\n"
            "runpy.run_path(%r, run_name='__main__')\n" % str(REPO / "ds4py" / "__main__.py"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ds4py")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.strip().startswith("ds4py "), r.stderr


def test_run_and_chat_default_to_the_demo_model_as_serve_does():
    r = ds4py("run", "-p", "hi", "-n", "2", "--nothink", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert "no -m given: the demo model" in r.stderr and "RANDOM WEIGHTS" in r.stderr
    r = ds4py("chat", stdin="/quit\n")
    assert r.returncode == 0 and "demo-tiny" in r.stdout, r.stderr


def test_bench_defaults_to_the_demo_model_and_checks_for_matplotlib_first(tmp_path):
    r = ds4py("bench", "--ctx-start", "16", "--ctx-max", "16", "--gen-tokens", "1", "--prefill-sizes", "none",
              "--format", "csv")
    assert r.returncode == 0 and "benchmarking the demo model" in r.stderr, r.stderr
    assert r.stdout.splitlines()[0].startswith("ctx_tokens") and r.stdout.splitlines()[1].startswith("16,")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        # before the sweep: the model is not even opened (a missing file would be the error otherwise)
        one_line_error(ds4py("bench", "-m", tmp_path / "missing.gguf", "--plot", tmp_path / "p.png"), "matplotlib")
    else:
        pytest.skip("matplotlib is installed: the missing-matplotlib check cannot be exercised")


def test_bench_help_gives_every_option_a_help_text_and_its_default():
    from ds4py.__main__ import build_parser

    p = build_parser().commands["bench"]
    for a in p._actions:
        if a.option_strings and a.dest != "help":
            assert a.help, a.option_strings
            if isinstance(a.default, (int, float)) and not isinstance(a.default, bool) and a.default:
                assert f"default {a.default:g}" in a.help or "default" in a.help, (a.option_strings, a.help)
    for flag in ("--ctx-start", "--ctx-max", "--requests", "--url", "--seed", "--format"):
        help_text = next(a.help for a in p._actions if flag in a.option_strings)
        assert "default" in help_text, flag


def test_serve_exits_non_zero_when_the_model_fails_to_load(tmp_path):
    from ds4py.cli.serve import ensure_demo_model

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(ensure_demo_model().read_bytes()[:3_000_000])         # a truncated download
    r = ds4py("serve", "-m", cut, "--port", "0", timeout=120)
    last = one_line_error(r, "failed to load", "truncated")
    assert last.startswith("ds4py serve: error:")


def test_serve_with_the_cuda_backend_and_no_gpu_exits_with_the_reason():
    from ds4py.cuda import driver

    if driver.available():
        pytest.skip("a GPU is present: the CUDA backend loads")
    one_line_error(ds4py("serve", "--backend", "cuda", "--port", "0", timeout=120), "failed to load")


def test_a_bad_port_and_an_unreachable_server_are_one_sentence_each():
    one_line_error(ds4py("serve", "--port", "99999"), "--port", "65535")
    one_line_error(ds4py("bench", "serve", "--url", "http://127.0.0.1:1", "--requests", "1"),
                   "cannot reach the server at http://127.0.0.1:1")


def test_convert_refuses_a_folder_without_tokenizer_and_inspect_verify_agrees_with_run(golden, tmp_path):
    out = tmp_path / "t.gguf"
    one_line_error(ds4py("convert", golden / "v4-tiny", out), "no tokenizer.json", "--tokenizer")
    assert not out.exists()
    r = ds4py("convert", golden / "v4-tiny", out, "--dense", "f32", "--experts", "q2_k", "--no-tokenizer")
    assert r.returncode == 0, r.stderr
    # no line per tensor (not a terminal: no bar), the per-layer note once, and a summary of what was written
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2, r.stderr
    assert re.match(r"note: 7 tensors \(blk\.0\.ffn_down_exps\.weight \.\.\. blk\.6\.ffn_down_exps\.weight\): rows of "
                    r"\d+ are not a multiple of 256", lines[0]), lines[0]
    assert re.match(rf"wrote {re.escape(str(out))}: \d+ tensors, [\d.]+ MiB in [\d.]+ s$", lines[1]), lines[1]
    one_line_error(ds4py("inspect", out, "--verify"), "no tokenizer")       # as run refuses it:
    one_line_error(ds4py("run", "-m", out, "-p", "hi", "-n", "1"), "tokenizer")


def test_an_unknown_option_is_reported_first_with_the_close_match():
    r = ds4py("run", "--top_p", "0.9")                     # and no -p: the unknown option is what is reported
    last = one_line_error(r, "unknown option --top_p", "did you mean --top-p?")
    assert last.startswith("ds4py run: error:") and "usage: ds4py run" in r.stderr
    one_line_error(ds4py("serve", "--prot", "8000"), "did you mean --port?")
    one_line_error(ds4py("--verison"), "did you mean --version?")
    from ds4py.__main__ import build_parser

    args = build_parser().parse_args(["run", "-p", "x", "--temperature", "0.3"])   # the usual spelling: an alias
    assert args.temp == 0.3


def test_max_tokens_minus_one_is_refused_by_the_rule_the_help_states():
    from ds4py.__main__ import build_parser

    n = next(a for a in build_parser().commands["run"]._actions if "-n" in a.option_strings)
    assert ">= 0, 0 = until EOS" in n.help
    one_line_error(ds4py("run", "-p", "hi", "-n", "-1"), "-n/--max-tokens must be >= 0 (0 = until EOS", "got -1")


def test_render_defaults_to_thinking_as_run_does():
    stdin = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    r = ds4py("render", stdin=stdin)
    assert r.returncode == 0 and r.stdout.endswith("<｜Assistant｜><think>"), r.stdout
    stdin = json.dumps({"messages": [{"role": "user", "content": "hi"}], "options": {"thinking_mode": "chat"}})
    assert ds4py("render", stdin=stdin).stdout.endswith("<｜Assistant｜></think>")


# ---- silent waits: a line on a terminal, nothing in pipes ---------------------------------------------------------

class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_demo_model_generation_shows_progress_on_a_terminal_only(tmp_path, monkeypatch):
    import ds4py.tiny
    from ds4py.cli import serve

    calls = []
    monkeypatch.setattr(ds4py.tiny, "make_tiny", lambda path, **kw: (calls.append(kw["progress"]),
                                                                    Path(path).write_bytes(b"x")))
    for i, stream in enumerate((Tty(), io.StringIO())):
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / str(i)))
        monkeypatch.setattr(sys, "stderr", stream)
        serve.ensure_demo_model()
        assert ("generating the demo model" in stream.getvalue()) == (i == 0)
    assert calls == [True, False]


def test_a_slow_prompt_shows_a_waiting_line_on_a_terminal_only(monkeypatch):
    """The emulator reads 3 prompt tokens in ~40 s: `run` says so while it waits, then clears the line."""
    import time as _time

    from ds4py.cli import run as run_cli
    from ds4py.session import DoneEvent, TokenEvent

    class Tok:
        eos_id = 1

        def decode(self, ids):
            return "<eos>"

    class SlowSession:
        tokenizer = Tok()
        model = types.SimpleNamespace(config=types.SimpleNamespace(variant="v4"))
        spec_stats = None

        def generate(self, ids, params, cancelled=None):
            _time.sleep(1.6)                                   # the prefill
            yield TokenEvent(5, "x")
            yield DoneEvent("length", len(ids), 0, 1)

    for stream in (Tty(), io.StringIO()):
        monkeypatch.setattr(sys, "stderr", stream)
        out = io.StringIO()
        run_cli.stream_answer(SlowSession(), [0, 1, 2], None, "off", run_cli.Printer(out, False), False)
        drawn = "[reading the prompt (3 tokens)... 1 s]" in stream.getvalue()
        assert drawn == isinstance(stream, Tty), stream.getvalue()
        assert out.getvalue() == "x\n"
