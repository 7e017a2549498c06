"""cu/mhc.cu against its twin (ds4py/cuda/twins/mhc.py, ref.ops) on the CPU emulator, in every thread order:
the mix with its last-block Sinkhorn (F16 and F32 fn, several tokens, ragged column chunks, the head's pre-only
mix), collapse + RMSNorm, hc_post; the ticket left zeroed for replays; bit-identical whichever block finishes
last. The twin itself is pinned to ref.ops.hc_pre."""

from __future__ import annotations

import numpy as np
import pytest

from cu_fixtures import arena, fresh_arena, put, putter, requires_emulator, rng, rt  # noqa: F401 (fixtures)
from ds4py.cuda import ops, twins
from ds4py.cuda.ops import mhc as om
from ds4py.cuda.twins import mhc as tm
from ds4py.cuda.ops.mhc import HcResidual, HcRows
from ds4py.ref import ops as ref

pytestmark = requires_emulator

HC = 4
EPS = 1e-6


def case(r, T, D, nrows, f32):
    X = r.standard_normal((T, HC, D)).astype(np.float32)
    fn = (r.standard_normal((nrows, HC * D)) * 0.05).astype(np.float32 if f32 else np.float16)
    scale = (0.5 + r.random(3)).astype(np.float32)
    base = (0.3 * r.standard_normal(nrows)).astype(np.float32)
    return X, fn, scale, base


def run_mix(rt, arena, put, X, fn, scale, base, warps=4, ticket=None):
    T, _, D = X.shape
    nrows = fn.shape[0]
    part = arena.scratch(om.mix_partial_floats(T, nrows, D), np.float32)
    ticket = ticket or put(np.zeros(T, np.uint32), False)
    mix = arena.scratch((T, om.mix_record(HC)), np.float32)
    ops.hc_mix(rt, om.MixWeights(put(fn), put(scale), put(base), D, EPS, EPS, 20),
               om.MixBuffers(put(X, False), T, mix, part, ticket), warps=warps)
    return mix, ticket


def check_mix(got, X, fn, scale, base, what):
    want = tm.hc_mix(X, fn.astype(np.float32), scale, base, EPS, EPS, 20)
    n = X.shape[1] * X.shape[2]
    xf = X.reshape(X.shape[0], -1).astype(np.float64)
    rs = 1 / np.sqrt((xf ** 2).mean(1) + EPS)
    mag_m = (np.abs(xf) @ np.abs(fn.astype(np.float64)).T) * rs[:, None]              # [T, nrows]
    sc = np.concatenate([np.full(HC, scale[0]), np.full(HC, scale[1]), np.full(HC * HC, scale[2])])[:fn.shape[0]]
    mag = np.zeros_like(want, np.float64)
    mag[:, :fn.shape[0]] = mag_m * sc
    mag += np.abs(want)
    twins.assert_close_scaled(got, want, mag, n, what)


@pytest.mark.parametrize("D,T,warps", [(64, 1, 1), (160, 3, 3), (1024, 2, 4), (200, 1, 8)])
@pytest.mark.parametrize("f32", [False, True])
def test_mix_and_sinkhorn(rt, arena, put, D, T, warps, f32):
    r = rng(D, T, warps, f32)
    X, fn, scale, base = case(r, T, D, om.mix_record(HC), f32)
    mix, ticket = run_mix(rt, arena, put, X, fn, scale, base, warps)
    check_mix(mix.download(), X, fn, scale, base, f"mix D={D} T={T}")
    assert (ticket.download() == 0).all()                 # left ready for the next launch / replay
    C = mix.download()[:, 2 * HC:].reshape(T, HC, HC)
    np.testing.assert_allclose(C.sum(1), 1.0, atol=1e-4)  # Sinkhorn: columns sum to one (rows nearly)


def test_mix_is_bit_identical_whichever_block_is_last(put):
    from ds4py.cuda.emu_runtime import EmuRuntime

    r = rng(5)
    X, fn, scale, base = case(r, 2, 1024, om.mix_record(HC), False)
    out = []
    for order, seed in [("forward", 0), ("reverse", 0), ("random", 1), ("random", 2)]:
        rt = EmuRuntime(order=order, seed=seed)
        with fresh_arena(rt, 4 << 20, 1 << 20) as arena:
            mix, ticket = run_mix(rt, arena, putter(arena), X, fn, scale, base)
            first = mix.download()
            mix2, _ = run_mix(rt, arena, putter(arena), X, fn, scale, base, ticket=ticket)   # the same ticket again
            assert mix2.download().tobytes() == first.tobytes()
            out.append(first.tobytes())
    assert len(set(out)) == 1


@pytest.mark.parametrize("nrows", [om.mix_record(HC), HC])
def test_mix_is_bit_identical_for_any_warp_count(rt, arena, put, nrows):
    """The default block (om.mix_warps: one warp per 4-row group + the sum-of-squares warp, for bytes in flight)
    gives the bits the old 4-warp block gave: a group's sum never depends on which warp runs it."""
    r = rng(7, nrows)
    X, fn, scale, base = case(r, 2, 320, nrows, False)
    sc = scale if nrows > HC else scale[:1]
    outs = {w: run_mix(rt, arena, put, X, fn, sc, base, w)[0].download().tobytes() for w in (1, 4, 8, None)}
    assert len(set(outs.values())) == 1
    assert om.mix_warps(om.mix_record(HC)) == 7 and om.mix_warps(HC) == 4


def test_collapse_block_grows_with_the_width_only():
    assert [om.collapse_threads(D) for D in (64, 1024, 4096, 7168)] == [256, 256, 1024, 1024]


def test_twin_is_the_reference_hc_pre():
    r = rng(6)
    X, fn, scale, base = case(r, 3, 96, om.mix_record(HC), True)
    mix = tm.hc_mix(X, fn, scale, base, EPS, EPS, 20)
    x, post, comb = ref.hc_pre(X, fn, scale, base, EPS, EPS, 20)
    pre = mix[:, :HC]
    np.testing.assert_array_equal((pre[:, :, None] * X).sum(1), x)
    np.testing.assert_array_equal(mix[:, HC:2 * HC], post)
    np.testing.assert_array_equal(mix[:, 2 * HC:].reshape(-1, HC, HC), comb)
    f = r.standard_normal((3, 96)).astype(np.float32)
    np.testing.assert_array_equal(tm.hc_post(f, X, mix), ref.hc_post(f, X, post, comb))


@pytest.mark.parametrize("D,T,threads,weighted", [(1, 1, 32, True), (33, 2, 32, False), (500, 3, 128, True),
                                                  (4096, 1, 1024, True), (600, 2, 32, True), (300, 1, 64, False)])
def test_collapse_norm(rt, arena, put, D, T, threads, weighted):
    r = rng(D, T, threads)
    X = (3 * r.standard_normal((T, HC, D))).astype(np.float32)
    mix = r.random((T, om.mix_record(HC))).astype(np.float32)
    w = (1 + 0.1 * r.standard_normal(D)).astype(np.float32) if weighted else None
    y = arena.scratch((T, D), np.float32)
    ops.hc_collapse_norm(rt, HcRows(put(X, False), T, D), om.Collapse(y, put(w) if weighted else None, EPS, put(mix)),
                         threads=threads)
    want = tm.hc_collapse_norm(X, mix, w, EPS)
    twins.assert_close_scaled(y.download(), want, np.abs(want) + 1e-30, D, f"collapse D={D}")


@pytest.mark.parametrize("D,T,threads", [(1, 1, 32), (70, 2, 32), (1000, 3, 256)])
def test_hc_post(rt, arena, put, D, T, threads):
    r = rng(D, T, 3)
    X = r.standard_normal((T, HC, D)).astype(np.float32)
    f = r.standard_normal((T, D)).astype(np.float32)
    mix = r.random((T, om.mix_record(HC))).astype(np.float32)
    dX = put(X, False)
    ops.hc_post(rt, put(f, False), HcResidual(dX, put(mix), D), T, threads=threads)
    want = tm.hc_post(f, X, mix)
    post, C = mix[:, HC:2 * HC], mix[:, 2 * HC:].reshape(T, HC, HC)
    mag = np.abs(post)[:, :, None] * np.abs(f)[:, None, :] + np.einsum("tjk,tjd->tkd", np.abs(C), np.abs(X))
    twins.assert_close_scaled(dX.download(), want, mag, HC + 1, "hc_post")


@pytest.mark.parametrize("D", [64, 288])
def test_head_collapse(rt, arena, put, D):
    """The head: a pre-only mix from output_hc_fn [hc, hc*D], then collapse + output_norm."""
    r = rng(D, 9)
    X, fn, scale, base = case(r, 2, D, HC, False)
    mix, _ = run_mix(rt, arena, put, X, fn, scale[:1], base)
    w = (1 + 0.1 * r.standard_normal(D)).astype(np.float32)
    y = arena.scratch((2, D), np.float32)
    ops.hc_collapse_norm(rt, HcRows(put(X, False), 2, D), om.Collapse(y, put(w), EPS, mix), threads=64)
    want = tm.hc_head(X, fn.astype(np.float32), scale[:1], base, w, EPS, EPS)
    twins.assert_close_scaled(y.download(), want, np.abs(want) + np.abs(w), HC * D, "head collapse")


@pytest.mark.parametrize("D,T,nrows,lagged,weighted", [(64, 1, om.mix_record(HC), False, True),
                                                       (320, 2, om.mix_record(HC), True, True),
                                                       (288, 2, HC, False, True),
                                                       (1280, 1, om.mix_record(HC), False, False),
                                                       (8192, 1, om.mix_record(HC), False, True)])
def test_mix_with_collapse_is_the_two_launches_bit_for_bit(rt, arena, put, D, T, nrows, lagged, weighted):
    """hc_mix with a Collapse (its last block collapses + norms: one launch per sub-layer) writes the mix record
    and y of hc_mix followed by hc_collapse_norm at its default block; lagged: pre from another record (V4.1).
    D 8192: more chunk partials than the last block stages in shared memory (it reads them from L2 instead)."""
    r = rng(D, T, nrows, lagged)
    X, fn, scale, base = case(r, T, D, nrows, False)
    sc = scale if nrows > HC else scale[:1]
    w = (1 + 0.1 * r.standard_normal(D)).astype(np.float32) if weighted else None
    lag = r.random((T, om.mix_record(HC))).astype(np.float32) if lagged else None
    dX, dfn, dsc, dbase = put(X, False), put(fn), put(sc), put(base)
    dw, dlag = (put(w) if weighted else None), (put(lag) if lagged else None)
    stride = om.mix_record(HC)
    part = arena.scratch(om.mix_partial_floats(T, nrows, D), np.float32)
    ticket = put(np.zeros(T, np.uint32), False)
    mix1, mix2 = (arena.scratch((T, om.mix_record(HC)), np.float32) for _ in range(2))
    y1, y2 = (arena.scratch((T, D), np.float32) for _ in range(2))
    mw = om.MixWeights(dfn, dsc, dbase, D, EPS, EPS, 20)
    ops.hc_mix(rt, mw, om.MixBuffers(dX, T, mix1, part, ticket))
    ops.hc_collapse_norm(rt, HcRows(dX, T, D), om.Collapse(y1, dw, EPS, dlag if lagged else mix1, stride))
    ops.hc_mix(rt, mw, om.MixBuffers(dX, T, mix2, part, ticket),
               collapse=om.Collapse(y2, dw, EPS, dlag, stride if lagged else 0))
    assert (ticket.download() == 0).all()
    assert mix2.download()[:, :nrows].tobytes() == mix1.download()[:, :nrows].tobytes()
    assert y2.download().tobytes() == y1.download().tobytes()
    pre = (lag if lagged else mix1.download())[:, :HC]
    want = tm.hc_collapse_norm(X, pre, w, EPS)
    twins.assert_close_scaled(y2.download(), want, np.abs(want) + 1e-30, HC * D, f"fused collapse D={D}")


def test_mix_with_collapse_is_bit_identical_whichever_block_is_last(put):
    from ds4py.cuda.emu_runtime import EmuRuntime

    r = rng(11)
    X, fn, scale, base = case(r, 2, 1024, om.mix_record(HC), False)
    out = set()
    for order, seed in [("forward", 0), ("reverse", 0), ("random", 3)]:
        rt = EmuRuntime(order=order, seed=seed)
        with fresh_arena(rt, 4 << 20, 1 << 20) as arena:
            p = putter(arena)
            T, D, nrows = 2, 1024, om.mix_record(HC)
            part = arena.scratch(om.mix_partial_floats(T, nrows, D), np.float32)
            ticket = p(np.zeros(T, np.uint32), False)
            mix = arena.scratch((T, nrows), np.float32)
            y = arena.scratch((T, D), np.float32)
            ops.hc_mix(rt, om.MixWeights(p(fn), p(scale), p(base), D, EPS, EPS, 20),
                       om.MixBuffers(p(X, False), T, mix, part, ticket), collapse=om.Collapse(y, None, EPS))
            out.add(mix.download().tobytes() + y.download().tobytes())
    assert len(out) == 1
