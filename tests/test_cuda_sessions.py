"""`serve --sessions N` on the CUDA engine (CPU emulator, v4-tiny: ~0.13 s a row; ds4-tiny's IQ2 experts take
~1 s): the scheduler's batched decode steps reach the
multi-row step (several states, one row each; a prompt chunk beside them is stepped on its own and the decode
rows still share one multi-row step), and concurrent greedy answers equal sequential ones byte for byte; with
speculative decoding, the verify rows of several sessions go through one multi-row step and the answers are
still plain decoding's."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.model import open_model
from spec_fakes import NullTokenizer
from test_sessions import completion, concurrently, metrics, post, serving

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")


class IdsTokenizer(NullTokenizer):
    """Each token's text is its id: answers compare token for token (the golden v4-tiny has no vocabulary)."""

    def stream(self):
        return SimpleNamespace(push=lambda t: f"<{t}>", flush=lambda: "")

    def decode(self, ids):
        return "".join(f"<{t}>" for t in ids)


@pytest.fixture(scope="module")
def cuda(v4_mtp_gguf):
    return open_model(v4_mtp_gguf[0], backend="cuda-emu")


@pytest.fixture(scope="module")
def tok():
    return IdsTokenizer()


def wait_queued(srv, n: int, timeout: float = 60) -> None:
    """Until n requests wait for the engine (its /metrics queue depth)."""
    deadline = time.monotonic() + timeout
    while metrics(srv)["ds4py_queue_depth"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests queued after {timeout} s"
        time.sleep(0.01)


def test_concurrent_greedy_answers_on_cuda_equal_sequential_ones(cuda, tok, monkeypatch):
    """Three prompts (3, 13 and 23 tokens; chunks of 16) alone, then together: the same answers. Together, the
    engine's first admission waits until all three are queued, in order, so the steps are the same on every run
    (which requests share a step would otherwise depend on when each arrived): [3, 13] of prompt, two decode
    rows beside the last prompt's chunk of 16 (and of 7), then three decode rows."""
    from ds4py.server import scheduler

    prompts = [np.random.default_rng(30 + i).integers(3, 256, 3 + 10 * i).tolist() for i in range(3)]
    rows: list[tuple[int, int]] = []                 # (states, rows) of every multi-row step
    real, real_plan = cuda._step_rows, cuda.plan
    splits: list[list[int]] = []                     # the chunks of every step planned as several row sets

    def spy(states, chunks, all_logits):
        rows.append((len(states), sum(len(c) for c in chunks)))
        return real(states, chunks, all_logits)

    def plan(chunks):
        out = real_plan(chunks)
        if len(out) > 1 and any(len(idx) > 1 for _, idx in out):
            splits.append([len(c) for c in chunks])
        return out
    cuda._step_rows, cuda.plan = spy, plan
    try:
        with serving(cuda, tok, n=3, prefill_chunk=16) as srv:
            alone = [post(srv, completion(p, n=4)) for p in prompts]
        batched_alone = [r for r in rows if r[0] > 1]
        rows.clear()
        queued, real_admit = threading.Event(), scheduler.Scheduler._admit

        def admit(self):
            queued.wait(120)                         # the engine thread admits nothing before all three wait
            real_admit(self)
        monkeypatch.setattr(scheduler.Scheduler, "_admit", admit)
        together: list = [None] * len(prompts)
        with serving(cuda, tok, n=3, prefill_chunk=16) as srv:
            threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, post(srv, completion(
                prompts[i], n=4)))) for i in range(len(prompts))]
            try:
                for i, t in enumerate(threads):
                    t.start()
                    wait_queued(srv, i + 1)          # the next request arrives after this one, in this order
            finally:
                queued.set()
            for t in threads:
                t.join(300)
    finally:
        del cuda._step_rows, cuda.plan
    for a, b in zip(alone, together):
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert b["usage"]["completion_tokens"] == 4 and a["choices"][0]["text"].count("<") == 4
    assert not batched_alone                         # one request at a time: no step of several states
    assert any(n >= 2 and r == n for n, r in rows), rows      # decode rows of several sessions in one step
    assert any(max(c) > 1 and c.count(1) >= 2 for c in splits), splits   # a prompt chunk beside decode rows


def test_speculative_rounds_of_several_sessions_on_cuda(cuda, tok, monkeypatch):
    from ds4py import driver as runner
    from ds4py.mtp_spec import MtpSpec
    from test_spec_sessions import TableDraft

    prompts = [np.random.default_rng(40 + i).integers(3, 256, 4 + 3 * i).tolist() for i in range(3)]
    with serving(cuda, tok, n=3) as srv:
        plain = [post(srv, completion(p, n=6))["choices"][0]["text"] for p in prompts]
    truths = [p + [int(x) for x in t.strip("<>").split("><")] for p, t in zip(prompts, plain)]
    seen: list[list[int]] = []
    real = runner.ModelRunner.verify
    monkeypatch.setattr(runner.ModelRunner, "verify",
                        lambda self, st, ch: seen.append([len(c) for c in ch]) or real(self, st, ch))
    spec = MtpSpec(cuda, TableDraft(truths, cuda.config.vocab_size, {len(prompts[1]) + 2}), fixed_k=3)
    with serving(spec, tok, n=3) as srv:
        got = concurrently(lambda p: post(srv, completion(p, n=6)), prompts)
    assert [g["choices"][0]["text"] for g in got] == plain
    assert any(len(v) >= 2 and sum(v) <= 16 for v in seen), seen      # one multi-row verify of several sessions
    assert spec.stats.accepted > 0


def test_a_request_decoding_alone_decodes_on_the_device(cuda, tok):
    """The scheduler (one driver, whatever --sessions is) runs a request that decodes alone as the backend's
    device-side generation (4 bytes read back per token): with one session, and a greedy request alone among
    several; its tokens are those of greedy host steps."""
    prompt = np.random.default_rng(50).integers(3, 256, 7).tolist()
    st = cuda.new_state()
    lg, want = cuda.step([st], [prompt])[0], []
    for _ in range(5):
        want.append(int(np.argmax(lg)))
        lg = cuda.step([st], [[want[-1]]])[0]
    calls: list[int] = []
    real = cuda.generate
    cuda.generate = lambda state, token, params, n: calls.append(n) or real(state, token, params, n)
    try:
        for n in (1, 3):
            with serving(cuda, tok, n=n) as srv:
                got = post(srv, completion(prompt, n=5))
            assert got["choices"][0]["text"] == "".join(f"<{t}>" for t in want)
    finally:
        del cuda.generate
    assert calls == [4, 4]                      # the first token comes from the prompt's logits, 4 from the device
