"""The real server (numpy backend, golden ds4-tiny GGUF) on a free loopback port, driven by the official
openai and anthropic SDKs: every generation endpoint streamed and not, the golden ds4-server captures,
tool-call round trips with KV prefix reuse, usage and cached tokens, /metrics, concurrency, disconnects,
and the `python -m ds4py serve` command (with a model and with the generated demo model)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest

from ds4py.model import open_model
from ds4py.server.app import BackgroundServer, ServerConfig, ServerState
from ds4py.server.worker import Engine
from ds4py.session import Session
from ds4py.tokenizer import Tokenizer
from helpers import start_serve

CTX = 1024
NOTHINK = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def tiny(golden) -> Path:
    return golden / "ds4-tiny" / "tiny.gguf"


@pytest.fixture(scope="module")
def srv(tiny):
    model = open_model(str(tiny), backend="ref")
    tok = Tokenizer.from_gguf(str(tiny))
    state = ServerState(ServerConfig())
    state.set_engine(Engine(Session(model, tok, ctx_size=CTX), tok))
    with BackgroundServer(state) as s:
        s.tok = tok
        yield s


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(srv):
    return anthropic.Anthropic(base_url=srv.base_url, api_key="none", max_retries=0, timeout=120)


def golden_body(golden: Path, name: str) -> bytes:
    """Body of a captured raw HTTP response. ds4-server writes invalid UTF-8 token bytes raw into its JSON;
    we send valid UTF-8 with U+FFFD in their place, so decode the capture the same way."""
    raw = (golden / "ds4-tiny" / "server" / name).read_bytes()
    return raw.split(b"\r\n\r\n", 1)[1].decode("utf-8", errors="replace").encode()


def sse_events(body: bytes) -> list[tuple[str | None, object]]:
    out = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        event, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        out.append((event, data if data == "[DONE]" else json.loads(data)))
    return out


def raw_post(srv, path: str, body: dict) -> bytes:
    req = urllib.request.Request(srv.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def metrics(srv) -> dict[str, float]:
    text = urllib.request.urlopen(srv.base_url + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# ---- against the golden ds4-server captures ----------------------------------------------------------------

def test_models(oai, golden):
    ids = [m.id for m in oai.models.list()]
    assert ids[0] == "deepseek-v4-flash" and "deepseek-chat" in ids and "deepseek-reasoner" in ids
    m = oai.models.retrieve("deepseek-v4-flash")
    assert m.model_extra["context_length"] == CTX
    captured = json.loads(golden_body(golden, "resp_models.raw"))["data"][0]
    assert captured["id"] == m.id and captured["object"] == m.object
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")


def test_chat_greedy_matches_ds4_server(srv, oai, golden):
    req = json.loads((golden / "ds4-tiny" / "server" / "req_chat_nonstream.json").read_text())
    want = json.loads(golden_body(golden, "resp_chat_nonstream.raw"))
    r = oai.chat.completions.create(model=req["model"], messages=req["messages"], temperature=0,
                                    max_tokens=req["max_tokens"], extra_body={"thinking": req["thinking"]})
    assert r.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert r.choices[0].finish_reason == want["choices"][0]["finish_reason"] == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want["usage"]["prompt_tokens"],
                                                                  want["usage"]["completion_tokens"])

    # streamed: same chunk framing as the capture (role delta first, empty delta with finish_reason, a
    # choices=[] usage chunk, [DONE]) and the same text
    sreq = json.loads((golden / "ds4-tiny" / "server" / "req_chat_stream.json").read_text())
    got = sse_events(raw_post(srv, "/v1/chat/completions", sreq))
    cap = sse_events(golden_body(golden, "resp_chat_stream.raw"))
    for evs in (got, cap):
        assert evs[0][1]["choices"][0]["delta"] == {"role": "assistant"}
        assert evs[-1] == (None, "[DONE]")
        assert evs[-2][1]["choices"] == [] and evs[-3][1]["choices"][0]["delta"] == {}
    text = lambda evs: "".join(e[1]["choices"][0]["delta"].get("content", "") for e in evs[1:-3])  # noqa: E731
    assert text(got) == text(cap) == want["choices"][0]["message"]["content"]
    assert got[-3][1]["choices"][0]["finish_reason"] == "length"
    usage = got[-2][1]["usage"]
    assert usage["prompt_tokens"] == 12 and usage["completion_tokens"] == 8
    assert usage["prompt_tokens_details"]["cached_tokens"] == 11     # the repeat reuses all but the last token


def test_anthropic_stream_matches_ds4_server(srv, ant, golden):
    req = json.loads((golden / "ds4-tiny" / "server" / "req_anthropic_stream.json").read_text())
    cap = sse_events(golden_body(golden, "resp_anthropic_stream.raw"))
    got = sse_events(raw_post(srv, "/v1/messages", req))

    def shape(evs):   # event names with consecutive deltas collapsed
        names = [e for e, _ in evs]
        return [n for i, n in enumerate(names) if i == 0 or n != names[i - 1] or n != "content_block_delta"]
    assert shape(got) == shape(cap)
    text = lambda evs: "".join(d["delta"].get("text", "") for e, d in evs if e == "content_block_delta")  # noqa
    # the 6th sampled token is byte 0x00, which ds4-server (C strings) drops; we send it as \u0000
    assert text(got) == text(cap) + "\x00"
    assert got[-2][1]["delta"]["stop_reason"] == "max_tokens" and got[-2][1]["usage"]["output_tokens"] == 6

    # the SDK's stream accumulator and the non-streaming call agree with the raw stream
    kw = dict(model=req["model"], max_tokens=6, thinking={"type": "disabled"},
              messages=req["messages"], extra_body={"temperature": 0})
    with ant.messages.stream(**kw) as s:
        final = s.get_final_message()
    m = ant.messages.create(**kw)
    assert final.content[0].text == m.content[0].text == text(got)
    assert m.stop_reason == final.stop_reason == "max_tokens"
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == 5
    assert m.usage.cache_read_input_tokens >= 4
    assert ant.messages.count_tokens(model="deepseek-v4-flash", messages=req["messages"],
                                     thinking={"type": "disabled"}).input_tokens == 5


# ---- every endpoint, streamed and not: the same greedy tokens either way -----------------------------------

def test_completions_stream_equals_nonstream(oai, srv):
    kw = dict(model="deepseek-v4-flash", prompt="Once upon a time", max_tokens=5, temperature=0)
    r = oai.completions.create(**kw)
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens == 5
    # a raw completion is BOS + the text, no chat template
    assert r.usage.prompt_tokens == 1 + len(srv.tok.encode("Once upon a time"))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


def test_chat_thinking_stream_equals_nonstream(oai):
    kw = dict(model="deepseek-v4-flash", messages=[{"role": "user", "content": "Think about colors."}],
              max_tokens=6, temperature=0)
    r = oai.chat.completions.create(**kw)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in oai.chat.completions.create(**kw, stream=True) if c.choices)
    assert reasoning == r.choices[0].message.model_extra["reasoning_content"]
    assert r.usage.completion_tokens_details.reasoning_tokens == 6     # never left the reasoning


def test_responses_stream_equals_nonstream(oai):
    kw = dict(model="deepseek-v4-flash", input=[{"role": "user", "content": "Hi"}], instructions="Be brief.",
              max_output_tokens=5, temperature=0)
    r = oai.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    events = list(oai.responses.create(**kw, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == r.output[0].content[0].text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens == 5
    assert events[-1].response.usage.input_tokens_details.cached_tokens == r.usage.input_tokens - 1


def test_messages_nonstream_thinking_block(ant):
    m = ant.messages.create(model="deepseek-v4-flash", max_tokens=4, messages=[{"role": "user", "content": "Hey"}],
                            thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0})
    assert m.content[0].type == "thinking" and m.content[0].thinking
    assert m.usage.output_tokens == 4 and m.stop_reason == "max_tokens"


# ---- limits: max_tokens past the context is clamped, a prompt that does not fit is refused ---------------------

def test_max_tokens_beyond_context(tiny):
    model = open_model(str(tiny), backend="ref")
    tok = Tokenizer.from_gguf(str(tiny))
    state = ServerState(ServerConfig())
    state.set_engine(Engine(Session(model, tok, ctx_size=16), tok))
    with BackgroundServer(state) as s:
        c = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        # a huge max_tokens is not an error: prompt + answer stop at the context size, reported as "length"
        r = c.completions.create(model="deepseek-v4-flash", prompt=[5] * 12, max_tokens=10 ** 9, temperature=0)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason) == (12, 4, "length")
        with pytest.raises(openai.BadRequestError) as e:          # 16 prompt tokens leave no room for an answer
            c.completions.create(model="deepseek-v4-flash", prompt=[5] * 16, max_tokens=1)
        assert e.value.code == "context_length_exceeded"
        a = anthropic.Anthropic(base_url=s.base_url, api_key="none", max_retries=0, timeout=60)
        with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 15 maximum"):
            a.messages.create(model="deepseek-v4-flash", max_tokens=1,
                              messages=[{"role": "user", "content": "w " * 50}])


# ---- tool-call round trips: history with a tool call re-renders identically, and the prefix is reused -------

HISTORY_Q = "Weather in Paris?"
CALL_ARGS = {"city": "Paris", "days": 2}


def test_tool_round_trip_each_api_reuses_prefix(oai, ant):
    # OpenAI chat
    o_hist = [{"role": "user", "content": HISTORY_Q},
              {"role": "assistant", "content": "", "tool_calls": [{"id": "call_a", "type": "function", "function": {
                  "name": "get_weather", "arguments": json.dumps(CALL_ARGS)}}]},
              {"role": "tool", "tool_call_id": "call_a", "content": "sunny"}]
    kw = dict(model="deepseek-v4-flash", max_tokens=3, temperature=0, extra_body=NOTHINK)
    r1 = oai.chat.completions.create(messages=o_hist, **kw)
    p1 = r1.usage.prompt_tokens
    r2 = oai.chat.completions.create(messages=o_hist + [
        {"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "thanks"}], **kw)
    # the session cannot roll its live state back, so when the sampled answer re-tokenizes differently it
    # restores the snapshot taken before the last prompt token: everything up to the answer is reused
    assert r2.usage.prompt_tokens > p1 and r2.usage.prompt_tokens_details.cached_tokens >= p1 - 1

    # Anthropic: the same conversation as tool_use / tool_result blocks renders to the same prompt
    a_hist = [{"role": "user", "content": HISTORY_Q},
              {"role": "assistant", "content": [{"type": "tool_use", "id": "call_a", "name": "get_weather",
                                                 "input": CALL_ARGS}]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_a", "content": "sunny"}]}]
    akw = dict(model="deepseek-v4-flash", max_tokens=3, thinking={"type": "disabled"}, extra_body={"temperature": 0})
    m1 = ant.messages.create(messages=a_hist, **akw)
    assert m1.usage.input_tokens + m1.usage.cache_read_input_tokens == p1
    assert m1.usage.cache_read_input_tokens >= p1 - 1              # the earlier turn's snapshot
    assert m1.content[0].text == r1.choices[0].message.content     # same prompt, greedy: same answer
    m2 = ant.messages.create(messages=a_hist + [{"role": "assistant", "content": m1.content[0].text},
                                                {"role": "user", "content": "thanks"}], **akw)
    assert m2.usage.cache_read_input_tokens >= p1 - 1

    # Responses: function_call / function_call_output items
    r_hist = [{"role": "user", "content": HISTORY_Q},
              {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": json.dumps(CALL_ARGS)},
              {"type": "function_call_output", "call_id": "call_a", "output": "sunny"}]
    rkw = dict(model="deepseek-v4-flash", max_output_tokens=3, temperature=0, reasoning={"effort": "none"})
    x1 = oai.responses.create(input=r_hist, **rkw)
    assert x1.usage.input_tokens == p1 and x1.usage.input_tokens_details.cached_tokens >= p1 - 1
    assert x1.output_text == r1.choices[0].message.content
    x2 = oai.responses.create(input=r_hist + [{"role": "assistant", "content": x1.output_text},
                                              {"role": "user", "content": "thanks"}], **rkw)
    assert x2.usage.input_tokens_details.cached_tokens >= p1 - 1


# ---- scheduling, metrics, disconnects --------------------------------------------------------------------------

def test_eight_concurrent_clients(oai):
    prompts = [f"client {i % 4}" for i in range(8)]            # each prompt twice
    results: dict[int, object] = {}

    def one(i):
        results[i] = oai.chat.completions.create(model="deepseek-v4-flash", max_tokens=2, temperature=0,
                                                 messages=[{"role": "user", "content": prompts[i]}],
                                                 extra_body=NOTHINK)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(8))
    for i in range(4):   # greedy and exact: queue order and KV reuse never change an answer
        assert results[i].choices[0].message.content == results[i + 4].choices[0].message.content
        assert results[i].usage.completion_tokens == 2


def test_disconnect_stops_generation(srv):
    before = metrics(srv)
    body = json.dumps({"model": "deepseek-v4-flash", "stream": True, "max_tokens": 500, "temperature": 0,
                       "messages": [{"role": "user", "content": "Tell me a long story."}]}).encode()
    sock = socket.create_connection((srv.host, srv.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while got.count(b"data: ") < 4:
        got += sock.recv(65536)
    sock.close()
    t0 = time.monotonic()
    while metrics(srv)["ds4py_cancelled_generations_total"] < before["ds4py_cancelled_generations_total"] + 1:
        assert time.monotonic() - t0 < 30, "generation was not cancelled"
        time.sleep(0.05)
    stopped = metrics(srv)["ds4py_generated_tokens_total"]
    time.sleep(0.5)
    assert metrics(srv)["ds4py_generated_tokens_total"] == stopped          # nothing more is generated
    assert stopped - before["ds4py_generated_tokens_total"] < 50            # far fewer than the 500 asked for


def test_metrics_are_consistent(srv, oai):
    for _ in range(2):    # the repeat reuses the prompt's KV
        oai.chat.completions.create(model="deepseek-v4-flash", max_tokens=2,
                                    messages=[{"role": "user", "content": "m"}])
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")
    t0 = time.monotonic()
    while (m := metrics(srv))["ds4py_running_requests"] != 0:   # the worker clears it just after the last event
        assert time.monotonic() - t0 < 5
        time.sleep(0.02)
    assert m['ds4py_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert m['ds4py_requests_total{endpoint="/v1/models/{id}",status="404"}'] >= 1
    # every sampled token is either a request's first (TTFT) or follows another one (inter-token latency)
    assert m["ds4py_time_to_first_token_seconds_count"] + m["ds4py_inter_token_latency_seconds_count"] == \
        m["ds4py_generated_tokens_total"]
    assert 0 < m["ds4py_cached_prompt_tokens_total"] < m["ds4py_prompt_tokens_total"]
    assert m["ds4py_queue_depth"] == 0 and m["ds4py_running_requests"] == 0
    assert m['ds4py_time_to_first_token_seconds_bucket{le="+Inf"}'] == m["ds4py_time_to_first_token_seconds_count"]


# ---- the command ---------------------------------------------------------------------------------------------

def _stop(proc) -> str:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    return err


def test_serve_command(tiny):
    proc, base = start_serve(["-m", str(tiny), "--ctx", "256", "--api-key", "k"])
    try:
        c = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="deepseek-v4-flash", max_tokens=2, messages=[{"role": "user",
                                                                                         "content": "hi"}])
        assert r.usage.completion_tokens == 2
        assert c.models.retrieve("deepseek-v4-flash").model_extra["context_length"] == 256
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        err = _stop(proc)
    assert f"listening on http://127.0.0.1:{base.rsplit(':', 1)[1]}" in err


def test_serve_demo_model(tmp_path, golden):
    proc, base = start_serve(["--ctx", "128"], env={"XDG_CACHE_HOME": str(tmp_path)})
    try:
        models = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=30).read())["data"]
        assert models[0]["id"] == "ds4py-demo" and "RANDOM WEIGHTS" in models[0]["description"]
        c = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=60)
        m = c.messages.create(model="ds4py-demo", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert m.usage.output_tokens == 2
        text = "Refactor the tokenizer module so that merges are cached."
        n = c.messages.count_tokens(model="ds4py-demo", messages=[{"role": "user", "content": text}]).input_tokens
    finally:
        err = _stop(proc)
    assert "RANDOM WEIGHTS" in err
    demo = tmp_path / "ds4py" / "demo-tiny-v4vocab-random-seed0.gguf"
    # the demo model speaks DeepSeek V4's own vocabulary: official ids, and a prompt counts as the real model's
    tok = Tokenizer.from_gguf(str(demo))
    assert tok.vocab_size == 129280
    for case in json.loads((golden / "tokenizer" / "tokenizer_cases.json").read_text(encoding="utf-8"))["cases"][:8]:
        assert tok.encode(case["text"], special=True) == case["ids"], case["id"]
    assert n == 4 + len(tok.encode(text))                # BOS <｜User｜> text <｜Assistant｜></think>


def test_ignore_eos_generates_max_tokens(oai):
    """vLLM's `ignore_eos` (used by `bench serve --ignore-eos`) is honoured, not ignored: exactly max_tokens."""
    for n in (1, 7):
        r = oai.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="ignore_eos"):
        oai.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=2, extra_body={"ignore_eos": "yes"})
