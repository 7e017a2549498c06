"""ModelConfig: read from GGUF metadata, validated against the tensors (checked against the golden manifest)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ds4py import schema
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
    want = {name: shape for name, (shape, _) in schema.model_tensors(cfg).items()}
    have = {t["name"]: tuple(reversed(t["ne"])) for t in manifest["tensors"]}
    assert want == have


def test_wrong_shape_names_tensor_and_shape(tiny):
    cfg = dataclasses.replace(ModelConfig.from_gguf(tiny), q_lora_rank=128)
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_q_a\.weight.*expected \[128, 256\]"):
        schema.check_tensors(cfg, tiny)


def test_wrong_layer_pattern_names_missing_tensor(tiny):
    cfg = dataclasses.replace(ModelConfig.from_gguf(tiny), compress_ratios=(0, 4, 4, 128))
    with pytest.raises(GGUFError, match=r"blk\.1\.attn_compressor_ape\.weight.*missing"):
        schema.check_tensors(cfg, tiny)


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


V4_FLASH = {  # MODEL.md §1 / §5 values of the published V4 Flash GGUF
    "general.architecture": "deepseek4", "deepseek4.block_count": 43, "deepseek4.context_length": 1048576,
    "deepseek4.embedding_length": 4096, "deepseek4.vocab_size": 129280, "deepseek4.attention.head_count": 64,
    "deepseek4.attention.head_count_kv": 1, "deepseek4.attention.key_length": 512,
    "deepseek4.attention.value_length": 512, "deepseek4.rope.dimension_count": 64,
    "deepseek4.attention.q_lora_rank": 1024, "deepseek4.attention.output_lora_rank": 1024,
    "deepseek4.attention.output_group_count": 8, "deepseek4.attention.sliding_window": 128,
    "deepseek4.attention.layer_norm_rms_epsilon": 1e-6,
    "deepseek4.attention.compress_ratios": [0, 0] + [4, 128] * 20 + [4],
    "deepseek4.attention.compress_rope_freq_base": 160000.0, "deepseek4.attention.indexer.head_count": 64,
    "deepseek4.attention.indexer.key_length": 128, "deepseek4.attention.indexer.top_k": 512,
    "deepseek4.rope.freq_base": 10000.0, "deepseek4.rope.scaling.factor": 16.0,
    "deepseek4.rope.scaling.original_context_length": 65536, "deepseek4.rope.scaling.yarn_beta_fast": 32.0,
    "deepseek4.rope.scaling.yarn_beta_slow": 1.0, "deepseek4.expert_count": 256, "deepseek4.expert_used_count": 6,
    "deepseek4.expert_feed_forward_length": 2048, "deepseek4.expert_shared_count": 1,
    "deepseek4.expert_weights_scale": 1.5, "deepseek4.expert_weights_norm": True, "deepseek4.hash_layer_count": 3,
    "deepseek4.swiglu_clamp_exp": [10.0] * 43, "deepseek4.hyper_connection.count": 4,
    "deepseek4.hyper_connection.sinkhorn_iterations": 20, "deepseek4.hyper_connection.epsilon": 1e-6,
}


class _MetaOnly:
    path = "v4-flash.gguf"

    def meta(self, key, default=...):
        if key in V4_FLASH:
            return V4_FLASH[key]
        if default is ...:
            raise GGUFError(f"metadata key {key!r} is missing")
        return default


def test_full_size_shapes_follow_model_md():
    """The same code gives the published file's tensor shapes (MODEL.md §5, ne reversed)."""
    cfg = ModelConfig.from_gguf(_MetaOnly(), validate=False)
    t = {k: v[0] for k, v in schema.model_tensors(cfg).items()}
    assert len(cfg.compress_ratios) == 43 and cfg.compress_ratios[42] == 4 and cfg.compress_ratios[3] == 128
    assert t["token_embd.weight"] == (129280, 4096) and t["output_hc_fn.weight"] == (4, 16384)
    assert t["blk.0.hc_attn_fn.weight"] == (24, 16384) and t["blk.0.ffn_gate_tid2eid.weight"] == (129280, 6)
    assert t["blk.2.attn_q_b.weight"] == (64 * 512, 1024) and t["blk.2.attn_kv.weight"] == (512, 4096)
    assert t["blk.2.attn_output_a.weight"] == (8 * 1024, 512 * 64 // 8)
    assert t["blk.2.attn_output_b.weight"] == (4096, 8192)
    assert t["blk.2.attn_compressor_kv.weight"] == (1024, 4096) and t["blk.2.attn_compressor_ape.weight"] == (4, 1024)
    assert t["blk.3.attn_compressor_kv.weight"] == (512, 4096) and t["blk.3.attn_compressor_ape.weight"] == (128, 512)
    assert t["blk.2.indexer.attn_q_b.weight"] == (64 * 128, 1024) and t["blk.2.indexer.proj.weight"] == (64, 4096)
    assert t["blk.2.indexer_compressor_ape.weight"] == (4, 256) and "blk.3.indexer.proj.weight" not in t
    assert t["blk.3.ffn_gate_exps.weight"] == (256, 2048, 4096) and t["blk.3.ffn_down_exps.weight"] == (256, 4096, 2048)
    assert t["blk.3.exp_probs_b.bias"] == (256,) and "blk.2.exp_probs_b.bias" not in t
