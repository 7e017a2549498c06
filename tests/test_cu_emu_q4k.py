"""Q4_K dense weights on the CPU emulator: cu/gemv.cu's Q4_K GEMVs (plain with several matrices, the RMSNorm
prologue, accumulate and input groups; the hc_post and SwiGLU epilogues; the `_rows` variants bit-identical to
single rows) and cu/gemm.cu's Q4_K prefill GEMM, each against its numpy twin (the weights as ds4py.quant decodes
them). tests/gpu/test_kernels_core.py's functions take Q4_K the same way on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from cu_fixtures import (arena, check_gemv, check_several_matrices, gemv_weights, put,  # noqa: F401 (fixtures)
                         requires_emulator, rng, rt)
from ds4py.cuda import ops, twins
from ds4py.cuda.ops import gemm as ops_gemm
from ds4py.cuda.ops.gemv import weight_type
from ds4py.cuda.twins import gemm as tgemm
from ds4py.cuda.twins import gemv as tg
from ds4py.cuda.ops.gemm import GemmShape
from ds4py.cuda.ops.gemv import GemvX, SwiGlu
from ds4py.cuda.ops.mhc import HcResidual
from ds4py.errors import Ds4Error

pytestmark = requires_emulator


def test_the_type_follows_the_byte_count(arena, put):
    r = rng(40)
    assert weight_type(put(gemv_weights(r, "Q4_K", 3, 512)), 3, 512) == "Q4_K"
    assert weight_type(put(gemv_weights(r, "Q8_0", 3, 512)), 3, 512) == "Q8_0"


@pytest.mark.parametrize("rows,cols,warps,grid", [(1, 256, 1, None), (37, 512, 3, None), (9, 1280, 2, 1)])
def test_gemv(rt, arena, put, rows, cols, warps, grid):
    r = rng(41, rows, cols)
    W = gemv_weights(r, "Q4_K", rows, cols)
    x = r.standard_normal(cols).astype(np.float32)
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), y, rows)], GemvX(put(x, False), cols), warps=warps, grid=grid)
    check_gemv(y.download(), W, x, rows, cols, f"q4_k {rows}x{cols}")


def test_several_matrices_norm_add_and_groups(rt, arena, put):
    r = rng(42)
    cols = 256
    check_several_matrices(rt, arena, put, r, "Q4_K", cols, "q4_k", [])
    rows, group = 24, 8                                  # wo_a style: rows [g*8, (g+1)*8) read x[g]
    W = gemv_weights(r, "Q4_K", rows, cols)
    xg = r.standard_normal(3 * cols).astype(np.float32)
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), y, rows)], GemvX(put(xg, False), cols, x_group_rows=group), warps=2)
    check_gemv(y.download(), W, xg, rows, cols, "q4_k groups", x_group_rows=group)


def test_hc_post_and_swiglu_epilogues(rt, arena, put):
    r = rng(43)
    D, cols, hc = 42, 256, 4
    W = gemv_weights(r, "Q4_K", D, cols, 0.3)
    x = r.standard_normal(cols).astype(np.float32)
    X = r.standard_normal((hc, D)).astype(np.float32)
    mix = r.random((2 + hc) * hc).astype(np.float32)
    dX = put(X, False)
    ops.gemv_hc_post(rt, put(W), GemvX(put(x, False), cols), HcResidual(dX, put(mix), D), warps=2)
    want = tg.hc_post(tg.gemv(W, x, D, cols), X, mix)
    mag = (mix[hc:2 * hc, None] * tg.magnitude(W, x, D, cols)[None, :]
           + np.abs(mix[2 * hc:].reshape(hc, hc)).T @ np.abs(X))
    twins.assert_close_scaled(dX.download(), want, mag, cols, "q4_k hc_post", factor=2.0)
    rows = 13
    Wg, Wu = gemv_weights(r, "Q4_K", rows, cols, 0.5), gemv_weights(r, "Q4_K", rows, cols, 0.5)
    y = arena.scratch(rows, np.float32)
    ops.gemv_swiglu(rt, SwiGlu(put(Wg), put(Wu), rows, clamp=2.5), GemvX(put(x, False), cols), y, warps=2)
    g, u = tg.gemv(Wg, x, rows, cols), tg.gemv(Wu, x, rows, cols)
    want = tg.swiglu(g, u, 2.5)
    mg, mu = tg.magnitude(Wg, x, rows, cols), tg.magnitude(Wu, x, rows, cols)
    mag = 1.1 * np.abs(u) * mg + np.abs(tg.ref.silu(g)) * mu + np.abs(want)
    twins.assert_close_scaled(y.download(), want, mag, cols, "q4_k swiglu", factor=2.0)


def same_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.tobytes() == b.tobytes(), f"{what}: not bit-identical (max |diff| {np.max(np.abs(a - b))})"


def test_rows_equal_single_rows(rt, arena, put):
    """Each weight read once for nx rows; row n's bits = a single-row launch (plain, hc_post, SwiGLU)."""
    r = rng(44)
    nx, D, cols, hc, stride = 3, 20, 512, 4, 512 + 12
    W = gemv_weights(r, "Q4_K", D, cols, 0.3)
    Wg, Wu = gemv_weights(r, "Q4_K", 9, cols, 0.5), gemv_weights(r, "Q4_K", 9, cols, 0.5)
    x = np.zeros((nx, stride), np.float32)
    x[:, :cols] = r.standard_normal((nx, cols))
    X = r.standard_normal((nx, hc, D)).astype(np.float32)
    mix = r.random((nx, (2 + hc) * hc)).astype(np.float32)
    dW, dWg, dWu, dx = put(W), put(Wg), put(Wu), put(x.reshape(-1), False)
    y = arena.scratch(nx * D, np.float32)
    ops.gemv(rt, [(dW, y, D)], GemvX(dx, cols, nx=nx, x_stride=stride), warps=2)
    dX = put(X.reshape(-1), False)
    ops.gemv_hc_post(rt, dW, GemvX(dx, cols, nx=nx, x_stride=stride), HcResidual(dX, put(mix.reshape(-1)), D))
    s = arena.scratch(nx * 9, np.float32)
    ops.gemv_swiglu(rt, SwiGlu(dWg, dWu, 9, clamp=2.5), GemvX(dx, cols, nx=nx, x_stride=stride), s)
    for i in range(nx):
        xi = put(x[i, :cols].copy(), False)
        y1 = arena.scratch(D, np.float32)
        ops.gemv(rt, [(dW, y1, D)], GemvX(xi, cols), warps=4)
        same_bits(y.download().reshape(nx, D)[i], y1.download(), f"q4_k row {i}")
        X1 = put(X[i].copy(), False)
        ops.gemv_hc_post(rt, dW, GemvX(xi, cols), HcResidual(X1, put(mix[i].copy()), D), warps=1)
        same_bits(dX.download().reshape(nx, hc, D)[i], X1.download(), f"q4_k hc_post row {i}")
        s1 = arena.scratch(9, np.float32)
        ops.gemv_swiglu(rt, SwiGlu(dWg, dWu, 9, clamp=2.5), GemvX(xi, cols), s1, warps=3)
        same_bits(s.download().reshape(nx, 9)[i], s1.download(), f"q4_k swiglu row {i}")


@pytest.mark.parametrize("T,N,K,xgr,acc", [(70, 136, 256, 0, False), (9, 48, 512, 16, True)])
def test_gemm_against_the_twin(rt, arena, put, T, N, K, xgr, acc):
    r = rng(45, T, N, K)
    W = gemv_weights(r, "Q4_K", N, K, 0.1)
    groups = -(-N // xgr) if xgr else 1
    ldx = K * groups + 4
    x = np.zeros((T, ldx), np.float32)
    x[:, :K * groups] = r.standard_normal((T, K * groups)) * 2
    y0 = r.standard_normal((T, N)).astype(np.float32) if acc else np.full((T, N), np.nan, np.float32)
    d_y = put(y0, False)
    ops_gemm.gemm(rt, put(W), put(x), d_y, GemmShape(T, N, K, x_group_rows=xgr, ldx=ldx), accumulate=acc)
    want, mag = tgemm.gemm(W, x, T, N, K, xgr, y0 if acc else None)
    twins.assert_close_scaled(d_y.download(), want, mag, K, f"q4_k gemm T{T} N{N} K{K}", factor=2.0)


def test_checks(rt, arena, put):
    W = put(gemv_weights(rng(46), "Q4_K", 4, 256))
    with pytest.raises(Ds4Error, match="bytes"):               # not 4 x 512 of any block format
        ops.gemv(rt, [(W, arena.scratch(4, np.float32), 4)], GemvX(put(np.ones(512, np.float32), False), 512))
