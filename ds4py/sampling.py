"""Token sampling: temperature, then top-k, then top-p, then min-p, then one draw from a seeded generator.

Order. Temperature divides the logits first, so every truncation rule sees the distribution that is actually
sampled (Hugging Face's warper order and vLLM's sampler: temperature → top-k/top-p → min-p). llama.cpp's
default chain instead truncates the untempered distribution and applies temperature last; with temperature 1
(DeepSeek V4's recommended default, top-p 1) the two orders agree. After temperature:
  top-k   keep the k most probable tokens (ties broken towards the lower token id, so exactly k survive);
  top-p   keep the smallest most-probable-first prefix whose mass reaches p (the token that crosses p is kept);
  min-p   keep tokens with p_i >= min_p * p_max.
Each rule renormalises what it keeps. top-k and min-p commute with everything (they only depend on ranks and
on ratios to the maximum, which renormalising does not change); top-p measures mass *after* top-k, and min-p
after top-p only removes tokens, so the order matters only between top-k and top-p. The most probable token
always survives, so the kept set is never empty.

temperature == 0 (or top_k == 1) is greedy: argmax, lowest id on ties, and the generator is not consumed. So is
a temperature too small to divide by (below the smallest normal double, e.g. 1e-320: 1/T overflows); any other
tiny temperature is applied as given, with the maximum subtracted before dividing, so the distribution stays
finite (it collapses onto the maximum). A distribution that is not finite is never sampled from: that raises.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np

# When top-p runs without top-k, sort only the most probable few first: if they already hold p of the mass
# the nucleus lies inside them. Avoids a full argsort of a 129k vocabulary on every token.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0                      # 0 = off
    top_p: float = 1.0                  # 1 = off
    min_p: float = 0.0                  # 0 = off
    seed: int | None = None             # None = fresh OS entropy per Sampler
    max_tokens: int | None = None       # None = until EOS, a stop string or a full context
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.temperature = _number("temperature", self.temperature)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        self.top_k = _integer("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        self.top_p = _number("top_p", self.top_p)
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        self.min_p = _number("min_p", self.min_p)
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if self.seed is not None:
            self.seed = _integer("seed", self.seed)
            if self.seed < 0:
                raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.max_tokens is not None:
            self.max_tokens = _integer("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        # below the smallest normal double, 1/temperature overflows: nothing but the maximum can be sampled
        return self.temperature < sys.float_info.min or self.top_k == 1


def _number(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {v!r}")
    return float(v)


def _integer(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return int(v)


# ---- the truncation rules, each on a probability vector (float64, sums to 1), returning a renormalised copy


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    # max first, then divide: (l - max) / T is <= 0 and only underflows (to -inf, probability 0) for tiny T,
    # where l / T - max / T would overflow and give inf - inf = NaN
    z = np.asarray(logits, dtype=np.float64)
    with np.errstate(over="ignore"):
        z = (z - z.max()) / temperature
    p = np.exp(z)
    return p / p.sum()


def _order_desc(probs: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
    """Token ids by descending probability, ties towards the lower id (deterministic)."""
    if ids is None:
        ids = np.arange(probs.shape[0])
    return ids[np.lexsort((ids, -probs[ids]))]


def _keep(probs: np.ndarray, kept: np.ndarray) -> np.ndarray:
    out = np.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def apply_top_k(probs: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= probs.shape[0]:
        return probs
    # Everything >= the k-th largest value, then an exact ordered cut (ties at the boundary resolved by id).
    kth = np.partition(probs, -k)[-k]
    return _keep(probs, _order_desc(probs, np.flatnonzero(probs >= kth))[:k])


def apply_top_p(probs: np.ndarray, p: float) -> np.ndarray:
    if p >= 1.0:
        return probs
    order = None
    n = probs.shape[0]
    if n > _TOP_P_CANDIDATES:
        # Candidates = all tokens at least as probable as the m-th largest (ties included, so the exact
        # tie-break below sees them all). If they hold >= p, the nucleus is inside them.
        kth = np.partition(probs, -_TOP_P_CANDIDATES)[-_TOP_P_CANDIDATES]
        cand = np.flatnonzero(probs >= kth)
        if probs[cand].sum() >= p:
            order = _order_desc(probs, cand)
    if order is None:
        order = _order_desc(probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    return _keep(probs, order[mass_before < p])


def apply_min_p(probs: np.ndarray, min_p: float) -> np.ndarray:
    if min_p <= 0.0:
        return probs
    return _keep(probs, np.flatnonzero(probs >= min_p * probs.max()))


class Sampler:
    """Samples token ids with its own generator: the same params (with a seed) give the same tokens."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """The final probabilities sample() draws from (float64, sums to 1); one-hot when greedy."""
        logits = _check_logits(logits)
        prm = self.params
        if prm.greedy:
            out = np.zeros(logits.shape[0])
            out[int(np.argmax(logits))] = 1.0
            return out
        probs = softmax(logits, prm.temperature)
        probs = apply_top_k(probs, prm.top_k)
        probs = apply_top_p(probs, prm.top_p)
        return apply_min_p(probs, prm.min_p)

    def sample(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(_check_logits(logits)))
        return self.draw(self.distribution(logits))

    def draw(self, probs: np.ndarray) -> int:
        """One token from a probability vector (e.g. `distribution`'s, or speculative decoding's residual), with
        one uniform of this sampler's generator."""
        total = probs.sum()
        if not (np.isfinite(total) and total > 0) or not np.isfinite(probs).all():
            raise ValueError(f"the sampling distribution is not finite (temperature {self.params.temperature!r}); "
                             "refusing to sample from it")
        # Inverse CDF with one uniform draw: one generator step per token, robust to rounding in the sum.
        cdf = np.cumsum(probs)
        i = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        i = min(i, probs.shape[0] - 1)
        while probs[i] == 0.0:  # a draw landing exactly on a boundary never picks a removed token
            i -= 1
        return i


class InvalidLogits(ValueError):
    """The backend produced logits that are no distribution (NaN, +inf, all -inf): a model problem, never the
    request's (the server reports it on /health)."""


def _check_logits(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.shape[0] == 0:
        raise ValueError(f"logits must be a non-empty 1-D vector, got shape {logits.shape}")
    if not np.isfinite(logits.max()):  # max propagates NaN; +inf or all -inf is no distribution either
        raise InvalidLogits("logits contain NaN/inf or are all -inf (the backend produced invalid numbers)")
    return logits
