"""V4.1's DSpark kernels under the CPU emulator against their numpy twins (ds4py/cuda/twins/dspark.py): the sum
over the hc copies (the draft taps: the plain mean, written at a target's column offset; the block's pre-norm
hidden: the FFN pre-mix's collapse) and the greedy chain's add, bit for bit; and cu/prefill_attn.cu's block-keys
attention (every block query against the ring's window before the block and all block keys, no mask, sink,
inverse RoPE), forward, reverse and random thread order."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.ops import dspark as ops_dspark
from ds4py.cuda.ops import prefill_attn as ops_pfa
from ds4py.cuda.ops.attention import AttnKeys, AttnLayer
from ds4py.cuda.ops.prefill_attn import PrefillRows
from ds4py.cuda.twins import dspark as twin
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.errors import Ds4Error
from ds4py.ref import ops
from tests.cu_emu_device import devices

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")

ORDERS = ("forward", "reverse", "random")
EPS = 1e-6


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([41, *seed])


@pytest.mark.parametrize("order", ORDERS)
def test_taps_are_the_mean_over_the_copies_at_their_column_offset(kdev, order):
    T, hc, D, n_targets = 5, 4, 200, 3
    r = rng(T, D)
    dev = kdev(order, T)
    X = [(r.standard_normal((T, hc, D)) * 3).astype(np.float32) for _ in range(n_targets)]
    d_taps = dev.var(np.full((T, n_targets * D), np.nan, np.float32))
    for k, x in enumerate(X):
        y = d_taps.view(4 * k * D, (T - 1) * n_targets * D + D)         # target k's columns of every row
        ops_dspark.hc_sum(dev.rt, dev.const(x), T, D, ops_dspark.HcSum(y, 1.0 / hc, y_stride=n_targets * D), hc)
    want = np.concatenate([twin.hc_sum(x, None, 1.0 / hc) for x in X], axis=1)
    np.testing.assert_array_equal(d_taps.download(), want)
    np.testing.assert_array_equal(want, np.concatenate([x.mean(axis=1) for x in X], axis=1))   # the reference's


@pytest.mark.parametrize("order", ORDERS)
def test_hidden_is_the_pre_mix_collapse(kdev, order):
    T, hc, D, stride = 7, 4, 96, 24
    r = rng(T, D, 2)
    X = r.standard_normal((T, hc, D)).astype(np.float32)
    mix = r.standard_normal((T, stride)).astype(np.float32)
    dev = kdev(order, T)
    d_y = dev.var(np.full((T, D), np.nan, np.float32))
    ops_dspark.hc_sum(dev.rt, dev.const(X), T, D, ops_dspark.HcSum(d_y, 1.0, mix=dev.const(mix), mix_stride=stride), hc)
    np.testing.assert_array_equal(d_y.download(), twin.hc_sum(X, mix[:, :hc], 1.0))


@pytest.mark.parametrize("order", ORDERS)
def test_add(kdev, order):
    r = rng(3)
    a, b = (r.standard_normal(1000).astype(np.float32) for _ in range(2))
    dev = kdev(order, 1)
    out = dev.var(np.full(1000, np.nan, np.float32))
    ops_dspark.add(dev.rt, dev.const(a), dev.const(b), out, 1000)
    np.testing.assert_array_equal(out.download(), twin.add(a, b))


# hd, rd, heads, window, ring, t (the block's last main position), B, warps
CASES = [
    (64, 16, 4, 16, 19, 0, 5, 1),          # right after the first position: one ring row
    (64, 16, 4, 16, 19, 9, 5, 2),          # fewer ring rows than the window
    (128, 64, 12, 16, 24, 100, 5, 4),      # a full window, wrapped ring, 12 heads
    (512, 64, 8, 128, 144, 300, 7, 1),     # the real head dim; a longer block
]


def _case(case, seed=0):
    hd, rd, H, window, ring, t, B, warps = case
    r = rng(hd, H, t, B, seed)
    pos = np.arange(t + 1, t + 1 + B, dtype=np.int32)
    q_raw = (r.standard_normal((B, H, hd)) * 0.5).astype(np.float32)
    ring_a = r.standard_normal((ring, hd)).astype(np.float32)
    blk = r.standard_normal((B, hd)).astype(np.float32)
    sinks = r.standard_normal(H).astype(np.float32)
    return pos, q_raw, ring_a, blk, sinks, ops.rope_freqs(rd, 10000.0)


def _launch(dev, case, arrays):
    hd, rd, H, window, ring, t, B, warps = case
    pos, q_raw, ring_a, blk, sinks, freqs = arrays
    d_out = dev.var(np.full((B, H, hd), np.nan, np.float32))
    ops_pfa.prefill_attention(dev.rt,
                              AttnLayer(dev.const(freqs), dev.const(sinks), H, rd, window, EPS, hd ** -0.5, False),
                              AttnKeys(dev.const(ring_a)),
                              PrefillRows(dev.const(q_raw), dev.const(pos), dev.const(blk), d_out, B),
                              block_keys=True, warps=warps)
    return d_out.download()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hd{c[0]}-H{c[2]}-t{c[5]}-B{c[6]}")
@pytest.mark.parametrize("order", ORDERS)
def test_block_keys_attention(kdev, case, order):
    hd, rd, H, window, ring, t, B, warps = case
    arrays = _case(case)
    pos, q_raw, ring_a, blk, sinks, freqs = arrays
    out = _launch(kdev(order, B), case, arrays)
    want, mag, n_keys = twin.dspark_attention(q_raw, ring_a, blk, pos, window, sinks, freqs, H, rd, EPS, hd ** -0.5)
    assert n_keys == min(t + 1, window) + B
    assert_close_scaled(out, want, mag, n_keys + hd, f"dspark attention {case}")


def test_block_keys_see_the_whole_block_and_not_the_ring_slots_it_would_overwrite(kdev):
    """Controls: the causal prefill attention over the same arrays differs (the block is unmasked); changing the
    ring slot of position t - W (outside the window) changes nothing, changing position t's does."""
    case = (64, 16, 4, 16, 19, 30, 5, 2)
    hd, rd, H, window, ring, t, B, warps = case
    arrays = _case(case, 3)
    pos, q_raw, ring_a, blk, sinks, freqs = arrays
    dev = kdev("forward", B)
    out = _launch(dev, case, arrays)
    causal = dev.var(np.full((B, H, hd), np.nan, np.float32))
    ops_pfa.prefill_attention(dev.rt,
                              AttnLayer(dev.const(freqs), dev.const(sinks), H, rd, window, EPS, hd ** -0.5, False),
                              AttnKeys(dev.const(ring_a)),
                              PrefillRows(dev.const(q_raw), dev.const(pos), dev.const(blk), causal, B), warps=warps)
    assert np.abs(causal.download() - out).max() > 1e-3
    stale = ring_a.copy()
    stale[(t - window + 1 - 1) % ring] += 5.0     # position t - W: outside the window, its slot is no key
    assert (t - window) % ring not in {p % ring for p in range(t - window + 1, t + 1)}
    np.testing.assert_array_equal(_launch(dev, case, (pos, q_raw, stale, blk, sinks, freqs)), out)
    fresh = ring_a.copy()
    fresh[t % ring] += 5.0                         # position t: a key
    assert np.abs(_launch(dev, case, (pos, q_raw, fresh, blk, sinks, freqs)) - out).max() > 1e-3


def test_bad_launches_are_refused(kdev):
    dev = kdev("forward", 1)
    z = lambda s, dt=np.float32: dev.var(np.zeros(s, dt))   # noqa: E731
    with pytest.raises(Ds4Error, match="block keys take no compressed rows"):
        ops_pfa.prefill_attention(dev.rt, AttnLayer(z(8), z(4), 4, 16, 16, EPS, 0.125),
                                  AttnKeys(z((16, 64)), z((4, 64)), 4),
                                  PrefillRows(z((2, 4, 64)), z(2, np.int32), z((2, 64)), z((2, 4, 64)), 2),
                                  block_keys=True)
    with pytest.raises(Ds4Error, match="dspark_hc_sum: y too small"):
        ops_dspark.hc_sum(dev.rt, z((2, 4, 32)), 2, 32, ops_dspark.HcSum(z(40), 0.25))
