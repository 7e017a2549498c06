"""What the reference dequantises (only routed experts), and the full model's depth and ratio pattern.

Every dequantisation of weights goes through `ds4py.ref.weights._dequant_rows`; with the cache off
(cache_bytes=0) each use dequantises again, so a spy on it sees exactly which expert matrices a step touches.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

import ds4py.ref.weights as ref_weights
from ds4py.model import Numerics
from ds4py.ref.engine import RefModel
from ds4py.tiny import make_tiny

V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]           # MODEL.md §1: layer 2 -> 4, 3 -> 128, ..., 42 -> 4


@pytest.fixture
def spy(monkeypatch):
    """layer -> list of (tensor name, rows shape) for every expert matrix dequantised."""
    seen: dict[int, list] = defaultdict(list)
    real = ref_weights._dequant_rows

    def dequant(t, raw_rows, shape):
        if "_exps." in t.name:
            seen[int(t.name.split(".")[1])].append((t.name, tuple(shape)))
        return real(t, raw_rows, shape)

    monkeypatch.setattr(ref_weights, "_dequant_rows", dequant)
    return seen


def check_only_routed(model, seen, trace):
    cfg = model.config
    for il in range(cfg.n_layers):
        routed = np.unique(trace.experts[il])
        # 3 matrices (gate, up, down) per routed expert, each exactly one expert's [out, in], never a stack
        assert len(seen[il]) == 3 * len(routed), f"layer {il}: {len(seen[il])} expert matrices for {routed}"
        assert {s for _, s in seen[il]} <= {(cfg.expert_ff, cfg.dim), (cfg.dim, cfg.expert_ff)}


def test_decode_and_prefill_dequantise_only_routed_experts(golden, spy):
    model = RefModel(str(golden / "ds4-tiny" / "tiny.gguf"), cache_bytes=0, kernels="dequant")   # the oracle: counts its dequantisations
    ids = np.load(golden / "ds4-tiny" / "cases.npz")["chat_short/ids"][:9]
    st, tr = model.new_state(), model.new_trace()
    model.prefill(st, ids[:8], trace=tr)
    check_only_routed(model, spy, tr)
    assert any(len(np.unique(tr.experts[il])) < model.config.n_experts for il in range(4))   # a real restriction
    spy.clear()
    tr = model.new_trace()
    model.decode(st, int(ids[8]), trace=tr)
    for il in range(model.config.n_layers):
        assert len(np.unique(tr.experts[il])) == model.config.n_experts_used == 6
    check_only_routed(model, spy, tr)


def test_43_layers_with_the_v4_flash_ratio_pattern(tmp_path, spy):
    """make-tiny with the full model's depth and per-layer ratios (small widths): loads, the first ratio-128
    row is emitted by a decode step (position 127), decode equals prefill, 6 experts touched per layer."""
    path = tmp_path / "deep.gguf"
    make_tiny(str(path), seed=2, n_layers=43, dim=256, vocab_size=300, n_heads=2, head_dim=128, rope_dim=64,
              q_lora_rank=64, o_lora_rank=64, o_groups=2, n_experts=8, n_experts_used=6,
              expert_ff=256, index_heads=2, index_head_dim=64, index_topk=8, window=16)
    model = RefModel(str(path), numerics=Numerics(fake_quant=False), cache_bytes=0, kernels="dequant")
    cfg = model.config
    assert cfg.n_layers == 43 and list(cfg.compress_ratios) == V4_FLASH_RATIOS and cfg.hash_layers == 3
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 128)
    full = model.prefill(model.new_state(), ids)
    st = model.new_state()
    model.prefill(st, ids[:127])
    assert all(st.view(il, "comp_rows").shape[0] == 0 for il in range(3, 43, 2))
    spy.clear()
    tr = model.new_trace()
    last = model.decode(st, int(ids[127]), trace=tr)
    assert all(st.view(il, "comp_rows").shape[0] == 1 for il in range(3, 43, 2))     # ratio-128 row emitted
    assert all(st.view(il, "comp_rows").shape[0] == 32 for il in range(2, 43, 2))    # ratio-4 rows
    np.testing.assert_allclose(last, full, atol=1e-3)
    assert np.isfinite(last).all() and last.std() > 0.1
    for il in range(43):
        assert len(spy[il]) == 3 * 6, f"layer {il}: {len(spy[il])} expert matrices dequantised"
