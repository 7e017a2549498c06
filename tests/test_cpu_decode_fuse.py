"""Fewer, longer kernel calls in a decode step, and the serial ops compiled: the same bits.

A decode step's projections of one activation in one kernel call (ds4py.quant.jit_i8.matmul_many; the
reference's attention and FFN inputs, ds4py.ref.forward.x_products) against the one-matrix products they replace.

Every row runs the one-matrix decode kernel's float sequence (jit_decode.q8_0_rows / f16_rows), x quantised once
as jit_i8.matmul quantises it, so the results are the same bits as jit_i8.matmul (Q8_0) and jit.matmul (F16) on
each matrix: checked over matrix counts and mixes, row counts (odd, one row, empty pieces), row lengths (F16 any
length), token counts up to DECODE_ROWS, on the calling thread and on the pool at 2 and 3 threads. At model level
(ds4-tiny, ds4's numerics) the step gives the one-by-one products' logits bit for bit with fewer kernel calls.
The shared expert's down projection in the routed IQ2_XXS gate / up launch (jit_i8.experts_matmul's `plain`):
each product's bits. The compiled twins of ops.rmsnorm and ops.hc_collapse (ds4py.ref.ops_jit): numpy's bits.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4py.quant import jit, jit_i8

pytestmark = pytest.mark.skipif(not jit.available(), reason=f"numba unavailable: {jit.unavailable_reason()}")

F32 = np.float32


def _q8(rows, cols, rng):
    from test_fused import stored

    return stored(Q.Q8_0, rows, cols, rng)


def _f16(rows, cols, rng):
    return (rng.standard_normal((rows, cols)) * 0.1).astype(np.float16).view(np.uint8)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("pool", [False, True], ids=["serial", "pool"])
def test_one_call_gives_each_matrix_its_own_products_bit_for_bit(pool, threads, monkeypatch):
    if pool:                                       # every call on numba's pool
        monkeypatch.setattr(jit, "SERIAL_BYTES", 0)
    half = jit_i8._kernels() and jit_i8._tables["dec"].NATIVE_HALF
    cases = [([1, 3], [], 32, 1), ([37, 5, 64], [], 96, 3), ([2], [3], 64, 2), ([1, 1, 1, 1], [7, 1, 2, 9, 4, 33], 32, 1),
             ([], [5, 70], 100, 2), ([], [1, 2], 7, 1), ([130, 17], [40], 256, jit_i8.DECODE_ROWS),
             ([3], [2, 2, 2], 160, 5)]            # (Q8_0 rows of each, F16 rows of each, cols, tokens)
    for q8_rows, f16_rows, cols, tokens in cases:
        if f16_rows and not half:
            assert not jit_i8.many_supported(len(q8_rows), len(f16_rows), tokens)
            continue
        assert jit_i8.many_supported(len(q8_rows), len(f16_rows), tokens)
        rng = np.random.default_rng([cols, tokens, len(q8_rows), len(f16_rows)])
        q8 = [_q8(r, cols, rng) for r in q8_rows]
        h16 = [_f16(r, cols, rng) for r in f16_rows]
        x = (rng.standard_normal((tokens, cols)) * rng.uniform(0.1, 10, (tokens, 1))).astype(F32)
        yq, yh = jit_i8.matmul_many(q8, h16, x, threads)
        assert len(yq) == len(q8) and len(yh) == len(h16)
        for raw, y in zip(q8, yq):
            assert y.shape == (tokens, raw.shape[0]) and y.dtype == F32
            np.testing.assert_array_equal(y, jit_i8.matmul(Q.Q8_0, raw, x, 1))
        for raw, y in zip(h16, yh):
            assert y.shape == (tokens, raw.shape[0]) and y.dtype == F32
            np.testing.assert_array_equal(y, jit.matmul(Q.F16, raw, x, 1))


def test_what_one_call_takes():
    assert jit_i8.many_supported(2, 0, jit_i8.DECODE_ROWS)
    assert not jit_i8.many_supported(2, 0, jit_i8.DECODE_ROWS + 1)        # a prefill: the other kernels' bits
    dec = jit_i8._tables["dec"]
    assert not jit_i8.many_supported(dec.MANY_Q8 + 1, 0, 1)
    assert not jit_i8.many_supported(0, dec.MANY_F16 + 1, 1)
    plan = jit_i8.many_plan([_q8(3, 64, np.random.default_rng(0))], [], 64)
    with pytest.raises(ValueError, match="32 columns for matrices of 64"):
        jit_i8.many_run(plan, np.zeros((1, 32), F32))


@pytest.mark.parametrize("pool", [False, True], ids=["serial", "pool"])
def test_the_shared_down_with_the_routed_gate_and_up_gives_their_own_products(pool, monkeypatch):
    """experts_matmul's `plain` Q8_0 product (the shared expert's down) in the routed IQ2_XXS gate / up launch:
    each product's bits, over routings, token counts, odd row counts, 2 and 3 threads."""
    from test_fused import stored

    if pool:
        monkeypatch.setattr(jit, "SERIAL_BYTES", 0)
    for tokens, k, n_experts, rows, cols, rows8, cols8, threads in [
            (1, 6, 16, 20, 512, 64, 96, 2), (3, 2, 5, 7, 256, 1, 32, 3), (jit_i8.DECODE_ROWS, 4, 9, 33, 256, 130, 320, 2)]:
        rng = np.random.default_rng([tokens, k, rows8])
        gate = np.stack([stored(Q.IQ2_XXS, rows, cols, rng) for _ in range(n_experts)])
        up = np.stack([stored(Q.IQ2_XXS, rows, cols, rng) for _ in range(n_experts)])
        q8 = stored(Q.Q8_0, rows8, cols8, rng)
        x = rng.standard_normal((tokens, cols)).astype(F32)
        h = (rng.standard_normal((tokens, cols8)) * 3).astype(F32)
        idx = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(tokens)])
        order = np.argsort(idx, axis=None, kind="stable")
        e_of = idx.ravel()[order]
        gs = np.concatenate(([0], np.flatnonzero(np.diff(e_of)) + 1, [len(order)]))
        ex, tok = e_of[gs[:-1]], order // k
        assert jit_i8.plain_supported(Q.IQ2_XXS, 2, tokens)
        g, u, y8 = jit_i8.experts_matmul(Q.IQ2_XXS, (gate, up), ex, gs, tok, x, threads, plain=(q8, h))
        g0, u0 = jit_i8.experts_matmul(Q.IQ2_XXS, (gate, up), ex, gs, tok, x, threads)
        np.testing.assert_array_equal(g, g0)
        np.testing.assert_array_equal(u, u0)
        np.testing.assert_array_equal(y8, jit_i8.matmul(Q.Q8_0, q8, h, 1))
    assert not jit_i8.plain_supported(Q.Q2_K, 2, 1) and not jit_i8.plain_supported(Q.IQ2_XXS, 1, 1)
    assert not jit_i8.plain_supported(Q.IQ2_XXS, 2, jit_i8.DECODE_ROWS + 1)


def _steps(path, many: bool, chunks, monkeypatch):
    """Logits of a step over `chunks` then two one-token steps, and the kernel calls of the last step."""
    from ds4py.model import Numerics
    from ds4py.ref.engine import RefModel

    monkeypatch.setattr(jit, "SERIAL_BYTES", 0)        # the tiny model's matrices on the pool, as a real model's
    if not many:
        monkeypatch.setattr(jit_i8, "many_supported", lambda q8, f16, rows: False)
        monkeypatch.setattr(jit_i8, "plain_supported", lambda qtype, mats, rows: False)
    calls = []
    real = jit._call

    def counted(name, fn, args, threads, pool=True):
        calls.append(name)
        return real(name, fn, args, threads, pool)

    monkeypatch.setattr(jit, "_call", counted)
    m = RefModel(path, numerics=Numerics.ds4(), kernels="jit", threads=2)
    states = [m.new_state() for _ in chunks]
    out = [np.concatenate(m._step(states, chunks, True))]
    for t in (7, 120):
        calls.clear()
        out.append(np.concatenate(m._step(states, [np.array([t])] * len(chunks), True)))
    monkeypatch.undo()
    return out, list(calls)


@pytest.mark.parametrize("chunks", [[[3, 17, 250]], [[3, 17], [88, 41, 5]]], ids=["one", "two"])
def test_the_step_equals_the_one_by_one_products(golden, chunks, monkeypatch):
    """ds4-tiny (ds4's q2 layout: Q8_0 attention and shared expert, F16 router and compressors): the decode
    steps' logits are the one-by-one products' bits, with fewer kernel calls."""
    path = str(golden / "ds4-tiny" / "tiny.gguf")
    chunks = [np.array(c) for c in chunks]
    got, calls = _steps(path, True, chunks, monkeypatch)
    want, calls_before = _steps(path, False, chunks, monkeypatch)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert any("many" in c for c in calls) and not any("many" in c for c in calls_before)
    assert "q8_0_iq2_xxs_ex_dec" in calls and "q8_0_iq2_xxs_ex_dec" not in calls_before
    assert len(calls) < len(calls_before)


# ---- the serial ops' compiled twins (ds4py.ref.ops_jit.rmsnorm / hc_collapse): numpy's bits ---------------------
def _numpy_op(monkeypatch, fn, *args):
    from ds4py.ref import ops

    monkeypatch.setattr(ops, "_ops_jit", lambda: None)
    try:
        return fn(*args)
    finally:
        monkeypatch.undo()


def test_rmsnorm_is_the_numpy_ops_bits(monkeypatch):
    """Every row length up to 300 and the model's (pairwise sums of every depth), rows of one token, several, and
    per head ([T, H, hd]), with and without a weight, scales over 12 orders, an all-zero row, inf / NaN."""
    from ds4py.ref import ops, ops_jit

    assert jit.loaded() and ops._ops_jit() is ops_jit
    rng = np.random.default_rng(11)
    shapes = [(1, n) for n in range(1, 301)] + [(1, n) for n in (512, 1000, 1024, 1536, 4096, 4099, 7168, 16384)]
    shapes += [(3, 4096), (8, 1024), (1, 64, 512), (2, 8, 448), (5, 7, 33), (300, 16), (1000, 9), (128, 64),
               (40, 4, 130)]
    for shape in shapes:
        scale = 10.0 ** rng.uniform(-6, 6)
        x = (rng.standard_normal(shape) * scale).astype(F32)
        for weight in (None, (rng.standard_normal(shape[-1]) + 1).astype(F32)):
            got = ops.rmsnorm(x, weight, 1e-6)
            want = _numpy_op(monkeypatch, ops.rmsnorm, x, weight, 1e-6)
            assert got.dtype == F32 and got.shape == x.shape
            np.testing.assert_array_equal(got, want)
    x = rng.standard_normal((4, 256)).astype(F32)
    x[0] = 0
    x[1, 3], x[2, 7] = np.inf, np.nan
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(ops.rmsnorm(x, None, 1e-6), _numpy_op(monkeypatch, ops.rmsnorm, x, None, 1e-6))
    np.testing.assert_array_equal(ops.rmsnorm(x[:, ::2], None, 1e-6),             # a strided view
                                  _numpy_op(monkeypatch, ops.rmsnorm, x[:, ::2], None, 1e-6))


def test_hc_collapse_is_the_numpy_ops_bits(monkeypatch):
    from ds4py.ref import ops, ops_jit

    rng = np.random.default_rng(12)
    for n in range(1, ops_jit.MAX_N + 1):
        for T, D in ((1, 4096), (3, 37), (9, 256)):
            scale = 10.0 ** rng.uniform(-3, 3)
            X = (rng.standard_normal((T, n, D)) * scale).astype(F32)
            pre = rng.standard_normal((T, n)).astype(F32)
            got = ops.hc_collapse(X, pre)
            assert got.dtype == F32 and got.shape == (T, D)
            np.testing.assert_array_equal(got, _numpy_op(monkeypatch, ops.hc_collapse, X, pre))
