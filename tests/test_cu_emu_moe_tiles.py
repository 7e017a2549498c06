"""cu/moe_prefill.cu's exact fp32 token tiles (moe_gate_up_tile_<fmt>, moe_down_tile_<fmt>: the default prefill
experts of the GGML formats) under the CPU emulator: every (token, slot) result bit for bit the decode path's
(moe_gate_up_rows_<fmt>'s h of that pair; moe_down_rows_<fmt> with that one slot), for every expert format, several
rows per block (ragged row tiles, one row per block), token tiles longer than one MOET_NT chunk and than one work
item (skew), bad ids (NaN rows) and every thread order; the stages and the whole MoE against the fp32 twin and the
reference (ref.ops.swiglu) within fp32 tolerances."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cu_fixtures import requires_emulator
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.ops import moe_prefill as ops_mp
from ds4py.cuda.twins import moe_prefill as twin
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.cuda.ops.core import TokenRows
from ds4py.cuda.ops.experts import Experts, Slots
from ds4py.errors import Ds4Error
from tests.cu_emu_device import devices
from tests.test_cu_emu_moe_prefill import _experts, _reference_moe, bufs_on, ids_case, rng, whole_moe

pytestmark = requires_emulator
kdev = pytest.fixture(devices, name="kdev")

# format, dim (gate/up columns), ff, ids case, rows per block (None: the wrapper's)
GATE_UP = [(QT.IQ2_XXS, 256, 64, "skew", None), (QT.Q2_K, 256, 96, "bad", 5), (QT.Q4_K, 256, 64, "random", 3),
           (QT.MXFP4, 64, 160, "bad", None), (QT.Q8_0, 96, 64, "skew", 7), (QT.F16, 64, 32, "random", 1)]
# format, dim (down rows), ff (down columns), ids case, rows per block
DOWN = [(QT.Q2_K, 256, 256, "skew", None), (QT.IQ2_XXS, 40, 256, "bad", 6), (QT.Q4_K, 64, 256, "random", 9),
        (QT.MXFP4, 70, 64, "skew", None), (QT.Q8_0, 64, 96, "bad", 32), (QT.F16, 130, 32, "random", 4)]


def _bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_array_equal(np.ascontiguousarray(got, np.float32).view(np.uint32),
                                  np.ascontiguousarray(want, np.float32).view(np.uint32), err_msg=what)


@pytest.mark.parametrize("order", ("forward", "random"))
@pytest.mark.parametrize("case", GATE_UP, ids=lambda c: f"{c[0].name}-d{c[1]}-ff{c[2]}-{c[3]}-rpb{c[4]}")
def test_gate_up_tiles_are_the_rows_kernels_bits(kdev, case, order):
    qtype, dim, ff, how, rpb = case
    T, k, E = 75, 3, 4                                # 225 pairs: skew puts 75 on expert 0 (two work items)
    r = rng(21, int(qtype))
    rg, Wg = _experts(r, qtype, E, ff, dim)
    ru, Wu = _experts(r, qtype, E, ff, dim)
    x = (r.standard_normal((T, dim)) * 2).astype(np.float32)
    ids = ids_case(how, r, T, k, E)
    wts = (r.random((T, k)) + 0.2).astype(np.float32)
    clamp = 0.0 if qtype == QT.F16 else 0.5
    dev = kdev(order, T)
    bufs = bufs_on(dev, T, k, E, ff, dim)
    ops_mp.moe_prefill_route(dev.rt, dev.const(ids), bufs, T, k, E)
    ops_mp.moe_tile_gate_up(dev.rt,
                            Experts(fmt=qtype, n_experts=E, ff=ff, dim=dim, gate=dev.const(rg), up=dev.const(ru),
                                    clamp=clamp), TokenRows(x=dev.const(x), T=T), Slots(weights=dev.const(wts), k=k),
                            bufs, rows_per_block=rpb)
    h = dev.var(np.full((T * k, ff), np.nan, np.float32))
    ops_moe.moe_gate_up_rows(dev.rt,
                             Experts(fmt=qtype, n_experts=E, ff=ff, dim=dim, gate=dev.const(rg), up=dev.const(ru),
                                     clamp=clamp), TokenRows(x=dev.const(x), y=h, T=T),
                             Slots(ids=dev.const(ids), weights=dev.const(wts), k=k))
    pos = bufs.pos.download()
    got = bufs.H.download()[pos]                       # pair order
    _bits_equal(got, h.download(), f"gate_up tiles {case}")
    rt_ = twin.route(ids, E, ops_mp.BM, ops_mp.max_tiles(T * k, E))
    want, mag = twin.gate_up(Wg, Wu, x, wts, rt_, k, clamp, exact=True)
    H = bufs.H.download()
    bad = np.isnan(want).all(1)
    assert np.isnan(H[bad]).all() and (how != "bad" or bad.any())
    assert_close_scaled(H[~bad], want[~bad], mag[~bad], dim, f"gate_up tiles {case}")


@pytest.mark.parametrize("order", ("forward", "reverse"))
@pytest.mark.parametrize("case", DOWN, ids=lambda c: f"{c[0].name}-d{c[1]}-ff{c[2]}-{c[3]}-rpb{c[4]}")
def test_down_tiles_are_the_one_slot_down_bits(kdev, case, order):
    qtype, dim, ff, how, rpb = case
    T, k, E = 70, 2, 3
    r = rng(22, int(qtype))
    rd, Wd = _experts(r, qtype, E, dim, ff)
    ids = ids_case(how, r, T, k, E)
    H = r.standard_normal((T * k, ff)).astype(np.float32)      # sorted order
    dev = kdev(order, T)
    bufs = bufs_on(dev, T, k, E, ff, dim)
    bufs.H.upload(H)
    ops_mp.moe_prefill_route(dev.rt, dev.const(ids), bufs, T, k, E)
    ops_mp.moe_tile_down(dev.rt, Experts(fmt=qtype, n_experts=E, ff=ff, dim=dim, down=dev.const(rd)), bufs, T, k,
                         rows_per_block=rpb)
    pos = bufs.pos.download()
    y = dev.var(np.full((T * k, dim), np.nan, np.float32))      # one row per pair, its one slot
    ops_moe.moe_down_rows(dev.rt, Experts(fmt=qtype, n_experts=E, ff=ff, dim=dim, down=dev.const(rd)),
                          TokenRows(x=dev.const(H[pos]), y=y, T=T * k), Slots(ids=dev.const(ids)))
    Yp = bufs.Yp.download()
    _bits_equal(Yp[pos], y.download(), f"down tiles {case}")
    want, mag = twin.down(Wd, H, twin.route(ids, E, ops_mp.BM, ops_mp.max_tiles(T * k, E)), exact=True)
    bad = np.isnan(want).all(1)
    assert np.isnan(Yp[bad]).all() and (how != "bad" or bad.any())
    assert_close_scaled(Yp[~bad], want[~bad], mag[~bad], ff, f"down tiles {case}")


WHOLE = [(QT.IQ2_XXS, QT.Q2_K, 256, 256, 21, 3, 4, "random"), (QT.Q4_K, QT.Q8_0, 256, 64, 80, 2, 2, "skew")]


@pytest.mark.parametrize("case", WHOLE, ids=lambda c: f"{c[0].name}-{c[1].name}-{c[7]}")
def test_whole_tiled_moe_against_twin_and_reference(kdev, case):
    qg, qd, dim, ff, T, k, E, how = case
    r = rng(23, int(qg), int(qd))
    rg, Wg = _experts(r, qg, E, ff, dim)
    ru, Wu = _experts(r, qg, E, ff, dim)
    rd, Wd = _experts(r, qd, E, dim, ff)
    clamp = 10.0
    x, ids, wts, add, got = whole_moe(kdev("random", T), ops_mp.moe_tiles, r, (T, k, E, how),
                                      Experts(fmt=qg, n_experts=E, ff=ff, dim=dim, gate=rg, up=ru, down=rd,
                                              down_fmt=qd, clamp=clamp))
    want, mag = twin.moe(Wg, Wu, Wd, x, ids, wts, clamp, ops_mp.BM, ops_mp.max_tiles(T * k, E), add, exact=True)
    ref = _reference_moe(Wg, Wu, Wd, x, ids, wts, clamp, add)
    e_twin, e_ref = np.abs(got - want) / mag, np.abs(got - ref) / mag
    print(f"\n{qg.name}/{qd.name} {how}: |kernel - twin| / mag max {e_twin.max():.2e}; |kernel - reference| / mag "
          f"max {e_ref.max():.2e}")
    assert e_twin.max() <= 2 ** -18 and e_ref.max() <= 2 ** -18      # fp32 throughout: summation order only


def test_tile_geometry_and_bad_input(kdev):
    # V4 Flash: IQ2_XXS gate / up rows of 4096 columns, Q2_K down rows of 2048; within the stage budget
    assert ops_mp.tile_rows(QT.IQ2_XXS, 4096, 2) == 14 and ops_mp.tile_rows(QT.Q2_K, 2048, 1) == 32
    assert ops_mp.tile_rows(QT.Q4_K, 4096, 2) == 6 and ops_mp.tile_threads(6) == 64
    for q, cols, mats in ((QT.IQ2_XXS, 4096, 2), (QT.Q4_K, 4096, 2), (QT.Q2_K, 2048, 1), (QT.F16, 4096, 2)):
        nr = ops_mp.tile_rows(q, cols, mats)
        assert mats * ops_moe.room(nr * ops_moe.row_bytes(q, cols)) <= ops_moe.SMEM_BUDGET
    dev = kdev()
    bufs = bufs_on(dev, 4, 2, 3, 32, 32)
    with pytest.raises(Ds4Error, match="GGML formats"):
        ops_mp.moe_tile_down(dev.rt, Experts(fmt="vq12", n_experts=3, ff=32, dim=32), bufs, 4, 2)
    with pytest.raises(Ds4Error, match="rows per block"):
        ops_mp.moe_tile_down(dev.rt,
                             Experts(fmt=QT.Q8_0, n_experts=3, ff=32, dim=32,
                                     down=dev.const(np.zeros(3 * 32 * 34, np.uint8))), bufs, 4, 2, rows_per_block=33)


@pytest.mark.parametrize("bits", (12, 13, 7))
def test_vq_prefill_results_do_not_depend_on_the_persistent_grid(kdev, bits):
    """cu/moe_prefill.cu's VQ-8 down is persistent (one wave of blocks, each copying the codebook once and looping
    over (feature tile, work item) pairs): an H200-like device (a block per pair or nearly) and a one-SM device (one
    or two blocks looping over every pair) give the same bits, bad ids included."""
    from ds4py.cuda.emu_runtime import EmuDevice, EmuRuntime
    from ds4py.cuda.ops import experts as ops_moe
    from tests.cu_emu_device import KernelDevice
    from tests.test_cu_emu_moe_prefill import vq_experts
    from tests.test_cu_emu_vq import codebook

    def one_sm(order: str) -> KernelDevice:
        # one SM, H200's per-block shared memory (the emulator's static shared memory of the 13-bit gate + up is
        # g++'s layout, above ptxas' 26,624 B: GB10's limit would refuse it here, not on the device)
        dev = EmuDevice(name="one-SM", cc=(9, 0), sm_count=1, smem_per_block_optin=232_448, threads_per_sm=2048)
        return KernelDevice(EmuRuntime(order=order, check_pdl=True, device=dev), 32, 32)

    T, k, E, dim, ff = 40, 2, 3, 128, 192
    r = rng(24, bits)
    cb = codebook(r, bits)
    fmt, dg, _ = vq_experts(r, bits, cb, E, ff, dim)
    _, du, _ = vq_experts(r, bits, cb, E, ff, dim)
    _, dd, _ = vq_experts(r, bits, cb, E, dim, ff)
    x = r.standard_normal((T, dim)).astype(np.float32)
    ids = ids_case("bad", r, T, k, E)
    wts = (r.random((T, k)) + 0.2).astype(np.float32)
    outs = []
    for dev in (kdev("random", 1), one_sm("reverse")):
        bufs = bufs_on(dev, T, k, E, ff, dim)
        ops_mp.moe_prefill_route(dev.rt, dev.const(ids), bufs, T, k, E)
        ops_mp.moe_prefill_gate_up(dev.rt,
                                   Experts(fmt=fmt, n_experts=E, ff=ff, dim=dim, gate=dev.const(dg), up=dev.const(du),
                                           clamp=0.5), TokenRows(x=dev.const(x), T=T),
                                   Slots(weights=dev.const(wts), k=k), bufs)
        ops_mp.moe_prefill_down(dev.rt, Experts(fmt=fmt, n_experts=E, ff=ff, dim=dim, down=dev.const(dd)), bufs, T, k)
        grid = ops_mp._grid(dev.rt, fmt, -(-dim // ops_mp.BN), ops_mp.max_tiles(T * k, E),
                            f"moe_prefill_down_{fmt}")
        if dev.rt.device.sm_count == 1:
            assert 2 * grid[0] <= -(-dim // ops_mp.BN) * ops_mp.max_tiles(T * k, E), grid   # blocks loop
        outs.append((bufs.H.download(), bufs.Yp.download()))
    for name, a, b in zip(("H", "Yp"), *outs):
        _bits_equal(a, b, f"vq{bits} {name}")
    assert np.isnan(outs[0][1]).any() and np.isfinite(outs[0][1]).any()
    assert ops_moe.codebook_bytes(fmt) > 0
