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

k is chosen per round by `Scheduler` from the model's measured costs (shared by its requests: costs belong to
the model and the machine) and the request's own acceptance calibration (seed 000 §4.4); see its docstring.
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


# ---- costs and the scheduler ------------------------------------------------------------------------------
class _Median:
    """The median of the samples so far: robust to a step the OS descheduled (on a shared machine one step in a
    few can take several times its cost, which pulled a running mean, and with it k, around)."""

    def __init__(self):
        self.samples: list[float] = []
        self._value: float | None = None

    def add(self, v: float) -> None:
        self.samples.append(v)
        self._value = None

    @property
    def n(self) -> int:
        return len(self.samples)

    def value(self) -> float | None:
        if self._value is None and self.samples:
            self._value = float(np.median(self.samples))
        return self._value


def _count_medians(rows: dict[int, list[float]]) -> list[tuple[int, float, int]]:
    """(count, median, weight) per row count; a count's first sample is a warm-up, left out once it has a second."""
    return sorted((r, float(np.median(v[1:] if len(v) > 1 else v)), len(v) - (len(v) > 1)) for r, v in rows.items())


def _line(pts: list[tuple[int, float, int]]) -> tuple[float, float] | None:
    """The weighted least-squares line t ≈ a + b·r through per-count medians (b ≥ 0: noise can tilt it, a step
    never gets cheaper with rows), or None below two counts."""
    if len(pts) < 2:
        return None
    r, t, w = (np.array(x, float) for x in zip(*pts))
    rm, tm = np.average(r, weights=w), np.average(t, weights=w)
    b = max(float(np.sum(w * (r - rm) * (t - tm)) / np.sum(w * (r - rm) ** 2)), 0.0)
    return float(tm - b * rm), b


class MeasuredCosts:
    """Costs of a model's steps on the scheduler's clock (SpecModel.costs: every unseeded request of the model
    adds its samples and reads the same estimates): a plain step (the main step; the MTP rows it
    leaves pending are caught up by the next draft), a chained draft step (running median), a first draft step
    as a line g + m·r in the r pending MTP rows it catches up (m: what the MTP block costs per decoded token,
    paid by speculative tokens and by the plain steps between rounds alike), and a verify of r rows as a line
    a + b·r through the per-count medians (weighted least squares, weight = samples; a count's first sample is a
    warm-up, left out once the count has a second).

    The verify slope is floored by the marginal cost of the best-measured extra row, median(r=2) − median(r=1)
    (every plain step times r = 1, every k = 1 round r = 2): on the trained tiny model the least-squares slope
    through few, noisy long-round counts came out 2.5–5 ms per row against ~3.6 ms measured directly, so long
    rounds looked cheap and the scheduler lost up to 13% on prose. The floor errs toward short rounds, whose
    cost is measured best."""

    deterministic = False

    def __init__(self):
        self._plain, self._first, self._chain = _Median(), _Median(), _Median()
        self._rows: dict[int, list[float]] = {}
        self._first_rows: dict[int, list[float]] = {}
        self._line: tuple[float, float] | None = None
        self._catch: tuple[float, float] | None = None
        self._stale = True

    def observe_plain(self, seconds: float) -> None:
        self._plain.add(seconds)

    def observe_draft(self, first: bool, seconds: float, rows: int = 1) -> None:
        """A draft step's time; a first one also ran `rows` pending MTP rows (the last one gives its logits)."""
        (self._first if first else self._chain).add(seconds)
        if first:
            self._first_rows.setdefault(rows, []).append(seconds)
            self._stale = True

    def observe_verify(self, rows: int, seconds: float) -> None:
        self._rows.setdefault(rows, []).append(seconds)
        self._stale = True

    def _refit(self) -> None:
        if not self._stale:
            return
        self._stale = False
        pts = _count_medians(self._rows)
        line = _line(pts)
        if line is not None:
            med = {r: (t, w) for r, t, w in pts}
            if 1 in med and 2 in med and min(med[1][1], med[2][1]) >= 2:
                floor = med[2][0] - med[1][0]
                if floor > line[1]:            # pivot the line about its weighted centre onto the floor slope
                    r, t, w = (np.array(x, float) for x in zip(*pts))
                    rm, tm = np.average(r, weights=w), np.average(t, weights=w)
                    line = (float(tm - floor * rm), float(floor))
        self._line = line
        self._catch = _line(_count_medians(self._first_rows))

    def line(self) -> tuple[float, float] | None:
        self._refit()
        return self._line

    def catch_up(self) -> float:
        """m: the first draft step's cost per pending MTP row (0 until two row counts are measured)."""
        self._refit()
        return self._catch[1] if self._catch is not None else 0.0

    def verified(self) -> bool:
        return bool(self._rows)

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


class ByteCosts:
    """Deterministic costs for a seeded sampled request (its tokens depend on the drafts, so its k must not
    depend on the clock): the bytes each step reads, the decode roofline. A verify of r rows reads the dense
    weights once and r rows' routed experts (no sharing assumed); a first draft step reads the draft (MTP: the
    block and the head), a chained one `chain_bytes` (MTP: the same; DSpark: nothing, its block holds every
    position); a plain step the model and what the draft reads per main row beyond the head (MTP: its catch-up
    row)."""

    deterministic = True

    def __init__(self, main_bytes: int, routed_bytes: int, draft_bytes: int, head_bytes: int,
                 chain_bytes: int | None = None):
        self.main, self.routed, self.draft_b, self.head = main_bytes, routed_bytes, draft_bytes, head_bytes
        self.chain = draft_bytes if chain_bytes is None else chain_bytes

    def observe_plain(self, seconds: float) -> None:
        pass

    def observe_draft(self, first: bool, seconds: float, rows: int = 1) -> None:
        pass

    def catch_up(self) -> float:
        return 0.0                             # plain() already counts the MTP block's row per token

    def observe_verify(self, rows: int, seconds: float) -> None:
        pass

    def verified(self) -> bool:
        return True

    def known(self) -> bool:
        return True

    def verify(self, rows: int) -> float:
        return float(self.main + (rows - 1) * self.routed)

    def plain(self) -> float:
        return float(self.main + self.draft_b - self.head)

    def draft(self, first: bool) -> float:
        return float(self.draft_b if first else self.chain)


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


class Scheduler:
    """Chooses each round's k from the model's costs and the request's acceptance, no tuned constants (seed 000
    §4.4), for every draft (MTP, DSpark).

    A round of k drafts yields E(k) = 1 + Σ_{j≤k} a_j tokens on average, a_j = Π_{i≤j} c_i(σ_i) the survival of
    the first j drafts; σ_i is the draft's confidence at position i (MTP: the largest probability of its
    distribution q_i; DSpark: its confidence head, σ(c_i)), and c_i the request's calibration of σ to an acceptance probability (_Calibration: the
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
      (the gap doubles while drafting does not pay, resets when it does): O(log n) probes. It was the
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

    def __init__(self, costs, k_max: int, fixed_k: int | None = None):
        self.costs, self.k_max, self.fixed_k = costs, k_max, fixed_k
        self.first_hits = 0.0          # Σ first-position acceptance (probability, or 0/1 greedy)
        self.first_sigma = 0.0         # Σ σ_1 over the same rounds
        self.first_rounds = 0
        self.decisions = 0
        self.first = _Calibration()    # first positions: every round's (σ_1, first-position acceptance)
        self.chained = _Calibration()  # chained positions i ≥ 2 that a verify reached (σ_i, accepted)
        self.depth = 0                 # the deepest position a verify has accepted so far
        self.first_sigmas: list[float] = []    # every recorded round's σ_1
        self.depth_hits: dict[int, float] = {}  # per chained position j: Σ accepted, Σ predicted (_depth_factors)
        self.depth_pred: dict[int, float] = {}
        self.gap, self.skipped = 1, 0  # plain steps between probes while drafting does not pay (doubling)

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
        if not n or not self.depth_pred:
            return out
        hits = pred = 0.0
        top = max(self.depth_pred)
        kappa = {}
        for j in range(top, 1, -1):               # suffix sums: positions ≥ j
            hits += self.depth_hits.get(j, 0.0)
            pred += self.depth_pred.get(j, 0.0)
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
        if not self.costs.known():
            return not self.costs.verified()          # bootstrap: a short block, then one plain row
        if self.first_rounds == 0:
            return True
        if self.drafting_pays():
            self.gap, self.skipped = 1, 0
            return True
        if self.skipped >= self.gap:               # a probe: the calibration and the costs may have moved
            self.gap, self.skipped = 2 * self.gap, 0
            return True
        self.skipped += 1
        return False

    def drafting_pays(self) -> bool:
        """Does a round that drafts q_1 out-earn plain steps, over the first-position confidences σ_1 seen so far
        (each round's value as include() would decide it: k = 1 at E = 1 + c(σ_1) tokens, or the draft step
        wasted on a k = 0 round)? The long-run rate Σ tokens / Σ cost against 1 / plain(). Positions beyond the
        first only add (include() takes them only when they raise the rate), so this errs toward plain."""
        c = self.first(self.first_sigmas)
        spent = self._spent(1)
        one, zero = self._round(spent, 2, 1 + c), self._round(spent, 1, 1.0)
        take = (1 + c) / one > 1 / zero
        tokens = np.where(take, 1 + c, 1.0).sum()
        cost = np.where(take, one, zero).sum()
        return tokens / cost > 1 / self.costs.plain()

    def _round(self, spent: float, rows: int, tokens: float) -> float:
        """A round's cost: its draft steps, the verify of `rows` rows and the MTP rows its `tokens` leave for the
        next draft step to catch up (a plain step's row is charged nothing: plain decoding, the baseline, runs
        no MTP block)."""
        return spent + self.costs.verify(rows) + self.costs.catch_up() * tokens

    def include(self, sigmas: Sequence[float]) -> bool:
        """q_i is known (σ_i = sigmas[-1]): verify position i?"""
        i = len(sigmas)
        if self._free():
            return i <= self._free_k()
        if i > self.depth + 1:          # one position beyond the deepest one accepted so far, no further
            return False
        E, a = self._expected(sigmas)
        spent = self._spent(i)
        return E / self._round(spent, 1 + i, E) > (E - a) / self._round(spent, i, E - a)

    def keep_drafting(self, sigmas: Sequence[float], k_max: int) -> bool:
        """d_i is drawn: compute q_{i+1}?"""
        i = len(sigmas)
        if i >= k_max or (self.fixed_k is not None and i >= self.fixed_k):
            return False
        if self._free():
            return i < self._free_k()
        if i >= self.depth + 1:
            return False
        E, a = self._expected(sigmas)
        spent = self._spent(i)
        more = (E + a) / self._round(spent + self.costs.draft(False), i + 2, E + a)
        return more > E / self._round(spent, i + 1, E)

    def record(self, first_hit: float, sigma1: float) -> None:
        self.first_hits += first_hit
        self.first_sigma += sigma1
        self.first_rounds += 1
        self.first.add(float(sigma1), float(first_hit))
        self.first_sigmas.append(float(sigma1))

    def accepted_run(self, a: int) -> None:
        """A verify accepted the drafts at positions 1..a."""
        self.depth = max(self.depth, a)

    def record_chained(self, sigma: float, hit: float, position: int = 2) -> None:
        """A chained position (i ≥ 2) a verify reached (the drafts before it accepted): its σ_i and whether it
        was accepted."""
        c = self.chained if self.chained.n else self.first
        self.depth_pred[position] = self.depth_pred.get(position, 0.0) + float(c([sigma])[0])
        self.depth_hits[position] = self.depth_hits.get(position, 0.0) + float(hit)
        self.chained.add(float(sigma), float(hit))


# ---- statistics -----------------------------------------------------------------------------------------
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


# ---- the model wrapper and a request's rounds -------------------------------------------------------------
class SpecModel:
    """A main model with a draft (a Drafter), usable wherever a model is stepped (Session, the server): `step`
    advances both, `verify` is a round's main step, `new_request` gives a request's round runner. save_state /
    load_state write and read the paired state as one blob (`encode_pair`: the main and the draft state blobs and
    the drafter's host ring) under the pair's `fingerprint`, so the disk KV cache (`--kv-disk-dir`) works with
    speculation; a blob of another pair, or of the main model alone, is refused in one sentence.

    `costs`: the measured costs of every request of this model (costs belong to the model and the machine; a
    request keeps only its acceptance calibration: one request's few noisy samples flipped "drafting pays" off
    for the rest of it, bench/spec_trained.py)."""

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

    def byte_costs(self) -> "ByteCosts":
        """The deterministic cost model (ByteCosts) from the bytes each part of the pair reads."""
        return self.drafter.byte_costs()


class SpecRequest:
    """One request's speculative rounds: its scheduler (the model's measured costs, or the files' bytes for a
    seeded sampled request, whose tokens must not depend on the clock; its own acceptance calibration), its
    suppressed tokens and its statistics.

    round() runs a whole round; the server splits it around one verify step shared by several requests: draft()
    (phase 1), the caller's verify (SpecModel.verify), finish() (phases 3 and 4), or plain_step() when draft()
    left the plain step to the caller."""

    def __init__(self, spec: SpecModel, params: SamplingParams, suppress: Sequence[int] = ()):
        seeded_sampled = not params.greedy and params.seed is not None
        self.spec, self.params = spec, params
        self.scheduler = Scheduler(spec.byte_costs() if seeded_sampled else spec.costs, spec.k_max, spec.fixed_k)
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
        plan = self.draft(state, token, sampler, remaining)
        if isinstance(plan, Round):
            return plan
        t0 = CLOCK()
        (P,), (H,) = self.spec.verify([state], [plan.chunk])
        self.scheduler.costs.observe_verify(len(plan.chunk), CLOCK() - t0)
        return self.finish(state, plan, P, H, sampler)

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
        if not self._prepared:
            # e.g. the MTP block catching up on the prompt's rows: not a round's cost (timed with it, it made the
            # first draft look many steps long and, never drafting again to re-measure, the scheduler decoded
            # plainly for the rest of the request)
            sp.drafter.prepare(state, token)
            self._prepared = True
        t0 = CLOCK()
        prop = sp.drafter.propose(state, token)
        sched.costs.observe_draft(True, CLOCK() - t0, prop.rows)
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
                sched.costs.observe_draft(False, CLOCK() - t0)
        finally:
            prop.close()
        return Draft(np.asarray([token] + drafts, np.int64), drafts, qs, q1, sigmas, sigma1, n,
                     SpecStats(draft_steps=prop.steps))

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
