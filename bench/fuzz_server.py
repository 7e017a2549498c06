"""Hostile-input fuzzing of `ds4py serve`: every route, deterministic mutations by category, one line of figures
per category. A 5xx, a dropped connection or an error body that is not the route's API shape is a finding.

    python bench/fuzz_server.py                      # in-process server (fast fake model, real everything else)
    python bench/fuzz_server.py --random 6000        # plus 6000 seeded random compound mutations
    python bench/fuzz_server.py --url http://127.0.0.1:8000 --api-key KEY    # a running `ds4py serve`
    python bench/fuzz_server.py --json out.json

Categories:
  valid        the base body of each route (streamed and not)
  field-type   every JSON path of every base body replaced by each value of WRONG_VALUES
  field-drop   every JSON path removed
  field-add    every field the route knows, added or replaced with each value of WRONG_VALUES
  random       compound random mutations (--random N, seeded)
  body         malformed bodies: not JSON, not an object, deep nesting, invalid UTF-8, huge numbers
  headers      Content-Encoding the body does not have, odd Content-Types, API keys (non-ASCII, invalid
               UTF-8, wrong), Host (DNS rebinding) and Origin (cross-site) variants
  http         malformed HTTP on a raw socket (bad request line, headers, chunking, TLS bytes, ...)
  routes       wrong methods and unknown routes

The in-process server runs the real HTTP stack, parsers, renderer, tokenizer (the golden ds4-tiny one, or the
demo model's), session, sampler and worker; only the model is replaced by random logits (so 10,000 requests
take a minute). `tests/test_fuzz_server.py` runs the deterministic categories on every CI run.
"""

from __future__ import annotations

import argparse
import copy
import http.client
import io
import json
import logging
import random
import socket
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ds4py.model import Capabilities  # noqa: E402

MODEL = "deepseek-v4-flash"
WRONG_VALUES = [None, True, False, 0, -1, 1.5, 1e-320, 10 ** 30, "", "x", [], [1], ["x"], {}, {"a": 1},
                {"type": 5}, [{"type": "text", "text": 7}]]

TOOL_PARAMS = {"type": "object", "properties": {"a": {"type": "integer"}}}
BODIES: dict[str, dict] = {
    "/v1/chat/completions": {
        "model": MODEL, "max_tokens": 2, "max_completion_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "min_p": 0.1, "seed": 3, "stop": ["zz"], "stream": False, "stream_options": {"include_usage": True},
        "reasoning_effort": "high", "thinking": {"type": "enabled"}, "response_format": {"type": "json_object"},
        "tool_choice": "auto", "parallel_tool_calls": True, "user": "u",
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": TOOL_PARAMS}}],
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "ok", "reasoning_content": "r", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "res"},
            {"role": "user", "content": "go"}]},
    "/v1/completions": {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0, "stop": "zz",
                        "stream": False, "seed": 1, "echo": False, "n": 1},
    "/v1/responses": {
        "model": MODEL, "instructions": "be brief", "max_output_tokens": 2, "tool_choice": "auto", "store": False,
        "stream": False, "temperature": 1, "top_p": 1, "metadata": {"k": "v"},
        "reasoning": {"effort": "low", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "tools": [{"type": "function", "name": "f", "description": "d", "parameters": TOOL_PARAMS},
                  {"type": "custom", "name": "patch", "description": "apply a patch"}, {"type": "web_search"}],
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "env"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}],
             "encrypted_content": "think"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "res"},
            {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "diff"},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "ok"}]}]},
    "/v1/messages": {
        "model": MODEL, "max_tokens": 2, "system": [{"type": "text", "text": "sys"}], "stop_sequences": ["zz"],
        "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stream": False, "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 100}, "tool_choice": {"type": "auto"},
        "tools": [{"name": "f", "description": "d", "input_schema": TOOL_PARAMS}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""},
                                              {"type": "text", "text": "ok"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
                                          "content": [{"type": "text", "text": "res"}]},
                                         {"type": "text", "text": "go"}]}]},
}
BODIES["/v1/messages/count_tokens"] = {k: v for k, v in BODIES["/v1/messages"].items()
                                       if k not in ("max_tokens", "stream", "stop_sequences")}
GETS = ["/health", "/metrics", "/v1/models", f"/v1/models/{MODEL}"]


def known_fields(path: str) -> list[str]:
    from ds4py.server import anthropic, openai, responses

    return sorted({"/v1/chat/completions": openai.CHAT_FIELDS, "/v1/completions": openai.COMPLETION_FIELDS,
                   "/v1/responses": responses.FIELDS, "/v1/messages": anthropic.FIELDS,
                   "/v1/messages/count_tokens": anthropic.FIELDS}[path])


# ---- mutations ---------------------------------------------------------------------------------------------

def paths(v, prefix=()):
    """Every JSON path inside v (dict keys and list indices), outermost first."""
    if isinstance(v, dict):
        for k, x in v.items():
            yield prefix + (k,)
            yield from paths(x, prefix + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield prefix + (i,)
            yield from paths(x, prefix + (i,))


def replaced(body, path, value, drop=False):
    b = copy.deepcopy(body)
    cur = b
    for k in path[:-1]:
        cur = cur[k]
    if drop:
        del cur[path[-1]]
    else:
        cur[path[-1]] = copy.deepcopy(value)
    return b


def json_cases(rng: random.Random, n_random: int, values=WRONG_VALUES):
    """(category, method, path, body bytes, headers) for the JSON categories."""
    for path, body in BODIES.items():
        for stream in (False, True):
            if "stream" in body or stream is False:
                yield "valid", "POST", path, {**body, **({"stream": True} if stream else {})}, {}
        for p in paths(body):
            for v in values:
                yield "field-type", "POST", path, replaced(body, p, v), {}
            yield "field-drop", "POST", path, replaced(body, p, None, drop=True), {}
        for key in known_fields(path):
            for v in values:
                yield "field-add", "POST", path, {**body, key: v}, {}
    routes = list(BODIES)
    for _ in range(n_random):
        path = rng.choice(routes)
        body = BODIES[path]
        for _ in range(rng.randint(1, 4)):
            ps = list(paths(body))
            op = rng.random()
            if op < 0.15 and ps:
                body = replaced(body, rng.choice(ps), None, drop=True)
            elif op < 0.3:
                body = {**body, rng.choice(known_fields(path)): rng.choice(WRONG_VALUES)}
            elif ps:
                body = replaced(body, rng.choice(ps), rng.choice(WRONG_VALUES + [rng.random() * 10 - 3,
                                                                                   rng.randint(-5, 5000)]))
        yield "random", "POST", path, body, {}


def raw_cases():
    """(category, method, path, raw body bytes, headers) for bodies and headers that are not plain JSON."""
    good = json.dumps(BODIES["/v1/chat/completions"]).encode()
    for path in BODIES:
        for raw in (b"", b"{", b"[]", b"null", b"\"text\"", b"1", b"{\"a\": NaN}", b"{\"a\": 1e999}",
                    b"\xff\xfe{}", "{\"m\": \"\ud800\"}".encode("utf-8", "surrogatepass"),
                    b"[" * 100000 + b"]" * 100000, b"{\"a\":" * 3000 + b"1" + b"}" * 3000,
                    json.dumps({"messages": [{"role": "user", "content": "x" * 100}] * 2000}).encode()):
            yield "body", "POST", path, raw, {"Content-Type": "application/json"}
        for enc in ("gzip", "deflate", "br", "zstd", "gzip, deflate", "identity", "x-unknown"):
            yield "headers", "POST", path, json.dumps(BODIES[path]).encode(), {"Content-Encoding": enc}
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "",
                      "application/json; charset=latin-1"):
            yield "headers", "POST", path, json.dumps(BODIES[path]).encode(), {"Content-Type": ctype}
    for path in list(BODIES) + GETS:
        body = json.dumps(BODIES[path]).encode() if path in BODIES else None
        method = "POST" if path in BODIES else "GET"
        for auth in ({"x-api-key": "caf\u00e9\u2603"}, {"Authorization": "Bearer \u00ff\u00fe"},
                     {"x-api-key": b"\xff\xfe\xfd"}, {"Authorization": "Bearer"}, {"Authorization": "Basic a2V5"},
                     {"x-api-key": ""}, {"x-api-key": "wrong"}, {"x-api-key": "k" * 10000}):
            yield "headers", method, path, body, {"_noauth": True, **auth}
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.nip.io", "[::1]", "localhost", "",
                     "a" * 300, "127.0.0.1:99999", "xn--80ak6aa92e.com"):
            yield "headers", method, path, body, {"Host": host}
        for origin in ("http://evil.example", "null", "http://app.example", "file://", "http://localhost:1"):
            yield "headers", method, path, body, {"Origin": origin, "Content-Type": "text/plain"}
    yield "headers", "POST", "/v1/chat/completions", good, {"Content-Length": "99999999999"}


def http_cases():
    """Raw bytes that are not (valid) HTTP."""
    good = json.dumps(BODIES["/v1/chat/completions"]).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    yield b"GARBAGE\r\n\r\n"
    yield b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64))          # a TLS ClientHello
    yield b"GET / HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n"
    yield b"GET /\r\n\r\n"
    yield b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n"
    yield b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n"
    yield b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    yield b"GET /health HTTP/1.1\r\n" + b"".join(b"X%d: y\r\n" % i for i in range(300)) + b"Host: a\r\n\r\n"
    yield head + b"Content-Length: abc\r\n\r\n" + good
    yield head + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n" + good
    yield head + b"Transfer-Encoding: chunked\r\n\r\nZZZ\r\n" + good + b"\r\n0\r\n\r\n"
    yield head + b"Transfer-Encoding: chunked, gzip\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    yield head + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    yield head + b"Content-Length: -1\r\n\r\n"
    yield b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}" + b"\x00\x01\x02\r\n\r\n"
    yield b"\x00\x00\x00\x00\r\n\r\n"
    yield b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\n"
    yield "GET /h\u00e9alth HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    yield b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def route_cases():
    for path in BODIES:
        yield "GET", path
        yield "PUT", path
        yield "DELETE", path
    for path in GETS:
        yield "POST", path
    for path in ("/", "/v1", "/v1/", "/v1/models/nope", "/v1/chat", "/../../etc/passwd", "/%00", "/v1/messages/x",
                 "/v1/embeddings", "/" + "a" * 5000):
        yield "GET", path
        yield "POST", path


# ---- running ------------------------------------------------------------------------------------------------

class Finding(Exception):
    pass


def shape_ok(path: str, status: int, data: bytes, ctype: str) -> bool:
    """An error body is JSON in the route's API shape: Anthropic's for /v1/messages*, else OpenAI's. (Errors of
    requests the HTTP parser could not read carry both shapes at once: the route is unknown there.)"""
    if status < 400:
        return True
    if "json" not in ctype:
        return False
    try:
        j = json.loads(data)
    except ValueError:
        return False
    err = j.get("error") if isinstance(j, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return False
    return j.get("type") == "error" and isinstance(err.get("type"), str) if path.startswith("/v1/messages") else True


class Fuzzer:
    def __init__(self, host: str, port: int, api_key: str | None):
        self.host, self.port, self.key = host, port, api_key
        self.stats: dict[str, Counter] = defaultdict(Counter)
        self.findings: list[str] = []

    def record(self, cat: str, outcome: str, what: str) -> None:
        self.stats[cat][outcome] += 1
        bad = outcome.startswith("5") or outcome in ("no answer", "bad shape")
        if bad and len(self.findings) < 200:
            self.findings.append(f"{cat}: {outcome}: {what[:300]}")

    def request(self, cat, method, path, body, headers):
        hdrs = dict(headers)
        noauth = hdrs.pop("_noauth", False)
        if self.key and not noauth:
            hdrs.setdefault("Authorization", f"Bearer {self.key}")
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            hdrs.setdefault("Content-Type", "application/json")
        host = hdrs.pop("Host", f"127.0.0.1:{self.port}")
        lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: " + host.encode("utf-8", "surrogateescape")]
        for k, v in hdrs.items():
            lines.append(k.encode() + b": " + (v if isinstance(v, bytes) else v.encode("utf-8")))
        if body is not None and "Content-Length" not in hdrs:
            lines.append(b"Content-Length: %d" % len(body))
        lines.append(b"Connection: close")
        raw = b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")
        status, ctype, data = self.send(raw)
        what = f"{method} {path} {dict((k, str(v)[:60]) for k, v in headers.items())} {(body or b'')[:200]!r}"
        if status is None:
            self.record(cat, "no answer", what)
        elif not shape_ok(path, status, data, ctype):
            self.record(cat, "bad shape", what + f" -> {status} {data[:200]!r}")
        else:
            self.record(cat, str(status), what)

    def send(self, raw: bytes, timeout: float = 30.0):
        """(status, content type, body) of the answer to raw bytes, or (None, "", b"") without one."""
        buf = b""
        try:
            with socket.create_connection((self.host, self.port), timeout=timeout) as s:
                try:                      # (no half-close: aiohttp takes EOF as the client going away)
                    s.sendall(raw)
                except OSError:           # the server may answer (413) and close before taking everything
                    pass
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
        except OSError:
            pass
        if not buf.startswith(b"HTTP/"):
            return None, "", b""
        r = http.client.HTTPResponse(_FakeSock(buf))
        try:
            r.begin()
            data = r.read()
        except (http.client.HTTPException, ValueError):
            return r.status if hasattr(r, "status") else None, "", b""
        return r.status, r.getheader("Content-Type", ""), data

    def http(self, raw: bytes) -> None:
        status, ctype, data = self.send(raw)
        what = repr(raw[:120])
        if status is None:
            self.record("http", "no answer", what)
        elif status >= 400 and not shape_ok("/", status, data, ctype):
            self.record("http", "bad shape", what + f" -> {status} {data[:200]!r}")
        else:
            self.record("http", str(status), what)


class _FakeSock:
    def __init__(self, data: bytes):
        self._f = io.BytesIO(data)

    def makefile(self, *a, **k):
        return self._f


def run(fz: Fuzzer, n_random: int = 0, seed: int = 0, categories=None, values=WRONG_VALUES) -> None:
    rng = random.Random(seed)
    want = (lambda c: True) if not categories else (lambda c: c in categories)
    for cat, method, path, body, headers in json_cases(rng, n_random, values):
        if want(cat):
            fz.request(cat, method, path, body, headers)
    if want("body") or want("headers"):
        for cat, method, path, body, headers in raw_cases():
            if want(cat):
                fz.request(cat, method, path, body, headers)
    if want("http"):
        for raw in http_cases():
            fz.http(raw)
    if want("routes"):
        for method, path in route_cases():
            fz.request("routes", method, path, None, {})


# ---- the in-process server ----------------------------------------------------------------------------------

class FastState:
    def __init__(self, n=0):
        self.n_tokens = n

    @property
    def rollback_floor(self) -> int:              # no rollback: the session uses its snapshots
        return self.n_tokens

    def copy(self):
        return FastState(self.n_tokens)

    def nbytes(self):
        return 8


class FastModel:
    """Random logits, a function of the position: the Session, sampler and tokenizer around it are real."""
    backend, path = "fake", "fuzz"
    capabilities = Capabilities()                 # host steps only (ds4py.model's declared capabilities)

    def new_request(self, params, suppress=()):
        return None                               # plain decoding: no speculative rounds

    def __init__(self, vocab_size: int, eos: int, ctx: int = 4096):
        self.config = SimpleNamespace(vocab_size=vocab_size, context_length=ctx)
        self.eos = eos

    def new_state(self):
        return FastState()

    def _logits(self, n):
        x = np.random.default_rng(n).standard_normal(self.config.vocab_size).astype(np.float32) * 2
        x[self.eos] += 3.0                        # answers end soon
        return x

    def step(self, states, chunks, all_logits=False):
        out = []
        for state, ids in zip(states, chunks):
            state.n_tokens += len(ids)
            out.append(self._logits(state.n_tokens))
        return out

    def weight_bytes_per_token(self):
        return 0


def tokenizer_path() -> Path:
    golden = REPO.parent / "shared" / "golden" / "ds4-tiny" / "tiny.gguf"
    if golden.is_file():
        return golden
    from ds4py.cli.serve import ensure_demo_model

    return ensure_demo_model()


class InProcess:
    """A BackgroundServer on the fast fake model, with an API key and one CORS origin; log records kept."""

    def __init__(self, ctx: int = 4096, api_key: str = "k"):
        from ds4py.server.app import BackgroundServer, ServerConfig, ServerState
        from ds4py.server.worker import Engine
        from ds4py.session import Session
        try:
            from ds4py.server.worker import PrefillPacer
        except ImportError:             # an older checkout (the harness measures before/after a change too)
            def PrefillPacer():
                return 2048
        from ds4py.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(str(tokenizer_path()))
        session = Session(FastModel(tok.vocab_size, tok.eos_id, ctx), tok, ctx_size=ctx, prefill_chunk=PrefillPacer())
        self.state = ServerState(ServerConfig(api_key=api_key, cors=["http://app.example"], max_body_mb=1.0,
                                              **{k: v for k, v in (("header_timeout", 5.0), ("body_timeout", 5.0))
                                                 if k in ServerConfig.__dataclass_fields__}))
        self.state.set_engine(Engine(session, tok))
        self.server = BackgroundServer(self.state)
        self.api_key = api_key
        self.log = _Records()

    def __enter__(self):
        for name in ("ds4py", "aiohttp"):
            lg = logging.getLogger(name)
            lg.addHandler(self.log)
            lg.setLevel(logging.INFO)
        self.server.start()
        return self

    def __exit__(self, *exc):
        self.server.stop()
        for name in ("ds4py", "aiohttp"):
            logging.getLogger(name).removeHandler(self.log)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    @property
    def tracebacks(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()}" for r in self.records if r.exc_info]


def summary(fz: Fuzzer, seconds: float) -> dict:
    cats = {c: dict(sorted(v.items())) for c, v in fz.stats.items()}
    total = sum(sum(v.values()) for v in fz.stats.values())
    bad = sum(n for v in fz.stats.values() for k, n in v.items() if k.startswith("5") or k in ("no answer",
                                                                                              "bad shape"))
    return {"requests": total, "findings": bad, "seconds": round(seconds, 1), "categories": cats,
            "examples": fz.findings[:40]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="fuzz a running server instead of an in-process one")
    ap.add_argument("--api-key", default=None, help="the server's key (with --url)")
    ap.add_argument("--random", type=int, default=0, help="random compound mutations to add (seeded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.url:
        from urllib.parse import urlsplit

        u = urlsplit(args.url)
        fz = Fuzzer(u.hostname, u.port or 80, args.api_key)
        run(fz, args.random, args.seed)
        tracebacks = None
    else:
        with InProcess() as srv:
            fz = Fuzzer(srv.server.host, srv.server.port, srv.api_key)
            run(fz, args.random, args.seed)
            tracebacks = srv.log.tracebacks
            m = srv.state.metrics
            leak = {"running": m.running, "queue_depth": m.queue_depth}
    out = summary(fz, time.perf_counter() - t0)
    if tracebacks is not None:
        out["logged_tracebacks"] = len(tracebacks)
        out["after"] = leak
    for cat, v in out["categories"].items():
        print(f"{cat:<11s} {sum(v.values()):6d}  " + "  ".join(f"{k}:{n}" for k, n in v.items()))
    print(f"total {out['requests']} requests in {out['seconds']} s; findings (5xx, no answer, bad error shape): "
          f"{out['findings']}" + (f"; tracebacks logged: {out['logged_tracebacks']}" if tracebacks is not None else ""))
    for ex in out["examples"][:10]:
        print("  " + ex)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if out["findings"] or (tracebacks or []) else 0


if __name__ == "__main__":
    sys.exit(main())
