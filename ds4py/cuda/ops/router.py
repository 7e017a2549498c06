"""Host wrapper of cu/router.cu: the MoE routing of the decode token (top-k or hash table, weights)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.ops.core import is_dtype, need
from ds4py.cuda.ops.experts import Slots

ROUTE_PER_LANE = 32            # experts per lane of the one warp
ROUTE_MAX_EXPERTS = 32 * ROUTE_PER_LANE
ROUTE_MAX_K = 32               # picks are held one per lane
DEFINES = {"ROUTE_PER_LANE": ROUTE_PER_LANE}                                       # -D values of cu/router.cu


@dataclass(frozen=True)
class Router:
    """One layer's MoE routing: bias [n_experts] (top-k layers) or tid2eid [vocab, k] int32 (hash layers; the other
    None), k of n_experts, the weights' scale and normalisation; gate_temp / norm_eps: V4.1's logits / gate_temp
    and weights / (sum + norm_eps)."""
    bias: Any
    tid2eid: Any
    n_experts: int
    k: int
    route_scale: float
    route_norm: bool = True
    gate_temp: float = 1.0
    norm_eps: float = 0.0


def moe_route(rt: Any, ro: Router, logits: Any, token: Any, out: Slots, stream: Any = None,
              pdl: bool = False) -> None:
    """out.ids / out.weights [k] of the token: top-k of sqrt(softplus(logits)) + bias, or tid2eid[token] (hash
    layers, token = the device token id; then bias is unused)."""
    bias, tid2eid, n_experts, k, ids, weights = ro.bias, ro.tid2eid, ro.n_experts, ro.k, out.ids, out.weights
    need(out.k == k, f"moe_route: the router picks {k} experts, the slots hold {out.k}")
    gate_temp, norm_eps = ro.gate_temp, ro.norm_eps
    need(1 <= n_experts <= ROUTE_MAX_EXPERTS and 1 <= k <= min(ROUTE_MAX_K, n_experts),
         f"moe_route: {k} of {n_experts} experts (at most {ROUTE_MAX_K} of {ROUTE_MAX_EXPERTS})")
    need(logits.size == n_experts and (bias is None or bias.size == n_experts), "moe_route: logits / bias size")
    need(ids.size >= k and weights.size >= k and is_dtype(ids, np.int32) and is_dtype(weights, np.float32),
         "moe_route: ids (int32) and weights (float32) need k entries")
    vocab = 0
    if tid2eid is not None:
        need(len(tid2eid.shape) == 2 and tid2eid.shape[1] == k and is_dtype(tid2eid, np.int32)
             and token is not None,
             f"moe_route: tid2eid must be int32 [vocab, {k}] with a device token id")
        vocab = int(tid2eid.shape[0])
    need(gate_temp > 0 and norm_eps >= 0, f"moe_route: gate temperature {gate_temp} must be > 0, eps {norm_eps} >= 0")
    rt.launch("moe_route", 1, 32, logits, bias, tid2eid, token, int(n_experts), int(k), vocab, float(ro.route_scale),
              int(ro.route_norm), float(gate_temp), float(norm_eps), ids, weights, stream=stream, pdl=pdl)


def moe_route_rows(rt: Any, ro: Router, logits: Any, tokens: Any, out: Slots, n_rows: int, stream: Any = None,
                   pdl: bool = False) -> None:
    """moe_route of n_rows tokens (prefill): logits [n_rows, n_experts], tokens [n_rows] int32 (read on hash
    layers), out.ids / out.weights [n_rows, k]; row r bit-identical to a one-token moe_route."""
    bias, tid2eid, n_experts, k, ids, weights = ro.bias, ro.tid2eid, ro.n_experts, ro.k, out.ids, out.weights
    need(out.k == k, f"moe_route_rows: the router picks {k} experts, the slots hold {out.k}")
    need(1 <= n_experts <= ROUTE_MAX_EXPERTS and 1 <= k <= min(ROUTE_MAX_K, n_experts) and n_rows >= 1,
         f"moe_route_rows: {k} of {n_experts} experts (at most {ROUTE_MAX_K} of {ROUTE_MAX_EXPERTS}), rows >= 1")
    need(logits.size >= n_rows * n_experts and (bias is None or bias.size == n_experts),
         "moe_route_rows: logits / bias size")
    need(ids.size >= n_rows * k and weights.size >= n_rows * k and is_dtype(ids, np.int32)
         and is_dtype(weights, np.float32), "moe_route_rows: ids (int32) and weights (float32) need rows x k")
    vocab = 0
    if tid2eid is not None:
        need(len(tid2eid.shape) == 2 and tid2eid.shape[1] == k and is_dtype(tid2eid, np.int32)
             and tokens is not None
             and tokens.size >= n_rows and is_dtype(tokens, np.int32),
             f"moe_route_rows: tid2eid must be int32 [vocab, {k}] with int32 device token ids")
        vocab = int(tid2eid.shape[0])
    rt.launch("moe_route_rows", int(n_rows), 32, logits, bias, tid2eid, tokens, int(n_experts), int(k), vocab,
              float(ro.route_scale), int(ro.route_norm), float(ro.gate_temp), float(ro.norm_eps), ids, weights,
              stream=stream, pdl=pdl)
