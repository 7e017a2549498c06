"""cu/gemv.cu's int8-activation Q8_0 kernels (gemv_q8_0_i8[_hc_post | _swiglu][_rows]: Numerics.act_quant, dp4a as
llama.cpp's mmvq) under the CPU emulator against their twin (ds4py/cuda/twins/gemv.py gemv_i8: the fp32 product on x
rounded by the reference's own ds4py.ref.ops.q8_0_round, after the RMSNorm). The kernels quantise x themselves and
take exact integer block dots, so they equal the twin within the fp32 rounding of its sums (assert_close_scaled):
one code off in the rounding is far outside it (x here has zero blocks, ties of magnitude and values at exactly half a
code). The `_rows` kernels are bit-identical to the single-row ones, also when the rows take several launches. With
input groups (gemv_q8_0_i8_grouped[_rows], the grouped wo_a) each group's rows equal gemv_q8_0_i8 on that group's x
bit for bit."""

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
    x = (r.standard_normal((n, cols)) * 2).astype(np.float32)
    x[:, 1], x[:, 7] = np.float32(6.0), np.float32(-6.0)                   # a tie of magnitude in block 0
    if cols >= 64:
        x[:, 32:64] = 0.0                                                  # a zero block (d = 0)
    if cols >= 96:                                                         # block 2: max 127, halves of a code
        x[:, 64:96] = (r.integers(-254, 255, (n, 32)) / 2).astype(np.float32)
        x[:, 70] = np.float32(127.0)
    return x


def check(got, W, x, rows, cols, what, norm=None):
    want, mag = tg.gemv_i8(W, x, rows, cols, norm)
    twins.assert_close_scaled(got, want, mag, cols, what)
    exact = tg.gemv(W, x, rows, cols, norm=norm)
    assert not np.array_equal(want, exact)                               # the rounding is really there


@pytest.mark.parametrize("rows,cols,warps,grid", [(5, 96, 2, None), (37, 288, 3, None), (67, 1056, 4, None),
                                                  (9, 2080, 2, 1)])
def test_gemv_i8(rt, arena, put, rows, cols, warps, grid):
    r = rng(rows, cols, 8)
    W = gemv_weights(r, "Q8_0", rows, cols)
    x = activations(r, cols)[0]
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), y, rows)], GemvX(put(x, False), cols, act_quant=True), warps=warps, grid=grid)
    check(y.download(), W, x, rows, cols, f"i8 {rows}x{cols}")


def test_several_matrices_norm_and_add(rt, arena, put):
    r = rng(7, 8)
    cols, shapes = 160, [5, 12, 7]
    Ws = [gemv_weights(r, "Q8_0", n, cols) for n in shapes]
    x = activations(r, cols)[0] * np.float32(3)
    # not the half-code block: after the RMSNorm its values lie within fp32 noise of a code's half, where the kernel's
    # norm and the reference's round to different codes (a near tie, as the engine test explains)
    x[64:96] = r.standard_normal(32).astype(np.float32)
    nw = (1 + 0.1 * r.standard_normal(cols)).astype(np.float32)
    dx, dnw = put(x, False), put(nw)
    for norm_dev, norm_host in [(None, None), ((dnw, 1e-6), (nw, 1e-6)), ((None, 1e-5), (None, 1e-5))]:
        ys = [arena.scratch(n, np.float32) for n in shapes]
        ops.gemv(rt, [(put(W), y, n) for W, y, n in zip(Ws, ys, shapes)],
                 GemvX(dx, cols, norm=norm_dev, act_quant=True), warps=2)
        for W, y, n in zip(Ws, ys, shapes):
            check(y.download(), W, x, n, cols, f"i8 multi {n} norm {norm_host is not None}", norm=norm_host)
    base = r.standard_normal(shapes[0]).astype(np.float32)
    y = put(base, False)
    ops.gemv(rt, [(put(Ws[0]), y, shapes[0])], GemvX(dx, cols, act_quant=True), add=True)
    want, mag = tg.gemv_i8(Ws[0], x, shapes[0], cols)
    twins.assert_close_scaled(y.download(), want + base, mag + np.abs(base), cols, "i8 add")


def test_hc_post_and_swiglu(rt, arena, put):
    r = rng(10, 8)
    D, cols, hc, clamp = 42, 96, 4, 2.5
    W = gemv_weights(r, "Q8_0", D, cols, 0.3)
    x = activations(r, cols)[0]
    X = r.standard_normal((hc, D)).astype(np.float32)
    mix = r.random((2 + hc) * hc).astype(np.float32)
    dX = put(X, False)
    ops.gemv_hc_post(rt, put(W), GemvX(put(x, False), cols, act_quant=True), HcResidual(dX, put(mix), D), warps=2)
    f, fm = tg.gemv_i8(W, x, D, cols)
    want = tg.hc_post(f, X, mix)
    mag = mix[hc:2 * hc, None] * fm[None, :] + np.abs(mix[2 * hc:].reshape(hc, hc)).T @ np.abs(X)
    twins.assert_close_scaled(dX.download(), want, mag, cols, "i8 hc_post", factor=2.0)
    rows = 13
    Wg, Wu = gemv_weights(r, "Q8_0", rows, cols, 0.5), gemv_weights(r, "Q8_0", rows, cols, 0.5)
    y = arena.scratch(rows, np.float32)
    ops.gemv_swiglu(rt, SwiGlu(put(Wg), put(Wu), rows, clamp=clamp), GemvX(put(x, False), cols, act_quant=True), y,
                    warps=2)
    (g, mg), (u, mu) = tg.gemv_i8(Wg, x, rows, cols), tg.gemv_i8(Wu, x, rows, cols)
    want = tg.swiglu(g, u, clamp)
    mag = 1.1 * np.abs(u) * mg + np.abs(tg.ref.silu(g)) * mu + np.abs(want)
    twins.assert_close_scaled(y.download(), want, mag, cols, "i8 swiglu", factor=2.0)


@pytest.mark.parametrize("cols", [288, 8192])
def test_rows_are_the_single_row_kernels_bit_for_bit(rt, arena, put, cols):
    """nx rows in one launch (or, at 8,192 columns, several: 5 rows of int8 x fit GB10's shared memory beside
    4 warps' ring) = each row alone, for the plain, hc_post and swiglu kernels, with the norm prologue."""
    r = rng(12, cols)
    rows, nx, hc = 9, 8, 4
    W = gemv_weights(r, "Q8_0", rows, cols)
    x = activations(r, cols, nx)
    nw = (1 + 0.1 * r.standard_normal(cols)).astype(np.float32)
    dW, dx, dnw = put(W), put(x, False), put(nw)
    if cols == 8192:
        assert i8_rows_per_launch(cols, 4) < nx
    y = arena.scratch(nx * rows, np.float32)
    ops.gemv(rt, [(dW, y, rows)], GemvX(dx, cols, nx=nx, norm=(dnw, 1e-6), act_quant=True), warps=4)
    for n in range(nx):
        one = arena.scratch(rows, np.float32)
        ops.gemv(rt, [(dW, one, rows)], GemvX(put(x[n], False), cols, norm=(dnw, 1e-6), act_quant=True), warps=4)
        assert y.download()[n * rows:(n + 1) * rows].tobytes() == one.download().tobytes(), f"row {n}"
    X = r.standard_normal((nx, hc, rows)).astype(np.float32)
    mix = r.random((nx, (2 + hc) * hc)).astype(np.float32)
    dX = put(X, False)
    ops.gemv_hc_post(rt, dW, GemvX(dx, cols, nx=nx, act_quant=True), HcResidual(dX, put(mix), rows), warps=4)
    sw = arena.scratch(nx * rows, np.float32)
    ops.gemv_swiglu(rt, SwiGlu(dW, dW, rows, clamp=1.5), GemvX(dx, cols, nx=nx, act_quant=True), sw, warps=4)
    for n in range(nx):
        one = put(X[n], False)
        ops.gemv_hc_post(rt, dW, GemvX(put(x[n], False), cols, act_quant=True), HcResidual(one, put(mix[n]), rows),
                         warps=4)
        assert dX.download()[n].tobytes() == one.download().tobytes(), f"hc_post row {n}"
        s1 = arena.scratch(rows, np.float32)
        ops.gemv_swiglu(rt, SwiGlu(dW, dW, rows, clamp=1.5), GemvX(put(x[n], False), cols, act_quant=True), s1,
                        warps=4)
        assert sw.download()[n * rows:(n + 1) * rows].tobytes() == s1.download().tobytes(), f"swiglu row {n}"


def test_refusals(rt, arena, put):
    r = rng(13)
    x = put(r.standard_normal(64).astype(np.float32), False)
    y = arena.scratch(8, np.float32)
    with pytest.raises(Ds4Error, match="Q8_0 and Q4_K weights only"):
        ops.gemv(rt, [(put(gemv_weights(r, "F16", 8, 64)), y, 8)], GemvX(x, 64, act_quant=True))
    with pytest.raises(Ds4Error, match="input groups"):
        ops.gemv_hc_post(rt, put(gemv_weights(r, "Q8_0", 8, 32)), GemvX(x, 32, x_group_rows=4, act_quant=True),
                         HcResidual(arena.scratch(32, np.float32), put(np.zeros(24, np.float32)), 8))
    with pytest.raises(Ds4Error, match="input groups"):
        ops.gemv(rt, [(put(gemv_weights(r, "Q8_0", 8, 32)), y, 8)],
                 GemvX(x, 32, x_group_rows=4, norm=(None, 1e-6), act_quant=True))


# ---- input groups (gemv_q8_0_i8_grouped[_rows]: the grouped wo_a, x quantised in the block loop) ------------------
def grouped_x(r: np.random.Generator, groups: int, cols: int, n: int = 1) -> np.ndarray:
    """n rows of `groups` groups of x, each group with activations()'s special blocks."""
    return np.stack([np.concatenate([activations(r, cols)[0] for _ in range(groups)]) for _ in range(n)])


@pytest.mark.parametrize("rows,cols,xgr,warps,grid", [(24, 96, 8, 2, None), (40, 288, 12, 3, None),
                                                      (66, 1056, 16, 4, None), (12, 2080, 4, 2, 1)])
def test_grouped_is_the_twin_and_each_group_alone_bit_for_bit(rt, arena, put, rows, cols, xgr, warps, grid):
    """Row block g reads group g's x, rounded on its own (the twin: ref.ops.q8_0_round per group); and each group's
    rows are gemv_q8_0_i8 on that group's x bit for bit (the same codes, scales and sum order). Ragged: rows not a
    multiple of x_group_rows (66 = 4 x 16 + 2), several pieces per row (2,080 columns)."""
    r = rng(rows, cols, xgr)
    groups = -(-rows // xgr)
    W = gemv_weights(r, "Q8_0", rows, cols)
    x = grouped_x(r, groups, cols)[0]
    y = arena.scratch(rows, np.float32)
    dW = put(W)
    ops.gemv(rt, [(dW, y, rows)], GemvX(put(x, False), cols, x_group_rows=xgr, act_quant=True), warps=warps, grid=grid)
    got = y.download()
    want, mag = tg.gemv_i8(W, x, rows, cols, x_group_rows=xgr)
    twins.assert_close_scaled(got, want, mag, cols, f"i8 grouped {rows}x{cols}/{xgr}")
    assert not np.array_equal(want, tg.gemv(W, x, rows, cols, x_group_rows=xgr))   # the rounding is really there
    for g in range(groups):
        n = min(xgr, rows - g * xgr)
        one = arena.scratch(n, np.float32)
        ops.gemv(rt, [(put(W[g * xgr:g * xgr + n]), one, n)], GemvX(put(x[g * cols:(g + 1) * cols], False), cols,
                                                                     act_quant=True), warps=warps)
        assert got[g * xgr:g * xgr + n].tobytes() == one.download().tobytes(), f"group {g}"


def test_grouped_several_matrices_and_rows(rt, arena, put):
    """Two matrices of one launch (each its own groups from x's start), add; nx = 3 rows in one launch
    (gemv_q8_0_i8_grouped_rows, x_stride wider than the groups) = each row alone bit for bit."""
    r = rng(21, 5)
    cols, xgr, shapes, nx = 160, 8, [20, 13], 3
    Ws = [gemv_weights(r, "Q8_0", n, cols) for n in shapes]
    groups = 3
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
            want, mag = tg.gemv_i8(W, xs[k], n, cols, x_group_rows=xgr)
            twins.assert_close_scaled(one.download(), want, mag, cols, f"i8 grouped row {k}")
    base = r.standard_normal(shapes[0]).astype(np.float32)
    y = put(base, False)
    ops.gemv(rt, [(dWs[0], y, shapes[0])], GemvX(put(xs[0], False), cols, x_group_rows=xgr, act_quant=True), add=True)
    want, mag = tg.gemv_i8(Ws[0], xs[0], shapes[0], cols, x_group_rows=xgr)
    twins.assert_close_scaled(y.download(), want + base, mag + np.abs(base), cols, "i8 grouped add")


def test_grouped_rows_over_several_launches_and_warps(rt, arena, put):
    """At 8,192 columns 4 warps hold one row of int8 x each beside their rings (GB10's shared memory): nx = 3 rows
    take 3 launches; by default the launch takes fewer warps and one launch. Every row = that row alone, bit for
    bit, and the twin."""
    from ds4py.cuda.ops.gemv import _i8_grouped_launches

    cols, xgr, rows, nx = 8192, 4, 10, 3
    assert _i8_grouped_launches(rt, "t", "Q8_0", 3, cols, nx, 4, None, "gemv_q8_0_i8_grouped_rows")[3] == 1
    assert _i8_grouped_launches(rt, "t", "Q8_0", 3, cols, nx, None, None, "gemv_q8_0_i8_grouped_rows")[3] == nx
    r = rng(23, cols)
    W = gemv_weights(r, "Q8_0", rows, cols)
    xs = grouped_x(r, 3, cols, nx)
    dW, dx = put(W), put(xs, False)
    for warps in (4, None):
        y = arena.scratch(nx * rows, np.float32)
        ops.gemv(rt, [(dW, y, rows)], GemvX(dx, cols, nx=nx, x_group_rows=xgr, act_quant=True), warps=warps)
        for k in range(nx):
            one = arena.scratch(rows, np.float32)
            ops.gemv(rt, [(dW, one, rows)], GemvX(put(xs[k], False), cols, x_group_rows=xgr, act_quant=True))
            assert y.download()[k * rows:(k + 1) * rows].tobytes() == one.download().tobytes(), f"row {k} {warps}"
    want, mag = tg.gemv_i8(W, xs[nx - 1], rows, cols, x_group_rows=xgr)
    twins.assert_close_scaled(one.download(), want, mag, cols, "i8 grouped 8192")


def near_half_codes(r: np.random.Generator, cols: int) -> np.ndarray:
    """x whose every Q8_0 block has a scale d that is not a power of two and values within an ulp of (k + 1/2) d:
    where a quotient x / d computed other than correctly rounded (cu/gemv.cu div_rn_rcp's contract) lands on the
    other side of a code's half."""
    x = np.empty(cols, np.float32)
    for b in range(cols // 32):
        d = np.float32(r.uniform(0.01, 3.0)) / np.float32(127)
        k = r.integers(-127, 127, 32).astype(np.float64) + 0.5
        v = (k * np.float64(d)).astype(np.float32)
        step = r.integers(-1, 2, 32)
        v = np.where(step > 0, np.nextafter(v, np.float32(np.inf)), np.where(step < 0, np.nextafter(v, np.float32(-np.inf)), v))
        v[r.integers(0, 32)] = np.float32(127) * d                     # the block's amax: d = fl(amax / 127)
        x[32 * b:32 * b + 32] = v
    return x


@pytest.mark.parametrize("kind", ["near_half", "tiny"])
def test_codes_near_a_half_and_outside_the_fast_range(rt, arena, put, kind):
    """The codes equal ref.ops.q8_0_round's on quotients next to a code's half (the reciprocal-based quotient,
    div_rn_rcp); blocks whose scale is below its range (tiny: d < 2^-30) take __fdiv_rn out of line (their f16
    scale is 0 in the reference too; above 2^30 it is inf); plain and grouped kernels."""
    r = rng(31, len(kind))
    rows, cols = 12, 256
    x = near_half_codes(r, cols)
    if kind == "tiny":
        x = (x * np.float32(1e-9)).astype(np.float32)
    W = gemv_weights(r, "Q8_0", rows, cols)
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), y, rows)], GemvX(put(x, False), cols, act_quant=True), warps=2)
    check(y.download(), W, x, rows, cols, f"i8 {kind}")
    xg = np.concatenate([x, x[::-1].copy()])
    yg = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), yg, rows)], GemvX(put(xg, False), cols, x_group_rows=8, act_quant=True), warps=2)
    want, mag = tg.gemv_i8(W, xg, rows, cols, x_group_rows=8)
    twins.assert_close_scaled(yg.download(), want, mag, cols, f"i8 grouped {kind}")
