"""cu/attention.cu under the CPU emulator against its twin (ds4py/cuda/twins/attention.py, i.e. ds4py/ref/ops.py):
the decode kv store (norm, RoPE, FP8 fake-quant, ring slot) and the two-pass decode attention with sink over window
and compressed rows, at several geometries (ragged head groups, empty key splits, real and tiny head dims), in
forward, reverse and random thread order."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.ops import attention as ops_attn
from ds4py.cuda.ops.attention import AttnKeys, AttnLayer, DecodeBuffers, KvRow
from ds4py.cuda.twins import attention as twin
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.errors import Ds4Error
from ds4py.ref import ops
from tests.cu_emu_device import devices

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")

ORDERS = ("forward", "reverse", "random")
EPS = 1e-6
EPS32 = float(np.finfo(np.float32).eps)


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([7, *seed])


def yarn_freqs(rd: int) -> np.ndarray:
    return ops.rope_freqs(rd, 160000.0, 16.0, 65536, 32.0, 1.0)


@pytest.mark.parametrize("hd,rd,ring,pos", [(512, 64, 144, 0), (96, 32, 20, 37), (192, 64, 24, 1000),
                                            (128, 64, 144, 70001)])
@pytest.mark.parametrize("fake_quant,round_f16", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("order", ORDERS)
def test_kv_store(kdev, hd, rd, ring, pos, fake_quant, round_f16, order):
    r = rng(hd, pos, fake_quant, round_f16)
    kv_raw = (r.standard_normal(hd) * 3).astype(np.float32)
    norm_w = (1 + 0.2 * r.standard_normal(hd)).astype(np.float32)
    freqs = yarn_freqs(rd) if hd != 96 else ops.rope_freqs(rd, 10000.0)
    win = r.standard_normal((ring, hd)).astype(np.float32)
    before = win.copy()
    dev = kdev(order, pos)
    d_win = dev.var(win)
    ops_attn.kv_store(dev.rt, KvRow(dev.const(norm_w), dev.const(freqs), hd, rd, EPS, fake_quant, round_f16),
                      dev.const(kv_raw), dev.const(np.array([pos], np.int32)), d_win)
    win = d_win.download()
    slot = pos % ring
    others = np.arange(ring) != slot
    np.testing.assert_array_equal(win[others], before[others])      # only the position's slot is written
    row, pre, mag = twin.kv_row(kv_raw, norm_w, freqs, pos, rd, EPS, fake_quant, round_f16)
    got, nope = win[slot], hd - rd
    tol = 8 * EPS32 * np.sqrt(hd) * mag
    if round_f16:       # F16 storage on top: the value is an F16 and within its rounding of the fp32 row
        np.testing.assert_array_equal(got, ops.f16_round(got))
        assert np.all(np.abs(got - row) <= np.abs(row) * 2.0 ** -10 + tol)
        return
    if fake_quant:
        twin.assert_fake_quant_close(got[:nope], pre[:nope], tol[:nope], "fp8", 64, "kv fp8 dims")
    else:
        assert_close_scaled(got[:nope], pre[:nope], mag[:nope], hd, "kv non-rope dims")
    assert_close_scaled(got[nope:], pre[nope:], mag[nope:], hd, "kv rope dims")


def test_fp8_fake_quant_is_exact_on_the_grid(kdev):
    """Rows whose normalised, roped values are exact e4m3 grid points times a power of two come back unchanged:
    the quantiser itself adds no error (and a scale off by one binade would change them)."""
    hd, rd = 128, 64
    r = rng(3)
    grid = ops.round_e4m3(np.clip(r.standard_normal(hd).astype(np.float32) * 100, -448, 448))
    grid[::64] = 448.0                                    # every block's max sets the scale exactly
    x = (grid * np.float32(2.0 ** -9)).astype(np.float32)
    ms = float(np.mean(x.astype(np.float64) ** 2))
    norm_w = np.full(hd, np.sqrt(ms + EPS), np.float32)   # undo the RMSNorm (up to rounding)
    dev = kdev()
    d_win = dev.var(np.zeros((4, hd), np.float32))
    ops_attn.kv_store(dev.rt, KvRow(dev.const(norm_w), dev.const(yarn_freqs(rd)), hd, rd, EPS, True, False),
                      dev.const(x), dev.const(np.array([0], np.int32)), d_win)
    win = d_win.download()
    _, pre, mag = twin.kv_row(x, norm_w, yarn_freqs(rd), 0, rd, EPS, True, False)
    twin.assert_fake_quant_close(win[0, :64], pre[:64], 8 * EPS32 * mag[:64], "fp8", 64, "grid row")
    np.testing.assert_array_equal(win[0, :64], ops.fp8_fake_quant(pre[None, :64], 64)[0])


# hd, rd, heads, window, ring, ratio, pos, topk, warps, extra key capacity, target blocks
ATTN_CASES = [
    (96, 32, 8, 16, 20, 4, 43, 8, 2, 40, 6),       # ratio 4: 16 window rows + 8 selected of 11 visible
    (128, 64, 12, 16, 24, 128, 300, 0, 4, 20, 4),  # ratio 128: all 2 visible rows; 12 heads in one 16-head block
    (512, 64, 4, 128, 144, 0, 57, 0, 1, 16, 3),    # window only, before the window is full (58 keys)
    (96, 32, 5, 16, 20, 4, 9, 8, 1, 0, 8),         # ratio 4 with fewer visible rows (2) than topk; 5 heads
    (64, 32, 16, 8, 12, 128, 1023, 0, 2, 33, 5),   # 8 compressed rows, a full window, several splits per head
    (512, 64, 64, 128, 144, 4, 65535, 512, 4, 0, 264),     # V4 Flash at 64K: top 512 of 16K rows
    (512, 64, 64, 128, 144, 128, 65535, 0, 4, 0, 264),     # V4 Flash at 64K, ratio 128: all 512 rows
]


@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"hd{c[0]}-H{c[2]}-r{c[5]}-pos{c[6]}")
@pytest.mark.parametrize("order", ORDERS)
def test_decode_attention(kdev, case, order):
    hd, rd, H, window, ring, ratio, pos, topk, warps, extra, target = case
    r = rng(hd, H, pos)
    q_raw = (r.standard_normal((H, hd)) * 2).astype(np.float32)
    win = r.standard_normal((ring, hd)).astype(np.float32)
    n_vis = (pos + 1) // ratio if ratio else 0
    comp = r.standard_normal((n_vis + 3, hd)).astype(np.float32) if ratio else None
    sel = None
    if ratio == 4:
        sel = np.full(topk + 2, -1, np.int32)
        k = min(n_vis, topk)
        sel[:k] = np.sort(r.choice(n_vis, k, replace=False)) if k < n_vis else np.arange(k)
    sinks = r.standard_normal(H).astype(np.float32)
    freqs = yarn_freqs(rd) if ratio else ops.rope_freqs(rd, 10000.0)
    n_keys = min(pos + 1, window) + (min(n_vis, topk) if ratio == 4 else n_vis)
    plan = ops_attn.attn_plan(H, hd, n_keys + extra, warps=warps, target_blocks=target)
    dev = kdev(order, pos, weights_mib=64)
    d_part_o = dev.var(np.full(plan.part_o_shape, np.nan, np.float32))
    d_part_ml = dev.var(np.full(plan.part_ml_shape, np.nan, np.float32))
    d_out = dev.var(np.full((H, hd), np.nan, np.float32))
    scale = hd ** -0.5
    ops_attn.decode_attention(dev.rt, plan, AttnLayer(dev.const(freqs), dev.const(sinks), H, rd, window, EPS, scale),
                              AttnKeys(dev.const(win), dev.const(comp), ratio, dev.const(sel), topk),
                              DecodeBuffers(dev.const(q_raw), dev.const(np.array([pos], np.int32)), d_part_o,
                                            d_part_ml, d_out))
    out, part_ml = d_out.download(), d_part_ml.download()
    keys = twin.decode_keys(win, ring, window, pos, comp, ratio, sel, topk)
    assert keys.shape[0] == n_keys
    want, mag = twin.decode_attention(q_raw, keys, sinks, freqs, pos, H, rd, EPS, scale)
    assert_close_scaled(out, want, mag, n_keys + hd, f"attention {case}")
    assert plan.splits * plan.keys_per_split >= n_keys + extra
    empty = np.arange(plan.splits) * plan.keys_per_split >= n_keys
    assert np.all(part_ml[:, empty, 0] == -np.inf) and np.all(part_ml[:, empty, 1] == 0)


def test_decode_attention_without_q_norm(kdev):
    """V4.1's queries have no per-head RMS (q_norm=False): the twin without it, over window + selected rows."""
    hd, rd, H, window, ring, ratio, pos, topk = 64, 16, 4, 16, 32, 2, 40, 8
    r = rng(hd, H, pos, 41)
    q_raw = (r.standard_normal((H, hd)) * 0.3).astype(np.float32)
    win = r.standard_normal((ring, hd)).astype(np.float32)
    comp = r.standard_normal((24, hd)).astype(np.float32)
    sel = np.sort(r.choice((pos + 1) // ratio, topk, replace=False)).astype(np.int32)
    sinks = r.standard_normal(H).astype(np.float32)
    freqs = yarn_freqs(rd)
    n_keys = window + topk
    plan = ops_attn.attn_plan(H, hd, n_keys)
    dev = kdev("random", pos)
    d_out = dev.var(np.full((H, hd), np.nan, np.float32))
    ops_attn.decode_attention(dev.rt, plan,
                              AttnLayer(dev.const(freqs), dev.const(sinks), H, rd, window, EPS, hd ** -0.5, False),
                              AttnKeys(dev.const(win), dev.const(comp), ratio, dev.const(sel), topk),
                              DecodeBuffers(dev.const(q_raw), dev.const(np.array([pos], np.int32)),
                                            dev.var(np.zeros(plan.part_o_shape, np.float32)),
                                            dev.var(np.zeros(plan.part_ml_shape, np.float32)), d_out))
    keys = twin.decode_keys(win, ring, window, pos, comp, ratio, sel, topk)
    want, mag = twin.decode_attention(q_raw, keys, sinks, freqs, pos, H, rd, EPS, hd ** -0.5, q_norm=False)
    assert_close_scaled(d_out.download(), want, mag, n_keys + hd, "attention without q norm")


def test_decode_attention_skips_dropped_picks(kdev):
    """V4.1's dropped picks (sel -1: outside the candidate blocks, v41_drop_masked) are no keys: the twin over the
    others; with one tile per split the last splits hold dropped picks only (no NaN, an empty split)."""
    hd, rd, H, window, ring, ratio, pos, topk = 64, 16, 4, 16, 32, 1, 60, 48
    r = rng(hd, H, pos, 43)
    q_raw = (r.standard_normal((H, hd)) * 0.3).astype(np.float32)
    win = r.standard_normal((ring, hd)).astype(np.float32)
    comp = r.standard_normal((64, hd)).astype(np.float32)
    sel = np.sort(r.choice(pos + 1, topk, replace=False)).astype(np.int32)
    sel[[1, 5]] = -1
    sel[16:] = -1                                    # keys 32 .. 63: two whole tiles of dropped picks
    sinks = r.standard_normal(H).astype(np.float32)
    freqs = yarn_freqs(rd)
    plan = ops_attn.attn_plan(H, hd, window + topk, min_tiles=1)
    assert plan.keys_per_split == 16 and plan.splits == 4
    dev = kdev("random", pos)
    d_out = dev.var(np.full((H, hd), np.nan, np.float32))
    d_ml = dev.var(np.zeros(plan.part_ml_shape, np.float32))
    ops_attn.decode_attention(dev.rt, plan,
                              AttnLayer(dev.const(freqs), dev.const(sinks), H, rd, window, EPS, hd ** -0.5, False),
                              AttnKeys(dev.const(win), dev.const(comp), ratio, dev.const(sel), topk),
                              DecodeBuffers(dev.const(q_raw), dev.const(np.array([pos], np.int32)),
                                            dev.var(np.zeros(plan.part_o_shape, np.float32)), d_ml, d_out))
    keys = twin.decode_keys(win, ring, window, pos, comp, ratio, sel, topk)
    assert keys.shape[0] == window + 14
    want, mag = twin.decode_attention(q_raw, keys, sinks, freqs, pos, H, rd, EPS, hd ** -0.5, q_norm=False)
    assert_close_scaled(d_out.download(), want, mag, keys.shape[0] + hd, "attention with dropped picks")
    assert np.all(d_ml.download()[:, 2:, 0] == -np.inf)


def test_attention_is_bit_identical_across_thread_orders(kdev):
    hd, rd, H, window, ring, ratio, pos, topk, warps, extra, target = ATTN_CASES[0]
    r = rng(99)
    q_raw = r.standard_normal((H, hd)).astype(np.float32)
    win = r.standard_normal((ring, hd)).astype(np.float32)
    comp = r.standard_normal((12, hd)).astype(np.float32)
    sel = np.arange(topk, dtype=np.int32)[::-1].copy()
    sinks = np.zeros(H, np.float32)
    plan = ops_attn.attn_plan(H, hd, 40, warps=warps, target_blocks=target)
    outs = []
    for order in ORDERS:
        dev = kdev(order, 5)
        d_out = dev.var(np.zeros((H, hd), np.float32))
        ops_attn.decode_attention(dev.rt, plan,
                                  AttnLayer(dev.const(yarn_freqs(rd)), dev.const(sinks), H, rd, window, EPS,
                                            hd ** -0.5),
                                  AttnKeys(dev.const(win), dev.const(comp), ratio, dev.const(sel), topk),
                                  DecodeBuffers(dev.const(q_raw), dev.const(np.array([pos], np.int32)),
                                                dev.var(np.zeros(plan.part_o_shape, np.float32)),
                                                dev.var(np.zeros(plan.part_ml_shape, np.float32)), d_out))
        outs.append(d_out.download())
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_attention_wrappers_reject_bad_shapes():
    rt = None                                            # rejected before any launch
    with pytest.raises(Ds4Error, match="blocks of 64"):
        ops_attn.kv_store(rt, KvRow(np.zeros(100, np.float32), np.zeros(16, np.float32), 100, 32, EPS),
                          np.zeros(100, np.float32), np.zeros(1, np.int32), np.zeros((4, 100), np.float32))
    with pytest.raises(Ds4Error, match="multiple of 8"):
        ops_attn.attn_plan(4, 100, 64)
    plan = ops_attn.attn_plan(4, 64, 64)
    with pytest.raises(Ds4Error, match="partial buffers"):
        ops_attn.decode_attention(rt, plan, AttnLayer(np.zeros(16, np.float32), np.zeros(4, np.float32), 4, 32, 8,
                                                      EPS, 0.125),
                                  AttnKeys(np.zeros((8, 64), np.float32)),
                                  DecodeBuffers(np.zeros((4, 64), np.float32), np.zeros(1, np.int32),
                                                np.zeros((4, 1, 64), np.float32), np.zeros((4, 1, 2), np.float32),
                                                np.zeros((4, 64), np.float32)))


def test_attention_warps_follow_the_device():
    """4 warps where the key tile leaves one block per SM (GB10 at hd 512), 2 where several fit (H200); no device:
    4 (the most splits, which sizes the workspace's partials)."""
    from ds4py.cuda.devices import profile
    assert ops_attn.attn_warps(profile("gb10"), 64, 512) == 4
    assert ops_attn.attn_warps(profile("h200"), 64, 512) == 2
    assert ops_attn.attn_warps(None, 64, 512) == 4
    for keys in (144, 640, 16384):                    # the workspace (4 warps) holds every device's partials
        assert ops_attn.attn_plan(64, 512, keys, warps=4).splits >= ops_attn.attn_plan(64, 512, keys, warps=2).splits


def test_attention_geometry_follows_the_device_and_the_workspace_holds_it():
    """H200 (several 2-warp blocks per SM): one tile per block, one wave of resident blocks; GB10 and no device:
    the default (4 warps, 2 tiles, 264 blocks). The workspace's partials hold every geometry's splits."""
    from ds4py.cuda.devices import profile
    h200 = ops_attn.attn_geometry(profile("h200"), 64, 512)
    assert (h200.warps, h200.min_tiles) == (2, 1) and h200.target_blocks == 4 * 132
    assert ops_attn.attn_geometry(profile("gb10"), 64, 512) == ops_attn.DEFAULT_GEOMETRY
    assert ops_attn.attn_geometry(None, 64, 512) == ops_attn.DEFAULT_GEOMETRY
    for keys in (58, 144, 640, 16384, 1 << 20):
        room = max(p.splits for p in ops_attn.workspace_plans(64, 512, keys))
        for dev in (None, profile("h200"), profile("gb10")):
            plan = ops_attn.geometry_plan(ops_attn.attn_geometry(dev, 64, 512), 64, 512, keys)
            assert plan.splits <= room and plan.splits * plan.keys_per_split >= keys
    assert ops_attn.geometry_plan(h200, 64, 512, 128).splits == 8         # window only at 2K: 8 one-tile splits
