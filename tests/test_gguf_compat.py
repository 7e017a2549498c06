"""GGUF metadata other engines load: ds4py's writers carry every key of ds4's public V4 Flash files, same values.

The published key list below is that of ds4's public V4 Flash GGUFs (the q2 file: IQ2_XXS / Q2_K experts), as
read from their headers and from the loaders that take them (llama.cpp's deepseek4 `load_arch_hparams` requires
`expert_gating_func` = 4, sqrt(softplus), and reads `rope.scaling.type`; without "yarn" it scales linearly).
Keys of those files ds4py does not write, and why, are listed in NOT_WRITTEN. Checked here:
* `convert` (the official golden checkpoint), `make-tiny` and `make-synthetic` files carry every published key;
* the values for V4 Flash's own shape equal the published ones (ds4py's metadata function at V4 Flash's config);
* a ds4py file of ds4-tiny's shape has every key of ds4's golden tiny.gguf, with the same values;
* files without the new keys (ds4's tiny.gguf) still open; a gating function or rope scaling ds4py does not
  compute is refused in one sentence;
* quantize-vq adds the keys a source written before them lacks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGUFReader

from ds4py.config import ModelConfig
from ds4py.convert import general_metadata, gguf_metadata
from ds4py.errors import ConfigError
from ds4py.ggml_types import GGMLQuantizationType as Q
from ds4py.gguf import GGUFFile

A = "deepseek4."
V4_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4]
PUBLISHED = {
    "general.architecture": "deepseek4", "general.type": "model", "general.file_type": 19,
    "general.quantization_version": 2,
    A + "block_count": 43, A + "context_length": 1048576, A + "embedding_length": 4096, A + "vocab_size": 129280,
    A + "attention.head_count": 64, A + "attention.head_count_kv": 1, A + "attention.key_length": 512,
    A + "attention.value_length": 512, A + "attention.q_lora_rank": 1024, A + "attention.output_lora_rank": 1024,
    A + "attention.output_group_count": 8, A + "attention.sliding_window": 128,
    A + "attention.layer_norm_rms_epsilon": 1e-6, A + "attention.compress_ratios": V4_FLASH_RATIOS,
    A + "attention.compress_rope_freq_base": 160000.0, A + "attention.indexer.head_count": 64,
    A + "attention.indexer.key_length": 128, A + "attention.indexer.top_k": 512,
    A + "rope.dimension_count": 64, A + "rope.freq_base": 10000.0, A + "rope.scaling.type": "yarn",
    A + "rope.scaling.factor": 16.0, A + "rope.scaling.original_context_length": 65536,
    A + "rope.scaling.yarn_beta_fast": 32.0, A + "rope.scaling.yarn_beta_slow": 1.0,
    A + "expert_count": 256, A + "expert_used_count": 6, A + "expert_shared_count": 1,
    A + "expert_feed_forward_length": 2048, A + "expert_gating_func": 4, A + "expert_weights_scale": 1.5,
    A + "expert_weights_norm": True, A + "hash_layer_count": 3, A + "swiglu_clamp_exp": [10.0] * 43,
    A + "hyper_connection.count": 4, A + "hyper_connection.sinkhorn_iterations": 20,
    A + "hyper_connection.epsilon": 1e-6,
}
# in some published files, not written by ds4py: what each would say about a ds4py file
NOT_WRITTEN = {
    A + "nextn_predict_layers": "ds4py writes the MTP block to its own file; in the main file a non-zero count "
                                "makes some llama.cpp builds take the last trunk layer for the MTP block",
    "general.size_label": "cosmetic", "general.license": "not ds4py's to state",
    "quantize.imatrix.file": "ds4py's quantisers use no importance matrix",
}


def _values(path: str) -> dict:
    r = GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith(("GGUF.", "tokenizer."))}


def _same(a, b) -> bool:
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-6)
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _published_keys_present(path: str) -> dict:
    got = _values(path)
    missing = sorted(set(PUBLISHED) - set(got))
    assert not missing, f"{path} lacks the published keys {missing}"
    assert not set(NOT_WRITTEN) & set(got)
    return got


def test_the_metadata_of_v4_flash_equals_the_published_keys_and_values():
    s = ModelConfig.v4_flash(n_layers=43, dim=4096, vocab_size=129280, n_heads=64, context_length=1048576,
                             compress_ratios=V4_FLASH_RATIOS)
    tensors = [("blk.0.ffn_gate_exps.weight", Q.IQ2_XXS), ("blk.0.ffn_down_exps.weight", Q.Q2_K),
               ("blk.0.attn_q_a.weight", Q.Q8_0)]
    meta = {k: v for k, _, v in general_metadata(tensors) + gguf_metadata(s)}
    meta["general.architecture"] = "deepseek4"
    assert set(PUBLISHED) <= set(meta), sorted(set(PUBLISHED) - set(meta))
    wrong = {k: (meta[k], v) for k, v in PUBLISHED.items() if not _same(meta[k], v)}
    assert not wrong, wrong
    extra = set(meta) - set(PUBLISHED)           # ds4py's extras are ds4-tiny's (test below): none invented
    assert extra == {A + "expert_group_count", A + "expert_group_used_count"}, extra


def test_convert_make_tiny_and_make_synthetic_write_every_published_key(golden, tmp_path):
    from ds4py.convert import convert_checkpoint
    from ds4py.tiny import make_synthetic, make_tiny

    conv = str(tmp_path / "conv.gguf")
    convert_checkpoint(str(golden / "v4-tiny"), conv, progress=False)
    got = _published_keys_present(conv)
    assert got[A + "expert_gating_func"] == 4 and got[A + "rope.scaling.type"] == "yarn"
    assert got["general.file_type"] == 38                       # MXFP4 experts (ggml's MOSTLY_MXFP4_MOE)
    assert got[A + "rope.scaling.factor"] == 16.0 and got[A + "rope.scaling.original_context_length"] == 64
    tiny = str(tmp_path / "tiny.gguf")
    make_tiny(tiny, experts="q4_k")
    assert _published_keys_present(tiny)["general.file_type"] == 15          # Q4_K experts: MOSTLY_Q4_K_M
    synth = str(tmp_path / "synth.gguf")
    make_synthetic(synth, n_layers=1, vocab_size=512, n_experts=8, index_topk=16)
    got = _published_keys_present(synth)
    assert got["general.file_type"] == 19 and got[A + "embedding_length"] == 4096   # IQ2_XXS gate/up


def test_a_file_of_ds4_tinys_shape_carries_its_keys_with_its_values(golden, tmp_path):
    from ds4py.tiny import make_tiny

    theirs_path = str(golden / "ds4-tiny" / "tiny.gguf")
    theirs = _values(theirs_path)
    s = ModelConfig.from_gguf(GGUFFile(theirs_path))       # read as before: it has neither new key
    assert s.extra["gating_func"] == 4 and s.extra["rope_scaling"] == "yarn"
    ours = {k: v for k, _, v in gguf_metadata(s)}
    missing = sorted(k for k in theirs if k.startswith(A) and k not in ours)
    assert not missing, missing
    wrong = {k: (ours[k], v) for k, v in theirs.items() if k.startswith(A) and not _same(ours[k], v)}
    assert not wrong, wrong
    p = str(tmp_path / "same-shape.gguf")
    make_tiny(p, **{k: getattr(s, k) for k in ("n_layers", "dim", "vocab_size", "n_heads", "head_dim", "rope_dim",
                                               "q_lora_rank", "o_lora_rank", "o_groups", "n_experts",
                                               "n_experts_used", "expert_ff", "index_heads", "index_head_dim",
                                               "index_topk", "window")},
              hash_layers=s.hash_layers, compress_ratios=list(s.compress_ratios))
    written = _values(p)
    assert set(theirs) - {"general.name"} <= set(written)
    assert all(_same(written[k], v) for k, v in theirs.items() if k.startswith(A))


@pytest.mark.parametrize("key,value,msg", [
    ("expert_gating_func", 2, "expert_gating_func is 2, expected 4"),
    ("rope.scaling.type", "linear", "rope.scaling.type is 'linear', expected 'yarn'"),
    ("rope.scaling.type", 3, "metadata deepseek4.rope.scaling.type is int"),
])
def test_a_gating_or_rope_scaling_ds4py_does_not_compute_is_refused_in_one_sentence(golden, key, value, msg):
    f = GGUFFile(str(golden / "ds4-tiny" / "tiny.gguf"))
    real = f.meta

    def meta(k, default=...):
        if k == A + key:
            return value
        return real(k) if default is ... else real(k, default)

    f.meta = meta
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_gguf(f, validate=False)


def test_quantize_vq_adds_the_keys_an_older_source_lacks(golden, tmp_path):
    from ds4py.vq.quantize import Options, quantize_vq

    out = str(tmp_path / "vq.gguf")
    quantize_vq(str(golden / "ds4-tiny" / "tiny.gguf"), out, Options(bits=6, rounds=2, train_per_code=1000),
                progress=False)
    got = _values(out)
    assert got[A + "expert_gating_func"] == 4 and got[A + "rope.scaling.type"] == "yarn"
    assert got["general.type"] == "model" and got["general.quantization_version"] == 2
    assert got["general.file_type"] == 1024                   # no ggml type describes VQ-8 experts
    assert np.isfinite(float(got[A + "rope.scaling.factor"]))
