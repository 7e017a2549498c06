"""The numpy twins the kernels are checked against (ds4py/cuda/twins): each one the reference's math
(ds4py/ref/ops.py, ds4py/quant) plus the kernel's own layout; checked here without any kernel."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import twins
from ds4py.cuda.twins import gemv as tg
from ds4py.cuda.twins import mhc as tm
from ds4py.cuda.twins import sample as ts
from ds4py.ref import ops as ref


def test_q8_0_round_trip():
    x = np.random.default_rng(0).standard_normal(32 * 40).astype(np.float32) * 3
    raw = twins.quant_q8_0(x)
    assert raw.shape == (40, 34)
    assert np.abs(twins.dequant_q8_0(raw) - x).max() <= np.abs(x).max() / 127


def _exact_dot(W, x) -> np.ndarray:
    """Row-by-row dot products summed exactly (math.fsum of exact float64 products), rounded once to float32:
    an independent oracle, not the twins' own matmul."""
    import math

    W, x = np.asarray(W, np.float64), np.asarray(x, np.float64)
    return np.array([math.fsum(float(a) * float(b) for a, b in zip(row, x)) for row in W], np.float32)


def test_gemv_twin_forms():
    """The GEMV twin against independent oracles: the Q8_0 matrix decoded by ds4py.quant (not the twin's decoder)
    and exact sums (the twin rounds once from float64: within one float32 step), known answers, then its forms
    (grouped inputs, the norm prologue, the SwiGLU epilogue) against plain numpy and ref.ops."""
    from gguf import GGMLQuantizationType as Q

    from ds4py.quant import dequantize

    r = np.random.default_rng(1)
    W = r.standard_normal((8, 64)).astype(np.float32)
    x = r.standard_normal(64 * 2).astype(np.float32)
    raw = twins.quant_q8_0(W).reshape(8, -1)
    Wq = dequantize(raw, Q.Q8_0, (8, 64))
    np.testing.assert_array_equal(twins.q8_0_matrix(raw, 8, 64), Wq)
    np.testing.assert_allclose(tg.gemv(raw, x, 8, 64), _exact_dot(Wq, x[:64]), rtol=2 ** -23, atol=1e-30)
    W16 = W.astype(np.float16)
    np.testing.assert_allclose(twins.gemv_f16(W16, x[:64]), _exact_dot(W16, x[:64]), rtol=2 ** -23, atol=1e-30)
    blk = np.zeros((1, 34), np.uint8)          # d = 0.5, q = 1..32, x = 1: 0.5 * (1 + ... + 32) = 264
    blk[0, :2] = np.array([0.5], np.float16).view(np.uint8)
    blk[0, 2:] = np.arange(1, 33, dtype=np.int8).view(np.uint8)
    assert tg.gemv(blk, np.ones(32, np.float32), 1, 32)[0] == 264.0
    assert twins.gemv_f16(np.full((1, 3), 0.25, np.float16), np.array([4, 8, -2], np.float32))[0] == 2.5
    grouped = tg.gemv(W, x, 8, 64, x_group_rows=4)
    np.testing.assert_allclose(grouped, np.concatenate([W[:4] @ x[:64], W[4:] @ x[64:]]), rtol=1e-5)
    w = r.random(64).astype(np.float32)
    np.testing.assert_allclose(tg.gemv(W, x, 8, 64, norm=(w, 1e-6)), W @ ref.rmsnorm(x[:64], w, 1e-6), rtol=1e-5)
    g, u = np.array([-20.0, 0.5, 30.0], np.float32), np.array([-40.0, 2.0, 3.0], np.float32)
    np.testing.assert_allclose(tg.swiglu(g, u, 10.0), ref.silu(np.minimum(g, 10)) * np.clip(u, -10, 10))


def test_mhc_twin_is_the_reference():
    """The mix record reproduces ref.ops.hc_pre exactly (same float32 operations), hc_post and hc_head too."""
    r = np.random.default_rng(6)
    X = r.standard_normal((3, 4, 24)).astype(np.float32)
    fn = (0.05 * r.standard_normal((24, 96))).astype(np.float32)
    scale, base = (0.5 + r.random(3)).astype(np.float32), (0.3 * r.standard_normal(24)).astype(np.float32)
    mix = tm.hc_mix(X, fn, scale, base, 1e-6, 1e-6, 20)
    x, post, comb = ref.hc_pre(X, fn, scale, base, 1e-6, 1e-6, 20)
    np.testing.assert_array_equal((mix[:, :4, None] * X).sum(1), x)
    np.testing.assert_array_equal(mix[:, 4:8], post)
    np.testing.assert_array_equal(mix[:, 8:].reshape(-1, 4, 4), comb)
    f = r.standard_normal((3, 24)).astype(np.float32)
    np.testing.assert_array_equal(tm.hc_post(f, X, mix), ref.hc_post(f, X, post, comb))
    head = tm.hc_mix(X, fn[:4], scale[:1], base[:4], 1e-6, 1e-6, 20)
    np.testing.assert_array_equal((head[:, :4, None] * X).sum(1), ref.hc_head(X, fn[:4], scale[:1], base[:4],
                                                                               1e-6, 1e-6))


def test_rmsnorm_twin():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    y = twins.rmsnorm(x, np.array([1.0, 2.0], np.float32), 1e-20)
    r = 1 / np.sqrt(12.5)
    np.testing.assert_allclose(y[0], [3 * r, 8 * r], rtol=1e-6)
    assert np.all(y[1] == 0)


def test_embed_and_argmax_twins():
    t = np.arange(12, dtype=np.float16).reshape(4, 3)
    out = twins.embed_f16(t, np.array([2, -1, 4, 0]))
    np.testing.assert_array_equal(out[0], [6, 7, 8])
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
    assert twins.embed_f16(t, np.array([1]), copies=4).shape == (1, 4, 3)
    assert twins.argmax(np.array([1, 5, 5, 2], np.float32)) == 1
    assert twins.argmax(np.array([1, np.nan, 9, np.nan], np.float32)) == 1


def test_sample_twin_draw():
    """With equal logits the fixed-point draw is floor(u * n) in the kernel's walk order."""
    n, threads = 10, 4
    keep = np.ones(n, bool)
    order = [i for t in range(threads - 1, -1, -1) for i in range(t, n, threads)]
    for pos in range(20):
        u = ts.philox_u64(5, pos)
        assert ts.draw(np.zeros(n, np.float32), keep, 1.0, 5, pos, threads) == order[(n * u) >> 64]
    assert ts.kept(np.array([0.0, 1.0, 1.0, -2.0], np.float32), ts.params(1.0, top_k=2)).tolist() == \
        [False, True, True, False]


def test_tolerance_can_fail():
    ref_ = np.ones(100, np.float32)
    twins.assert_close_scaled(ref_ * (1 + 1e-7), ref_, 1.0, 100)
    with pytest.raises(AssertionError, match="1 of 100"):
        bad = ref_.copy()
        bad[7] += 1e-3
        twins.assert_close_scaled(bad, ref_, 1.0, 100, "x")
    with pytest.raises(AssertionError):
        twins.assert_close_scaled(np.full(3, np.nan), np.zeros(3), 1.0, 3)
