"""`serve --sessions N` on the CUDA engine (CPU emulator, v4-tiny: ~0.13 s a row; ds4-tiny's IQ2 experts are ~1 s): the scheduler's batched decode steps reach the
multi-row step (several states, one row each; a prompt chunk beside them is stepped on its own and the decode
rows still share one multi-row step), and concurrent greedy answers equal sequential ones byte for byte."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.model import open_model
from spec_fakes import NullTokenizer
from test_sessions import completion, concurrently, post, serving

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


def test_concurrent_greedy_answers_on_cuda_equal_sequential_ones(cuda, tok):
    prompts = [np.random.default_rng(30 + i).integers(3, 256, 3 + 9 * i).tolist() for i in range(4)]
    rows: list[tuple[int, int]] = []                 # (states, rows) of every multi-row step
    real, real_split = cuda._step_rows, cuda._step_split
    splits: list[list[int]] = []

    def spy(states, chunks, all_logits):
        rows.append((len(states), sum(len(c) for c in chunks)))
        return real(states, chunks, all_logits)
    cuda._step_rows = spy
    cuda._step_split = lambda st, ch, al: splits.append([len(c) for c in ch]) or real_split(st, ch, al)
    try:
        with serving(cuda, tok, n=4, prefill_chunk=16) as srv:
            alone = [post(srv, completion(p, n=5)) for p in prompts]
        batched_alone = [r for r in rows if r[0] > 1]
        rows.clear()
        with serving(cuda, tok, n=4, prefill_chunk=16) as srv:
            together = concurrently(lambda p: post(srv, completion(p, n=5)), prompts)
    finally:
        del cuda._step_rows, cuda._step_split
    for a, b in zip(alone, together):
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert b["usage"]["completion_tokens"] == 5 and a["choices"][0]["text"].count("<") == 5
    assert not batched_alone                         # one request at a time: no step of several states
    assert any(n >= 3 and r == n for n, r in rows), rows      # decode rows of several sessions in one step
    assert any(max(c) > 1 and c.count(1) >= 2 for c in splits), splits   # a prompt chunk beside decode rows
