"""V4.1 on the engine contract: the declared state (shared compressed rows and indexer keys on their source layers
only, ratio-1 compressors without input rings, the Engram token-id ring), chunked prefill and batched steps,
exact truncate, save / load, and the engine-contract check every backend passes."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.errors import Ds4Error
from ds4py.kv import RING, ROWS
from ds4py.model import Numerics
from ds4py.ref.engine import RefModel
from test_ref_state import check_engine_contract

ATOL = 1e-4              # noquant: summation-order noise only


@pytest.fixture(scope="module")
def model(v41_gguf):
    return RefModel(v41_gguf, numerics=Numerics(fake_quant=False))


@pytest.fixture(scope="module")
def ids(golden):
    return np.load(golden / "v41-tiny" / "cases.npz")["c_ids"]


@pytest.fixture(scope="module")
def whole(model, ids):
    return model.prefill(model.new_state(), ids, all_logits=True)


def test_layout_follows_the_v41_roles(model):
    """Only kv sources hold compressed rows (layer 1: ratio 2, pooling rings of r + R; layer 3: ratio 1, no rings),
    only key owners hold indexer keys, consumers (2, 4) and the key-less index source (5) hold windows only;
    the token ids of the n-gram history live in one int32 ring on the first Engram layer."""
    R, cfg = model.rollback_horizon, model.config
    parts = {p.key: p for p in model.layout.parts}
    assert parts["0.ngram_ids"].kind == RING and parts["0.ngram_ids"].dtype == "<i4"
    assert parts["0.ngram_ids"].capacity == cfg.engram_max_ngram - 1 + R and parts["0.ngram_ids"].width == 1
    assert parts["1.comp_kv"].capacity == 2 + R and parts["1.comp_kv"].width == cfg.head_dim
    assert parts["1.comp_rows"].period == 2 and parts["1.idx_keys"].period == 2
    assert parts["1.idx_keys"].width == cfg.index_head_dim and parts["3.idx_keys"].period == 1
    assert parts["3.comp_rows"].kind == ROWS and "3.comp_kv" not in parts and "3.comp_score" not in parts
    for il in (2, 4, 5):
        assert sorted(p.name for p in model.layout.parts if p.layer == il) == ["win"], il
    assert not any(p.name in ("idx_kv", "idx_score") for p in model.layout.parts)


def test_engine_contract(model, ids):
    check_engine_contract(model, ids)


def test_chunked_prefill_and_decode_equal_one_prefill(model, ids, whole):
    """Chunks that split ratio-2 groups and the n-gram history (odd sizes, a single token) give the logits of one
    prefill, within summation-order noise and with the same top-1."""
    st, rows = model.new_state(), []
    for a, b in ((0, 7), (7, 8), (8, 41), (41, 42), (42, 43), (43, 120), (120, 200)):
        rows.append(model.prefill(st, ids[a:b], all_logits=True))
    rows = np.concatenate(rows)
    assert np.abs(rows - whole).max() <= ATOL
    assert np.array_equal(rows.argmax(-1), whole.argmax(-1))


def test_batched_step_equals_separate_calls(model, ids, whole):
    """Two sequences at different lengths in one step (prefill rows and a decode row together)."""
    a, b = model.new_state(), model.new_state()
    model.prefill(a, ids[:60])
    la, lb = model.step([a, b], [ids[60:61], ids[:33]])
    assert np.abs(la - whole[60]).max() <= ATOL and np.abs(lb - whole[32]).max() <= ATOL
    la, lb = model.step([a, b], [ids[61:75], ids[33:34]], all_logits=True)
    assert np.abs(la - whole[61:75]).max() <= ATOL and np.abs(lb - whole[33:34]).max() <= ATOL


def test_truncate_is_exact(model, ids):
    """Feeding other tokens, truncating and re-feeding gives bit for bit the logits of never having fed them:
    the shared rows, the indexer keys, the ratio-2 pooling rings and the n-gram ring are all rolled back."""
    ref = model.new_state()
    model.prefill(ref, ids[:101])
    want = model.prefill(ref, ids[101:110], all_logits=True)
    st = model.new_state()
    model.prefill(st, ids[:101])
    model.prefill(st, ids[::-1][:9])                           # 9 other tokens (odd: ends mid ratio-2 group)
    st.truncate(101)
    got = model.prefill(st, ids[101:110], all_logits=True)
    assert np.array_equal(got, want)


def test_save_load_round_trip_covers_the_ngram_ring(model, ids):
    """A saved state continues exactly; its blob holds the n-gram ring, which matters: the same state with
    the ring's history cleared gives other logits."""
    st = model.new_state()
    model.prefill(st, ids[:77])
    blob = model.save_state(st)
    back = model.load_state(blob)
    assert model.save_state(back) == blob
    want = model.decode(st, int(ids[77]))
    assert np.array_equal(model.decode(back, int(ids[77])), want)
    cleared = model.load_state(blob)
    cleared.ring(0, "ngram_ids")[:] = 0
    assert np.abs(model.decode(cleared, int(ids[77])) - want).max() > 1e-3


def test_v41_only_options_are_refused_on_v4(v4_gguf):
    with pytest.raises(Ds4Error, match="V4.1 models only"):
        RefModel(v4_gguf, engram_dir="/tmp")
