"""A long CPU prefill's own parts (issue 35): attention in query tiles of PREFILL_TILE spread over the kernels'
threads (forward.attend with Weights.each), the prefill's temporaries kept in glibc's heap (ref/heap.py), and the
dense Q8_0 products that quantise x themselves taking it unrounded (Weights._act_unless_int8)."""

from __future__ import annotations

import resource
import sys

import numpy as np
import pytest

import ds4py.ref.forward as F
from ds4py.model import Numerics
from ds4py.ref import heap, ops
from ds4py.ref.engine import RefModel
from ds4py.ggml_types import GGMLQuantizationType as Q
from ds4py.quant import jit_i8, jit_i8_gemm
from ds4py.ref.fused import Runner
from ds4py.ref.ops import q8_0_round
from ds4py.ref.weights import Weights

rng = np.random.default_rng(11)


def _case(T: int, p0: int, W: int, ratio: int, H: int = 3, hd: int = 32):
    """One sequence's chunk of T queries at positions p0.. with its window band and compressed rows."""
    pos = np.arange(p0, p0 + T)
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    win_pos = np.arange(max(0, p0 - W + 1), p0 + T)
    win = rng.standard_normal((len(win_pos), hd)).astype(np.float32)
    n_rows = (p0 + T) // ratio
    comp = rng.standard_normal((n_rows, hd)).astype(np.float32)
    visible = np.arange(n_rows)[None, :] < ((pos + 1) // ratio)[:, None]
    sel = visible & (rng.random(visible.shape) < 0.6)              # an indexer's choice among the visible rows
    sink = rng.standard_normal(H).astype(np.float32)
    return q, win, win_pos, comp, sel, pos, sink


def _whole(q, win, win_pos, comp, sel, pos, sink, W):
    """Every query against every key at once: the op the tiles must equal up to fp32 summation order."""
    mask = (win_pos[None, :] <= pos[:, None]) & (win_pos[None, :] > pos[:, None] - W)
    return ops.attention_with_sink(q, np.concatenate([win, comp]), np.concatenate([mask, sel], 1), sink,
                                   q.shape[-1] ** -0.5)


@pytest.mark.parametrize("T,p0", [(F.QUERY_BLOCK + 1, 0), (700, 0), (333, 517)])
def test_prefill_tiles_equal_one_masked_product_on_any_thread_count(T, p0):
    W, ratio = 24, 4
    case = _case(T, p0, W, ratio)
    want = _whole(*case, W)
    tiles = []
    real = ops.attention_with_sink
    try:
        ops.attention_with_sink = lambda q, kv, *a: tiles.append((q.shape[0], kv.shape[0])) or real(q, kv, *a)
        serial = F.attend(*case[:6], case[6], W, ratio)
    finally:
        ops.attention_with_sink = real
    np.testing.assert_allclose(serial, want, rtol=2e-5, atol=2e-6)
    assert max(t for t, _ in tiles) == F.PREFILL_TILE
    # a tile scores its window band and the compressed rows visible to its last query, never the whole chunk
    assert max(k for _, k in tiles) <= F.PREFILL_TILE + W - 1 + (p0 + T) // ratio
    for threads in (2, 3):
        runner = Runner(threads)
        got = F.attend(*case[:6], case[6], W, ratio, each=runner.each)
        np.testing.assert_array_equal(got, serial)                 # the tiles' bits whoever computes them


def test_a_short_chunk_keeps_one_block():
    """Chunks up to QUERY_BLOCK rows (a 128-token prefill, verify steps) keep the one-block product as before."""
    W, ratio = 24, 4
    case = _case(F.QUERY_BLOCK, 40, W, ratio)
    np.testing.assert_array_equal(F.attend(*case[:6], case[6], W, ratio, each=Runner(2).each), _whole(*case, W))


def test_runner_each_runs_every_item_once_and_passes_errors_on():
    seen = []
    Runner(3).each(seen.append, 50)
    assert sorted(seen) == list(range(50))

    def bad(i):
        if i == 7:
            raise ValueError("item 7")

    with pytest.raises(ValueError, match="item 7"):
        Runner(2).each(bad, 20)


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._glibc() is None, reason="glibc's malloc only")
def test_heap_reuse_keeps_a_freed_array_s_pages():
    """Inside reuse() a freed 96 MiB array's pages serve the next one (no fault per page); after it the
    free pages go back (the process's anonymous memory does not keep them)."""
    n = 96 << 18                                                   # float32: 96 MiB, above any mmap threshold

    def faults_of_second_array() -> int:
        a = np.ones(n, np.float32)
        del a
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        b = np.ones(n, np.float32)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        del b
        return after - before

    outside = faults_of_second_array()
    with heap.reuse():
        inside = faults_of_second_array()
    # a fresh mapping faults at least once per 2 MiB (huge pages: numpy asks for them on large arrays), the
    # heap's block not at all
    assert outside >= (n * 4) >> 21 and inside < outside // 4, (outside, inside)

    def rss_anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) << 10

    base = rss_anon()
    with heap.reuse():
        a = np.ones(n, np.float32)
        del a
        assert rss_anon() > base + (n * 4) // 2                      # kept while inside
    assert rss_anon() < base + (16 << 20)                            # given back after


def test_heap_reuse_off_does_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_glibc", lambda: calls.append(1))
    with heap.reuse(False):
        pass
    assert not calls


class _Q8Tensor:
    """A stand-in for a mapped dense Q8_0 matrix (the TensorInfo fields Weights reads)."""

    def __init__(self, raw: np.ndarray, rows: int, cols: int):
        self.qtype, self.shape, self.name, self._raw = Q.Q8_0, (rows, cols), "blk.0.attn_q_a.weight", raw

    def raw_bytes(self) -> np.ndarray:
        return self._raw


@pytest.mark.skipif(not jit_i8_gemm.q8_0_int8(), reason="no AVX-512 VNNI here: dense Q8_0 keeps dequantise + BLAS")
def test_dense_q8_0_takes_x_unrounded_with_the_rounded_products_bits(monkeypatch):
    """Where every product of a dense Q8_0 matrix quantises x itself (int8 decode kernel, q8_0_matmul), linear
    and grouped_linear skip act's rounding: the bits of the rounded x, for prefill and decode rows alike."""
    rows, cols, T = 96, 256, 40
    blocks = np.zeros((rows, cols // 32), dtype=[("d", "<f2"), ("q", "i1", 32)])
    blocks["d"] = rng.uniform(0.001, 0.02, blocks.shape)
    blocks["q"] = rng.integers(-128, 128, blocks["q"].shape)
    raw = blocks.view(np.uint8).reshape(rows, -1)
    t = _Q8Tensor(raw, rows, cols)
    w = Weights(None, act_quant=True, kernels="jit", threads=2, lean=True)
    x = (rng.standard_normal((T, cols)) * 3).astype(np.float32)
    rounded = []
    monkeypatch.setattr(w, "act", lambda t, x: rounded.append(x.shape) or q8_0_round(x))
    for n in (T, 5):                                               # a prefill's rows, then a decode step's
        got = w.linear(t, x[:n])
        np.testing.assert_array_equal(got, jit_i8_gemm.q8_0_matmul(raw, q8_0_round(x[:n]), 2)[:n] if n > 8
                                      else jit_i8.matmul(Q.Q8_0, raw, q8_0_round(x[:n]), 2))
    xg = np.stack([x, x[::-1]], 1)                                 # [T, groups 2, cols]: wo_a's shape
    g = w.grouped_linear(t, xg)
    for k in range(2):
        np.testing.assert_array_equal(g[:, k], jit_i8_gemm.q8_0_matmul(raw[k * rows // 2:(k + 1) * rows // 2],
                                                                       q8_0_round(xg[:, k]), 2))
    assert not rounded


def test_a_long_prefill_equals_the_one_block_attention(v4_gguf, monkeypatch):
    """The whole model: a prefill longer than QUERY_BLOCK with the tiles equals the same prefill with one block
    per QUERY_BLOCK queries (the attention before the tiles) to fp32 summation order under exact numerics."""
    exact = RefModel(v4_gguf, numerics=Numerics(fake_quant=False), kernels="jit", threads=2)
    ids = rng.integers(3, exact.config.vocab_size - 20, F.QUERY_BLOCK + 40)
    got = exact.prefill(exact.new_state(), ids, all_logits=True)
    monkeypatch.setattr(F, "PREFILL_TILE", F.QUERY_BLOCK)
    monkeypatch.setattr(F, "QUERY_BLOCK", 10 ** 9)                   # one block: the attention before the tiles
    want = exact.prefill(exact.new_state(), ids, all_logits=True)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
