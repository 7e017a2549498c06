"""Speculative decoding inside `serve --sessions N` batches (ds4py/server/scheduler.py): each generating request
drafts on its own, the drafts of several sessions are verified in one main step, each round is accepted and
rolled back on its own. Greedy answers equal plain sequential decoding's byte for byte, with the real MTP block
(v4-tiny-mtp, random weights: drafts rejected) and with oracle drafts (long accepted runs, rejections at chosen
positions, answers that end inside a round); several sessions' rows share verify steps."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ds4py.model import open_model, open_mtp
from ds4py import driver as runner
from ds4py.mtp_spec import MtpSpec
from spec_fakes import NullTokenizer, OracleDraft
from test_sessions import completion, concurrently, metrics, post, serving


class IdsTokenizer(NullTokenizer):
    """Each token's text is its id (the golden v4-tiny has no vocabulary)."""

    def stream(self):
        return SimpleNamespace(push=lambda t: f"<{t}>", flush=lambda: "")

    def decode(self, ids):
        return "".join(f"<{t}>" for t in ids)


class TableDraft(OracleDraft):
    """An oracle over several sequences: at position j after token t it proposes what some truth continues
    (j, t) with (wrong at the positions in `wrong`)."""

    def __init__(self, truths, vocab, wrong=frozenset()):
        super().__init__([], vocab, wrong)
        self.table = {(j, t[j + 1]): t[j + 2] for t in truths for j in range(len(t) - 2)}

    def propose(self, pos: int, token: int) -> int:
        return self.table.get((pos, token), 0)


PROMPTS = [np.random.default_rng(70 + i).integers(3, 256, 5 + 6 * i).tolist() for i in range(4)]
N = 12


@pytest.fixture(scope="module")
def model(v4_mtp_gguf):
    return open_model(v4_mtp_gguf[0])


@pytest.fixture(scope="module")
def plain(model):
    """Plain greedy answers, one request at a time: (text, token ids)."""
    with serving(model, IdsTokenizer(), n=4) as srv:
        out = [post(srv, completion(p, n=N))["choices"][0]["text"] for p in PROMPTS]
    return [(t, [int(x) for x in t.strip("<>").split("><")]) for t in out]


def record_verifies(monkeypatch) -> list[list[int]]:
    """Each ModelRunner.verify call's row counts per session, appended to the returned list as the calls come."""
    seen: list[list[int]] = []
    real = runner.ModelRunner.verify

    def verify(self, states, chunks):
        seen.append([len(c) for c in chunks])
        return real(self, states, chunks)
    monkeypatch.setattr(runner.ModelRunner, "verify", verify)
    return seen


@pytest.fixture
def verifies(monkeypatch):
    return record_verifies(monkeypatch)


def _stop_runs(model, plain, concurrent: bool):
    """Each prompt with a stop string that ends its answer early (its 7th token's text), then a follow-up
    turn of prompt 0 on the same server: (answers, the follow-up's cached prompt tokens)."""
    bodies = [completion(p, n=N, stop=[f"<{t[6]}>"]) for p, (_, t) in zip(PROMPTS, plain)]
    with serving(model, IdsTokenizer(), n=4) as srv:
        got = concurrently(lambda b: post(srv, b), bodies) if concurrent else [post(srv, b) for b in bodies]
        first = PROMPTS[0] + plain[0][1]
        follow = post(srv, completion(first + [7], n=2))
    return ([(g["choices"][0]["text"], g["choices"][0]["finish_reason"], g["usage"]["completion_tokens"])
             for g in got], follow["usage"]["prompt_tokens_details"]["cached_tokens"], follow["choices"][0]["text"])


def test_oracle_rounds_of_several_sessions_equal_plain_answers(model, plain, verifies):
    truths = [p + t for p, (_, t) in zip(PROMPTS, plain)]
    wrong = {len(PROMPTS[0]) + 3, len(PROMPTS[2]) + 6, 20}
    spec = MtpSpec(model, TableDraft(truths, model.config.vocab_size, wrong), fixed_k=4)
    with serving(spec, IdsTokenizer(), n=4) as srv:
        got = concurrently(lambda p: post(srv, completion(p, n=N)), PROMPTS)
        m = metrics(srv)
    assert [g["choices"][0]["text"] for g in got] == [t for t, _ in plain]
    assert all(g["usage"]["completion_tokens"] == N for g in got)
    assert any(len(v) >= 2 for v in verifies), verifies                  # several sessions, one verify step
    assert 0 < m["ds4py_spec_accepted_tokens_total"] < m["ds4py_spec_draft_tokens_total"]
    # answers that end inside a round (a stop string): the same text, and the tokens sampled past the stop are
    # un-fed (a follow-up turn finds exactly what plain decoding left in the session)
    want = _stop_runs(model, plain, concurrent=False)
    assert _stop_runs(MtpSpec(model, TableDraft(truths, model.config.vocab_size), fixed_k=8), plain, True) == want
    assert all(f == "stop" for _, f, _ in want[0])


def test_real_mtp_block_in_sessions_equals_plain_answers(model, plain, v4_mtp_gguf, verifies):
    spec = MtpSpec(model, open_mtp(model, v4_mtp_gguf[1]))          # the scheduler chooses k per request
    with serving(spec, IdsTokenizer(), n=4) as srv:
        got = concurrently(lambda p: post(srv, completion(p, n=N)), PROMPTS)
        again = post(srv, completion(PROMPTS[1], n=N))                 # a repeat: prefix reuse of a paired state
    assert [g["choices"][0]["text"] for g in got] == [t for t, _ in plain]
    assert again["choices"][0]["text"] == plain[1][0]
    assert spec.stats.drafted > 0 and verifies
