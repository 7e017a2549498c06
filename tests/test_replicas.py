"""What a replica behind a router needs (docs/deploy.md): vLLM-compatible /metrics, readiness distinct from
liveness, the replica id on every answer, SSE keep-alives during a long prefill (read by the official SDKs), and
session affinity inside a replica (its session headers, hits and prefix fallbacks counted)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import anthropic
import openai
import pytest
from multidict import CIMultiDict

from ds4py.model import open_model
from ds4py.server.affinity import Affinity, session_key
from ds4py.server.app import BackgroundServer, ServerConfig, ServerState
from ds4py.server.pool import SessionPool
from ds4py.server.worker import Engine
from ds4py.session import Session
from ds4py.tokenizer import Tokenizer
from test_prefill_cancel import SlowModel
from test_server import CTX, NOTHINK, tiny  # noqa: F401  (the fixture: the tiny golden file)


@pytest.fixture(scope="module")
def model_tok(tiny):
    return open_model(str(tiny), backend="ref"), Tokenizer.from_gguf(str(tiny))


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """({'name{labels}': value}, {name: type}) of a Prometheus text exposition."""
    values, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values, types


def wait_idle(state: ServerState) -> None:
    t0 = time.monotonic()
    while state.metrics.running or state.metrics.queue_depth:
        assert time.monotonic() - t0 < 10
        time.sleep(0.02)


# ---- metrics, readiness, replica id ----------------------------------------------------------------------------

def test_vllm_metrics_readiness_and_replica_id(model_tok):
    model, tok = model_tok
    state = ServerState(ServerConfig(replica_id="r-7", model_ids=("deepseek-v4-flash",)))
    with BackgroundServer(state) as srv:
        # loading: not ready, but alive; the replica id is on every answer, errors included
        st, hd, body = get(srv.base_url + "/health")
        assert st == 503 and json.loads(body)["status"] == "loading" and hd["X-Replica-Id"] == "r-7"
        st, _, body = get(srv.base_url + "/livez")
        assert st == 200 and json.loads(body)["status"] == "alive"
        state.set_engine(Engine(Session(model, tok, ctx_size=CTX), tok))
        assert get(srv.base_url + "/health")[0] == 200
        oai = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "hello there"}]
        r = oai.chat.completions.with_raw_response.create(model="deepseek-v4-flash", max_tokens=3, messages=msgs)
        assert r.headers["x-replica-id"] == "r-7"
        first = r.parse()
        msgs += [{"role": "assistant", "content": first.choices[0].message.content or "x"},
                 {"role": "user", "content": "and again"}]
        with oai.chat.completions.with_streaming_response.create(model="deepseek-v4-flash", max_tokens=3,
                                                                 messages=msgs, stream=True) as s:
            assert s.headers["x-replica-id"] == "r-7"
            s.read()
        wait_idle(state)
        st, _, text = get(srv.base_url + "/metrics")
        m, types = parse_metrics(text.decode())
        lab = '{model_name="deepseek-v4-flash",engine="0"}'
        for name, kind in (("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                           ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:gpu_cache_usage_perc", "gauge"),
                           ("vllm:prompt_tokens_total", "counter"), ("vllm:generation_tokens_total", "counter"),
                           ("vllm:prefix_cache_queries_total", "counter"), ("vllm:prefix_cache_hits_total", "counter")):
            assert types[name] == kind and name + lab in m, name
        for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                     "vllm:e2e_request_latency_seconds"):
            assert types[name] == "histogram"
            assert m[f'{name}_bucket{{model_name="deepseek-v4-flash",engine="0",le="+Inf"}}'] == m[f"{name}_count{lab}"]
        assert m["vllm:num_requests_running" + lab] == 0 and m["vllm:num_requests_waiting" + lab] == 0
        assert m["vllm:e2e_request_latency_seconds_count" + lab] == 2
        assert m['vllm:request_success_total{model_name="deepseek-v4-flash",engine="0",finished_reason="length"}'] == 2
        assert m["vllm:time_to_first_token_seconds_count" + lab] == 2
        assert m["vllm:generation_tokens_total" + lab] == m["ds4py_generated_tokens_total"] == 6
        assert m["vllm:prompt_tokens_total" + lab] == m["ds4py_prompt_tokens_total"] == \
            m["vllm:prefix_cache_queries_total" + lab]
        # the second turn extended the first one's KV: its hits are the cached tokens of the usage
        assert 0 < m["vllm:prefix_cache_hits_total" + lab] == m["ds4py_cached_prompt_tokens_total"]
        used = state.engine.session.tokens
        assert len(used) > 0 and m["vllm:kv_cache_usage_perc" + lab] == pytest.approx(len(used) / CTX, abs=1e-6)
        assert types["vllm:lora_requests_info"] == "gauge"
        assert 'vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}' in m
        assert m['ds4py_replica_info{replica_id="r-7"}'] == 1
        # `bench serve` counts the answers of each replica (pointed at a router, one line per replica)
        from ds4py.bench_serve import format_summary, run_serve_bench
        summary = run_serve_bench(srv.base_url, concurrency=2, requests=3, input_len=8, output_len=2)
        assert summary["per_replica"] == {"r-7": 3} and "replica r-7:" in format_summary(summary)
        # draining (SIGTERM): not ready, still alive, new requests refused with 503
        state.draining = True
        st, _, body = get(srv.base_url + "/health")
        assert st == 503 and json.loads(body)["status"] == "draining"
        assert get(srv.base_url + "/livez")[0] == 200
        with pytest.raises(openai.InternalServerError) as e:
            oai.chat.completions.create(model="deepseek-v4-flash", max_tokens=2, messages=msgs[:1])
        assert e.value.status_code == 503 and "shutting down" in str(e.value)


def test_no_replica_header_without_a_replica_id(model_tok):
    model, tok = model_tok
    state = ServerState(ServerConfig())
    state.set_engine(Engine(Session(model, tok, ctx_size=CTX), tok))
    with BackgroundServer(state) as srv:
        st, hd, text = get(srv.base_url + "/metrics")
        assert st == 200 and "X-Replica-Id" not in hd and "ds4py_replica_info" not in text.decode()


def test_livez_needs_no_key(model_tok):
    model, tok = model_tok
    state = ServerState(ServerConfig(api_key="k"))
    state.set_engine(Engine(Session(model, tok, ctx_size=CTX), tok))
    with BackgroundServer(state) as srv:
        assert get(srv.base_url + "/livez")[0] == 200 and get(srv.base_url + "/health")[0] == 200
        assert get(srv.base_url + "/metrics")[0] == 401


# ---- SSE keep-alive ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slow_srv(model_tok):
    """A server whose prompt steps cost 10 ms a token (a 60-token prompt: 0.6 s of silence), keep-alive 0.1 s."""
    _, tok = model_tok
    model = SlowModel(tok.vocab_size, per_token=0.01, ctx=4096)
    state = ServerState(ServerConfig(sse_keepalive=0.1))
    state.set_engine(Engine(Session(model, tok, ctx_size=4096), tok))
    with BackgroundServer(state) as srv:
        yield srv


LONG = "a long prompt " * 20


def raw_stream(srv, path: str, body: dict) -> bytes:
    st, _, data = post(srv.base_url + path, {**body, "stream": True})
    assert st == 200, data
    return data


def test_keepalive_during_a_long_prefill_raw(slow_srv):
    data = raw_stream(slow_srv, "/v1/messages", {"model": "deepseek-v4-flash", "max_tokens": 2, **NOTHINK,
                                                  "messages": [{"role": "user", "content": LONG}]})
    assert data.count(b'event: ping\ndata: {"type": "ping"}\n\n') >= 2
    assert data.index(b"event: message_start") < data.index(b"event: ping")     # pings inside the message
    assert data.rstrip().endswith(b'data: {"type":"message_stop"}')
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "chat " + LONG}]}),
                       ("/v1/completions", {"prompt": "raw " + LONG}),
                       ("/v1/responses", {"input": "responses " + LONG})):   # (each one prefilled anew)
        data = raw_stream(slow_srv, path, {"model": "deepseek-v4-flash", "max_tokens": 2, **body})
        assert data.count(b"\n: keep-alive\n\n") + data.startswith(b": keep-alive\n\n") >= 2, path
        assert b"ping" not in data


def test_keepalive_is_accepted_by_the_sdks(slow_srv):
    oai = openai.OpenAI(base_url=slow_srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    chunks = list(oai.chat.completions.create(model="deepseek-v4-flash", max_tokens=2, stream=True,
                                              messages=[{"role": "user", "content": "sdk " + LONG}]))
    assert chunks[-1].choices[0].finish_reason == "length"
    events = list(oai.responses.create(model="deepseek-v4-flash", max_output_tokens=2, input="sdk2 " + LONG,
                                 stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    ant = anthropic.Anthropic(base_url=slow_srv.base_url, api_key="none", max_retries=0, timeout=60)
    with ant.messages.stream(model="deepseek-v4-flash", max_tokens=2,
                             messages=[{"role": "user", "content": "sdk3 " + LONG}],
                             **NOTHINK) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and final.stop_reason == "max_tokens"


def test_keepalive_with_thinking_is_an_event_the_sdks_pass_on(slow_srv):
    """With thinking on the keep-alive is an empty thinking delta in the already opened reasoning block, not a
    ping: the SDKs drop pings before their caller, and Claude Code aborts a stream without events after 300 s."""
    body = {"model": "deepseek-v4-flash", "max_tokens": 2, "thinking": {"type": "adaptive"},
            "messages": [{"role": "user", "content": "think " + LONG}]}
    data = raw_stream(slow_srv, "/v1/messages", body)
    assert b"ping" not in data
    start = data.index(b'"content_block":{"type":"thinking","thinking":"","signature":""}')
    empty = b'"delta":{"type":"thinking_delta","thinking":""}'
    assert data.count(empty) >= 2 and data.index(b"event: message_start") < start < data.index(empty)
    ant = anthropic.Anthropic(base_url=slow_srv.base_url, api_key="none", max_retries=0, timeout=60)
    with ant.messages.stream(**{**body, "messages": [{"role": "user", "content": "think sdk " + LONG}]}) as s:
        seen = [ev.type for ev in s]
        final = s.get_final_message()
    assert seen[:2] == ["message_start", "content_block_start"] and seen.count("thinking") >= 2, seen  # passed on
    assert final.content[0].type == "thinking" and final.stop_reason == "max_tokens"
    # continuing a prefilled assistant message: its text goes on, no reasoning block to open: pings
    data = raw_stream(slow_srv, "/v1/messages", {**body, "messages": [{"role": "user", "content": "go on " + LONG},
                                                                      {"role": "assistant", "content": "Sure,"}]})
    assert data.count(b"event: ping") >= 2 and b'"type":"thinking"' not in data


# ---- session affinity ------------------------------------------------------------------------------------------

def test_session_key_sources():
    H = CIMultiDict           # what aiohttp hands over: header names are case-insensitive
    assert session_key(H({"X-Session-ID": " abc ", "session_id": "cx"}), {"user": "u"}) == "abc"
    assert session_key(H({"X-Claude-Code-Session-Id": "cc-1", "session_id": "cx"}), {}) == "cc-1"
    assert session_key(H({"session_id": "codex-1"}), {}) == "codex-1"
    assert session_key(H({"Session-Id": "codex-2"}), {}) == "codex-2"
    uid = "user_0a1b_account_ff_session_57a121ec-f78c-48c3-a745-e3036a3ecc33"
    assert session_key({}, {"metadata": {"user_id": uid}}) == "57a121ec-f78c-48c3-a745-e3036a3ecc33"
    uid = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "54c1eb09"})
    assert session_key({}, {"metadata": {"user_id": uid}}) == "54c1eb09"
    assert session_key({}, {"prompt_cache_key": "conv-9", "user": "u"}) == "conv-9"
    assert session_key({}, {"user": "u"}) == "u"
    for body in ({}, {"metadata": {"user_id": "{not json"}}, {"metadata": "x"}, {"user": 5}, {"user": "  "},
                 {"metadata": {"user_id": '["list"]'}}):
        assert session_key({}, body) is None
    assert len(session_key(H({"X-Session-ID": "k" * 1000}), {})) == 256


def test_affinity_choice_and_bound():
    a = Affinity(max_keys=2)
    assert a.choose(None, lambda i: True, lambda i: True, lambda: 1) == (1, "none")
    assert a.choose("k", lambda i: True, lambda i: True, lambda: 1) == (1, "fallback")     # unknown key
    a.bind("k", 0)
    assert a.choose("k", lambda i: True, lambda i: True, lambda: 1) == (0, "hit")
    assert a.choose("k", lambda i: False, lambda i: True, lambda: 1) == (1, "fallback")    # its session is busy
    assert a.choose("k", lambda i: True, lambda i: False, lambda: 1) == (1, "fallback")    # serves nothing
    assert a.bind("j", 1) is None and a.bind("j", 1) is None
    assert a.owner(1) == "j" and a.owner(0) == "k"
    assert a.bind("l", 1) == "j"         # l's conversation replaced (displaced) j's in slot 1
    assert a.slot_of("j") is None and a.owner(1) == "l" and a.slot_of("k") == 0
    a.bind("m", 2)
    assert len(a) == 2 and a.slot_of("k") is None and a.owner(0) is None                   # least recent dropped


def test_session_affinity_in_a_pool(model_tok):
    """Two conversations with their own session ids over a pool of 3: each turn runs in its conversation's
    session (hits), an unrelated side request of the same id does not evict it (fallback), a request without an
    id is routed by prefix (none); the counts are on /metrics."""
    model, tok = model_tok
    state = ServerState(ServerConfig())
    state.set_engine(Engine(SessionPool(model, tok, 3, CTX), tok))
    pool = state.engine.pool
    with BackgroundServer(state) as srv:
        ant = anthropic.Anthropic(base_url=srv.base_url, api_key="none", max_retries=0, timeout=60)
        convs = {"conv-a": [{"role": "user", "content": "tell me about apples"}],
                 "conv-b": [{"role": "user", "content": "tell me about boats"}]}
        where = {k: [] for k in convs}
        for turn in range(3):
            for key, msgs in convs.items():
                hdr = {"X-Claude-Code-Session-Id": key}
                r = ant.messages.create(model="deepseek-v4-flash", max_tokens=3, messages=msgs, extra_headers=hdr,
                                        **NOTHINK)
                if turn:
                    assert r.usage.cache_read_input_tokens > 0
                where[key].append(pool.affinity.slot_of(key))
                msgs += [{"role": "assistant", "content": r.content[0].text if r.content else "ok"},
                         {"role": "user", "content": f"more, turn {turn}"}]
        assert all(len(set(v)) == 1 for v in where.values()) and where["conv-a"][0] != where["conv-b"][0]
        held = {k: list(pool.sessions[v[0]].tokens) for k, v in where.items()}
        # a side request with conv-a's id but an unrelated prompt: runs elsewhere, conv-a's state stays
        ant.messages.create(model="deepseek-v4-flash", max_tokens=2, extra_headers={"X-Session-ID": "conv-a"},
                            messages=[{"role": "user", "content": "zzz unrelated"}], system="other", **NOTHINK)
        wait_idle(state)
        assert list(pool.sessions[where["conv-b"][0]].tokens) == held["conv-b"]
        assert list(pool.sessions[where["conv-a"][0]].tokens) == held["conv-a"]
        ant.messages.create(model="deepseek-v4-flash", max_tokens=2, messages=convs["conv-b"], **NOTHINK)
        wait_idle(state)
        m, _ = parse_metrics(get(srv.base_url + "/metrics")[2].decode())
        assert m['ds4py_session_affinity_total{result="hit"}'] == 4           # turns 2 and 3 of both
        assert m['ds4py_session_affinity_total{result="fallback"}'] == 3      # two first turns, the side request
        assert m['ds4py_session_affinity_total{result="none"}'] == 1


def _conversation_turns(base_url: str, key: str, turns: int, out: list) -> None:
    """One conversation of `turns` streamed chat turns with X-Session-ID; appends each turn's usage to out."""
    msgs = [{"role": "system", "content": f"Project {key}: keep answers short."},
            {"role": "user", "content": f"{key}: start"}]
    for turn in range(turns):
        st, hd, body = post(base_url + "/v1/chat/completions",
                            {"model": "deepseek-v4-flash", "messages": msgs, "max_tokens": 2, "temperature": 0,
                             "stream": True, "stream_options": {"include_usage": True}},
                            {"X-Session-ID": key})
        assert st == 200, body
        events = [json.loads(line[6:]) for line in body.decode().splitlines()
                  if line.startswith("data: {")]
        text = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
        out.append((turn, events[-1]["usage"]))
        msgs += [{"role": "assistant", "content": text or "x"}, {"role": "user", "content": f"{key}: step {turn}"}]


def test_concurrent_conversations_keep_their_sessions(model_tok):
    """As many conversations as sessions, their turns sent at once (a replica behind a router): every later turn
    reuses at least its previous prompt (less its last token: the snapshot point), none displaces another."""
    model, tok = model_tok
    state = ServerState(ServerConfig())
    state.set_engine(Engine(SessionPool(model, tok, 3, CTX), tok))
    with BackgroundServer(state) as srv:
        usage = {k: [] for k in ("conv-a", "conv-b", "conv-c")}
        threads = [threading.Thread(target=_conversation_turns, args=(srv.base_url, k, 3, u)) for k, u in usage.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(len(u) == 3 for u in usage.values()), usage
        for u in usage.values():
            for (_, prev), (_, cur) in zip(u, u[1:]):
                assert cur["prompt_tokens_details"]["cached_tokens"] >= prev["prompt_tokens"] - 1, u
        wait_idle(state)
        m, _ = parse_metrics(get(srv.base_url + "/metrics")[2].decode())
        assert m["ds4py_session_displaced_total"] == 0
        assert m['ds4py_session_affinity_total{result="hit"}'] == 6


def test_more_conversations_than_sessions_are_displaced_and_counted(model_tok, caplog):
    """Three conversations taking turns over two sessions: a turn that finds its session taken over displaces
    the least recently used conversation; /metrics and the log say so (the capacity a replica lacks)."""
    model, tok = model_tok
    state = ServerState(ServerConfig())
    state.set_engine(Engine(SessionPool(model, tok, 2, CTX), tok))
    with BackgroundServer(state) as srv, caplog.at_level("INFO", logger="ds4py.server"):
        for key in ("conv-a", "conv-b", "conv-c"):
            _conversation_turns(srv.base_url, key, 1, [])
        wait_idle(state)
        m, _ = parse_metrics(get(srv.base_url + "/metrics")[2].decode())
    assert m["ds4py_session_displaced_total"] == 1          # conv-c took conv-a's session (least recently used)
    assert state.engine.pool.affinity.slot_of("conv-a") is None
    assert any("'conv-c' displaces 'conv-a'" in r.getMessage() for r in caplog.records)


def test_session_affinity_with_one_session(model_tok):
    model, tok = model_tok
    state = ServerState(ServerConfig())
    state.set_engine(Engine(Session(model, tok, ctx_size=CTX), tok))
    with BackgroundServer(state) as srv:
        oai = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            r = oai.chat.completions.create(model="deepseek-chat", max_tokens=2, messages=msgs,
                                            extra_headers={"session_id": "codex-conv"})
            msgs += [{"role": "assistant", "content": r.choices[0].message.content or "x"},
                     {"role": "user", "content": "next"}]
        wait_idle(state)
        assert state.metrics.affinity == {"hit": 1, "fallback": 1, "none": 0}


def test_unknown_field_names_are_remembered_within_a_bound(monkeypatch):
    """A long-lived replica: a client sending a new unknown field name on every request does not grow the
    server's memory (the names logged once are bounded)."""
    from ds4py.server import protocol

    monkeypatch.setattr(protocol, "_warned", set())
    monkeypatch.setattr(protocol, "MAX_WARNED", 8)
    for i in range(100):
        protocol.note_unknown({f"x_{i}": 1}, frozenset(), "/v1/chat/completions")
    assert len(protocol._warned) == 8


def test_serve_replica_options_are_checked():
    from test_serve_cli import serve_fails

    assert "--replica-id must be 1 to 128 printable ASCII" in serve_fails(["--replica-id", "two words"])
    assert "--replica-id must be" in serve_fails(["--replica-id", ""])
    assert "--sse-keepalive must be >= 0" in serve_fails(["--sse-keepalive", "-1"])


def test_serve_replica_id_in_the_log_and_header(tiny):
    import signal as sig

    from helpers import start_serve

    proc, base = start_serve(["-m", str(tiny), "--ctx", "256", "--replica-id", "box-1", "-v"])
    try:
        st, hd, _ = get(base + "/livez")
        assert st == 200 and hd["X-Replica-Id"] == "box-1"
    finally:
        proc.send_signal(sig.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert "[box-1] " in err and "ds4py serve [box-1]: listening" in err
