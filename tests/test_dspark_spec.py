"""Speculative decoding with V4.1's DSpark draft (ds4py/dspark.py) on the reference backend, golden
v41-tiny-dspark (DeepSeek's official weights layout, random values: the real draft accepts at chance level).

- greedy is byte-identical to plain greedy decoding for every k and for the scheduler, short and long prompts;
- an oracle draft (the true continuation, wrong at chosen positions) is accepted as far as it is right, the
  rings afterwards are bit for bit the rings of plain decoding (one write per accepted position), and stopping
  inside a round leaves the plain state;
- the real (garbage) draft drives k to 0: main-model rows per generated token within 1.05x plain decoding's;
- the pair (main state + rings) saves and loads; rejection sampling keeps the plain distribution.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ds4py.dspark import DSparkSpec
from ds4py.spec import SpecState
from ds4py.errors import Ds4Error
from ds4py.ref.dspark import DraftBlock
from ds4py.ref.engine import RefModel
from ds4py.sampling import Sampler, SamplingParams
from ds4py.session import Session, TokenEvent
from ds4py.drafts import speculative
from ds4py.spec import ByteCosts
from spec_fakes import CounterState, MarkovModel, NullTokenizer, assert_seeded_runs_reproduce, chi_square_p

PROMPTS = [[7, 301, 12], list(range(40, 80))]       # short, and longer than the 16-row window
N = 24


@pytest.fixture(scope="module")
def model(dspark_gguf):
    m = RefModel(dspark_gguf)
    m.rows = 0
    step, taps = m._step, m._step_taps

    def count(fn):
        def run(states, chunks, all_logits):
            m.rows += sum(len(c) for c in chunks)
            return fn(states, chunks, all_logits)
        return run
    m._step, m._step_taps = count(step), count(taps)       # main-model rows, whichever entry point
    return m


def _tokens(session, prompt, n=N, **kw):
    prm = SamplingParams(**{"temperature": 0.0, "ignore_eos": True, "max_tokens": n, **kw})
    return [e.token_id for e in session.generate(prompt, prm) if isinstance(e, TokenEvent)]


@pytest.fixture(scope="module")
def plain(model):
    return [_tokens(Session(model, NullTokenizer(), 256), p) for p in PROMPTS]


class OracleDSpark:
    """The real draft's rings, but a block that proposes `truth` (confidence +8), wrong where asked."""

    def __init__(self, draft, truth, wrong=()):
        self.d, self.truth, self.wrong = draft, truth, set(wrong)
        self.block_size, self.fingerprint = draft.block_size, draft.fingerprint

    def __getattr__(self, name):          # new_state, feed, save_state, load_state, call_bytes: the real ones
        return getattr(self.d, name)

    def block(self, state, token):
        blk = self.d.block(state, token)
        n, V, Bn = state.n_tokens, blk.base.shape[1], blk.size
        base = np.full((Bn, V), -30.0, np.float32)
        for i in range(Bn):
            p = n + 1 + i                      # block position i predicts the token at n + 1 + i
            if p < len(self.truth):
                base[i, (self.truth[p] + (p in self.wrong)) % V] = 30.0
        return DraftBlock(base, blk.hidden, blk.embed, np.zeros_like(blk.head), np.zeros_like(blk.confidence_w))


def test_speculative_picks_the_dspark_draft_by_default(model):
    spec = speculative(model)
    assert isinstance(spec, DSparkSpec) and spec.k_max == 5
    assert speculative(model, enabled=False) is model
    with pytest.raises(Ds4Error, match="drop --mtp"):
        speculative(model, "x.mtp.gguf")


@pytest.mark.parametrize("k", [None, 0, 1, 2, 5])
def test_greedy_is_byte_identical_for_every_k(model, plain, k):
    for pi, prompt in enumerate(PROMPTS):
        spec = DSparkSpec(model, model.open_dspark(), fixed_k=k)
        assert _tokens(Session(spec, NullTokenizer(), 256), prompt) == plain[pi], f"prompt {pi}, k {k}"
        if k:
            st = spec.stats                    # (the last rounds draft fewer: the answer's end)
            assert k * (st.rounds - 2) <= st.drafted <= k * st.rounds and st.rounds > 0


@pytest.mark.parametrize("k", [2, 5])
def test_oracle_drafts_are_accepted_and_the_rings_stay_plain(model, plain, k):
    prompt = PROMPTS[1]
    truth = prompt + plain[1]
    wrong = {len(prompt) + j for j in (4, 11, 17)}
    spec = DSparkSpec(model, OracleDSpark(model.open_dspark(), truth, wrong), fixed_k=k)
    s = Session(spec, NullTokenizer(), 256)
    assert _tokens(s, prompt) == plain[1]
    st = spec.stats
    assert 0 < st.accepted < st.drafted and st.tokens_per_round > 1.5
    ref = DSparkSpec(model, model.open_dspark(), fixed_k=0)
    r = Session(ref, NullTokenizer(), 256)
    _tokens(r, prompt)
    a, b = s.state, r.state
    assert a.n_tokens == b.n_tokens == a.draft.n_tokens == len(truth) - 1
    for key in a.draft.arrays:         # the rings hold exactly the main positions, written once each
        W = a.draft.arrays[key].shape[0]
        kept = np.arange(a.n_tokens - W + 4, a.n_tokens) % W
        assert np.array_equal(a.draft.arrays[key][kept], b.draft.arrays[key][kept]), key
    d = spec.draft
    assert np.array_equal(d.d.block(a.draft, 5).base, d.d.block(b.draft, 5).base)


def test_an_oracle_is_accepted_fully_and_stops_inside_a_round(model, plain):
    prompt, cont = PROMPTS[0], plain[0]
    truth = prompt + cont
    spec = DSparkSpec(model, OracleDSpark(model.open_dspark(), truth), fixed_k=5)
    s = Session(spec, NullTokenizer(), 256)
    assert _tokens(s, prompt, n=20) == cont[:20]
    assert spec.stats.accepted == spec.stats.drafted and spec.stats.tokens_per_round > 5
    assert s.state.n_tokens == s.state.draft.n_tokens == len(prompt) + 19
    # the second turn continues as plain decoding would (the state is the plain one)
    assert _tokens(s, truth[:len(prompt) + 20], n=4) == cont[20:24]


def test_the_real_draft_drives_k_to_zero(model):
    """Random weights: the draft never hits; the scheduler calibrates its confidence to zero after the first call:
    main-model rows per generated token within 1.05x of plain decoding's (counted)."""
    n = 160
    spec = speculative(model)
    s = Session(spec, NullTokenizer(), 256)
    model.rows = 0
    toks = _tokens(s, PROMPTS[0], n=n)
    spec_rows = model.rows - len(PROMPTS[0])
    plain_rows = n - 1                   # plain decoding feeds every generated token but the last
    assert len(toks) == n and spec_rows <= 1.05 * plain_rows, (spec_rows, spec.stats.summary())
    assert spec.stats.accepted == 0 and spec.stats.draft_steps >= 1


def test_a_block_position_costs_no_draft_call(model):
    """DSpark's costs under the one scheduler: a draft call reads the draft, a further block position nothing (its
    block holds every position), unlike an MTP chained step; a plain step reads the backbone."""
    c = DSparkSpec(model, model.open_dspark()).byte_costs()
    assert c.draft(False) == 0 < c.draft(True) and c.plain() == model.weight_bytes_per_token()


def test_the_pair_saves_and_loads(model):
    spec = DSparkSpec(model, model.open_dspark(), fixed_k=3)
    s = Session(spec, NullTokenizer(), 256)
    _tokens(s, PROMPTS[1], n=6)
    st = s.state
    blob = spec.save_state(st)
    back = spec.load_state(blob)
    assert isinstance(back, SpecState) and back.n_tokens == st.n_tokens == back.draft.n_tokens
    a, b = st.copy(), back
    assert np.array_equal(spec.step([a], [[9]])[0], spec.step([b], [[9]])[0])
    d = spec.draft
    assert np.array_equal(d.block(a.draft, 4).base, d.block(b.draft, 4).base)
    with pytest.raises(Ds4Error, match="main model alone"):
        spec.load_state(model.save_state(st.main))
    with pytest.raises(Ds4Error, match="corrupt"):
        spec.load_state(blob[:-5] + bytes([blob[-5] ^ 1]) + blob[-4:])
    with pytest.raises(Ds4Error, match="earliest"):
        st.truncate(st.rollback_floor - 1)
    st.truncate(st.n_tokens - 2)
    assert st.draft.n_tokens == st.main.n_tokens


class TapMarkov(MarkovModel):
    """spec_fakes' Markov target with draft taps (position, token) per row, as a V4.1 model gives step_taps."""

    def step_taps(self, states, chunks, all_logits=False):
        logits, hidden = self.step_hidden(states, chunks, all_logits)
        return logits, [h[:, 0, :] for h in hidden]


class MarkovDSpark:
    """A DSpark-shaped draft over TapMarkov: its ring only counts positions (checking it is fed each main position
    once, in order); block position i after main position n − 1 predicts the token at n + 1 + i from out_i with a
    distorted copy of the target's table."""

    def __init__(self, target, distortion: float, seed: int, block: int = 3):
        rng = np.random.default_rng(seed)
        self.table = target.table + rng.normal(0, distortion, target.table.shape).astype(np.float32)
        self.block_size, self.fingerprint, self.horizon = block, "markov-dspark", target.rollback_horizon

    def new_state(self):
        return CounterState(self.horizon)

    def feed(self, states, taps):
        for st, t in zip(states, taps):
            assert np.array_equal(t[:, 0], np.arange(st.n_tokens, st.n_tokens + len(t))), "a ring write per position"
            st.begin_step(len(t))
            st.end_step(len(t))

    def block(self, state, token):
        n, table = state.n_tokens, self.table
        return SimpleNamespace(size=self.block_size,
                               position=lambda i, prev: (table[(n + i) % table.shape[0], int(prev)], 2.0))


@pytest.mark.parametrize("k,params", [(2, dict(temperature=1.0)), (3, dict(temperature=0.7, top_k=3)),
                                      (None, dict(temperature=1.3, top_p=0.8, min_p=0.05))],
                         ids=["k2", "k3-topk", "sched-topp-minp"])
def test_sampled_rounds_give_the_plain_sequence_distribution(k, params):
    """Whole 3-token sequences through the session with DSpark rounds (drafts drawn from the draft's own
    distribution under the request's temperature and truncation, the Markov chain of its block): their
    frequencies match the exact plain-sampling distribution (64 sequences, chi-square)."""
    target = TapMarkov(vocab=4, period=3, seed=k or 7)
    spec = DSparkSpec(target, MarkovDSpark(target, 0.8, seed=11), fixed_k=k)
    spec.byte_costs = lambda: ByteCosts(main_bytes=1000, routed_bytes=100, draft_bytes=100, head_bytes=100)
    session = Session(spec, NullTokenizer(), ctx_size=512)
    prompt, L, N = [2, 0, 3], 3, 2500
    counts: dict[tuple, int] = {}
    for run in range(N):
        prm = SamplingParams(**params, seed=run, max_tokens=L, ignore_eos=True)
        seq = tuple(e.token_id for e in session.generate(prompt, prm) if isinstance(e, TokenEvent))
        counts[seq] = counts.get(seq, 0) + 1
    assert spec.stats.rounds > N // 2 and 0 < spec.stats.accepted < spec.stats.drafted
    exact = target.sequence_distribution(Sampler(SamplingParams(**params)), prompt, L)
    keys = sorted(exact)
    obs = np.array([counts.get(s, 0) for s in keys], float)
    assert chi_square_p(obs, N * np.array([exact[s] for s in keys])) > 1e-3


def test_the_disk_cache_keeps_the_pair(model, plain, tmp_path):
    """--kv-disk-dir with DSpark: the paired state's checkpoints (cold, shutdown) load into a new session and
    continue as plain decoding; the main model alone does not see them (another fingerprint)."""
    from ds4py.disk_cache import DiskCache, KVCachePolicy

    policy = KVCachePolicy(min_tokens=16, trim_tokens=4, align_tokens=16, continued_interval=32)

    def disk(m):
        return DiskCache(tmp_path, 64.0, m, policy=policy, asynchronous=False)
    prompt = PROMPTS[1]
    s = Session(speculative(model), NullTokenizer(), 256, disk=disk(speculative(model)))
    assert _tokens(s, prompt) == plain[1]
    assert [e.reason for e in s.disk.entries()] == ["cold"]
    s.close()
    again = Session(speculative(model), NullTokenizer(), 256, disk=disk(speculative(model)))
    follow = prompt + plain[1][:-1] + [7, 8]
    want = _tokens(Session(model, NullTokenizer(), 256), follow, n=6)
    assert _tokens(again, follow, n=6) == want
    assert again.last_source == "disk" and again.last_cached == len(prompt) + len(plain[1]) - 1
    assert disk(model).best(prompt) is None


class TableDSpark(OracleDSpark):
    """An oracle over several sequences (serve --sessions N): after token prev at position p it proposes what some
    truth continues (p, prev) with."""

    def __init__(self, draft, truths):
        super().__init__(draft, [])
        self.table = {(j, t[j]): t[j + 1] for t in truths for j in range(len(t) - 1)}

    def block(self, state, token):
        n, V, table = state.n_tokens, self.d.main_config.vocab_size, self.table

        def position(i, prev):
            lg = np.full(V, -30.0, np.float32)
            lg[table.get((n + i, int(prev)), 0)] = 30.0
            return lg, 8.0
        return SimpleNamespace(size=self.block_size, position=position)


def test_rounds_of_several_sessions_equal_plain_answers(model, monkeypatch):
    """serve --sessions 3: each request's draft call, one verify step for several sessions' rows, greedy answers
    equal to plain sequential ones (oracle drafts: long accepted runs; the real draft: rejections)."""
    from contextlib import contextmanager

    from ds4py.server.pool import SessionPool
    from ds4py.server.worker import Engine
    from test_sessions import BackgroundServer, ServerConfig, ServerState, completion, concurrently, post
    from test_spec_sessions import IdsTokenizer, record_verifies

    @contextmanager
    def serving(m):
        state = ServerState(ServerConfig(max_queue=16))
        state.set_engine(Engine(SessionPool(m, IdsTokenizer(), 3, 256), IdsTokenizer()))
        with BackgroundServer(state) as srv:
            yield srv
    seen = record_verifies(monkeypatch)
    prompts = [[5 + i, 40 + 3 * i, 7, 200 - i] for i in range(3)]
    with serving(model) as srv:
        plain = [post(srv, completion(p, n=10))["choices"][0]["text"] for p in prompts]
    ids = [[int(x) for x in t.strip("<>").split("><")] for t in plain]
    oracle = TableDSpark(model.open_dspark(), [p + t for p, t in zip(prompts, ids)])
    for draft in (oracle, model.open_dspark()):
        spec = DSparkSpec(model, draft, fixed_k=3)
        with serving(spec) as srv:
            got = concurrently(lambda p: post(srv, completion(p, n=10)), prompts)
        assert [g["choices"][0]["text"] for g in got] == plain
        assert spec.stats.rounds > 0 and (spec.stats.accepted > 0) == (draft is oracle)
    assert any(len(v) >= 2 for v in seen), seen


def test_seeded_sampled_requests_reproduce():
    """A seeded sampled request's schedule uses the files' bytes, not the clock: the same seed gives the same
    tokens in a fresh session and after other requests, another seed other tokens."""
    target = TapMarkov(vocab=8, period=5, seed=3)
    spec = DSparkSpec(target, MarkovDSpark(target, 0.5, seed=4, block=4))
    spec.byte_costs = lambda: ByteCosts(main_bytes=1000, routed_bytes=100, draft_bytes=150, head_bytes=150)
    assert_seeded_runs_reproduce(spec)
    assert spec.stats.rounds > 0 and spec.stats.accepted > 0
