"""A layer's routed experts in one kernel call per projection (ds4py.quant.jit_i8.experts_matmul; the reference's
MoE for a decode step, ds4py.ref.forward.routed_batched) against the per-expert products it replaces.

Every (pair, row) runs the per-expert decode kernel's float sequence, so the results are the same bits as
jit_i8.matmul on each expert's rows: checked over expert counts, routings (an expert taking several rows, a row
several experts), row lengths (multiples of each format's block), odd output row counts, one and two matrices,
on the calling thread and on the pool. At model level (ds4-tiny, ds4's numerics) the batched MoE gives the
per-expert loop's logits and trace bit for bit, one sequence and a batch of two.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from ds4py.quant import jit, jit_i8

pytestmark = pytest.mark.skipif(not jit.available(), reason=f"numba unavailable: {jit.unavailable_reason()}")

F32 = np.float32
BLOCK = {Q.Q8_0: 32, Q.Q2_K: 256, Q.IQ2_XXS: 256}


def _stored(qt, experts, rows, cols, rng):
    from test_fused import stored

    return np.stack([stored(qt, rows, cols, rng) for _ in range(experts)])


def _routing(rng, tokens, n_experts, k):
    """[tokens, k] distinct experts per row, as the router picks them, and moe's pairs: by expert, then row."""
    idx = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(tokens)])
    order = np.argsort(idx, axis=None, kind="stable")
    tok = order // k
    e_of = idx.ravel()[order]
    gs = np.concatenate(([0], np.flatnonzero(np.diff(e_of)) + 1, [len(order)]))
    return e_of[gs[:-1]], gs, tok


def _per_expert(qt, raw, ex, gs, xr, x):
    return np.concatenate([jit_i8.matmul(qt, raw[e], x[xr[a:b]], 1) for e, a, b in zip(ex, gs[:-1], gs[1:])])


@pytest.mark.parametrize("pool", [False, True], ids=["serial", "pool"])
@pytest.mark.parametrize("qt", jit_i8.EXPERT_FORMATS, ids=lambda q: q.name)
def test_one_call_gives_the_per_expert_products_bit_for_bit(qt, pool, monkeypatch):
    if pool:                                       # every call on numba's pool, split unevenly over 2 threads
        monkeypatch.setattr(jit, "SERIAL_BYTES", 0)
    b = BLOCK[qt]
    cases = [(1, 1, 1, 3, b), (1, 6, 8, 37, 2 * b), (3, 4, 6, 5, 3 * b), (8, 6, 16, 20, b),
             (jit_i8.DECODE_ROWS, 2, 3, 64, 5 * b), (2, 1, 2, 1, 9 * b)]   # (tokens, k, experts, rows, cols)
    if jit_i8.experts_supported(qt, 40):          # a prefill's experts: up to 40 rows on one expert
        cases += [(40, 6, 9, 11, 2 * b), (17, 3, 24, 7, b)]
    for tokens, k, n_experts, rows, cols in cases:
        rng = np.random.default_rng([int(qt), tokens, k, cols])
        gate, up = _stored(qt, n_experts, rows, cols, rng), _stored(qt, n_experts, rows, cols, rng)
        x = (rng.standard_normal((tokens, cols)) * rng.uniform(0.1, 10, (tokens, 1))).astype(F32)
        ex, gs, tok = _routing(rng, tokens, n_experts, k)
        g, u = jit_i8.experts_matmul(qt, (gate, up), ex, gs, tok, x, 2)
        assert g.shape == u.shape == (tokens * k, rows) and g.dtype == F32
        np.testing.assert_array_equal(g, _per_expert(qt, gate, ex, gs, tok, x))
        np.testing.assert_array_equal(u, _per_expert(qt, up, ex, gs, tok, x))
        h = rng.standard_normal((tokens * k, cols)).astype(F32)          # down: one activation row per pair
        pairs = np.arange(tokens * k)
        d, = jit_i8.experts_matmul(qt, (gate,), ex, gs, pairs, h, 2)
        np.testing.assert_array_equal(d, _per_expert(qt, gate, ex, gs, pairs, h))


def test_only_decode_kernel_formats_and_steps_are_taken():
    assert jit_i8.experts_supported(Q.IQ2_XXS, jit_i8.DECODE_ROWS)
    assert jit_i8.experts_supported(Q.IQ2_XXS, 1000) and jit_i8.experts_supported(Q.Q2_K, 1000)   # the same bits
    assert jit_i8.experts_supported(Q.Q8_0, jit_i8.DECODE_ROWS)
    assert not jit_i8.experts_supported(Q.Q8_0, jit_i8.DECODE_ROWS + 1)       # longer: the fp32 kernels' bits
    assert not jit_i8.experts_supported(Q.Q4_K, 1) and not jit_i8.experts_supported(Q.MXFP4, 1)
    with pytest.raises(ValueError):
        jit_i8.experts_matmul(Q.Q4_K, (np.zeros((1, 1, 144), np.uint8),), np.zeros(1), np.array([0, 1]),
                              np.zeros(1), np.zeros((1, 256), F32))


def _run(path, batched: bool, chunks, monkeypatch):
    """Logits of a step over `chunks` (all rows) and two one-token steps after, the routed experts' calls, and
    the moe_hook's parts of a traced one-sequence prefill + decode."""
    from ds4py.model import Numerics
    from ds4py.ref.engine import RefModel
    from ds4py.ref.weights import Weights

    calls = []
    real = Weights.experts_linear

    def counted(self, *a):
        calls.append(1)
        return real(self, *a)

    monkeypatch.setattr(Weights, "experts_linear", counted)
    if not batched:
        monkeypatch.setattr(Weights, "experts_batched", lambda self, tensors, rows: False)
    m = RefModel(path, numerics=Numerics.ds4(), kernels="jit", threads=2)
    states = [m.new_state() for _ in chunks]
    out = [np.concatenate(m._step(states, chunks, True))]
    for t in (7, 120):
        out.append(np.concatenate(m._step(states, [np.array([t])] * len(chunks), True)))
    parts = []
    trace = m.new_trace()
    trace.moe_hook = lambda il, x, idx, wts, p, shared, y: parts.append((p.copy(), y.copy()))
    st = m.new_state()
    out.append(m.prefill(st, chunks[0], trace=trace))
    out.append(m.decode(st, 9, trace=trace))
    monkeypatch.undo()
    return out, calls, parts


@pytest.mark.parametrize("chunks", [[[3, 17, 250]], [[3, 17], [88, 41, 5]], "prefill"],
                         ids=["one", "two", "prefill"])
def test_the_batched_moe_equals_the_per_expert_loop(golden, chunks, monkeypatch):
    """ds4-tiny: routed IQ2_XXS gate / up, Q2_K down (the layout of ds4's q2 files), hash-routed and top-k
    layers; a step of one sequence or two (rows <= DECODE_ROWS), or a prefill of two sequences (21 and 12 rows:
    the batched experts of a prefill, some experts routed more rows than DECODE_ROWS), then decode steps."""
    path = str(golden / "ds4-tiny" / "tiny.gguf")
    if chunks == "prefill":
        rng = np.random.default_rng(5)
        chunks = [rng.integers(1, 250, 21), rng.integers(1, 250, 12)]
    chunks = [np.array(c) for c in chunks]
    got, calls, got_parts = _run(path, True, chunks, monkeypatch)
    want, none, want_parts = _run(path, False, chunks, monkeypatch)
    assert calls and not none                           # 2 calls a layer (gate + up, down) instead of the loop
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert len(got_parts) == len(want_parts) > 0
    for (p, y), (q, z) in zip(got_parts, want_parts):
        np.testing.assert_array_equal(p, q)
        np.testing.assert_array_equal(y, z)


@pytest.mark.parametrize("tokens", [1, 3, jit_i8.DECODE_ROWS])
def test_grouped_and_paired_projections_equal_their_one_matrix_products(golden, tokens):
    """The attention's grouped output projection (its groups as experts: one call) and the shared expert's gate
    and up (one x, one call) in a decode step: the bits of the products they replace."""
    from ds4py.model import Numerics
    from ds4py.ref.engine import RefModel

    m = RefModel(str(golden / "ds4-tiny" / "tiny.gguf"), numerics=Numerics.ds4(), kernels="jit", threads=2)
    w, L, G = m.weights, m.binding.layers[0], m.config.o_groups
    rng = np.random.default_rng(tokens)
    t = L.attn.out_a
    rank, cols = t.shape[0] // G, t.shape[1]
    o = rng.standard_normal((tokens, G, cols)).astype(F32)
    raw = np.asarray(t.raw_bytes())
    want = np.stack([jit_i8.matmul(t.qtype, raw[g * rank:(g + 1) * rank], o[:, g], 1) for g in range(G)], axis=1)
    np.testing.assert_array_equal(w.grouped_linear(t, o), want)
    S = L.ffn.shared
    x = rng.standard_normal((tokens, S.gate.shape[1])).astype(F32)
    g, u = w.linear_pair(S.gate, S.up, x)
    np.testing.assert_array_equal(g, jit_i8.matmul(S.gate.qtype, S.gate.raw_bytes(), x, 1))
    np.testing.assert_array_equal(u, jit_i8.matmul(S.up.qtype, S.up.raw_bytes(), x, 1))


def test_verify_rows_through_the_batched_moe_are_the_decode_steps_bits(golden):
    """A speculative verify step (several rows, row-stable) takes the batched MoE as a decode step does: each
    row's logits are the bits of that row stepped alone."""
    from ds4py.model import Numerics
    from ds4py.ref.engine import RefModel

    m = RefModel(str(golden / "ds4-tiny" / "tiny.gguf"), numerics=Numerics.ds4(), kernels="jit", threads=2)
    rows = [250, 9, 88]
    assert len(rows) <= min(m.stable_rows, jit_i8.DECODE_ROWS)
    a, b = m.new_state(), m.new_state()
    m.prefill(a, [3, 17])
    m.prefill(b, [3, 17])
    verify = m._step([a], [np.array(rows)], True)[0]
    for i, t in enumerate(rows):
        np.testing.assert_array_equal(verify[i], m.decode(b, t))
