"""Speculative decoding on the trained tiny V4 + MTP (../shared/trained/v4-tiny-trained): a draft that has learnt
something (teacher-forced agreement ~0.5), so rounds accept drafts, the scheduler's calibration has a signal, and
greedy identity is checked on accepted runs of real drafts, not only on rejections. Timing is a bench
(bench/spec_trained.py); this checks behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.model import open_mtp
from ds4py.ref.engine import RefModel
from ds4py.sampling import Sampler, SamplingParams
from ds4py.spec_schedule import RECENT, REFRESH, WINDOW, MeasuredCosts, Scheduler, StepCosts, _Calibration, break_even_acceptance
from ds4py.mtp_spec import MtpSpec

GEN = 32
EOS = 1


@pytest.fixture(scope="module")
def pair(trained_gguf):
    model = RefModel(trained_gguf[0])
    return model, open_mtp(model, trained_gguf[1])


@pytest.fixture(scope="module")
def prompts(trained):
    return {d: np.load(trained / f"test_{d}.ids.npy")[1000:1064].astype(np.int64) for d in ("code", "prose")}


def _plain(model, prompt) -> list[int]:
    st = model.new_state()
    lg, out = model.step([st], [list(prompt)])[0], []
    for _ in range(GEN):
        lg = lg.copy()
        lg[EOS] = -np.inf
        out.append(int(np.argmax(lg)))
        lg = model.step([st], [[out[-1]]])[0]
    return out


def _spec(spec, prompt):
    st = spec.new_state()
    lg = spec.step([st], [list(prompt)])[0]
    req = spec.new_request(SamplingParams(temperature=0.0), suppress=[EOS])
    sampler = Sampler(req.params)
    out, ks = [req._sample(lg, sampler)], []
    while len(out) <= GEN:
        r = req.round(st, out[-1], sampler, GEN + 1 - len(out))
        ks.append(r.stats.drafted)
        out += r.tokens
    return out[:GEN], req, ks


def _timed_costs(plain: float, verify1: float, verify2: float, draft: float, draft3: float | None = None,
                 overhead: float | None = None) -> MeasuredCosts:
    """MeasuredCosts after three rounds that timed a plain step, a verify of 1 and of 2 rows, a first draft step
    of one row (and of 3 rows, a round's overhead, where given), in seconds."""
    c = MeasuredCosts()
    for _ in range(3):
        c.observe_plain(plain)
        c.observe_verify(1, verify1)
        c.observe_verify(2, verify2)
        c.observe_draft(True, draft)
        if draft3 is not None:
            c.observe_draft(True, draft3, rows=3)
        if overhead is not None:
            c.observe_overhead(overhead)
    return c


@pytest.mark.parametrize("dom", ["code", "prose"])
@pytest.mark.parametrize("k", [None, 1, 3], ids=["scheduler", "k1", "k3"])
def test_greedy_speculation_is_plain_decoding(pair, prompts, dom, k):
    """Byte-identical to plain greedy decoding, with drafts accepted (a learnt draft) as well as rejected."""
    model, mtp = pair
    got, req, ks = _spec(MtpSpec(model, mtp, fixed_k=k), prompts[dom])
    assert got == _plain(model, prompts[dom])
    if k is not None:                     # (the scheduler's k follows the clock: it may decode plainly here)
        assert 0 < req.stats.accepted < req.stats.drafted
        assert 0.15 <= req.stats.acceptance <= 0.9, req.stats.summary()


def test_scheduler_bootstraps_short_and_calibrates(pair, prompts):
    """The first round drafts BOOTSTRAP_DRAFTS (not k_max), the next is a plain step (neither depends on the
    clock). With k = 1 every round records its first position (no clock either): the first-position line has a
    positive slope on this draft's prose (more confident drafts are accepted more often), and chained positions
    are recorded only when a round has them."""
    model, mtp = pair
    _, req, ks = _spec(MtpSpec(model, mtp), prompts["prose"])
    assert ks[:2] == [Scheduler.BOOTSTRAP_DRAFTS, 0]
    assert req.scheduler.first.n >= 1
    for dom in ("code", "prose"):
        _, req, _ = _spec(MtpSpec(model, mtp, fixed_k=1), prompts[dom])
        sch = req.scheduler
        assert sch.first.n == req.stats.rounds and sch.chained.n == 0
        if dom == "prose":                # (on the 32 code positions here the fitted slope is 0: no signal)
            assert sch.first.line is not None and sch.first.line[1] > 0, sch.first.line
        _, req, _ = _spec(MtpSpec(model, mtp, fixed_k=3), prompts[dom])
        assert req.scheduler.chained.n > 0


def test_costs_and_acceptance_verdict_are_the_models(pair, prompts):
    """Issue 38: a model's unseeded requests share its measured costs (costs belong to the model and the machine)
    and, per sampling rules, its acceptance verdict (spec_schedule.Verdict: calibrations, recent σ_1, depth, probe
    gap); a seeded sampled request schedules by the files' bytes and its own calibration. So a second request skips
    the bootstrap (the costs are known) and starts from what the first learnt, with counts of its own."""
    model, mtp = pair
    spec = MtpSpec(model, mtp)
    a = spec.new_request(SamplingParams(temperature=0.0))
    b = spec.new_request(SamplingParams(temperature=0.8))
    b2 = spec.new_request(SamplingParams(temperature=0.8, seed=None))
    c = spec.new_request(SamplingParams(temperature=0.8, top_p=0.9))
    seeded = spec.new_request(SamplingParams(temperature=0.8, seed=3))
    assert a.scheduler.costs is b.scheduler.costs is spec.costs
    assert seeded.scheduler.costs is not spec.costs and seeded.scheduler.costs.deterministic
    assert a.scheduler.verdict is spec.verdict(SamplingParams(temperature=0.0, top_p=0.5))     # greedy: one
    assert b.scheduler.verdict is b2.scheduler.verdict is not a.scheduler.verdict
    assert c.scheduler.verdict is not b.scheduler.verdict                   # top-p changes q
    assert seeded.scheduler.verdict is not b.scheduler.verdict
    assert a.scheduler.first.n == b.scheduler.first.n == 0
    _, first, ks = _spec(spec, prompts["prose"])
    assert ks[:2] == [Scheduler.BOOTSTRAP_DRAFTS, 0] and spec.costs.known()
    learnt = first.scheduler.first.n
    assert learnt == first.scheduler.first_rounds >= 1
    _, second, ks = _spec(spec, prompts["code"])
    assert second.scheduler.verdict is first.scheduler.verdict            # no bootstrap, no calibration from zero
    assert ks[0] <= first.scheduler.verdict.depth + 1
    assert second.scheduler.first.n == learnt + second.scheduler.first_rounds
    assert second.scheduler.first_rounds >= second.stats.rounds       # every drafting round (k = 0 ones too)


def test_a_request_starts_from_the_pooled_verdict():
    """Where the model's earlier requests found that drafting does not pay, a new request does not draft a forced
    first round nor probe after 1, 2, 4 plain steps again: it continues the pooled probe gap, which doubles up to
    WINDOW plain steps (a pooled verdict is still re-checked that often). Its own calibration starts empty only
    without a verdict (a seeded request)."""
    c = _timed_costs(10e-3, 9e-3, 14e-3, 1e-3)
    first = Scheduler(c, k_max=4)
    for _ in range(20):
        first.record(0.0, 0.3)                 # the draft never accepted
    assert not first.drafting_pays()
    decisions = [first.should_draft(4) for _ in range(400)]
    probes = [i for i, d in enumerate(decisions) if d]
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps[:6] == [2, 4, 8, 16, 32, 64] and set(gaps[6:]) == {WINDOW}
    second = Scheduler(c, k_max=4, verdict=first.verdict)
    assert second.first is first.first and second.first_rounds == 0
    assert not any(second.should_draft(4) for _ in range(WINDOW - first.verdict.skipped))
    alone = Scheduler(c, k_max=4)
    assert alone.first.n == 0 and alone.should_draft(4)      # nothing known: the first round drafts


def test_calibration_line():
    """_Calibration recovers an affine acceptance law from (σ, hit) samples, clips it to [0, 1], keeps c1 >= 0,
    and is ρ·σ before two σ differ."""
    c = _Calibration()
    assert np.allclose(c([0.5]), 0.5)                           # ρ = 1 before any sample
    c.add(0.4, 0.6)
    assert c.line is None and np.allclose(c([0.2]), 0.3)        # ρ = 1.5
    rng = np.random.default_rng(0)
    for s in rng.random(4000):
        c.add(float(s), float(rng.random() < 0.3 + 0.6 * s))
    c0, c1 = c.line
    assert abs(c0 - 0.3) < 0.05 and abs(c1 - 0.6) < 0.08
    assert c([0.0, 1.0, 5.0]).tolist() == pytest.approx([c0, c0 + c1, 1.0])
    d = _Calibration()
    for s in (0.1, 0.9, 0.2, 0.8):                             # falling with σ: slope held at 0
        d.add(s, 1.0 - s)
    assert d.line[1] == 0.0 and np.allclose(d([0.1, 0.9]), 0.5)


def test_verify_line_floored_by_the_measured_extra_row():
    """Few, noisy long-round counts flatten the least-squares verify line; its slope is floored by the
    best-measured extra row, median(r = 2) − median(r = 1); the line runs through the one-row median."""
    c = MeasuredCosts()
    for _ in range(6):
        c.observe_verify(1, 10e-3)
        c.observe_verify(2, 14e-3)
    for _ in range(2):
        c.observe_verify(5, 15e-3)          # long rounds that happened to run fast
    a, b = c.line()
    assert b == pytest.approx(4e-3)
    assert c.verify(5) - c.verify(2) == pytest.approx(12e-3)
    # through the one-row median: the measured counts read as measured (about the weighted centre, as before the
    # fifth session, the fast long rounds pulled verify(1) to 9.0 and verify(2) to 13.0 ms)
    assert c.verify(1) == pytest.approx(10e-3) and c.verify(2) == pytest.approx(14e-3)
    d = MeasuredCosts()                     # a steeper least-squares slope is kept
    for _ in range(3):
        d.observe_verify(1, 10e-3)
        d.observe_verify(2, 11e-3)
        d.observe_verify(4, 20e-3)
    assert d.line()[1] > 1e-3 + 1e-9


def test_catch_up_cost_charged_to_speculative_tokens():
    """The first draft step's cost per pending MTP row is fitted from its row counts and charged per token a round
    yields: at first-draft acceptance 0.35, a k = 1 round that beats plain on its draft and verify alone
    (1.35 / 13 ms > 1 / 10 ms) loses once its tokens' MTP rows (1.5 ms each) are counted, and the scheduler
    decodes plainly, probing after 1, 2, 4, ... plain steps; with the costs changed so that drafting pays, it
    drafts at the next check (when the gap runs out)."""
    c = _timed_costs(10e-3, 9e-3, 12e-3, 1e-3, draft3=4e-3)
    assert c.catch_up() == pytest.approx(1.5e-3) and c.draft(True) == pytest.approx(1e-3)
    assert c.verify(2) == pytest.approx(12e-3)
    s = Scheduler(c, k_max=4)
    rng = np.random.default_rng(1)
    for _ in range(2000):
        s.record(float(rng.random() < 0.35), 0.5)
    s.first.hits = s.first_hits = 0.35 * s.first_rounds          # exactly 0.35 at σ = 0.5 (ρ·σ: one σ)
    s.first_sigma = s.first.sigma
    assert not s.drafting_pays()
    probes = [False, True] + [False] * 2 + [True] + [False] * 4 + [True] + [False] * 3      # gaps 1, 2, 4
    checks = []
    pays = s.drafting_pays
    s.drafting_pays = lambda: checks.append(1) or pays()
    assert [s.should_draft(4) for _ in range(13)] == probes
    # the check runs at the probes and at the step after each (a probe's round may bring news), not on the
    # plain steps between: it cost ~2% of a plain step of the trained tiny model on the CPU
    assert len(checks) == 7
    del s.drafting_pays
    free = _timed_costs(10e-3, 9e-3, 12e-3, 1e-3, draft3=1e-3)     # the same with a flat first draft: m = 0
    free.observe_plain(10e-3)               # a plain step just timed: no re-timing due (plain_due)
    s.costs = free
    assert free.catch_up() == 0.0 and s.drafting_pays()
    # between probes the plain steps are not re-checked (Scheduler.should_draft): the gap of 8 plain steps runs
    # out (3 of them taken above), then the check finds that drafting pays and drafts, the gap back at 1
    assert [s.should_draft(4) for _ in range(6)] == [False] * 5 + [True] and s.gap == 1


def test_chained_acceptance_recalibrated_per_depth():
    """The chained line pools every depth; per depth j its predictions are rescaled by Σ hits / Σ predicted over
    the positions ≥ j a verify reached: all hits at position 2 and all misses at 3 keep position 2 near the
    pooled line (0.5 here) and push positions 3 and deeper (no data: the deepest factor) near 0."""
    s = Scheduler(MeasuredCosts(), k_max=8)
    s.record(1.0, 0.9)
    for _ in range(50):
        s.record_chained(0.8, 1.0, 2)
        s.record_chained(0.8, 0.0, 3)
    c = s.calibrated([0.9, 0.8, 0.8, 0.8])
    assert c[1] == pytest.approx(0.5, abs=0.05)
    assert c[2] < 0.05 and c[3] == pytest.approx(c[2])
    assert Scheduler(MeasuredCosts(), k_max=8).calibrated([0.9, 0.8]).tolist() == pytest.approx([0.9, 0.8])


def test_round_overhead_is_measured_and_charged(pair, prompts):
    """A drafting round's time beyond its timed draft and verify steps (draft distributions, decisions,
    acceptance, rollback) is measured by round() and charged to every round: at costs where k = 1 pays by 3% on
    its steps alone (1.55 tokens: 15.5 ms of plain steps for 15 ms of draft + verify), an overhead of 1 ms a round
    turns it into a loss and the scheduler decodes plainly."""
    spec = MtpSpec(*pair)
    _, req, ks = _spec(spec, prompts["code"][:32])
    assert spec.costs._overhead.n >= req.stats.rounds > 0 and spec.costs.overhead() > 0.0
    c = _timed_costs(10e-3, 9e-3, 14e-3, 1e-3)
    s = Scheduler(c, k_max=4)
    for _ in range(20):
        s.record(0.55, 0.5)
    assert s.drafting_pays()
    assert break_even_acceptance(c) == pytest.approx(0.5)
    for _ in range(3):
        c.observe_overhead(1e-3)
    assert c.overhead() == pytest.approx(1e-3) and not s.drafting_pays()
    assert break_even_acceptance(c) == pytest.approx(0.6)


def test_step_costs_give_the_expected_speed_up_per_k():
    """StepCosts (given step times, e.g. the GPU time model's) through Scheduler.expected_round: E = 1 + a_1 +
    a_1·a_c + ..., the round's cost = draft steps + verify(1 + k) + m·E, the speed-up E · plain / cost; the
    break-even acceptance is where k = 1 gives 1.0x."""
    c = StepCosts(10.0, {2: 13.0, 3: 16.0}, 1.0, 1.5)          # m = 0.5 per pending row
    assert c.catch_up() == 0.5 and c.draft(True) == c.draft(False) == 1.0 and c.verify(1) == 10.0
    assert c.verify(4) == pytest.approx(19.0) and c.verify(5) == pytest.approx(22.0)     # the last two counts' line
    s = Scheduler(c, k_max=4)
    assert s.expected_round([]) == (1.0, 10.0)
    E, cost = s.expected_round([0.6])
    assert E == pytest.approx(1.6) and cost == pytest.approx(1.0 + 13.0 + 0.5 * 1.6)
    E, cost = s.expected_round([0.6, 0.5])
    assert E == pytest.approx(1.9) and cost == pytest.approx(2.0 + 16.0 + 0.5 * 1.9)
    a = break_even_acceptance(c)
    E, cost = s.expected_round([a])
    assert E * c.plain() / cost == pytest.approx(1.0)


def test_costs_keep_a_window_of_recent_samples():
    """A model's costs live as long as its server: every median keeps the last WINDOW samples (bounded work per
    decision, and it follows a machine whose speed changed) instead of every step so far."""
    c = MeasuredCosts()
    for t in (20e-3, 10e-3):                  # the machine got twice as fast after 1,000 steps
        for _ in range(1000):
            c.observe_plain(t)
            c.observe_verify(1, t)
            c.observe_verify(2, 1.5 * t)
            c.observe_draft(True, 0.1 * t, rows=1)
            c.observe_draft(True, 0.2 * t, rows=3)
    assert c.plain() == pytest.approx(10e-3) and c.verify(2) == pytest.approx(15e-3)
    assert c.draft(True) == pytest.approx(1e-3) and c.catch_up() == pytest.approx(0.5e-3)
    assert len(c._plain.samples) == len(c._rows[1]) == WINDOW


def _scheduled_rounds(s: Scheduler, costs: MeasuredCosts, n: int, verify_2: float) -> list[bool]:
    """n decisions of `s` (k = 4), each timed into `costs` as it ran: a drafting round a 1 ms draft step and a
    2-row verify of verify_2 seconds, a plain round an 8 ms plain step and a 7.9 ms 1-row verify."""
    decisions = []
    for _ in range(n):
        decisions.append(s.should_draft(4))
        if decisions[-1]:
            costs.observe_draft(True, 1e-3)
            costs.observe_verify(2, verify_2)
        else:
            costs.observe_plain(8e-3)
            costs.observe_verify(1, 7.9e-3)
    return decisions


def test_a_drafting_scheduler_re_times_the_plain_step():
    """A scheduler that drafts every round times no plain step, so it judged its rounds against plain steps timed
    long ago: on the trained tiny model a plain median of 10.8 ms from the first request's few plain steps against
    7.6 ms measured since kept k = 1 rounds "paying" and prose lost 12% (issue 38, fourth session). Now it takes a
    plain step after every REFRESH drafting rounds, and medians read the samples of the last WINDOW main steps
    (at least the last RECENT): the stale estimate is replaced and the scheduler stops drafting where the rounds
    (1.6 tokens for 15 ms) lose to the true plain step (8 ms)."""
    c = MeasuredCosts()
    for _ in range(RECENT):                        # a slow (cold, or loaded) start: plain steps of 15 ms
        c.observe_plain(15e-3)
        c.observe_verify(1, 14.9e-3)
    for _ in range(3):
        c.observe_draft(True, 1e-3)
        c.observe_verify(2, 14e-3)
    s = Scheduler(c, k_max=4)
    for _ in range(40):
        s.record(0.6, 0.5)                         # first-draft acceptance 0.6
    assert s.drafting_pays()
    decisions = _scheduled_rounds(s, c, 20 * REFRESH, verify_2=14e-3)
    plains = [i for i, d in enumerate(decisions) if not d]
    assert plains[:3] == [0, 5, 14]           # 3 rounds drafted before (due at 2): then gaps of 4, 8 rounds
    assert c.plain() == pytest.approx(8e-3) and not s.drafting_pays()
    assert plains[RECENT // 2] < 4 * REFRESH                               # outvoted within a few re-timings
    assert sum(decisions[-4 * REFRESH:]) <= 4                              # then it decodes plainly, probing
    d = MeasuredCosts()                       # drafting that pays: re-timed after 2, 4, .. rounds, then REFRESH
    for _ in range(3):
        d.observe_plain(8e-3)
        d.observe_verify(1, 7.9e-3)
        d.observe_draft(True, 1e-3)
        d.observe_verify(2, 9e-3)
    s = Scheduler(d, k_max=4)
    for _ in range(40):
        s.record(0.8, 0.5)
    decisions = _scheduled_rounds(s, d, 8 * REFRESH, verify_2=9e-3)
    plains = [i for i, x in enumerate(decisions) if not x]
    gaps = [b - a - 1 for a, b in zip(plains, plains[1:])]
    assert gaps[:4] == [4, 8, 16, 32] and set(gaps[4:]) == {REFRESH}
    assert not Scheduler(StepCosts(8.0, {2: 9.0}, 1.0), 4).costs.plain_due()     # given costs: never


def test_a_position_must_earn_the_plain_rate():
    """A position is verified only if it raises the round's rate and earns at least 1 / plain(): with its first
    draft step spent, a round's rate can be below plain's (here a k = 0 round: 1 token in 10 ms against 8 ms
    plain), and a first draft accepted with probability 0.45 beats that rate (1.45 tokens in 14 ms) while the
    4 ms its verify row costs would decode 0.5 tokens plainly; at 0.55 it pays."""
    c = _timed_costs(8e-3, 8e-3, 12e-3, 1.5e-3, overhead=0.5e-3)
    for acc, verified in ((0.45, False), (0.55, True)):
        s = Scheduler(c, k_max=4)
        for _ in range(10):
            s.record(acc, 0.5)                      # one σ: c(σ) = ρ·σ = acc
        E, cost = s.expected_round([acc])
        assert E / cost > 1 / 10e-3                 # beats the k = 0 round either way
        assert s.include([0.5]) is verified


def test_a_requests_prepare_is_not_round_overhead(pair, prompts, monkeypatch):
    """The first draft of a request runs the drafter's prepare() (the prompt's pending MTP rows, up to the ring's
    64): the prompt's work, not a round's. It was left in the round's measured overhead, and where most overhead
    samples were requests' first rounds (a scheduler that mostly decodes plainly) every round looked 2.6-4.2 ms
    dearer. On a clock that only prepare() advances, every overhead sample is 0."""
    from ds4py import spec as spec_module
    from ds4py.mtp_spec import MtpDraft

    now = [0.0]
    monkeypatch.setattr(spec_module, "CLOCK", lambda: now[0])
    prepare = MtpDraft.prepare

    def slow_prepare(self, state, token):
        now[0] += 1.0
        return prepare(self, state, token)

    monkeypatch.setattr(MtpDraft, "prepare", slow_prepare)
    spec = MtpSpec(*pair, fixed_k=1)
    for dom in ("code", "prose"):
        _spec(spec, prompts[dom])
    assert now[0] == 2.0 and spec.costs._overhead.n > 2
    assert max(spec.costs._overhead.samples) == 0.0


def test_multi_row_verify_read_against_the_one_row_steps_timed_with_it():
    """A load swing scales every step alike: verify(2) is read as its samples over the one-row steps timed around
    them, times the one-row median now. Probes timed verify(2) at 30 ms while plain steps took 20 (a loaded phase);
    the machine then got quiet (plain 10 ms) and no probe has run since: verify(2) is 15 ms (1.5 plain steps), not
    the stale 30 ms (3 plain steps: a break-even acceptance above 1, drafting never tried again)."""
    c = MeasuredCosts()
    for i in range(24):                      # loaded: a probe every 4 steps
        c.observe_plain(20e-3)
        c.observe_verify(1, 20e-3)
        if i % 4 == 3:
            c.observe_verify(2, 30e-3)
    for _ in range(20):                      # quiet, plain steps only
        c.observe_plain(10e-3)
        c.observe_verify(1, 10e-3)
    assert c.plain() == pytest.approx(10e-3) and c.verify(1) == pytest.approx(10e-3)
    assert c.verify(2) == pytest.approx(15e-3)
    costs = StepCosts(10e-3, {2: 15e-3}, 1e-3)
    assert break_even_acceptance(costs) == pytest.approx(0.6)
    d = MeasuredCosts()                      # the bootstrap round's verify, timed before any one-row step
    d.observe_verify(3, 24e-3)
    for _ in range(6):
        d.observe_verify(1, 8e-3)
    assert d.verify(3) == pytest.approx(24e-3)


def test_a_probe_verifies_its_first_draft():
    """verify(2) is timed only by rounds that verify a draft: while fewer than RECENT were timed, a probe
    verifies its first draft whatever σ_1 says (one slow cold sample had made every draft look unprofitable, so
    none was verified again and the estimate was never refreshed); then, and on a round that is not a probe, σ_1
    decides; a draft never kept (random weights) is not verified by a probe."""
    c = MeasuredCosts()
    c.observe_verify(3, 40e-3)                # the bootstrap round's 3-row verify, cold: 4 plain steps
    for _ in range(8):
        c.observe_plain(10e-3)
        c.observe_verify(1, 10e-3)
    c.observe_draft(True, 1.7e-3)
    s = Scheduler(c, k_max=4)
    for _ in range(64):
        s.record(0.3, 0.2)
    assert c.verify(2) == pytest.approx(25e-3)                 # k = 1 never pays on this line
    assert [s.should_draft(4) for _ in range(2)] == [False, True]     # a probe after 1 plain step
    assert s.probing and s.include([0.2]) and not s.include([0.2, 0.2])
    for _ in range(RECENT):                   # its verify and the next ones time 2 rows at 1.45 plain steps
        c.observe_verify(2, 14.5e-3)
    assert c.timed(2) == RECENT and c.verify(2) < 20e-3        # (the cold 3-row sample still tilts the line)
    assert s.probing and not s.include([0.2])                  # measured: σ_1 decides
    s.record(0.0, 0.2)
    s.should_draft(4)
    assert not s.probing and not s.include([0.2])
    never = Scheduler(StepCosts(10e-3, {2: 25e-3}, 1.7e-3), k_max=4)
    for _ in range(64):                       # a draft never kept (random weights): a probe verifies nothing
        never.record(0.0, 0.2)
    assert [never.should_draft(4) for _ in range(2)] == [False, True]
    assert never.probing and not never.include([0.2])


def test_lockstep_bench_alternates_the_sides(pair, prompts):
    """bench/spec_trained.py --lockstep: the side that has fed the fewest tokens advances next, every side ends
    with the same tokens fed, each charged its own time; greedy output identical to plain."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import spec_trained

    model, mtp = pair
    spec = MtpSpec(model, mtp, fixed_k=2)
    st = spec.new_state()
    lg = spec.step([st], [list(prompts["prose"])])[0]
    params = SamplingParams(temperature=0.0)
    sides = {"plain": spec_trained._PlainSide(model, st.copy(), lg, params),
             "spec": spec_trained._SpecSide(spec, st.copy(), lg, params)}
    order = []
    for name, side in sides.items():
        adv = side.advance
        side.advance = (lambda adv, name: lambda n: order.append((name, {k: s.fed for k, s in sides.items()}))
                        or adv(n))(adv, name)
    cpu = spec_trained.lockstep(sides, 16, 1)
    assert all(fed[name] == min(f for f in fed.values() if f < 16) for name, fed in order)
    assert order[0][0] == "spec"              # ties in the rotated order
    assert sides["plain"].fed == 16 and sides["spec"].fed == 16 and set(cpu) == {"plain", "spec"}
    assert sides["spec"].tokens(16) == sides["plain"].tokens(16) and min(cpu.values()) > 0
    assert sum(sides["spec"].ks) > 0          # rounds that drafted: the sides ran apart and were re-aligned
