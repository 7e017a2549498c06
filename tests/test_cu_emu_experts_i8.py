"""cu/experts.cu's int8-activation expert kernels (moe_gate_up_i8_<fmt>, moe_down_i8_<fmt>: Numerics.act_quant)
under the CPU emulator against their twins (ds4py/cuda/twins/experts.py gate_up_i8 / down_i8: the fp32 products on
x rounded by the reference's own ds4py.ref.ops.q8_k_round). The kernels round x themselves (Q8_K per block of 256,
shuffles between 8 lanes) and take exact integer dots, so they equal the twin within the fp32 rounding of its sums
(assert_close_scaled): one code off in the rounding is far outside it. Ties of magnitude, zero blocks and values
halfway between two codes are in the inputs."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4py.cuda import emu
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.twins import experts as twin
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.cuda.ops.experts import Experts, Slots
from ds4py.errors import Ds4Error
from ds4py.ref import ops as ref_ops
from tests.cu_emu_device import devices
from tests.test_cu_emu_experts import HC, expert_tensor, rng, run_down

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")


def activations(r: np.random.Generator, n: int) -> np.ndarray:
    """Random activations with the Q8_K rounding's edge cases: a block whose largest magnitude is tied between a
    positive and a negative value (the reference takes the first; the kernel's codes may be all negated, q * d is
    the same), an all-zero block, values at exactly half a code (rint rounds them to even: a kernel rounding them
    away from zero fails 4 of the forward cases, checked)."""
    x = (r.standard_normal(n) * 2).astype(np.float32)
    x[3], x[200] = np.float32(9.0), np.float32(-9.0)              # block 0: tie, the positive first
    if n >= 512:
        x[256:512] = 0.0                                          # block 1: zeros (scale 0)
    if n >= 1024:
        b = x[768:1024]
        b[:] = (r.integers(-254, 255, 256) / 2).astype(np.float32)
        b[17] = np.float32(-127.0)                               # max -127: codes x * 1, halves round to even
    return x


# format, dim (columns), ff (rows), experts, slots, rows per block (None: the wrapper's)
GATE_UP = [(QT.IQ2_XXS, 1024, 40, 5, 6, None), (QT.IQ2_XXS, 4096, 24, 3, 2, None), (QT.Q2_K, 1024, 33, 4, 3, 5),
           (QT.Q2_K, 256, 17, 1, 1, None), (QT.Q4_K, 1024, 21, 3, 6, None)]


@pytest.mark.parametrize("case", GATE_UP, ids=lambda c: f"{c[0].name}-d{c[1]}-ff{c[2]}")
@pytest.mark.parametrize("order", ("forward", "random"))
def test_gate_up_i8(kdev, case, order):
    qtype, dim, ff, n_exp, slots, rpb = case
    r = rng(int(qtype), dim, ff, 8)
    raw_g, Wg = expert_tensor(r, qtype, n_exp, ff, dim)
    raw_u, Wu = expert_tensor(r, qtype, n_exp, ff, dim)
    x = activations(r, dim)
    shared = n_exp == 1
    ids = None if shared else r.integers(0, n_exp, slots).astype(np.int32)
    route_w = None if shared else (r.random(slots) + 0.2).astype(np.float32)
    dev = kdev(order, dim)
    d_h = dev.var(np.full((slots + 1, ff), np.nan, np.float32))
    ops_moe.moe_gate_up(dev.rt,
                        Experts(fmt=qtype, n_experts=n_exp, ff=ff, dim=dim, gate=dev.const(raw_g), up=dev.const(raw_u),
                                clamp=0.5, act_quant=True), dev.const(x), d_h,
                        Slots(ids=dev.const(ids), weights=dev.const(route_w), k=slots), rows_per_block=rpb)
    h = d_h.download()
    want, mag = twin.gate_up_i8(Wg, Wu, x, ids, route_w, 0.5, slots)
    assert_close_scaled(h[:slots], want, mag, dim, f"gate_up_i8 {case}")
    assert np.isnan(h[slots:]).all()
    exact, _ = twin.gate_up(Wg, Wu, x, ids, route_w, 0.5, slots)
    assert not np.array_equal(want, exact)                        # the rounding is really there


DOWN = [(QT.Q2_K, 2048, 20, 3, 6, 8, "hc"), (QT.Q2_K, 512, 37, 5, 6, None, "add"),
        (QT.IQ2_XXS, 1024, 19, 4, 3, 4, "y"), (QT.Q4_K, 1024, 45, 3, 6, None, "hc")]


@pytest.mark.parametrize("case", DOWN, ids=lambda c: f"{c[0].name}-ff{c[1]}-d{c[2]}-{c[6]}")
@pytest.mark.parametrize("order", ("forward", "random"))
def test_down_i8(kdev, case, order):
    qtype, ff, dim, n_exp, slots, rpb, epi = case
    r = rng(int(qtype), ff, dim, 9)
    raw, W = expert_tensor(r, qtype, n_exp, dim, ff)
    h = np.stack([activations(r, ff) for _ in range(slots)])
    ids, add, post, comb, X, got = run_down(
        kdev(order, ff), r, Experts(fmt=qtype, n_experts=n_exp, ff=ff, dim=dim, down=raw, act_quant=True), h, epi, rpb)
    want, mag = twin.down_i8(W, ids, h, slots, add, post, comb, X)
    assert_close_scaled(got.reshape(want.shape), want, mag, ff * slots + HC, f"down_i8 {case}")


def test_the_twin_rounds_with_the_reference():
    x = activations(rng(5), 1024)
    q = ref_ops.q8_k_round(x.reshape(1, -1))[0]
    assert q[3] == np.float32(9.0) and q[200] == np.float32(-9.0) and not q[256:512].any()


def test_act_quant_is_refused_for_a_format_without_int8_kernels():
    with pytest.raises(Ds4Error, match="int8 activations"):
        ops_moe.i8_kernel(QT.Q8_0, True)
    assert ops_moe.i8_kernel(QT.Q8_0, False) == ""
    assert ops_moe.I8_FORMATS == {QT.IQ2_XXS, QT.Q2_K, QT.Q4_K}
