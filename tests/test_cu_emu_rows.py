"""Multi-row kernels on the CPU emulator: the `_rows` GEMVs read each weight once for nx
activation rows, and row n of a multi-row launch is bit-identical to a single-row launch on x[n] (batch
invariance), for every weight type, several matrices, the RMSNorm prologue, input groups, the hc_post and SwiGLU
epilogues; and close to the numpy twin. tests/gpu/test_gpu_rows.py runs the same functions on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from cu_fixtures import GEMV_KINDS, arena, gemv_weights, put, requires_emulator, rng, rt  # noqa: F401 (fixtures)
from ds4py.cuda import ops, twins
from ds4py.cuda.ops.gemv import GEMV_MAX_X, GemvX, SwiGlu
from ds4py.cuda.ops.mhc import HcResidual
from ds4py.cuda.twins import gemv as tg
from ds4py.errors import Ds4Error

pytestmark = requires_emulator



def same_bits(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.tobytes() == b.tobytes(), f"{what}: not bit-identical (max |diff| {np.max(np.abs(a - b))})"


@pytest.mark.parametrize("kind", GEMV_KINDS)
@pytest.mark.parametrize("nx", [2, 5])
def test_gemv_rows_equal_single_rows(rt, arena, put, kind, nx):
    """Two matrices sharing x (q_a + kv style) with and without the RMSNorm prologue; rows padded apart."""
    r = rng(21, nx, len(kind))
    cols, shapes, stride = 1088, [9, 6], 1088 + 12
    Ws = [gemv_weights(r, kind, n, cols) for n in shapes]
    x = np.zeros((nx, stride), np.float32)
    x[:, :cols] = r.standard_normal((nx, cols)) * (1 + np.arange(nx))[:, None]
    nw = (1 + 0.1 * r.standard_normal(cols)).astype(np.float32)
    dWs, dnw = [put(W) for W in Ws], put(nw)
    for norm in (None, (dnw, 1e-6)):
        ys = [arena.scratch(nx * n, np.float32) for n in shapes]
        ops.gemv(rt, [(W, y, n) for W, y, n in zip(dWs, ys, shapes)],
                 GemvX(put(x.reshape(-1), False), cols, nx=nx, x_stride=stride, norm=norm), warps=2)
        for i in range(nx):
            one = [arena.scratch(n, np.float32) for n in shapes]
            ops.gemv(rt, [(W, y, n) for W, y, n in zip(dWs, one, shapes)],
                     GemvX(put(x[i, :cols].copy(), False), cols, norm=norm), warps=4)
            for m, n in enumerate(shapes):
                got = ys[m].download().reshape(nx, n)[i]
                same_bits(got, one[m].download(), f"{kind} row {i} of {nx} matrix {m} norm {norm is not None}")
                if norm is None:
                    want = tg.gemv(Ws[m], x[i, :cols], n, cols)
                    twins.assert_close_scaled(got, want, tg.magnitude(Ws[m], x[i, :cols], n, cols), cols, kind)


@pytest.mark.parametrize("kind", ("F16", "Q8_0"))
def test_gemv_rows_input_groups_and_the_widest_launch(rt, arena, put, kind):
    """wo_a style input groups with GEMV_MAX_X rows (x_stride defaults to the groups' width)."""
    nx, rows, cols, group = GEMV_MAX_X, 24, 64, 8
    r = rng(22, len(kind))
    W = gemv_weights(r, kind, rows, cols)
    x = r.standard_normal((nx, 3 * cols)).astype(np.float32)
    dW = put(W)
    y = arena.scratch(nx * rows, np.float32)
    ops.gemv(rt, [(dW, y, rows)], GemvX(put(x.reshape(-1), False), cols, nx=nx, x_group_rows=group))
    got = y.download().reshape(nx, rows)
    for i in (0, 7, nx - 1):
        one = arena.scratch(rows, np.float32)
        ops.gemv(rt, [(dW, one, rows)], GemvX(put(x[i].copy(), False), cols, x_group_rows=group), warps=1)
        same_bits(got[i], one.download(), f"{kind} groups row {i}")


@pytest.mark.parametrize("kind", GEMV_KINDS)
def test_hc_post_and_swiglu_rows(rt, arena, put, kind):
    r = rng(23, len(kind))
    nx, D, cols, hc = 3, 42, 96, 4
    W = gemv_weights(r, kind, D, cols, 0.3)
    Wg, Wu = gemv_weights(r, kind, 13, cols, 0.5), gemv_weights(r, kind, 13, cols, 0.5)
    x = r.standard_normal((nx, cols)).astype(np.float32)
    X = r.standard_normal((nx, hc, D)).astype(np.float32)
    mix = r.random((nx, (2 + hc) * hc)).astype(np.float32)
    dW, dWg, dWu, dx = put(W), put(Wg), put(Wu), put(x.reshape(-1), False)
    dX = put(X.reshape(-1), False)
    ops.gemv_hc_post(rt, dW, GemvX(dx, cols, nx=nx), HcResidual(dX, put(mix.reshape(-1)), D))
    y = arena.scratch(nx * 13, np.float32)
    ops.gemv_swiglu(rt, SwiGlu(dWg, dWu, 13, clamp=2.5), GemvX(dx, cols, nx=nx), y)
    for i in range(nx):
        X1 = put(X[i].copy(), False)
        ops.gemv_hc_post(rt, dW, GemvX(put(x[i].copy(), False), cols), HcResidual(X1, put(mix[i].copy()), D), warps=1)
        same_bits(dX.download().reshape(nx, hc, D)[i], X1.download(), f"{kind} hc_post row {i}")
        want = tg.hc_post(tg.gemv(W, x[i], D, cols), X[i], mix[i])
        assert np.allclose(X1.download(), want, rtol=1e-4, atol=1e-4)
        y1 = arena.scratch(13, np.float32)
        ops.gemv_swiglu(rt, SwiGlu(dWg, dWu, 13, clamp=2.5), GemvX(put(x[i].copy(), False), cols), y1, warps=3)
        same_bits(y.download().reshape(nx, 13)[i], y1.download(), f"{kind} swiglu row {i}")


def test_rows_wrapper_checks(rt, arena, put):
    W = put(np.ones((8, 64), np.float16))
    x, y = put(np.ones(3 * 64, np.float32), False), arena.scratch(4 * 8, np.float32)
    with pytest.raises(Ds4Error, match=f"1 to {GEMV_MAX_X} activation rows"):
        ops.gemv(rt, [(W, y, 8)], GemvX(x, 64, nx=GEMV_MAX_X + 1))
    with pytest.raises(Ds4Error, match="x must be float32 with 256 values"):
        ops.gemv(rt, [(W, y, 8)], GemvX(x, 64, nx=4))
    with pytest.raises(Ds4Error, match="y must be float32 with 40 values"):
        ops.gemv(rt, [(W, y, 8)], GemvX(put(np.ones(5 * 64, np.float32), False), 64, nx=5))
    with pytest.raises(Ds4Error, match="x_stride"):
        ops.gemv(rt, [(W, y, 8)], GemvX(x, 64, nx=2, x_stride=32))


# ---- experts: grouped gate + up over the rows' distinct experts, per-row down -------------------------------------
from gguf import GGMLQuantizationType as QT  # noqa: E402

from ds4py.cuda.ops import experts as ops_moe  # noqa: E402
from ds4py.cuda.twins import experts as twin  # noqa: E402
from ds4py.cuda.ops.core import TokenRows  # noqa: E402
from ds4py.cuda.ops.experts import Experts, HcPost, Slots  # noqa: E402
from tests.cu_emu_device import devices  # noqa: E402
from tests.test_cu_emu_experts import expert_tensor  # noqa: E402

kdev = pytest.fixture(devices, name="kdev")

# format, dim, ff, experts, k (slots per row), rows
ROWS_MOE = [(QT.IQ2_XXS, 256, 256, 5, 3, 4), (QT.Q2_K, 512, 256, 6, 2, 3), (QT.MXFP4, 96, 64, 4, 2, 5),
            (QT.Q8_0, 160, 96, 3, 2, 2), (QT.F16, 64, 32, 1, 1, 3), (QT.Q4_K, 256, 256, 4, 2, 3)]


@pytest.mark.parametrize("case", ROWS_MOE, ids=lambda c: f"{c[0].name}-d{c[1]}-rows{c[5]}")
@pytest.mark.parametrize("order", ("forward", "random"))
def test_grouped_gate_up_and_rows_down_equal_single_rows(kdev, case, order):
    """Rows that share experts (ids drawn from few experts, one id repeated in a row, one bad id): each pair's h and
    each row's down + hc_post are bit-identical to the one-token kernels, and close to the twin."""
    qtype, dim, ff, n_exp, k, nx = case
    r = np.random.default_rng([31, int(qtype), nx])
    raw_g, Wg = expert_tensor(r, qtype, n_exp, ff, dim)
    raw_u, Wu = expert_tensor(r, qtype, n_exp, ff, dim)
    raw_d, Wd = expert_tensor(r, qtype, n_exp, dim, ff)
    stride = dim + 8
    x = np.zeros((nx, stride), np.float32)
    x[:, :dim] = r.standard_normal((nx, dim)) * 2
    shared = n_exp == 1
    ids = None if shared else r.integers(0, n_exp, (nx, k)).astype(np.int32)
    if ids is not None:
        ids[0, -1] = ids[0, 0]                           # a row choosing one expert twice
        if nx > 2:
            ids[2, 0] = n_exp + 3                        # bad ids (two different ones): NaN pairs, nothing read
            ids[-1, -1] = -7
    wts = None if shared else (r.random((nx, k)) + 0.2).astype(np.float32)
    hc = 4
    mix = r.random((nx, (2 + hc) * hc)).astype(np.float32)
    X = r.standard_normal((nx, hc, dim)).astype(np.float32)
    add = r.standard_normal((nx, dim)).astype(np.float32)
    dev = kdev(order, dim)
    cg, cu, cd = dev.const(raw_g), dev.const(raw_u), dev.const(raw_d)
    d_ids = dev.const(None if ids is None else ids.reshape(-1))
    d_w = dev.const(None if wts is None else wts.reshape(-1))
    d_h = dev.var(np.full((nx * k + 1, ff), 7.0, np.float32))
    ops_moe.moe_gate_up_rows(dev.rt, Experts(fmt=qtype, n_experts=n_exp, ff=ff, dim=dim, gate=cg, up=cu, clamp=0.5),
                             TokenRows(x=dev.const(x.reshape(-1)), y=d_h, T=nx, ldx=stride),
                             Slots(ids=d_ids, weights=d_w, k=k))
    h = d_h.download()
    assert (h[nx * k] == 7.0).all()                      # nothing beyond the pairs
    d_out = dev.var(np.zeros((nx, hc, dim), np.float32))
    ops_moe.moe_down_rows(dev.rt, Experts(fmt=qtype, n_experts=n_exp, ff=ff, dim=dim, down=cd),
                          TokenRows(x=d_h, y=d_out, T=nx, add=dev.const(add.reshape(-1))), Slots(ids=d_ids, k=k),
                          hc=HcResidual(dev.const(X.reshape(-1)), dev.const(mix.reshape(-1)), dim, hc))
    out = d_out.download()
    for n in range(nx):
        rid = None if ids is None else dev.const(ids[n].copy())
        one = dev.var(np.zeros((k, ff), np.float32))
        ops_moe.moe_gate_up(dev.rt, Experts(fmt=qtype, n_experts=n_exp, ff=ff, dim=dim, gate=cg, up=cu, clamp=0.5),
                            dev.const(x[n, :dim].copy()), one,
                            Slots(ids=rid, weights=None if wts is None else dev.const(wts[n].copy()), k=k))
        same_bits(h[n * k:(n + 1) * k], one.download(), f"{case} gate_up row {n}")
        y1 = dev.var(np.zeros((hc, dim), np.float32))
        ops_moe.moe_down(dev.rt, Experts(fmt=qtype, n_experts=n_exp, ff=ff, dim=dim, down=cd),
                         TokenRows(x=one, y=y1, add=dev.const(add[n].copy())), Slots(ids=rid, k=k),
                         hc=HcPost(dev.const(mix[n, hc:2 * hc].copy()), dev.const(mix[n, 2 * hc:].copy()),
                                   dev.const(X[n].copy())))
        same_bits(out[n], y1.download(), f"{case} down row {n}")
        if ids is not None and ((ids[n] >= n_exp) | (ids[n] < 0)).any():
            assert np.isnan(h[n * k:(n + 1) * k][(ids[n] >= n_exp) | (ids[n] < 0)]).all()
            continue
        want, mag = twin.gate_up(Wg, Wu, x[n, :dim], None if ids is None else ids[n],
                                 None if wts is None else wts[n], 0.5, k)
        twins.assert_close_scaled(h[n * k:(n + 1) * k], want, mag, dim, f"{case} gate_up twin row {n}")
