"""Hostile but fair clients against the real HTTP stack (scripted engine, see test_server_protocol): every 4xx in
the API's own JSON shape, never a 500 for the client's mistake; timeouts for stalled clients; browser-facing
protections (Host, Origin); the smaller length limit binds; count_tokens counts what does not fit."""

from __future__ import annotations

import gzip
import json
import logging
import socket
import time

import pytest

from ds4py.chat import EOS
from test_server_protocol import ScriptedSession, call, get, post, scripted, tok  # noqa: F401  (tok: a fixture)

MSGS = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/chat/completions": {"messages": MSGS, "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"messages": MSGS, "max_tokens": 2},
    "/v1/messages/count_tokens": {"messages": MSGS},
}


def is_api_error(path: str, r) -> bool:
    """The route's own error JSON: Anthropic's on /v1/messages*, OpenAI's elsewhere."""
    j = r.json()
    if path.startswith("/v1/messages"):
        return j["type"] == "error" and isinstance(j["error"]["message"], str) and isinstance(j["error"]["type"], str)
    return isinstance(j["error"]["message"], str) and "type" in j["error"] and "param" in j["error"]


def raw_exchange(srv, data: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes, return everything the server sends until it closes."""
    with socket.create_connection((srv.host, srv.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


# ---- 400 where it used to be 500 ----------------------------------------------------------------------------

def test_content_encoding_the_body_does_not_have_is_400(tok):
    with scripted(tok, ["ok", EOS]) as srv:
        for path, body in BODIES.items():
            raw = json.dumps(body).encode()
            for enc in ("gzip", "deflate", "br"):
                r = post(srv.base_url + path, content=raw, headers={"Content-Encoding": enc,
                                                                   "Content-Type": "application/json"})
                assert r.status_code == 400 and is_api_error(path, r), (path, enc, r.content)
                # gzip / deflate: found reading the body; br: not decodable here at all
                assert any(w in r.json()["error"]["message"] for w in ("cannot be read", "Content-Encoding"))
            r = post(srv.base_url + path, content=gzip.compress(raw), headers={"Content-Encoding": "gzip"})
            assert r.status_code == 200, (path, r.content)                     # a real gzip body is fine
        assert len(srv.session.prompts) == 4                                    # count_tokens does not generate


WRONG_TYPES = [
    # (route, body, the field the 400 names)
    ("/v1/chat/completions", {"messages": MSGS, "reasoning_effort": ["high"]}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": MSGS, "reasoning_effort": {"x": 1}}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": MSGS, "stream": True, "stream_options": {"include_usage": "yes"}},
     "include_usage"),
    ("/v1/chat/completions", {"messages": MSGS, "tools": [{"type": "function", "function": {
        "name": "f", "description": {"a": 1}}}]}, "description"),
    ("/v1/chat/completions", {"messages": [MSGS[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": {"x": 1}, "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "r"}]}, "id"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": ["low"]}}, "reasoning.effort"),
    ("/v1/responses", {"input": "hi", "include": 5}, "include"),
    ("/v1/responses", {"input": "hi", "include": [5]}, "include"),
    ("/v1/responses", {"input": "hi", "text": {"format": "json"}}, "text.format"),
    ("/v1/responses", {"input": "hi", "text": "plain"}, "text"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "schema": "x"}}}, "schema"),
    ("/v1/responses", {"input": [{"type": "reasoning", "content": 5}, {"role": "user", "content": "hi"}]},
     "content"),
    ("/v1/responses", {"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]},
                                 {"role": "user", "content": "hi"}]}, "content"),
    ("/v1/responses", {"input": [{"type": "reasoning", "summary": "x", "encrypted_content": 5},
                                 {"role": "user", "content": "hi"}]}, "summary"),
    ("/v1/messages", {"messages": MSGS, "max_tokens": 2, "reasoning_effort": {"a": 1}}, "reasoning_effort"),
    ("/v1/messages", {"messages": MSGS, "max_tokens": 2, "stop_sequences": "STOP"}, "stop_sequences"),
    ("/v1/messages", {"max_tokens": 2, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}]},
     "is_error"),
    ("/v1/messages/count_tokens", {"messages": MSGS, "reasoning_effort": [1]}, "reasoning_effort"),
]


@pytest.mark.parametrize("path,body,field", WRONG_TYPES, ids=[f"{p}:{f}" for p, _, f in WRONG_TYPES])
def test_fields_of_the_wrong_type_deep_in_a_valid_body_are_400(tok, path, body, field):
    with scripted(tok, ["ok", EOS]) as srv:
        r = post(srv.base_url + path, json_body=body)
        assert r.status_code == 400 and is_api_error(path, r), r.content
        assert field in r.json()["error"]["message"]
        assert srv.session.prompts == []


def test_non_ascii_and_invalid_utf8_api_keys_are_401_on_every_route(tok):
    with scripted(tok, ["ok", EOS], api_key="s3cret") as srv:
        for path in list(BODIES) + ["/v1/models", "/metrics"]:
            for key in ("caf\u00e9\u2603".encode(), b"\xff\xfe\xfd", "s3cret\u00e9".encode()):
                for header in (b"x-api-key: " + key, b"Authorization: Bearer " + key):
                    method = b"POST" if path in BODIES else b"GET"
                    body = json.dumps(BODIES.get(path, {})).encode()
                    out = raw_exchange(srv, method + b" " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" +
                                       header + b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
                    assert out.startswith(b"HTTP/1.1 401"), (path, header, out[:200])
                    assert b"authentication_error" in out
        assert srv.session.prompts == []


def test_unexpected_exception_is_a_logged_500_of_last_resort(tok, caplog):
    with scripted(tok, ["ok", EOS]) as srv:
        engine = srv.state.engine

        def broken(req):
            raise RuntimeError("a bug")
        engine.prompt_ids = broken
        with caplog.at_level(logging.ERROR, logger="ds4py.server"):
            r = post(srv.base_url + "/v1/chat/completions", json_body=BODIES["/v1/chat/completions"])
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
        assert "RuntimeError" in r.json()["error"]["message"] and "a bug" not in r.json()["error"]["message"]
        assert any(rec.exc_info for rec in caplog.records), "the bug must be logged with its traceback"


# ---- limits -----------------------------------------------------------------------------------------------------

def test_smaller_of_max_tokens_and_max_completion_tokens_binds(tok):
    with scripted(tok, ["a", "b", "c", "d", "e", "f", EOS]) as srv:
        for a, b in ((5, 2), (2, 5)):
            r = post(srv.base_url + "/v1/chat/completions",
                     json_body={"messages": MSGS, "max_tokens": a, "max_completion_tokens": b})
            assert r.json()["usage"]["completion_tokens"] == 2, (a, b)


def test_count_tokens_counts_prompts_longer_than_the_context(tok):
    with scripted(tok, ["ok", EOS], ctx_size=64) as srv:
        body = {"messages": [{"role": "user", "content": "long " * 200}]}
        r = post(srv.base_url + "/v1/messages/count_tokens", json_body=body)
        assert r.status_code == 200 and r.json()["input_tokens"] > 64
        r = post(srv.base_url + "/v1/messages", json_body={**body, "max_tokens": 2})
        assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"]


def test_413_closes_the_connection_before_reading_the_body(tok):
    with scripted(tok, ["ok", EOS], max_body_mb=0.01) as srv:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 50000000\r\n\r\n")
        t0 = time.monotonic()
        out = raw_exchange(srv, head + b"{" * 1000)          # 50 MB announced, 1 kB sent: answered at once
        assert out.startswith(b"HTTP/1.1 413") and b"connection: close" in out.lower()
        assert b"request_too_large" in out and time.monotonic() - t0 < 5
        r = post(srv.base_url + "/v1/messages", content=b"x" * 20_000)       # Content-Length known
        assert r.status_code == 413 and r.headers["connection"] == "close" and is_api_error("/v1/messages", r)
        chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n" +
                   b"".join(b"1000\r\n" + b"x" * 4096 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n")
        out = raw_exchange(srv, chunked)                     # no Content-Length: found while reading
        assert out.startswith(b"HTTP/1.1 413") and b"connection: close" in out.lower()


def test_stalled_headers_are_closed_and_stalled_bodies_get_408(tok):
    with scripted(tok, ["ok", EOS], header_timeout=0.5, body_timeout=0.5) as srv:
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")      # never finishes
            t0 = time.monotonic()
            assert s.recv(100) == b""                        # closed by the server
            assert 0.3 < time.monotonic() - t0 < 5
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
            t0 = time.monotonic()
            out = b""
            while chunk := s.recv(65536):
                out += chunk
            assert out.startswith(b"HTTP/1.1 408") and b"connection: close" in out.lower(), out[:300]
            assert b"did not arrive within 0.5 s" in out and time.monotonic() - t0 < 15
        assert srv.session.prompts == []
        # a slow but steady client is fine: the headers and body arrive in pieces, each well within the limits
        body = json.dumps(BODIES["/v1/chat/completions"]).encode()
        msg = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            for i in range(0, len(msg), len(msg) // 4 + 1):
                s.sendall(msg[i:i + len(msg) // 4 + 1])
                time.sleep(0.05)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        assert out.startswith(b"HTTP/1.1 200")


def test_low_level_http_errors_are_api_json_without_tracebacks(tok, caplog):
    with scripted(tok, ["ok", EOS]) as srv, caplog.at_level(logging.DEBUG):
        for raw in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n",
                    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(40)),
                    b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Encoding: zstd\r\n"
                    b"Content-Length: 2\r\n\r\n{}",
                    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n"):
            out = raw_exchange(srv, raw)
            head, _, body = out.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.") and b" 400 " in head.split(b"\r\n")[0], out[:200]
            assert b"application/json" in head
            j = json.loads(body)
            # the route is unknown at that point: both SDKs' shapes at once
            assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
            assert j["error"]["message"].startswith("malformed HTTP request")
        assert not [r for r in caplog.records if r.exc_info], "malformed HTTP must not log tracebacks"
        assert len([r for r in caplog.records if "malformed HTTP" in r.getMessage()]) >= 5   # one line each


# ---- browser-facing safety ----------------------------------------------------------------------------------------

def test_host_header_must_name_this_server(tok):
    """DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1 sends `Host: evil.example`."""
    with scripted(tok, ["ok", EOS]) as srv:
        url = srv.base_url
        for host in ("evil.example", "evil.example:%d" % srv.port, "127.0.0.1.nip.io"):
            r = call("GET", url + "/v1/models", headers={"Host": host})
            assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host
            r = post(url + "/v1/messages", json_body=BODIES["/v1/messages"], headers={"Host": host})
            assert r.status_code == 403 and is_api_error("/v1/messages", r)
        for host in ("127.0.0.1:%d" % srv.port, "localhost:%d" % srv.port, "LOCALHOST", "[::1]:80", "127.0.0.2",
                     "app.localhost"):
            assert call("GET", url + "/v1/models", headers={"Host": host}).status_code == 200, host
        assert srv.session.prompts == []
    with scripted(tok, ["ok", EOS], allowed_hosts=["box.lan"]) as srv:
        assert call("GET", srv.base_url + "/health", headers={"Host": "box.lan:8000"}).status_code == 200
        assert call("GET", srv.base_url + "/health", headers={"Host": "localhost"}).status_code == 403
    with scripted(tok, ["ok", EOS], host="0.0.0.0") as srv:         # every interface: it cannot know its names
        assert call("GET", srv.base_url + "/health", headers={"Host": "box.lan"}).status_code == 200


def test_allowed_hosts_default_follows_the_bound_address():
    from ds4py.server.app import allowed_hosts_for, host_allowed

    loop = allowed_hosts_for("127.0.0.1")
    assert host_allowed("localhost:8000", loop) and host_allowed("[::1]:1", loop) and host_allowed("127.9.9.9", loop)
    assert not host_allowed("evil.example", loop) and not host_allowed("10.0.0.5", loop)
    one = allowed_hosts_for("192.168.1.7")
    assert host_allowed("192.168.1.7:8000", one) and host_allowed("localhost", one)
    assert not host_allowed("evil.example", one)
    assert allowed_hosts_for("0.0.0.0") is None and allowed_hosts_for("::") is None


def test_cross_site_simple_posts_are_refused_unless_cors_allows_the_origin(tok):
    body = json.dumps(BODIES["/v1/chat/completions"]).encode()
    simple = {"Content-Type": "text/plain", "Origin": "http://evil.example"}     # no preflight for this one
    with scripted(tok, ["ok", EOS]) as srv:
        r = post(srv.base_url + "/v1/chat/completions", content=body, headers=simple)
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        r = post(srv.base_url + "/v1/messages", content=json.dumps(BODIES["/v1/messages"]).encode(),
                 headers={**simple, "Origin": "null"})
        assert r.status_code == 403 and is_api_error("/v1/messages", r)
        assert srv.session.prompts == []                        # nothing ran
        same = {"Content-Type": "text/plain", "Origin": f"http://127.0.0.1:{srv.port}"}
        assert post(srv.base_url + "/v1/chat/completions", content=body, headers=same).status_code == 200
        assert post(srv.base_url + "/v1/chat/completions", content=body).status_code == 200      # no Origin: no browser
        assert call("GET", srv.base_url + "/v1/models", headers=simple).status_code == 200        # reads are unreadable
    with scripted(tok, ["ok", EOS], cors=["http://evil.example"]) as srv:
        r = post(srv.base_url + "/v1/chat/completions", content=body, headers=simple)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://evil.example"
