"""Speculative decoding with a draft model: draft k tokens, verify k + 1 rows in one main step, keep the agreeing
prefix (docs/spec.md). One driver for every draft: the state pairing, the rounds, the scheduler and the costs are
here; what a draft model does differently is a `Drafter` (ds4py.mtp_spec: V4's MTP block, one token a step;
ds4py.dspark: V4.1's DSpark draft, a block of B positions a call with its own confidence).

    spec = MtpSpec(model, mtp)                   # or DSparkSpec(model, draft): a SpecModel with that Drafter
    session = Session(spec, tokenizer)           # generate() then runs speculative rounds (spec.new_request)

A round at main position n (the state holds n tokens; `token` was sampled last and is not fed yet):
 1. draft: the drafter's proposal after main position n − 1 with `token` (Drafter.propose) gives the draft
    logits of position 1; each further position's from the draft token before it (Proposal.next: a chained MTP
    step, a DSpark block position). The drafter's state only ever keeps rows of main positions;
 2. verify: one main step of [token, d_1..d_k]: k + 1 rows, all logits and what the drafter reads of each row
    (Drafter.main_step: the final hidden states for MTP, the draft taps for DSpark);
 3. accept: greedy keeps d_i while it is the target's argmax; sampled keeps d_i with probability
    min(1, p_i(d_i) / q_i(d_i)), else draws one token from normalise(max(0, p_i − q_i)) and stops; when all k
    are kept one more token comes from p_k. The round yields a + 1 tokens (a accepted drafts);
 4. truncate the main state to n + 1 + a; the drafter keeps the accepted rows (Drafter.settle).
Greedy output is byte-identical to plain greedy decoding for every k: verify rows are computed row-stably
(bit for bit the rows one-token decode steps compute, docs/engine.md) and truncate is exact. Sampled output
has exactly plain sampling's distribution (rejection sampling; tests/test_spec_sampling.py checks it).

k is chosen per round by `Scheduler` (ds4py.spec_schedule) from the model's measured costs (shared by its requests: costs belong to
the model and the machine) and the acceptance calibration its requests learnt under the same sampling rules
(spec_schedule.Verdict; seed 000 §4.4); see its docstring.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ds4py.errors import Ds4Error
from ds4py.contract import Capabilities
from ds4py.sampling import Sampler, SamplingParams, softmax
from ds4py.spec_schedule import ByteCosts, MeasuredCosts, Scheduler, Verdict

F32 = np.float32
# The clock MeasuredCosts' samples are taken with (spec.py's own steps). Wall time is what a user waits for; a
# benchmark on a machine shared with other jobs may set time.process_time instead, to measure (and schedule) as
# on a machine of its own (bench/spec_trained.py --clock cpu, with one kernel thread).
CLOCK = time.perf_counter


# ---- the draft interface ----------------------------------------------------------------------------------
class Proposal(ABC):
    """One round's draft after main position n − 1 (Drafter.propose): the first position's draft logits, then one
    position at a time from the draft token before it. `rows`: the main positions the first call caught up (its
    cost per row is the scheduler's catch-up term); `steps`: the draft model calls made so far."""

    logits: np.ndarray                 # position i's draft logits [vocab] (i = 1 after propose, then each next)
    sigma: float | None                # the draft's own confidence there in [0, 1]; None: the largest q_i
    rows: int = 1
    steps: int = 1

    @abstractmethod
    def next(self, token: int) -> None:
        """Draft token d_i is drawn: compute position i + 1 (logits, sigma)."""

    def close(self) -> None:
        """The round's drafting is over (the drafter's state must hold main positions only again)."""


class Drafter(ABC):
    """What a draft model gives the speculative driver (SpecModel / SpecRequest): its paired state, the main step
    it reads and how it is fed the positions that step made, one round's proposal, what it keeps after a verify,
    its state on disk and its bytes. Everything else (rounds, acceptance, scheduler, costs) is shared."""

    kind: str                          # "mtp" / "dspark" (what the CLI reports)
    path: str                          # the file it was read from
    fingerprint: str                   # the pair's fingerprint (pair_fingerprint of the main model's and its own)
    limit: int                         # the most drafts one round may verify (before the main model's limits)
    what: str                          # its state, in the sentence a refused rollback says

    @abstractmethod
    def new_state(self, main: Any) -> "SpecState": ...

    @abstractmethod
    def main_step(self, mains: list, chunks: Sequence[Sequence[int]], all_logits: bool) -> tuple[list, list]:
        """The main model's step with what the draft reads of each row: (logits, rows per state)."""

    @abstractmethod
    def fed(self, states: Sequence["SpecState"], chunks: Sequence[np.ndarray], rows: Sequence[np.ndarray]) -> None:
        """A plain main step fed `chunks` (every main state advanced): the draft takes their rows."""

    def prepare(self, state: "SpecState", token: int) -> None:
        """Before a request's first proposal, untimed: work that is the prompt's, not a round's."""

    @abstractmethod
    def propose(self, state: "SpecState", token: int) -> Proposal: ...

    @abstractmethod
    def settle(self, state: "SpecState", n: int, chunk: np.ndarray, rows: np.ndarray, accepted: int) -> None:
        """A verify of chunk = [token, d_1..d_k] at main position n gave `rows`; the main state now holds
        n + 1 + accepted tokens: keep what the draft needs of the true ones."""

    @abstractmethod
    def target(self, state: "SpecState", n: int) -> int:
        """The draft state's positions when the main state holds n tokens."""

    @abstractmethod
    def can_follow(self, state: "SpecState", n: int) -> bool:
        """Can the draft state follow a rollback of the main state to n tokens?"""

    @abstractmethod
    def save(self, state: "SpecState") -> tuple[bytes, np.ndarray, np.ndarray]:
        """(draft state blob, host ring h, host ring ids) for encode_pair."""

    @abstractmethod
    def load(self, main: Any, blob: bytes, h: np.ndarray, ids: np.ndarray) -> "SpecState": ...

    @abstractmethod
    def byte_costs(self) -> "ByteCosts": ...


# ---- the paired state ------------------------------------------------------------------------------------
class SpecState:
    """A main state, its draft's state and the drafter's host ring (MTP: the main model's last final HC states and
    token ids by position; None for a draft that keeps none). copy / truncate / rollback_floor keep them
    consistent (the drafter says how its state follows the main one); n_tokens is the main state's."""

    def __init__(self, drafter: Drafter, main, draft, h: np.ndarray | None = None, ids: np.ndarray | None = None):
        self.drafter, self.main, self.draft, self.h, self.ids = drafter, main, draft, h, ids

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
        n = self.main.rollback_floor
        while n < self.n_tokens and not self.drafter.can_follow(self, n):
            n += 1
        return n

    def truncate(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise Ds4Error(f"truncate needs an integer token count, got {n!r}")
        n = int(n)
        if not 0 <= n <= self.n_tokens or n < self.main.rollback_floor:
            self.main.truncate(n)                   # raises its one-sentence error, changes nothing
        if not self.drafter.can_follow(self, n):
            raise Ds4Error(f"cannot roll back to {n} tokens: the {self.drafter.what} cannot follow that far, "
                           f"{self.rollback_floor} is the earliest; keep a copy() for deeper rollbacks")
        self.main.truncate(n)
        self.draft.truncate(self.drafter.target(self, n))

    def copy(self) -> "SpecState":
        return SpecState(self.drafter, self.main.copy(), self.draft.copy(),
                         None if self.h is None else self.h.copy(), None if self.ids is None else self.ids.copy())

    def nbytes(self) -> int:
        ring = 0 if self.h is None else self.h.nbytes + self.ids.nbytes
        return int(self.main.nbytes() + self.draft.nbytes() + ring)


# ---- the paired state on disk ----------------------------------------------------------------------------
PAIR_MAGIC = b"DS4PYSP\0"
PAIR_VERSION = 1
_PAIR_PREFIX = struct.Struct("<8sIIQ")          # magic, version, header length, total length
_PAIR_TRAILER = struct.Struct("<I")             # CRC-32 of every byte before it


def pair_fingerprint(main: str, mtp: str) -> str:
    """The fingerprint of a main model with its MTP block (what a paired state and its disk checkpoints are
    keyed by): a state of one pair never loads into another, nor into the main model alone."""
    return hashlib.blake2b(f"ds4py spec pair v1\0{main}\0{mtp}".encode(), digest_size=20).hexdigest()


def encode_pair(fingerprint: str, main: bytes, draft: bytes, h: np.ndarray, ids: np.ndarray) -> bytes:
    """DS4PYSP v1: prefix (magic, version, header length, total length), JSON header {pair, sections[name,
    offset, length], ring shape}, the main state blob, the MTP state blob (each a DS4PYKV blob with its own
    fingerprint and checksum), the pending ring (h float32, ids int64), CRC-32 of everything before it."""
    h = np.ascontiguousarray(h, np.float32)
    ids = np.ascontiguousarray(ids, np.int64)
    parts = [("main", bytes(main)), ("mtp", bytes(draft)), ("h", h.tobytes()), ("ids", ids.tobytes())]
    sections, at = [], 0
    for name, b in parts:
        sections.append({"name": name, "offset": at, "length": len(b)})
        at += len(b)
    header = json.dumps({"pair": fingerprint, "sections": sections, "h_shape": list(h.shape)},
                        separators=(",", ":")).encode()
    total = _PAIR_PREFIX.size + len(header) + at + _PAIR_TRAILER.size
    body = _PAIR_PREFIX.pack(PAIR_MAGIC, PAIR_VERSION, len(header), total) + header + b"".join(b for _, b in parts)
    return body + _PAIR_TRAILER.pack(zlib.crc32(body))


def decode_pair(data, fingerprint: str) -> tuple[bytes, bytes, np.ndarray, np.ndarray]:
    """(main blob, MTP blob, h ring, ids ring) of a DS4PYSP blob saved by this pair; Ds4Error otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise Ds4Error(f"a saved state is bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B")
    if len(view) < _PAIR_PREFIX.size + _PAIR_TRAILER.size:
        raise Ds4Error(f"not a speculative (main + MTP) state: {len(view)} bytes is shorter than its header")
    magic, version, hlen, total = _PAIR_PREFIX.unpack_from(view, 0)
    if magic != PAIR_MAGIC:
        what = "a state of the main model alone" if bytes(view[:8]) == b"DS4PYKV\0" else "not a ds4py state"
        raise Ds4Error(f"this is {what}, not a speculative (main + MTP) state; open it without the MTP block")
    if version != PAIR_VERSION:
        raise Ds4Error(f"speculative state format version {version} is not supported (this ds4py reads {PAIR_VERSION})")
    if total != len(view):
        raise Ds4Error(f"the speculative state is {len(view)} bytes, its header says {total} (truncated or padded)")
    (crc,) = _PAIR_TRAILER.unpack_from(view, len(view) - _PAIR_TRAILER.size)
    if zlib.crc32(view[:len(view) - _PAIR_TRAILER.size]) != crc:
        raise Ds4Error("the speculative state is corrupt (checksum mismatch)")
    try:
        header = json.loads(bytes(view[_PAIR_PREFIX.size:_PAIR_PREFIX.size + hlen]))
        sec = {s["name"]: (int(s["offset"]), int(s["length"])) for s in header["sections"]}
        h_shape = tuple(int(v) for v in header["h_shape"])
        pair = header["pair"]
    except (ValueError, KeyError, TypeError) as e:
        raise Ds4Error(f"the speculative state's header is unreadable ({type(e).__name__})") from None
    if pair != fingerprint:
        raise Ds4Error("this speculative state was saved with another main model or MTP block (the pair's "
                       "fingerprint differs); it cannot be loaded here")
    base = _PAIR_PREFIX.size + hlen
    end = len(view) - _PAIR_TRAILER.size

    def piece(name: str) -> memoryview:
        if name not in sec or sec[name][0] < 0 or base + sum(sec[name]) > end:
            raise Ds4Error(f"the speculative state's {name} section is missing or out of bounds")
        o, n = sec[name]
        return view[base + o: base + o + n]

    hb, ib = piece("h"), piece("ids")
    if len(hb) != 4 * int(np.prod(h_shape)) or len(ib) != 8 * h_shape[0]:
        raise Ds4Error("the speculative state's pending ring does not match its declared shape")
    h = np.frombuffer(hb, np.float32).reshape(h_shape).copy()
    ids = np.frombuffer(ib, np.int64).copy()
    return bytes(piece("main")), bytes(piece("mtp")), h, ids


# ---- acceptance -------------------------------------------------------------------------------------------
def accept_greedy(target_logits: np.ndarray, drafts: Sequence[int], pick=np.argmax) -> tuple[int, int]:
    """(accepted drafts a, the next token): d_i is kept while it is row i−1's argmax (`pick`: the sampler's
    greedy choice, which also refuses invalid logits); the next token is row a's."""
    for i, d in enumerate(drafts):
        best = int(pick(target_logits[i]))
        if best != d:
            return i, best
    return len(drafts), int(pick(target_logits[len(drafts)]))


def accept_sampled(p: Sequence[np.ndarray], q: Sequence[np.ndarray], drafts: Sequence[int],
                   sampler: Sampler) -> tuple[int, int, float]:
    """Rejection sampling: (accepted a, the next token, the first draft's acceptance probability).
    p: the target's k + 1 final distributions, q: the k draft distributions the drafts were drawn from."""
    first = 1.0
    for i, d in enumerate(drafts):
        ratio = p[i][d] / q[i][d]
        if i == 0:
            first = min(1.0, float(ratio))
        if sampler.rng.random() < ratio:
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        if residual.sum() <= 0:                 # p == q up to rounding: a rejection cannot happen in exact math
            residual = p[i]
        return i, sampler.draw(residual / residual.sum()), first
    return len(drafts), sampler.draw(p[len(drafts)]), first


# ---- statistics (the costs and the scheduler: ds4py.spec_schedule) ---------------------------------------- -----------------------------------------------------------------------------------------
@dataclass
class SpecStats:
    rounds: int = 0            # verify steps with at least one draft
    drafted: int = 0           # drafts verified
    accepted: int = 0          # of those, accepted
    plain_steps: int = 0       # rounds that decoded one token without drafts
    draft_steps: int = 0       # MTP draft steps (first + chained), verified or not
    spec_tokens: int = 0       # tokens the verify rounds produced (accepted + one each)

    def add(self, other: "SpecStats") -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(other, f))

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.spec_tokens / self.rounds if self.rounds else 0.0

    @property
    def mean_k(self) -> float:
        """The draft length the scheduler chose, per decode step (a plain step counts as k = 0)."""
        steps = self.rounds + self.plain_steps
        return self.drafted / steps if steps else 0.0

    def summary(self) -> str:
        return (f"spec: {self.rounds} rounds, {self.accepted}/{self.drafted} drafts accepted "
                f"({self.acceptance:.0%}), {self.tokens_per_round:.2f} tokens/round, {self.plain_steps} plain steps, "
                f"mean k {self.mean_k:.2f}")


@dataclass
class Round:
    tokens: list[int]          # sampled tokens, in order (the last one not fed yet)
    logits: np.ndarray         # the main logits after the last fed token (what the last token was drawn from)
    stats: SpecStats = field(default_factory=SpecStats)


@dataclass
class Draft:
    """A round between its draft and its verify (SpecRequest.draft / finish): the chunk to verify and what
    acceptance and calibration need."""
    chunk: np.ndarray          # [token, d_1..d_k]
    drafts: list[int]
    qs: list[np.ndarray]       # the draft distributions d_i were drawn from
    q1: np.ndarray             # the first position's draft distribution (calibration, also when k = 0)
    sigmas: list[float]        # the draft's confidence at positions 1..k (σ_1 also when k = 0: sigma1)
    sigma1: float
    n: int                     # main positions before the round
    stats: SpecStats
    timed: float = 0.0         # seconds of its draft steps the costs already hold (round(): the rest is overhead)
    prepared: float = 0.0      # seconds of the drafter's prepare() (the prompt's work: no round's cost)


# ---- the model wrapper and a request's rounds -------------------------------------------------------------
class SpecModel:
    """A main model with a draft (a Drafter), usable wherever a model is stepped (Session, the server): `step`
    advances both, `verify` is a round's main step, `new_request` gives a request's round runner. save_state /
    load_state write and read the paired state as one blob (`encode_pair`: the main and the draft state blobs and
    the drafter's host ring) under the pair's `fingerprint`, so the disk KV cache (`--kv-disk-dir`) works with
    speculation; a blob of another pair, or of the main model alone, is refused in one sentence.

    `costs`: the measured costs of every request of this model (costs belong to the model and the machine: one
    request's few noisy samples flipped "drafting pays" off for the rest of it, bench/spec_trained.py); `verdict`:
    what its requests learnt of the draft's acceptance, per sampling rules (spec_schedule.Verdict: a request
    starts from it instead of re-exploring)."""

    def __init__(self, model, drafter: Drafter, fixed_k: int | None = None):
        if fixed_k is not None and (isinstance(fixed_k, bool) or not isinstance(fixed_k, int) or fixed_k < 0):
            raise Ds4Error(f"a fixed draft length must be an integer >= 0, got {fixed_k!r}")
        if not model.capabilities.speculation:
            raise Ds4Error(f"the {model.backend} backend cannot decode speculatively; use --no-spec")
        self.model, self.drafter, self.fixed_k = model, drafter, fixed_k
        self.config, self.backend, self.numerics = model.config, model.backend, model.numerics
        self.path, self.layout, self.gguf, self.stack = model.path, model.layout, model.gguf, model.stack
        self.startup = model.startup
        # steps here are host steps with host sampling (no device-side generation, nothing to count)
        self.capabilities = Capabilities(emulated=model.capabilities.emulated)
        self.base_fingerprint = model.fingerprint
        self.fingerprint = drafter.fingerprint
        self.rollback_horizon = R = model.rollback_horizon
        self.stable_rows = model.stable_rows
        # verify rows k + 1 row-stable and within the rollback horizon, and the draft's own limit
        self.k_max = max(0, min(R, model.stable_rows - 1, drafter.limit))
        self.costs = MeasuredCosts()                # every unseeded request's (see the class docstring)
        self._verdicts: dict[tuple, Verdict] = {}   # per sampling rules (verdict())
        self.stats = SpecStats()                    # every request's, summed

    def new_state(self) -> SpecState:
        return self.drafter.new_state(self.model.new_state())

    def weight_bytes_per_token(self) -> int:
        return self.model.weight_bytes_per_token()

    def weight_bytes(self):
        return self.model.weight_bytes()

    def has_mtp_block(self) -> bool:
        return self.drafter.kind == "mtp"

    def save_state(self, state: SpecState) -> bytes:
        """The paired state as one blob (format: encode_pair)."""
        self._check([state])
        return encode_pair(self.fingerprint, self.model.save_state(state.main), *self.drafter.save(state))

    def load_state(self, data) -> SpecState:
        main, draft, h, ids = decode_pair(data, self.fingerprint)
        return self.drafter.load(self.model.load_state(main), draft, h, ids)   # each blob checks its own model

    def _check(self, states) -> list:
        if isinstance(states, (str, bytes)) or not isinstance(states, Sequence):
            raise Ds4Error("step takes a list of states and a list of token-id chunks")
        for s in states:
            if not isinstance(s, SpecState) or s.drafter.fingerprint != self.fingerprint:
                what = type(s).__name__ if not isinstance(s, SpecState) else "a SpecState of another pair"
                raise Ds4Error(f"a speculative model steps the SpecStates of its new_state(), got {what}")
        return [s.main for s in states]

    def step(self, states: Sequence[SpecState], chunks: Sequence[Sequence[int]], all_logits: bool = False,
             timing: dict | None = None) -> list[np.ndarray]:
        t0 = CLOCK()
        logits, rows = self.drafter.main_step(self._check(states), chunks, all_logits)
        t1 = CLOCK()
        self.drafter.fed(states, [np.asarray(c, np.int64) for c in chunks], rows)
        if timing is not None:
            timing["main"], timing["total"] = t1 - t0, CLOCK() - t0
        return logits

    def verify(self, states: Sequence[SpecState], chunks: Sequence[Sequence[int]]) -> tuple[list[np.ndarray],
                                                                                        list[np.ndarray]]:
        """The verify rows of one or several rounds in one main step: every row's logits and what the draft reads
        of it (the main states only: finish() gives the drafter the rows the round keeps)."""
        return self.drafter.main_step(self._check(states), [list(c) for c in chunks], True)

    def prefill(self, state: SpecState, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        return self.step([state], [ids], all_logits)[0]

    def decode(self, state: SpecState, token: int) -> np.ndarray:
        return self.step([state], [[token]])[0]

    def new_request(self, params: SamplingParams, suppress: Sequence[int] = ()) -> "SpecRequest":
        return SpecRequest(self, params, suppress)

    def verdict(self, params: SamplingParams) -> Verdict:
        """The acceptance verdict the unseeded requests with these sampling rules share: greedy ones one, sampled
        ones one per (temperature, top-k, top-p, min-p) -- the rules that shape the draft's distribution q, its
        confidence max q and the sampled acceptance Σ min(p, q)."""
        key = ("greedy",) if params.greedy else (params.temperature, params.top_k, params.top_p, params.min_p)
        return self._verdicts.setdefault(key, Verdict())

    def byte_costs(self) -> "ByteCosts":
        """The deterministic cost model (ByteCosts) from the bytes each part of the pair reads."""
        return self.drafter.byte_costs()


class SpecRequest:
    """One request's speculative rounds: its scheduler (the model's measured costs, or the files' bytes for a
    seeded sampled request, whose tokens must not depend on the clock; the model's acceptance verdict for its
    sampling rules, or a seeded request's own), its
    suppressed tokens and its statistics.

    round() runs a whole round; the server splits it around one verify step shared by several requests: draft()
    (phase 1), the caller's verify (SpecModel.verify), finish() (phases 3 and 4), or plain_step() when draft()
    left the plain step to the caller."""

    def __init__(self, spec: SpecModel, params: SamplingParams, suppress: Sequence[int] = ()):
        seeded_sampled = not params.greedy and params.seed is not None
        self.spec, self.params = spec, params
        # a seeded sampled request's k (and with it its tokens) must depend on its seed alone: the files' bytes
        # and its own calibration; the others share the model's measured costs and its verdict for their rules
        self.scheduler = (Scheduler(spec.byte_costs(), spec.k_max, spec.fixed_k) if seeded_sampled else
                          Scheduler(spec.costs, spec.k_max, spec.fixed_k, spec.verdict(params)))
        self.suppress = np.asarray(list(suppress), np.int64)
        self.stats = SpecStats()
        self._prepared = False         # the drafter's prepare() has run (before the request's first proposal)

    def _filtered(self, logits: np.ndarray) -> np.ndarray:
        if not self.suppress.size:
            return logits
        out = np.array(logits, copy=True)
        out[..., self.suppress] = -np.inf
        return out

    def _draft_distribution(self, logits: np.ndarray, sampler: Sampler) -> np.ndarray:
        """q: the draft's own distribution under the request's sampling rules (greedy: the temperature-1
        softmax, whose argmax is the draft and whose maximum its confidence)."""
        lg = self._filtered(logits)
        return softmax(lg) if sampler.params.greedy else sampler.distribution(lg)

    def round(self, state: SpecState, token: int, sampler: Sampler, remaining: int) -> Round:
        """Feed `token` and produce up to `remaining` tokens (at least one). See the module docstring."""
        start = CLOCK()
        plan = self.draft(state, token, sampler, remaining)
        if isinstance(plan, Round):
            return plan
        t0 = CLOCK()
        (P,), (H,) = self.spec.verify([state], [plan.chunk])
        t1 = CLOCK()
        self.scheduler.costs.observe_verify(len(plan.chunk), t1 - t0)
        out = self.finish(state, plan, P, H, sampler)
        # what the round cost beyond its timed steps (the draft distributions, decisions, acceptance, rollback):
        # on the CPU reference ~0.3 ms a round, 4% of a plain step, which the model did not charge
        self.scheduler.costs.observe_overhead(CLOCK() - start - plan.timed - plan.prepared - (t1 - t0))
        return out

    def draft(self, state: SpecState, token: int, sampler: Sampler, remaining: int,
              step_plain: bool = True) -> "Round | Draft | None":
        """Phase 1 (draft) of a round: a Draft whose `chunk` ([token, d_1..d_k]) the caller verifies in one main
        step (SpecModel.verify) and hands to finish(); or, when the scheduler decodes plainly, the whole round (a
        plain step, done here), or None with step_plain=False (the caller steps `token` itself, through the
        SpecModel's step, and reports it with plain_step())."""
        sp, sched = self.spec, self.scheduler
        n = state.n_tokens
        k_max = min(sp.k_max, remaining - 1, sp.config.context_length - n - 1)
        if n < 1 or not sched.should_draft(k_max):
            return self._plain_round(state, token, sampler) if step_plain else None
        prepared = 0.0
        if not self._prepared:
            # e.g. the MTP block catching up on the prompt's rows: not a round's cost (timed with it, it made the
            # first draft look many steps long and, never drafting again to re-measure, the scheduler decoded
            # plainly for the rest of the request; left in the round's overhead, it made every round look up to
            # 4 ms dearer where most of the overhead samples were requests' first rounds, issue 38 fourth session)
            t0 = CLOCK()
            sp.drafter.prepare(state, token)
            prepared = CLOCK() - t0
            self._prepared = True
        t0 = CLOCK()
        prop = sp.drafter.propose(state, token)
        timed = CLOCK() - t0
        sched.costs.observe_draft(True, timed, prop.rows)
        drafts, sigmas, qs = [], [], []
        q1 = sigma1 = None
        try:
            while True:
                q = self._draft_distribution(prop.logits, sampler)
                sigmas.append(float(q.max()) if prop.sigma is None else float(prop.sigma))
                if q1 is None:
                    q1, sigma1 = q, sigmas[0]
                if not sched.include(sigmas):         # decided on q_i and σ_i alone, before d_i is drawn
                    sigmas.pop()
                    break
                d = int(np.argmax(q)) if sampler.params.greedy else sampler.draw(q)
                drafts.append(d)
                qs.append(q)
                if not sched.keep_drafting(sigmas, k_max):
                    break
                t0 = CLOCK()
                prop.next(d)
                dt = CLOCK() - t0
                timed += dt
                sched.costs.observe_draft(False, dt)
        finally:
            prop.close()
        return Draft(np.asarray([token] + drafts, np.int64), drafts, qs, q1, sigmas, sigma1, n,
                     SpecStats(draft_steps=prop.steps), timed, prepared)

    def finish(self, state: SpecState, plan: Draft, P: np.ndarray, H: np.ndarray, sampler: Sampler) -> Round:
        """Phases 3 and 4 of a round, after the verify step of plan.chunk gave its logits P and rows H: calibrate
        on the first position (known from row 0 even when k = 0), accept the agreeing prefix, roll back the
        rejected rows, let the drafter keep the true ones."""
        st, drafts, k = plan.stats, plan.drafts, len(plan.drafts)
        Pf = self._filtered(P)
        greedy = sampler.params.greedy
        p = [sampler.distribution(row) for row in (Pf[:1] if greedy else Pf)]
        q1 = plan.q1
        first = float(np.argmax(p[0]) == np.argmax(q1)) if greedy else float(np.minimum(p[0], q1).sum())
        self.scheduler.record(first, plan.sigma1)
        if k == 0:
            self.spec.drafter.settle(state, plan.n, plan.chunk, H, 0)
            st.plain_steps = 1
            return self._done(Round([self._sample(P[0], sampler)], P[0], st))
        if greedy:
            a, nxt = accept_greedy(Pf, drafts, sampler.sample)
        else:
            a, nxt, _ = accept_sampled(p, plan.qs, drafts, sampler)
        state.main.truncate(plan.n + 1 + a)
        self.spec.drafter.settle(state, plan.n, plan.chunk, H, a)
        st.rounds, st.drafted, st.accepted, st.spec_tokens = 1, k, a, a + 1
        self.scheduler.accepted_run(a)
        for i in range(1, min(a + 1, k)):                   # chained positions the verify reached
            self.scheduler.record_chained(plan.sigmas[i], float(i < a), i + 1)
        return self._done(Round(drafts[:a] + [nxt], P[a], st))

    def _plain_round(self, state: SpecState, token: int, sampler: Sampler) -> Round:
        """A round without drafts: one plain step of `token`, timed for the scheduler's costs."""
        timing: dict = {}
        logits = self.spec.step([state], [[token]], timing=timing)[0]
        self.scheduler.costs.observe_plain(timing["total"])
        self.scheduler.costs.observe_verify(1, timing["main"])
        return self._done(Round([self._sample(logits, sampler)], logits, SpecStats(plain_steps=1)))

    def plain_step(self, seconds: float) -> None:
        """A plain step the caller ran (draft(..., step_plain=False) gave None) and how long it took."""
        self.scheduler.costs.observe_plain(seconds)
        self.scheduler.costs.observe_verify(1, seconds)
        self._done(Round([], np.zeros(0, F32), SpecStats(plain_steps=1)))

    def _sample(self, logits: np.ndarray, sampler: Sampler) -> int:
        return sampler.sample(self._filtered(logits))

    def _done(self, r: Round) -> Round:
        self.stats.add(r.stats)
        self.spec.stats.add(r.stats)
        return r
