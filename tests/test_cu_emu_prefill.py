"""The prefill kernels under the CPU emulator against their numpy twins (ds4py/cuda/twins/prefill_attn.py and the
decode twins): a block's kv rows (bit-identical to the decode kv store, row by row), the window-ring store after
the block, the block attention (window rows from the ring before the block and from the block inside it,
compressed rows all visible or selected, the sink), and the `_rows` variants of the indexer, top-k and router
kernels, each row bit-identical to its decode launch; forward, reverse and random thread order."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.ops import attention as ops_attn
from ds4py.cuda.ops import indexer as ops_idx
from ds4py.cuda.ops import prefill_attn as ops_pfa
from ds4py.cuda.ops.attention import AttnKeys, AttnLayer, KvRow
from ds4py.cuda.ops.indexer import IndexQuery, IndexScorer, ScoreBuffers
from ds4py.cuda.ops.prefill_attn import PrefillRows
from ds4py.cuda.ops import router as ops_route
from ds4py.cuda.ops import topk as ops_topk
from ds4py.cuda.twins import attention as twin_attn
from ds4py.cuda.twins import indexer as twin_idx
from ds4py.cuda.twins import prefill_attn as twin
from ds4py.cuda.twins import router as twin_route
from ds4py.cuda.twins import topk as twin_topk
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.cuda.ops.experts import Slots
from ds4py.cuda.ops.topk import Visible
from ds4py.errors import Ds4Error
from ds4py.ref import ops
from tests.cu_emu_device import devices
from tests.test_cu_emu_attention import EPS, EPS32, ORDERS, yarn_freqs

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([11, *seed])


def positions(p0: int, T: int) -> np.ndarray:
    return np.arange(p0, p0 + T, dtype=np.int32)


@pytest.mark.parametrize("hd,rd,T,ring,p0", [(96, 32, 7, 20, 0), (128, 64, 30, 24, 45), (512, 64, 3, 144, 70000)])
@pytest.mark.parametrize("order", ORDERS)
def test_kv_rows_equal_the_decode_store_and_the_ring_keeps_the_tail(kdev, hd, rd, T, ring, p0, order):
    r = rng(hd, T, p0)
    kv_raw = (r.standard_normal((T, hd)) * 3).astype(np.float32)
    norm_w = (1 + 0.2 * r.standard_normal(hd)).astype(np.float32)
    freqs = yarn_freqs(rd)
    pos = positions(p0, T)
    dev = kdev(order, T)
    d_blk = dev.var(np.full((T, hd), np.nan, np.float32))
    d_pos = dev.const(pos)
    kr = KvRow(dev.const(norm_w), dev.const(freqs), hd, rd, EPS, True, False)
    ops_pfa.kv_rows(dev.rt, kr, dev.const(kv_raw), d_pos, d_blk, T)
    blk = d_blk.download()
    # row t is bit for bit what the decode kv store writes at pos[t]
    d_win = dev.var(np.zeros((T, hd), np.float32))
    for t in range(T):
        ops_attn.kv_store(dev.rt, kr, dev.const(kv_raw[t]), dev.const(pos[t:t + 1]), d_win)
    win = d_win.download()
    np.testing.assert_array_equal(blk, win[pos % T])
    want, pre, mag = twin.kv_rows(kv_raw, norm_w, freqs, pos, rd, EPS, True, False)
    nope = hd - rd
    twin_attn.assert_fake_quant_close(blk[:, :nope], pre[:, :nope], 8 * EPS32 * np.sqrt(hd) * mag[:, :nope], "fp8",
                                      64, "block kv rows")
    assert_close_scaled(blk[:, nope:], want[:, nope:], mag[:, nope:], hd, "block kv rope dims")
    # the ring store: the block's last min(T, ring) rows at slot p % ring, nothing else touched
    before = r.standard_normal((ring, hd)).astype(np.float32)
    d_ring = dev.var(before)
    ops_pfa.ring_store(dev.rt, d_blk, T, d_pos, d_ring)
    np.testing.assert_array_equal(d_ring.download(), twin.ring_store(before, blk, pos))


# hd, rd, heads, window, ring, ratio, p0, T, topk, warps
CASES = [
    (96, 32, 8, 16, 20, 4, 40, 24, 8, 2),          # ratio 4: selected rows; the block is longer than the ring
    (128, 64, 12, 16, 24, 128, 250, 20, 0, 4),     # ratio 128: all visible rows; 12 heads in one 16-head block
    (512, 64, 4, 128, 144, 0, 0, 9, 0, 1),         # window only, from position 0
    (96, 32, 5, 16, 20, 4, 3, 6, 8, 1),            # ratio 4 with fewer visible rows than topk; 5 heads
    (64, 32, 16, 8, 12, 0, 100, 5, 0, 4),          # window only, the window straddles the block start
]


def _case(case, seed=0):
    hd, rd, H, window, ring, ratio, p0, T, topk, warps = case
    r = rng(hd, H, p0, T, seed)
    pos = positions(p0, T)
    q_raw = (r.standard_normal((T, H, hd)) * 2).astype(np.float32)
    ring_a = r.standard_normal((ring, hd)).astype(np.float32)
    blk = r.standard_normal((T, hd)).astype(np.float32)
    n_max = (p0 + T) // ratio if ratio else 0
    comp = r.standard_normal((n_max + 3, hd)).astype(np.float32) if ratio else None
    sel = None
    if ratio == 4:
        sel = np.full((T, topk), -1, np.int32)
        for t in range(T):
            n = (p0 + t + 1) // ratio
            k = min(n, topk)
            sel[t, :k] = np.sort(r.choice(n, k, replace=False)) if k < n else np.arange(k)
    sinks = r.standard_normal(H).astype(np.float32)
    freqs = yarn_freqs(rd) if ratio else ops.rope_freqs(rd, 10000.0)
    return pos, q_raw, ring_a, blk, comp, sel, sinks, freqs


def _launch(dev, case, arrays):
    hd, rd, H, window, ring, ratio, p0, T, topk, warps = case
    pos, q_raw, ring_a, blk, comp, sel, sinks, freqs = arrays
    d_out = dev.var(np.full((T, H, hd), np.nan, np.float32))
    ops_pfa.prefill_attention(dev.rt, AttnLayer(dev.const(freqs), dev.const(sinks), H, rd, window, EPS, hd ** -0.5),
                              AttnKeys(dev.const(ring_a), dev.const(comp), ratio, dev.const(sel), topk),
                              PrefillRows(dev.const(q_raw), dev.const(pos), dev.const(blk), d_out, T), warps=warps)
    return d_out.download()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hd{c[0]}-H{c[2]}-r{c[5]}-p{c[6]}-T{c[7]}")
@pytest.mark.parametrize("order", ORDERS)
def test_prefill_attention(kdev, case, order):
    hd, rd, H, window, ring, ratio, p0, T, topk, warps = case
    arrays = _case(case)
    pos, q_raw, ring_a, blk, comp, sel, sinks, freqs = arrays
    out = _launch(kdev(order, T), case, arrays)
    want, mag, counts = twin.prefill_attention(q_raw, ring_a, blk, pos, window, comp, ratio, sel, topk, sinks, freqs,
                                               H, rd, EPS, hd ** -0.5)
    assert_close_scaled(out, want, mag, max(counts) + hd, f"prefill attention {case}")


def test_prefill_attention_without_q_norm(kdev):
    """V4.1's queries have no per-head RMS (q_norm=False): the twin without it."""
    case = (64, 16, 4, 16, 32, 4, 30, 6, 8, 2)
    hd, rd, H, window, ring, ratio, p0, T, topk, warps = case
    pos, q_raw, ring_a, blk, comp, sel, sinks, freqs = _case(case, 41)
    q_raw = q_raw * np.float32(0.2)
    dev = kdev("random", T)
    d_out = dev.var(np.full((T, H, hd), np.nan, np.float32))
    ops_pfa.prefill_attention(dev.rt,
                              AttnLayer(dev.const(freqs), dev.const(sinks), H, rd, window, EPS, hd ** -0.5, False),
                              AttnKeys(dev.const(ring_a), dev.const(comp), ratio, dev.const(sel), topk),
                              PrefillRows(dev.const(q_raw), dev.const(pos), dev.const(blk), d_out, T), warps=warps)
    want, mag, counts = twin.prefill_attention(q_raw, ring_a, blk, pos, window, comp, ratio, sel, topk, sinks, freqs,
                                               H, rd, EPS, hd ** -0.5, q_norm=False)
    assert_close_scaled(d_out.download(), want, mag, max(counts) + hd, "prefill attention without q norm")


def test_prefill_attention_is_bit_identical_across_thread_orders(kdev):
    case = CASES[0]
    arrays = _case(case, 7)
    outs = [_launch(kdev(order, 3), case, arrays) for order in ORDERS]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("order", ORDERS)
def test_indexer_and_topk_rows_equal_their_decode_launches(kdev, order):
    ih, ihd, rd, ratio, topk, p0, T = 8, 64, 32, 4, 5, 37, 9
    r = rng(ih, p0, T)
    pos = positions(p0, T)
    freqs = yarn_freqs(rd)
    n_keys = (p0 + T) // ratio + 4
    q_raw = r.standard_normal((T, ih * ihd)).astype(np.float32)
    w_raw = r.standard_normal((T, ih)).astype(np.float32)
    keys = r.standard_normal((n_keys, ihd)).astype(np.float32)
    wscale = twin_idx.weight_scale(ihd, ih)
    dev = kdev(order, 1)
    d_q = dev.var(np.zeros((T, ih * ihd), np.float32))
    iq = IndexQuery(dev.const(freqs), ih, ihd, rd)
    ix = IndexScorer(ih, ihd, wscale, ratio)
    ops_idx.indexer_q_prep_rows(dev.rt, iq, dev.const(q_raw), dev.const(pos), d_q, T)
    q = d_q.download()
    stride = n_keys + 3
    d_sc = dev.var(np.full((T, stride), np.nan, np.float32))
    ops_idx.indexer_scores_rows(dev.rt, ix, ScoreBuffers(d_q, dev.const(w_raw), dev.const(keys), dev.const(pos), d_sc,
                                                         n_keys), T, stride, max_blocks=1)
    sc = d_sc.download()
    d_sel = dev.var(np.full((T, topk), -1, np.int32))
    ops_topk.topk_rows(dev.rt, ops_topk.ScoreRows(d_sc, dev.const(pos), T, stride, ratio), topk, d_sel)
    sel = d_sel.download()
    for t in range(T):
        d_q1 = dev.var(np.zeros(ih * ihd, np.float32))
        ops_idx.indexer_q_prep(dev.rt, iq, dev.const(q_raw[t]), dev.const(pos[t:t + 1]), d_q1)
        np.testing.assert_array_equal(q[t], d_q1.download())
        d_s1 = dev.var(np.full(n_keys, np.nan, np.float32))
        ops_idx.indexer_scores(dev.rt, ix, ScoreBuffers(d_q1, dev.const(w_raw[t]), dev.const(keys),
                                                        dev.const(pos[t:t + 1]), d_s1, n_keys))
        n = (int(pos[t]) + 1) // ratio
        np.testing.assert_array_equal(sc[t, :n], d_s1.download()[:n])
        want, mag = twin_idx.scores(q[t].reshape(ih, ihd), w_raw[t], wscale, keys[:n])
        assert_close_scaled(sc[t, :n], want, mag, ih * ihd, "indexer rows scores")
        d_k1 = dev.var(np.full(topk, -1, np.int32))
        ops_topk.topk(dev.rt, d_s1, topk, d_k1, Visible(pos_slot=dev.const(pos[t:t + 1]), ratio=ratio))
        k = min(n, topk)
        np.testing.assert_array_equal(sel[t, :k], d_k1.download()[:k])
        np.testing.assert_array_equal(sel[t, :k], twin_topk.topk(sc[t, :n], topk)[:k])


@pytest.mark.parametrize("hash_routing", [False, True])
def test_route_rows_equal_their_decode_launches(kdev, hash_routing):
    NX, k, T, vocab = 40, 4, 7, 50
    r = rng(NX, T, hash_routing)
    logits = r.standard_normal((T, NX)).astype(np.float32)
    bias = None if hash_routing else (0.1 * r.standard_normal(NX)).astype(np.float32)
    tid2eid = r.integers(0, NX, (vocab, k)).astype(np.int32) if hash_routing else None
    toks = r.integers(0, vocab, T).astype(np.int32)
    dev = kdev("random", 2)
    d_ids, d_w = dev.var(np.zeros((T, k), np.int32)), dev.var(np.zeros((T, k), np.float32))
    router = ops_route.Router(dev.const(bias), dev.const(tid2eid), NX, k, 1.5, True)
    ops_route.moe_route_rows(dev.rt, router, dev.const(logits), dev.const(toks), Slots(d_ids, d_w, router.k), T)
    ids, w = d_ids.download(), d_w.download()
    for t in range(T):
        d_i1, d_w1 = dev.var(np.zeros(k, np.int32)), dev.var(np.zeros(k, np.float32))
        ops_route.moe_route(dev.rt, router, dev.const(logits[t]), dev.const(toks[t:t + 1]), Slots(d_i1, d_w1, router.k))
        np.testing.assert_array_equal(ids[t], d_i1.download())
        np.testing.assert_array_equal(w[t], d_w1.download())
        want_ids, _ = twin_route.route(logits[t], bias, tid2eid, int(toks[t]), k, 1.5, True)
        np.testing.assert_array_equal(ids[t], want_ids)


def test_prefill_wrappers_reject_bad_shapes():
    rt = None                                            # rejected before any launch
    z = np.zeros
    with pytest.raises(Ds4Error, match="blocks of 64"):
        ops_pfa.kv_rows(rt, KvRow(z(100, np.float32), z(16, np.float32), 100, 32, EPS), z((2, 100), np.float32),
                        z(2, np.int32), z((2, 100), np.float32), 2)
    with pytest.raises(Ds4Error, match="int32"):
        ops_pfa.ring_store(rt, z((2, 64), np.float32), 2, z(2, np.float32), z((4, 64), np.float32))
    with pytest.raises(Ds4Error, match="sel must be"):
        ops_pfa.prefill_attention(rt, AttnLayer(z(16, np.float32), z(4, np.float32), 4, 32, 8, EPS, 0.1),
                                  AttnKeys(z((8, 64), np.float32), z((4, 64), np.float32), 4, z(3, np.int32), 4),
                                  PrefillRows(z((2, 4, 64), np.float32), z(2, np.int32), z((2, 64), np.float32),
                                              z((2, 4, 64), np.float32), 2))


@pytest.mark.parametrize("clamp", [0.0, 1.5])
def test_swiglu(kdev, clamp):
    r = rng(5, int(clamp))
    g, u = (r.standard_normal(1000) * 3).astype(np.float32), (r.standard_normal(1000) * 3).astype(np.float32)
    dev = kdev("reverse", 1)
    d_h = dev.var(np.full(1000, np.nan, np.float32))
    ops_pfa.swiglu(dev.rt, dev.const(g), dev.const(u), d_h, 1000, clamp)
    want = twin.swiglu(g, u, clamp)
    assert_close_scaled(d_h.download(), want, np.abs(want) + 1e-30, 4, "prefill swiglu")


@pytest.mark.parametrize("pieces", [2, 3])
def test_split_bf16(kdev, pieces):
    r = rng(6, pieces)
    x = (r.standard_normal(700) * np.exp(r.uniform(-20, 20, 700))).astype(np.float32)
    x[:4] = [np.inf, -np.inf, np.nan, 0.0]
    dev = kdev("random", 3)
    d_p = [dev.var(np.zeros(700, np.float32)) for _ in range(pieces)]
    ops_pfa.split_bf16(dev.rt, dev.const(x), d_p, 700)
    got = [d.download() for d in d_p]
    for g, w in zip(got, twin.split_bf16(x, pieces)):
        np.testing.assert_array_equal(g, w)
        assert np.all(g.view(np.uint32)[4:] & 0xFFFF == 0)          # bf16 values
    fin = np.isfinite(x)
    err = np.abs(x[fin].astype(np.float64) - sum(g[fin].astype(np.float64) for g in got))
    if pieces == 3:
        assert np.all(err == 0), "three bf16 pieces hold a normal float32 exactly"
    else:
        assert np.all(err <= 2.0 ** -16 * np.abs(x[fin]))       # 16 significant bits survive
