"""Speculative decoding with V4.1's DSpark draft (docs/dspark.md): one draft call proposes up to B tokens, one main
step verifies 1 + k rows, the agreeing prefix is kept; the same session / server interface as ds4py.spec's MTP
speculation (SpecModel / SpecRequest), and the same acceptance rules.

    spec = DSparkSpec(model, model.open_dspark())   # ds4py.drafts.speculative does this for a V4.1 file with a draft
    session = Session(spec, tokenizer)              # generate() runs rounds through spec.new_request

A round at main position n (the state holds n tokens; `token` was sampled last and is not fed yet):
 1. draft: one call on the rings (they hold main positions up to n − 1, every one fed by a main step): the block
    of B positions after n − 1 with block token 0 = `token`; for i = 0, 1, .. the Markov bias of out_i gives q_{i+1}
    and the confidence c_i; position i + 1 is included while the scheduler says it pays (decided from c_i, before
    d_{i+1} is drawn), d_{i+1} drawn from q_{i+1} (greedy: its argmax), out_{i+1} = d_{i+1};
 2. verify: one main step of [token, d_1..d_k] with all logits and the draft taps of every row (step_taps);
 3. accept as ds4py.spec (greedy: the target's argmax; sampled: rejection sampling from the draft's own q);
 4. truncate the main state to n + 1 + a and write the a + 1 accepted rows' taps into the rings: one ring write
    per accepted main position, so the rings always hold exactly the main positions fed (never drafts).
Greedy output is byte-identical to plain greedy decoding for every k (row-stable verify rows, exact truncate).

The scheduler (ConfidenceScheduler) reads the draft's confidence: a_j = Π_{i<j} min(1, ρ·σ(c_i)) with ρ the
request's calibration (first-position hits over Σ σ(c_0)), k* = argmax_k (1 + Σ_{j≤k} a_j) / (c_draft + v(1 + k)),
v(r) = c_v1 + c_tok·r the verify cost; costs measured per request (greedy and unseeded sampled; the files' bytes
until the request has measured them), a seeded sampled request uses the bytes throughout (its text must not depend
on timing). A draft that never hits calibrates ρ to 0: k = 0 (one verify row, as a plain step).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ds4py.errors import Ds4Error
from ds4py.contract import Capabilities
from ds4py.sampling import Sampler, SamplingParams
from ds4py.spec import (ByteCosts, Draft, MeasuredCosts, RequestRounds, Round, SpecStats,
                        decode_pair, encode_pair, pair_fingerprint)

F32 = np.float32


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class DSparkState:
    """A main state and its draft's rings, always at the same position (n_tokens); copy / truncate keep them so."""

    def __init__(self, main, draft):
        self.main, self.draft = main, draft

    @property
    def n_tokens(self) -> int:
        return self.main.n_tokens

    @property
    def n_written(self) -> int:
        return self.main.n_written

    @property
    def layout(self):
        return self.main.layout

    @property
    def rollback_floor(self) -> int:
        return max(self.main.rollback_floor, self.draft.rollback_floor)

    def truncate(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise Ds4Error(f"truncate needs an integer token count, got {n!r}")
        n = int(n)
        if 0 <= n <= self.n_tokens and n < self.draft.rollback_floor:
            raise Ds4Error(f"cannot roll back to {n} tokens: the DSpark rings cannot follow that far, "
                           f"{self.rollback_floor} is the earliest; keep a copy() for deeper rollbacks")
        self.main.truncate(n)                      # raises its one-sentence error, changes nothing
        self.draft.truncate(n)

    def copy(self) -> "DSparkState":
        return DSparkState(self.main.copy(), self.draft.copy())

    def nbytes(self) -> int:
        return int(self.main.nbytes() + self.draft.nbytes())


@dataclass
class DSparkDraft(Draft):
    """Draft (ds4py.spec) plus the first position's confidence σ(c_0) (the scheduler's calibration)."""
    sigma0: float = 0.0


class DraftCosts:
    """A request's costs for the scheduler: what it has measured once it knows them (MeasuredCosts: the mean draft
    call, the verify line a + b·r), the files' bytes (ByteCosts) before that. Only the ratios matter (k* is a
    ratio's argmax), so the two are never mixed in one decision."""

    deterministic = False

    def __init__(self, measured: MeasuredCosts, by_bytes: ByteCosts):
        self.m, self.b = measured, by_bytes

    def _use(self):
        return self.m if self.m.known() else self.b

    def observe_plain(self, seconds: float) -> None:
        self.m.observe_plain(seconds)

    def observe_draft(self, first: bool, seconds: float) -> None:
        self.m.observe_draft(first, seconds)

    def observe_verify(self, rows: int, seconds: float) -> None:
        self.m.observe_verify(rows, seconds)

    def verify(self, rows: int) -> float:
        return self._use().verify(rows)

    def plain(self) -> float:
        return self._use().plain()

    def draft(self, first: bool = True) -> float:
        return self._use().draft(True)


class ConfidenceScheduler:
    """k per round from the draft's confidence (module docstring). Decisions, each before the token it concerns is
    drawn: call the draft at all (an optimistic first-position rate, UCB1, against a plain step: a request whose
    drafts keep failing probes O(log n) calls); with c_{j−1} known, include position j while it raises
    E(j) / (c_draft + v(1 + j)): the survival never grows with j and v is linear, so the first position that does
    not raise the rate ends the argmax (the rate after it is a mediant of the rate before and a_j / c_tok).
    fixed_k: k = fixed_k every round (benchmarks, tests)."""

    def __init__(self, costs, k_max: int, fixed_k: int | None = None):
        self.costs, self.k_max, self.fixed_k = costs, k_max, fixed_k
        self.first_hits = 0.0          # Σ first-position acceptance (0/1 greedy, Σ min(p, q) sampled)
        self.first_sigma = 0.0         # Σ σ(c_0) over the same calls
        self.calls = 0
        self.decisions = 0

    def rho(self) -> float:
        return self.first_hits / self.first_sigma if self.first_sigma > 0 else 1.0

    def survival(self, sigmas: Sequence[float]) -> np.ndarray:
        """a_1..a_j for confidences σ(c_0)..σ(c_{j−1})."""
        return np.cumprod(np.minimum(1.0, self.rho() * np.asarray(sigmas, float)))

    def rate(self, sigmas: Sequence[float]) -> float:
        """(1 + Σ_{j≤k} a_j) / (c_draft + v(1 + k)), k = len(sigmas)."""
        c = self.costs
        return (1.0 + float(self.survival(sigmas).sum())) / (c.draft(True) + c.verify(1 + len(sigmas)))

    def should_draft(self, k_max: int) -> bool:
        self.decisions += 1
        if k_max < 1 or self.fixed_k is not None:
            return k_max >= 1 and bool(self.fixed_k)
        if self.calls == 0:
            return True
        ucb = min(1.0, self.first_hits / self.calls + math.sqrt(2 * math.log(self.decisions) / self.calls))
        return (1 + ucb) / (self.costs.draft(True) + self.costs.verify(2)) > 1 / self.costs.plain()

    def include(self, sigmas: Sequence[float], k_max: int) -> bool:
        """σ(c_{j−1}) = sigmas[-1] is known: verify position j = len(sigmas)?"""
        j = len(sigmas)
        if j > k_max:
            return False
        if self.fixed_k is not None:
            return j <= self.fixed_k
        return self.rate(sigmas) > self.rate(sigmas[:-1])

    def record(self, first_hit: float, sigma0: float) -> None:
        self.first_hits += first_hit
        self.first_sigma += sigma0
        self.calls += 1


class DSparkSpec:
    """A V4.1 model with its DSpark draft, usable wherever a model is stepped (Session, the server): `step` runs
    the main step with the draft taps and writes them into the rings; `verify` is a round's main step;
    `new_request` gives a request's round runner. save_state / load_state write the pair (the main state and the
    rings) as one DS4PYSP blob under the pair's fingerprint."""

    def __init__(self, model, draft, fixed_k: int | None = None):
        if fixed_k is not None and (isinstance(fixed_k, bool) or not isinstance(fixed_k, int) or fixed_k < 0):
            raise Ds4Error(f"a fixed draft length must be an integer >= 0, got {fixed_k!r}")
        self.model, self.draft, self.fixed_k = model, draft, fixed_k
        self.config, self.backend, self.numerics = model.config, model.backend, model.numerics
        self.path, self.layout, self.gguf, self.stack = model.path, model.layout, model.gguf, model.stack
        self.startup = model.startup
        # steps here are host steps with host sampling (no device-side generation, nothing to count)
        self.capabilities = Capabilities(emulated=model.capabilities.emulated)
        self.stable_rows = model.stable_rows
        self.base_fingerprint = model.fingerprint
        self.fingerprint = pair_fingerprint(model.fingerprint, "dspark:" + draft.fingerprint)
        self.rollback_horizon = R = model.rollback_horizon
        self.k_max = max(0, min(draft.block_size, R, model.stable_rows - 1))
        self.stats = SpecStats()
        self._byte_costs: ByteCosts | None = None

    # ---- the model interface ---------------------------------------------------------------------------------
    def new_state(self) -> DSparkState:
        return DSparkState(self.model.new_state(), self.draft.new_state())

    def _mains(self, states) -> list:
        if isinstance(states, (str, bytes)) or not isinstance(states, Sequence):
            raise Ds4Error("step takes a list of states and a list of token-id chunks")
        for s in states:
            if not isinstance(s, DSparkState):
                raise Ds4Error(f"a DSpark speculative model steps its own states (new_state()), got {type(s).__name__}")
        return [s.main for s in states]

    def step(self, states: Sequence[DSparkState], chunks: Sequence[Sequence[int]], all_logits: bool = False,
             timing: dict | None = None) -> list[np.ndarray]:
        t0 = time.perf_counter()
        logits, taps = self.model.step_taps(self._mains(states), chunks, all_logits)
        t1 = time.perf_counter()
        self.draft.feed([s.draft for s in states], taps)
        if timing is not None:
            timing["main"], timing["total"] = t1 - t0, time.perf_counter() - t0
        return logits

    def verify(self, states: Sequence[DSparkState], chunks: Sequence[Sequence[int]]):
        """A round's main step of each state's [token, d_1..d_k]: (all rows' logits, their draft taps); the rings
        are written by the round's finish, for the accepted rows only."""
        return self.model.step_taps(self._mains(states), chunks, all_logits=True)

    def prefill(self, state: DSparkState, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        return self.step([state], [ids], all_logits)[0]

    def decode(self, state: DSparkState, token: int) -> np.ndarray:
        return self.step([state], [[token]])[0]

    def weight_bytes_per_token(self) -> int:
        return self.model.weight_bytes_per_token()

    def weight_bytes(self):
        return self.model.weight_bytes()

    def has_mtp_block(self) -> bool:
        return False                     # its draft is DSpark's, in the model file (not V4's MTP block)

    def save_state(self, state: DSparkState) -> bytes:
        self._mains([state])
        return encode_pair(self.fingerprint, self.model.save_state(state.main), self.draft.save_state(state.draft),
                           np.zeros(0, F32), np.zeros(0, np.int64))

    def load_state(self, data) -> DSparkState:
        main, draft, _, _ = decode_pair(data, self.fingerprint)
        m, d = self.model.load_state(main), self.draft.load_state(draft)
        if d.n_tokens != m.n_tokens:
            raise Ds4Error(f"this speculative state is inconsistent: the DSpark rings hold {d.n_tokens} positions, "
                           f"the main state {m.n_tokens}")
        return DSparkState(m, d)

    def new_request(self, params: SamplingParams, suppress: Sequence[int] = ()) -> "DSparkRequest":
        return DSparkRequest(self, params, suppress)

    def byte_costs(self) -> ByteCosts:
        """The deterministic cost model from the file's bytes: a verify of r rows reads the backbone once and r
        rows' routed experts; a draft call reads the draft (call_bytes); a plain step the backbone."""
        if self._byte_costs is None:
            routed, draft = self.draft.routed_bytes_per_row(), self.draft.call_bytes()
            self._byte_costs = ByteCosts(int(self.model.weight_bytes_per_token()), int(routed), int(draft), int(draft))
        return self._byte_costs


class DSparkRequest(RequestRounds):
    """One request's DSpark rounds: the confidence scheduler (costs, calibration) and statistics; the interface
    of ds4py.spec.SpecRequest (round, draft / finish around a verify, plain_step)."""

    def __init__(self, spec: DSparkSpec, params: SamplingParams, suppress: Sequence[int] = ()):
        seeded_sampled = not params.greedy and params.seed is not None
        costs = spec.byte_costs() if seeded_sampled else DraftCosts(MeasuredCosts(), spec.byte_costs())
        super().__init__(spec, params, ConfidenceScheduler(costs, spec.k_max, spec.fixed_k), suppress)

    def draft(self, state: DSparkState, token: int, sampler: Sampler, remaining: int,
              step_plain: bool = True) -> "Round | DSparkDraft | None":
        """Phase 1: a DSparkDraft whose chunk ([token, d_1..d_k]) the caller verifies (DSparkSpec.verify) and hands
        to finish(); or, when the scheduler decodes plainly, the whole round (a plain step, done here), or None
        with step_plain=False (the caller steps `token` through DSparkSpec.step and reports it with plain_step)."""
        sp, sched, cfg = self.spec, self.scheduler, self.spec.config
        st = SpecStats()
        n = state.n_tokens
        k_max = min(sp.k_max, remaining - 1, cfg.context_length - n - 1)
        if n < 1 or not sched.should_draft(k_max):
            return self._plain_round(state, token, sampler) if step_plain else None
        t0 = time.perf_counter()
        blk = sp.draft.block(state.draft, token)
        st.draft_steps = 1
        drafts, qs, sigmas, prev, q1, sigma0 = [], [], [], int(token), None, 0.0
        for i in range(blk.size):
            logits, c = blk.position(i, prev)
            q = self._draft_distribution(logits, sampler)
            if i == 0:
                q1, sigma0 = q, sigmoid(c)
            sigmas.append(sigmoid(c))
            if not sched.include(sigmas, k_max):     # decided on c_i (and the drafts so far), before d_{i+1}
                break
            prev = int(np.argmax(q)) if sampler.params.greedy else sampler.draw(q)
            drafts.append(prev)
            qs.append(q)
        sched.costs.observe_draft(True, time.perf_counter() - t0)
        return DSparkDraft(np.asarray([token] + drafts, np.int64), drafts, qs, q1, n, st, sigma0)

    def finish(self, state: DSparkState, plan: DSparkDraft, P: np.ndarray, H: np.ndarray,
               sampler: Sampler) -> Round:
        """Phases 3 and 4, after the verify step of plan.chunk gave its logits P and draft taps H."""
        return self._settle(state, plan, P, H, sampler, plan.sigma0)

    def _accepted(self, state: DSparkState, plan: DSparkDraft, H: np.ndarray, a: int) -> None:
        self.spec.draft.feed([state.draft], [H[:a + 1]])       # one ring write per accepted main position
