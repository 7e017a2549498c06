"""cu/moe_prefill.cu under the CPU emulator against its twin (ds4py/cuda/twins/moe_prefill.py): the route's count /
scan / scatter and work items exact (skew, an expert with no tokens, one with all of them, bad ids; every thread
order), the grouped gate + up and down of every expert format against the twin stage by stage, and the whole
grouped MoE against the twin and against the reference MoE (ref.ops.swiglu, fp32 throughout) within bf16-level
tolerances scaled by the magnitude."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cu_fixtures import requires_emulator
from ds4py.cuda.ops import moe_prefill as ops_mp
from ds4py.cuda.twins import experts as twin_experts
from ds4py.cuda.twins import moe_prefill as twin
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.errors import Ds4Error
from ds4py.ref import ops as ref_ops
from tests.cu_emu_device import devices
from tests.test_cu_emu_experts import expert_tensor

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


@pytest.mark.parametrize("case", [("random", 37, 6, 8), ("skew", 150, 2, 5), ("one", 70, 3, 4), ("bad", 20, 4, 6),
                                  ("random", 400, 6, 256)], ids=lambda c: f"{c[0]}-T{c[1]}-k{c[2]}-E{c[3]}")
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
    ops_mp.moe_prefill_gate_up(dev.rt, qtype, dev.const(rg), dev.const(ru), dev.const(x), dev.const(wts), bufs, T, k,
                               E, ff, dim, clamp)
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
    ops_mp.moe_prefill_down(dev.rt, qtype, dev.const(rd), bufs, T, k, E, ff, dim)
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
    x = r.standard_normal((T, dim)).astype(np.float32)
    ids = ids_case(how, r, T, k, E)
    wts = (r.random((T, k)) + 0.2).astype(np.float32)
    add = r.standard_normal((T, dim)).astype(np.float32)
    clamp = 10.0
    dev = kdev(order, T)
    bufs = bufs_on(dev, T, k, E, ff, dim)
    y = dev.var(np.full((T, dim), np.nan, np.float32))
    ops_mp.moe_prefill(dev.rt, (qg, dev.const(rg)), (qg, dev.const(ru)), (qd, dev.const(rd)), dev.const(x),
                       dev.const(ids), dev.const(wts), y, T, k, E, ff, dim, clamp, bufs, add=dev.const(add))
    got = y.download().astype(np.float64)
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
    with pytest.raises(Ds4Error, match="1 to 256 experts"):
        ops_mp.moe_prefill_route(dev.rt, dev.const(z((4, 2), np.int32)), bufs, 4, 2, 300)
    with pytest.raises(Ds4Error, match="ids must be int32"):
        ops_mp.moe_prefill_route(dev.rt, dev.const(z((4, 2), np.int64)), bufs, 4, 2, 3)
    with pytest.raises(Ds4Error, match="has no kernel"):
        ops_mp.moe_prefill_down(dev.rt, QT.Q5_K, dev.const(z(10, np.uint8)), bufs, 4, 2, 3, 32, 32)
    with pytest.raises(Ds4Error, match="weight bytes"):
        ops_mp.moe_prefill_down(dev.rt, QT.Q8_0, dev.const(z(10, np.uint8)), bufs, 4, 2, 3, 32, 32)
    small = bufs_on(dev, 2, 2, 3, 32, 32)
    with pytest.raises(Ds4Error, match="buffer sorted"):
        ops_mp.moe_prefill_down(dev.rt, QT.Q8_0, dev.const(z(3 * 32 * 34, np.uint8)), small, 4, 2, 3, 32, 32)
    with pytest.raises(Ds4Error, match="same weight type"):
        ops_mp.moe_prefill(dev.rt, (QT.Q8_0, None), (QT.F16, None), (QT.F16, None), None, None, None, None, 4, 2, 3,
                           32, 32, 0.0, bufs)


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
    ops_mp.moe_prefill(dev.rt, (QT.Q8_0, dev.const(rg)), (QT.Q8_0, dev.const(ru)), (QT.Q8_0, dev.const(rd)),
                       dev.const(x), dev.const(ids), None, y, T, 1, 1, ff, dim, 10.0, bufs)
    got = y.download().astype(np.float64)
    assert bufs.info.download()[0] == -(-T // ops_mp.BM)
    want, mag = twin.moe(Wg, Wu, Wd, x, ids, None, 10.0, ops_mp.BM, ops_mp.max_tiles(T, 1))
    ref = _reference_moe(Wg, Wu, Wd, x, ids, np.ones((T, 1), np.float32), 10.0, 0)
    assert (np.abs(got - want) <= 2 ** -8 * mag).all() and (np.abs(got - ref) <= 2 ** -7 * mag).all()
