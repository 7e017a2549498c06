"""numpy twin of cu/topk.cu: the exact top-k with the kernel's documented tie rule (the lowest indices win), which
ref/forward.topk_mask leaves to numpy's argpartition (without ties at the threshold both give the same set)."""

from __future__ import annotations

import numpy as np

F32 = np.float32


def topk_key(x: np.ndarray) -> np.ndarray:
    """The kernel's order-preserving uint32 key of a float32."""
    u = np.asarray(x, F32).view(np.uint32)
    return np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, ascending; ties at the k-th value go to the lowest indices."""
    n = len(scores)
    if n <= k:
        return np.arange(n, dtype=np.int32)
    order = np.lexsort((np.arange(n), -topk_key(scores).astype(np.int64)))
    return np.sort(order[:k]).astype(np.int32)
