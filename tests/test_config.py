"""ModelConfig: read from GGUF metadata, validated against the tensors (checked against the golden manifest)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ds4py.config import ModelConfig
from ds4py.errors import ConfigError, GGUFError
from ds4py.gguf import GGUFFile


@pytest.fixture(scope="module")
def tiny(golden):
    return GGUFFile(golden / "ds4-tiny" / "tiny.gguf")


@pytest.fixture(scope="module")
def manifest(golden):
    return json.loads((golden / "ds4-tiny" / "gguf_manifest.json").read_text())


def test_fields_follow_metadata(tiny, manifest):
    meta = {k: v["value"] for k, v in manifest["metadata"].items() if "value" in v}
    cfg = ModelConfig.from_gguf(tiny)
    pairs = {
        "n_layers": "block_count", "dim": "embedding_length", "vocab_size": "vocab_size",
        "n_heads": "attention.head_count", "head_dim": "attention.key_length",
        "rope_dim": "rope.dimension_count", "q_lora_rank": "attention.q_lora_rank",
        "o_lora_rank": "attention.output_lora_rank", "o_groups": "attention.output_group_count",
        "window": "attention.sliding_window", "index_heads": "attention.indexer.head_count",
        "index_head_dim": "attention.indexer.key_length", "index_topk": "attention.indexer.top_k",
        "n_experts": "expert_count", "n_experts_used": "expert_used_count",
        "expert_ff": "expert_feed_forward_length", "hash_layers": "hash_layer_count",
        "hc_mult": "hyper_connection.count", "sinkhorn_iters": "hyper_connection.sinkhorn_iterations",
        "rope_orig_ctx": "rope.scaling.original_context_length",
    }
    for field, key in pairs.items():
        assert getattr(cfg, field) == meta["deepseek4." + key], field
    assert list(cfg.compress_ratios) == meta["deepseek4.attention.compress_ratios"]
    assert cfg.compress_rope_base == pytest.approx(meta["deepseek4.attention.compress_rope_freq_base"])
    assert cfg.route_scale == pytest.approx(meta["deepseek4.expert_weights_scale"])
    assert cfg.nope_dim == cfg.head_dim - cfg.rope_dim and cfg.hc_mix == 24


def test_expected_tensors_match_manifest(tiny, manifest):
    cfg = ModelConfig.from_gguf(tiny)
    want = {name: shape for name, (shape, _) in cfg.expected_tensors().items()}
    have = {t["name"]: tuple(reversed(t["ne"])) for t in manifest["tensors"]}
    assert want == have


def test_wrong_shape_names_tensor_and_shape(tiny):
    cfg = dataclasses.replace(ModelConfig.from_gguf(tiny), q_lora_rank=128)
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_q_a\.weight.*expected \[128, 256\]"):
        cfg.check_tensors(tiny)


def test_wrong_layer_pattern_names_missing_tensor(tiny):
    cfg = dataclasses.replace(ModelConfig.from_gguf(tiny), compress_ratios=(0, 4, 4, 128))
    with pytest.raises(GGUFError, match=r"blk\.1\.attn_compressor_kv\.weight.*missing"):
        cfg.check_tensors(tiny)


class _Meta:
    """A GGUFFile stand-in with edited metadata (tensors from the real file)."""

    def __init__(self, f, **edits):
        self.f, self.path, self.edits = f, "edited.gguf", edits

    def meta(self, key, default=...):
        if key in self.edits:
            if self.edits[key] is None:
                if default is ...:
                    raise GGUFError(f"metadata key {key!r} is missing")
                return default
            return self.edits[key]
        return self.f.meta(key, default)

    def tensor(self, *a, **k):
        return self.f.tensor(*a, **k)


def test_missing_key_is_config_error(tiny):
    with pytest.raises(ConfigError, match="attention.q_lora_rank"):
        ModelConfig.from_gguf(_Meta(tiny, **{"deepseek4.attention.q_lora_rank": None}))


def test_inconsistent_metadata(tiny):
    with pytest.raises(ConfigError, match="compress_ratios has 3 entries"):
        ModelConfig.from_gguf(_Meta(tiny, **{"deepseek4.attention.compress_ratios": [0, 0, 4]}))
    with pytest.raises(ConfigError, match="architecture"):
        ModelConfig.from_gguf(_Meta(tiny, **{"general.architecture": "llama"}))
    with pytest.raises(ConfigError, match="head_count_kv"):
        ModelConfig.from_gguf(_Meta(tiny, **{"deepseek4.attention.head_count_kv": 8}))
