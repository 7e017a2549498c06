"""cu/v41.cu under the CPU emulator against its twins (ds4py/cuda/twins/v41.py): the window kv row (FP8 in blocks
of 32), the indexer query (RoPE + FP4, no Hadamard), the ratio-2 and ratio-1 compressors (pool, latent, NVFP4 row)
with the ring store, the indexer keys from the latent, the candidate blocks and their mask, Engram's gate.
Fake-quantised outputs are checked exactly against the twin's quantiser applied to the kernel's own pre-quant
values (the same launch without fake-quant): the pre-quant values differ from the twin by summation order only."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.ops import v41 as ops_v41
from ds4py.cuda.ops.attention import KvRow
from ds4py.cuda.ops.compressor import CompState
from ds4py.cuda.ops.indexer import IndexQuery
from ds4py.cuda.ops.topk import ScoreRows
from ds4py.cuda.ops.v41 import CompRows, RawRows
from ds4py.cuda.twins import v41 as twin
from ds4py.ref import ops
from tests.cu_emu_device import devices

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")
F32 = np.float32
EPS = 1e-20
FREQS = ops.rope_freqs(16, 160000.0, 4.0, 32, 32.0, 1.0, v41=True)


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([41, *seed])


def close(got, want, what, rel=2e-6):
    err = np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= rel, f"{what}: max relative error {err:.2e}"


@pytest.mark.parametrize("order", ["forward", "random"])
def test_kv_rows_and_index_q(kdev, order):
    r, dev = rng(1), kdev(order, 1)
    hd, T, ring = 64, 3, 8
    kv = r.standard_normal((T, hd)).astype(F32) * 3
    w = (1 + 0.1 * r.standard_normal(hd)).astype(F32)
    pos = np.array([9, 10, 11], np.int32)
    outs = {}
    for fq in (False, True):
        win = dev.var(np.zeros((ring, hd), F32))
        ops_v41.kv_rows(dev.rt, KvRow(dev.const(w), dev.const(FREQS), hd, 16, EPS, fq),
                        RawRows(dev.const(kv), dev.const(pos), T), win)
        outs[fq] = win.download()[pos % ring]
    for t in range(T):
        _, pre = twin.kv_row(kv[t], w, FREQS, int(pos[t]), EPS, False)
        close(outs[False][t], pre, "kv row")
    assert np.array_equal(outs[True], ops.fp8_fake_quant(outs[False], 32))

    ih, ihd = 4, 64
    q_raw = r.standard_normal((T, ih, ihd)).astype(F32)
    got = {}
    for fq in (False, True):
        q = dev.var(np.zeros((T, ih, ihd), F32))
        ops_v41.index_q(dev.rt, IndexQuery(dev.const(FREQS), ih, ihd, 16, fq), dev.const(q_raw), dev.const(pos), q, T)
        got[fq] = q.download()
    for t in range(T):
        close(got[False][t], twin.index_q(q_raw[t], FREQS, int(pos[t]), False)[1], "index q")
    assert np.array_equal(got[True], ops.fp4_fake_quant(got[False], 32))


@pytest.mark.parametrize("ratio", [1, 2])
def test_compressor_decode_and_block(kdev, ratio):
    """Decode (one position per launch, rings) and a block (all positions at once, the ring holding what came
    before) give the twin's rows, latents and keys."""
    r, dev = rng(2, ratio), kdev("random", ratio)
    d, ihd, P = 64, 64, 13
    kv = r.standard_normal((P, d)).astype(F32)
    sc = r.standard_normal((P, d)).astype(F32) if ratio > 1 else None
    w = (1 + 0.1 * r.standard_normal(d)).astype(F32)
    kn = (1 + 0.1 * r.standard_normal(ihd)).astype(F32)
    n_g = P // ratio
    for fq in (False, True):
        rings = [dev.var(np.zeros((6, d), F32)) for _ in range(2)] if ratio > 1 else [None, None]
        rows, lat = dev.var(np.zeros((n_g + 1, d), F32)), dev.var(np.zeros((1, d), F32))
        keys = dev.var(np.zeros((n_g + 1, ihd), F32))
        lats = {}
        for p in range(P):                                   # decode
            pos = dev.const(np.array([p], np.int32))
            src = CompRows(dev.const(kv[p]), None if sc is None else dev.const(sc[p]), pos, 1, lat)
            ops_v41.compress(dev.rt, KvRow(dev.const(w), dev.const(FREQS), d, 16, EPS, fq), ratio,
                             CompState(*rings, rows), src)
            if ratio > 1:
                ops_v41.comp_ring_store(dev.rt, CompState(*rings, rows), src)
            if (p + 1) % ratio == 0:
                lats[(p + 1) // ratio - 1] = lat.download()[0]
                ops_v41.index_keys(dev.rt, KvRow(dev.const(kn), dev.const(FREQS), ihd, 16, EPS, fq),
                                   RawRows(dev.const(lat.download()[0]), pos, 1), keys, ratio)
        got, got_keys = rows.download(), keys.download()
        for g in range(n_g):
            row, pre, want_lat = twin.group_row(kv, sc, g, ratio, w, FREQS, EPS, False)
            close(lats[g], want_lat, "latent")
            if not fq:
                close(got[g], pre, f"row {g}")
                close(got_keys[g], twin.index_key(lats[g], kn, FREQS, g, ratio, EPS, False)[1], f"key {g}")
            else:
                pre_got = ops.rope_tail(lats[g][None], np.array([g * ratio]), FREQS)
                assert np.array_equal(got[g], ops.nvfp4_fake_quant(pre_got, 16)[0]), f"NVFP4 row {g}"
                kp = ops.rope_tail(ops.rmsnorm(lats[g][None], kn, EPS), np.array([g * ratio]), FREQS)
                close(got_keys[g], ops.fp4_fake_quant(kp, 32)[0], f"FP4 key {g}", rel=0.2)
        if fq:
            continue
        # a block of positions 5..12 after decoding 0..4: the same rows
        a = 5
        rings = [dev.var(np.zeros((6, d), F32)) for _ in range(2)] if ratio > 1 else [None, None]
        if ratio > 1:
            for p in range(a):
                ops_v41.comp_ring_store(dev.rt, CompState(*rings, None),
                                        CompRows(dev.const(kv[p]), dev.const(sc[p]),
                                                 dev.const(np.array([p], np.int32)), 1))
        rows_b, lat_b = dev.var(np.zeros((n_g + 1, d), F32)), dev.var(np.zeros((P - a, d), F32))
        posb = dev.const(np.arange(a, P, dtype=np.int32))
        src = CompRows(dev.const(kv[a:]), None if sc is None else dev.const(sc[a:]), posb, P - a, lat_b)
        ops_v41.compress(dev.rt, KvRow(dev.const(w), dev.const(FREQS), d, 16, EPS, False), ratio,
                         CompState(*rings, rows_b), src)
        gb = rows_b.download()
        for g in range((a + 1) // ratio if ratio > 1 else a, n_g):
            close(gb[g], twin.group_row(kv, sc, g, ratio, w, FREQS, EPS, False)[1], f"block row {g}")
        if ratio > 1:
            ops_v41.comp_ring_store(dev.rt, CompState(*rings, rows_b), src)
            ring_kv = rings[0].download()
            for p in range(P - 6, P):
                assert np.array_equal(ring_kv[p % 6], kv[p])


def test_candidates_and_mask(kdev):
    r, dev = rng(3), kdev("random", 3)
    stride, block, nb = 40, 4, 3
    for p in (0, 2, 9, 17, 30, 39):
        scores = r.standard_normal(stride).astype(F32)
        d_s, cand = dev.var(scores), dev.var(np.full(stride, -7, np.int32))
        pos = dev.const(np.array([p], np.int32))
        ops_v41.candidates(dev.rt, ScoreRows(d_s, pos, 1, stride, 1), cand, nb, block, False)
        n = p + 1
        got = cand.download()
        assert np.array_equal(got[:n], twin.candidates(scores, p, 1, nb, block)), f"candidates at {p}"
        assert (got[n:] == -7).all()
        ops_v41.candidates(dev.rt, ScoreRows(d_s, pos, 1, stride, 1), cand, nb, block, True)
        want = np.where(got[:n] == 1, scores[:n], -np.inf)
        assert np.array_equal(d_s.download()[:n], want.astype(F32))


def _stable_candidates(scores: np.ndarray, p: int, n_blocks: int, block: int) -> np.ndarray:
    """The kernel's tie rule spelled out: the n_blocks best blocks by (score desc, block asc), newest pinned."""
    n = p + 1
    nb = -(-n // block)
    bs = np.full(nb * block, -np.inf, F32)
    bs[:n] = scores[:n]
    bs = bs.reshape(nb, block).max(-1)
    bs[(n - 1) // block] = np.inf
    keep = np.zeros(nb, bool)
    keep[np.argsort(-bs, kind="stable")[:n_blocks]] = True
    return np.repeat(keep, block)[:n].astype(np.int32)


def test_candidates_over_thousands_of_blocks(kdev):
    """The radix select over block scores at a long context (3,000 blocks of 4 rows, two rows as in a prefill
    block) = the twin; with many ties (scores in 3 values) the lower block wins, as spelled out."""
    r, dev = rng(7), kdev("random", 7)
    stride, block, nb = 12000, 4, 8
    pos = np.array([11999, 7001], np.int32)
    scores = r.standard_normal((2, stride)).astype(F32)
    tied = np.round(scores * 0.6).clip(-1, 1).astype(F32)
    for what, sc in (("random", scores), ("tied", tied)):
        cand = dev.var(np.full((2, stride), -7, np.int32))
        ops_v41.candidates(dev.rt, ScoreRows(dev.var(sc), dev.const(pos), 2, stride, 1), cand, nb, block, False)
        got = cand.download()
        for i, p in enumerate(pos):
            n = int(p) + 1
            want = _stable_candidates(sc[i], int(p), nb, block)
            assert np.array_equal(got[i, :n], want), f"{what} row {i}"
            if what == "random":
                assert np.array_equal(want, twin.candidates(sc[i], int(p), 1, nb, block))
            assert len(np.unique(np.nonzero(got[i, :n])[0] // block)) == nb and (got[i, n:] == -7).all()


def test_drop_masked(kdev):
    """After the top-k of masked scores: the picks at -inf (fewer candidate rows than k) become -1, others kept;
    rows read only up to min(k, visible)."""
    r, dev = rng(6), kdev("random", 6)
    stride, k, n_rows = 24, 8, 3
    pos = np.array([2, 11, 23], np.int32)
    scores = r.standard_normal((n_rows, stride)).astype(F32)
    scores[:, ::3] = -np.inf
    sel = np.stack([np.sort(r.choice(p + 1, min(k, p + 1), replace=False)).tolist() + [99] * (k - min(k, p + 1))
                    for p in pos]).astype(np.int32)
    d_sel = dev.var(sel)
    ops_v41.drop_masked(dev.rt, ScoreRows(dev.const(scores), dev.const(pos), n_rows, stride, 1), d_sel, k)
    got = d_sel.download()
    for i, p in enumerate(pos):
        assert np.array_equal(got[i], twin.drop_masked(scores[i], sel[i], int(p), 1, k)), f"row {i}"
    assert (got == -1).any() and (got >= 0).any() and (got[0, 3:] == 99).all()


def test_engram(kdev):
    r, dev = rng(4), kdev("random", 4)
    T, hc, D = 2, 4, 256
    X = r.standard_normal((T, hc, D)).astype(F32)
    kv = r.standard_normal((T, (hc + 1) * D)).astype(F32)
    weight = (r.standard_normal((hc, D)) * r.standard_normal((hc, D))).astype(F32)
    dX = dev.var(X)
    ops_v41.engram(dev.rt, ops_v41.EngramLayer(weight=dev.const(weight), hc=hc, dim=D, eps=EPS), dX, dev.const(kv), T)
    close(dX.download(), twin.engram(X, kv, weight, EPS), "engram")


def test_engram_rows(kdev):
    """Every e4m3 code with scales over the e8m0 range (0 and 255 included): the reference's rows exactly."""
    r, dev = rng(5), kdev("random", 5)
    codes = np.arange(256 * 4, dtype=np.int64).astype(np.uint8).reshape(4, 256)
    scales = r.integers(100, 150, (4, 8)).astype(np.uint8)
    scales[0, 0], scales[0, 1] = 0, 255
    rows = dev.var(np.zeros((4, 256), F32))
    ops_v41.engram_rows(dev.rt, dev.const(codes), dev.const(scales), rows, 4 * 256)
    np.testing.assert_array_equal(rows.download(), twin.engram_rows(codes, scales))
