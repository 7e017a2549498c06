"""The speculative scheduler and its costs (ds4py.spec drives the rounds; docs/spec.md "The scheduler"): what a
round of k drafts costs (MeasuredCosts: a model's measured step times; ByteCosts: the files' bytes, for a seeded
sampled request), the acceptance calibration of a request (_Calibration) and the choice of k (Scheduler). The
same for every draft (the MTP block, DSpark): a draft differs only in its costs and its confidence σ."""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from typing import Sequence

import numpy as np

# Samples a running median keeps (per step kind, per row count): the most recent ones. Costs belong to the model
# and the machine and drift with the machine's state; and a model's costs live as long as the server, so keeping
# every sample made each re-fit O(all steps so far): ~0.1 ms a decision after a thousand steps, 4% of a plain step
# of the trained tiny model on the CPU (issue 38, third session).
WINDOW = 64

# The fewest samples a median reads however old they are (_Median, _count_medians): a median reads the samples
# of the last SPAN main steps, and at least the last RECENT ones. Why (issue 38, fourth session): samples of one
# kind can stop coming -- a scheduler that drafts every round times no plain step -- and WINDOW samples of that
# kind then reach back thousands of steps, to another load of the machine (or a cold start): on the trained tiny
# model a plain median of 10.8 ms from the first request's few plain steps, against 7.6 ms measured since, kept
# k = 1 rounds "paying" for the rest of the run and prose lost 12%. With the plain step re-timed while drafting
# (MeasuredCosts.plain_due) a stale plain estimate is outvoted by RECENT // 2 + 1 fresh samples once the stale
# ones are SPAN steps old. SPAN was WINDOW (64) first: on bench/spec_replay.py's virtual clock the 8 plain steps of
# a slow start stayed in the median for 64 steps, most of a first request, and code at temperature 1 drafted k = 2
# rounds against a stale 9.75 ms plain step (0.89-0.94x of plain). A steady kind (every plain step while not
# drafting, every k = 1 round's verify) still has SPAN samples a median.
RECENT = 5
SPAN = 16
# The most drafting rounds between two plain steps taken only to re-time a plain step (MeasuredCosts.plain_due):
# after 2, 4, 8, 16 rounds, then every REFRESH (the gap restarts when the scheduler decodes plainly of its own
# accord). On the virtual clock of bench/spec_replay.py (the first 12 steps 1.5x slow) a stale estimate was
# outvoted after ~14 drafting rounds, not ~160 with a fixed gap of 32; where a round of k = 1 beats plain by 20%,
# one plain step in 32 rounds gives back ~0.4% of the speed.
REFRESH = 32


class _Median:
    """The median of the recent samples (those of the last SPAN main steps, at least the last RECENT: the
    module's note above): robust to a step the OS descheduled (on a shared machine one step in a few can take
    several times its cost, which pulled a running mean, and with it k, around)."""

    def __init__(self, clock=None):
        self.samples: deque[float] = deque(maxlen=WINDOW)
        self.ticks: deque[int] = deque(maxlen=WINDOW)
        self._clock = clock                     # the main-step count now (MeasuredCosts.steps), or None
        self._value: float | None = None
        self._at = -1

    def add(self, v: float) -> None:
        self.samples.append(v)
        self.ticks.append(self._clock() if self._clock else 0)
        self._value = None

    @property
    def n(self) -> int:
        return len(self.samples)

    def value(self) -> float | None:
        now = self._clock() if self._clock else 0
        if (self._value is None or now != self._at) and self.samples:
            self._value, self._at = _median(_recent(self.samples, self.ticks, now)), now
        return self._value


def _recent(samples, ticks, now: int) -> list[float]:
    """The samples taken in the last SPAN main steps before `now`, at least the last RECENT (all if fewer)."""
    n = len(ticks) - bisect_left(ticks, now - SPAN + 1)          # ticks only grow: the recent ones are a tail
    k = min(max(n, RECENT), len(samples))
    return [samples[i] for i in range(len(samples) - k, len(samples))]


# Plain Python for the few-sample statistics below: they run at every decision (a plain step's too), and numpy's
# per-call cost made a decision ~0.4 ms, 4% of a plain step of the trained tiny model on the CPU.
def _median(v) -> float:
    a = sorted(v)
    h = len(a) // 2
    return float(a[h]) if len(a) % 2 else 0.5 * (a[h - 1] + a[h])


def _centre(pts: list[tuple[int, float, int]]) -> tuple[float, float]:
    """The weighted means of the counts and of their medians."""
    W = sum(w for _, _, w in pts)
    return sum(w * r for r, _, w in pts) / W, sum(w * t for _, t, w in pts) / W


def _count_medians(rows: dict[int, "deque[float]"], ticks: dict[int, "deque[int]"], now: int
                   ) -> list[tuple[int, float, int]]:
    """(count, median, weight) per row count over its recent samples (_recent); a count's first sample is a
    warm-up, left out once it has a second (while the window still holds it)."""
    out = []
    for r, v in rows.items():
        a = _recent(v, ticks[r], now)
        if 1 < len(v) < WINDOW and len(a) == len(v):       # the warm-up is among them: leave it out
            a = a[1:]
        out.append((r, _median(a), len(a)))
    return sorted(out)


def _line(pts: list[tuple[int, float, int]]) -> tuple[float, float] | None:
    """The weighted least-squares line t ≈ a + b·r through per-count medians (b ≥ 0: noise can tilt it, a step
    never gets cheaper with rows), or None below two counts."""
    if len(pts) < 2:
        return None
    rm, tm = _centre(pts)
    sxy = sum(w * (r - rm) * (t - tm) for r, t, w in pts)
    sxx = sum(w * (r - rm) ** 2 for r, _, w in pts)
    b = max(sxy / sxx, 0.0)
    return float(tm - b * rm), float(b)


class MeasuredCosts:
    """Costs of a model's steps on the scheduler's clock (SpecModel.costs: every unseeded request of the model
    adds its samples and reads the same estimates): a plain step (the main step; the MTP rows it
    leaves pending are caught up by the next draft), a chained draft step (running median), a first draft step
    as a line g + m·r in the r pending MTP rows it catches up (m: what the MTP block costs per decoded token,
    paid by speculative tokens and by the plain steps between rounds alike), and a verify of r rows as a line
    a + b·r through the per-count medians (weighted least squares, weight = samples; a count's first sample is a
    warm-up, left out once the count has a second).

    The line runs through the one-row median (_refit says why); its slope is floored by the marginal cost of the
    best-measured extra row, median(r=2) − median(r=1)
    (every plain step times r = 1, every k = 1 round r = 2): on the trained tiny model the least-squares slope
    through few, noisy long-round counts came out 2.5–5 ms per row against ~3.6 ms measured directly, so long
    rounds looked cheap and the scheduler lost up to 13% on prose. The floor errs toward short rounds, whose
    cost is measured best."""

    deterministic = False

    def __init__(self):
        self.steps = 0                 # main steps timed so far (plain and verify): the samples' clock (_recent)
        self.since_plain = 0           # drafting rounds since the last plain step was timed (plain_due)
        self.refresh_gap = 2           # drafting rounds before the next re-timed plain step (2, 4, .. REFRESH)
        clock = lambda: self.steps     # noqa: E731
        self._plain, self._first, self._chain, self._overhead = (_Median(clock), _Median(clock), _Median(clock),
                                                                 _Median(clock))
        self._rows: dict[int, deque[float]] = {}
        self._first_rows: dict[int, deque[float]] = {}
        self._refs: dict[int, deque[float | None]] = {}      # per multi-row verify sample: the one-row median then
        self._ticks: dict[tuple[str, int], deque[int]] = {}   # the step count at each _rows / _first_rows sample
        self._line: tuple[float, float] | None = None
        self._catch: tuple[float, float] | None = None
        self._stale = True

    def observe_plain(self, seconds: float) -> None:
        self._plain.add(seconds)
        # a re-timing step doubles the gap; a plain step the scheduler chose (drafting stopped) restarts it
        self.refresh_gap = min(2 * self.refresh_gap, REFRESH) if self.plain_due() else 2
        self.since_plain = 0

    def plain_due(self) -> bool:
        """Has the scheduler drafted refresh_gap rounds since it last timed a plain step? (Then it takes one: a
        scheduler that drafts every round would otherwise judge its rounds against a plain step timed long ago;
        the gap doubles from 2 to REFRESH, so a stale estimate is replaced within the first ~14 rounds.)"""
        return self.since_plain >= self.refresh_gap

    def _sample(self, store: dict, kind: str, rows: int, seconds: float) -> None:
        store.setdefault(rows, deque(maxlen=WINDOW)).append(seconds)
        self._ticks.setdefault((kind, rows), deque(maxlen=WINDOW)).append(self.steps)
        self._stale = True

    def observe_draft(self, first: bool, seconds: float, rows: int = 1) -> None:
        """A draft step's time; a first one also ran `rows` pending MTP rows (the last one gives its logits)."""
        (self._first if first else self._chain).add(seconds)
        if first:
            self.since_plain += 1
            self._sample(self._first_rows, "first", rows, seconds)

    def observe_verify(self, rows: int, seconds: float) -> None:
        self.steps += 1
        if rows != 1:                  # the one-row steps timed around it (_relative), None before any
            one = self._rows.get(1)
            self._refs.setdefault(rows, deque(maxlen=WINDOW)).append(
                _median(_recent(one, self._ticks["verify", 1], self.steps)) if one else None)
        self._sample(self._rows, "verify", rows, seconds)

    def observe_overhead(self, seconds: float) -> None:
        """A drafting round's time beyond its timed draft and verify steps (SpecRequest.round)."""
        self._overhead.add(max(seconds, 0.0))

    def overhead(self) -> float:
        """What a drafting round costs beyond its steps: the median of observe_overhead (0 before one)."""
        return self._overhead.value() or 0.0

    def _relative(self, pts: list[tuple[int, float, int]]) -> list[tuple[int, float, int]]:
        """Each multi-row count's median re-read as (its samples over the one-row steps timed around them) x the
        one-row median now. Why (issue 38, fifth session): with drafting off, verify(2) is timed only by probes,
        up to WINDOW steps apart, so its recent samples reach back over several load phases of a shared machine
        while the one-row median is the last SPAN steps': in lockstep at load 6-9 the scheduler read verify(2)
        at 2.2x a plain step (7.2 vs 16.2 ms; its probes' own neighbours said 1.45-1.5x, as a k = 1 run beside
        it measured), a break-even acceptance of 1.6 that no draft reaches, and kept drafting off where k = 1
        won 2-14%. A load swing scales every step alike; the ratio of steps timed together does not move."""
        ones, t1 = self._rows[1], self._ticks["verify", 1]
        med1 = next(t for r, t, _ in pts if r == 1)
        out = []
        for r, t, w in pts:
            if r != 1:
                v, refs, ticks = self._rows[r], self._refs[r], self._ticks["verify", r]
                ratios = []
                for i in range(len(v) - w, len(v)):          # the samples _count_medians read (the last w)
                    ref = refs[i]
                    if ref is None:                          # timed before any one-row step: the nearest ones
                        near = sorted(range(len(t1)), key=lambda j: abs(t1[j] - ticks[i]))[:RECENT]
                        ref = _median([ones[j] for j in near])
                    ratios.append(v[i] / max(ref, 1e-12))
                t = med1 * _median(ratios)
            out.append((r, t, w))
        return out

    def _refit(self) -> None:
        if not self._stale:
            return
        self._stale = False
        pts = _count_medians(self._rows, {r: self._ticks["verify", r] for r in self._rows}, self.steps)
        if len(pts) > 1 and 1 in self._rows:
            pts = self._relative(pts)
        line = _line(pts)
        med = {r: (t, w) for r, t, w in pts}
        if line is not None and 1 in med:
            # through the one-row median (every plain step and k = 0 round times it: the best-measured count),
            # the weighted least-squares slope of the other counts about it. Why anchored (issue 38, fifth
            # session): through the weighted centre, a few slow long rounds (old samples of a loaded phase) tilted
            # the line so that it read verify(1) 6.1 ms and verify(2) 11.4 against medians of 9.2 and 13.6 ms
            # measured on prose: a 2-row verify looked 1.1x a plain step instead of 1.5x and rounds that lost
            # were taken
            t1 = med[1][0]
            rest = [(r - 1, t - t1, w) for r, t, w in pts if r != 1]
            b = max(sum(w * x * y for x, y, w in rest) / sum(w * x * x for x, _, w in rest), 0.0)
            if 2 in med and min(med[1][1], med[2][1]) >= 2:
                b = max(b, med[2][0] - t1)     # floored by the best-measured extra row (see the class docstring)
            line = (float(t1 - b), float(b))
        self._line = line
        self._catch = _line(_count_medians(self._first_rows, {r: self._ticks["first", r] for r in self._first_rows},
                                           self.steps))

    def line(self) -> tuple[float, float] | None:
        self._refit()
        return self._line

    def catch_up(self) -> float:
        """m: the first draft step's cost per pending MTP row (0 until two row counts are measured)."""
        self._refit()
        return self._catch[1] if self._catch is not None else 0.0

    def verified(self) -> bool:
        return bool(self._rows)

    def timed(self, rows: int) -> int:
        """Samples of verifies of `rows` rows in the window."""
        return len(self._rows.get(rows, ()))

    def known(self) -> bool:
        return self.line() is not None and self._first.n > 0

    def verify(self, rows: int) -> float:
        a, b = self.line()
        return max(a + b * rows, 1e-12)

    def plain(self) -> float:
        return self._plain.value() or self.verify(1)

    def draft(self, first: bool) -> float:
        """A chained step's median; a first step's cost without its catch-up rows (g + m, one row: the row of the
        round's own token), the plain median until two row counts are measured."""
        if first:
            self._refit()
            if self._catch is not None:
                return max(self._catch[0] + self._catch[1], 1e-12)
        v = (self._first if first else self._chain).value()
        return v if v is not None else self._first.value()


class _GivenCosts:
    """The costs known without timing (ByteCosts, StepCosts): every observation is ignored, nothing is due for a
    re-time, and the verify line is known from the start."""

    deterministic = True

    def observe_plain(self, seconds: float) -> None:
        pass

    def observe_draft(self, first: bool, seconds: float, rows: int = 1) -> None:
        pass

    def observe_verify(self, rows: int, seconds: float) -> None:
        pass

    def observe_overhead(self, seconds: float) -> None:
        pass

    def plain_due(self) -> bool:
        return False                           # given costs: nothing to re-time

    def timed(self, rows: int) -> int:
        return WINDOW                          # given costs: known without timing

    def verified(self) -> bool:
        return True

    def known(self) -> bool:
        return True


class ByteCosts(_GivenCosts):
    """Deterministic costs for a seeded sampled request (its tokens depend on the drafts, so its k must not
    depend on the clock): the bytes each step reads, the decode roofline. A verify of r rows reads the dense
    weights once and r rows' routed experts (no sharing assumed); a first draft step reads the draft (MTP: the
    block and the head), a chained one `chain_bytes` (MTP: the same; DSpark: nothing, its block holds every
    position); a plain step the model and what the draft reads per main row beyond the head (MTP: its catch-up
    row)."""

    def __init__(self, main_bytes: int, routed_bytes: int, draft_bytes: int, head_bytes: int,
                 chain_bytes: int | None = None):
        self.main, self.routed, self.draft_b, self.head = main_bytes, routed_bytes, draft_bytes, head_bytes
        self.chain = draft_bytes if chain_bytes is None else chain_bytes

    def catch_up(self) -> float:
        return 0.0                             # plain() already counts the MTP block's row per token

    def overhead(self) -> float:
        return 0.0                             # bytes only: a seeded request's k must not depend on the clock

    def verify(self, rows: int) -> float:
        return float(self.main + (rows - 1) * self.routed)

    def plain(self) -> float:
        return float(self.main + self.draft_b - self.head)

    def draft(self, first: bool) -> float:
        return float(self.draft_b if first else self.chain)


class StepCosts(_GivenCosts):
    """Deterministic costs from given step times (seconds): a plain step, a verify of r rows (a dict by r; a line
    through the two nearest counts outside it) and the draft step as g + m·r in its pending rows (draft1, draft2:
    one and two rows) -- MeasuredCosts' model with its medians replaced by these numbers. For what-if questions
    (the GPU time model's steps: bench/spec_gpu_model.py), not for a request's decisions. overhead: a drafting
    round's host work beyond its steps (MeasuredCosts.overhead)."""

    def __init__(self, plain: float, verify: dict[int, float], draft1: float, draft2: float | None = None,
                 overhead: float = 0.0):
        self._over = float(overhead)
        self._plain, self._verify = float(plain), {int(r): float(t) for r, t in verify.items()}
        self._verify.setdefault(1, float(plain))
        self._m = max(float(draft2) - float(draft1), 0.0) if draft2 is not None else 0.0
        self._first = self._chain = float(draft1)       # one row (g + m); a first step's extra rows: catch_up()

    def catch_up(self) -> float:
        return self._m

    def overhead(self) -> float:
        return self._over

    def plain(self) -> float:
        return self._plain

    def draft(self, first: bool) -> float:
        return self._first if first else self._chain

    def verify(self, rows: int) -> float:
        if rows in self._verify:
            return self._verify[rows]
        rs = sorted(self._verify)
        lo, hi = (rs[-2], rs[-1]) if rows > rs[-1] else (rs[0], rs[1])
        b = (self._verify[hi] - self._verify[lo]) / (hi - lo)
        return self._verify[lo] + b * (rows - lo)


def break_even_acceptance(costs) -> float:
    """The first-draft acceptance a* at which a round of k = 1 (a first draft step, a verify of 2 rows and the MTP
    catch-up of its 1 + a* tokens) yields as many tokens per second as plain steps, on `costs` (the scheduler's
    cost model, with its per-round overhead o): (1 + a*) / (draft + verify(2) + m·(1 + a*) + o) = 1 / plain."""
    m = costs.catch_up()
    return (costs.draft(True) + costs.verify(2) + costs.overhead()) / max(costs.plain() - m, 1e-12) - 1.0


class _Calibration:
    """Acceptance as a function of the draft's confidence σ, from (σ, hit) pairs: the least-squares line
    hit ≈ c0 + c1·σ (c1 ≥ 0, clipped to [0, 1]) once two pairs differ in σ, else ρ·σ with ρ = Σ hit / Σ σ (1
    before any pair). Running sums: O(1) per pair."""

    def __init__(self):
        self.n, self.hits, self.sigma, self.sq, self.cross = 0, 0.0, 0.0, 0.0, 0.0
        self.line: tuple[float, float] | None = None

    def add(self, sigma: float, hit: float) -> None:
        self.n += 1
        self.hits += hit
        self.sigma += sigma
        self.sq += sigma * sigma
        self.cross += sigma * hit
        ms, mh = self.sigma / self.n, self.hits / self.n
        var = self.sq / self.n - ms * ms
        if self.n < 2 or var <= 1e-12 * max(ms * ms, 1e-12):      # one σ so far (or all equal): no slope
            self.line = None
            return
        c1 = max(0.0, (self.cross / self.n - ms * mh) / var)
        self.line = (mh - c1 * ms, c1)

    def rho(self) -> float:
        return self.hits / self.sigma if self.sigma > 0 else 1.0

    def __call__(self, sigmas) -> np.ndarray:
        s = np.asarray(sigmas, float)
        if self.line is None:
            return np.minimum(1.0, self.rho() * s)
        return np.clip(self.line[0] + self.line[1] * s, 0.0, 1.0)


class Verdict:
    """What a model's requests have learnt of its draft's acceptance under one set of sampling rules (SpecModel.
    verdict: every unseeded request with those rules reads and extends the same one, as they share the costs): the
    first and the chained positions' calibrations, the recent first-position confidences σ_1 drafting_pays judges
    by, the per-depth factors, the deepest run a verify accepted, and the probe gap while drafting does not pay.

    Why pooled (issue 38, third session): with a calibration per request every request re-explored -- a forced
    first round, then probes after 1, 2, 4, 8, ... plain steps -- although the model's earlier requests had
    already found that drafting does not pay; at temperature 1 on the trained tiny model's code (acceptance near
    the break-even) those rounds, most of them a draft step wasted on a k = 0 round, cost 6-8% of a 96-token
    request. The calibration is a function of the draft's confidence σ, so it carries over between requests; the
    sampling rules change q (and with it σ and the sampled acceptance Σ min(p, q)), hence one verdict per rules."""

    def __init__(self):
        self.first = _Calibration()    # first positions: every round's (σ_1, first-position acceptance)
        self.chained = _Calibration()  # chained positions i ≥ 2 that a verify reached (σ_i, accepted)
        self.depth = 0                 # the deepest position a verify has accepted so far
        self.first_sigmas: deque[float] = deque(maxlen=WINDOW)    # the recent rounds' σ_1
        self.depth_hits: dict[int, float] = {}  # per chained position j: Σ accepted, Σ predicted (_depth_factors)
        self.depth_pred: dict[int, float] = {}
        self.gap, self.skipped = 1, 0  # plain steps between probes while drafting does not pay (doubling)
        self.off = False               # drafting_pays said no at the last check, and no round has drafted since


class Scheduler:
    """Chooses each round's k from the model's costs and the acceptance its requests learnt under the same
    sampling rules (a Verdict, pooled; a seeded request's own), no tuned constants (seed 000 §4.4), for every
    draft (MTP, DSpark).

    A round of k drafts yields E(k) = 1 + Σ_{j≤k} a_j tokens on average, a_j = Π_{i≤j} c_i(σ_i) the survival of
    the first j drafts; σ_i is the draft's confidence at position i (MTP: the largest probability of its
    distribution q_i; DSpark: its confidence head, σ(c_i)), and c_i the verdict's calibration of σ to an acceptance probability (_Calibration: the
    least-squares line hit ≈ c0 + c1·σ, c1 ≥ 0, clipped to [0, 1]; ρ·σ with ρ = Σ hit / Σ σ until two samples
    differ in σ). Two calibrations: the first position's, from every round (its acceptance is known from verify
    row 0 even when it is not verified: [argmax p = argmax q] greedy, Σ min(p, q) sampled), and the chained
    positions', from every position i ≥ 2 a verify reached (the ones before it accepted: an unbiased sample of
    its conditional acceptance), the first's until it has a sample, rescaled per depth j by κ_j = Σ hits / Σ
    predicted over the positions ≥ j reached (_depth_factors). Why not ρ·σ alone, as first written: on the
    trained tiny model a first draft with σ < 0.2 is still accepted 34% of the time and one with σ > 0.9 93%
    (a line through the origin under-rates the many unconfident drafts and over-rates the confident ones), and
    chained drafts, made from the block's own output state, were kept far less often than the first position's
    calibration predicted (rounds of 16: 12.4 predicted, 1.5 kept; docs/spec.md "The scheduler").
    A round costs the draft steps spent, verify(1 + k) and the MTP rows its E tokens leave for the next draft
    step (m·E, MeasuredCosts.catch_up); a plain step costs plain(). Decisions, each before the token it concerns
    is drawn (a sampled round must not pick its drafts by their values, or rejection sampling stops being exact):
    - draft at all only if drafting pays (drafting_pays: over the σ_1 seen so far, rounds decided as include()
      would, k = 1 or a wasted draft at k = 0, out-earn plain steps), else probe after 1, 2, 4, ... plain steps
      (the gap doubles while drafting does not pay, up to WINDOW, and resets when it does; the gap is the
      verdict's, so a new request continues it instead of probing after 1, 2, 4, ... again). It was the
      acceptance's UCB1 bound (mean + sqrt(2 ln decisions / rounds)): over a 96-token answer the bonus stays
      ~0.5, so the scheduler drafted every round near break-even and paid a draft step (~15% of a plain step on
      the trained tiny model) on each round whose σ_1 then said k = 0;
    - with q_i computed, verify position i only if it raises E / T: (E(i−1) + a_i) / (spent + verify(1 + i))
      > E(i−1) / (spent + verify(i)), and only up to one position beyond the longest run of drafts a verify has
      accepted so far in this request (the horizon grows as runs are accepted: a deep chain is tried only after
      the one below it has paid);
    - with d_i drawn, compute q_{i+1} (one more chained step) only if even a_{i+1} = a_i (the best it can be)
      would pay for that step and the longer verify.
    Bootstrap (no cost line yet): the first round drafts and verifies BOOTSTRAP_DRAFTS positions, the next is a
    plain step, which gives the verify line its two points (r = 1 and r = 1 + BOOTSTRAP_DRAFTS; later rounds add
    the counts they choose). Timing only changes k: greedy tokens are the same for every k, and a seeded sampled
    request uses ByteCosts. `fixed_k` replaces all of this by k = fixed_k drafts every round (as far as k_max
    allows): for benchmarks and tests."""

    # The bootstrap round's length. It was k_max (16 on the reference): 15 chained draft steps and a 17-row
    # verify cost ~8 plain steps on the CPU for ~1.5-2 tokens, 5-10% of a 64..128-token answer, before the
    # scheduler had a cost to decide with. Two drafts give the line a second point two rows away from the
    # plain step's, for one chained step.
    BOOTSTRAP_DRAFTS = 2

    def __init__(self, costs, k_max: int, fixed_k: int | None = None, verdict: Verdict | None = None):
        self.costs, self.k_max, self.fixed_k = costs, k_max, fixed_k
        self.verdict = Verdict() if verdict is None else verdict   # pooled with the model's requests, or its own
        # this request's own counts (what it measured; the verdict's calibrations are pooled)
        self.first_hits = 0.0          # Σ first-position acceptance (probability, or 0/1 greedy)
        self.first_sigma = 0.0         # Σ σ_1 over the same rounds
        self.first_rounds = 0
        self.chained_hits, self.chained_n = 0.0, 0    # chained positions a verify reached, accepted
        self.decisions = 0
        self.probing = False           # the round being decided is a probe (include() verifies its first draft)

    @property
    def first(self) -> _Calibration:
        return self.verdict.first

    @property
    def chained(self) -> _Calibration:
        return self.verdict.chained

    @property
    def gap(self) -> int:
        return self.verdict.gap

    def rho(self) -> float:
        return self.first_hits / self.first_sigma if self.first_sigma > 0 else 1.0

    def calibrated(self, sigmas: Sequence[float]) -> np.ndarray:
        """The acceptance probability of the drafts at positions 1..len(sigmas), given the ones before were
        accepted (see the class docstring): the first position's calibration for σ_1, the chained positions' for
        the rest (the first position's until a verify has reached a chained position)."""
        first = self.first(sigmas[:1])
        rest = (self.chained if self.chained.n else self.first)(sigmas[1:])
        return np.concatenate([first, np.minimum(1.0, rest * self._depth_factors(len(rest)))])

    def _depth_factors(self, n: int) -> np.ndarray:
        """κ_j for chained positions j = 2..n+1: Σ hits / Σ predicted acceptance over the positions ≥ j a verify
        reached (each prediction the calibration's at the time, before its own sample), a pseudo-count of one
        each; positions deeper than any reached take the deepest κ. Why: the chained line pools every depth, and
        a draft chained from its own outputs drifts further at every step; on prose rounds of 6 drafts were
        predicted to yield 4.2 tokens and yielded 2.4 (docs/spec.md "The scheduler")."""
        out = np.ones(n)
        v = self.verdict
        if not n or not v.depth_pred:
            return out
        hits = pred = 0.0
        top = max(v.depth_pred)
        kappa = {}
        for j in range(top, 1, -1):               # suffix sums: positions ≥ j
            hits += v.depth_hits.get(j, 0.0)
            pred += v.depth_pred.get(j, 0.0)
            kappa[j] = (hits + 1.0) / (pred + 1.0)
        for i in range(n):
            out[i] = kappa.get(min(i + 2, top), 1.0)
        return out

    def _expected(self, sigmas: Sequence[float]) -> tuple[float, float]:
        """(E(j), a_j) for the j = len(sigmas) positions so far."""
        a = np.cumprod(self.calibrated(sigmas))
        return 1.0 + float(a.sum()), float(a[-1])

    def _spent(self, j: int) -> float:
        """Draft cost of computing q_1..q_j."""
        return self.costs.draft(True) + (j - 1) * self.costs.draft(False)

    def _free(self) -> bool:
        """Bootstrap or a fixed k: positions are taken as far as allowed."""
        return self.fixed_k is not None or not self.costs.known()

    def _free_k(self) -> int:
        return min(self.k_max, self.BOOTSTRAP_DRAFTS if self.fixed_k is None else self.fixed_k)

    def should_draft(self, k_max: int) -> bool:
        self.decisions += 1
        if k_max < 1 or self.fixed_k is not None:
            return k_max >= 1 and bool(self.fixed_k)
        v = self.verdict
        self.probing = False
        if v.off and v.skipped < v.gap:
            # drafting did not pay at the last check and nothing but plain steps' times came in since: plain until
            # the next probe, without re-checking. Why: the check (drafting_pays over the recent σ_1, the cost
            # line's refit after every timed step) cost ~0.14 ms a plain step, ~2% of a plain step of the trained
            # tiny model on the CPU, which a scheduler that had turned drafting off paid on every token (issue 38,
            # fifth session). A drafting round's new evidence clears `off` (record()).
            v.skipped += 1
            return False
        if not self.costs.known():
            return not self.costs.verified()          # bootstrap: a short block, then one plain row
        if v.first.n == 0:                         # nothing known of the draft under these rules: try it
            self.probing = True
            return True
        v.off = False
        if self.drafting_pays():
            v.gap, v.skipped = 1, 0
            # re-time a plain step now and then (MeasuredCosts.plain_due): rounds are judged against it
            return not self.costs.plain_due()
        if v.skipped >= v.gap:                     # a probe: the calibration and the costs may have moved
            # the gap doubles up to WINDOW plain steps: a verdict pooled over the model's requests is re-checked
            # at least that often (a probe costs about a draft step and a verify row beyond a plain step: < 1%)
            v.gap, v.skipped = min(2 * v.gap, WINDOW), 0
            self.probing = True
            return True
        v.skipped += 1
        v.off = True
        return False

    def drafting_pays(self) -> bool:
        """Does a round that drafts q_1 out-earn plain steps, over the first-position confidences σ_1 seen so far
        (each round's value as include() would decide it: k = 1 at E = 1 + c(σ_1) tokens, or the draft step
        wasted on a k = 0 round)? The long-run rate Σ tokens / Σ cost against 1 / plain(). Positions beyond the
        first only add (include() takes them only when they raise the rate), so this errs toward plain."""
        c = self.first(self.verdict.first_sigmas)
        spent = self._spent(1)
        one, zero = self._round(spent, 2, 1 + c), self._round(spent, 1, 1.0)
        take = ((1 + c) / one > 1 / zero) & (c * self.costs.plain() > one - zero)      # as include() decides
        tokens = np.where(take, 1 + c, 1.0).sum()
        cost = np.where(take, one, zero).sum()
        return tokens / cost > 1 / self.costs.plain()

    def expected_round(self, acceptance: Sequence[float]) -> tuple[float, float]:
        """(tokens, cost) of a round that drafts and verifies k = len(acceptance) positions, acceptance[i] the
        probability that draft i + 1 is accepted given the ones before it were: E = 1 + Σ_j Π_{i≤j} a_i tokens
        on average, and the cost include() weighs (k draft steps, verify(1 + k), the MTP catch-up of E tokens); a
        plain step for k = 0. Its speed-up over plain decoding is E · plain() / cost."""
        if not len(acceptance):
            return 1.0, self.costs.plain()
        E = 1.0 + float(np.cumprod(np.asarray(acceptance, float)).sum())
        return E, self._round(self._spent(len(acceptance)), 1 + len(acceptance), E)

    def _round(self, spent: float, rows: int, tokens: float) -> float:
        """A round's cost: its draft steps, the verify of `rows` rows, the MTP rows its `tokens` leave for the
        next draft step to catch up (a plain step's row is charged nothing: plain decoding, the baseline, runs
        no MTP block) and the round's host work beyond its steps (costs.overhead())."""
        return spent + self.costs.verify(rows) + self.costs.catch_up() * tokens + self.costs.overhead()

    def include(self, sigmas: Sequence[float]) -> bool:
        """q_i is known (σ_i = sigmas[-1]): verify position i? A probe verifies its first draft whatever σ_1
        says while fewer than RECENT verifies of 2 rows were timed. Why (issue 38, fifth session): verify(2) is
        timed only by rounds that verify a draft; with one slow sample (the bootstrap's 3-row verify, cold) the
        cost line read verify(2) at ~2x a plain step, a break-even acceptance above 1, so no round verified a
        draft again and the estimate was never refreshed (lockstep, trained tiny model). Not always: on
        bench/spec_replay.py's virtual clock, probes that always verified cost code greedy 1% (0.953 vs 0.964x).
        Not where the calibration predicts no acceptance at all (random weights: a verify row would only cost)."""
        i = len(sigmas)
        if self._free():
            return i <= self._free_k()
        if i == 1 and self.probing and self.costs.timed(2) < RECENT:
            return bool(self.calibrated(sigmas)[0] > 0)      # unless it is predicted never to be kept
        if i > self.verdict.depth + 1:  # one position beyond the deepest one accepted so far, no further
            return False
        E, a = self._expected(sigmas)
        spent = self._spent(i)
        return self._extends(E - a, self._round(spent, i, E - a), a, self._round(spent, 1 + i, E))

    def keep_drafting(self, sigmas: Sequence[float], k_max: int) -> bool:
        """d_i is drawn: compute q_{i+1}?"""
        i = len(sigmas)
        if i >= k_max or (self.fixed_k is not None and i >= self.fixed_k):
            return False
        if self._free():
            return i < self._free_k()
        if i >= self.verdict.depth + 1:
            return False
        E, a = self._expected(sigmas)
        spent = self._spent(i)
        return self._extends(E, self._round(spent, i + 1, E), a, self._round(spent + self.costs.draft(False), i + 2,
                                                                               E + a))

    def _extends(self, tokens: float, cost: float, more: float, cost_more: float) -> bool:
        """Is a round of `tokens` expected tokens for `cost` worth extending to tokens + more for cost_more? Only
        if the extension raises the round's rate and earns at least plain decoding's rate 1 / plain(): the time a
        position costs could decode plainly instead. Why the second test (issue 38, fourth session): a round's
        rate so far can be below plain (its first draft step is spent; σ_1 said little), and a position that beat
        such a round's rate was taken although it earned less than the plain steps the same time buys: on the
        trained tiny model's prose (first-draft acceptance 0.64 at a CPU break-even of 0.63-0.94) the scheduler
        verified 1.64 positions a round at chained acceptance 0.64 and lost 8% where k = 1 lost 1%."""
        extra = cost_more - cost
        return ((tokens + more) / cost_more > tokens / cost) and more * self.costs.plain() > extra

    def record(self, first_hit: float, sigma1: float) -> None:
        self.first_hits += first_hit
        self.first_sigma += sigma1
        self.first_rounds += 1
        self.verdict.first.add(float(sigma1), float(first_hit))
        self.verdict.first_sigmas.append(float(sigma1))
        self.verdict.off = False       # new evidence: the next decision re-checks drafting_pays

    def accepted_run(self, a: int) -> None:
        """A verify accepted the drafts at positions 1..a."""
        self.verdict.depth = max(self.verdict.depth, a)

    def record_chained(self, sigma: float, hit: float, position: int = 2) -> None:
        """A chained position (i ≥ 2) a verify reached (the drafts before it accepted): its σ_i and whether it
        was accepted."""
        v = self.verdict
        c = v.chained if v.chained.n else v.first
        v.depth_pred[position] = v.depth_pred.get(position, 0.0) + float(c([sigma])[0])
        v.depth_hits[position] = v.depth_hits.get(position, 0.0) + float(hit)
        v.chained.add(float(sigma), float(hit))
        self.chained_hits += float(hit)
        self.chained_n += 1
