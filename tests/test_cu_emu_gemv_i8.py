"""cu/gemv.cu's int8-activation kernels under the CPU emulator against their twin (ds4py/cuda/twins/gemv.py gemv_i8:
the fp32 product on x rounded by the reference's own rounding, after the RMSNorm), each test run for both formats:

- Q8_0 weights (gemv_q8_0_i8[_hc_post | _swiglu | _grouped][_rows]: Numerics.act_quant, dp4a as llama.cpp's mmvq):
  x rounded as ds4py.ref.ops.q8_0_round (blocks of 32);
- Q4_K weights (gemv_q4_k_i8[_hc_post | _swiglu | _grouped][_rows]: act_quant for the K-quant GEMVs, dp4a against
  Q8_K codes): x rounded as ds4py.ref.ops.q8_k_round (blocks of 256; the twin's rounding "q8_k").

The kernels quantise x themselves and take exact integer block dots, so they equal the twin within the fp32 rounding
of its sums (assert_close_scaled): one code off in the rounding is far outside it (x here has a zero block, ties of
magnitude, a block whose values lie at exactly half a code; Q8_K: a block whose largest magnitude is negative and a
tie of either sign first). The `_rows` kernels are bit-identical to the single-row ones, also when the rows take
several launches. With input groups (the grouped wo_a) each group is rounded on its own (the twin: the rounding per
group) and each group's rows equal the plain int8 kernel on that group's x bit for bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from cu_fixtures import arena, gemv_weights, put, requires_emulator, rng, rt  # noqa: F401 (fixtures)
from ds4py.cuda import ops, twins
from ds4py.cuda.ops.gemv import GemvX, SwiGlu, i8_rows_per_launch
from ds4py.cuda.ops.mhc import HcResidual
from ds4py.cuda.twins import gemv as tg
from ds4py.errors import Ds4Error

pytestmark = requires_emulator


def q8_0_activations(r: np.random.Generator, cols: int, n: int = 1) -> np.ndarray:
    """n rows of x whose Q8_0 blocks (32) hit the rounding's corner cases."""
    x = (r.standard_normal((n, cols)) * 2).astype(np.float32)
    x[:, 1], x[:, 7] = np.float32(6.0), np.float32(-6.0)                   # a tie of magnitude in block 0
    if cols >= 64:
        x[:, 32:64] = 0.0                                                  # a zero block (d = 0)
    if cols >= 96:                                                         # block 2: max 127, halves of a code
        x[:, 64:96] = (r.integers(-254, 255, (n, 32)) / 2).astype(np.float32)
        x[:, 70] = np.float32(127.0)
    return x


def q8_k_activations(r: np.random.Generator, cols: int, n: int = 1) -> np.ndarray:
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


@dataclass(frozen=True)
class Fmt:
    """One weight format's int8-activation kernels as these tests drive them."""
    qtype: str                       # the weights: gemv_<qtype>_i8*
    rounding: str                    # the twin's rounding of x (gemv_i8's `rounding`)
    block: int                       # ... in blocks of this many values
    seed: int                        # mixed into every test's generator (the formats draw their own data)
    activations: Callable[..., np.ndarray]

    def kernel(self, suffix: str = "") -> str:
        return f"gemv_{self.qtype.lower()}_i8{suffix}"


Q8_0 = Fmt("Q8_0", "q8_0", 32, 8, q8_0_activations)
Q4_K = Fmt("Q4_K", "q8_k", 256, 31, q8_k_activations)
BOTH = [pytest.param(Q8_0, id="q8_0"), pytest.param(Q4_K, id="q4_k")]


def cases(q8_0: list[tuple], q4_k: list[tuple]) -> list:
    """pytest params (fmt, *case): each format's own shapes (Q4_K's columns are whole 256-blocks)."""
    return [pytest.param(f, *c, id="-".join([f.qtype.lower(), *map(str, c)]))
            for f, cs in ((Q8_0, q8_0), (Q4_K, q4_k)) for c in cs]


def check(fmt: Fmt, got, W, x, rows, cols, what, norm=None, x_group_rows=0):
    """got = the twin within the fp32 rounding of its sums; the rounding is really there (the exact product differs)
    and, for Q8_K, it is Q8_K's and not Q8_0's."""
    want, mag = tg.gemv_i8(W, x, rows, cols, norm, x_group_rows=x_group_rows, rounding=fmt.rounding)
    twins.assert_close_scaled(got, want, mag, cols, what)
    assert not np.array_equal(want, tg.gemv(W, x, rows, cols, norm=norm, x_group_rows=x_group_rows))
    if fmt.rounding != "q8_0":
        q8_0, _ = tg.gemv_i8(W, x, rows, cols, norm, x_group_rows=x_group_rows)
        tol = 8 * np.finfo(np.float32).eps * np.sqrt(cols) * mag          # assert_close_scaled's bound
        assert (np.abs(q8_0 - want) > 2 * tol).any()


@pytest.mark.parametrize("fmt,rows,cols,warps,grid", cases(
    q8_0=[(5, 96, 2, None), (37, 288, 3, None), (67, 1056, 4, None), (9, 2080, 2, 1)],
    q4_k=[(5, 256, 2, None), (37, 1024, 3, None), (67, 2304, 4, None), (9, 4352, 2, 1)]))
def test_gemv_i8(rt, arena, put, fmt, rows, cols, warps, grid):
    """Ragged rows, one block for the grid; several pieces per row (Q4_K: 2,304 and 4,352 columns, a piece is
    2,048)."""
    r = rng(rows, cols, fmt.seed)
    W = gemv_weights(r, fmt.qtype, rows, cols)
    x = fmt.activations(r, cols)[0]
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), y, rows)], GemvX(put(x, False), cols, act_quant=True), warps=warps, grid=grid)
    check(fmt, y.download(), W, x, rows, cols, f"{fmt.qtype} i8 {rows}x{cols}")


@pytest.mark.parametrize("fmt,cols", cases(q8_0=[(160,)], q4_k=[(1024,)]))
def test_several_matrices_norm_and_add(rt, arena, put, fmt, cols):
    r = rng(7, fmt.seed)
    b, shapes = fmt.block, [5, 12, 7]
    Ws = [gemv_weights(r, fmt.qtype, n, cols) for n in shapes]
    x = fmt.activations(r, cols)[0] * np.float32(3)
    # not the half-code block: after the RMSNorm its values lie within fp32 noise of a code's half, where the kernel's
    # norm and the reference's may round to different codes (a near tie, as the engine test explains)
    x[2 * b:3 * b] = r.standard_normal(b).astype(np.float32)
    nw = (1 + 0.1 * r.standard_normal(cols)).astype(np.float32)
    dx, dnw = put(x, False), put(nw)
    for norm_dev, norm_host in [(None, None), ((dnw, 1e-6), (nw, 1e-6)), ((None, 1e-5), (None, 1e-5))]:
        ys = [arena.scratch(n, np.float32) for n in shapes]
        ops.gemv(rt, [(put(W), y, n) for W, y, n in zip(Ws, ys, shapes)],
                 GemvX(dx, cols, norm=norm_dev, act_quant=True), warps=2)
        for W, y, n in zip(Ws, ys, shapes):
            check(fmt, y.download(), W, x, n, cols, f"{fmt.qtype} i8 multi {n} norm {norm_host is not None}",
                  norm=norm_host)
    base = r.standard_normal(shapes[0]).astype(np.float32)
    y = put(base, False)
    ops.gemv(rt, [(put(Ws[0]), y, shapes[0])], GemvX(dx, cols, act_quant=True), add=True)
    want, mag = tg.gemv_i8(Ws[0], x, shapes[0], cols, rounding=fmt.rounding)
    twins.assert_close_scaled(y.download(), want + base, mag + np.abs(base), cols, f"{fmt.qtype} i8 add")


@pytest.mark.parametrize("fmt", BOTH)
def test_hc_post_and_swiglu(rt, arena, put, fmt):
    r = rng(10, fmt.seed)
    D, cols, hc, clamp = 42, 3 * fmt.block, 4, 2.5
    W = gemv_weights(r, fmt.qtype, D, cols, 0.3)
    x = fmt.activations(r, cols)[0]
    X = r.standard_normal((hc, D)).astype(np.float32)
    mix = r.random((2 + hc) * hc).astype(np.float32)
    dX = put(X, False)
    ops.gemv_hc_post(rt, put(W), GemvX(put(x, False), cols, act_quant=True), HcResidual(dX, put(mix), D), warps=2)
    f, fm = tg.gemv_i8(W, x, D, cols, rounding=fmt.rounding)
    want = tg.hc_post(f, X, mix)
    mag = mix[hc:2 * hc, None] * fm[None, :] + np.abs(mix[2 * hc:].reshape(hc, hc)).T @ np.abs(X)
    twins.assert_close_scaled(dX.download(), want, mag, cols, f"{fmt.qtype} i8 hc_post", factor=2.0)
    rows = 13
    Wg, Wu = gemv_weights(r, fmt.qtype, rows, cols, 0.5), gemv_weights(r, fmt.qtype, rows, cols, 0.5)
    y = arena.scratch(rows, np.float32)
    ops.gemv_swiglu(rt, SwiGlu(put(Wg), put(Wu), rows, clamp=clamp), GemvX(put(x, False), cols, act_quant=True), y,
                    warps=2)
    (g, mg), (u, mu) = (tg.gemv_i8(Wg, x, rows, cols, rounding=fmt.rounding),
                        tg.gemv_i8(Wu, x, rows, cols, rounding=fmt.rounding))
    want = tg.swiglu(g, u, clamp)
    mag = 1.1 * np.abs(u) * mg + np.abs(tg.ref.silu(g)) * mu + np.abs(want)
    twins.assert_close_scaled(y.download(), want, mag, cols, f"{fmt.qtype} i8 swiglu", factor=2.0)


@pytest.mark.parametrize("fmt,cols", cases(q8_0=[(288,), (8192,)], q4_k=[(768,), (16384,)]))
def test_rows_are_the_single_row_kernels_bit_for_bit(rt, arena, put, fmt, cols):
    """nx rows in one launch (or, at the wider shape, several: 5 rows of rounded x fit GB10's shared memory beside
    4 warps' ring) = each row alone, for the plain, hc_post and swiglu kernels, with the norm prologue."""
    r = rng(12, cols, fmt.seed)
    rows, nx, hc = 9, 8, 4
    W = gemv_weights(r, fmt.qtype, rows, cols)
    x = fmt.activations(r, cols, nx)
    nw = (1 + 0.1 * r.standard_normal(cols)).astype(np.float32)
    dW, dx, dnw = put(W), put(x, False), put(nw)
    if cols >= 8192:
        assert i8_rows_per_launch(cols, 4, fmt.qtype) < nx
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
    check(fmt, one.download(), W, x[nx - 1], rows, cols, f"{fmt.qtype} i8 last row", norm=(nw, 1e-6))


@pytest.mark.parametrize("fmt", BOTH)
def test_input_groups_refuse_hc_post_and_the_norm(rt, arena, put, fmt):
    r = rng(13, fmt.seed)
    cols = fmt.block
    x = put(r.standard_normal(4 * cols).astype(np.float32), False)
    y = arena.scratch(8, np.float32)
    with pytest.raises(Ds4Error, match="do not combine with input groups"):
        ops.gemv_hc_post(rt, put(gemv_weights(r, fmt.qtype, 8, cols)), GemvX(x, cols, x_group_rows=4, act_quant=True),
                         HcResidual(put(np.zeros((4, 8), np.float32), False), put(np.zeros(24, np.float32)), 8))
    with pytest.raises(Ds4Error, match="RMSNorm prologue does not combine with input groups"):
        ops.gemv(rt, [(put(gemv_weights(r, fmt.qtype, 8, cols)), y, 8)],
                 GemvX(x, cols, x_group_rows=4, norm=(None, 1e-6), act_quant=True))


def test_refusals(rt, arena, put):
    r = rng(13)
    x = put(r.standard_normal(64).astype(np.float32), False)
    y = arena.scratch(8, np.float32)
    with pytest.raises(Ds4Error, match="Q8_0 and Q4_K weights only"):
        ops.gemv(rt, [(put(gemv_weights(r, "F16", 8, 64)), y, 8)], GemvX(x, 64, act_quant=True))
    xw = put(np.zeros(8192, np.float32), False)                 # 10 warps' rings + one row of 8,192: > GB10's
    with pytest.raises(Ds4Error, match="do not fit shared memory"):
        ops.gemv(rt, [(put(gemv_weights(r, "Q4_K", 8, 8192)), y, 8)], GemvX(xw, 8192, act_quant=True), warps=10)


# ---- input groups (gemv_<fmt>_i8_grouped[_rows]: the grouped wo_a, each warp's x group rounded in the block loop) ----
def grouped_x(fmt: Fmt, r: np.random.Generator, groups: int, cols: int, n: int = 1) -> np.ndarray:
    """n rows of `groups` groups of x, each group with the format's corner-case blocks."""
    return np.stack([np.concatenate([fmt.activations(r, cols)[0] for _ in range(groups)]) for _ in range(n)])


@pytest.mark.parametrize("fmt,rows,cols,xgr,warps,grid", cases(
    q8_0=[(24, 96, 8, 2, None), (40, 288, 12, 3, None), (66, 1056, 16, 4, None), (12, 2080, 4, 2, 1)],
    q4_k=[(24, 256, 8, 2, None), (40, 768, 12, 3, None), (66, 1024, 16, 4, None), (12, 2304, 4, 2, 1)]))
def test_grouped_is_the_twin_and_each_group_alone_bit_for_bit(rt, arena, put, fmt, rows, cols, xgr, warps, grid):
    """Row block g reads group g's x, rounded on its own; each group's rows = the plain int8 kernel on that group's
    x bit for bit (the same codes, scales and sum order). Ragged: rows not a multiple of x_group_rows
    (66 = 4 x 16 + 2), several pieces per row (2,080 / 2,304 columns), one block for the grid (each warp's run
    crossing groups)."""
    r = rng(rows, cols, xgr, fmt.seed + 10)
    groups = -(-rows // xgr)
    W = gemv_weights(r, fmt.qtype, rows, cols)
    x = grouped_x(fmt, r, groups, cols)[0]
    y = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), y, rows)], GemvX(put(x, False), cols, x_group_rows=xgr, act_quant=True), warps=warps,
             grid=grid)
    got = y.download()
    check(fmt, got, W, x, rows, cols, f"{fmt.qtype} i8 grouped {rows}x{cols}/{xgr}", x_group_rows=xgr)
    for g in range(groups):
        n = min(xgr, rows - g * xgr)
        one = arena.scratch(n, np.float32)
        ops.gemv(rt, [(put(W[g * xgr:g * xgr + n]), one, n)], GemvX(put(x[g * cols:(g + 1) * cols], False), cols,
                                                                     act_quant=True), warps=warps)
        assert got[g * xgr:g * xgr + n].tobytes() == one.download().tobytes(), f"group {g}"


@pytest.mark.parametrize("fmt,cols", cases(q8_0=[(160,)], q4_k=[(512,)]))
def test_grouped_several_matrices_rows_and_add(rt, arena, put, fmt, cols):
    """Two matrices of one launch (each its own groups from x's start); nx = 3 rows in one launch
    (gemv_<fmt>_i8_grouped_rows, x_stride wider than the groups) = each row alone bit for bit; add."""
    r = rng(22, fmt.seed + 10)
    xgr, shapes, nx, groups = 8, [20, 13], 3, 3
    Ws = [gemv_weights(r, fmt.qtype, n, cols) for n in shapes]
    stride = groups * cols + 32
    xs = np.zeros((nx, stride), np.float32)
    xs[:, :groups * cols] = grouped_x(fmt, r, groups, cols, nx)
    dWs, dx = [put(W) for W in Ws], put(xs, False)
    ys = [arena.scratch(nx * n, np.float32) for n in shapes]
    ops.gemv(rt, [(dW, y, n) for dW, y, n in zip(dWs, ys, shapes)],
             GemvX(dx, cols, nx=nx, x_stride=stride, x_group_rows=xgr, act_quant=True), warps=2)
    for k in range(nx):
        for W, dW, y, n in zip(Ws, dWs, ys, shapes):
            one = arena.scratch(n, np.float32)
            ops.gemv(rt, [(dW, one, n)], GemvX(put(xs[k], False), cols, x_group_rows=xgr, act_quant=True), warps=2)
            assert y.download()[k * n:(k + 1) * n].tobytes() == one.download().tobytes(), f"row {k} matrix {n}"
            check(fmt, one.download(), W, xs[k], n, cols, f"{fmt.qtype} i8 grouped row {k}", x_group_rows=xgr)
    base = r.standard_normal(shapes[0]).astype(np.float32)
    y = put(base, False)
    ops.gemv(rt, [(dWs[0], y, shapes[0])], GemvX(put(xs[0], False), cols, x_group_rows=xgr, act_quant=True), add=True)
    want, mag = tg.gemv_i8(Ws[0], xs[0], shapes[0], cols, x_group_rows=xgr, rounding=fmt.rounding)
    twins.assert_close_scaled(y.download(), want + base, mag + np.abs(base), cols, f"{fmt.qtype} i8 grouped add")


@pytest.mark.parametrize("fmt", BOTH)
def test_grouped_rows_over_several_launches_and_warps(rt, arena, put, fmt):
    """At 8,192 columns 4 warps hold one row of rounded x each beside their rings (GB10's shared memory): nx = 3
    rows take 3 launches; by default the launch takes fewer warps and one launch. Every row = that row alone, bit
    for bit, and the twin."""
    from ds4py.cuda.ops.gemv import _i8_grouped_launches

    cols, xgr, rows, nx = 8192, 4, 10, 3
    kernel = fmt.kernel("_grouped_rows")
    assert _i8_grouped_launches(rt, "t", fmt.qtype, 3, cols, nx, 4, None, kernel)[3] == 1
    assert _i8_grouped_launches(rt, "t", fmt.qtype, 3, cols, nx, None, None, kernel)[3] == nx
    r = rng(24, cols, fmt.seed + 10)
    W = gemv_weights(r, fmt.qtype, rows, cols)
    xs = grouped_x(fmt, r, 3, cols, nx)
    dW, dx = put(W), put(xs, False)
    for warps in (4, None):
        y = arena.scratch(nx * rows, np.float32)
        ops.gemv(rt, [(dW, y, rows)], GemvX(dx, cols, nx=nx, x_group_rows=xgr, act_quant=True), warps=warps)
        for k in range(nx):
            one = arena.scratch(rows, np.float32)
            ops.gemv(rt, [(dW, one, rows)], GemvX(put(xs[k], False), cols, x_group_rows=xgr, act_quant=True))
            assert y.download()[k * rows:(k + 1) * rows].tobytes() == one.download().tobytes(), f"row {k} {warps}"
    check(fmt, one.download(), W, xs[nx - 1], rows, cols, f"{fmt.qtype} i8 grouped 8192", x_group_rows=xgr)


# ---- Q8_0's quantiser: the reciprocal-based quotient (cu/gemv.cu div_rn_rcp) ---------------------------------------
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
    check(Q8_0, y.download(), W, x, rows, cols, f"i8 {kind}")
    xg = np.concatenate([x, x[::-1].copy()])
    yg = arena.scratch(rows, np.float32)
    ops.gemv(rt, [(put(W), yg, rows)], GemvX(put(xg, False), cols, x_group_rows=8, act_quant=True), warps=2)
    want, mag = tg.gemv_i8(W, xg, rows, cols, x_group_rows=8)
    twins.assert_close_scaled(yg.download(), want, mag, cols, f"i8 grouped {kind}")
