"""The cuda-core kernels on a real GPU: every emulator test of tests/test_cu_emu_{gemv,mhc,embed,sample}.py again
(the same functions, with tests/gpu/conftest.py's rt / arena / put), then the real V4 Flash shapes, PDL on/off and
graph replay bit-identical to direct launches, and the sampler's distribution over many draws."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import ops, twins
from ds4py.cuda.graph import StepGraph
from ds4py.cuda.ops import mhc as om
from ds4py.cuda.ops.argmax import argmax_parts
from ds4py.cuda.ops.sample import SampleRows, SampleRule
from ds4py.cuda.twins import gemv as tg
from ds4py.cuda.twins import mhc as tm
from ds4py.cuda.twins import sample as ts
from ds4py.cuda.ops.argmax import ArgmaxParts
from ds4py.cuda.ops.gemv import GemvX
from ds4py.cuda.ops.mhc import HcResidual, HcRows
from cu_fixtures import fresh_arena, gemv_weights
from gpu_sizes import shrink
from test_cu_emu_embed import (test_argmax, test_embed, test_rmsnorm, test_rmsnorm_in_place,  # noqa: F401
                               test_wrapper_checks as test_embed_wrapper_checks)
from test_cu_emu_gemv import (test_batch_invariance, test_gemv, test_hc_post_epilogue, test_input_groups,  # noqa: F401
                              test_q8_0_rows_at_any_even_address, test_several_matrices_norm_and_add,
                              test_swiglu_epilogue, test_the_tolerance_sees_one_quant_off)
from test_cu_emu_mhc import (test_collapse_norm, test_hc_post, test_head_collapse,  # noqa: F401
                             test_mix_and_sinkhorn)
from test_cu_emu_sample import (chi2_tail, test_bad_rows_and_greedy, test_cut_inside_a_run_of_ties_keeps_the_lowest_ids,  # noqa: F401
                                test_draws_are_philox_token_for_token, test_kept_set_is_the_cpu_samplers,
                                test_replays_repeat_their_draws)

pytestmark = pytest.mark.gpu

# The decode GEMVs of V4 Flash (rows, cols, input groups): q_b, wo_a (8 groups of 1024 rows), wo_b, head
# (cut down on the emulator: conftest.shrink).
REAL = [("q_b", shrink(32768, 256, 4), 1024, 0), ("wo_a", shrink(8192, 64, 8), 4096, shrink(1024, 64, 4)),
        ("wo_b", shrink(4096, 64, 4), 8192, 0), ("head", shrink(129280, 512, 4), 4096, 0)]


def q8_random(r: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Q8_0 bytes drawn directly (f16 scales ~ 0.05/127 .. 0.1/127, uniform int8 quants): fast at 129,280 rows."""
    blocks = np.empty((rows * cols // 32, 34), np.uint8)
    blocks[:, :2] = ((0.05 + 0.05 * r.random((len(blocks), 1))) / 127).astype(np.float16).view(np.uint8)
    blocks[:, 2:] = r.integers(0, 256, (len(blocks), 32), dtype=np.uint8)
    return blocks.reshape(rows, -1)


@pytest.fixture
def big(rt):
    with fresh_arena(rt, 1200 << 20, 32 << 20) as a:
        yield a


@pytest.mark.parametrize("name,rows,cols,groups", REAL)
def test_q8_0_gemv_at_real_shapes(rt, big, name, rows, cols, groups):
    r = np.random.default_rng(rows)
    W = q8_random(r, rows, cols)
    x = r.standard_normal(cols * (rows // groups if groups else 1)).astype(np.float32)
    dW = big.weights(W.shape, W.dtype)
    dW.upload(W)
    dx = big.scratch(x.shape, np.float32)
    dx.upload(x)
    y = big.scratch(rows, np.float32)
    ops.gemv(rt, [(dW, y, rows)], GemvX(dx, cols, x_group_rows=groups))
    want = tg.gemv(W, x, rows, cols, x_group_rows=groups)
    twins.assert_close_scaled(y.download(), want, tg.magnitude(W, x, rows, cols, groups), cols, name, factor=1.0)


def test_head_argmax_and_sampler_at_vocab_size(rt, big):
    """Head GEMV -> argmax and -> sampler over 129,280 logits: argmax exact; the sampler's kept set the CPU's."""
    V, D = shrink(129280, 64), shrink(4096, 16, 32)
    r = np.random.default_rng(3)
    W = q8_random(r, V, D)
    x = r.standard_normal(D).astype(np.float32)
    dW = big.weights(W.shape, W.dtype)
    dW.upload(W)
    dx = big.scratch(D, np.float32)
    dx.upload(x)
    logits = big.scratch(V, np.float32)
    ops.gemv(rt, [(dW, logits, V)], GemvX(dx, D))
    parts = argmax_parts(rt, V)
    pv, pi = big.scratch(parts, np.float32), big.scratch(parts, np.int32)
    ticket = big.scratch(1, np.uint32)
    ticket.upload(np.zeros(1, np.uint32))
    tok = big.scratch(1, np.int32)
    ops.argmax(rt, logits, V, ArgmaxParts(pv, pi, ticket), tok)
    host = logits.download()
    assert int(tok.download()[0]) == int(np.argmax(host))
    kept = big.scratch(V, np.uint8)
    for prm in (dict(temperature=1.0, top_k=50), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, min_p=0.05),
                dict(temperature=0.7, top_k=500, top_p=0.95, min_p=0.01)):
        ops.sample(rt, SampleRule(seed=11, **prm), logits, tok, SampleRows(n=V, kept=kept))
        keep = kept.download().astype(bool)
        want = ts.kept(host, ts.params(**prm))
        assert (keep == want).all(), prm
        assert want[int(tok.download()[0])]


def test_sampler_distribution_on_device(rt, arena, put):
    logits = (np.random.default_rng(4).standard_normal(200) * 1.5).astype(np.float32)
    N = shrink(100_000, 50)
    out = arena.scratch(N, np.int32)
    for prm in (dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)):
        ops.sample(rt, SampleRule(seed=5, **prm), put(logits, weights=False), out,
                   SampleRows(n=200, rows=N, row_stride=0), threads=shrink(1024, 32, 32))
        counts = np.bincount(out.download(), minlength=200)
        p = ts.distribution(logits, ts.params(**prm))
        assert counts[p == 0].sum() == 0
        sup = p > 1e-4
        expect = N * p[sup]
        chi2 = float(((counts[sup] - expect) ** 2 / expect).sum())
        assert chi2_tail(chi2, int(sup.sum()) - 1) > 1e-6, prm


def _decode_like(rt, arena, dev, pdl):
    """mix -> collapse+norm -> q8 gemv with hc_post -> head mix -> collapse -> head gemv -> argmax, all on device."""
    D, V = 1024, 4096
    s = {}
    s["part"] = arena.scratch(om.mix_partial_floats(1, 24, D), np.float32)
    s["mix"], s["hmix"] = arena.scratch(24, np.float32), arena.scratch(24, np.float32)
    s["x"], s["y"] = arena.scratch(D, np.float32), arena.scratch(D, np.float32)
    s["logits"] = arena.scratch(V, np.float32)
    s["pv"], s["pi"], s["tok"] = arena.scratch(16, np.float32), arena.scratch(16, np.int32), arena.scratch(1, np.int32)
    ops.hc_mix(rt, om.MixWeights(dev["fn"], dev["scale"], dev["base"], D, 1e-6, 1e-6, 20),
               om.MixBuffers(dev["X"], 1, s["mix"], s["part"], dev["ticket"]), pdl=pdl)
    ops.hc_collapse_norm(rt, HcRows(dev["X"], 1, D), om.Collapse(s["x"], dev["norm"], 1e-6, s["mix"]), pdl=pdl)
    ops.gemv_hc_post(rt, dev["W"], GemvX(s["x"], D), HcResidual(dev["X"], s["mix"], D), pdl=pdl)
    ops.hc_mix(rt, om.MixWeights(dev["hfn"], dev["scale"], dev["base"], D, 1e-6, 1e-6, 20),
               om.MixBuffers(dev["X"], 1, s["hmix"], s["part"], dev["ticket"]), pdl=pdl)
    ops.hc_collapse_norm(rt, HcRows(dev["X"], 1, D), om.Collapse(s["y"], dev["norm"], 1e-6, s["hmix"]), pdl=pdl)
    ops.gemv(rt, [(dev["head"], s["logits"], V)], GemvX(s["y"], D), pdl=pdl)
    ops.argmax(rt, s["logits"], V, ArgmaxParts(s["pv"], s["pi"], dev["ticket1"]), s["tok"], pdl=pdl)
    return s


@pytest.fixture
def decode_weights(arena, put):
    r = np.random.default_rng(8)
    D, V = 1024, 4096
    host = {"fn": (0.05 * r.standard_normal((24, 4 * D))).astype(np.float16),
            "hfn": (0.05 * r.standard_normal((4, 4 * D))).astype(np.float16),
            "scale": (0.5 + r.random(3)).astype(np.float32), "base": (0.3 * r.standard_normal(24)).astype(np.float32),
            "norm": (1 + 0.1 * r.standard_normal(D)).astype(np.float32),
            "W": gemv_weights(r, "Q8_0", D, D, 0.05), "head": gemv_weights(r, "Q8_0", V, D, 0.05)}
    dev = {k: put(v) for k, v in host.items()}
    for t in ("ticket", "ticket1"):               # in the weights region: they outlive begin_step()
        dev[t] = put(np.zeros(1, np.uint32))
        dev[t].readonly = False
    X0 = r.standard_normal((4, D)).astype(np.float32)
    return host, dev, X0


def test_pdl_graph_and_direct_are_bit_identical(rt, arena, decode_weights):
    host, dev, X0 = decode_weights
    runs = []
    for mode in ("direct", "pdl", "graph", "graph+pdl"):
        X = arena.scratch((4, 1024), np.float32)
        X.upload(X0)
        dev["X"] = X
        if mode.startswith("graph"):
            slot = arena.scratch(2, np.int32)
            holder = {}
            g = StepGraph(rt, lambda: holder.update(s=_decode_like(rt, arena, dev, mode.endswith("pdl"))), slot)
            g.replay([0, 0])
            s = holder["s"]
        else:
            s = _decode_like(rt, arena, dev, mode == "pdl")
        rt.synchronize()
        runs.append({k: v.download().tobytes() for k, v in s.items() if k != "part"} | {"X": X.download().tobytes()})
    for other in runs[1:]:
        assert other == runs[0]
    mix = tm.hc_mix(X0[None], host["fn"].astype(np.float32), host["scale"], host["base"], 1e-6, 1e-6, 20)
    got = np.frombuffer(runs[0]["mix"], np.float32)
    np.testing.assert_allclose(got, mix[0], atol=1e-4)
