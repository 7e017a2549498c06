"""The reference's sparse attention: a query of an indexer layer attends its window plus its top-k compressed
rows, gathered (`forward.attention_with_picks`), never every compressed row, so a long prefill is linear in
its length. The gathered path gives the dense masked path's numbers up to fp32 summation order: checked op by
op, on the golden v4-tiny cases with the path forced on, and by the key counts a long prompt reaches."""

from __future__ import annotations

import numpy as np
import pytest

import ds4py.ref.forward as F
from ds4py.model import Numerics
from ds4py.ref import ops
from ds4py.ref.engine import RefModel
from ds4py.tiny import make_tiny

rng = np.random.default_rng(7)


def test_topk_rows_is_the_mask_set():
    s = rng.standard_normal((40, 30)).astype(np.float32)
    s[np.arange(40)[:, None] < np.arange(30)[None, :] // 2] = -np.inf     # causal: early rows see few columns
    for k in (1, 5, 16, 30, 64):
        idx, valid = F.topk_rows(s, k)
        assert idx.shape == valid.shape == (40, min(k, 30))
        sel = np.zeros(s.shape, bool)
        np.put_along_axis(sel, idx, valid, axis=1)
        np.testing.assert_array_equal(sel, F.topk_mask(s, k))
        assert np.isfinite(np.take_along_axis(s, idx, 1)[valid]).all()


@pytest.mark.parametrize("k", [1, 4, 12])
def test_attention_with_picks_equals_the_masked_dense_op(k):
    B, H, hd, Nw, N = 9, 3, 32, 14, 20
    q = rng.standard_normal((B, H, hd)).astype(np.float32)
    win = rng.standard_normal((Nw, hd)).astype(np.float32)
    comp = rng.standard_normal((N, hd)).astype(np.float32)
    sink = rng.standard_normal(H).astype(np.float32)
    win_mask = rng.random((B, Nw)) < 0.5
    win_mask[:, 0] = True
    scores = rng.standard_normal((B, N)).astype(np.float32)
    scores[:3, k // 2:] = -np.inf                                  # some queries have fewer than k valid picks
    idx, valid = F.topk_rows(scores, k)
    got = F.attention_with_picks(q, win, win_mask, comp, idx, valid, sink, hd ** -0.5)
    want = ops.attention_with_sink(q, np.concatenate([win, comp]),
                                   np.concatenate([win_mask, F.topk_mask(scores, k)], 1), sink, hd ** -0.5)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.fixture(scope="module")
def gold(golden):
    return np.load(golden / "v4-tiny" / "cases.npz")


def test_gathered_path_matches_the_official_code(v4_gguf, gold, monkeypatch):
    """With the gathered path forced on (the golden cases are short enough that the dense path serves them),
    every v4-tiny case matches DeepSeek's official code to fp32 noise with the same top-1 everywhere (noquant:
    no fake-quant rounding boundary can amplify summation order)."""
    monkeypatch.setattr(F, "DENSE_ROWS", 0)
    calls = []
    real = F.attention_with_picks
    monkeypatch.setattr(F, "attention_with_picks", lambda *a: calls.append(a[3].shape) or real(*a))
    model = RefModel(v4_gguf, numerics=Numerics(fake_quant=False))
    for c in "abcd":
        ids, P = gold[f"{c}_ids"], int(gold[f"{c}_P"])
        got = model.prefill(model.new_state(), ids, all_logits=True)
        pos = gold[f"{c}_consistency_positions_noquant"]
        want = gold[f"{c}_consistency_prefill_logits_noquant"]
        np.testing.assert_array_equal(got[pos].argmax(-1), want.argmax(-1))
        assert np.abs(got[pos] - want).max() <= 1e-4
        st = model.new_state()
        model.prefill(st, ids[:P])
        dec, want = np.array([model.decode(st, int(t)) for t in ids[P:]]), gold[f"{c}_decode_logits_noquant"]
        np.testing.assert_array_equal(dec.argmax(-1), want.argmax(-1))
        assert np.abs(dec - want).max() <= 1e-4
    assert calls, "the gathered path did not run"


def test_long_prompt_attends_window_and_picks_only(tmp_path, monkeypatch):
    """A prompt with many more compressed rows than DENSE_ROWS: every attention call of the indexer layer is
    the gathered one with exactly top-k rows per query, whatever the context; the dense op only ever sees the
    window band and (ratio-128 layer) its few rows. Chunked prefill equals one prefill to fp32 noise."""
    p = tmp_path / "m.gguf"
    make_tiny(str(p), seed=4, n_layers=4, vocab_size=300, n_heads=2, head_dim=128, rope_dim=64, q_lora_rank=64,
              o_lora_rank=32, o_groups=2, n_experts=4, n_experts_used=2, index_topk=8, window=32)
    model = RefModel(str(p), numerics=Numerics(fake_quant=False))
    cfg = model.config
    T = 4 * (F.DENSE_ROWS + 64)                    # the ratio-4 layer ends with DENSE_ROWS + 64 compressed rows
    ids = np.random.default_rng(1).integers(3, cfg.vocab_size - 20, T)
    picks, dense = [], []
    real_p, real_d = F.attention_with_picks, ops.attention_with_sink
    monkeypatch.setattr(F, "attention_with_picks", lambda *a: picks.append(a[4].shape) or real_p(*a))
    monkeypatch.setattr(ops, "attention_with_sink", lambda q, kv, *a: dense.append(kv.shape[0]) or real_d(q, kv, *a))
    st = model.new_state()
    chunked = np.concatenate([model.step([st], [ids[i:i + 100]], all_logits=True)[0] for i in range(0, T, 100)])
    assert picks and all(k == cfg.index_topk for _, k in picks)
    assert max(dense) <= F.QUERY_BLOCK + cfg.window - 1 + T // 128
    monkeypatch.setattr(F, "attention_with_picks", real_p)
    monkeypatch.setattr(ops, "attention_with_sink", real_d)
    whole = model.prefill(model.new_state(), ids, all_logits=True)
    np.testing.assert_array_equal(chunked.argmax(-1), whole.argmax(-1))
    assert np.abs(chunked - whole).max() < 1e-4
