"""A decode attention sub-layer and MoE sub-layers of a small random model, chained on the emulated device from the
kernels (core's GEMV / RMSNorm, then kv store, compressors, indexer, top-k, attention, router, experts) against
ds4py/ref/forward.attention and forward.moe fed the same inputs, token after token. The ratio-4 layer's indexer has
more visible rows than its top-k, so the selection really selects. Plain fp32 numerics (fake_quant off): the
quantisers are checked exactly in their own tests; here a boundary flip would only blur what this test is for."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4py import schema
from ds4py.config import ModelConfig
from ds4py.cuda import emu, ops
from ds4py.cuda.ops import attention as ops_attn
from ds4py.cuda.ops import compressor as ops_comp
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.ops import indexer as ops_idx
from ds4py.cuda.ops import router as ops_route
from ds4py.cuda.ops import topk as ops_topk
from ds4py.cuda.twins.indexer import weight_scale
from ds4py.cuda.ops.core import TokenRows
from ds4py.cuda.ops.experts import Experts, HcPost, Slots
from ds4py.gguf import GGUFFile
from ds4py.kv import state_layout
from ds4py.model import Numerics
from ds4py.ref import forward, ops as ref_ops
from ds4py.ref.state import RefState
from ds4py.ref.weights import Weights
from ds4py.tiny import make_tiny
from tests.cu_emu_device import devices

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")

SHAPE = dict(n_layers=4, dim=256, vocab_size=300, n_heads=8, head_dim=128, rope_dim=64, q_lora_rank=64,
             o_groups=2, o_lora_rank=64, n_experts=8, n_experts_used=6, expert_ff=256,
             index_heads=4, index_head_dim=128, index_topk=4, window=8, hash_layers=2,
             compress_ratios=[0, 0, 4, 128])
SPARE = 4                     # rollback horizon of the device rings (and of the reference state)
FP32 = Numerics(fake_quant=False)
STEPS = 30                    # 7 compressed rows at the end: the top 4 are chosen from up to 7


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("layer") / "tiny.gguf"
    make_tiny(str(path), seed=3, **SHAPE)
    gg = GGUFFile(str(path))
    cfg = ModelConfig.from_gguf(gg)
    return gg, cfg, Weights(gg), schema.bind(cfg, gg.tensor)


class Params:
    """The layer's tensors on the device: raw GGUF bytes for matrices (F16 ones as halves), f32 small ones."""

    def __init__(self, dev, gg: GGUFFile, il: int):
        self.dev, self.gg, self.p = dev, gg, f"blk.{il}."
        self.up: dict[tuple[str, str], object] = {}

    def _get(self, kind: str, name: str, make):
        if (kind, name) not in self.up:                  # each tensor uploaded once
            self.up[kind, name] = self.dev.const(make(self.gg.tensor(self.p + name)))
        return self.up[kind, name]

    def raw(self, name: str):
        return self._get("raw", name, lambda t: t.raw_bytes().view(np.float16) if t.qtype == QT.F16 else t.raw_bytes())

    def f32(self, name: str):
        return self._get("f32", name, lambda t: np.asarray(t.raw, np.float32))

    def any(self, name: str):
        return self._get("any", name, lambda t: np.ascontiguousarray(t.raw))


def linear(dev, P, name, x, rows, cols):
    """y = W x with core's GEMV for the tensor's type (Q8_0 or F16)."""
    y = dev.arena.scratch(rows, np.float32)
    t = P.gg.tensor(P.p + name)
    (ops.gemv_q8_0 if t.qtype == QT.Q8_0 else ops.gemv_f16)(dev.rt, P.raw(name), x, y, rows, cols)
    return y


def test_attention_sublayer_matches_the_reference(kdev, model):
    gg, cfg, w, B = model
    il = 2
    D, H, hd, rd, W = cfg.dim, cfg.n_heads, cfg.head_dim, cfg.rope_dim, cfg.window
    ih, ihd, topk, ratio = cfg.index_heads, cfg.index_head_dim, cfg.index_topk, cfg.compress_ratios[il]
    eps = cfg.norm_eps
    qr_dim, G, r_o = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    freqs_h = ref_ops.layer_rope_freqs(cfg, il)
    dev = kdev("random", 1, weights_mib=16, scratch_mib=64)
    P = Params(dev, gg, il)
    freqs = dev.const(freqs_h)
    cap = 2 * ratio + SPARE                  # overlap: this group and the previous one, + the rollback horizon
    win = dev.var(np.zeros((W + SPARE, hd), np.float32))
    c_kv, c_sc = dev.var(np.zeros((cap, 2 * hd), np.float32)), dev.var(np.zeros((cap, 2 * hd), np.float32))
    rows = dev.var(np.zeros((STEPS // ratio + 1, hd), np.float32))
    i_kv, i_sc = dev.var(np.zeros((cap, 2 * ihd), np.float32)), dev.var(np.zeros((cap, 2 * ihd), np.float32))
    keys = dev.var(np.zeros((STEPS // ratio + 1, ihd), np.float32))
    scores = dev.var(np.zeros(STEPS // ratio + 1, np.float32))
    sel = dev.var(np.zeros(topk, np.int32))
    plan = ops_attn.attn_plan(H, hd, W + topk, warps=1, target_blocks=4)
    part_o = dev.var(np.zeros(plan.part_o_shape, np.float32))
    part_ml = dev.var(np.zeros(plan.part_ml_shape, np.float32))
    pos_slot = dev.var(np.zeros(1, np.int32))
    st = RefState(state_layout(cfg, SPARE))
    xs = (np.random.default_rng(4).standard_normal((STEPS, D)) * 1.5).astype(np.float32)
    worst = 0.0
    for t in range(STEPS):
        pos_slot.upload(np.array([t], np.int32))
        x = dev.var(xs[t])
        qr = dev.arena.scratch(qr_dim, np.float32)
        ops.rmsnorm(dev.rt, linear(dev, P, "attn_q_a.weight", x, qr_dim, D), qr, qr_dim,
                    (P.f32("attn_q_a_norm.weight"), eps))
        q = linear(dev, P, "attn_q_b.weight", qr, H * hd, qr_dim)
        ops_attn.kv_store(dev.rt, ops_attn.KvRow(P.f32("attn_kv_a_norm.weight"), freqs, hd, rd, eps, fake_quant=False),
                          linear(dev, P, "attn_kv.weight", x, hd, D), pos_slot, win)
        ops_comp.compressor_decode(dev.rt,
                                   ops_comp.CompLayer(P.any("attn_compressor_ape.weight"),
                                                      P.f32("attn_compressor_norm.weight"), freqs, ratio, True, hd, rd,
                                                      eps, rotate=False, fake_quant=False),
                                   ops_comp.CompState(c_kv, c_sc, rows),
                                   linear(dev, P, "attn_compressor_kv.weight", x, 2 * hd, D),
                                   linear(dev, P, "attn_compressor_gate.weight", x, 2 * hd, D), pos_slot)
        ops_comp.compressor_decode(dev.rt,
                                   ops_comp.CompLayer(P.any("indexer_compressor_ape.weight"),
                                                      P.f32("indexer_compressor_norm.weight"), freqs, ratio, True, ihd,
                                                      rd, eps, rotate=True, fake_quant=False),
                                   ops_comp.CompState(i_kv, i_sc, keys),
                                   linear(dev, P, "indexer_compressor_kv.weight", x, 2 * ihd, D),
                                   linear(dev, P, "indexer_compressor_gate.weight", x, 2 * ihd, D), pos_slot)
        iq = dev.arena.scratch(ih * ihd, np.float32)
        ops_idx.indexer_q_prep(dev.rt, ops_idx.IndexQuery(freqs, ih, ihd, rd, fake_quant=False),
                               linear(dev, P, "indexer.attn_q_b.weight", qr, ih * ihd, qr_dim), pos_slot, iq)
        ops_idx.indexer_scores(dev.rt, ops_idx.IndexScorer(ih, ihd, weight_scale(ihd, ih)),
                               ops_idx.ScoreBuffers(iq, linear(dev, P, "indexer.proj.weight", x, ih, D), keys,
                                                    pos_slot, scores, int(keys.shape[0])))
        ops_topk.topk(dev.rt, scores, topk, sel, ops_topk.Visible(pos_slot=pos_slot))
        o = dev.arena.scratch((H, hd), np.float32)
        ops_attn.decode_attention(dev.rt, plan,
                                  ops_attn.AttnLayer(freqs, P.f32("attn_sinks.weight"), H, rd, W, eps, hd ** -0.5),
                                  ops_attn.AttnKeys(win, rows, ratio, sel, topk),
                                  ops_attn.DecodeBuffers(q, pos_slot, part_o, part_ml, o))
        u = dev.arena.scratch(G * r_o, np.float32)
        wo_a = P.raw("attn_output_a.weight")
        cols = H * hd // G
        rb = cols // 32 * 34
        for g in range(G):                       # u_g = wo_a[g] @ o_g, one GEMV per output group
            ops.gemv_q8_0(dev.rt, wo_a.view(g * r_o * rb, (r_o, rb), np.uint8), o.view(g * cols * 4, cols),
                          u.view(g * r_o * 4, r_o), r_o, cols)
        out = linear(dev, P, "attn_output_b.weight", u, D, G * r_o).download()

        trace = forward.Trace(cfg.n_layers)
        seq = forward.Seq(st, slice(0, 1), np.array([t]))
        want = forward.attention(w, cfg, FP32, cfg.roles(il), B.layers[il].attn, xs[t:t + 1], seq.pos, [seq],
                                 trace)[0]
        if t >= 4 * topk + 3:
            chosen = np.flatnonzero(trace.indexer_selected[il][0])
            np.testing.assert_array_equal(np.sort(sel.download()), chosen, err_msg=f"step {t}: indexer selection")
        scale = np.abs(want).max()
        err = np.abs(out - want).max() / scale
        worst = max(worst, err)
        assert err < 2e-5, f"step {t}: attention output off by {err:.2e} of its scale"
    assert worst > 0          # the two paths really are different computations


@pytest.mark.parametrize("il,token", [(0, 17), (3, 5)], ids=["hash-layer", "biased-top6"])
def test_moe_sublayer_matches_the_reference(kdev, model, il, token):
    gg, cfg, w, B = model
    D, NX, FF, k = cfg.dim, cfg.n_experts, cfg.expert_ff, cfg.n_experts_used
    dev = kdev("random", il, weights_mib=16, scratch_mib=16)
    P = Params(dev, gg, il)
    rt = dev.rt
    x_h = (np.random.default_rng(il).standard_normal(D) * 1.5).astype(np.float32)
    x = dev.var(x_h)
    ids, wts = dev.var(np.zeros(k, np.int32)), dev.var(np.zeros(k, np.float32))
    hash_layer = cfg.is_hash_layer(il)
    ops_route.moe_route(rt,
                        ops_route.Router(None if hash_layer else P.f32("exp_probs_b.bias"),
                                         P.any("ffn_gate_tid2eid.weight") if hash_layer else None, NX, k,
                                         cfg.route_scale, cfg.route_norm),
                        linear(dev, P, "ffn_gate_inp.weight", x, NX, D), dev.const(np.array([token], np.int32)),
                        Slots(ids, wts,
                              ops_route.Router(None if hash_layer else P.f32("exp_probs_b.bias"),
                                             P.any("ffn_gate_tid2eid.weight") if hash_layer else None, NX, k,
                                             cfg.route_scale, cfg.route_norm).k))
    clamp = cfg.swiglu_clamp[il]
    sh = {m: gg.tensor(P.p + f"ffn_{m}_shexp.weight").qtype for m in ("gate", "down")}
    h_sh, y_sh = dev.var(np.zeros(FF, np.float32)), dev.var(np.zeros(D, np.float32))
    ops_moe.moe_gate_up(rt,
                        Experts(fmt=sh["gate"], n_experts=1, ff=FF, dim=D, gate=P.raw("ffn_gate_shexp.weight"),
                                up=P.raw("ffn_up_shexp.weight"), clamp=clamp), x, h_sh, Slots())
    ops_moe.moe_down(rt, Experts(fmt=sh["down"], n_experts=1, ff=FF, dim=D, down=P.raw("ffn_down_shexp.weight")),
                     TokenRows(x=h_sh, y=y_sh), Slots())
    ex = {m: gg.tensor(P.p + f"ffn_{m}_exps.weight").qtype for m in ("gate", "down")}
    h, y = dev.var(np.zeros((k, FF), np.float32)), dev.var(np.zeros(D, np.float32))
    ops_moe.moe_gate_up(rt,
                        Experts(fmt=ex["gate"], n_experts=NX, ff=FF, dim=D, gate=P.raw("ffn_gate_exps.weight"),
                                up=P.raw("ffn_up_exps.weight"), clamp=clamp), x, h, Slots(ids=ids, weights=wts, k=k))
    ops_moe.moe_down(rt, Experts(fmt=ex["down"], n_experts=NX, ff=FF, dim=D, down=P.raw("ffn_down_exps.weight")),
                     TokenRows(x=h, y=y, add=y_sh), Slots(ids=ids, k=k))
    # and the same sum through the hc_post epilogue
    r = np.random.default_rng(9)
    hc = cfg.hc_mult
    post, comb = (r.random(hc) * 2).astype(np.float32), r.random((hc, hc)).astype(np.float32)
    X = r.standard_normal((hc, D)).astype(np.float32)
    Xn = dev.var(np.zeros((hc, D), np.float32))
    ops_moe.moe_down(rt, Experts(fmt=ex["down"], n_experts=NX, ff=FF, dim=D, down=P.raw("ffn_down_exps.weight")),
                     TokenRows(x=h, y=Xn, add=y_sh), Slots(ids=ids, k=k),
                     hc=HcPost(dev.const(post), dev.const(comb), dev.const(X)))

    trace = forward.Trace(cfg.n_layers)
    one = [forward.Seq(None, slice(0, 1), np.array([0]))]        # the MoE reads only the rows of its sequence
    want = forward.moe(w, cfg, cfg.roles(il), B.layers[il].ffn, x_h[None], np.array([token]), one, trace)[0]
    np.testing.assert_array_equal(ids.download(), trace.experts[il][0])
    np.testing.assert_allclose(wts.download(), trace.expert_weights[il][0], rtol=1e-6)
    scale = np.abs(want).max()
    assert np.abs(y.download() - want).max() < 1e-5 * scale
    want_X = ref_ops.hc_post(want[None], X[None], post[None], comb[None])[0]
    assert np.abs(Xn.download() - want_X).max() < 1e-5 * np.abs(want_X).max()
