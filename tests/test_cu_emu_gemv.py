"""cu/gemv.cu against its twin (ds4py/cuda/twins/gemv.py) on the CPU emulator, in every thread order: F32, F16
and Q8_0 at ragged shapes and several geometries, several matrices per launch, the RMSNorm prologue, accumulate,
input groups, the hc_post and SwiGLU epilogues, unaligned Q8_0 rows, and batch invariance (a row's bits do not
depend on the launch). tests/gpu/test_kernels_core.py runs the same functions on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from cu_fixtures import (GEMV_KINDS, arena, check_gemv, check_several_matrices, gemv_weights, put,  # noqa: F401 (fixtures)
                         requires_emulator, rng, rt)
from ds4py.cuda import ops, twins
from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.twins import gemv as tg
from ds4py.cuda.ops.gemv import GemvX, SwiGlu
from ds4py.cuda.ops.mhc import HcResidual
from ds4py.errors import Ds4Error

pytestmark = requires_emulator


# (rows, cols, warps, grid): ragged row counts (not a multiple of 4 rows per warp step), Q8_0 rows spanning 1, 2
# and 3 staged pieces of 32 blocks (the last one partial), grids small enough that warps loop over row groups.
GEOMETRIES = [(1, 32, 1, None), (5, 96, 2, None), (37, 288, 3, None), (67, 1056, 4, None), (130, 128, 4, 3),
              (9, 2080, 2, 1)]


@pytest.mark.parametrize("kind", GEMV_KINDS)
@pytest.mark.parametrize("rows,cols,warps,grid", GEOMETRIES)
def test_gemv(rt, arena, put, kind, rows, cols, warps, grid):
    r = rng(rows, cols, warps, len(kind))
    W = gemv_weights(r, kind, rows, cols)
    x = r.standard_normal(cols).astype(np.float32)
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), y, rows)], GemvX(put(x, False), cols), warps=warps, grid=grid)
    check_gemv(y.download(), W, x, rows, cols, f"{kind} {rows}x{cols}")


@pytest.mark.parametrize("kind", GEMV_KINDS)
def test_several_matrices_norm_and_add(rt, arena, put, kind):
    """q_a + kv style: three matrices share x in one launch; RMSNorm prologue with and without a weight; add."""
    check_several_matrices(rt, arena, put, rng(7, len(kind)), kind, 160, kind, [((None, 1e-5), (None, 1e-5))])


@pytest.mark.parametrize("kind", ("F16", "Q8_0"))
def test_input_groups(rt, arena, put, kind):
    """wo_a style: rows [g*8, (g+1)*8) read x[g]."""
    r = rng(8, len(kind))
    rows, cols, group = 24, 64, 8
    W = gemv_weights(r, kind, rows, cols)
    x = r.standard_normal(3 * cols).astype(np.float32)
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), y, rows)], GemvX(put(x, False), cols, x_group_rows=group), warps=2)
    check_gemv(y.download(), W, x, rows, cols, f"{kind} groups", x_group_rows=group)


@pytest.mark.parametrize("shift", [2, 6, 14])
def test_q8_0_rows_at_any_even_address(rt, arena, put, shift):
    """A Q8_0 tensor 2 bytes into a 16-byte word (34-byte blocks, tensors packed in one GGUF blob)."""
    r = rng(9, shift)
    rows, cols = 11, 1088
    W = gemv_weights(r, "Q8_0", rows, cols)
    blob = np.zeros(W.nbytes + 16, np.uint8)
    blob[shift: shift + W.nbytes] = W.reshape(-1)
    dW = put(blob).view(shift, W.shape, np.uint8)
    x = r.standard_normal(cols).astype(np.float32)
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(dW, y, rows)], GemvX(put(x, False), cols), warps=3)
    check_gemv(y.download(), W, x, rows, cols, f"q8_0 at +{shift}")


@pytest.mark.parametrize("kind", GEMV_KINDS)
def test_hc_post_epilogue(rt, arena, put, kind):
    r = rng(10, len(kind))
    D, cols, hc = 42, 96, 4
    W = gemv_weights(r, kind, D, cols, 0.3)
    x = r.standard_normal(cols).astype(np.float32)
    X = r.standard_normal((hc, D)).astype(np.float32)
    mix = r.random((2 + hc) * hc).astype(np.float32)
    dX = put(X, False)
    ops.gemv_hc_post(rt, put(W), GemvX(put(x, False), cols), HcResidual(dX, put(mix), D), warps=2)
    f = tg.gemv(W, x, D, cols)
    want = tg.hc_post(f, X, mix)
    mag = (mix[hc:2 * hc, None] * tg.magnitude(W, x, D, cols)[None, :]
           + np.abs(mix[2 * hc:].reshape(hc, hc)).T @ np.abs(X))
    twins.assert_close_scaled(dX.download(), want, mag, cols, f"{kind} hc_post", factor=2.0)


@pytest.mark.parametrize("kind", GEMV_KINDS)
@pytest.mark.parametrize("clamp", [0.0, 2.5])
@pytest.mark.parametrize("rows", [1, 13])
def test_swiglu_epilogue(rt, arena, put, kind, clamp, rows):
    r = rng(11, rows, len(kind))
    cols = 96
    Wg, Wu = gemv_weights(r, kind, rows, cols, 0.5), gemv_weights(r, kind, rows, cols, 0.5)
    x = r.standard_normal(cols).astype(np.float32)
    y = arena.scratch(rows, np.float32)
    ops.gemv_swiglu(rt, SwiGlu(put(Wg), put(Wu), rows, clamp=clamp), GemvX(put(x, False), cols), y, warps=2)
    g, u = tg.gemv(Wg, x, rows, cols), tg.gemv(Wu, x, rows, cols)
    want = tg.swiglu(g, u, clamp)
    # |d silu(g) u| <= (1.1 |u| + |silu(g)|) * error of the dots
    mg, mu = tg.magnitude(Wg, x, rows, cols), tg.magnitude(Wu, x, rows, cols)
    mag = 1.1 * np.abs(u) * mg + np.abs(tg.ref.silu(g)) * mu + np.abs(want)
    twins.assert_close_scaled(y.download(), want, mag, cols, f"{kind} swiglu clamp {clamp}", factor=2.0)


@pytest.mark.parametrize("kind", GEMV_KINDS)
def test_batch_invariance(rt, arena, put, kind):
    """A row's result is bit-identical whatever else the launch covers: the whole matrix, or a sub-range of it
    (any first row) launched with other matrices and another geometry."""
    r = rng(12, len(kind))
    rows, cols = 29, 1056
    W = gemv_weights(r, kind, rows, cols)
    x = r.standard_normal(cols).astype(np.float32)
    dW, dx = put(W), put(x, False)
    full = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(dW, full, rows)], GemvX(dx, cols), warps=4)
    a, b = 5, 22
    row_bytes = W.nbytes // rows
    sub = dW.view(a * row_bytes, (b - a,) + W.shape[1:])
    other = put(gemv_weights(r, kind, 6, cols))
    y_sub, y_other = arena.scratch(b - a, np.float32), arena.scratch(6, np.float32)
    ops.gemv(rt, [(other, y_other, 6), (sub, y_sub, b - a)], GemvX(dx, cols), warps=1, grid=2)
    assert y_sub.download().tobytes() == full.download()[a:b].tobytes()


def test_the_tolerance_sees_one_quant_off(rt, arena, put):
    """The check above is strict enough that one int8 quant off by one in one row fails it."""
    r = rng(13)
    rows, cols = 16, 1056
    W = gemv_weights(r, "Q8_0", rows, cols)
    x = r.standard_normal(cols).astype(np.float32)
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), y, rows)], GemvX(put(x, False), cols))
    check_gemv(y.download(), W, x, rows, cols, "unchanged")
    bad = W.copy()
    bad[5, 34 * 7 + 2 + int(np.argmax(np.abs(x[224:256])))] += 1       # quant of the largest |x| in block 7
    with pytest.raises(AssertionError, match="1 of 16"):
        check_gemv(y.download(), bad, x, rows, cols, "one quant off")


def test_wrapper_checks(rt, arena, put):
    x = put(np.ones(64, np.float32), False)
    y = arena.scratch(8, np.float32)
    W = put(np.ones((8, 64), np.float16))
    with pytest.raises(Ds4Error, match="not 8 x 96"):
        ops.gemv(rt, [(W, y, 8)], GemvX(x, 96))
    with pytest.raises(Ds4Error, match="same type"):
        ops.gemv(rt, [(W, y, 8), (put(np.ones((8, 64), np.float32)), y, 8)], GemvX(x, 64))
    with pytest.raises(Ds4Error, match="multiple of 32"):
        ops.gemv(rt, [(put(np.zeros((2, 34), np.uint8)), y, 2)], GemvX(x, 40))
    with pytest.raises(Ds4Error, match="1 to 4"):
        ops.gemv(rt, [(W, y, 8)] * 5, GemvX(x, 64))
    with pytest.raises(Ds4Error, match="x_group_rows"):
        ops.gemv(rt, [(W, y, 8)], GemvX(x, 64, x_group_rows=3))
    with pytest.raises(Ds4Error, match="float32, float16 or Q8_0"):
        ops.gemv(rt, [(DeviceArray(W.ptr, (8, 64), np.dtype(np.int32), True, W.mem), y, 8)], GemvX(x, 64))
