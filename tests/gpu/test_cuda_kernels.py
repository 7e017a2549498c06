"""Each kernel against its numpy twin (ds4py/cuda/twins.py), over several launch geometries."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import ops, twins
from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.twins import quant_q8_0

pytestmark = pytest.mark.gpu


def R(seed):
    return np.random.default_rng(seed)


@pytest.mark.parametrize("n, rows, threads", [(4096, 3, 256), (1000, 2, 128), (7168, 1, 1024), (33, 4, 32)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rmsnorm(rt, arena, put, n, rows, threads, weighted):
    x = (R(1).standard_normal((rows, n)) * 3).astype(np.float32)
    w = R(2).standard_normal(n).astype(np.float32) if weighted else None
    dx, dy = put(x, weights=False), arena.scratch((rows, n), np.float32)
    dw = put(w) if weighted else None
    ops.rmsnorm(rt, dx, dw, dy, n, 1e-6, threads=threads)
    got, ref = dy.download(), twins.rmsnorm(x, w, 1e-6)
    twins.assert_close_scaled(got, ref, np.abs(ref) + 1e-30, n, "rmsnorm")


def test_rmsnorm_in_place_tiny_eps(rt, arena, put):
    x = (R(3).standard_normal((2, 512)) * 1e-3).astype(np.float32)
    dx = put(x, weights=False)
    ops.rmsnorm(rt, dx, None, dx, 512, 1e-20)
    ref = twins.rmsnorm(x, None, 1e-20)
    twins.assert_close_scaled(dx.download(), ref, np.abs(ref), 512, "rmsnorm in place")


def _f16_case(rows, cols, seed):
    W = (R(seed).standard_normal((rows, cols)) * 0.05).astype(np.float16)
    x = R(seed + 1).standard_normal(cols).astype(np.float32)
    mag = np.abs(W.astype(np.float64)) @ np.abs(x.astype(np.float64))
    return W, x, mag


@pytest.mark.parametrize("rows, cols, warps, grid", [(1000, 4096, 8, None), (64, 520, 4, None),
                                                      (4097, 1024, 8, 7), (3, 8, 1, None)])
def test_gemv_f16(rt, arena, put, rows, cols, warps, grid):
    W, x, mag = _f16_case(rows, cols, 10)
    dW, dx, dy = put(W), put(x, weights=False), arena.scratch(rows, np.float32)
    ops.gemv_f16(rt, dW, dx, dy, rows, cols, warps=warps, grid=grid)
    twins.assert_close_scaled(dy.download(), twins.gemv_f16(W, x), mag, cols, "gemv_f16")


def _q8_case(rows, cols, seed):
    Wf = (R(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)
    raw = quant_q8_0(Wf).reshape(rows, cols // 32 * 34)
    x = R(seed + 1).standard_normal(cols).astype(np.float32)
    mag = np.abs(twins.q8_0_matrix(raw, rows, cols).astype(np.float64)) @ np.abs(x.astype(np.float64))
    return raw, x, mag


@pytest.mark.parametrize("rows, cols, warps, grid", [(333, 4096, 8, None), (50, 8192 + 96, 4, None),
                                                      (129, 96, 8, 5), (2, 32, 1, None), (1024, 4096, 16, None)])
def test_gemv_q8_0(rt, arena, put, rows, cols, warps, grid):
    raw, x, mag = _q8_case(rows, cols, 20)
    dW, dx, dy = put(raw), put(x, weights=False), arena.scratch(rows, np.float32)
    ops.gemv_q8_0(rt, dW, dx, dy, rows, cols, warps=warps, grid=grid)
    twins.assert_close_scaled(dy.download(), twins.gemv_q8_0(raw, x, rows, cols), mag, cols, "gemv_q8_0")


@pytest.mark.parametrize("shift", [2, 6, 14])
def test_gemv_q8_0_unaligned_rows(rt, arena, put, shift):
    """Rows start at any even address (a 34-byte block stride, a tensor at a 2-byte offset in the GGUF blob)."""
    rows, cols = 70, 4096 + 64
    raw, x, mag = _q8_case(rows, cols, 30)
    blob = np.zeros(raw.nbytes + 16, np.uint8)
    blob[shift: shift + raw.nbytes] = raw.reshape(-1)
    dblob = put(blob)
    dW = DeviceArray(dblob.ptr + shift, (raw.nbytes,), np.dtype(np.uint8), readonly=True)
    dx, dy = put(x, weights=False), arena.scratch(rows, np.float32)
    ops.gemv_q8_0(rt, dW, dx, dy, rows, cols, warps=8)
    twins.assert_close_scaled(dy.download(), twins.gemv_q8_0(raw, x, rows, cols), mag, cols, "gemv_q8_0 unaligned")


def test_embed(rt, arena, put):
    vocab, dim = 1000, 4096
    table = (R(4).standard_normal((vocab, dim))).astype(np.float16)
    ids = np.array([0, 999, 17, 17, -1, 1000, 512], np.int32)
    dt, di = put(table), put(ids, weights=False)
    out = arena.scratch((len(ids), dim), np.float32)
    ops.embed(rt, dt, di, out, len(ids))
    got, ref = out.download(), twins.embed_f16(table, ids)
    np.testing.assert_array_equal(got, ref)          # f16 -> f32 is exact; bad ids give NaN rows in both
    assert np.isnan(got[4]).all() and np.isnan(got[5]).all()


@pytest.mark.parametrize("parts, threads", [(1, 256), (7, 128), (132, 256), (600, 1024)])
def test_argmax(rt, arena, put, parts, threads):
    n = 129280
    cases = []
    x = R(5).standard_normal(n).astype(np.float32)
    cases.append(x)
    tie = x.copy()
    tie[[77_000, 5, 120_000]] = 50.0                     # ties -> lowest index (5)
    cases.append(tie)
    nan = x.copy()
    nan[[90_000, 1234]] = np.nan                         # numpy: first NaN
    cases.append(nan)
    cases.append(np.full(n, -np.inf, np.float32))        # all -inf -> 0
    cases.append(x[:1000].copy())                        # fewer elements than threads * parts
    pv, pi = arena.scratch(parts, np.float32), arena.scratch(parts, np.int32)
    out = arena.scratch(1, np.int32)
    for c in cases:
        dx = put(c, weights=False)
        ops.argmax(rt, dx, len(c), pv, pi, out, threads=threads)
        assert int(out.download()[0]) == twins.argmax(c)
