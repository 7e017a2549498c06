"""Greedy speculative decoding is byte-identical to plain greedy decoding, for every k.

Two facts make it so, each tested here on the real reference model (v4-tiny-mtp, converted with its MTP block):
- row stability: the k + 1 rows of a verify step are bit for bit the rows of k + 1 one-token decode steps,
  logits and every state part (without it a BLAS gemm and a gemv round differently: see docs/engine.md);
- exact rollback: truncate after a verify leaves exactly the state of the accepted prefix.
The random-weight MTP block accepts almost nothing, so the acceptance paths run with an oracle draft that
proposes plain decoding's own continuation, wrong at chosen positions.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.errors import Ds4Error
from ds4py.model import Numerics
from ds4py.ref.engine import RefModel
from ds4py.ref.mtp import RefMtp
from ds4py.sampling import SamplingParams
from ds4py.session import DoneEvent, Session, TokenEvent
from ds4py.spec import SpecState
from ds4py.mtp_spec import MtpSpec
from spec_fakes import NullTokenizer, OracleDraft


@pytest.fixture(scope="module")
def model(v4_mtp_gguf):
    return RefModel(v4_mtp_gguf[0])


@pytest.fixture(scope="module")
def mtp(model, v4_mtp_gguf):
    return RefMtp(model, v4_mtp_gguf[1])


def _tokens(session, prompt, **kw):
    prm = SamplingParams(**{"temperature": 0.0, "ignore_eos": True, **kw})
    return [e.token_id for e in session.generate(prompt, prm) if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("nx", [Numerics(), Numerics(fake_quant=False), Numerics.ds4()], ids=["qat", "noquant", "ds4"])
def test_verify_rows_are_bit_identical_to_decode_steps(v4_mtp_gguf, nx):
    """A k+1-row step equals k+1 one-row steps bit for bit (logits, every state part), across window and
    compressor group boundaries, with the compressors' fake quantisation, ds4's int8 activations and F16 KV."""
    m = RefModel(v4_mtp_gguf[0], numerics=nx)
    rng = np.random.default_rng(1)
    for P, k in ((1, 16), (14, 3), (29, 8), (63, 16), (127, 5)):     # positions crossing groups of 4 and 128
        ids = rng.integers(0, m.config.vocab_size, P + k + 1)
        a = m.new_state()
        m.step([a], [ids[:P]])
        b = a.copy()
        rows = m.step([a], [ids[P:]], all_logits=True)[0]
        one = np.stack([m.step([b], [[int(t)]])[0] for t in ids[P:]])
        assert np.array_equal(rows, one), f"P={P} k={k}: max |diff| {np.abs(rows - one).max():.2e}"
        for key, arr in a.arrays.items():
            assert np.array_equal(arr, b.arrays[key]), f"P={P} k={k}: state part {key} differs"


def test_verify_rows_stay_bit_identical_across_the_gathered_attention_threshold(model, monkeypatch):
    """The indexer layers attend gathered top-k picks once a query sees more than DENSE_ROWS compressed rows:
    a verify chunk that crosses that threshold takes, row by row, the path each row's own decode step takes."""
    import ds4py.ref.forward as F

    monkeypatch.setattr(F, "DENSE_ROWS", 10)       # ratio 4: rows 43+ see 11+ compressed rows and gather
    rng = np.random.default_rng(3)
    for P, k in ((36, 10), (60, 5)):                # crossing the threshold; past it
        ids = rng.integers(0, model.config.vocab_size, P + k + 1)
        a = model.new_state()
        model.step([a], [ids[:P]])
        b = a.copy()
        rows = model.step([a], [ids[P:]], all_logits=True)[0]
        one = np.stack([model.step([b], [[int(t)]])[0] for t in ids[P:]])
        assert np.array_equal(rows, one), f"P={P} k={k}: max |diff| {np.abs(rows - one).max():.2e}"


def test_batched_decode_rows_are_bit_identical_too(model):
    """Row stability also covers a step of several sequences (batched decode): each row as if alone."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n) for n in (5, 17, 40)]
    states = [model.new_state() for _ in prompts]
    for s, p in zip(states, prompts):
        model.step([s], [p])
    alone = [s.copy() for s in states]
    nxt = [[3], [7, 8], [9]]
    together = model.step(states, nxt, all_logits=True)
    for s, c, got in zip(alone, nxt, together):
        assert np.array_equal(got, model.step([s], [c], all_logits=True)[0])


def test_step_hidden_is_step_plus_the_head_input(model):
    ids = np.arange(5, 30)
    a, b = model.new_state(), model.new_state()
    (lg,), (h,) = model.step_hidden([a], [ids], all_logits=True)
    assert np.array_equal(lg, model.step([b], [ids], all_logits=True)[0])
    assert h.shape == (len(ids), model.config.hc_mult, model.config.dim) and a.n_tokens == b.n_tokens


PROMPTS = [[0, 17, 42, 99, 3], [0] + list(range(60, 90)), [0, 5]]


@pytest.fixture(scope="module")
def plain_runs(model):
    """Plain greedy decoding of each prompt (40 tokens): (tokens, the session's state afterwards)."""
    out = []
    for p in PROMPTS:
        s = Session(model, NullTokenizer(), 1024)
        out.append((_tokens(s, p, max_tokens=40), s.state))
    return out


@pytest.fixture(scope="module")
def plain(plain_runs):
    return [t for t, _ in plain_runs]


@pytest.mark.parametrize("pi", range(len(PROMPTS)))
def test_greedy_with_the_mtp_block_is_byte_identical(model, mtp, plain, pi):
    """The real (random-weight) MTP block and the adaptive scheduler: bootstrap longest block, probes, plain."""
    spec = MtpSpec(model, mtp)
    s = Session(spec, NullTokenizer(), 1024)
    assert _tokens(s, PROMPTS[pi], max_tokens=40) == plain[pi]
    assert spec.stats.rounds >= 1 and spec.stats.drafted >= 1


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 16])
def test_greedy_with_oracle_drafts_is_byte_identical_for_every_k(model, plain, plain_runs, k):
    """Long accepted runs and rejections at chosen positions, for every k: the same tokens as plain decoding,
    and the same session state afterwards (its tokens and the logits of a next step)."""
    for pi, prompt in enumerate(PROMPTS[:2]):
        truth = prompt + plain[pi]
        wrong = {len(prompt) + j for j in (3, 4, 11, 20, 27)}
        spec = MtpSpec(model, OracleDraft(truth, model.config.vocab_size, wrong), fixed_k=k)
        s = Session(spec, NullTokenizer(), 1024)
        assert _tokens(s, prompt, max_tokens=40) == plain[pi], f"prompt {pi}"
        assert spec.stats.accepted > 0 and spec.stats.accepted < spec.stats.drafted
        assert s.tokens == truth[:-1] and s.state.n_tokens == len(truth) - 1
        a, b = plain_runs[pi][1].copy(), s.state.main      # the same state: the same logits, bit for bit
        for t in [truth[-1], 7, 8, 9]:
            assert np.array_equal(model.step([a], [[t]])[0], model.step([b], [[t]])[0])


def test_stopping_inside_a_round_leaves_the_plain_state(model, plain):
    """max_tokens, a stop token and a cancellation landing inside an accepted run: the session keeps exactly
    the emitted tokens (less the last), so the next turn continues as plain decoding would."""
    prompt, cont = PROMPTS[1], plain[1]
    truth = prompt + cont
    for stop_after in (3, 7, 12):
        spec = MtpSpec(model, OracleDraft(truth, model.config.vocab_size), fixed_k=8)
        s = Session(spec, NullTokenizer(), 1024)
        assert _tokens(s, prompt, max_tokens=stop_after) == cont[:stop_after]
        assert s.tokens == truth[:len(prompt) + stop_after - 1] and s.state.n_tokens == len(s.tokens)
        assert _tokens(s, truth[:len(prompt) + stop_after], max_tokens=5) == cont[stop_after:stop_after + 5]
    eos_at = 9
    spec = MtpSpec(model, OracleDraft(truth, model.config.vocab_size), fixed_k=8)
    s = Session(spec, NullTokenizer(eos_id=cont[eos_at]), 1024)
    prm = SamplingParams(temperature=0.0, max_tokens=40)
    evs = list(s.generate(prompt, prm))
    first_eos = cont.index(cont[eos_at])
    assert [e.token_id for e in evs if isinstance(e, TokenEvent)] == cont[:first_eos + 1]
    assert evs[-1].finish_reason == "stop" and s.state.n_tokens == len(prompt) + first_eos
    n = [0]

    def cancel():
        n[0] += 1
        return n[0] > 6
    s = Session(MtpSpec(model, OracleDraft(truth, model.config.vocab_size), fixed_k=8), NullTokenizer(), 1024)
    got = [e for e in s.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40), cancel)]
    toks = [e.token_id for e in got if isinstance(e, TokenEvent)]
    assert isinstance(got[-1], DoneEvent) and got[-1].finish_reason == "cancelled"
    assert toks == cont[:len(toks)] and s.state.n_tokens == len(prompt) + len(toks) - 1


def test_second_turn_reuses_the_speculative_state(model, plain):
    """Prefix reuse (live extension, snapshot restore, truncation) with paired states: a second turn and a
    regenerated answer give plain decoding's tokens."""
    prompt, cont = PROMPTS[1], plain[1]
    spec = MtpSpec(model, OracleDraft(prompt + cont, model.config.vocab_size, {40, 41}), fixed_k=4)
    s, p = Session(spec, NullTokenizer(), 1024), Session(model, NullTokenizer(), 1024)
    turn2 = prompt + cont[:10] + [5, 6, 7]
    for prm in (dict(max_tokens=10), dict(max_tokens=12)):
        assert _tokens(s, prompt, **prm) == _tokens(p, prompt, **prm)
    assert _tokens(s, turn2, max_tokens=8) == _tokens(p, turn2, max_tokens=8)
    assert _tokens(s, prompt, max_tokens=6) == cont[:6]
    assert s.stats.cached_tokens > 0 and (s.stats.snapshots_restored or s.stats.truncations)


def test_spec_state_rollback_keeps_both_states_consistent(model, mtp):
    spec = MtpSpec(model, mtp)
    st = spec.new_state()
    n = spec.capacity + 19                          # a chunk longer than the pending ring
    spec.step([st], [list(range(3, 3 + n))])
    assert isinstance(st, SpecState) and st.n_tokens == n and st.draft.n_tokens == n - 1   # a long chunk: caught up
    for t in (5, 6, 7, 8):
        spec.step([st], [[t]])
    assert st.draft.n_tokens == n - 1               # plain steps: the MTP catches up lazily, rows in the ring
    snap = st.copy()
    st.truncate(n + 1)
    assert st.n_tokens == n + 1 and st.draft.n_tokens == n - 1
    st.truncate(n - 7)
    assert st.draft.n_tokens == n - 8 and st.rollback_floor <= n - 7
    with pytest.raises(Ds4Error, match="earliest"):
        st.truncate(st.rollback_floor - 1)
    with pytest.raises(Ds4Error):
        st.truncate(n - 6)                          # truncate only removes tokens
    assert snap.n_tokens == n + 4 and snap.draft.n_tokens == n - 1 and st.nbytes() > st.main.nbytes()
    with pytest.raises(Ds4Error, match="SpecState"):
        spec.step([model.new_state()], [[1]])


@pytest.mark.parametrize("seed", range(6))
def test_greedy_identity_over_random_prompts_drafts_and_k(model, mtp, seed):
    """Random prompt, random oracle errors, random k (or the scheduler), and the real MTP block: plain tokens."""
    rng = np.random.default_rng(100 + seed)
    prompt = [0] + [int(t) for t in rng.integers(2, 256, int(rng.integers(1, 50)))]
    want = _tokens(Session(model, NullTokenizer(), 1024), prompt, max_tokens=24)
    truth = prompt + want
    wrong = {len(prompt) + int(j) for j in rng.choice(24, int(rng.integers(0, 8)), replace=False)}
    k = [None, 1, 2, 4, 7, 16][seed]
    for draft in (OracleDraft(truth, model.config.vocab_size, wrong), mtp):
        spec = MtpSpec(model, draft, fixed_k=k)
        assert _tokens(Session(spec, NullTokenizer(), 1024), prompt, max_tokens=24) == want
