"""cu/gemv.cu's int8-activation Q4_K kernels (gemv_q4_k_i8[_hc_post | _swiglu | _grouped][_rows]: Numerics.act_quant for the
K-quant GEMVs, dp4a against Q8_K codes) under the CPU emulator against their twin (ds4py/cuda/twins/gemv.py gemv_i8
with rounding "q8_k": the fp32 product on x rounded by the reference's own ds4py.ref.ops.q8_k_round, after the
RMSNorm). The kernels quantise x themselves and take exact integer sub-block dots, so they equal the twin within the
fp32 rounding of its sums (assert_close_scaled); one code off in the rounding is far outside it (x here has a zero
block, a block whose largest magnitude is negative, a tie of magnitude of either sign, and a block whose values lie
at exactly half a code). The `_rows` kernels are bit-identical to the single-row ones, also over several launches.
With input groups (gemv_q4_k_i8_grouped[_rows], V4.1's grouped wo_a) each group is rounded on its own (the twin:
ref.ops.q8_k_round per group) and each group's rows equal gemv_q4_k_i8 on that group's x bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from cu_fixtures import arena, gemv_weights, put, requires_emulator, rng, rt  # noqa: F401 (fixtures)
from ds4py.cuda import ops, twins
from ds4py.cuda.ops.gemv import GemvX, SwiGlu, i8_rows_per_launch
from ds4py.cuda.ops.mhc import HcResidual
from ds4py.cuda.twins import gemv as tg
from ds4py.errors import Ds4Error

pytestmark = requires_emulator


def activations(r: np.random.Generator, cols: int, n: int = 1) -> np.ndarray:
    """n rows of x whose Q8_K blocks (256) hit the rounding's corner cases."""
    x = (r.standard_normal((n, cols)) * 2).astype(np.float32)
    x[:, 1], x[:, 7] = np.float32(6.0), np.float32(-6.0)                   # a tie of magnitude, + first (block 0)
    if cols >= 512:
        x[:, 256:512] = 0.0                                                # a zero block (d = 0)
    if cols >= 768:                                                        # block 2: max -127, halves of a code
        x[:, 512:768] = (r.integers(-254, 255, (n, 256)) / 2).astype(np.float32)
        x[:, 600] = np.float32(-127.0)
    if cols >= 1024:                                                       # block 3: - first in a tie, then +
        x[:, 770], x[:, 900] = np.float32(-9.0), np.float32(9.0)
    return x


def check(got, W, x, rows, cols, what, norm=None):
    want, mag = tg.gemv_i8(W, x, rows, cols, norm, rounding="q8_k")
    twins.assert_close_scaled(got, want, mag, cols, what)
    assert not np.array_equal(want, tg.gemv(W, x, rows, cols, norm=norm))      # the rounding is really there
    q8_0, _ = tg.gemv_i8(W, x, rows, cols, norm)                               # and it is Q8_K's, not Q8_0's
    tol = 8 * np.finfo(np.float32).eps * np.sqrt(cols) * mag                  # assert_close_scaled's bound
    assert (np.abs(q8_0 - want) > 2 * tol).any()


@pytest.mark.parametrize("rows,cols,warps,grid", [(5, 256, 2, None), (37, 1024, 3, None), (67, 2304, 4, None),
                                                  (9, 4352, 2, 1)])
def test_gemv_q4k_i8(rt, arena, put, rows, cols, warps, grid):
    """Several pieces per row (2,304 and 4,352 columns: a piece is 2,048), ragged rows, one block for the grid."""
    r = rng(rows, cols, 31)
    W = gemv_weights(r, "Q4_K", rows, cols)
    x = activations(r, cols)[0]
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), y, rows)], GemvX(put(x, False), cols, act_quant=True), warps=warps, grid=grid)
    check(y.download(), W, x, rows, cols, f"q4_k i8 {rows}x{cols}")


def test_several_matrices_norm_and_add(rt, arena, put):
    r = rng(7, 31)
    cols, shapes = 1024, [5, 12, 7]
    Ws = [gemv_weights(r, "Q4_K", n, cols) for n in shapes]
    x = activations(r, cols)[0] * np.float32(3)
    # not the half-code block: after the RMSNorm its values lie within fp32 noise of a code's half, where the kernel's
    # norm and the reference's may round to different codes (a near tie, as the engine test explains)
    x[512:768] = r.standard_normal(256).astype(np.float32)
    nw = (1 + 0.1 * r.standard_normal(cols)).astype(np.float32)
    dx, dnw = put(x, False), put(nw)
    for norm_dev, norm_host in [(None, None), ((dnw, 1e-6), (nw, 1e-6)), ((None, 1e-5), (None, 1e-5))]:
        ys = [arena.scratch(n, np.float32) for n in shapes]
        ops.gemv(rt, [(put(W), y, n) for W, y, n in zip(Ws, ys, shapes)],
                 GemvX(dx, cols, norm=norm_dev, act_quant=True), warps=2)
        for W, y, n in zip(Ws, ys, shapes):
            check(y.download(), W, x, n, cols, f"q4_k i8 multi {n} norm {norm_host is not None}", norm=norm_host)
    base = r.standard_normal(shapes[0]).astype(np.float32)
    y = put(base, False)
    ops.gemv(rt, [(put(Ws[0]), y, shapes[0])], GemvX(dx, cols, act_quant=True), add=True)
    want, mag = tg.gemv_i8(Ws[0], x, shapes[0], cols, rounding="q8_k")
    twins.assert_close_scaled(y.download(), want + base, mag + np.abs(base), cols, "q4_k i8 add")


def test_hc_post_and_swiglu(rt, arena, put):
    r = rng(10, 31)
    D, cols, hc, clamp = 42, 768, 4, 2.5
    W = gemv_weights(r, "Q4_K", D, cols, 0.3)
    x = activations(r, cols)[0]
    X = r.standard_normal((hc, D)).astype(np.float32)
    mix = r.random((2 + hc) * hc).astype(np.float32)
    dX = put(X, False)
    ops.gemv_hc_post(rt, put(W), GemvX(put(x, False), cols, act_quant=True), HcResidual(dX, put(mix), D), warps=2)
    f, fm = tg.gemv_i8(W, x, D, cols, rounding="q8_k")
    want = tg.hc_post(f, X, mix)
    mag = mix[hc:2 * hc, None] * fm[None, :] + np.abs(mix[2 * hc:].reshape(hc, hc)).T @ np.abs(X)
    twins.assert_close_scaled(dX.download(), want, mag, cols, "q4_k i8 hc_post", factor=2.0)
    rows = 13
    Wg, Wu = gemv_weights(r, "Q4_K", rows, cols, 0.5), gemv_weights(r, "Q4_K", rows, cols, 0.5)
    y = arena.scratch(rows, np.float32)
    ops.gemv_swiglu(rt, SwiGlu(put(Wg), put(Wu), rows, clamp=clamp), GemvX(put(x, False), cols, act_quant=True), y,
                    warps=2)
    (g, mg), (u, mu) = tg.gemv_i8(Wg, x, rows, cols, rounding="q8_k"), tg.gemv_i8(Wu, x, rows, cols, rounding="q8_k")
    want = tg.swiglu(g, u, clamp)
    mag = 1.1 * np.abs(u) * mg + np.abs(tg.ref.silu(g)) * mu + np.abs(want)
    twins.assert_close_scaled(y.download(), want, mag, cols, "q4_k i8 swiglu", factor=2.0)


@pytest.mark.parametrize("cols", [768, 16384])
def test_rows_are_the_single_row_kernels_bit_for_bit(rt, arena, put, cols):
    """nx rows in one launch (or, at 16,384 columns, several: 5 rows of Q8_K x fit GB10's shared memory beside
    4 warps' ring) = each row alone, for the plain, hc_post and swiglu kernels, with the norm prologue."""
    r = rng(12, cols, 31)
    rows, nx, hc = 9, 8, 4
    W = gemv_weights(r, "Q4_K", rows, cols)
    x = activations(r, cols, nx)
    nw = (1 + 0.1 * r.standard_normal(cols)).astype(np.float32)
    dW, dx, dnw = put(W), put(x, False), put(nw)
    if cols == 16384:
        assert i8_rows_per_launch(cols, 4, "Q4_K") < nx
    y = arena.scratch(nx * rows, np.float32)
    ops.gemv(rt, [(dW, y, rows)], GemvX(dx, cols, nx=nx, norm=(dnw, 1e-6), act_quant=True), warps=4)
    X = r.standard_normal((nx, hc, rows)).astype(np.float32)
    mix = r.random((nx, (2 + hc) * hc)).astype(np.float32)
    dX = put(X, False)
    ops.gemv_hc_post(rt, dW, GemvX(dx, cols, nx=nx, act_quant=True), HcResidual(dX, put(mix), rows), warps=4)
    sw = arena.scratch(nx * rows, np.float32)
    ops.gemv_swiglu(rt, SwiGlu(dW, dW, rows, clamp=1.5), GemvX(dx, cols, nx=nx, act_quant=True), sw, warps=4)
    for n in range(nx):
        one = arena.scratch(rows, np.float32)
        ops.gemv(rt, [(dW, one, rows)], GemvX(put(x[n], False), cols, norm=(dnw, 1e-6), act_quant=True), warps=4)
        assert y.download()[n * rows:(n + 1) * rows].tobytes() == one.download().tobytes(), f"row {n}"
        h1 = put(X[n], False)
        ops.gemv_hc_post(rt, dW, GemvX(put(x[n], False), cols, act_quant=True), HcResidual(h1, put(mix[n]), rows),
                         warps=4)
        assert dX.download()[n].tobytes() == h1.download().tobytes(), f"hc_post row {n}"
        s1 = arena.scratch(rows, np.float32)
        ops.gemv_swiglu(rt, SwiGlu(dW, dW, rows, clamp=1.5), GemvX(put(x[n], False), cols, act_quant=True), s1,
                        warps=4)
        assert sw.download()[n * rows:(n + 1) * rows].tobytes() == s1.download().tobytes(), f"swiglu row {n}"
    check(one.download(), W, x[nx - 1], rows, cols, "q4_k i8 last row", norm=(nw, 1e-6))


def test_refusals(rt, arena, put):
    r = rng(13, 31)
    x = put(r.standard_normal(1024).astype(np.float32), False)
    y = arena.scratch(8, np.float32)
    with pytest.raises(Ds4Error, match="do not combine with input groups"):
        ops.gemv_hc_post(rt, put(gemv_weights(r, "Q4_K", 8, 256)), GemvX(x, 256, x_group_rows=4, act_quant=True),
                         HcResidual(put(np.zeros((4, 8), np.float32), False), put(np.zeros(24, np.float32)), 8))
    with pytest.raises(Ds4Error, match="RMSNorm prologue does not combine with input groups"):
        ops.gemv(rt, [(put(gemv_weights(r, "Q4_K", 8, 256)), y, 8)],
                 GemvX(x, 256, x_group_rows=4, norm=(None, 1e-6), act_quant=True))
    xw = put(np.zeros(8192, np.float32), False)                 # 10 warps' rings + one row of 8,192: > GB10's
    with pytest.raises(Ds4Error, match="do not fit shared memory"):
        ops.gemv(rt, [(put(gemv_weights(r, "Q4_K", 8, 8192)), y, 8)], GemvX(xw, 8192, act_quant=True), warps=10)


# ---- input groups (gemv_q4_k_i8_grouped[_rows]: V4.1's grouped wo_a, each warp's x group quantised as Q8_K) ----------
def grouped_x(r: np.random.Generator, groups: int, cols: int, n: int = 1) -> np.ndarray:
    """n rows of `groups` groups of x, each group with activations()'s corner-case blocks."""
    return np.stack([np.concatenate([activations(r, cols)[0] for _ in range(groups)]) for _ in range(n)])


def check_grouped(got, W, x, rows, cols, xgr, what):
    want, mag = tg.gemv_i8(W, x, rows, cols, x_group_rows=xgr, rounding="q8_k")
    twins.assert_close_scaled(got, want, mag, cols, what)
    assert not np.array_equal(want, tg.gemv(W, x, rows, cols, x_group_rows=xgr))   # the rounding is really there
    q8_0, _ = tg.gemv_i8(W, x, rows, cols, x_group_rows=xgr)                       # and it is Q8_K's, per group
    tol = 8 * np.finfo(np.float32).eps * np.sqrt(cols) * mag
    assert (np.abs(q8_0 - want) > 2 * tol).any()


@pytest.mark.parametrize("rows,cols,xgr,warps,grid", [(24, 256, 8, 2, None), (40, 768, 12, 3, None),
                                                      (66, 1024, 16, 4, None), (12, 2304, 4, 2, 1)])
def test_grouped_is_the_twin_and_each_group_alone_bit_for_bit(rt, arena, put, rows, cols, xgr, warps, grid):
    """Row block g reads group g's x, rounded on its own as Q8_K; each group's rows = gemv_q4_k_i8 on that group's x
    bit for bit. Ragged: rows not a multiple of x_group_rows (66 = 4 x 16 + 2), several pieces per row (2,304
    columns), one block for the grid (each warp's run crossing groups)."""
    r = rng(rows, cols, xgr, 41)
    groups = -(-rows // xgr)
    W = gemv_weights(r, "Q4_K", rows, cols)
    x = grouped_x(r, groups, cols)[0]
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), y, rows)], GemvX(put(x, False), cols, x_group_rows=xgr, act_quant=True), warps=warps,
             grid=grid)
    got = y.download()
    check_grouped(got, W, x, rows, cols, xgr, f"q4_k i8 grouped {rows}x{cols}/{xgr}")
    for g in range(groups):
        n = min(xgr, rows - g * xgr)
        one = arena.scratch(n, np.float32)
        ops.gemv(rt, [(put(W[g * xgr:g * xgr + n]), one, n)], GemvX(put(x[g * cols:(g + 1) * cols], False), cols,
                                                                     act_quant=True), warps=warps)
        assert got[g * xgr:g * xgr + n].tobytes() == one.download().tobytes(), f"group {g}"


def test_grouped_several_matrices_rows_and_add(rt, arena, put):
    """Two matrices of one launch (each its own groups from x's start); nx = 3 rows in one launch
    (gemv_q4_k_i8_grouped_rows, x_stride wider than the groups) = each row alone bit for bit; add."""
    r = rng(22, 41)
    cols, xgr, shapes, nx, groups = 512, 8, [20, 13], 3, 3
    Ws = [gemv_weights(r, "Q4_K", n, cols) for n in shapes]
    stride = groups * cols + 32
    xs = np.zeros((nx, stride), np.float32)
    xs[:, :groups * cols] = grouped_x(r, groups, cols, nx)
    dWs, dx = [put(W) for W in Ws], put(xs, False)
    ys = [arena.scratch(nx * n, np.float32) for n in shapes]
    ops.gemv(rt, [(dW, y, n) for dW, y, n in zip(dWs, ys, shapes)],
             GemvX(dx, cols, nx=nx, x_stride=stride, x_group_rows=xgr, act_quant=True), warps=2)
    for k in range(nx):
        for W, dW, y, n in zip(Ws, dWs, ys, shapes):
            one = arena.scratch(n, np.float32)
            ops.gemv(rt, [(dW, one, n)], GemvX(put(xs[k], False), cols, x_group_rows=xgr, act_quant=True), warps=2)
            assert y.download()[k * n:(k + 1) * n].tobytes() == one.download().tobytes(), f"row {k} matrix {n}"
            check_grouped(one.download(), W, xs[k], n, cols, xgr, f"q4_k i8 grouped row {k}")
    base = r.standard_normal(shapes[0]).astype(np.float32)
    y = put(base, False)
    ops.gemv(rt, [(dWs[0], y, shapes[0])], GemvX(put(xs[0], False), cols, x_group_rows=xgr, act_quant=True), add=True)
    want, mag = tg.gemv_i8(Ws[0], xs[0], shapes[0], cols, x_group_rows=xgr, rounding="q8_k")
    twins.assert_close_scaled(y.download(), want + base, mag + np.abs(base), cols, "q4_k i8 grouped add")


def test_grouped_rows_over_several_launches(rt, arena, put):
    """At 8,192 columns 4 warps hold one row of Q8_K x each beside their rings (GB10's shared memory): nx = 3 rows
    take 3 launches; by default fewer warps and one launch. Every row = that row alone bit for bit, and the twin."""
    from ds4py.cuda.ops.gemv import _i8_grouped_launches

    cols, xgr, rows, nx = 8192, 4, 10, 3
    assert _i8_grouped_launches(rt, "t", "Q4_K", 3, cols, nx, 4, None, "gemv_q4_k_i8_grouped_rows")[3] == 1
    assert _i8_grouped_launches(rt, "t", "Q4_K", 3, cols, nx, None, None, "gemv_q4_k_i8_grouped_rows")[3] == nx
    r = rng(24, cols, 41)
    W = gemv_weights(r, "Q4_K", rows, cols)
    xs = grouped_x(r, 3, cols, nx)
    dW, dx = put(W), put(xs, False)
    for warps in (4, None):
        y = arena.scratch(nx * rows, np.float32)
        ops.gemv(rt, [(dW, y, rows)], GemvX(dx, cols, nx=nx, x_group_rows=xgr, act_quant=True), warps=warps)
        for k in range(nx):
            one = arena.scratch(rows, np.float32)
            ops.gemv(rt, [(dW, one, rows)], GemvX(put(xs[k], False), cols, x_group_rows=xgr, act_quant=True))
            assert y.download()[k * rows:(k + 1) * rows].tobytes() == one.download().tobytes(), f"row {k} {warps}"
    check_grouped(one.download(), W, xs[nx - 1], rows, cols, xgr, "q4_k i8 grouped 8192")
