"""numpy twin of cu/router.cu: the MoE routing of one token, as ref/forward.route computes it (ops.sqrt_softplus,
a stable descending sort of the biased scores, weights from the unbiased ones)."""

from __future__ import annotations

import numpy as np

from ds4py.ref import ops

F32 = np.float32


def route(logits: np.ndarray, bias: np.ndarray | None, tid2eid: np.ndarray | None, token: int, k: int,
          route_scale: float, route_norm: bool, gate_temp: float = 1.0,
          norm_eps: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(ids [k] int32, weights [k] f32) for one token (V4.1: logits / gate_temp, weights / (sum + norm_eps))."""
    logits = logits.astype(F32)
    s = ops.sqrt_softplus((logits / F32(gate_temp) if gate_temp != 1.0 else logits)[None])[0]
    if tid2eid is not None:
        idx = np.asarray(tid2eid[token], np.int64)
    else:
        biased = s + bias.astype(F32) if bias is not None else s
        idx = np.argsort(-biased, kind="stable")[:k]
    w = s[idx]
    if route_norm:
        w = w / (w.sum() + F32(norm_eps) if norm_eps else w.sum())
    return idx.astype(np.int32), (w * F32(route_scale)).astype(F32)
