"""The weight schema (ds4py.schema): one declaration from which the expected tensors, the converter's layout,
make-tiny and the forward's typed binding derive. Checked against the golden ds4 GGUF and its manifest."""

from __future__ import annotations

import dataclasses
import json

import pytest
from gguf import GGMLQuantizationType as QT

from ds4py import schema
from ds4py.config import ModelConfig
from ds4py.convert import ds4_layout
from ds4py.gguf import GGUFFile, TensorInfo

# what our writers store per slot, and what the golden ds4 file has there
SLOT_TYPES = {"q8": {QT.Q8_0}, "f16": {QT.F16}, "f32": {QT.F32}, "i32": {QT.I32}, "experts": {QT.IQ2_XXS, QT.Q2_K}}


@pytest.fixture(scope="module")
def tiny(golden):
    return GGUFFile(golden / "ds4-tiny" / "tiny.gguf")


def test_schema_list_is_the_golden_gguf(tiny, golden):
    """Same names in the same order, same shapes, every golden type allowed and equal to our slot's type."""
    cfg = ModelConfig.from_gguf(tiny)
    manifest = json.loads((golden / "ds4-tiny" / "gguf_manifest.json").read_text())
    ours = list(schema.entries(cfg))
    assert [e.name for e in ours] == [t["name"] for t in manifest["tensors"]] == list(tiny.tensors)
    for e, t in zip(ours, manifest["tensors"]):
        assert e.shape == tuple(reversed(t["ne"])) == tiny.tensors[e.name].shape, e.name
        qt = QT[t["type"]]
        assert qt in e.spec.types and qt in SLOT_TYPES[e.spec.slot], (e.name, t["type"], e.spec.slot)
    assert [sp.name for sp in ds4_layout(cfg)] == [e.name for e in ours]
    assert list(schema.model_tensors(cfg)) == [e.name for e in ours]


def test_binding_holds_every_tensor_once(tiny):
    cfg = ModelConfig.from_gguf(tiny)
    b = schema.bind(cfg, tiny.tensor)
    seen = []

    def walk(x):
        if isinstance(x, TensorInfo):
            seen.append(x.name)
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, tuple):
            for y in x:
                walk(y)
        else:
            assert x is None

    walk(b)
    assert sorted(seen) == sorted(tiny.tensors)
    # roles follow the config's predicates, not names: layer 2 (ratio 4) has an indexer, layer 3 (128) not
    assert b.layers[2].attn.index.comp.kv.name == "blk.2.indexer_compressor_kv.weight"
    assert b.layers[3].attn.index is None and b.layers[3].attn.comp.ape.shape == (128, 512)
    assert b.layers[0].attn.comp is None and b.layers[0].ffn.tid2eid is not None and b.layers[0].ffn.route_bias is None
    assert b.layers[3].ffn.tid2eid is None and b.layers[3].ffn.route_bias.name == "blk.3.exp_probs_b.bias"


def test_official_sources_follow_the_layer_and_expert():
    cfg = ModelConfig.v4_flash(n_layers=4, dim=256, vocab_size=512, n_heads=16, n_experts=4,
                               compress_ratios=[0, 0, 4, 128])
    src = {e.name: e.src for e in schema.entries(cfg)}
    assert src["blk.2.indexer_compressor_ape.weight"] == "layers.2.attn.indexer.compressor.ape"
    assert src["blk.1.ffn_down_exps.weight"] == [f"layers.1.ffn.experts.{i}.w2.weight" for i in range(4)]
    assert src["output_hc_fn.weight"] == "hc_head_fn"


def test_roles_come_from_predicates():
    cfg = ModelConfig.v4_flash(n_layers=4, dim=256, vocab_size=512, n_heads=16, compress_ratios=[0, 0, 4, 128])
    r = [cfg.roles(i) for i in range(4)]
    assert [x.compressor for x in r] == [False, False, True, True]
    assert [x.overlap for x in r] == [0, 0, 1, 0] and [x.indexer for x in r] == [False, False, True, False]
    assert r[2].index_ratio == 4 and r[2].index_overlap == 1 and [x.hash_routing for x in r] == [True] * 3 + [False]
    assert cfg.comp_width(2) == 1024 and cfg.comp_width(3) == 512 and cfg.index_comp_width(2) == 256
