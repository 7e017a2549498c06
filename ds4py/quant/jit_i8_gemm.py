"""The CPU prefill products of the int8-activation mode: T tokens times one quantised matrix as a GEMM.

    if jit_i8_gemm.supported(qtype):
        y = jit_i8_gemm.matmul(qtype, raw, x, threads)     # raw uint8 [R, row_nbytes], x [T, C] -> [T, R]
    y = jit_i8_gemm.q8_0_matmul(raw, x, threads)            # dense Q8_0, int8 (VNNI / aarch64 sdot: q8_0_int8())
    y = jit_i8_gemm.dense_q8_0(raw, x_rounded, threads, seg)  # dense Q8_0 elsewhere: dequantise + BLAS

Routed experts (IQ2_XXS, Q2_K, Q4_K): x is quantised per block exactly as ds4py.quant.jit_i8 does it (the
reference's act_quant rounding), and every (token, row) gets jit_i8's own float operations in its order, so y is
bit for bit jit_i8.matmul's: which of the two runs is a speed choice only (no batch-invariance question). The
kernels (jit_i8_gemm_kernels) unpack a tile of rows once and run every token over it while it is in cache.

Dense Q8_0 matrices (attention projections, shared expert, grouped output), on hosts with AVX-512 VNNI or
aarch64 sdot (q8_0_int8()): int8 products, x quantised as jit_i8 does, exact int32 block sums with the rows as
vector lanes
(ds4py.quant.jit_q8_0_vnni: ~100 GMAC/s a core here against ~35 for the BLAS route below), each (token, row)
acc += (d_w * d_x) * isum in block order: the int8-activation numerics of the decode kernels, within float32
rounding of the reference's act_quant product (tests/test_jit_i8_gemm.py), the same bits at any token count.
Elsewhere: float32 BLAS on the activation rounded
as the reference's act_quant mode rounds it (ops.q8_0_round), with the weights dequantised a tile at a time by a
compiled loop and the tiles shared between `threads` threads (numpy's matmul and the numba loop release the GIL).
That is the reference's own act_quant computation (rounded x times the dequantised matrix), just faster. Why not
integer dot products here: Q8_0's blocks are 32 weights, and numba's integer dot product over 32 ends in a
horizontal sum per block and token; measured on this machine (AVX-512 VNNI), 4x slower per multiply-add than its
256-weight blocks (~5 vs ~20 GMAC/s a core) and far below single-precision BLAS (~30 GMAC/s a core, OpenBLAS).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as Q

from ds4py.quant import jit, jit_i8

F32 = np.float32
FORMATS = (Q.IQ2_XXS, Q.Q2_K, Q.Q4_K)
_INTS = {int(q) for q in FORMATS}
TILE_BYTES = 2 << 20             # float32 bytes of one dequantised tile of a dense matrix
_pool: dict = {}
_pool_lock = threading.Lock()


def supported(qtype) -> bool:
    return int(qtype) in _INTS


def _kernels():
    jit_i8._kernels()                                     # numba state and jit_i8's tables
    from ds4py.quant import jit_i8_gemm_kernels

    return jit_i8_gemm_kernels


def matmul(qtype, raw: np.ndarray, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """x @ W.T for stored GGUF rows raw (uint8 [R, row_nbytes]) of a format in FORMATS, x quantised per block as
    the reference's act_quant mode rounds it -> float32 [T, R], bit for bit jit_i8.matmul's."""
    k = _kernels()
    st, tb = jit._state, jit_i8._tables
    qt = int(qtype)
    raw = jit._readonly(np.ascontiguousarray(raw).view(np.uint8))
    x = np.ascontiguousarray(x, dtype=F32)
    R, (T, C) = raw.shape[0], x.shape
    y = np.empty((T, R), F32)
    parts = max(1, min(threads, R))
    xq, xd, xbs = jit_i8.quant_q8_k(x)
    f16 = st["f16"]
    if qt == Q.IQ2_XXS:
        jit._call("gemm_iq2_xxs", k.iq2_xxs, (raw.reshape(R, C // 256, 66), xq, xd, y, f16, tb["grid"],
                                              tb["signs"], parts), threads)
    elif qt == Q.Q2_K:
        jit._call("gemm_q2_k", k.q2_k, (raw.reshape(R, C // 256, 84), xq, xd, xbs, y, f16, parts), threads)
    elif qt == Q.Q4_K:
        jit._call("gemm_q4_k", k.q4_k, (raw.reshape(R, C // 256, 144), xq, xd, xbs, y, f16, parts), threads)
    else:
        raise ValueError(f"no int8-activation prefill kernel for format {qt}")
    return y


def _q8_0_int8_available() -> bool:
    from ds4py.quant import jit_q8_0_vnni

    return jit_q8_0_vnni.AVAILABLE


def q8_0_int8() -> bool:
    """Whether q8_0_matmul runs here (numba loads and the host has AVX-512 VNNI, or is aarch64 with sdot)."""
    if "vnni" not in _pool:
        _pool["vnni"] = jit.available() and _q8_0_int8_available()
    return _pool["vnni"]


def q8_0_matmul(raw: np.ndarray, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """x @ W.T for the Q8_0 rows raw (uint8 [R, C / 32 * 34]) in int8: x quantised per block of 32 as
    jit_i8.quant_q8_0 does (ops.q8_0_round's codes and scales; x may be rounded already: quantising q8_0_round(x)
    gives the same codes and scales, tested) -> float32 [T, R]. Only where q8_0_int8()."""
    from ds4py.quant import jit_q8_0_vnni

    _kernels()
    raw = jit._readonly(np.ascontiguousarray(raw).view(np.uint8))
    x = np.ascontiguousarray(x, dtype=F32)
    R, (T, C) = raw.shape[0], x.shape
    xq, xd = jit_i8.quant_q8_0(x)
    xu = xq.view(np.uint8) ^ np.uint8(0x80)              # code + 128: vpdpbusd's unsigned operand
    y = np.empty((T, R), F32)
    tiles = -(-R // jit_q8_0_vnni.LANES)
    jit._call("q8_0_vnni", jit_q8_0_vnni.q8_0_vnni, (raw.reshape(R, C // 32, 34), xu, xd, y, jit._state["f16"],
                                                     max(1, min(threads, tiles))), threads)
    return y


def _executor(threads: int) -> ThreadPoolExecutor:
    with _pool_lock:
        ex = _pool.get(threads)
        if ex is None:
            ex = _pool[threads] = ThreadPoolExecutor(threads, "ds4py-prefill")
        return ex


def dense_q8_0(raw: np.ndarray, x: np.ndarray, threads: int = 1, seg: list[slice] | None = None) -> np.ndarray:
    """x @ W.T for the Q8_0 rows raw (uint8 [R, C / 32 * 34]), x already rounded (ops.q8_0_round, or unrounded
    for the fp32 numerics): W dequantised TILE_BYTES at a time, one BLAS product per tile and sequence (seg; each row
    alone in row-stable mode: ops.mm's grouping, batch invariance), the tiles spread over `threads` threads."""
    k = _kernels()
    f16 = jit._state["f16"]
    raw = jit._readonly(np.ascontiguousarray(raw).view(np.uint8))
    x = np.ascontiguousarray(x, dtype=F32)
    R, C = raw.shape[0], x.shape[1]
    r3 = raw.reshape(R, C // 32, 34)
    y = np.empty((x.shape[0], R), F32)
    step = max(16, TILE_BYTES // (4 * C))
    tiles = [(a, min(a + step, R)) for a in range(0, R, step)]
    nthreads = max(1, min(threads, len(tiles)))
    # the row groups ops.per_row would multiply (seg: per sequence, or per row in a row-stable step)
    T = x.shape[0]
    groups = seg if seg is not None and len(seg) > 1 else [slice(0, T)]

    def work(i: int) -> None:
        buf = np.empty((step, C), F32)
        for a, b in tiles[i::nthreads]:
            w = buf[:b - a]
            k.q8_0_rows(r3[a:b], w, f16)
            for g in groups:
                y[g, a:b] = x[g] @ w.T

    if nthreads == 1:
        work(0)
    else:
        list(_executor(nthreads).map(work, range(nthreads)))
    return y
