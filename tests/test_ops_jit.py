"""The decode step's host-side savings change no bits: the compiled twins of small reference ops (ds4py.ref.ops_jit)
give the numpy ops' bits (ops.sinkhorn's rounds over every mix size they take, token counts, round counts and
scales; larger mixes keep numpy's path), and BLAS on one thread in a decode step (ds4py.ref.blas) gives the
logits of OpenBLAS's own threads."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.quant import jit
from ds4py.ref import ops

pytestmark = pytest.mark.skipif(not jit.available(), reason=f"numba unavailable: {jit.unavailable_reason()}")

F32 = np.float32


def _numpy_sinkhorn(monkeypatch, C, iters, eps):
    monkeypatch.setattr(ops, "_ops_jit", lambda: None)
    try:
        return ops.sinkhorn(C, iters, eps)
    finally:
        monkeypatch.undo()


def test_numpy_adds_a_short_axis_first_to_last():
    """The order ops_jit replays (numpy's reduction of fewer than 8 values, along either axis of a mix)."""
    from ds4py.ref import ops_jit

    rng = np.random.default_rng(3)
    for n in range(1, ops_jit.MAX_N + 1):
        C = (rng.standard_normal((5000, n, n)) * rng.uniform(0, 1e3, (5000, n, n))).astype(F32)
        for axis in (-1, -2):
            a = np.moveaxis(C, axis, -1)
            seq = a[..., 0].copy()
            for k in range(1, n):
                seq += a[..., k]
            np.testing.assert_array_equal(C.sum(axis), seq)


@pytest.mark.parametrize("n", range(1, 9))
def test_sinkhorn_is_the_numpy_ops_bits(n, monkeypatch):
    from ds4py.ref import ops_jit

    assert jit.loaded() and ops._ops_jit() is ops_jit
    rng = np.random.default_rng(n)
    for T in (1, 2, 9):
        for iters in (1, 2, 20):
            for scale in (1e-3, 1.0, 30.0):
                C = (rng.standard_normal((T, n, n)) * scale).astype(F32)
                want = _numpy_sinkhorn(monkeypatch, C, iters, 1e-6)
                got = ops.sinkhorn(C, iters, 1e-6)
                assert got.dtype == F32 and got.shape == C.shape
                np.testing.assert_array_equal(got, want)


def test_hc_post_is_the_numpy_ops_bits(monkeypatch):
    """The compiled hc_post against numpy's expression (the sum over the copies, axis 1 of a 4-D product, first
    to last), every copy count it takes, odd widths, token counts, scales; non-float32 inputs keep numpy."""
    from ds4py.ref import ops_jit

    assert jit.loaded() and ops._ops_jit() is ops_jit
    rng = np.random.default_rng(17)
    for n in range(1, ops_jit.MAX_N + 1):
        for T, D in ((1, 64), (3, 37), (9, 256)):
            scale = rng.uniform(1e-3, 1e3)
            f = (rng.standard_normal((T, D)) * scale).astype(F32)
            X = (rng.standard_normal((T, n, D)) * scale).astype(F32)
            post = rng.standard_normal((T, n)).astype(F32)
            comb = rng.standard_normal((T, n, n)).astype(F32)
            got = ops.hc_post(f, X, post, comb)
            monkeypatch.setattr(ops, "_ops_jit", lambda: None)
            want = ops.hc_post(f, X, post, comb)
            monkeypatch.undo()
            assert got.dtype == F32 and got.shape == (T, n, D)
            np.testing.assert_array_equal(got, want)
    f64 = ops.hc_post(f.astype(np.float64), X, post, comb)                  # another dtype: numpy's own
    assert f64.dtype == np.float64


def test_a_decode_step_runs_blas_on_one_thread_and_puts_it_back():
    from ds4py.ref import blas

    api = blas._lookup()
    if api is None:
        pytest.skip("no OpenBLAS among the loaded libraries")
    get, put = api
    before = get()
    put(2)
    try:
        with blas.single_threaded():
            assert get() == 1
        assert get() == 2
        with blas.single_threaded(False):
            assert get() == 2
    finally:
        put(before)


def test_the_logits_do_not_depend_on_blas_threads(golden, monkeypatch):
    """ds4-tiny in ds4's numerics on the compiled kernels: the same logits with BLAS on one thread in decode steps
    (the default) as with OpenBLAS's own threads, prefill then decode."""
    from contextlib import nullcontext

    from ds4py.model import Numerics
    from ds4py.ref import blas, forward
    from ds4py.ref.engine import RefModel

    def run():
        m = RefModel(str(golden / "ds4-tiny" / "tiny.gguf"), numerics=Numerics.ds4(), kernels="jit", threads=2)
        st = m.new_state()
        out = [m.prefill(st, [3, 17, 250, 9])]
        return out + [m.decode(st, t) for t in (88, 41, 5)]

    api = blas._lookup()
    before = api[0]() if api else None
    if api:
        api[1](2)
    try:
        want = run()
        monkeypatch.setattr(forward.blas, "single_threaded", lambda on=True: nullcontext())
        got = run()
    finally:
        if api:
            api[1](before)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)


def _load_twins():
    """The compiled kernels loaded (ops uses its twins only then), as a decode step has them."""
    from ds4py.quant import jit_i8

    jit_i8._kernels()
    assert ops._ops_jit() is not None


def _numpy_op(monkeypatch, fn, *args, **kw):
    """fn on numpy's path (no compiled twins)."""
    monkeypatch.setattr(ops, "_ops_jit", lambda: None)
    try:
        return fn(*args, **kw)
    finally:
        monkeypatch.undo()


def _same_bits(a, b):
    assert a.dtype == b.dtype == F32 and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("block", [32, 64])
def test_fp8_fake_quant_is_the_numpy_ops_bits(block, monkeypatch):
    """Every scale from subnormal to the e4m3 range and past it, zero and tiny blocks (the 1e-4 floor), exact
    powers of two (frexp's 0.5 mantissa), ties of the rounding, signed zeros, strided and 3-d inputs; a non-finite
    block takes numpy's path."""
    _load_twins()
    rng = np.random.default_rng(block)
    for scale in [1e-42, 1e-30, 1e-6, 1e-4, 3e-3, 1, 7, 448, 1e4, 3e30]:
        x = (rng.standard_normal((5, 7 * block)) * scale).astype(F32)
        x[1, :block] = 0
        x[1, block] = -0.0
        x[2, :block] = np.float32(2.0) ** rng.integers(-10, 10, block)          # powers of two
        x[3, :block] = (rng.integers(-64, 64, block) + 0.5) * np.float32(2.0 ** -4)   # ties
        x[4, :block] = rng.standard_normal(block).astype(F32) * np.float32(1e-5)
        for y in (x, x[:, :5 * block], x[::2], x.reshape(5, 7, block)[:, 1:4].reshape(5, 3 * block),
                  x.reshape(5, 7, block)):
            _same_bits(ops.fp8_fake_quant(y, block), _numpy_op(monkeypatch, ops.fp8_fake_quant, y, block))
    x = rng.standard_normal((3, 2 * block)).astype(F32)
    x[0, 3], x[1, block + 1] = np.nan, np.inf
    got, want = ops.fp8_fake_quant(x, block), _numpy_op(monkeypatch, ops.fp8_fake_quant, x, block)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_is_the_numpy_ops_bits(inverse, monkeypatch):
    """Query-like [T, H, d] and key-like [T, d] rows, one and several tokens, positions up to 2^20, the plain and
    YaRN frequencies of a real-width layer, float16 and Fortran-ordered input, a rope part as wide as the row."""
    from ds4py.host.rope import rope_freqs

    _load_twins()
    rng = np.random.default_rng(int(inverse))
    plain = rope_freqs(64, 10000.0)
    yarn = rope_freqs(64, 160000.0, 16.0, 65536, 32.0, 1.0)
    for freqs in (plain, yarn):
        for shape in [(1, 64, 512), (3, 512), (5, 8, 64), (1, 64), (2, 3, 4, 64)]:
            x = (rng.standard_normal(shape) * 3).astype(F32)
            pos = rng.integers(0, 1 << 20, shape[0])
            for y in (x, x.astype(np.float16), np.asfortranarray(x)):
                _same_bits(ops.rope_tail(y, pos, freqs, inverse),
                           _numpy_op(monkeypatch, ops.rope_tail, y, pos, freqs, inverse))


def test_hc_coeffs_is_the_numpy_ops_bits(monkeypatch):
    """ops.hc_coeffs with its twins around the GEMV (the mixes' scaling, the affines, the comb rows' max, one numpy
    exp for all, the sigmoids and the Sinkhorn rounds) against numpy's expressions: every copy count the twins take,
    token counts, per-sequence products, scales up to exp's overflow, NaN / inf in the state; a copy count beyond
    them and another dtype keep numpy's path."""
    from ds4py.ref import ops_jit

    assert jit.loaded() and ops._ops_jit() is ops_jit
    rng = np.random.default_rng(29)

    def both(*args, **kw):
        got = ops.hc_coeffs(*args, **kw)
        want = _numpy_op(monkeypatch, ops.hc_coeffs, *args, **kw)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
        return got

    for n in range(1, ops_jit.MAX_N + 2):
        for T, D in ((1, 64), (3, 40), (5, 128)):
            for sc in (1e-3, 1.0, 1e4):
                X = (rng.standard_normal((T, n, D)) * sc).astype(F32)
                fn = (rng.standard_normal((n * (2 + n), n * D)) * 0.2).astype(F32)
                scale = rng.uniform(0.01, 300, 3).astype(F32)
                base = rng.standard_normal(n * (2 + n)).astype(F32)
                seg = [slice(0, 1), slice(1, T)] if T > 1 else None
                both(X, fn, scale, base, 1e-6, 1e-6, 20, seg)
    X[0, 0, 3], X[-1, -1, 0] = np.inf, np.nan                                # non-finite states: numpy's NaNs
    both(X, fn, scale, base, 1e-6, 1e-6, 20)
    X = (rng.standard_normal((2, 4, 64))).astype(F32)
    fn = (rng.standard_normal((24, 256)) * 0.2).astype(F32)
    fn[0, :], fn[9, 5] = 1e30, -np.inf                                          # exp overflows, a NaN comb row
    both(X, fn, scale, np.zeros(24, F32), 1e-6, 1e-6, 3)
    both(X.astype(np.float64), fn, scale, np.zeros(24, F32), 1e-6, 1e-6, 3)     # another dtype: numpy's own


def test_swiglu_hidden_and_grouped_adds_are_the_numpy_ops_bits(monkeypatch):
    """ops.swiglu_hidden's twins (clamps, silu around numpy's exp, the pair weights) and ops.add_rows_grouped
    (forward._routed_run's per-expert `y[tok] += d`, a repeated row keeping its last write as numpy's does)
    against numpy's expressions: clamps on and off, values past the clamp and exp's overflow, NaN / inf."""
    rng = np.random.default_rng(31)
    for N, F in ((1, 64), (6, 130), (9, 2048)):
        for clamp in (0.0, 10.0):
            g = (rng.standard_normal((N, F)) * rng.uniform(0.1, 200)).astype(F32)
            u = (rng.standard_normal((N, F)) * rng.uniform(0.1, 200)).astype(F32)
            g[0, :4], u[0, 4:8] = (np.nan, np.inf, -np.inf, -100.0), (np.nan, -np.inf, np.inf, -0.0)
            wt = rng.uniform(0, 2, N).astype(F32)
            for weight in (None, wt):
                _same_bits(ops.swiglu_hidden(g, u, clamp, weight),
                           _numpy_op(monkeypatch, ops.swiglu_hidden, g, u, clamp, weight))
    for T, pairs in ((1, 6), (4, 30)):
        y = rng.standard_normal((T, 96)).astype(F32)
        d = (rng.standard_normal((pairs, 96)) * 10).astype(F32)
        tok = rng.integers(0, T, pairs)
        gs = np.unique(np.concatenate(([0, pairs], rng.integers(1, pairs, 3))))
        tok[1] = tok[0]                                                # a row twice in one group
        d[2, 5] = np.nan
        _same_bits(ops.add_rows_grouped(y.copy(), d, tok, gs),
                   _numpy_op(monkeypatch, ops.add_rows_grouped, y.copy(), d, tok, gs))
