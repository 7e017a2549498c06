"""cu/compressor.cu under the CPU emulator against its twin (ds4py/cuda/twins/compressor.py -> ops.compress_pool):
the decode update (ring store, row emitted on the device when the position completes a group) and the prefill
pooling + ring store, for the attention compressors (ratio 4 with overlap, ratio 128; FP8) and the indexer keys
(ratio 4, Hadamard + FP4), at several geometries and positions (first group, ring wrap-around), in every order."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.ops import compressor as ops_comp
from ds4py.cuda.ops.compressor import CompChunk, CompLayer, CompState
from ds4py.cuda.twins import compressor as twin
from ds4py.cuda.twins.attention import assert_fake_quant_close
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.errors import Ds4Error
from ds4py.ref import ops
from tests.cu_emu_device import devices

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")

ORDERS = ("forward", "reverse", "random")
EPS = 1e-6
EPS32 = float(np.finfo(np.float32).eps)
SPARE = 3                     # rollback horizon of these tests' rings


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([11, *seed])


class History:
    """Random compressor inputs for positions 0 .. n-1 (kv, raw scores), an ape table and a norm weight."""

    def __init__(self, r, n: int, d: int, ratio: int, overlap: bool, ape_dtype):
        w = (1 + int(overlap)) * d
        self.kv = (r.standard_normal((n, w)) * 2).astype(np.float32)
        self.sc_raw = (r.standard_normal((n, w)) * 3).astype(np.float32)
        self.ape = (r.standard_normal((ratio, w)) * 0.5).astype(ape_dtype)
        self.norm = (1 + 0.2 * r.standard_normal(d)).astype(np.float32)
        self.sc = twin.scores_with_ape(self.sc_raw, self.ape, np.arange(n), ratio)

    def rings(self, positions, cap: int) -> tuple[np.ndarray, np.ndarray]:
        """Rings holding `positions` (other slots NaN: reading them poisons the result)."""
        kv = np.full((cap, self.kv.shape[1]), np.nan, np.float32)
        sc = kv.copy()
        for p in positions:
            kv[p % cap], sc[p % cap] = self.kv[p], self.sc[p]
        return kv, sc


def check_row(got, h, g, ratio, overlap, freqs, rd, rotate, fake_quant, what):
    row, pre, mag = twin.group_row(h.kv, h.sc, g, ratio, overlap, h.norm, freqs, rd, EPS, rotate, fake_quant)
    d = row.size
    n_terms = d + ratio * (1 + int(overlap))
    tol = 8 * EPS32 * np.sqrt(n_terms) * mag
    if rotate and fake_quant:
        assert_fake_quant_close(got, pre, tol, "fp4", 32, what)
    elif fake_quant:
        assert_fake_quant_close(got[: d - rd], pre[: d - rd], tol[: d - rd], "fp8", 64, what)
        assert_close_scaled(got[d - rd:], pre[d - rd:], mag[d - rd:], n_terms, what)
    else:
        assert_close_scaled(got, pre, mag, n_terms, what)


# d, rd, ratio, overlap, rotate, ape dtype, subs (None: default)
COMPRESSORS = [
    (512, 64, 4, True, False, np.float16, None),      # V4 attention compressor of a ratio-4 layer
    (128, 64, 4, True, True, np.float32, None),       # V4 indexer keys (Hadamard + FP4)
    (192, 64, 128, False, False, np.float16, 3),      # ratio 128, slots split over 3 subs
    (96, 32, 8, False, False, np.float32, 2),         # a smaller head, ratio 8, 2 subs
    (64, 32, 4, True, True, np.float16, 2),           # tiny indexer (v4-tiny), overlap through 2 subs
]


@pytest.mark.parametrize("comp", COMPRESSORS, ids=lambda c: f"d{c[0]}-r{c[2]}-{'idx' if c[4] else 'attn'}")
@pytest.mark.parametrize("order", ORDERS)
def test_compressor_decode(kdev, comp, order):
    d, rd, ratio, overlap, rotate, ape_dt, subs = comp
    cap = twin.ring_capacity(ratio, overlap, SPARE)
    # positions: first group, a middle position (no emission), a ring wrap-around, a later group
    positions = [ratio - 1, ratio + 1, 3 * ratio - 1 + cap, 5 * ratio - 1] if ratio < 64 else [127, 200, 255]
    r = rng(d, ratio)
    h = History(r, max(positions) + 1, d, ratio, overlap, ape_dt)
    freqs = ops.rope_freqs(rd, 160000.0, 16.0, 65536, 32.0, 1.0)
    dev = kdev(order, d)
    layer = CompLayer(dev.const(h.ape), dev.const(h.norm), dev.const(freqs), ratio, overlap, d, rd, EPS, rotate,
                      subs=subs)
    for pos in positions:
        d_kv, d_sc = (dev.var(a) for a in h.rings(range(max(0, pos - cap + 1), pos), cap))
        d_rows = dev.var(np.full(((pos + 1) // ratio + 2, d), np.nan, np.float32))
        ops_comp.compressor_decode(dev.rt, layer, CompState(d_kv, d_sc, d_rows), dev.const(h.kv[pos]),
                                   dev.const(h.sc_raw[pos]), dev.const(np.array([pos], np.int32)))
        ring_kv, ring_sc, rows = d_kv.download(), d_sc.download(), d_rows.download()
        np.testing.assert_array_equal(ring_kv[pos % cap], h.kv[pos])
        np.testing.assert_array_equal(ring_sc[pos % cap], h.sc[pos])    # score + ape, one fp32 add
        g = pos // ratio
        emitted = (pos + 1) % ratio == 0
        untouched = np.arange(rows.shape[0]) != g if emitted else np.ones(rows.shape[0], bool)
        assert np.isnan(rows[untouched]).all(), f"pos {pos}: rows other than the completed group were written"
        if emitted:
            check_row(rows[g], h, g, ratio, overlap, freqs, rd, rotate, True, f"pos {pos} row {g}")


@pytest.mark.parametrize("comp", COMPRESSORS[:3] + COMPRESSORS[4:], ids=lambda c: f"d{c[0]}-r{c[2]}")
@pytest.mark.parametrize("p0,n_tok", [(0, 9), (6, 1), (13, 30), (131, 260)])
def test_compressor_prefill(kdev, comp, p0, n_tok):
    d, rd, ratio, overlap, rotate, ape_dt, subs = comp
    if ratio == 128 and n_tok < 100:
        p0, n_tok = p0 + 100, n_tok + 150                  # make ratio-128 chunks complete groups too
    cap = twin.ring_capacity(ratio, overlap, SPARE)
    r = rng(d, p0, n_tok)
    h = History(r, p0 + n_tok, d, ratio, overlap, ape_dt)
    freqs = ops.rope_freqs(rd, 160000.0, 16.0, 65536, 32.0, 1.0)
    dev = kdev("random", p0 + n_tok)
    d_kv, d_sc = (dev.var(a) for a in h.rings(range(max(0, p0 - cap), p0), cap))
    n_rows = (p0 + n_tok) // ratio + 2
    d_rows = dev.var(np.full((n_rows, d), np.nan, np.float32))
    layer = CompLayer(dev.const(h.ape), dev.const(h.norm), dev.const(freqs), ratio, overlap, d, rd, EPS, rotate,
                      subs=subs)
    ops_comp.compressor_prefill(dev.rt, layer, CompState(d_kv, d_sc, d_rows),
                                CompChunk(dev.const(h.kv[p0:]), dev.const(h.sc_raw[p0:]), n_tok,
                                          dev.const(np.array([p0], np.int32))))
    ring_kv, ring_sc, rows = d_kv.download(), d_sc.download(), d_rows.download()
    done = range(p0 // ratio, (p0 + n_tok) // ratio)
    for g in range(n_rows):
        if g in done:
            check_row(rows[g], h, g, ratio, overlap, freqs, rd, rotate, True, f"prefill row {g}")
        else:
            assert np.isnan(rows[g]).all(), f"row {g} is not completed by this chunk but was written"
    want_kv, want_sc = h.rings(range(max(0, p0 - cap), p0 + n_tok), cap)   # later positions overwrite earlier ones
    np.testing.assert_array_equal(ring_kv, want_kv)
    np.testing.assert_array_equal(ring_sc, want_sc)


def test_decode_equals_prefill_rows(kdev):
    """Feeding positions one by one (decode) and as one chunk (prefill) emits bit-identical rows."""
    d, rd, ratio, overlap, rotate, ape_dt, _ = COMPRESSORS[1]
    n = 21
    cap = twin.ring_capacity(ratio, overlap, SPARE)
    h = History(rng(5), n, d, ratio, overlap, ape_dt)
    freqs = ops.rope_freqs(rd, 160000.0, 16.0, 65536, 32.0, 1.0)
    dev = kdev()
    layer = CompLayer(dev.const(h.ape), dev.const(h.norm), dev.const(freqs), ratio, overlap, d, rd, EPS, rotate)
    rows_a = dev.var(np.full((n // ratio, d), np.nan, np.float32))
    kv_a, sc_a = (dev.var(a) for a in h.rings([], cap))
    pos_slot = dev.var(np.zeros(1, np.int32))
    for pos in range(n):                                 # one slot, rewritten per step (as a graph replay does)
        pos_slot.upload(np.array([pos], np.int32))
        ops_comp.compressor_decode(dev.rt, layer, CompState(kv_a, sc_a, rows_a), dev.const(h.kv[pos]),
                                   dev.const(h.sc_raw[pos]), pos_slot)
    rows_b = dev.var(np.full((n // ratio, d), np.nan, np.float32))
    kv_b, sc_b = (dev.var(a) for a in h.rings([], cap))
    ops_comp.compressor_prefill(dev.rt, layer, CompState(kv_b, sc_b, rows_b),
                                CompChunk(dev.const(h.kv), dev.const(h.sc_raw), n, dev.const(np.array([0], np.int32))))
    np.testing.assert_array_equal(rows_a.download(), rows_b.download())
    np.testing.assert_array_equal(kv_a.download(), kv_b.download())


def test_a_row_past_the_capacity_is_dropped_not_written_out_of_bounds(kdev):
    d, rd, ratio, overlap, rotate, ape_dt, _ = COMPRESSORS[0]
    cap = twin.ring_capacity(ratio, overlap, SPARE)
    pos = 3 * ratio - 1                                  # completes group 2
    h = History(rng(8), pos + 1, d, ratio, overlap, ape_dt)
    dev = kdev()
    d_kv, d_sc = (dev.var(a) for a in h.rings(range(max(0, pos - cap + 1), pos), cap))
    rows = dev.var(np.full((2, d), 7.0, np.float32))     # room for groups 0 and 1 only
    layer = CompLayer(dev.const(h.ape), dev.const(h.norm), dev.const(ops.rope_freqs(rd, 10000.0)), ratio, overlap,
                      d, rd, EPS, rotate)
    ops_comp.compressor_decode(dev.rt, layer, CompState(d_kv, d_sc, rows), dev.const(h.kv[pos]),
                               dev.const(h.sc_raw[pos]), dev.const(np.array([pos], np.int32)))
    assert np.all(rows.download() == 7.0)                # the emulator faults on an out-of-bounds store
    np.testing.assert_array_equal(d_kv.download()[pos % cap], h.kv[pos])


def test_compressor_wrappers_reject_bad_shapes():
    rt = None                                            # rejected before any launch
    z = np.zeros
    with pytest.raises(Ds4Error, match="power of two"):
        ops_comp.compressor_decode(rt, CompLayer(z((4, 192), np.float16), z(96, np.float32), z(16, np.float32), 4,
                                                 True, 96, 32, EPS, True),
                                   CompState(z((11, 192), np.float32), z((11, 192), np.float32),
                                             z((4, 96), np.float32)),
                                   z(192, np.float32), z(192, np.float32), z(1, np.int32))
    with pytest.raises(Ds4Error, match="ape must be"):
        ops_comp.compressor_decode(rt, CompLayer(z((4, 128), np.float16), z(128, np.float32), z(32, np.float32), 4,
                                                 True, 128, 64, EPS, True),
                                   CompState(z((11, 256), np.float32), z((11, 256), np.float32),
                                             z((4, 128), np.float32)),
                                   z(256, np.float32), z(256, np.float32), z(1, np.int32))
