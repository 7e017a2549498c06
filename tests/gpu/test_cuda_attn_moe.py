"""The attention / compressor / indexer / top-k / router / expert kernels on a real GPU (skipped without one).

1. Every emulator test of these kernels (tests/test_cu_emu_{attention,compressor,indexer,topk,router,experts,layer}.py)
   runs again here with its `kdev` fixture bound to the device: same inputs, same twins, same tolerances, but the
   hardware's FP8 conversion, FMA contraction, cp.async and warp scheduling.
2. Real V4 Flash shapes: decode attention at 4K and 64K context (64 heads of 512, window 128, top-k 512 of 16K
   compressed rows, or all 512 rows of a ratio-128 layer), the ratio-128 compressor, the indexer's scores over 16K
   keys and the top-k, 6 of the routed experts at 4096 x 2048 in IQ2_XXS / Q2_K and the Q8_0 shared expert (the
   experts cut down 8x when these tests run on the emulator, DS4PY_GPU_TESTS_ON_EMULATOR=1).
3. Runs are bit-identical: twice, and with PDL on and off.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4py.cuda.ops import attention as ops_attn
from ds4py.cuda.ops import compressor as ops_comp
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.ops import indexer as ops_idx
from ds4py.cuda.ops import topk as ops_topk
from ds4py.cuda.twins import attention as twin_attn
from ds4py.cuda.twins import experts as twin_moe
from ds4py.cuda.twins import indexer as twin_idx
from ds4py.cuda.twins import topk as twin_topk
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.cuda.ops.core import TokenRows
from ds4py.cuda.ops.experts import Experts, Slots
from ds4py.ref import ops
from ds4py.ref.forward import topk_mask
from tests.cu_emu_device import gpu_devices
from gpu_sizes import shrink
from tests.test_cu_emu_attention import (test_attention_is_bit_identical_across_thread_orders,  # noqa: F401
                                   test_decode_attention, test_fp8_fake_quant_is_exact_on_the_grid, test_kv_store)
from tests.test_cu_emu_compressor import (History, check_row, test_compressor_decode,  # noqa: F401
                                    test_compressor_prefill, test_decode_equals_prefill_rows)
from tests.test_cu_emu_experts import (expert_tensor, test_bad_expert_ids_give_nan_not_a_wild_read,  # noqa: F401
                                 test_dequant_is_bit_exact, test_down, test_gate_up,
                                 test_moe_is_bit_identical_across_orders)
from tests.test_cu_emu_indexer import test_indexer_q_prep, test_indexer_scores  # noqa: F401
from tests.test_cu_emu_layer import (model, test_attention_sublayer_matches_the_reference,  # noqa: F401
                               test_moe_sublayer_matches_the_reference)
from tests.test_cu_emu_router import (test_route_hash_layers, test_route_ties_pick_the_lower_index,  # noqa: F401
                                test_route_topk)
from tests.test_cu_emu_topk import (test_topk, test_topk_extreme_values,  # noqa: F401
                              test_topk_ties_go_to_the_lowest_indices)

pytestmark = pytest.mark.gpu

EPS = 1e-6
H, HD, RD, W, RING = 64, 512, 64, 128, 144          # V4 Flash attention
IH, IHD, TOPK = 64, 128, 512                         # its indexer


@pytest.fixture
def kdev(rt):
    """The emulator tests' device factory on the GPU (256 MiB regions unless a test asks for more)."""
    yield from gpu_devices(rt, 256)


def yarn() -> np.ndarray:
    return ops.rope_freqs(RD, 160000.0, 16.0, 65536, 32.0, 1.0)


def run_attention(dev, pos, ratio, q_raw, win, comp, sel, sinks, pdl=False):
    n_vis = (pos + 1) // ratio if ratio else 0
    cap = W + (TOPK if ratio == 4 else n_vis)
    plan = ops_attn.attn_plan(H, HD, cap)
    part_o = dev.var(np.zeros(plan.part_o_shape, np.float32))
    part_ml = dev.var(np.zeros(plan.part_ml_shape, np.float32))
    out = dev.var(np.zeros((H, HD), np.float32))
    ops_attn.decode_attention(dev.rt, plan, ops_attn.AttnLayer(dev.const(yarn()), sinks, H, RD, W, EPS, HD ** -0.5),
                              ops_attn.AttnKeys(win, comp, ratio, sel, TOPK),
                              ops_attn.DecodeBuffers(q_raw, dev.const(np.array([pos], np.int32)), part_o, part_ml,
                                                     out), pdl=pdl)
    return out.download()


@pytest.mark.parametrize("pos,ratio", [(4095, 4), (65535, 4), (65535, 128), (4095, 128), (4095, 0)])
def test_attention_real_shapes(kdev, pos, ratio):
    r = np.random.default_rng(pos + ratio)
    dev = kdev()
    q_raw = (r.standard_normal((H, HD)) * 2).astype(np.float32)
    win = r.standard_normal((RING, HD)).astype(np.float32)
    n_vis = (pos + 1) // ratio if ratio else 0
    comp = r.standard_normal((max(n_vis, 1), HD)).astype(np.float32)
    sel = np.sort(r.choice(n_vis, TOPK, replace=False)).astype(np.int32) if ratio == 4 else None
    sinks = r.standard_normal(H).astype(np.float32)
    d_q, d_win, d_comp, d_sel, d_sinks = (dev.const(a) for a in (q_raw, win, comp if ratio else None, sel, sinks))
    out = run_attention(dev, pos, ratio, d_q, d_win, d_comp, d_sel, d_sinks)
    freqs = yarn()                                        # any table: the kernel got the same one
    keys = twin_attn.decode_keys(win, RING, W, pos, comp, ratio, sel, TOPK)
    want, mag = twin_attn.decode_attention(q_raw, keys, sinks, freqs, pos, H, RD, EPS, HD ** -0.5)
    assert_close_scaled(out, want, mag, keys.shape[0] + HD, f"attention pos {pos} ratio {ratio}")
    again = run_attention(dev, pos, ratio, d_q, d_win, d_comp, d_sel, d_sinks, pdl=True)
    np.testing.assert_array_equal(again, out)             # rerun, and with PDL: the same bits


def test_compressor_ratio128_real_shape(kdev):
    d, rd, ratio, cap = HD, RD, 128, 128 + 16
    pos = 128 * 40 - 1
    h = History(np.random.default_rng(2), pos + 1, d, ratio, False, np.float16)
    dev = kdev()
    kv, sc = (dev.var(a) for a in h.rings(range(pos - cap + 1, pos), cap))
    rows = dev.var(np.full((41, d), np.nan, np.float32))
    ops_comp.compressor_decode(dev.rt, ops_comp.CompLayer(dev.const(h.ape), dev.const(h.norm), dev.const(yarn()),
                                                          ratio, False, d, rd, EPS, False),
                               ops_comp.CompState(kv, sc, rows), dev.const(h.kv[pos]), dev.const(h.sc_raw[pos]),
                               dev.const(np.array([pos], np.int32)))
    check_row(rows.download()[pos // ratio], h, pos // ratio, ratio, False, yarn(), rd, False, True, "ratio 128 row")


def test_indexer_and_topk_real_shapes(kdev):
    r = np.random.default_rng(3)
    n = 16384
    pos = 4 * n + 1
    dev = kdev()
    q = ops.fp4_fake_quant(r.standard_normal((IH, IHD)).astype(np.float32), 32)
    keys = ops.fp4_fake_quant(r.standard_normal((n, IHD)).astype(np.float32), 32)
    w_raw = r.standard_normal(IH).astype(np.float32)
    wscale = twin_idx.weight_scale(IHD, IH)
    scores = dev.var(np.zeros(n, np.float32))
    slot = dev.const(np.array([pos], np.int32))
    ops_idx.indexer_scores(dev.rt, ops_idx.IndexScorer(IH, IHD, wscale),
                           ops_idx.ScoreBuffers(dev.const(q), dev.const(w_raw), dev.const(keys), slot, scores, n))
    got = scores.download()
    want, mag = twin_idx.scores(q, w_raw, wscale, keys)
    assert_close_scaled(got, want, mag, IHD + IH, "indexer scores 16K")
    sel = dev.var(np.zeros(TOPK, np.int32))
    ops_topk.topk(dev.rt, scores, TOPK, sel, ops_topk.Visible(pos_slot=slot))
    out = sel.download()
    np.testing.assert_array_equal(out, twin_topk.topk(got, TOPK))
    if len(np.unique(got)) == n:
        np.testing.assert_array_equal(out, np.flatnonzero(topk_mask(got[None], TOPK)[0]))


@pytest.mark.parametrize("gate_type,down_type", [(QT.IQ2_XXS, QT.Q2_K), (QT.Q4_K, QT.Q4_K), (QT.MXFP4, QT.MXFP4)])
def test_experts_real_shapes(kdev, gate_type, down_type):
    D, FF, NX, k = shrink(4096, 8, 256), shrink(2048, 8, 256), 8, 6     # cut down on the emulator
    r = np.random.default_rng(int(gate_type))
    raw_g, Wg = expert_tensor(r, gate_type, NX, FF, D)
    raw_u, Wu = expert_tensor(r, gate_type, NX, FF, D)
    raw_d, Wd = expert_tensor(r, down_type, NX, D, FF)
    x = (r.standard_normal(D) * 0.5).astype(np.float32)
    ids = r.choice(NX, k, replace=False).astype(np.int32)
    wts = (r.random(k) + 0.2).astype(np.float32)
    dev = kdev()
    d_ids = dev.const(ids)
    h, y = dev.var(np.zeros((k, FF), np.float32)), dev.var(np.zeros(D, np.float32))
    ops_moe.moe_gate_up(dev.rt,
                        Experts(fmt=gate_type, n_experts=NX, ff=FF, dim=D, gate=dev.const(raw_g), up=dev.const(raw_u),
                                clamp=10.0), dev.const(x), h, Slots(ids=d_ids, weights=dev.const(wts), k=k))
    ops_moe.moe_down(dev.rt, Experts(fmt=down_type, n_experts=NX, ff=FF, dim=D, down=dev.const(raw_d)),
                     TokenRows(x=h, y=y), Slots(ids=d_ids, k=k))
    want_h, mag_h = twin_moe.gate_up(Wg, Wu, x, ids, wts, 10.0, k)
    assert_close_scaled(h.download(), want_h, mag_h, D, "gate_up 4096")
    want_y, mag_y = twin_moe.down(Wd, ids, h.download(), k)
    assert_close_scaled(y.download(), want_y, mag_y, FF * k, "down 2048")


def test_shared_expert_q8_0_real_shape(kdev):
    D, FF = shrink(4096, 8, 256), shrink(2048, 8, 256)
    r = np.random.default_rng(7)
    raw_g, Wg = expert_tensor(r, QT.Q8_0, 1, FF, D)
    raw_u, Wu = expert_tensor(r, QT.Q8_0, 1, FF, D)
    raw_d, Wd = expert_tensor(r, QT.Q8_0, 1, D, FF)
    x = r.standard_normal(D).astype(np.float32)
    dev = kdev()
    h, y = dev.var(np.zeros(FF, np.float32)), dev.var(np.zeros(D, np.float32))
    ops_moe.moe_gate_up(dev.rt,
                        Experts(fmt=QT.Q8_0, n_experts=1, ff=FF, dim=D, gate=dev.const(raw_g), up=dev.const(raw_u),
                                clamp=10.0), dev.const(x), h, Slots())
    ops_moe.moe_down(dev.rt, Experts(fmt=QT.Q8_0, n_experts=1, ff=FF, dim=D, down=dev.const(raw_d)),
                     TokenRows(x=h, y=y), Slots())
    want_h, mag_h = twin_moe.gate_up(Wg, Wu, x, None, None, 10.0, 1)
    assert_close_scaled(h.download().reshape(1, -1), want_h, mag_h, D, "shared gate_up")
    want_y, mag_y = twin_moe.down(Wd, None, h.download(), 1)
    assert_close_scaled(y.download(), want_y, mag_y, FF, "shared down")
