"""The numpy twins the GPU kernels (and the CPU emulator) are checked against."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import twins


def test_q8_0_twin_matches_the_quant_module():
    simple = pytest.importorskip("ds4py.quant.simple")
    x = np.random.default_rng(0).standard_normal(32 * 40).astype(np.float32) * 3
    raw = twins.quant_q8_0(x)
    assert raw.tobytes() == simple.quant_q8_0(x).tobytes()
    np.testing.assert_array_equal(twins.dequant_q8_0(raw), simple.dequant_q8_0(raw.reshape(-1)).reshape(-1))
    assert np.abs(twins.dequant_q8_0(raw) - x).max() <= np.abs(x).max() / 127


def _exact_dot(W, x) -> np.ndarray:
    """Row-by-row dot products summed exactly (math.fsum of exact float64 products), rounded once to float32:
    an independent oracle, not the twins' own matmul."""
    import math

    W, x = np.asarray(W, np.float64), np.asarray(x, np.float64)
    return np.array([math.fsum(float(a) * float(b) for a, b in zip(row, x)) for row in W], np.float32)


def test_gemv_twins():
    """The GEMV twins against an exact oracle: the Q8_0 matrix decoded by ds4py.quant (an independent decoder)
    and exact sums; the twins round once from float64, so they match to within one float32 step."""
    from ds4py.quant import dequantize
    from gguf import GGMLQuantizationType as Q

    r = np.random.default_rng(1)
    W = r.standard_normal((5, 64)).astype(np.float32)
    x = r.standard_normal(64).astype(np.float32)
    raw = twins.quant_q8_0(W).reshape(5, -1)
    Wq = dequantize(raw.reshape(5, -1), Q.Q8_0, (5, 64))
    np.testing.assert_array_equal(twins.q8_0_matrix(raw, 5, 64), Wq)
    np.testing.assert_allclose(twins.gemv_q8_0(raw, x, 5, 64), _exact_dot(Wq, x), rtol=2 ** -23, atol=1e-30)
    W16 = W.astype(np.float16)
    np.testing.assert_allclose(twins.gemv_f16(W16, x), _exact_dot(W16, x), rtol=2 ** -23, atol=1e-30)
    # a known answer: one Q8_0 block with d = 0.5 and q = 1..32, times x = 1: 0.5 * (1 + ... + 32) = 264
    blk = np.zeros((1, 34), np.uint8)
    blk[0, :2] = np.array([0.5], np.float16).view(np.uint8)
    blk[0, 2:] = np.arange(1, 33, dtype=np.int8).view(np.uint8)
    assert twins.gemv_q8_0(blk, np.ones(32, np.float32), 1, 32)[0] == 264.0
    assert twins.gemv_f16(np.full((1, 3), 0.25, np.float16), np.array([4, 8, -2], np.float32))[0] == 2.5


def test_rmsnorm_twin():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    y = twins.rmsnorm(x, np.array([1.0, 2.0], np.float32), 0.0 + 1e-20)
    r = 1 / np.sqrt(12.5)
    np.testing.assert_allclose(y[0], [3 * r, 8 * r], rtol=1e-6)
    assert np.all(y[1] == 0)


def test_embed_and_argmax_twins():
    t = np.arange(12, dtype=np.float16).reshape(4, 3)
    out = twins.embed_f16(t, np.array([2, -1, 4, 0]))
    np.testing.assert_array_equal(out[0], [6, 7, 8])
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
    assert twins.argmax(np.array([1, 5, 5, 2], np.float32)) == 1
    assert twins.argmax(np.array([1, np.nan, 9, np.nan], np.float32)) == 1


def test_tolerance_can_fail():
    ref = np.ones(100, np.float32)
    twins.assert_close_scaled(ref * (1 + 1e-7), ref, 1.0, 100)
    with pytest.raises(AssertionError, match="1 of 100"):
        bad = ref.copy()
        bad[7] += 1e-3
        twins.assert_close_scaled(bad, ref, 1.0, 100, "x")
    with pytest.raises(AssertionError):
        twins.assert_close_scaled(np.full(3, np.nan), np.zeros(3), 1.0, 3)
