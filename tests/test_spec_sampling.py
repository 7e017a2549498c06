"""Speculative sampling is exactly plain sampling: rejection sampling in isolation, then the whole session loop
(drafting, k + 1-row verify, acceptance, rollback, the bonus token, stopping mid-round) on a tiny-vocabulary
model whose sequence distribution is enumerated exactly. Seeded runs reproduce."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.sampling import Sampler, SamplingParams
from ds4py.session import Session, TokenEvent
from ds4py.spec import ByteCosts, accept_sampled
from ds4py.mtp_spec import MtpSpec
from spec_fakes import MarkovDraft, MarkovModel, NullTokenizer, assert_seeded_runs_reproduce, chi_square_p

P_MIN = 1e-3        # fixed seeds: each test's outcome is deterministic; a correct sampler fails 0.1% of seed sets


def _dist(rng, V, sparse=False):
    p = rng.dirichlet(np.ones(V) * 0.7)
    if sparse:
        p[rng.choice(V, V // 3, replace=False)] = 0
        p /= p.sum()
    return p


@pytest.mark.parametrize("case", range(4))
def test_rejection_sampling_gives_the_target_distribution(case):
    """d ~ q; keep d with probability min(1, p/q), else draw from normalise(max(0, p - q)): the kept-or-drawn
    token is distributed as p, for p and q with disjoint supports, shared zeros, and q = p."""
    rng = np.random.default_rng(case)
    V = 6
    p = _dist(rng, V, sparse=case == 1)
    q = p.copy() if case == 3 else _dist(rng, V, sparse=case == 2)
    s = Sampler(SamplingParams(temperature=1.0, seed=100 + case))
    N, counts, accepted = 30_000, np.zeros(V), 0
    for _ in range(N):
        d = s.draw(q)
        a, tok, _ = accept_sampled([p, p], [q], [d], s)
        counts[d if a else tok] += 1
        accepted += a
        assert a == 0 or tok is not None
    assert chi_square_p(counts, N * p) > P_MIN
    assert abs(accepted / N - np.minimum(p, q).sum()) < 0.015       # the acceptance rate is Σ min(p, q)


def test_the_check_has_power_against_a_wrong_residual():
    """Negative control: drawing the replacement from p instead of the residual (a classic bug) is caught."""
    rng = np.random.default_rng(7)
    p, q = _dist(rng, 6), _dist(rng, 6)
    s = Sampler(SamplingParams(temperature=1.0, seed=3))
    N, counts = 30_000, np.zeros(6)
    for _ in range(N):
        d = s.draw(q)
        counts[d if s.rng.random() < p[d] / q[d] else s.draw(p)] += 1
    assert chi_square_p(counts, N * p) < 1e-6


PARAMS = [dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8, min_p=0.05)]


@pytest.mark.parametrize("pi,k", [(0, 1), (1, 3), (2, 2), (0, None)], ids=["k1", "k3-topk", "k2-topp-minp", "sched"])
def test_speculative_session_samples_the_plain_sequence_distribution(pi, k):
    """Whole sequences of 3 tokens from the session with speculation (k drafts a round, or the scheduler's k; the
    request's temperature / top-k / top-p / min-p on both draft and target): their frequencies match the exact
    distribution of plain sampling (64 sequences, chi-square)."""
    target = MarkovModel(vocab=4, period=3, seed=pi)
    spec = MtpSpec(target, MarkovDraft(target, distortion=0.8, seed=10 + pi), fixed_k=k)
    # the scheduler's costs (a seeded request: bytes): a verify row costs a tenth of a step, a draft a tenth
    spec.byte_costs = lambda: ByteCosts(main_bytes=1000, routed_bytes=100, draft_bytes=100, head_bytes=10)
    session = Session(spec, NullTokenizer(), ctx_size=512)
    prompt, L, N = [2, 0, 3], 3, 2500
    counts: dict[tuple, int] = {}
    for run in range(N):
        prm = SamplingParams(**PARAMS[pi], seed=1000 * pi + run, max_tokens=L, ignore_eos=True)
        seq = tuple(e.token_id for e in session.generate(prompt, prm) if isinstance(e, TokenEvent))
        counts[seq] = counts.get(seq, 0) + 1
    assert spec.stats.rounds > N // 2 and 0 < spec.stats.accepted < spec.stats.drafted     # both paths ran
    exact = target.sequence_distribution(Sampler(SamplingParams(**PARAMS[pi])), prompt, L)
    keys = sorted(exact)
    assert set(counts) <= set(keys)
    obs = np.array([counts.get(s, 0) for s in keys], float)
    assert chi_square_p(obs, N * np.array([exact[s] for s in keys])) > P_MIN


def test_seeded_runs_reproduce_and_differ_by_seed():
    """Same seed, same prompt: the same tokens, in a fresh session or after other requests (the schedule of a
    seeded sampled request is deterministic: byte costs, not the clock)."""
    target = MarkovModel(vocab=8, period=5, seed=3)
    spec = MtpSpec(target, MarkovDraft(target, distortion=0.5, seed=4))
    # byte costs where a verify row pays at this draft's acceptance (~0.8): the model's own make every row cost a
    # whole step (break-even 0.91), and the calibrated scheduler then rightly decodes plainly, never reaching a round
    spec.byte_costs = lambda: ByteCosts(main_bytes=1000, routed_bytes=100, draft_bytes=100, head_bytes=10)
    assert_seeded_runs_reproduce(spec)
    assert spec.stats.rounds > 0
