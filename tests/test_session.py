"""Session: prefix reuse (counted on a fake model whose logits depend on the whole history), stop strings,
EOS, limits, cancellation; then the real numpy reference model on ds4-tiny."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from ds4py.errors import ContextLengthError, Ds4Error
from ds4py.sampling import SamplingParams
from ds4py.session import DoneEvent, Session, TokenEvent
from ds4py.tokenizer import Tokenizer
from spec_fakes import FakeContract

V = 512
GREEDY = dict(temperature=0.0)


@dataclass
class FakeState:
    horizon: int = 16
    history: list[int] = field(default_factory=list)
    n_written: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.history)

    @property
    def rollback_floor(self) -> int:
        return max(0, self.n_written - self.horizon)

    def truncate(self, n: int) -> None:
        assert self.rollback_floor <= n <= self.n_tokens, (n, self.rollback_floor, self.n_tokens)
        del self.history[n:]

    def copy(self) -> "FakeState":
        return FakeState(self.horizon, list(self.history), self.n_written)

    def nbytes(self) -> int:
        return 8 * len(self.history)


class FakeModel(FakeContract):
    """Logits are a pseudo-random function of the entire history, so a wrongly reused or half-restored state
    gives different tokens. `script` forces the tokens that follow a given prefix length (to spell text)."""

    def __init__(self, ctx: int = 4096, horizon: int = 16):
        self.config = SimpleNamespace(vocab_size=V, context_length=ctx)
        self.path, self.backend, self.rollback_horizon = "<fake>", "fake", horizon
        self.steps: list[int] = []                    # rows of every step call
        self.script: list[int] = []
        self.script_start = 0
        self.fail_at_step: int | None = None          # raise KeyboardInterrupt in this step call (1-based)

    def new_state(self) -> FakeState:
        return FakeState(self.rollback_horizon)

    def logits(self, history: list[int]) -> np.ndarray:
        seed = int.from_bytes(hashlib.sha256(np.asarray(history, np.int64).tobytes()).digest()[:8], "little")
        out = np.random.default_rng(seed).normal(size=V).astype(np.float32)
        out[1] = -30.0                                  # EOS only when scripted
        k = len(history) - self.script_start
        if 0 <= k < len(self.script):
            out[self.script[k]] = 50.0
        return out

    def step(self, states, chunks, all_logits=False):
        assert len(states) == len(chunks) == 1 and not all_logits     # the session steps its one state
        self.steps.append(len(chunks[0]))
        if self.fail_at_step is not None and len(self.steps) >= self.fail_at_step:
            raise KeyboardInterrupt
        st = states[0]
        st.history.extend(int(i) for i in chunks[0])
        st.n_written = max(st.n_written, st.n_tokens)
        return [self.logits(st.history)]

    def weight_bytes_per_token(self) -> int:
        return 0


@pytest.fixture(scope="module")
def tok(golden) -> Tokenizer:
    return Tokenizer.from_gguf(golden / "ds4-tiny" / "tiny.gguf")


def run(session, prompt, **kw):
    cancelled = kw.pop("cancelled", None)
    events = list(session.generate(prompt, SamplingParams(**{**GREEDY, **kw}), cancelled))
    toks = [e for e in events if isinstance(e, TokenEvent)]
    done = events[-1]
    assert isinstance(done, DoneEvent) and all(isinstance(e, TokenEvent) for e in events[:-1])
    assert done.completion_tokens == len(toks)
    return [e.token_id for e in toks], "".join(e.text for e in toks), done


def fresh_tokens(tok, prompt, n):
    ids, _, _ = run(Session(FakeModel(), tok), prompt, max_tokens=n)
    return ids


PROMPT = [0, 507, 100, 101, 102, 103, 508, 510]


def test_first_request_prefills_everything(tok):
    m = FakeModel()
    s = Session(m, tok)
    ids, text, done = run(s, PROMPT, max_tokens=5)
    assert (done.finish_reason, done.prompt_tokens, done.cached_tokens, done.completion_tokens) == ("length", 8, 0, 5)
    assert s.stats.prefilled_tokens == 8 and s.stats.decoded_tokens == 4
    assert sum(m.steps) == 8 + 4                     # the last sampled token is never decoded
    assert s.tokens == PROMPT + ids[:-1]
    assert text == tok.decode(ids)


def test_second_turn_prefills_only_the_new_tokens(tok):
    m = FakeModel()
    s = Session(m, tok)
    ids, _, _ = run(s, PROMPT, max_tokens=6)
    turn2 = PROMPT + ids + [1, 507, 200, 201, 508, 510]
    assert s.prompt_cache_tokens(turn2) == len(PROMPT) + 5
    before = s.stats.prefilled_tokens
    ids2, _, done = run(s, turn2, max_tokens=6)
    assert done.cached_tokens == len(PROMPT) + 5
    assert s.stats.prefilled_tokens - before == len(turn2) - done.cached_tokens == 7
    assert ids2 == fresh_tokens(tok, turn2, 6)       # same history -> same logits -> same greedy tokens


def test_thinking_turn_diverging_at_last_prompt_token_restores_snapshot(tok):
    m = FakeModel(horizon=4)                         # the answer is longer than the rollback horizon
    s = Session(m, tok)
    think = PROMPT[:-1] + [509]                      # ... <｜Assistant｜><think>
    ids, _, _ = run(s, think, max_tokens=6)
    # history re-renders the turn as <｜Assistant｜></think>answer: diverges at the last prompt token
    turn2 = PROMPT[:-1] + [510, 300, 301, 1, 507, 200, 508, 509]
    assert s.prompt_cache_tokens(turn2) == len(PROMPT) - 1
    before = s.stats.prefilled_tokens
    ids2, _, done = run(s, turn2, max_tokens=4)
    assert done.cached_tokens == len(PROMPT) - 1 and s.stats.snapshots_restored == 1
    assert s.stats.prefilled_tokens - before == len(turn2) - len(PROMPT) + 1
    assert ids2 == fresh_tokens(tok, turn2, 4)


def test_turn_that_rendered_to_nothing_reuses_a_rolled_back_snapshot(tok):
    """A thinking-only answer (cut at max_tokens) whose reasoning the client drops leaves no assistant
    message: the next prompt merges the user turns and diverges one token before the snapshot point (at the
    old <｜Assistant｜>), far beyond the live state's horizon. A copy of the snapshot rolled back by one token
    serves it instead of a full re-prefill."""
    m = FakeModel(horizon=4)
    s = Session(m, tok)
    think = PROMPT[:-2] + [508, 509]                 # ... user text <｜Assistant｜><think>
    run(s, think, max_tokens=12)                     # a long answer: the live state cannot roll back that far
    retry = PROMPT[:-2] + [271, 200, 201, 508, 509]  # ... user text \n\n more text <｜Assistant｜><think>
    assert s.prompt_cache_tokens(retry) == len(PROMPT) - 2
    before, steps = s.stats.prefilled_tokens, len(m.steps)
    ids, _, done = run(s, retry, max_tokens=4)
    assert done.cached_tokens == len(PROMPT) - 2 and s.stats.snapshots_restored == 1 and s.stats.truncations == 1
    assert s.stats.prefilled_tokens - before == 5 and m.steps[steps] == 4      # only the new tokens
    assert ids == fresh_tokens(tok, retry, 4)
    # the snapshot itself is untouched: the original prompt still reuses all of it
    assert s.prompt_cache_tokens(think) == len(think) - 1


def test_repeated_prompt_reuses_all_but_one_or_all(tok):
    s = Session(FakeModel(), tok)
    a, _, _ = run(s, PROMPT, max_tokens=3)
    b, _, done = run(s, PROMPT, max_tokens=3)
    assert a == b and done.cached_tokens == len(PROMPT) - 1
    # one-token completions leave the live state exactly at the prompt: nothing to prefill at all
    s = Session(FakeModel(), tok)
    run(s, PROMPT, max_tokens=1)
    before = s.stats.prefilled_tokens
    c, _, done = run(s, PROMPT, max_tokens=3)
    assert done.cached_tokens == len(PROMPT) and s.stats.prefilled_tokens == before and c == a


def test_diverging_within_the_rollback_horizon_truncates_the_live_state(tok):
    m = FakeModel(horizon=8)
    s = Session(m, tok)
    ids, _, _ = run(s, PROMPT, max_tokens=4)               # live: PROMPT + 3 answer tokens
    edited = PROMPT + ids[:2] + [300, 301]                 # keeps 2 answer tokens, then differs
    assert s.prompt_cache_tokens(edited) == len(PROMPT) + 2
    steps = len(m.steps)
    got, _, done = run(s, edited, max_tokens=3)
    assert done.cached_tokens == len(PROMPT) + 2 and s.stats.truncations == 1 and s.stats.snapshots_restored == 0
    assert m.steps[steps] == 1 and got == fresh_tokens(tok, edited, 3)   # only the new tokens were stepped
    # regenerating the same prompt: truncate to all but its last token (no snapshot copy needed)
    again, _, done = run(s, edited, max_tokens=3)
    assert again == got and done.cached_tokens == len(edited) - 1 and s.stats.truncations == 2
    # deeper than the live state's horizon (measured from the furthest it reached): a snapshot (here the one
    # before PROMPT's last token, within its own horizon of 3 tokens) or a fresh start
    far = PROMPT[:3] + [400, 401]
    assert s.prompt_cache_tokens(far) == 3 and s.state.rollback_floor > 3
    got, _, done = run(s, far, max_tokens=2)
    assert done.cached_tokens == 3 and s.stats.snapshots_restored == 1 and got == fresh_tokens(tok, far, 2)
    farther = [300, 301, 302]
    assert s.prompt_cache_tokens(farther) == 0
    got, _, done = run(s, farther, max_tokens=2)
    assert done.cached_tokens == 0 and got == fresh_tokens(tok, farther, 2)


def test_snapshots_are_bounded_and_independent(tok):
    s = Session(FakeModel(horizon=0), tok, max_snapshots=2)      # horizon 0: no truncation, only snapshots
    prompts = [[0, 507, 100 + i, 508, 510] for i in range(3)]
    for p in prompts:
        run(s, p, max_tokens=2)
    assert len(s._snapshots) == 2
    assert s.prompt_cache_tokens(prompts[0]) == 0          # its snapshot was evicted (least recently used)
    assert s.prompt_cache_tokens(prompts[2]) == 4
    # a restored snapshot is copied: generating from it must not change the stored one
    snap = s._snapshots[-1]
    stored = list(snap.state.history)
    run(s, prompts[2] + [300, 301], max_tokens=3)
    assert snap.state.history == stored


def test_reset_forgets_everything(tok):
    s = Session(FakeModel(), tok)
    run(s, PROMPT, max_tokens=2)
    s.reset()
    assert s.prompt_cache_tokens(PROMPT) == 0
    _, _, done = run(s, PROMPT, max_tokens=2)
    assert done.cached_tokens == 0


def test_prompt_errors(tok):
    s = Session(FakeModel(ctx=16), tok)
    with pytest.raises(ContextLengthError, match="16"):
        s.generate(list(range(2, 18)), SamplingParams())
    with pytest.raises(Ds4Error, match="empty"):
        s.generate([], SamplingParams())
    with pytest.raises(Ds4Error, match="vocabulary"):
        s.generate([0, 512], SamplingParams())
    with pytest.raises(Ds4Error, match="exceeds"):
        Session(FakeModel(ctx=16), tok, ctx_size=32)


def test_context_full_ends_with_length(tok):
    s = Session(FakeModel(), tok, ctx_size=len(PROMPT) + 3)
    ids, _, done = run(s, PROMPT, max_tokens=100)
    assert done.finish_reason == "length" and len(ids) == 3
    _, _, done = run(s, list(range(2, 2 + len(PROMPT) + 2)))   # exactly one token of room
    assert done.completion_tokens == 1


def scripted(tok, text: str, prompt=PROMPT, eos=False):
    m = FakeModel()
    m.script = tok.encode(text) + ([tok.eos_id] if eos else [])
    m.script_start = len(prompt)
    return m


def test_stop_string_is_cut_and_never_emitted(tok):
    m = scripted(tok, "abc STOP def")
    ids, text, done = run(Session(m, tok), PROMPT, max_tokens=20, stop=["XYZ", "STOP"])
    assert (text, done.finish_reason, done.stop_string) == ("abc ", "stop", "STOP")
    assert tok.decode(ids).endswith("STOP")


def test_stop_prefix_is_held_back_then_released(tok):
    m = scripted(tok, "abc STOP def")
    events = list(Session(m, tok).generate(PROMPT, SamplingParams(max_tokens=20, stop=["STAR"], **GREEDY)))
    texts = [e.text for e in events if isinstance(e, TokenEvent)]
    # 'S', 'T' could start "STAR": held (empty deltas) until 'O' rules it out, then released at once
    i = texts.index("ST" + "O")
    assert texts[i - 2:i] == ["", ""]
    assert "".join(texts).startswith("abc STOP def")
    # a prefix still pending when the limit hits is flushed with the last token
    m = scripted(tok, "abc ST")
    _, text, done = run(Session(m, tok), PROMPT, max_tokens=len(m.script), stop=["STAR"])
    assert text == "abc ST" and done.finish_reason == "length"


def test_eos_stops_and_ignore_eos_continues(tok):
    m = scripted(tok, "abc", eos=True)
    ids, text, done = run(Session(m, tok), PROMPT, max_tokens=20)
    assert ids[-1] == tok.eos_id and text == "abc" and done.finish_reason == "stop" and done.stop_string is None
    m = scripted(tok, "abc", eos=True)
    ids, text, done = run(Session(m, tok), PROMPT, max_tokens=6, ignore_eos=True)
    assert done.finish_reason == "length" and ids[3] == tok.eos_id and text.startswith("abc<｜end▁of▁sentence｜>")


def test_text_deltas_never_split_utf8(tok):
    m = scripted(tok, "héllo 日本")
    events = list(Session(m, tok).generate(PROMPT, SamplingParams(max_tokens=len(m.script), **GREEDY)))
    texts = [e.text for e in events if isinstance(e, TokenEvent)]
    assert "".join(texts) == "héllo 日本"
    assert "\ufffd" not in "".join(texts) and texts[1] == "" and texts[2] == "é"


def test_cancel_stops_before_the_next_decode(tok):
    m = FakeModel()
    s = Session(m, tok)
    got = []
    gen = s.generate(PROMPT, SamplingParams(max_tokens=50, **GREEDY), cancelled=lambda: len(got) >= 3)
    for ev in gen:
        got.append(ev)
    done = got[-1]
    assert done.finish_reason == "cancelled" and done.completion_tokens == 3
    assert s.stats.decoded_tokens == 2 and sum(m.steps) == len(PROMPT) + 2    # none after the client left


def test_generate_is_the_drivers_step_loop(tok, monkeypatch):
    """run / chat go through the one driver (ds4py.driver, the server's too): every model call of
    Session.generate is its runner's step, one sequence each, prefill chunks then one decode row per token."""
    from ds4py import driver

    seen = []
    real = driver.ModelRunner.step

    def step(self, states, chunks):
        seen.append([len(c) for c in chunks])
        return real(self, states, chunks)
    monkeypatch.setattr(driver.ModelRunner, "step", step)
    m = FakeModel()
    ids, _, done = run(Session(m, tok, prefill_chunk=4), PROMPT, max_tokens=3)
    assert seen == [[4], [3], [1], [1], [1]] and len(m.steps) == len(seen)      # chunks end at the snapshot point
    assert ids == fresh_tokens(tok, PROMPT, 3) and done.finish_reason == "length"


def test_cancel_during_prefill_keeps_a_reusable_state(tok):
    m = FakeModel()
    s = Session(m, tok, prefill_chunk=4)
    long_prompt = list(range(2, 40))
    calls = iter(range(100))
    _, _, done = run(s, long_prompt, cancelled=lambda: next(calls) >= 3)
    assert done.finish_reason == "cancelled" and done.completion_tokens == 0
    assert s.tokens == long_prompt[:12]
    ids, _, done = run(s, long_prompt, max_tokens=3)
    assert done.cached_tokens == 12 and ids == fresh_tokens(tok, long_prompt, 3)


def test_interrupted_model_call_drops_the_live_state(tok):
    m = FakeModel()
    s = Session(m, tok)
    m.fail_at_step = 3                                # prompt: 7 + 1 tokens, then the first decode fails
    with pytest.raises(KeyboardInterrupt):
        run(s, PROMPT, max_tokens=5)
    assert s.state is None and s.tokens == []
    m.fail_at_step = None
    ids, _, done = run(s, PROMPT, max_tokens=4)       # snapshot before the last prompt token survives
    assert done.cached_tokens == len(PROMPT) - 1 and ids == fresh_tokens(tok, PROMPT, 4)


def test_live_state_out_of_step_with_its_tokens_is_not_reused(tok):
    # e.g. a KeyboardInterrupt landing between a model call and the session's bookkeeping
    s = Session(FakeModel(), tok)
    run(s, PROMPT, max_tokens=1)
    s.state.history.append(7)
    assert s.prompt_cache_tokens(PROMPT + [9]) == len(PROMPT) - 1      # the snapshot, not the live state
    ids, _, _ = run(s, PROMPT + [9], max_tokens=3)
    assert ids == fresh_tokens(tok, PROMPT + [9], 3)


def test_one_generation_at_a_time(tok):
    s = Session(FakeModel(), tok)
    g = s.generate(PROMPT, SamplingParams(max_tokens=5, **GREEDY))
    next(g)
    with pytest.raises(RuntimeError, match="already generating"):
        next(s.generate(PROMPT, SamplingParams(max_tokens=5)))
    g.close()
    run(s, PROMPT, max_tokens=2)


def test_seeded_sampling_is_reproducible_across_sessions(tok):
    a, _, _ = run(Session(FakeModel(), tok), PROMPT, max_tokens=8, temperature=1.0, seed=3)
    b, _, _ = run(Session(FakeModel(), tok), PROMPT, max_tokens=8, temperature=1.0, seed=3)
    c, _, _ = run(Session(FakeModel(), tok), PROMPT, max_tokens=8, temperature=1.0, seed=4)
    assert a == b and a != c


# ---- the real numpy reference model on ds4-tiny ---------------------------------------------------------


@pytest.fixture(scope="module")
def ref_model(golden):
    engine = pytest.importorskip("ds4py.ref.engine", reason="the reference engine is not in the tree yet")
    return engine.RefModel(str(golden / "ds4-tiny" / "tiny.gguf"))


def test_ref_second_turn_reuses_prefix_with_same_logits(ref_model, tok):
    s = Session(ref_model, tok, ctx_size=4096)
    p1 = [0, 507] + tok.encode("Hello there, how are you?") + [508, 510]
    ids, _, done = run(s, p1, max_tokens=4)
    assert done.cached_tokens == 0
    p2 = p1 + ids + [1, 507] + tok.encode("And now?") + [508, 510]
    before = s.stats.prefilled_tokens
    _, _, done = run(s, p2, max_tokens=1)
    assert done.cached_tokens == len(p1) + 3
    assert s.stats.prefilled_tokens - before == len(p2) - len(p1) - 3
    fresh = ref_model.prefill(ref_model.new_state(), p2)
    np.testing.assert_allclose(s._logits, fresh, atol=2e-3, rtol=1e-3)
    assert int(np.argmax(s._logits)) == int(np.argmax(fresh))


def test_ref_regenerate_truncates_with_the_same_logits(ref_model, tok):
    s = Session(ref_model, tok, ctx_size=4096)
    p = [0, 507] + tok.encode("Tell me a story.") + [508, 510]
    a, _, _ = run(s, p, max_tokens=5)
    logits_a = s._logits                                 # after the 4th answer token
    b, _, done = run(s, p, max_tokens=5)                  # regenerate: truncate to len(p) - 1, step 1 token
    assert done.cached_tokens == len(p) - 1 and s.stats.truncations == 1 and s.stats.snapshots_restored == 0
    assert a == b
    np.testing.assert_array_equal(s._logits, logits_a)     # the same computations: bit for bit


def test_ref_snapshot_restore_is_independent(ref_model, tok):
    s = Session(ref_model, tok, ctx_size=4096)
    base = [0, 507] + tok.encode("Count to three.") + [508]
    run(s, base + [509], max_tokens=3)                       # thinking prompt
    turn2 = base + [510] + tok.encode("one two") + [1, 507] + tok.encode("again") + [508, 509]
    _, _, d1 = run(s, turn2, max_tokens=1)
    logits_a = s._logits.copy()
    _, _, d2 = run(s, turn2, max_tokens=1)                   # same prompt: exact live match
    assert d1.cached_tokens == len(base) and d2.cached_tokens == len(turn2)
    np.testing.assert_array_equal(s._logits, logits_a)
    s.reset()
    _, _, d3 = run(s, turn2, max_tokens=1)
    assert d3.cached_tokens == 0
    np.testing.assert_allclose(s._logits, logits_a, atol=2e-3, rtol=1e-3)
