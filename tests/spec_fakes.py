"""Test doubles for speculative decoding: a tiny-vocabulary target model whose next-token logits depend on the
position and the last token (so its exact sequence distribution can be enumerated), a draft block that
disagrees with it in a known way, and an oracle draft that proposes a given continuation.

They implement only what ds4py.spec uses of a model (step_hidden, new_state, states with n_tokens / n_written /
truncate / copy) and of an MTP block (new_state, step)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np

from ds4py.errors import Ds4Error
from ds4py.kv import StateLayout, StateCounters
from ds4py.model import Capabilities, WeightBytes
from ds4py.sampling import SamplingParams
from ds4py.session import Session, TokenEvent


class FakeContract:
    """The declared parts of ds4py.model.Model a fake does not otherwise need (no capabilities, no speculation
    driver, no file): what the session, the server and SpecModel read."""
    capabilities = Capabilities()
    stable_rows = 1
    gguf = stack = None
    startup: dict = {}

    def new_request(self, params, suppress=()):
        return None


class CounterState(StateCounters):
    """A state that only counts (the fakes' logits need no KV: they read positions and ids)."""

    def __init__(self, horizon: int):
        super().__init__(StateLayout(horizon, ()))

    def copy(self) -> "CounterState":
        out = CounterState(self.layout.horizon)
        out.n_tokens, out.n_written = self.n_tokens, self.n_written
        return out

    def nbytes(self) -> int:
        return 16


class MarkovModel(FakeContract):
    """Target: the logits after token t at position p are table[p % period, t]. hidden row = (position, token)."""

    backend = "fake"
    capabilities = Capabilities(speculation=True)

    def __init__(self, vocab: int = 4, period: int = 3, seed: int = 0, horizon: int = 16, ctx: int = 512):
        self.table = np.random.default_rng(seed).normal(0, 1.2, (period, vocab, vocab)).astype(np.float32)
        self.config = SimpleNamespace(vocab_size=vocab, context_length=ctx, hc_mult=1, dim=2)
        self.rollback_horizon, self.stable_rows = horizon, horizon + 1
        self.path, self.fingerprint, self.numerics, self.layout = "<markov>", "0", None, StateLayout(horizon, ())
        self.rows_stepped: list[int] = []

    def new_state(self) -> CounterState:
        return CounterState(self.rollback_horizon)

    def row_logits(self, pos: int, token: int) -> np.ndarray:
        return self.table[pos % self.table.shape[0], token]

    def step_hidden(self, states, chunks, all_logits=False):
        logits, hidden = [], []
        for st, c in zip(states, chunks):
            c = [int(t) for t in c]
            if st.n_tokens + len(c) > self.config.context_length:
                raise Ds4Error("context")
            pos = np.arange(st.n_tokens, st.n_tokens + len(c))
            self.rows_stepped.append(len(c))
            st.begin_step(len(c))
            st.end_step(len(c))
            rows = np.stack([self.row_logits(p, t) for p, t in zip(pos, c)])
            logits.append(rows if all_logits else rows[-1])
            hidden.append(np.stack([pos, c], 1).astype(np.float32)[:, None, :])
        return logits, hidden

    def step(self, states, chunks, all_logits=False):
        return self.step_hidden(states, chunks, all_logits)[0]

    def weight_bytes_per_token(self) -> int:
        return 1000

    def weight_bytes(self) -> WeightBytes:
        return WeightBytes(1000, 1000, 0)          # every verify row priced as a whole step

    def sequence_distribution(self, sampler, prompt: list[int], length: int) -> dict[tuple, float]:
        """The exact probability of every continuation of `length` tokens under plain sampling with `sampler`'s
        truncation rules (its `distribution`)."""
        V, out = self.config.vocab_size, {}
        for seq in itertools.product(range(V), repeat=length):
            hist, p = list(prompt), 1.0
            for t in seq:
                p *= sampler.distribution(self.row_logits(len(hist) - 1, hist[-1]))[t]
                hist.append(t)
            out[seq] = p
        return out


class MarkovDraft:
    """Draft block: row (h = (position j, token t_j), next token t_{j+1}) predicts t_{j+2} with a distorted copy
    of the target's table at position j + 1. Its output state is (j + 1, t_{j+1}), so a chained row sees the
    position and token it would have had: drafts are good but not exact."""

    def __init__(self, target: MarkovModel, distortion: float = 1.0, seed: int = 1, horizon: int = 16):
        rng = np.random.default_rng(seed)
        self.table = target.table + rng.normal(0, distortion, target.table.shape).astype(np.float32)
        self.rollback_horizon, self.fingerprint, self.path = horizon, "markov-draft", "<markov-draft>"
        self.rows_stepped: list[int] = []

    def new_state(self) -> CounterState:
        return CounterState(self.rollback_horizon)

    def step(self, states, hidden, next_ids, all_logits=False, logits=True):
        lg, out = [], []
        for st, h, c in zip(states, hidden, next_ids):
            c = [int(t) for t in c]
            pos = np.arange(st.n_tokens, st.n_tokens + len(c))
            assert np.array_equal(h[:, 0, 0], pos), "an MTP row must get the state of its own position"
            self.rows_stepped.append(len(c))
            st.begin_step(len(c))
            st.end_step(len(c))
            rows = np.stack([self.table[(p + 1) % self.table.shape[0], t] for p, t in zip(pos, c)])
            lg.append(rows if all_logits else rows[-1])
            out.append(np.stack([pos + 1, c], 1).astype(np.float32)[:, None, :])
        return (lg if logits else []), out

    def weight_bytes_per_token(self) -> int:
        return 100


class OracleDraft:
    """Draft block that proposes truth[j + 2] at position j (the continuation plain decoding produces), except
    at the positions in `wrong`, where it proposes another token. For any main model with hc_mult x dim states."""

    def __init__(self, truth: list[int], vocab: int, wrong: set[int] = frozenset(), horizon: int = 16):
        self.truth, self.vocab, self.wrong, self.rollback_horizon = list(truth), vocab, set(wrong), horizon
        self.fingerprint, self.path = "oracle-draft", "<oracle-draft>"

    def new_state(self) -> CounterState:
        return CounterState(self.rollback_horizon)

    def step(self, states, hidden, next_ids, all_logits=False, logits=True):
        lg, out = [], []
        for st, h, c in zip(states, hidden, next_ids):
            pos = np.arange(st.n_tokens, st.n_tokens + len(c))
            st.begin_step(len(c))
            st.end_step(len(c))
            rows = np.full((len(c), self.vocab), -10.0, np.float32)
            for r, (p, t) in enumerate(zip(pos, c)):
                d = self.propose(int(p), int(t))
                rows[r, (d + 1) % self.vocab if p in self.wrong else d] = 10.0
            lg.append(rows if all_logits else rows[-1])
            out.append(np.asarray(h, np.float32))
        return (lg if logits else []), out

    def propose(self, pos: int, token: int) -> int:
        """The token this oracle drafts at position `pos` after `token`: what the truth holds two further on."""
        return self.truth[pos + 2] if pos + 2 < len(self.truth) else 0

    def weight_bytes_per_token(self) -> int:
        return 1


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """p-value of Pearson's chi-square test (cells with expected < 5 pooled; Wilson-Hilferty approximation of
    the chi-square tail, accurate to a few percent for the degrees of freedom used here)."""
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    x, k = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


class NullTokenizer:
    """Token ids only: no text (the session's text deltas are empty)."""

    eos_id = None

    def __init__(self, eos_id: int | None = None):
        self.eos_id = eos_id

    def stream(self):
        return SimpleNamespace(push=lambda t: "", flush=lambda: "")


def assert_seeded_runs_reproduce(spec) -> None:
    """A seeded sampled request over `spec` gives the same 40 tokens in a fresh session and after another request,
    and another seed other tokens."""
    def gen(session, seed):
        prm = SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True)
        return [e.token_id for e in session.generate([1, 2, 3], prm) if isinstance(e, TokenEvent)]
    a = gen(Session(spec, NullTokenizer(), 512), 5)
    s = Session(spec, NullTokenizer(), 512)
    gen(s, 6)
    assert gen(s, 5) == a
    assert gen(Session(spec, NullTokenizer(), 512), 6) != a
