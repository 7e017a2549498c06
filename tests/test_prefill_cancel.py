"""Cancellation reaches inside a long prefill: the server's PrefillPacer sizes prefill chunks to about a quarter
second, and the session checks for a gone client between chunks (a disconnect used to keep the engine busy for
the rest of a 2048-token chunk)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ds4py.server.app import BackgroundServer, ServerConfig, ServerState
from ds4py.server.worker import Engine, PrefillPacer
from ds4py.session import Session
from ds4py.tokenizer import Tokenizer
from spec_fakes import FakeContract


class _State:
    def __init__(self, n=0):
        self.n_tokens = self.n_written = n
        self.rollback_floor = n                     # no rollback: the session falls back to its snapshots

    def truncate(self, n):
        raise AssertionError("not reachable: rollback_floor is n_tokens")

    def copy(self):
        return _State(self.n_tokens)

    def nbytes(self):
        return 8


class SlowModel(FakeContract):
    """A model whose prompt steps cost `per_token` seconds per token and cannot be interrupted inside a call."""
    backend, path = "fake", "slow"

    def __init__(self, vocab: int, per_token: float, ctx: int = 16384):
        self.config = SimpleNamespace(vocab_size=vocab, context_length=ctx)
        self.per_token, self.calls = per_token, []

    def new_state(self):
        return _State()

    def step(self, states, chunks, all_logits=False):
        (state,), (ids,) = states, chunks
        if len(ids) > 1:
            self.calls.append(len(ids))
            time.sleep(self.per_token * len(ids))
        state.n_tokens += len(ids)
        state.n_written = state.rollback_floor = state.n_tokens
        return [np.zeros(self.config.vocab_size, np.float32)]

    def weight_bytes_per_token(self):
        return 0


@pytest.fixture(scope="module")
def tok(golden):
    return Tokenizer.from_gguf(str(golden / "ds4-tiny" / "tiny.gguf"))


@contextlib.contextmanager
def _prefilling(tok, tokens: int, chunk):
    """A server whose engine (SlowModel, 1 ms a token; prefill chunks `chunk`) has started the prefill of a
    completion of `tokens` tokens: yields (the model, the server state, the client's socket)."""
    model = SlowModel(tok.vocab_size, per_token=0.001)
    state = ServerState(ServerConfig())
    state.set_engine(Engine(Session(model, tok, ctx_size=16384, prefill_chunk=chunk), tok))
    with BackgroundServer(state) as srv:
        body = json.dumps({"prompt": [5] * tokens, "max_tokens": 2}).encode()
        s = socket.create_connection((srv.host, srv.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        t0 = time.monotonic()
        while not model.calls:
            assert time.monotonic() - t0 < 10
            time.sleep(0.01)
        yield model, state, s


def _busy_after_disconnect(tok, chunk) -> tuple[float, list[int]]:
    """Seconds the engine stays busy after a client disconnects 0.3 s into the prefill of 6000 tokens."""
    with _prefilling(tok, 6000, chunk) as (model, state, s):
        time.sleep(0.3)
        s.close()
        t_gone = time.monotonic()
        while state.metrics.running:
            assert time.monotonic() - t_gone < 20
            time.sleep(0.01)
        busy = time.monotonic() - t_gone
        assert state.metrics.cancelled == 1
    return busy, model.calls


def test_disconnect_during_prefill_frees_the_engine_quickly(tok):
    busy, calls = _busy_after_disconnect(tok, PrefillPacer(seconds=0.1))
    assert busy < 0.6, f"the engine stayed busy {busy:.2f} s after the client left (chunks {calls})"
    assert sum(calls) < 3000                               # most of the 6000 tokens were never prefilled
    # negative control: one fixed chunk of 2048 tokens (2 s here) runs to its end
    busy, calls = _busy_after_disconnect(tok, 2048)
    assert busy > 1.0 and calls[0] == 2048


def test_pacer_sizes_chunks_from_the_measured_speed():
    def run(a, b, target=0.25, steps=12):
        p = PrefillPacer(seconds=target)
        for _ in range(steps):
            n = p.next_len()
            p.record(n, a + b * n)
        return p.next_len()
    assert 240 <= run(0.0, 0.001) <= 260                   # per-token cost only: 0.25 s of tokens
    assert 190 <= run(0.05, 0.001) <= 210                  # a fixed 50 ms per call: (0.25 - 0.05) / b
    assert run(2.0, 0.001) == 2000                         # the call itself costs 2 s: no chunk under a / b
    assert run(0.0, 1.0) == 16                             # very slow tokens: the minimum
    assert run(0.0, 1e-7) == 2048                          # very fast: the maximum
    p = PrefillPacer(seconds=0.25)
    p.record(64, 1e-9)                                     # one suspiciously fast chunk: at most doubles
    assert p.next_len() == 128
    with pytest.raises(ValueError):
        PrefillPacer(seconds=0)


def test_serve_prefills_in_paced_chunks(golden):
    from ds4py.cli.serve import make_engine
    from ds4py.server.toolmemory import ToolMemory

    engine = make_engine(str(golden / "ds4-tiny" / "tiny.gguf"), "ref", 256, ToolMemory())
    assert isinstance(engine.session.prefill_chunk, PrefillPacer)


def test_shutdown_during_prefill_stops_the_engine_and_tells_the_client(tok):
    """SIGTERM's path (run_server: state.close() first): the running prefill is cancelled at its next chunk, the
    engine thread ends within a second, and the waiting client gets a 503 saying the server is shutting down."""
    with _prefilling(tok, 12000, PrefillPacer(seconds=0.1)) as (model, state, s):
        time.sleep(0.2)
        t_stop = time.monotonic()
        state.close()
        assert state.worker.join(5.0), "the engine thread kept running after close()"
        stopped = time.monotonic() - t_stop
        reply = s.recv(65536).decode()
        s.close()
    assert stopped < 1.0 and sum(model.calls) < 6000, (stopped, model.calls)
    assert reply.startswith("HTTP/1.1 503") and "shutting down" in reply
