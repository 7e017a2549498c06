"""cu/experts.cu under the CPU emulator against its twin (ds4py/cuda/twins/experts.py): exact dequantisation of every
expert format (bit for bit with ds4py.quant), the routed / shared gate+up+SwiGLU and the down sum with its add and
hc_post epilogues, at several geometries (ragged row tails, one real-width case), in every thread order, bit-identical
across orders."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4py.cuda import emu
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.twins import experts as twin
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.cuda.ops.core import TokenRows
from ds4py.cuda.ops.experts import Experts, HcPost, Slots
from ds4py.errors import Ds4Error
from tests.cu_emu_device import devices

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")

ORDERS = ("forward", "reverse", "random")
FMTS = [QT.IQ2_XXS, QT.Q2_K, QT.Q4_K, QT.MXFP4, QT.Q8_0, QT.F16]


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([19, *seed])


def f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float16).reshape(-1, 1).view(np.uint8)


def random_blocks(r: np.random.Generator, qtype: int, n_values: int, edge: bool = False) -> np.ndarray:
    """Valid random GGUF bytes for n_values weights (scales of a realistic size; `edge`: extreme scale codes too)."""
    qt = QT(qtype)
    if qt == QT.F16:
        v = (r.standard_normal(n_values) * 0.05).astype(np.float16)
        if edge:
            v[:4] = [np.float16(6e-8), np.float16(-65504), np.float16(0), np.float16(-0.0)]
        return v.view(np.uint8)
    _, qk, nb = ops_moe.FORMATS[qt]
    n = n_values // qk
    b = r.integers(0, 256, (n, nb), dtype=np.uint8)
    scale = (r.random(n) * 0.01 + 0.001) * np.where(r.random(n) < 0.2, -1, 1)
    if edge:
        scale[:3] = [6e-8, 65504, 0.0]                   # f16 subnormal, largest, zero
    if qt == QT.IQ2_XXS:
        b[:, 0:2] = f16_bytes(scale)
    elif qt in (QT.Q2_K, QT.Q4_K):
        off = 80 if qt == QT.Q2_K else 0
        b[:, off:off + 2] = f16_bytes(scale)
        b[:, off + 2:off + 4] = f16_bytes(scale * r.random(n))
    elif qt == QT.MXFP4:
        b[:, 0] = r.integers(118, 131, n)
        if edge:
            b[:4, 0] = [0, 1, 2, 254]                    # e8m0 codes in the subnormal range and near the top
    elif qt == QT.Q8_0:
        b[:, 0:2] = f16_bytes(scale)
    return b.reshape(-1)


def expert_tensor(r, qtype, n_experts: int, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    raw = random_blocks(r, qtype, n_experts * rows * cols)
    return raw, twin.dequant(raw, qtype, (n_experts, rows, cols))


@pytest.mark.parametrize("qtype", FMTS, ids=lambda q: q.name)
def test_dequant_is_bit_exact(kdev, qtype):
    r = rng(int(qtype))
    n = 256 * 37
    raw = random_blocks(r, qtype, n, edge=True)
    dev = kdev("random", int(qtype))
    d_out = dev.var(np.full(n + 64, np.nan, np.float32))
    ops_moe.moe_dequant(dev.rt, qtype, dev.const(raw), d_out, n)
    out = d_out.download()
    with np.errstate(over="ignore"):                     # e8m0 254 * 12 overflows to inf, in both
        want = twin.dequant(raw, qtype, (n,))
    np.testing.assert_array_equal(out[:n].view(np.uint32), want.view(np.uint32))   # bits, NaN and -0 included
    assert np.isnan(out[n:]).all()


# format, dim (columns of gate/up), ff (rows), experts, slots, rows per block (None: the wrapper's)
GATE_UP = [
    (QT.IQ2_XXS, 256, 40, 5, 6, None), (QT.IQ2_XXS, 4096, 24, 3, 2, None), (QT.Q2_K, 512, 33, 4, 3, 5),
    (QT.Q4_K, 256, 17, 3, 6, None), (QT.MXFP4, 96, 50, 4, 2, 7), (QT.Q8_0, 160, 21, 1, 1, None),
    (QT.F16, 64, 9, 2, 3, 3),
]


@pytest.mark.parametrize("case", GATE_UP, ids=lambda c: f"{c[0].name}-d{c[1]}-ff{c[2]}")
@pytest.mark.parametrize("order", ORDERS)
def test_gate_up(kdev, case, order):
    qtype, dim, ff, n_exp, slots, rpb = case
    r = rng(int(qtype), dim, ff)
    raw_g, Wg = expert_tensor(r, qtype, n_exp, ff, dim)
    raw_u, Wu = expert_tensor(r, qtype, n_exp, ff, dim)
    x = (r.standard_normal(dim) * 2).astype(np.float32)
    shared = n_exp == 1
    ids = None if shared else r.integers(0, n_exp, slots).astype(np.int32)
    route_w = None if shared else (r.random(slots) + 0.2).astype(np.float32)
    clamp = 0.0 if qtype == QT.F16 else 0.5                # small: the clamp really cuts with these scales
    dev = kdev(order, dim)
    d_h = dev.var(np.full((slots + 1, ff), np.nan, np.float32))
    ops_moe.moe_gate_up(dev.rt,
                        Experts(fmt=qtype, n_experts=n_exp, ff=ff, dim=dim, gate=dev.const(raw_g), up=dev.const(raw_u),
                                clamp=clamp), dev.const(x), d_h,
                        Slots(ids=dev.const(ids), weights=dev.const(route_w), k=slots), rows_per_block=rpb)
    h = d_h.download()
    want, mag = twin.gate_up(Wg, Wu, x, ids, route_w, clamp, slots)
    assert_close_scaled(h[:slots], want, mag, dim, f"gate_up {case}")
    assert np.isnan(h[slots:]).all()


# format, ff (columns of down), dim (rows), experts, slots, rows per block, epilogue
DOWN = [
    (QT.Q2_K, 256, 37, 5, 6, None, "add"), (QT.Q2_K, 2048, 20, 3, 6, 8, "hc"), (QT.IQ2_XXS, 512, 19, 4, 3, 4, "y"),
    (QT.Q4_K, 256, 45, 3, 6, None, "hc"), (QT.MXFP4, 64, 30, 6, 4, 9, "add"), (QT.Q8_0, 96, 25, 1, 1, None, "y"),
    (QT.F16, 128, 11, 2, 2, 2, "hc"),
]


@pytest.mark.parametrize("case", DOWN, ids=lambda c: f"{c[0].name}-ff{c[1]}-d{c[2]}-{c[6]}")
@pytest.mark.parametrize("order", ORDERS)
def test_down(kdev, case, order):
    qtype, ff, dim, n_exp, slots, rpb, epi = case
    r = rng(int(qtype), ff, dim, 1)
    raw, W = expert_tensor(r, qtype, n_exp, dim, ff)
    h = r.standard_normal((slots, ff)).astype(np.float32)
    ids, add, post, comb, X, got = run_down(kdev(order, ff), r,
                                            Experts(fmt=qtype, n_experts=n_exp, ff=ff, dim=dim, down=raw), h, epi, rpb)
    want, mag = twin.down(W, ids, h, slots, add, post, comb, X)
    assert_close_scaled(got.reshape(want.shape), want, mag, ff * slots + HC, f"down {case}")


HC = 4                                            # the hc_post epilogue's streams in the down tests


def run_down(dev, r, ex: Experts, h: np.ndarray, epi: str, rpb: int | None):
    """The down kernel of experts `ex` (down: the host bytes) on the slots' h [slots, ff] with epilogue epi ("y",
    "add" or "hc"), its ids, add and hc_post inputs drawn from r in that order: (ids, add, post, comb, X, out)."""
    slots, dim = len(h), ex.dim
    ids = None if ex.n_experts == 1 else r.integers(0, ex.n_experts, slots).astype(np.int32)
    add = r.standard_normal(dim).astype(np.float32) if epi != "y" else None
    post = (r.random(HC) * 2).astype(np.float32) if epi == "hc" else None
    comb = r.random((HC, HC)).astype(np.float32) if epi == "hc" else None
    X = r.standard_normal((HC, dim)).astype(np.float32) if epi == "hc" else None
    d_out = dev.var(np.full((HC if epi == "hc" else 1, dim), np.nan, np.float32))
    ops_moe.moe_down(dev.rt, replace(ex, down=dev.const(ex.down)),
                     TokenRows(x=dev.const(h), y=d_out, add=dev.const(add)), Slots(ids=dev.const(ids), k=slots),
                     hc=HcPost(dev.const(post), dev.const(comb), dev.const(X)) if epi == "hc" else None,
                     rows_per_block=rpb)
    return ids, add, post, comb, X, d_out.download()


def test_moe_is_bit_identical_across_orders(kdev):
    qtype, dim, ff, n_exp, slots = QT.IQ2_XXS, 512, 256, 4, 6
    r = rng(5)
    raw_g, _ = expert_tensor(r, qtype, n_exp, ff, dim)
    raw_u, _ = expert_tensor(r, qtype, n_exp, ff, dim)
    raw_d, _ = expert_tensor(r, QT.Q2_K, n_exp, dim, ff)
    x = r.standard_normal(dim).astype(np.float32)
    ids = r.integers(0, n_exp, slots).astype(np.int32)
    w = r.random(slots).astype(np.float32)
    outs = []
    for order in ORDERS:
        dev = kdev(order, 9)
        d_h, d_y = dev.var(np.zeros((slots, ff), np.float32)), dev.var(np.zeros(dim, np.float32))
        d_ids = dev.const(ids)
        ops_moe.moe_gate_up(dev.rt,
                            Experts(fmt=qtype, n_experts=n_exp, ff=ff, dim=dim, gate=dev.const(raw_g),
                                    up=dev.const(raw_u), clamp=10.0), dev.const(x), d_h,
                            Slots(ids=d_ids, weights=dev.const(w), k=slots))
        ops_moe.moe_down(dev.rt, Experts(fmt=QT.Q2_K, n_experts=n_exp, ff=ff, dim=dim, down=dev.const(raw_d)),
                         TokenRows(x=d_h, y=d_y), Slots(ids=d_ids, k=slots))
        outs.append(d_y.download())
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_bad_expert_ids_give_nan_not_a_wild_read(kdev):
    qtype, dim, ff, n_exp = QT.Q4_K, 256, 8, 2
    r = rng(6)
    raw, _ = expert_tensor(r, qtype, n_exp, ff, dim)
    dev = kdev()
    ids = dev.const(np.array([1, -1, 2], np.int32))
    d_h = dev.var(np.zeros((3, ff), np.float32))
    ops_moe.moe_gate_up(dev.rt,
                        Experts(fmt=qtype, n_experts=n_exp, ff=ff, dim=dim, gate=dev.const(raw), up=dev.const(raw),
                                clamp=10.0),
                        dev.const(r.standard_normal(dim).astype(
        np.float32)), d_h, Slots(ids=ids, k=3))
    h = d_h.download()
    assert np.isfinite(h[0]).all() and np.isnan(h[1:]).all()
    raw_d, _ = expert_tensor(r, qtype, n_exp, ff, dim)      # [2, ff rows, dim cols] read as down: dim = ff here
    d_y = dev.var(np.zeros(ff, np.float32))
    ops_moe.moe_down(dev.rt, Experts(fmt=qtype, n_experts=n_exp, ff=dim, dim=ff, down=dev.const(raw_d)),
                     TokenRows(x=dev.const(np.ones((3, dim), np.float32)), y=d_y), Slots(ids=ids, k=3))
    assert np.isnan(d_y.download()).all()


def test_expert_wrappers_reject_bad_input():
    z = np.zeros
    with pytest.raises(Ds4Error, match="has no kernel"):
        ops_moe.moe_dequant(None, QT.Q5_K, z(176, np.uint8), z(256, np.float32), 256)
    with pytest.raises(Ds4Error, match="weight bytes"):
        ops_moe.moe_gate_up(None,
                            Experts(fmt=QT.Q2_K, n_experts=1, ff=4, dim=256, gate=z(100, np.uint8), up=z(100, np.uint8),
                                    clamp=10.0), z(256, np.float32), z((1, 4), np.float32), Slots())
    with pytest.raises(Ds4Error, match="whole"):
        ops_moe.row_bytes(QT.IQ2_XXS, 100)
    with pytest.raises(Ds4Error, match="rows per block"):
        ops_moe.moe_plan(QT.Q8_0, 4096, 100, 2, 2, rows_per_block=17)
