"""`serve --sessions N` on the reference model (ds4-tiny): routing to resident sessions, batched decode steps
with prefill chunks between them, greedy and seeded answers that do not depend on what runs beside them,
cancellation, the queue limit, a failing step, and the metrics."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from ds4py.disk_cache import DiskCache, KVCachePolicy
from ds4py.model import open_model
from ds4py import driver as runner
from ds4py.server.app import BackgroundServer, ServerConfig, ServerState
from ds4py.server.pool import SessionPool
from ds4py.server.worker import Engine
from ds4py.tokenizer import Tokenizer

CTX = 1024


@pytest.fixture(scope="module")
def model(golden):
    return open_model(str(golden / "ds4-tiny" / "tiny.gguf"))


@pytest.fixture(scope="module")
def tok(golden):
    return Tokenizer.from_gguf(golden / "ds4-tiny" / "tiny.gguf")


@pytest.fixture
def steps(monkeypatch):
    """Every model step the scheduler runs: [(id(state), chunk length), ...] per step."""
    seen: list[list[tuple[int, int]]] = []
    real = runner.ModelRunner.step

    def step(self, states, chunks):
        seen.append([(id(s), len(c)) for s, c in zip(states, chunks)])
        return real(self, states, chunks)
    monkeypatch.setattr(runner.ModelRunner, "step", step)
    return seen


@contextlib.contextmanager
def serving(model, tok, n=4, max_queue=64, **pool):
    state = ServerState(ServerConfig(max_queue=max_queue))
    state.set_engine(Engine(SessionPool(model, tok, n, CTX, **pool), tok))
    with BackgroundServer(state) as srv:
        yield srv


def post(srv, body: dict, path="/v1/completions", timeout=300) -> dict:
    req = urllib.request.Request(srv.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def completion(ids, n=10, **kw) -> dict:
    return {"model": "deepseek-v4-flash", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, **kw}


def concurrently(fn, args) -> list:
    out = [None] * len(args)

    def one(i):
        out[i] = fn(args[i])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def metrics(srv) -> dict[str, float]:
    text = urllib.request.urlopen(srv.base_url + "/metrics", timeout=30).read().decode()
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines() if ln and ln[0] != "#")}


def open_stream(srv, body: dict) -> socket.socket:
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection((srv.host, srv.port), timeout=120)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def read_events(sock, n: int) -> bytes:
    got = b""
    while got.count(b"data: ") < n:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    return got


PROMPTS = [np.random.default_rng(i).integers(3, 512, 8 + 9 * i).tolist() for i in range(12)]


# ---- batching and invariance -----------------------------------------------------------------------------

def test_concurrent_greedy_requests_equal_sequential_ones(model, tok, steps):
    """12 prompts of 8..107 tokens, 10 greedy tokens each: one at a time on one server, all at once on a fresh
    one (4 sessions: 8 wait for a free session). Same tokens, in fewer model steps (decode rows batched)."""
    with serving(model, tok) as srv:
        alone = [post(srv, completion(p)) for p in PROMPTS]
    n_alone = len(steps)
    assert max(len(s) for s in steps) == 1
    steps.clear()
    with serving(model, tok) as srv:
        together = concurrently(lambda p: post(srv, completion(p)), PROMPTS)
        m = metrics(srv)
    for a, b in zip(alone, together):
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 10
    assert max(len(s) for s in steps) == 4 and len(steps) < n_alone * 0.6
    assert m["ds4py_batch_sequences_count"] == len(steps)
    assert m['ds4py_batch_sequences_bucket{le="3"}'] < len(steps)          # most steps ran 4 sequences


def test_a_long_prefill_runs_between_decode_steps(model, tok, steps):
    """A 300-token prompt arrives while another request streams: every step that prefills it also advances
    the stream, and no step holds more than one chunk of prompt."""
    with serving(model, tok, n=2, prefill_chunk=32) as srv:
        sock = open_stream(srv, completion(PROMPTS[0], n=60))
        read_events(sock, 3)
        started = len(steps)
        long = post(srv, completion(np.random.default_rng(99).integers(3, 512, 300).tolist(), n=2))
        sock.close()
        assert long["usage"]["prompt_tokens"] == 300
    during = [s for s in steps[started:] if any(n > 1 for _, n in s)]
    assert len(during) >= 9                                  # 300 tokens in chunks of at most 32
    assert all(sum(n for _, n in s if n > 1) <= 32 for s in steps)
    assert sum(any(n == 1 for _, n in s) for s in during) >= len(during) - 1    # the stream kept going


def test_prompt_chunks_follow_a_fixed_grid(model, tok, steps):
    """Chunk boundaries are multiples of the chunk from the prompt's start (and the snapshot point before its
    last token), whatever else is running: the arithmetic of a prompt never depends on the load."""
    def chunks_by_state():
        out: dict[int, list[int]] = {}
        for s in steps:
            for sid, n in s:
                out.setdefault(sid, []).append(n)
        return list(out.values())
    with serving(model, tok, n=3, prefill_chunk=32) as srv:
        post(srv, completion(PROMPTS[-1], n=1))                       # 107 tokens, alone
        assert chunks_by_state() == [[32, 32, 32, 10, 1]]
        steps.clear()
        sock = open_stream(srv, completion(PROMPTS[0], n=60))         # 8 tokens, then decoding
        read_events(sock, 2)
        concurrently(lambda p: post(srv, completion(p, n=1)), [PROMPTS[-2] + [5], PROMPTS[-3]])   # 99, 89
        sock.close()
    got = chunks_by_state()
    assert [32, 32, 32, 2, 1] in got and [32, 32, 24, 1] in got
    assert all(sum(n for _, n in s if n > 1) <= 32 for s in steps)


def test_seeded_sampling_does_not_depend_on_neighbours(model, tok):
    body = completion(PROMPTS[3], n=12, temperature=1.0, seed=7, ignore_eos=True)
    with serving(model, tok) as srv:
        alone = post(srv, body)["choices"][0]["text"]
    with serving(model, tok) as srv:
        out = concurrently(lambda b: post(srv, b), [completion(PROMPTS[i], n=12, temperature=1.0, seed=i)
                                                    for i in (1, 2)] + [body] + [completion(PROMPTS[5], n=12)])
    assert out[2]["choices"][0]["text"] == alone


# ---- routing ---------------------------------------------------------------------------------------------

def test_routing_follows_the_longest_own_prefix_else_empty_else_lru(model, tok, tmp_path):
    pool = SessionPool(model, tok, 3, CTX)

    def run(i, prompt, n=3):
        s = pool.acquire(i)
        s.start(prompt)
        while (ids := s.next_chunk(prompt, 64, aligned=True)) is not None:
            s.advance(ids, model.step([s.state], [ids])[0])
        for _ in range(n - 1):
            t = int(np.argmax(s.logits))
            s.advance([t], model.step([s.state], [[t]])[0], decoded=True)
        pool.release(i)
    a, b, c, d = PROMPTS[4], PROMPTS[5], PROMPTS[6], PROMPTS[7]
    assert pool.route(a) == 0                                        # all empty: the first
    run(0, a)
    assert pool.route(b) == 1                                        # unrelated: an empty session, not 0's
    run(1, b)
    follow = list(pool.sessions[0].tokens) + [9, 9]
    assert pool.route(follow) == 0                                   # a continuation goes home
    assert pool.route(a) == 0                                        # a retry: 0's snapshot before a's last token
    pool.disk = DiskCache(tmp_path, 64, model, policy=KVCachePolicy(min_tokens=8), asynchronous=False)
    pool.disk.save("cold", follow[:-1], model.save_state(model.new_state()), None)    # (a stand-in state)
    assert pool.route(follow) == 2                                   # the disk holds more: an empty session
    pool.disk = None
    run(2, c)
    assert pool.route(d) == 0                                        # all full, nothing shared: the LRU (0)
    pool.acquire(0)
    assert pool.route(follow) == 1                                   # 0 is busy (never evicted): LRU of the rest
    pool.busy = [True] * 3
    assert pool.route(d) is None                                     # everyone busy: the request waits


def test_a_short_shared_prefix_does_not_take_another_conversation(model, tok):
    pool = SessionPool(model, tok, 2, CTX)
    s = pool.acquire(0)
    short = PROMPTS[0]                                               # 8 tokens: the whole state within the horizon
    s.start(short)
    s.advance(short, model.step([s.state], [short])[0])
    pool.release(0)
    other = short[:2] + [7] * 10
    assert s.reuse(other, disk=False) == (2, "truncate")            # reachable, but it would throw 6 tokens away
    assert pool.route(other) == 1


# ---- cancellation, limits, failures ------------------------------------------------------------------------

def test_disconnect_frees_its_session_and_spares_the_others(model, tok):
    with serving(model, tok, n=2) as srv:
        want = post(srv, completion(PROMPTS[2], n=20))["choices"][0]["text"]
        before = metrics(srv)
        sock = open_stream(srv, completion(PROMPTS[1], n=400))
        read_events(sock, 3)
        other = {}
        t = threading.Thread(target=lambda: other.update(post(srv, completion(PROMPTS[2], n=20))))
        t.start()
        time.sleep(0.3)
        sock.close()
        t.join(120)
        t0 = time.monotonic()
        while metrics(srv)["ds4py_cancelled_generations_total"] < before["ds4py_cancelled_generations_total"] + 1:
            assert time.monotonic() - t0 < 30
            time.sleep(0.05)
        assert other["choices"][0]["text"] == want
        both = concurrently(lambda p: post(srv, completion(p, n=3)), [PROMPTS[3], PROMPTS[4]])
        assert all(r["usage"]["completion_tokens"] == 3 for r in both)        # both sessions free again
        m = metrics(srv)
        assert m["ds4py_running_requests"] == 0
        assert m["ds4py_generated_tokens_total"] - before["ds4py_generated_tokens_total"] < 100


def test_queue_limit_answers_429(model, tok):
    with serving(model, tok, n=2, max_queue=1) as srv:
        socks = []
        for i in (0, 1):           # one at a time: two arriving together could find the first still queued
            socks.append(open_stream(srv, completion(PROMPTS[i], n=900)))
            read_events(socks[-1], 2)                           # running: both sessions busy after the second
        socks.append(open_stream(srv, completion(PROMPTS[2], n=5)))
        t0 = time.monotonic()
        while metrics(srv)["ds4py_queue_depth"] < 1:
            assert time.monotonic() - t0 < 30
            time.sleep(0.05)
        with pytest.raises(urllib.error.HTTPError) as e:
            post(srv, completion(PROMPTS[3], n=5))
        assert e.value.code == 429 and e.value.headers["Retry-After"]
        socks[0].close()                                        # a session frees up: the waiting one runs
        got = read_events(socks[2], 3)
        assert b"HTTP/1.1 200" in got
        for s in socks[1:]:
            s.close()


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(model, tok, monkeypatch):
    real = runner.ModelRunner.step
    calls = {"n": 0}

    def flaky(self, states, chunks):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real(self, states, chunks)
    monkeypatch.setattr(runner.ModelRunner, "step", flaky)
    with serving(model, tok, n=2) as srv:
        with pytest.raises(urllib.error.HTTPError) as e:
            post(srv, completion(PROMPTS[1], n=5))
        assert e.value.code == 500 and b"device lost" in e.value.read()
        r = post(srv, completion(PROMPTS[1], n=5))
        assert r["usage"]["completion_tokens"] == 5
        # the half-advanced live state was dropped; the snapshot before the prompt's last token is intact
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPTS[1]) - 1
        assert metrics(srv)['ds4py_kv_cache_source_total{source="snapshot"}'] == 1


def test_nonfinite_logits_mark_the_model_broken(model, tok, monkeypatch):
    real = runner.ModelRunner.step

    def nan(self, states, chunks):
        out = real(self, states, chunks)
        return [np.full_like(o, np.nan) for o in out] if len(states) > 1 else out
    monkeypatch.setattr(runner.ModelRunner, "step", nan)
    with serving(model, tok, n=2) as srv:
        results = concurrently(lambda p: _status(srv, completion(p, n=30)), [PROMPTS[1], PROMPTS[2]])
        assert 503 in results or 500 in results
        health = urllib.request.Request(srv.base_url + "/health")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(health, timeout=30)
        assert e.value.code == 503 and b"invalid logits" in e.value.read()


def _status(srv, body) -> int:
    try:
        post(srv, body)
        return 200
    except urllib.error.HTTPError as e:
        return e.code


# ---- metrics and the reuse report -----------------------------------------------------------------------------

def test_metrics_report_sessions_batches_and_reuse(model, tok, caplog):
    with serving(model, tok, n=3) as srv:
        post(srv, completion(PROMPTS[6], n=20))                           # longer than the rollback horizon
        again = post(srv, completion(PROMPTS[6], n=20))                   # a retry: the snapshot
        edited = PROMPTS[6][:30] + [1, 2, 3] + PROMPTS[6][33:]
        with caplog.at_level("INFO", logger="ds4py.server"):
            post(srv, completion(edited, n=20))
        m = metrics(srv)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPTS[6]) - 1
    assert m['ds4py_kv_cache_source_total{source="snapshot"}'] == 1
    assert m['ds4py_kv_cache_requests_total{result="hit"}'] == 1
    assert m['ds4py_kv_cache_requests_total{result="cold"}'] == 1
    assert m['ds4py_kv_cache_requests_total{result="miss"}'] == 1
    assert m["ds4py_kv_cache_last_miss_divergence_token"] == 30
    assert "first diverged from session 0's live state" in caplog.text and "at token 30" in caplog.text
    tokens = [m[f'ds4py_session_tokens{{session="{i}"}}'] for i in range(3)]
    assert sorted(tokens)[0] == 0 and max(tokens) == len(PROMPTS[6]) + 19
    assert m["ds4py_kv_cache_resident_bytes"] == sum(m[f'ds4py_session_bytes{{session="{i}"}}'] for i in range(3))
    assert m["ds4py_batch_sequences_count"] > 0 and m["ds4py_running_requests"] == 0


def test_pool_rejects_bad_sizes(model, tok):
    from ds4py.errors import Ds4Error
    with pytest.raises(Ds4Error, match="--sessions"):
        SessionPool(model, tok, 0, CTX)
    with pytest.raises(Ds4Error, match="prefill chunk"):
        SessionPool(model, tok, 2, CTX, prefill_chunk=0)
