"""What a ROWS step (ds4py/cuda/layer.py: up to MAX_ROWS rows of any states in one launch sequence) reads of the
weights, by the kernels' access pattern: the bench's roofline of multi-row steps."""

from __future__ import annotations

from typing import Any

from ds4py.cuda.layer import MAX_ROWS
from ds4py.cuda.ops.gemv import GEMV_MAX_X

__all__ = ["MAX_ROWS", "weight_bytes_per_step"]


def weight_bytes_per_step(model: Any, rows: int, distinct_experts: int | None = None) -> dict[str, int]:
    """Weight bytes one multi-row step reads from memory (the bench's roofline), by the kernels' access pattern:
    dense tensors once per GEMV_MAX_X rows, the routed gate + up once per distinct expert, the routed down once
    per (row, expert), the embedding one row per row. distinct_experts: per layer (default: all rows' experts
    distinct, min(rows * k, n_experts))."""
    from ds4py import schema
    from ds4py.cuda import synth

    cfg = model.config
    k, NX = cfg.n_experts_used, cfg.n_experts
    distinct = min(rows * k, NX) if distinct_experts is None else distinct_experts
    passes = -(-rows // GEMV_MAX_X)
    out = {"dense": 0, "experts_gate_up": 0, "experts_down": 0, "embed": 0}
    for e in schema.entries(cfg):
        t = synth._lookup(model.w.binding, e)
        f = e.spec.field
        if f == "embed":
            out["embed"] += rows * (t.array.nbytes // t.shape[0])
        elif f.startswith("ffn.experts."):
            per = t.array.nbytes // NX
            out["experts_down" if f.endswith("down") else "experts_gate_up"] += per * (
                rows * k if f.endswith("down") else distinct)
        else:
            out["dense"] += t.array.nbytes * passes
    out["total"] = sum(out.values())
    return out
