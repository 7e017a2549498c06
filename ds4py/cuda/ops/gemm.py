"""Host side of cu/gemm.cu: the prefill GEMM on tensor cores (bf16 mma.sync, fp32 accumulate) for the dense
weights (Q8_0 / F16 / F32 / Q4_K, as the GEMVs read them).

    gemm(rt, W, x, y, GemmShape(T, N, K))                   # y[T, N] = x[T, K] @ W[N, K]^T
    gemm(rt, W, x, y, GemmShape(T, N, K), accumulate=True)  # y += ...
    gemm(rt, W_o_a, o, u, GemmShape(T, 8192, 4096, x_group_rows=1024))   # grouped wo_a: block g reads x[:, g*K:]

W is a DeviceArray (or a DevTensor: its .array) typed as for ops.gemv: float32 -> F32, float16 -> F16, uint8
bytes -> Q8_0 ([N, K/32*34]) or Q4_K ([N, K/256*144]). x: float32 [T, ldx] (ldx >= K * groups, a multiple of 4, default K * groups), y:
float32 [T, ldy] (default N). Numerics (cu/gemm.cu): x rounded to bf16 (or, precise_x, two bf16 pieces), weights exact (Q8_0 codes + per-block
scale, F16 as two bf16 pieces, F32 and Q4_K's exact values as three), fp32 accumulation in a fixed k order: a row's result does not depend
on T or on the other rows (twin: ds4py/cuda/twins/gemm.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.ops.core import aligned, ceil_div, is_dtype, need
from ds4py.cuda.ops.gemv import COL_MULTIPLE, byte_rows, weight_type
from ds4py.errors import Ds4Error

DEFINES = {
    "GEMM_BM": 64,               # tokens per block tile
    "GEMM_BN": 128,              # output features per block tile
    "GEMM_WARPS_M": 2,           # warps along the tokens (each 32 rows)
    "GEMM_WARPS_N": 4,           # warps along the features (each 32 columns)
}
BM, BN, BK = DEFINES["GEMM_BM"], DEFINES["GEMM_BN"], 32
THREADS = 32 * DEFINES["GEMM_WARPS_M"] * DEFINES["GEMM_WARPS_N"]
MAX_T = 65535 * BM               # grid.y limit
_KERNEL = {"Q8_0": "gemm_q8_0", "F16": "gemm_f16", "F32": "gemm_f32", "Q4_K": "gemm_q4_k"}
PIECES = {"Q8_0": 1, "F16": 2, "F32": 3, "Q4_K": 3}     # bf16 mma per k16 step and tile: the tensor-core cost factor
ACCUMULATE, X_SPLIT = 1, 2                   # flags (GEMM_ACCUMULATE, GEMM_X_SPLIT)
# Q4_K's sector ring (cu/gemm.cu: GEMM_RING = 2 sectors of 32 bytes per weight row) is dynamic shared memory:
# with its three staged weight pieces the static 48 KB has no room for it.
RING_SMEM = {"Q4_K": BN * 2 * 32}


def gemm_grid(T: int, N: int, x_group_rows: int = 0) -> tuple[int, int, int]:
    """(feature tiles, token tiles, input groups) of one launch."""
    cols = x_group_rows or N
    return ceil_div(cols, BN), ceil_div(T, BM), ceil_div(N, cols)


@dataclass(frozen=True)
class GemmShape:
    """What one GEMM launch multiplies: y[t, n] = sum_k x[t, k] W[n, k] for t < T, n < N, k < K. x_group_rows > 0:
    features [g*x_group_rows, (g+1)*x_group_rows) read x[t, g*K:(g+1)*K] (the grouped wo_a). ldx / ldy: floats
    between rows of x / y (None: K * groups, N). precise_x: x as two bf16 pieces (relative error 2^-17 instead of
    2^-9, twice the tensor work: for the router, whose top-k a bf16 x could reorder)."""
    T: int
    N: int
    K: int
    x_group_rows: int = 0
    ldx: int | None = None
    ldy: int | None = None
    precise_x: bool = False


def gemm(rt: Any, W: Any, x: Any, y: Any, shape: GemmShape, accumulate: bool = False, stream: Any = None,
         pdl: bool = False) -> None:
    """y = x W^T over `shape` (accumulate: y +=). One launch."""
    if hasattr(W, "qtype") and hasattr(W, "array"):                  # a DevTensor (device_weights): its device array
        W = W.array
    T, N, K, x_group_rows = shape.T, shape.N, shape.K, shape.x_group_rows
    qtype = weight_type(W, N, K)
    need(isinstance(T, (int, np.integer)) and 1 <= T <= MAX_T, f"gemm: T must be 1..{MAX_T}, got {T}")
    need(N >= 1 and K >= 1, f"gemm: N and K must be >= 1, got {N}, {K}")
    need(K % COL_MULTIPLE[qtype] == 0, f"gemm: K ({K}) must be a multiple of {COL_MULTIPLE[qtype]} for {qtype}")
    need(x_group_rows >= 0, f"gemm: x_group_rows must be >= 0, got {x_group_rows}")
    groups = ceil_div(N, x_group_rows) if x_group_rows else 1
    need(groups <= 65535, f"gemm: {groups} input groups exceed the grid")
    ldx = K * groups if shape.ldx is None else int(shape.ldx)
    ldy = N if shape.ldy is None else int(shape.ldy)
    need(ldx >= K * groups and ldx % 4 == 0, f"gemm: ldx ({ldx}) must be a multiple of 4 and >= {K * groups}")
    need(ldy >= N, f"gemm: ldy ({ldy}) must be >= N ({N})")
    if qtype == "Q8_0":
        need(W.nbytes == byte_rows(qtype, N, K),
             f"gemm: W holds {W.nbytes} bytes, not {N} x {K} Q8_0 ({byte_rows(qtype, N, K)})")
        need(W.ptr % 2 == 0, "gemm: Q8_0 weights must be 2-byte aligned")
    elif qtype == "Q4_K":
        need(aligned(16, W), "gemm: Q4_K weights must be 16-byte aligned")
    else:
        need(W.size == N * K, f"gemm: W has {W.size} values, not {N} x {K}")
        need(aligned(16, W), f"gemm: {qtype} weights must be 16-byte aligned")
    need(is_dtype(x, np.float32) and x.size >= (T - 1) * ldx + K * groups,
         f"gemm: x must be float32 [{T}, {ldx}]")
    need(aligned(16, x), "gemm: x must be 16-byte aligned")
    need(is_dtype(y, np.float32) and y.size >= (T - 1) * ldy + N, f"gemm: y must be float32 [{T}, {ldy}]")
    rt.launch(_KERNEL[qtype], gemm_grid(T, N, x_group_rows), THREADS, W, x, y, int(T), int(N), int(K), ldx, ldy,
              int(x_group_rows), (ACCUMULATE if accumulate else 0) | (X_SPLIT if shape.precise_x else 0),
              smem=RING_SMEM.get(qtype, 0), stream=stream, pdl=pdl)


def mma_tile(rt: Any, dtype: str, a: Any, b: Any, c: Any, d: Any, tiles: int = 1) -> None:
    """d = one m16n8k16 mma per tile from per-lane fragments (a [tiles, 32, 4], b [tiles, 32, 2] uint32, c / d
    [tiles, 32, 4] float32; twins.mma packs them): the fragment-layout check of the f16 / bf16 wrappers."""
    if dtype not in ("f16", "bf16"):
        raise Ds4Error(f"mma_tile: dtype must be f16 or bf16, not {dtype!r}")
    need(a.size >= tiles * 128 and b.size >= tiles * 64 and c.size >= tiles * 128 and d.size >= tiles * 128,
         "mma_tile: the fragments do not cover the tiles")
    rt.launch(f"gemm_mma_tile_{dtype}", tiles, 32, a, b, c, d)
