"""cu/indexer.cu and cu/topk.cu under the CPU emulator against their twins (ds4py/cuda/twins/indexer.py):
the indexer query (RoPE, Hadamard, FP4), the scores over the visible keys, and the exact top-k by radix select
(the set of ref/forward.topk_mask when the threshold has no ties; ties go to the lowest indices), at several
geometries, in forward, reverse and random thread order."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.ops import indexer as ops_idx
from ds4py.cuda.twins import indexer as twin
from ds4py.cuda.twins.attention import assert_fake_quant_close
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.errors import Ds4Error
from ds4py.ref import ops
from ds4py.ref.forward import topk_mask
from tests.emu_launch import EmuLaunch

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")

ORDERS = ("forward", "reverse", "random")
EPS32 = float(np.finfo(np.float32).eps)


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([13, *seed])


@pytest.mark.parametrize("ih,ihd,rd,pos", [(64, 128, 64, 70003), (16, 64, 32, 11), (4, 128, 64, 0), (6, 32, 16, 9)])
@pytest.mark.parametrize("order", ORDERS)
def test_indexer_q_prep(ih, ihd, rd, pos, order):
    r = rng(ih, ihd, pos)
    q_raw = (r.standard_normal((ih, ihd)) * 2).astype(np.float32)
    freqs = ops.rope_freqs(rd, 160000.0, 16.0, 65536, 32.0, 1.0)
    q = np.full((ih, ihd), np.nan, np.float32)
    ops_idx.indexer_q_prep(EmuLaunch("indexer", order=order, seed=pos), q_raw, freqs, np.array([pos], np.int32), q,
                           ih, ihd, rd)
    _, pre, mag = twin.q_prep(q_raw, freqs, pos, True)
    assert_fake_quant_close(q, pre, 8 * EPS32 * np.sqrt(ihd) * mag, "fp4", 32, "indexer q")
    q2 = np.full((ih, ihd), np.nan, np.float32)
    ops_idx.indexer_q_prep(EmuLaunch("indexer"), q_raw, freqs, np.array([pos], np.int32), q2, ih, ihd, rd, False)
    assert_close_scaled(q2, pre, mag, ihd, "indexer q without FP4")


# heads, dim, position, key capacity, most blocks (fewer than tiles: blocks loop over tiles)
SCORE_CASES = [(64, 128, 4 * 300 - 1, 320, 2), (16, 64, 4 * 5 + 2, 64, 8), (4, 128, 4 * 130 - 3, 200, 264),
               (96, 32, 4 * 70 - 1, 100, 3),
               (8, 32, 3, 8, 1)]


@pytest.mark.parametrize("ih,ihd,pos,cap,blocks", SCORE_CASES)
@pytest.mark.parametrize("order", ORDERS)
def test_indexer_scores(ih, ihd, pos, cap, blocks, order):
    r = rng(ih, ihd, pos, 1)
    n_vis = (pos + 1) // 4
    q = ops.fp4_fake_quant(r.standard_normal((ih, ihd)).astype(np.float32), 32)
    keys = np.full((cap, ihd), np.nan, np.float32)       # rows past the visible ones must not be read
    keys[:n_vis] = ops.fp4_fake_quant(r.standard_normal((n_vis, ihd)).astype(np.float32), 32)
    w_raw = r.standard_normal(ih).astype(np.float32)
    wscale = twin.weight_scale(ihd, ih)
    scores = np.full(cap, np.nan, np.float32)
    ops_idx.indexer_scores(EmuLaunch("indexer", order=order, seed=pos), q, w_raw, wscale, keys,
                           np.array([pos], np.int32), scores, ih, ihd, cap, max_blocks=blocks)
    want, mag = twin.scores(q, w_raw, wscale, keys[:n_vis])
    assert_close_scaled(scores[:n_vis], want, mag, ihd + ih, "indexer scores")
    assert np.isnan(scores[n_vis:]).all(), "scores past the visible keys were written"


def tie_scores(r, n: int) -> np.ndarray:
    """Scores with many exact ties (a few distinct values), including at any threshold."""
    return r.choice(np.array([-2.5, -0.0, 0.0, 0.5, 1.0, 3.0, 7.25], np.float32), n)


@pytest.mark.parametrize("n,k", [(10, 16), (300, 16), (3000, 512), (20000, 512), (5, 5), (1025, 1024)])
@pytest.mark.parametrize("order", ORDERS)
def test_topk(n, k, order):
    r = rng(n, k)
    s = r.standard_normal(n).astype(np.float32)
    out = np.full(k + 3, -7, np.int32)
    pos = 4 * n + 2                                       # (pos + 1) // 4 = n visible rows
    ops_idx.topk(EmuLaunch("topk", order=order, seed=n), s, k, out, pos_slot=np.array([pos], np.int32))
    m = min(n, k)
    np.testing.assert_array_equal(out[:m], twin.topk(s, k))
    assert np.all(out[m:] == -7)
    np.testing.assert_array_equal(np.flatnonzero(topk_mask(s[None], k)[0]), out[:m])   # the reference's set


@pytest.mark.parametrize("n,k", [(700, 16), (17000, 512), (64, 63)])
def test_topk_ties_go_to_the_lowest_indices(n, k):
    r = rng(n, k, 2)
    s = tie_scores(r, n)
    out = np.zeros(k, np.int32)
    ops_idx.topk(EmuLaunch("topk", order="random", seed=1), s, k, out, n=n)
    want = twin.topk(s, k)
    np.testing.assert_array_equal(out, want)
    kth = np.sort(s)[::-1][k - 1]
    assert np.all(s[out] >= kth) and np.sum(s > kth) <= k   # the same values as any top-k: only ties differ


def test_topk_extreme_values():
    s = np.array([np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 1.0, 1.0], np.float32)
    for k in range(1, len(s)):
        out = np.zeros(k, np.int32)
        ops_idx.topk(EmuLaunch("topk"), s, k, out, n=len(s))
        np.testing.assert_array_equal(out, twin.topk(s, k), err_msg=f"k={k}")


def test_indexer_wrappers_reject_bad_shapes():
    rt = EmuLaunch("indexer", "topk")
    z = np.zeros
    with pytest.raises(Ds4Error, match="power of two"):
        ops_idx.indexer_q_prep(rt, z((4, 96), np.float32), z(16, np.float32), z(1, np.int32), z((4, 96), np.float32),
                               4, 96, 32)
    with pytest.raises(Ds4Error, match="multiple of 4"):
        ops_idx.indexer_scores(rt, z((6, 64), np.float32), z(6, np.float32), 1.0, z((8, 64), np.float32),
                               z(1, np.int32), z(8, np.float32), 6, 64, 8)
    with pytest.raises(Ds4Error, match="room for k"):
        ops_idx.topk(rt, z(10, np.float32), 8, z(4, np.int32), n=10)
