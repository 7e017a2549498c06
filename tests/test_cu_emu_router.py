"""cu/router.cu under the CPU emulator against its twin (ref/forward.route's math): biased top-k with stable ties,
hash routing from the device token id (bad ids visible as -1 / NaN), weight normalisation, in every thread order.
Expert ids must match exactly; weights within a few ulp (the kernel's expf / log1pf are not numpy's)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.ops import router as ops_route
from ds4py.cuda.ops.router import Router
from ds4py.cuda.twins import router as twin
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.cuda.ops.experts import Slots
from ds4py.errors import Ds4Error
from tests.cu_emu_device import devices

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")

ORDERS = ("forward", "reverse", "random")


def run(dev, n_experts, k, logits, bias, tid2eid=None, token=None, scale=1.5, norm=True):
    ids, w = dev.var(np.full(k, -9, np.int32)), dev.var(np.full(k, np.nan, np.float32))
    tok = None if token is None else dev.const(np.array([token], np.int32))
    ops_route.moe_route(dev.rt, Router(dev.const(bias), dev.const(tid2eid), n_experts, k, scale, norm),
                        dev.const(logits), tok,
                        Slots(ids, w, Router(dev.const(bias), dev.const(tid2eid), n_experts, k, scale, norm).k))
    return ids.download(), w.download()


@pytest.mark.parametrize("n_experts,k", [(256, 6), (16, 6), (8, 3), (384, 6), (1000, 32), (33, 1)])
@pytest.mark.parametrize("biased,norm", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("order", ORDERS)
def test_route_topk(kdev, n_experts, k, biased, norm, order):
    r = np.random.default_rng([n_experts, k, biased, norm])
    logits = (r.standard_normal(n_experts) * 3).astype(np.float32)
    bias = (r.standard_normal(n_experts) * 0.5).astype(np.float32) if biased else None
    ids, w = run(kdev(order, k), n_experts, k, logits, bias, norm=norm)
    want_ids, want_w = twin.route(logits, bias, None, 0, k, 1.5, norm)
    np.testing.assert_array_equal(ids, want_ids)
    assert_close_scaled(w, want_w, np.abs(want_w), 4 * k, "route weights")


def test_route_ties_pick_the_lower_index(kdev):
    logits = np.zeros(64, np.float32)
    logits[[5, 9, 40, 41]] = 2.0
    logits[63] = np.nan                                  # never chosen ahead of a number
    ids, w = run(kdev(), 64, 6, logits, None)
    np.testing.assert_array_equal(ids, [5, 9, 40, 41, 0, 1])
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(ids, twin.route(logits, None, None, 0, 6, 1.5, True)[0])


@pytest.mark.parametrize("order", ORDERS)
def test_route_hash_layers(kdev, order):
    r = np.random.default_rng(3)
    n_experts, k, vocab = 16, 6, 50
    logits = r.standard_normal(n_experts).astype(np.float32)
    table = r.integers(0, n_experts, (vocab, k)).astype(np.int32)
    table[7, 2] = 99                                     # a corrupt table entry
    bias = np.full(n_experts, 100.0, np.float32)         # ignored on hash layers
    dev = kdev(order, 3)
    for token in (0, 13, vocab - 1):
        ids, w = run(dev, n_experts, k, logits, bias, table, token)
        want_ids, want_w = twin.route(logits, None, table, token, k, 1.5, True)
        np.testing.assert_array_equal(ids, want_ids)
        assert_close_scaled(w, want_w, np.abs(want_w), 4 * k, "hash route weights")
    ids, w = run(dev, n_experts, k, logits, bias, table, 7)
    assert ids[2] == -1 and np.isnan(w).all()            # the bad id poisons the weights, never a wild read
    ids, w = run(dev, n_experts, k, logits, bias, table, vocab)
    assert np.all(ids == -1) and np.isnan(w).all()       # an out-of-range token


def test_route_wrapper_rejects_bad_shapes():
    rt = None                                            # rejected before any launch
    z = np.zeros
    with pytest.raises(Ds4Error, match="experts"):
        ops_route.moe_route(rt, Router(None, None, 8, 9, 1.5), z(8, np.float32), None,
                            Slots(z(9, np.int32), z(9, np.float32), Router(None, None, 8, 9, 1.5).k))
    with pytest.raises(Ds4Error, match="tid2eid"):
        ops_route.moe_route(rt, Router(None, z((5, 4), np.int32), 8, 6, 1.5), z(8, np.float32), z(1, np.int32),
                            Slots(z(6, np.int32), z(6, np.float32), Router(None, z((5, 4), np.int32), 8, 6, 1.5).k))


@pytest.mark.parametrize("temp,eps", [(1.7, 1e-20), (1.0, 1e-20)])
def test_route_gate_temperature(kdev, temp, eps):
    """V4.1: logits / gate_temp, weights / (sum + 1e-20): the twin's ids and weights, exactly."""
    r = np.random.default_rng([41, int(temp * 10)])
    logits = (r.standard_normal(16) * 3).astype(np.float32)
    bias = (r.standard_normal(16) * 0.5).astype(np.float32)
    dev = kdev("random", 1)
    ids, w = dev.var(np.full(4, -9, np.int32)), dev.var(np.full(4, np.nan, np.float32))
    ops_route.moe_route(dev.rt, Router(dev.const(bias), None, 16, 4, 1.5, True, gate_temp=temp, norm_eps=eps),
                        dev.const(logits), None,
                        Slots(ids, w, Router(dev.const(bias), None, 16, 4, 1.5, True, gate_temp=temp, norm_eps=eps).k))
    want_ids, want_w = twin.route(logits, bias, None, 0, 4, 1.5, True, temp, eps)
    np.testing.assert_array_equal(ids.download(), want_ids)
    np.testing.assert_array_equal(w.download(), want_w)
