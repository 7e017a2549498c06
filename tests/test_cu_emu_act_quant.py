"""The int8-activation numerics' kernels (Numerics.act_quant) under the CPU emulator:

- cu/act_quant.cu act_round_q8_0 / act_round_q8_k against their twins (ds4py.ref.ops.q8_0_round / q8_k_round on
  each row) bit for bit, strided rows included, with the roundings' edge cases: a magnitude tie between a positive
  and a negative value, zero blocks, values exactly halfway between two codes (rint: to even);
- cu/experts.cu's multi-row int8 kernels (moe_gate_up_rows_i8_<fmt>, moe_down_rows_i8_<fmt>): every (row, slot)
  pair bit-identical to the single-row int8 kernels (moe_gate_up_i8_<fmt>, moe_down_i8_<fmt>), so a row of a
  multi-row act_quant step is its single step (the engine test: tests/test_cuda_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4py.cuda import emu
from ds4py.cuda.ops import act_quant as ops_aq
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.ops import moe_prefill as ops_moep
from ds4py.cuda.ops.core import TokenRows
from ds4py.cuda.ops.experts import Experts, Slots
from ds4py.cuda.twins import act_quant as twin
from ds4py.errors import Ds4Error
from tests.cu_emu_device import devices
from tests.test_cu_emu_experts import expert_tensor, rng
from tests.test_cu_emu_experts_i8 import activations

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")


def edge_rows(r: np.random.Generator, n_rows: int, stride: int, block: int) -> np.ndarray:
    x = (r.standard_normal(n_rows * stride) * 3).astype(np.float32)
    x[5], x[17] = np.float32(40.0), np.float32(-40.0)                     # a tie of magnitude, positive first
    if n_rows > 1:
        x[stride + 1], x[stride + 9] = np.float32(-40.0), np.float32(40.0)  # ... negative first
    x[block:2 * block] = 0.0                                              # a zero block
    if n_rows > 2:                                                        # halves of a code (max 127: codes = x)
        b = x[2 * stride:2 * stride + block]
        b[:] = (r.integers(-254, 255, block) / 2).astype(np.float32)
        b[3] = np.float32(127.0)
    x[-3] = np.float32(-0.0)
    return x


CASES = [("q8_0", 3, 64, 64), ("q8_0", 4, 96, 104), ("q8_0", 1, 4096, 4096), ("q8_k", 3, 512, 512),
         ("q8_k", 2, 256, 264), ("q8_k", 1, 4096, 4096)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-s{c[3]}")
@pytest.mark.parametrize("order", ("forward", "random"))
def test_act_round_is_the_reference_rounding_bit_for_bit(kdev, case, order):
    kind, n_rows, width, stride = case
    x = edge_rows(rng(n_rows, width, stride), n_rows, stride, ops_aq.BLOCK[kind])
    dev = kdev(order)
    dx = dev.const(x)
    dy = dev.var(np.full_like(x, np.nan))
    ops_aq.act_round(dev.rt, kind, TokenRows(dx, dy, T=n_rows, ldx=stride), width)
    got = dy.download()
    want = twin.act_round(kind, x, n_rows, width, stride, out=np.full_like(x, np.nan))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{kind}: {np.sum(got != want)} values differ"
    assert not np.array_equal(want[:width], x[:width])                    # the rounding is really there


def test_act_round_in_place_and_refusals(kdev):
    x = edge_rows(rng(7), 2, 256, 256)
    dev = kdev()
    dx = dev.var(x)
    ops_aq.act_round(dev.rt, "q8_k", TokenRows(dx, T=2), 256)               # in place (y None)
    assert np.array_equal(dx.download(), twin.act_round("q8_k", x, 2, 256))
    with pytest.raises(Ds4Error, match="whole q8_k blocks"):
        ops_aq.act_round(dev.rt, "q8_k", TokenRows(dx, dx), 96)
    with pytest.raises(Ds4Error, match="unknown"):
        ops_aq.act_round(dev.rt, "q4_0", TokenRows(dx, dx), 32)
    assert ops_aq.rounding(QT.Q8_0) == ops_aq.rounding(QT.MXFP4) == "q8_0"
    assert ops_aq.rounding(QT.IQ2_XXS) == ops_aq.rounding(QT.Q4_K) == "q8_k"
    assert ops_aq.rounding(QT.F16) is ops_aq.rounding(QT.F32) is ops_aq.rounding("vq13") is None



def test_prefill_experts_refuse_int8_activations():
    """The tensor-core experts and the token tiles are fp32 only: under act_quant a block's experts take the int8
    rows kernels (layer.Recording turns both off), and the ops refuse the flag rather than ignore it."""
    ex = Experts(fmt=QT.Q2_K, n_experts=2, ff=16, dim=256, act_quant=True)
    for run in (ops_moep.moe_prefill, ops_moep.moe_tiles):
        with pytest.raises(Ds4Error, match="fp32 only"):
            run(None, ex, TokenRows(x=None, T=1), Slots(k=1), None)


# format, dim (columns), ff (rows), experts, activation rows, slots per row
ROWS = [(QT.IQ2_XXS, 512, 24, 4, 3, 2), (QT.Q2_K, 256, 19, 3, 4, 3), (QT.Q4_K, 512, 17, 5, 2, 3)]


@pytest.mark.parametrize("case", ROWS, ids=lambda c: c[0].name)
def test_int8_rows_kernels_are_the_single_row_kernels_bit_for_bit(kdev, case):
    qtype, dim, ff, n_exp, nx, k = case
    r = rng(int(qtype), dim, ff, 4)
    raw_g, _ = expert_tensor(r, qtype, n_exp, ff, dim)
    raw_u, _ = expert_tensor(r, qtype, n_exp, ff, dim)
    x = np.stack([activations(r, dim) for _ in range(nx)])
    ids = r.integers(0, n_exp, nx * k).astype(np.int32)
    ids[1] = ids[0] if k > 1 else ids[1]
    wts = (r.random(nx * k) + 0.2).astype(np.float32)
    dev = kdev("random", seed=3)
    Wg, Wu = dev.const(raw_g), dev.const(raw_u)
    d_h = dev.var(np.full((nx * k, ff), np.nan, np.float32))
    ex = Experts(fmt=qtype, n_experts=n_exp, ff=ff, dim=dim, gate=Wg, up=Wu, clamp=0.7, act_quant=True)
    ops_moe.moe_gate_up_rows(dev.rt, ex, TokenRows(x=dev.const(x), y=d_h, T=nx),
                             Slots(ids=dev.const(ids), weights=dev.const(wts), k=k))
    rows = d_h.download()
    for n in range(nx):
        one = dev.var(np.full((k, ff), np.nan, np.float32))
        pair = slice(n * k, (n + 1) * k)
        ops_moe.moe_gate_up(dev.rt, ex, dev.const(x[n]), one,
                            Slots(ids=dev.const(ids[pair]), weights=dev.const(wts[pair]), k=k))
        assert np.array_equal(rows[n * k:(n + 1) * k], one.download()), f"gate+up row {n}"
    # the down: nx rows of k slots' h [256] (its columns: whole Q8_K blocks) into ff outputs
    ff_cols = 256
    h = np.stack([activations(r, ff_cols) for _ in range(nx * k)])
    raw_d2, _ = expert_tensor(r, qtype, n_exp, ff, ff_cols)
    down = Experts(fmt=qtype, n_experts=n_exp, ff=ff_cols, dim=ff, down=dev.const(raw_d2), act_quant=True)
    out = dev.var(np.full((nx, ff), np.nan, np.float32))
    ops_moe.moe_down_rows(dev.rt, down, TokenRows(x=dev.const(h), y=out, T=nx), Slots(ids=dev.const(ids), k=k))
    got = out.download()
    for n in range(nx):
        one = dev.var(np.full(ff, np.nan, np.float32))
        ops_moe.moe_down(dev.rt, down, TokenRows(x=dev.const(h[n * k:(n + 1) * k]), y=one),
                         Slots(ids=dev.const(ids[n * k:(n + 1) * k]), k=k))
        assert np.array_equal(got[n], one.download()), f"down row {n}"
