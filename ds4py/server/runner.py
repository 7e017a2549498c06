"""The model runner of `serve --sessions N`: executes the step the scheduler planned, as one batched model.step
over the sequences' states (docs/engine.md: each routed expert and every weight read once for all rows, each
sequence's arithmetic independent of the others), and measures it. The scheduler (scheduler.py) decides what
runs; the runner only runs it, so that a backend with a device-side step (CUDA graphs per batch size) or
speculative verification changes this module and not the policy."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from .metrics import Metrics


class ModelRunner:
    def __init__(self, model, metrics: Metrics):
        self.model, self.metrics = model, metrics

    def step(self, states: Sequence, chunks: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """The last logits of each sequence after feeding it its chunk (a decode token or a prefill chunk)."""
        t0 = time.perf_counter()
        out = self.model.step(list(states), [list(c) for c in chunks])
        self.metrics.observe_step(len(states), sum(len(c) for c in chunks), time.perf_counter() - t0)
        return out

    def verify(self, states: Sequence, chunks: Sequence[Sequence[int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Speculative verify rows of several sessions in one main step (the speculative model's verify: every
        row's logits and what its rounds' finish reads: MTP final hidden states, DSpark draft taps)."""
        t0 = time.perf_counter()
        out = self.model.verify(list(states), chunks)
        self.metrics.observe_step(len(states), sum(len(c) for c in chunks), time.perf_counter() - t0)
        return out
