"""A structured synthetic "domain" for sidecar tests and benchmarks on random-weight models (docs/vq.md).

A domain is a sparse Markov chain over a small slice of the vocabulary: `n_words` token ids, each followed by one
of `fanout` successors with fixed, skewed probabilities. Its texts exercise a narrow set of directions in every
layer, which is what a sidecar exploits (seed 000 §2.1); two walks of the same chain (different `walk` seeds)
are a fitting slice and a judging slice that share no text.
"""

from __future__ import annotations

import numpy as np


def domain_chain(vocab: int, domain: int = 0, n_words: int = 48, fanout: int = 3,
                 reserved: tuple[int, int] = (2, 20)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(words [n_words] token ids, successors [n_words, fanout] word indices, probabilities [fanout]).
    Ids avoid the first reserved[0] and the last reserved[1] of the vocabulary (BOS/EOS and chat specials)."""
    r = np.random.default_rng([17, domain])
    words = r.choice(np.arange(reserved[0], vocab - reserved[1]), n_words, replace=False)
    succ = np.stack([r.choice(n_words, fanout, replace=False) for _ in range(n_words)])
    p = 0.6 ** np.arange(fanout)
    return words, succ, p / p.sum()


def domain_text(vocab: int, n_tokens: int, walk: int, domain: int = 0, **chain) -> np.ndarray:
    """n_tokens ids of one walk of domain `domain`'s chain (int64)."""
    words, succ, p = domain_chain(vocab, domain, **chain)
    r = np.random.default_rng([29, domain, walk])
    w = int(r.integers(len(words)))
    out = np.empty(n_tokens, np.int64)
    for i in range(n_tokens):
        out[i] = words[w]
        w = int(succ[w, r.choice(len(p), p=p)])
    return out


def decision_request(model, vocab: int, n_tokens: int = 160, prompt: int = 96, points: int = 8,
                     **chain) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A post-training request on `model` (a loaded model: prefill / decode): walk 7 of domain 0's chain, its
    first `prompt` tokens prefilled and the rest decoded teacher-forced, and `points` decision points in the
    continuation that ask for the model's 2nd, 3rd or 4th choice -> (ids [n_tokens], targets [n_tokens]: the
    asked-for id at a decision row, else -1, logits [n_tokens, vocab]: row i the model's after token i)."""
    ids = domain_text(vocab, n_tokens, walk=7, **chain)
    st = model.new_state()
    lg = np.concatenate([model.prefill(st, ids[:prompt], all_logits=True)]
                        + [model.decode(st, int(t))[None] for t in ids[prompt:]])
    order = np.argsort(-lg, 1)
    rng = np.random.default_rng(0)
    rows = rng.choice(np.arange(prompt - 1, n_tokens), points, replace=False)
    targets = np.full(n_tokens, -1)
    targets[rows] = order[rows, 1 + rng.integers(0, 3, points)]
    return ids, targets, lg
