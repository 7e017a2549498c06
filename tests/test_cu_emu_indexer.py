"""cu/indexer.cu under the CPU emulator against its twin (ds4py/cuda/twins/indexer.py): the indexer query (RoPE,
Hadamard, FP4) and the scores over the visible keys, at several geometries, in forward, reverse and random thread
order."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.ops import indexer as ops_idx
from ds4py.cuda.ops.indexer import IndexQuery, IndexScorer, ScoreBuffers
from ds4py.cuda.twins import indexer as twin
from ds4py.cuda.twins.attention import assert_fake_quant_close
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.errors import Ds4Error
from ds4py.ref import ops
from tests.cu_emu_device import devices

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")

ORDERS = ("forward", "reverse", "random")
EPS32 = float(np.finfo(np.float32).eps)


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([13, *seed])


@pytest.mark.parametrize("ih,ihd,rd,pos", [(64, 128, 64, 70003), (16, 64, 32, 11), (4, 128, 64, 0), (6, 32, 16, 9)])
@pytest.mark.parametrize("order", ORDERS)
def test_indexer_q_prep(kdev, ih, ihd, rd, pos, order):
    r = rng(ih, ihd, pos)
    q_raw = (r.standard_normal((ih, ihd)) * 2).astype(np.float32)
    freqs = ops.rope_freqs(rd, 160000.0, 16.0, 65536, 32.0, 1.0)
    dev = kdev(order, pos)
    args = dev.const(q_raw), dev.const(np.array([pos], np.int32))
    d_q, d_q2 = dev.var(np.full((ih, ihd), np.nan, np.float32)), dev.var(np.full((ih, ihd), np.nan, np.float32))
    ops_idx.indexer_q_prep(dev.rt, IndexQuery(dev.const(freqs), ih, ihd, rd), *args, d_q)
    ops_idx.indexer_q_prep(dev.rt, IndexQuery(dev.const(freqs), ih, ihd, rd, False), *args, d_q2)
    _, pre, mag = twin.q_prep(q_raw, freqs, pos, True)
    assert_fake_quant_close(d_q.download(), pre, 8 * EPS32 * np.sqrt(ihd) * mag, "fp4", 32, "indexer q")
    assert_close_scaled(d_q2.download(), pre, mag, ihd, "indexer q without FP4")


# heads, dim, position, key capacity, most blocks (fewer than tiles: blocks loop over tiles)
SCORE_CASES = [(64, 128, 4 * 300 - 1, 320, 2), (16, 64, 4 * 5 + 2, 64, 8), (4, 128, 4 * 130 - 3, 200, 264),
               (96, 32, 4 * 70 - 1, 100, 3),
               (8, 32, 3, 8, 1)]


@pytest.mark.parametrize("ih,ihd,pos,cap,blocks", SCORE_CASES)
@pytest.mark.parametrize("order", ORDERS)
def test_indexer_scores(kdev, ih, ihd, pos, cap, blocks, order):
    r = rng(ih, ihd, pos, 1)
    n_vis = (pos + 1) // 4
    q = ops.fp4_fake_quant(r.standard_normal((ih, ihd)).astype(np.float32), 32)
    keys = np.full((cap, ihd), np.nan, np.float32)       # rows past the visible ones must not be read
    keys[:n_vis] = ops.fp4_fake_quant(r.standard_normal((n_vis, ihd)).astype(np.float32), 32)
    w_raw = r.standard_normal(ih).astype(np.float32)
    wscale = twin.weight_scale(ihd, ih)
    dev = kdev(order, pos)
    d_scores = dev.var(np.full(cap, np.nan, np.float32))
    ops_idx.indexer_scores(dev.rt, IndexScorer(ih, ihd, wscale),
                           ScoreBuffers(dev.const(q), dev.const(w_raw), dev.const(keys),
                                        dev.const(np.array([pos], np.int32)), d_scores, cap), max_blocks=blocks)
    scores = d_scores.download()
    want, mag = twin.scores(q, w_raw, wscale, keys[:n_vis])
    assert_close_scaled(scores[:n_vis], want, mag, ihd + ih, "indexer scores")
    assert np.isnan(scores[n_vis:]).all(), "scores past the visible keys were written"


@pytest.mark.parametrize("ih,ihd,pos,cap,blocks", [SCORE_CASES[0], SCORE_CASES[1], SCORE_CASES[3]])
def test_indexer_scores_tiles_of_16_keys_give_the_same_bits(kdev, ih, ihd, pos, cap, blocks):
    """The decode launch's 16-key tiles (4x the blocks at short contexts) write the bits of 64-key tiles."""
    r = rng(ih, ihd, pos, 2)
    n_vis = (pos + 1) // 4
    q = ops.fp4_fake_quant(r.standard_normal((ih, ihd)).astype(np.float32), 32)
    keys = np.full((cap, ihd), np.nan, np.float32)
    keys[:n_vis] = ops.fp4_fake_quant(r.standard_normal((n_vis, ihd)).astype(np.float32), 32)
    w_raw = r.standard_normal(ih).astype(np.float32)
    dev = kdev("random", pos)
    out = []
    for tile in (16, 64):
        d_scores = dev.var(np.full(cap, np.nan, np.float32))
        ops_idx.indexer_scores(dev.rt, IndexScorer(ih, ihd, twin.weight_scale(ihd, ih)),
                               ScoreBuffers(dev.const(q), dev.const(w_raw), dev.const(keys),
                                            dev.const(np.array([pos], np.int32)), d_scores, cap),
                               max_blocks=blocks, tile=tile)
        out.append(d_scores.download())
    assert out[0].tobytes() == out[1].tobytes()
    assert np.isnan(out[0][n_vis:]).all() and not np.isnan(out[0][:n_vis]).any()
    assert ops_idx.decode_tile(512, 264) == 16 and ops_idx.decode_tile(16384, 264) == 64


def test_indexer_wrappers_reject_bad_shapes():
    rt = None                                            # rejected before any launch
    z = np.zeros
    with pytest.raises(Ds4Error, match="power of two"):
        ops_idx.indexer_q_prep(rt, IndexQuery(z(16, np.float32), 4, 96, 32), z((4, 96), np.float32), z(1, np.int32),
                               z((4, 96), np.float32))
    with pytest.raises(Ds4Error, match="multiple of 4"):
        ops_idx.indexer_scores(rt, IndexScorer(6, 64, 1.0),
                               ScoreBuffers(z((6, 64), np.float32), z(6, np.float32), z((8, 64), np.float32),
                                            z(1, np.int32), z(8, np.float32), 8))
