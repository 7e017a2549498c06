"""Capture on the engine's own path (seed 000 §4.2 "Fitting on the deployment path"): the reference forward's MoE
hook (`Trace.moe_hook`, ds4py/ref/forward.py) hands over, per layer, the MoE input x, the chosen experts and
their mixing weights, each routed expert's weighted output `rw · ye` (the parts), the shared expert's output
`ysh` and the block output y. Nothing is recomputed in a second implementation; every capture checks that
`ysh + Σ parts`, summed in the forward's order, is the block output bit for bit, or stops.

A capture of layer l stops the forward right after layer l's MoE (the layers above cannot matter yet), so a
sidecar fit over L layers costs about L(L+1)/2 layer passes plus a recapture per router bias (docs/vq.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ds4py.errors import Ds4Error


class CaptureError(Ds4Error):
    """The captured parts do not add up to the engine's block output."""


class _Stop(Exception):
    pass


@dataclass
class LayerCapture:
    """One layer's MoE over every captured row (rows of all sequences, in order)."""
    x: list = field(default_factory=list)          # [N, D] MoE input (after ffn_norm)
    idx: list = field(default_factory=list)        # [N, k] chosen experts
    wts: list = field(default_factory=list)        # [N, k] mixing weights
    parts: list = field(default_factory=list)      # [N, k, D] rw · ye per slot (only when asked for)
    shared: list = field(default_factory=list)     # [N, D] shared expert output
    y: list = field(default_factory=list)          # [N, D] block output
    post: list = field(default_factory=list)       # [N, hc] the FFN's hc_post weights

    def finish(self) -> "LayerCapture":
        for name in ("x", "idx", "wts", "parts", "shared", "y", "post"):
            v = getattr(self, name)
            setattr(self, name, np.concatenate(v) if v else None)
        return self


def check_sum(idx: np.ndarray, parts: np.ndarray, shared: np.ndarray, y: np.ndarray, layer: int) -> None:
    """ysh + Σ rw·ye in the forward's order (experts ascending) must be the block output bit for bit."""
    total = shared.copy()
    for e in np.unique(idx):
        tok, slot = np.nonzero(idx == e)
        total[tok] += parts[tok, slot]
    if not np.array_equal(total, y):
        bad = float(np.mean(total != y))
        raise CaptureError(f"layer {layer}: the captured expert outputs do not add up to the block output "
                           f"({bad:.4%} of values differ); the capture hook is out of step with the forward")


def capture(model, seqs: Sequence[np.ndarray], layers: Sequence[int], stop_after: int | None = None,
            parts: bool = True, final: bool = False) -> tuple[dict[int, LayerCapture], list]:
    """Prefill each sequence from an empty state with the MoE hook recording `layers`; stop after layer
    `stop_after` (None: run the whole model). Returns per layer a LayerCapture and, with final=True, per
    sequence (the hc stream after the last layer [T, hc, D], the logits [T, vocab])."""
    caps = {l: LayerCapture() for l in layers}
    want = set(layers)
    finals = []
    for ids in seqs:
        tr = model.new_trace()

        def hook(layer, x, idx, wts, p, shared, y, tr=tr):
            if layer in want:
                check_sum(idx, p, shared, y, layer)
                c = caps[layer]
                c.x.append(x.copy())
                c.idx.append(idx.copy())
                c.wts.append(wts.copy())
                c.shared.append(shared)
                c.y.append(y.copy())
                c.post.append(tr.ffn_post[layer].copy())
                if parts:
                    c.parts.append(p)
            if layer == stop_after:
                raise _Stop

        tr.moe_hook = hook
        try:
            logits = model.prefill(model.new_state(), np.asarray(ids, np.int64), all_logits=True, trace=tr)
        except _Stop:
            continue
        if final:
            finals.append((tr.hc[-1], logits))
    return {l: c.finish() for l, c in caps.items()}, finals


def router_scores(model, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Layer `layer`'s router on MoE inputs x with the engine's own functions: (s = sqrt(softplus(W x)) [N, X],
    the bound router bias b [X], sidecar-biased where one is mounted); the forward selects by s + b."""
    from ds4py.ref import ops

    F = model.binding.layers[layer].ffn
    return ops.sqrt_softplus(model.weights.linear(F.gate_inp, x)), model.weights.get(F.route_bias)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The forward's choice: the k best, stable order on ties (ds4py.ref.forward.route)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def set_mask(idx: np.ndarray, n_experts: int) -> np.ndarray:
    m = np.zeros((len(idx), n_experts), bool)
    np.put_along_axis(m, idx, True, axis=1)
    return m


@dataclass
class PathCapture:
    """Every position of one sequence captured where its decision is made: rows < split through one prefill of
    ids[:split] (all logits), rows >= split through one decode step each (teacher-forced ids[split:])."""
    layer: LayerCapture                 # the MoE of the captured layer, one row per position
    hc: np.ndarray                      # [T, hc, D] the hc stream after the last layer
    logits: np.ndarray                  # [T, vocab]
    decoded: np.ndarray                 # bool [T]: the row came from a decode step


def capture_path(model, ids: np.ndarray, split: int, layer: int) -> PathCapture:
    ids = np.asarray(ids, np.int64)
    cap = LayerCapture()
    hc, logits = [], []

    def traced():
        tr = model.new_trace()

        def hook(l, x, idx, wts, p, shared, y):
            if l == layer:
                check_sum(idx, p, shared, y, l)
                for name, v in (("x", x), ("idx", idx), ("wts", wts), ("parts", p), ("shared", shared),
                                ("y", y), ("post", tr.ffn_post[l])):
                    getattr(cap, name).append(np.array(v))

        tr.moe_hook = hook
        return tr

    state = model.new_state()
    tr = traced()
    logits.append(model.prefill(state, ids[:split], all_logits=True, trace=tr))
    hc.append(tr.hc[-1])
    for t in ids[split:]:
        tr = traced()
        logits.append(model.decode(state, int(t), trace=tr)[None])
        hc.append(tr.hc[-1])
    decoded = np.arange(len(ids)) >= split
    return PathCapture(cap.finish(), np.concatenate(hc), np.concatenate(logits), decoded)
