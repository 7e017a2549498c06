"""cu/moe_prefill.cu under the CPU emulator against its twin (ds4py/cuda/twins/moe_prefill.py): the route's count /
scan / scatter and work items exact (skew, an expert with no tokens, one with all of them, bad ids; every thread
order), the grouped gate + up and down of every expert format against the twin stage by stage, and the whole
grouped MoE against the twin and against the reference MoE (ref.ops.swiglu, fp32 throughout) within bf16-level
tolerances scaled by the magnitude; VQ-8 experts (12 and 12 + 1 bits, the device layout of ds4py/cuda/vq_layout.py,
effective float32 gains) stage by stage and whole within fp32 tolerances (x and H go in as three bf16 pieces: exact)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cu_fixtures import requires_emulator
from ds4py.cuda import kernels, vq_layout
from ds4py.cuda.ops import moe_prefill as ops_mp
from ds4py.cuda.twins import experts as twin_experts
from ds4py.cuda.twins import moe_prefill as twin
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.cuda.ops.core import TokenRows
from ds4py.cuda.ops.experts import Experts, Slots
from ds4py.errors import Ds4Error
from ds4py.quant import vq
from ds4py.ref import ops as ref_ops
from tests.cu_emu_device import devices
from tests.test_cu_emu_experts import expert_tensor
from tests.test_cu_emu_vq import codebook

pytestmark = requires_emulator
kdev = pytest.fixture(devices, name="kdev")
ORDERS = ("forward", "reverse", "random")


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([29, *seed])


def bufs_on(dev, T, k, E, ff, dim):
    return ops_mp.MoePrefillBuffers.alloc(lambda s, dt: dev.var(np.full(s, -7 if dt == np.int32 else np.nan, dt)),
                                          T, k, E, ff, dim)


def ids_case(name: str, r, T: int, k: int, E: int) -> np.ndarray:
    if name == "random":                          # expert 1 never chosen
        ids = r.choice([e for e in range(E) if e != 1], (T, k))
    elif name == "skew":                          # slot 0 of every token is expert 0: several work items
        ids = np.concatenate([np.zeros((T, 1), np.int64), r.integers(1, E, (T, k - 1))], 1)
    elif name == "one":                           # all pairs to one expert
        ids = np.full((T, k), E - 1)
    else:                                         # bad ids among good ones
        ids = r.integers(0, E, (T, k))
        ids[1, 0], ids[T - 1, k - 1], ids[T // 2, 0] = -1, E, 1 << 30
    return np.ascontiguousarray(ids, np.int32)


def whole_moe(dev, op, r, shape, ex: Experts):
    """Run the whole-MoE wrapper `op` (moe_prefill or moe_tiles) of experts `ex` (gate / up / down the host bytes)
    on dev with T tokens of k slots among E experts (shape = (T, k, E, ids case)), x, ids, route weights and add
    drawn from r in that order: (x, ids, wts, add, y as float64)."""
    T, k, E, how = shape
    x = r.standard_normal((T, ex.dim)).astype(np.float32)
    ids = ids_case(how, r, T, k, E)
    wts = (r.random((T, k)) + 0.2).astype(np.float32)
    add = r.standard_normal((T, ex.dim)).astype(np.float32)
    bufs = bufs_on(dev, T, k, E, ex.ff, ex.dim)
    y = dev.var(np.full((T, ex.dim), np.nan, np.float32))
    ex = replace(ex, gate=dev.const(ex.gate), up=dev.const(ex.up), down=dev.const(ex.down))
    op(dev.rt, ex, TokenRows(x=dev.const(x), y=y, T=T, add=dev.const(add)),
       Slots(ids=dev.const(ids), weights=dev.const(wts), k=k), bufs)
    return x, ids, wts, add, y.download().astype(np.float64)


@pytest.mark.parametrize("case", [("random", 37, 6, 8), ("skew", 150, 2, 5), ("one", 70, 3, 4), ("bad", 20, 4, 6),
                                  ("random", 400, 6, 256), ("skew", 300, 6, 384)], ids=lambda c: f"{c[0]}-T{c[1]}-k{c[2]}-E{c[3]}")
@pytest.mark.parametrize("order", ORDERS)
def test_route_is_exact(kdev, case, order):
    name, T, k, E = case
    ids = ids_case(name, rng(1, T, E), T, k, E)
    dev = kdev(order, T)
    bufs = bufs_on(dev, T, k, E, 32, 32)
    ops_mp.moe_prefill_route(dev.rt, dev.const(ids), bufs, T, k, E)
    want = twin.route(ids, E, ops_mp.BM, ops_mp.max_tiles(T * k, E))
    n = want["n_tiles"]
    assert bufs.info.download()[0] == n
    for name_ in ("offsets", "sorted", "pos"):
        np.testing.assert_array_equal(getattr(bufs, name_).download(), want[name_], err_msg=name_)
    np.testing.assert_array_equal(bufs.tile_bucket.download()[:n], want["tile_bucket"])
    np.testing.assert_array_equal(bufs.tile_row.download()[:n], want["tile_row"])
    if name == "skew":
        assert (want["tile_bucket"] == 0).sum() == -(-T // ops_mp.BM) >= 3


def _experts(r, qtype, E, rows, cols):
    raw, vals = expert_tensor(r, qtype, E, rows, cols)
    return raw, vals.astype(np.float32)


# format, dim, ff
GATE_UP = [(QT.IQ2_XXS, 256, 64), (QT.Q2_K, 256, 96), (QT.Q4_K, 256, 64), (QT.MXFP4, 64, 160), (QT.Q8_0, 96, 64),
           (QT.F16, 64, 32)]
DOWN = [(QT.Q2_K, 256, 256), (QT.IQ2_XXS, 40, 256), (QT.Q4_K, 64, 256), (QT.MXFP4, 70, 64), (QT.Q8_0, 64, 96),
        (QT.F16, 130, 32)]


@pytest.mark.parametrize("case", GATE_UP, ids=lambda c: f"{c[0].name}-d{c[1]}-ff{c[2]}")
def test_gate_up_stage(kdev, case):
    qtype, dim, ff = case
    T, k, E = 30, 3, 4
    r = rng(2, int(qtype))
    rg, Wg = _experts(r, qtype, E, ff, dim)
    ru, Wu = _experts(r, qtype, E, ff, dim)
    x = (r.standard_normal((T, dim)) * 2).astype(np.float32)
    ids = ids_case("bad" if qtype == QT.Q4_K else "skew", r, T, k, E)
    wts = (r.random((T, k)) + 0.2).astype(np.float32)
    clamp = 0.0 if qtype == QT.F16 else 0.5
    dev = kdev()
    bufs = bufs_on(dev, T, k, E, ff, dim)
    ops_mp.moe_prefill_route(dev.rt, dev.const(ids), bufs, T, k, E)
    ops_mp.moe_prefill_gate_up(dev.rt,
                               Experts(fmt=qtype, n_experts=E, ff=ff, dim=dim, gate=dev.const(rg), up=dev.const(ru),
                                       clamp=clamp), TokenRows(x=dev.const(x), T=T), Slots(weights=dev.const(wts), k=k),
                               bufs)
    rt_ = twin.route(ids, E, ops_mp.BM, ops_mp.max_tiles(T * k, E))
    want, mag = twin.gate_up(Wg, Wu, x, wts, rt_, k, clamp)
    got = bufs.H.download()
    bad = np.isnan(want).all(1)
    assert np.isnan(got[bad]).all()
    assert_close_scaled(got[~bad], want[~bad], mag[~bad], dim, f"gate_up {case}")


@pytest.mark.parametrize("case", DOWN, ids=lambda c: f"{c[0].name}-d{c[1]}-ff{c[2]}")
def test_down_stage(kdev, case):
    qtype, dim, ff = case
    T, k, E = 25, 2, 3
    r = rng(3, int(qtype))
    rd, Wd = _experts(r, qtype, E, dim, ff)
    ids = ids_case("random" if E > 2 else "one", r, T, k, E)
    H = r.standard_normal((T * k, ff)).astype(np.float32)
    dev = kdev()
    bufs = bufs_on(dev, T, k, E, ff, dim)
    bufs.H.upload(H)
    ops_mp.moe_prefill_route(dev.rt, dev.const(ids), bufs, T, k, E)
    ops_mp.moe_prefill_down(dev.rt, Experts(fmt=qtype, n_experts=E, ff=ff, dim=dim, down=dev.const(rd)), bufs, T, k)
    want, mag = twin.down(Wd, H, twin.route(ids, E, ops_mp.BM, ops_mp.max_tiles(T * k, E)))
    assert_close_scaled(bufs.Yp.download(), want, mag, ff, f"down {case}")


def _reference_moe(Wg, Wu, Wd, x, ids, wts, clamp, add):
    """ref.ops.swiglu per (token, slot), fp32, summed over the slots (the reference backend's math)."""
    T, k = ids.shape
    y = np.zeros((T, Wd.shape[1]), np.float32)
    for t in range(T):
        for s in range(k):
            e = ids[t, s]
            y[t] += ref_ops.swiglu(x[t:t + 1], Wg[e], Wu[e], Wd[e], clamp, wts[t, s:s + 1])[0]
    return y + add


# gate/up format, down format, dim, ff, T, k, E, ids
WHOLE = [(QT.IQ2_XXS, QT.Q2_K, 256, 256, 21, 3, 4, "random"), (QT.MXFP4, QT.MXFP4, 64, 96, 70, 2, 3, "skew"),
         (QT.Q4_K, QT.Q8_0, 256, 64, 9, 2, 2, "one")]


@pytest.mark.parametrize("case", WHOLE, ids=lambda c: f"{c[0].name}-{c[1].name}-{c[7]}")
@pytest.mark.parametrize("order", ORDERS)
def test_whole_moe_against_twin_and_reference(kdev, case, order):
    qg, qd, dim, ff, T, k, E, how = case
    r = rng(4, int(qg), int(qd))
    rg, Wg = _experts(r, qg, E, ff, dim)
    ru, Wu = _experts(r, qg, E, ff, dim)
    rd, Wd = _experts(r, qd, E, dim, ff)
    clamp = 10.0
    x, ids, wts, add, got = whole_moe(kdev(order, T), ops_mp.moe_prefill, r, (T, k, E, how),
                                      Experts(fmt=qg, n_experts=E, ff=ff, dim=dim, gate=rg, up=ru, down=rd,
                                              down_fmt=qd, clamp=clamp))
    want, mag = twin.moe(Wg, Wu, Wd, x, ids, wts, clamp, ops_mp.BM, ops_mp.max_tiles(T * k, E), add)
    ref = _reference_moe(Wg, Wu, Wd, x, ids, wts, clamp, add)
    e_twin = np.abs(got - want) / mag
    e_ref = np.abs(got - ref) / mag
    print(f"\n{case[0].name}/{case[1].name} {how}: |kernel - twin| / mag max {e_twin.max():.2e}; "
          f"|kernel - reference| / mag max {e_ref.max():.2e}, mean {e_ref.mean():.2e}")
    assert e_twin.max() <= 2 ** -8                  # a bf16 ulp of H at most, on top of fp32 rounding
    assert e_ref.max() <= 2 ** -7 and e_ref.mean() <= 2 ** -10   # bf16 x, W, H: each <= 2^-9 relative


def test_wrappers_reject_bad_input(kdev):
    dev = kdev()
    z = np.zeros
    bufs = bufs_on(dev, 4, 2, 3, 32, 32)
    with pytest.raises(Ds4Error, match="1 to 512 experts"):
        ops_mp.moe_prefill_route(dev.rt, dev.const(z((4, 2), np.int32)), bufs, 4, 2, 600)
    with pytest.raises(Ds4Error, match="ids must be int32"):
        ops_mp.moe_prefill_route(dev.rt, dev.const(z((4, 2), np.int64)), bufs, 4, 2, 3)
    with pytest.raises(Ds4Error, match="has no kernel"):
        ops_mp.moe_prefill_down(dev.rt,
                                Experts(fmt=QT.Q5_K, n_experts=3, ff=32, dim=32, down=dev.const(z(10, np.uint8))), bufs,
                                4, 2)
    with pytest.raises(Ds4Error, match="weight bytes"):
        ops_mp.moe_prefill_down(dev.rt,
                                Experts(fmt=QT.Q8_0, n_experts=3, ff=32, dim=32, down=dev.const(z(10, np.uint8))), bufs,
                                4, 2)
    small = bufs_on(dev, 2, 2, 3, 32, 32)
    with pytest.raises(Ds4Error, match="buffer sorted"):
        ops_mp.moe_prefill_down(dev.rt,
                                Experts(fmt=QT.Q8_0, n_experts=3, ff=32, dim=32,
                                        down=dev.const(z(3 * 32 * 34, np.uint8))), small, 4, 2)
    mat = lambda qt: SimpleNamespace(kernel_format=qt, array=None)           # noqa: E731
    rec = SimpleNamespace(cfg=SimpleNamespace(n_experts=3, expert_ff=32, dim=32))
    with pytest.raises(Ds4Error, match="same weight type"):           # one Experts format for gate and up
        kernels.routed_experts(rec, SimpleNamespace(gate=mat(QT.Q8_0), up=mat(QT.F16), down=mat(QT.F16)))


def test_shared_expert_as_one_expert_for_every_token(kdev):
    """The prefill shared expert: n_experts = 1, k = 1, ids 0, no route weights (Q8_0 gate / up / down)."""
    T, dim, ff = 70, 64, 96
    r = rng(5)
    rg, Wg = _experts(r, QT.Q8_0, 1, ff, dim)
    ru, Wu = _experts(r, QT.Q8_0, 1, ff, dim)
    rd, Wd = _experts(r, QT.Q8_0, 1, dim, ff)
    x = r.standard_normal((T, dim)).astype(np.float32)
    ids = np.zeros((T, 1), np.int32)
    dev = kdev()
    bufs = bufs_on(dev, T, 1, 1, ff, dim)
    y = dev.var(np.full((T, dim), np.nan, np.float32))
    ex = Experts(fmt=QT.Q8_0, n_experts=1, ff=ff, dim=dim, gate=dev.const(rg), up=dev.const(ru), down=dev.const(rd),
                 clamp=10.0)
    ops_mp.moe_prefill(dev.rt, ex, TokenRows(x=dev.const(x), y=y, T=T), Slots(ids=dev.const(ids)), bufs)
    got = y.download().astype(np.float64)
    assert bufs.info.download()[0] == -(-T // ops_mp.BM)
    want, mag = twin.moe(Wg, Wu, Wd, x, ids, None, 10.0, ops_mp.BM, ops_mp.max_tiles(T, 1))
    ref = _reference_moe(Wg, Wu, Wd, x, ids, np.ones((T, 1), np.float32), 10.0, 0)
    assert (np.abs(got - want) <= 2 ** -8 * mag).all() and (np.abs(got - ref) <= 2 ** -7 * mag).all()


# ---- VQ-8 ---------------------------------------------------------------------------------------------------------
def vq_experts(r, bits: int, cb: np.ndarray, E: int, rows: int, cols: int):
    """(format, device copy, dequantised float32 [E, rows, cols]) of random indices over codebook cb, with effective
    gains as a sidecar leaves them (an f16 gain times a float32 scale: fl32(g * c) is rounded, not exact)."""
    idx = r.integers(0, 1 << bits, (E, rows, cols // 8))
    idx[0, 0, :4] = (1 << bits) - 1                       # the last codeword (bit 12 set at 13 bits)
    stream, hi = vq.pack_indices(idx, bits)
    g16 = (r.random((E, rows)) * 0.05 + 0.01).astype(np.float16).astype(np.float32)
    gains = g16 * (r.random((E, rows)) + 0.5).astype(np.float32)
    gains[0, 1] = 0.0
    fmt = vq_layout.kernel_format(bits, "test")
    return fmt, vq_layout.pack(fmt, cb, stream, hi, gains, cols), twin_experts.vq_dequant(cb, stream, hi, gains, bits)


@pytest.mark.parametrize("bits,ids_how", [(12, "skew"), (13, "bad")])
def test_vq_gate_up_stage(kdev, bits, ids_how):
    T, k, E, dim, ff = 70 if ids_how == "skew" else 30, 3, 4, 128, 96     # ff: a partial 64-wide feature tile
    r = rng(6, bits)
    cb = codebook(r, bits)
    fmt, dg, Wg = vq_experts(r, bits, cb, E, ff, dim)
    _, du, Wu = vq_experts(r, bits, cb, E, ff, dim)
    x = (r.standard_normal((T, dim)) * 2).astype(np.float32)
    ids = ids_case(ids_how, r, T, k, E)
    wts = (r.random((T, k)) + 0.2).astype(np.float32)
    dev = kdev()
    bufs = bufs_on(dev, T, k, E, ff, dim)
    ops_mp.moe_prefill_route(dev.rt, dev.const(ids), bufs, T, k, E)
    ops_mp.moe_prefill_gate_up(dev.rt,
                               Experts(fmt=fmt, n_experts=E, ff=ff, dim=dim, gate=dev.const(dg), up=dev.const(du),
                                       clamp=0.5), TokenRows(x=dev.const(x), T=T), Slots(weights=dev.const(wts), k=k),
                               bufs)
    rt_ = twin.route(ids, E, ops_mp.BM, ops_mp.max_tiles(T * k, E))
    want, mag = twin.gate_up(Wg, Wu, x, wts, rt_, k, 0.5, exact=True)
    got = bufs.H.download()
    bad = np.isnan(want).all(1)
    assert bad.any() == (ids_how == "bad") and np.isnan(got[bad]).all()
    assert_close_scaled(got[~bad], want[~bad], mag[~bad], dim, f"vq{bits} gate_up")
    if ids_how == "skew":
        assert (rt_["tile_bucket"] == 0).sum() == 2             # expert 0's 70 rows: two work items


@pytest.mark.parametrize("bits,dim", [(12, 64), (13, 67)])   # 13 bits, 3 x 67 rows: the gains 2-byte aligned
def test_vq_down_stage(kdev, bits, dim):
    T, k, E, ff = 25, 2, 3, 128
    r = rng(7, bits)
    cb = codebook(r, bits)
    fmt, dd, Wd = vq_experts(r, bits, cb, E, dim, ff)
    ids = ids_case("random", r, T, k, E)
    H = r.standard_normal((T * k, ff)).astype(np.float32)
    dev = kdev()
    bufs = bufs_on(dev, T, k, E, ff, dim)
    bufs.H.upload(H)
    ops_mp.moe_prefill_route(dev.rt, dev.const(ids), bufs, T, k, E)
    ops_mp.moe_prefill_down(dev.rt, Experts(fmt=fmt, n_experts=E, ff=ff, dim=dim, down=dev.const(dd)), bufs, T, k)
    want, mag = twin.down(Wd, H, twin.route(ids, E, ops_mp.BM, ops_mp.max_tiles(T * k, E)), exact=True)
    assert_close_scaled(bufs.Yp.download(), want, mag, ff, f"vq{bits} down")
    # the twin's exact H is the point: rounded to bf16 it is off by far more than the tolerance
    coarse, _ = twin.down(Wd, H, twin.route(ids, E, ops_mp.BM, ops_mp.max_tiles(T * k, E)))
    assert np.abs(coarse - want).max() > 1e3 * np.finfo(np.float32).eps * np.abs(want).max()


# bits, dim, ff, T, k, E, ids
VQ_WHOLE = [(12, 128, 128, 70, 2, 3, "skew"), (13, 64, 192, 21, 3, 4, "bad")]
# the other widths quantize-vq writes (6 .. 11 bits: the index fields cross bytes at odd widths), one order each
VQ_WIDTHS = [(6, 64, 128, 19, 2, 3, "random", "forward"), (7, 128, 64, 23, 2, 3, "bad", "random"),
             (8, 64, 64, 17, 3, 4, "skew", "reverse"), (9, 64, 128, 21, 2, 3, "random", "random"),
             (10, 128, 64, 15, 2, 3, "bad", "forward"), (11, 64, 192, 20, 3, 3, "random", "random")]


@pytest.mark.parametrize("case,order", [(c, o) for c in VQ_WHOLE for o in ("forward", "random")]
                         + [(c[:7], c[7]) for c in VQ_WIDTHS], ids=lambda c: f"vq{c[0]}-{c[6]}" if isinstance(c, tuple) else c)
def test_vq_whole_moe_against_twin_and_reference(kdev, case, order):
    """Kernel vs twin vs the reference MoE (ref.ops.swiglu on the reference's decode), all within fp32 noise of the
    magnitude; the bad ids' tokens come out NaN."""
    bits, dim, ff, T, k, E, how = case
    r = rng(8, bits)
    cb = codebook(r, bits)
    fmt, dg, Wg = vq_experts(r, bits, cb, E, ff, dim)
    _, du, Wu = vq_experts(r, bits, cb, E, ff, dim)
    _, dd, Wd = vq_experts(r, bits, cb, E, dim, ff)
    clamp = 0.4
    x, ids, wts, add, got = whole_moe(kdev(order, T), ops_mp.moe_prefill, r, (T, k, E, how),
                                      Experts(fmt=fmt, n_experts=E, ff=ff, dim=dim, gate=dg, up=du, down=dd,
                                              clamp=clamp))
    want, mag = twin.moe(Wg, Wu, Wd, x, ids, wts, clamp, ops_mp.BM, ops_mp.max_tiles(T * k, E), add, exact=True)
    good = ((ids >= 0) & (ids < E)).all(1)
    assert np.isnan(got[~good]).all() and np.isfinite(got[good]).all() and good.sum() >= T - 3
    ref = _reference_moe(Wg, Wu, Wd, x[good], ids[good], wts[good], clamp, add[good])
    e_twin = (np.abs(got[good] - want[good]) / mag[good]).max()
    e_ref = (np.abs(got[good] - ref) / mag[good]).max()
    r_ref = np.abs(got[good] - ref).max() / np.abs(ref).max()
    print(f"\nvq{bits} {how}: |kernel - twin| / mag max {e_twin:.2e}; |kernel - reference| / mag max {e_ref:.2e}, "
          f"/ max |y| {r_ref:.2e} (fp32 eps {np.finfo(np.float32).eps:.2e})")
    n = dim + ff
    assert_close_scaled(got[good], want[good], mag[good], n, f"vq{bits} whole vs twin")
    assert_close_scaled(got[good], ref, mag[good], n, f"vq{bits} whole vs reference")


@pytest.mark.parametrize("dim,ff", [(832, 128), (256, 2240)])
def test_vq13_windows_at_wide_rows(kdev, dim, ff):
    """13 bits at rows of many sectors (cu/moe_prefill.cu MoepWin: each tile row's stream and hi windows): 156 / 420
    stream bytes and 13 / 35 hi bytes a row, so the rows start at every phase of a sector and cross their hi sectors
    at different k tiles; gate + up and down against the twin."""
    T, k, E = 24, 2, 2
    r = rng(9, dim, ff)
    cb = codebook(r, 13)
    fmt, dg, Wg = vq_experts(r, 13, cb, E, ff, dim)
    _, du, Wu = vq_experts(r, 13, cb, E, ff, dim)
    _, dd, Wd = vq_experts(r, 13, cb, E, dim, ff)
    x = r.standard_normal((T, dim)).astype(np.float32)
    ids = ids_case("random", r, T, k, E)
    wts = (r.random((T, k)) + 0.2).astype(np.float32)
    dev = kdev("random", 1)
    bufs = bufs_on(dev, T, k, E, ff, dim)
    y = dev.var(np.full((T, dim), np.nan, np.float32))
    ex = Experts(fmt=fmt, n_experts=E, ff=ff, dim=dim, gate=dev.const(dg), up=dev.const(du), down=dev.const(dd),
                 clamp=0.4)
    ops_mp.moe_prefill(dev.rt, ex, TokenRows(x=dev.const(x), y=y, T=T), Slots(ids=dev.const(ids),
                       weights=dev.const(wts), k=k), bufs)
    want, mag = twin.moe(Wg, Wu, Wd, x, ids, wts, 0.4, ops_mp.BM, ops_mp.max_tiles(T * k, E), None, exact=True)
    assert_close_scaled(y.download().astype(np.float64), want, mag, dim + ff, f"vq13 {dim} x {ff}")


def test_vq_wrappers_reject_bad_input(kdev):
    dev = kdev()
    bufs = bufs_on(dev, 4, 2, 3, 64, 64)
    with pytest.raises(Ds4Error, match="no VQ-8 kernel format 'vq14'"):
        ops_mp.moe_prefill_down(dev.rt,
                                Experts(fmt="vq14", n_experts=3, ff=64, dim=64, down=dev.const(np.zeros(10, np.uint8))),
                                bufs, 4, 2)
    with pytest.raises(Ds4Error, match="not whole vq12 blocks"):
        ops_mp.moe_prefill_down(dev.rt,
                                Experts(fmt="vq12", n_experts=3, ff=96, dim=64, down=dev.const(np.zeros(10, np.uint8))),
                                bufs, 4, 2)
    with pytest.raises(Ds4Error, match="weight bytes"):
        ops_mp.moe_prefill_down(dev.rt,
                                Experts(fmt="vq13", n_experts=3, ff=64, dim=64, down=dev.const(np.zeros(10, np.uint8))),
                                bufs, 4, 2)
