"""ds4py.ref.ops against independent definitions (value tables, naive loops, stated properties)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.quant.official import E2M1, E4M3
from ds4py.ref import ops

rng = np.random.default_rng(0)


def nearest_even(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Nearest representable value; ties to the code with an even mantissa (the smaller code index)."""
    vals = np.unique(table[np.isfinite(table)])
    i = np.abs(x[:, None] - vals[None, :]).argmin(1)      # argmin picks the lower value on an exact tie
    return vals[i]


def test_round_e4m3_is_nearest_value():
    x = np.concatenate([rng.normal(0, 50, 20000), rng.normal(0, 0.01, 5000)]).astype(np.float32)
    x = np.clip(x, -448, 448)
    got = ops.round_e4m3(x)
    want = nearest_even(x, E4M3)
    ok = got == want
    # exact ties (x halfway between two codes) may legitimately go to the upper even code
    tie = np.isclose(np.abs(x - want), np.abs(x - got))
    assert (ok | tie).all()


def test_round_e2m1_grid_and_ties():
    x = np.linspace(-6, 6, 4801).astype(np.float32)
    got = ops.round_e2m1(x)
    assert set(np.unique(np.abs(got))) <= set(np.abs(E2M1))
    assert np.all(np.abs(got - x) <= np.abs(nearest_even(x, E2M1) - x) + 1e-7)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    assert ops.round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_fp8_fake_quant_scale_and_blocks():
    x = rng.normal(0, 3, (5, 128)).astype(np.float32)
    y = ops.fp8_fake_quant(x, 64)
    for blk in range(2):
        xb, yb = x[:, 64 * blk:64 * blk + 64], y[:, 64 * blk:64 * blk + 64]
        s = 2.0 ** np.ceil(np.log2(np.abs(xb).max(1) / 448))
        q = yb / s[:, None]
        assert np.isin(q, E4M3).all()                                    # every value is an e4m3 code × scale
        assert np.all(np.abs(yb - xb) <= np.abs(xb) * 2 ** -4 + s[:, None] * 2 ** -9)


def test_fp4_fake_quant_values():
    x = rng.normal(0, 1, (3, 64)).astype(np.float32)
    y = ops.fp4_fake_quant(x, 32).reshape(3, 2, 32)
    s = 2.0 ** np.ceil(np.log2(np.abs(x.reshape(3, 2, 32)).max(-1) / 6))
    assert np.isin(y / s[..., None], E2M1).all()


def test_hadamard_matches_definition():
    n = 16
    i = np.arange(n)
    want = np.array([[(-1) ** bin(a & b).count("1") for b in i] for a in i]) / np.sqrt(n)
    np.testing.assert_allclose(ops.hadamard_matrix(n), want, atol=1e-7)
    x = rng.normal(size=(4, 128)).astype(np.float32)
    np.testing.assert_allclose(ops.hadamard(ops.hadamard(x)), x, atol=1e-5)     # orthonormal + symmetric


def test_rope_inverse_and_norm():
    freqs = ops.rope_freqs(64, 160000.0, 16.0, 65536, 32, 1)
    x = rng.normal(size=(7, 3, 64)).astype(np.float32)
    pos = np.arange(100, 107)
    y = ops.rope(x, pos, freqs)
    np.testing.assert_allclose(ops.rope(y, pos, freqs, inverse=True), x, atol=1e-5)
    pair = lambda a: np.hypot(a[..., 0::2], a[..., 1::2])                       # noqa: E731
    np.testing.assert_allclose(pair(y), pair(x), rtol=1e-5)
    np.testing.assert_allclose(ops.rope(x, np.zeros(7, int), freqs), x)


def test_yarn_ramp_bounds_full_size():
    """MODEL.md §2.3: for rd 64, base 160000, 65536 original context the ramp runs from 15 to 25."""
    plain = ops.rope_freqs(64, 160000.0)
    yarn = ops.rope_freqs(64, 160000.0, 16.0, 65536, 32, 1)
    np.testing.assert_allclose(yarn[:16], plain[:16], rtol=1e-6)               # i <= 15: unscaled
    np.testing.assert_allclose(yarn[25:], plain[25:] / 16, rtol=1e-6)          # i >= 25: divided by 16
    assert np.all((yarn[16:25] < plain[16:25]) & (yarn[16:25] > plain[16:25] / 16))


def test_sinkhorn_doubly_stochastic():
    C = ops.sinkhorn(rng.normal(size=(5, 4, 4)).astype(np.float32), 20, 1e-6)
    np.testing.assert_allclose(C.sum(-2), 1, atol=1e-4)
    np.testing.assert_allclose(C.sum(-1), 1, atol=2e-3)


def test_compress_pool_overlap_naive():
    ratio, d, G = 4, 8, 3
    kv = rng.normal(size=(G * ratio, 2 * d)).astype(np.float32)
    sc = rng.normal(size=(G * ratio, 2 * d)).astype(np.float32)
    got = ops.compress_pool(kv, sc, ratio, True)
    for g in range(G):
        for ch in range(d):
            slots_kv = [kv[g * ratio + r, d + ch] for r in range(ratio)]
            slots_sc = [sc[g * ratio + r, d + ch] for r in range(ratio)]
            if g > 0:
                slots_kv += [kv[(g - 1) * ratio + r, ch] for r in range(ratio)]
                slots_sc += [sc[(g - 1) * ratio + r, ch] for r in range(ratio)]
            w = np.exp(np.array(slots_sc) - max(slots_sc))
            assert got[g, ch] == pytest.approx(float((w / w.sum()) @ np.array(slots_kv)), rel=1e-5, abs=1e-6)


def test_attention_with_sink_naive():
    T, H, hd, N = 3, 2, 8, 5
    q = rng.normal(size=(T, H, hd)).astype(np.float32)
    kv = rng.normal(size=(N, hd)).astype(np.float32)
    mask = rng.random((T, N)) < 0.6
    mask[:, 0] = True
    sink = rng.normal(size=H).astype(np.float32)
    got = ops.attention_with_sink(q, kv, mask, sink, hd ** -0.5)
    for t in range(T):
        for h in range(H):
            s = np.array([q[t, h] @ kv[n] / np.sqrt(hd) for n in range(N) if mask[t, n]])
            v = kv[mask[t]]
            e = np.exp(s)
            np.testing.assert_allclose(got[t, h], (e @ v) / (e.sum() + np.exp(sink[h])), rtol=1e-5, atol=1e-6)


def test_swiglu_clamp():
    x = rng.normal(size=(2, 16)).astype(np.float32) * 10
    w1, w3 = rng.normal(size=(8, 16)).astype(np.float32), rng.normal(size=(8, 16)).astype(np.float32)
    w2 = rng.normal(size=(16, 8)).astype(np.float32)
    g, u = np.minimum(x @ w1.T, 10), np.clip(x @ w3.T, -10, 10)
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(ops.swiglu(x, w1, w3, w2, 10.0), (g / (1 + np.exp(-g)) * u) @ w2.T, rtol=1e-4)
