"""V4.1 Flash's layer map at full depth (40 layers: [0, 0] + [2] x 18 + [1] x 20, kv sources 2/8/14/20, index
sources 2/8/14/20/24/28/32/36, candidate source 20, Engram before blocks 1 and 14) on small random weights: the
official-layout checkpoint is built here, converted, and must give decode == prefill, chunked == whole, with
the state holding rows only on the source layers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ds4py import engram
from ds4py.convert import convert_checkpoint, ds4_layout, scale_name, shape_from_config
from ds4py.model import Numerics
from ds4py.ref.engine import RefModel
from test_convert import write_safetensors

N_LAYERS = 40
CONFIG = {
    "vocab_size": 512, "dim": 64, "moe_inter_dim": 64, "n_layers": N_LAYERS, "n_heads": 2, "n_routed_experts": 4,
    "n_shared_experts": 1, "n_activated_experts": 2, "score_func": "sqrtsoftplus", "route_scale": 1.5,
    "swiglu_limit": 10.0, "q_lora_rank": 32, "head_dim": 32, "rope_head_dim": 16, "norm_eps": 1e-20, "o_groups": 2,
    "o_lora_rank": 32, "window_size": 8, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layers": [2, 8, 14, 20], "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36],
    "compress_rope_theta": 160000.0, "original_seq_len": 32, "rope_theta": 10000, "rope_factor": 4, "beta_fast": 32,
    "beta_slow": 1, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 4, "candidate_source_layer": 20,
    "candidate_topk_blocks": 2, "candidate_block_size": 4, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_vocab_size": 30, "engram_n_heads": 2,
    "engram_head_dim": 32, "engram_pad_id": 2, "engram_compressed_vocab_size": 256, "max_seq_len": 256,
}


def _bf16(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def build_checkpoint(dst) -> None:
    """Random official-layout tensors in the stored dtypes: BF16 dense (fan-in scaled), FP4 experts with e8m0 scales,
    F32 norms ~1 and hc / sink / bias parameters, Engram tables in FP8 with per-row e8m0 scales."""
    cfg = dict(CONFIG)
    h = engram.bucket_primes(2, 4, 2, cfg["engram_vocab_size"])
    cfg["engram_num_embeddings"] = [int(x) for x in h.reshape(2, -1).sum(1)]
    s = shape_from_config(cfg)
    rng = np.random.default_rng(7)
    t = {}
    for sp in ds4_layout(s):
        shp = sp.shape[1:] if sp.slot == "experts" else sp.shape
        for n in sp.src if isinstance(sp.src, list) else [sp.src]:
            if sp.slot == "experts":
                t[n] = ("I8", rng.integers(-128, 128, (shp[0], shp[1] // 2), dtype=np.int8))
                t[scale_name(n)] = ("F8_E8M0", np.full((shp[0], shp[1] // 32), 127 - 4, np.uint8))
            elif "norm" in n or n.endswith(("q_weight", "k_weight")):
                t[n] = ("BF16", _bf16(1 + 0.1 * rng.standard_normal(shp)))
            elif n.endswith(("_base", "_scale", "attn_sink", "gate.bias")):
                t[n] = ("F32", (0.5 * rng.standard_normal(shp)).astype(np.float32))
            elif n.endswith("_fn"):
                t[n] = ("F32", (0.02 * rng.standard_normal(shp)).astype(np.float32))
            else:
                t[n] = ("BF16", _bf16(rng.standard_normal(shp) / np.sqrt(shp[-1])))
    for e, layer in enumerate(s.engram_layers):
        wn, sn = engram.table_names(layer)
        rows = s.engram_rows[e]
        t[wn] = ("F8_E4M3", rng.integers(0, 0x70, (rows, 32), dtype=np.uint8) | (np.uint8(0x80) * rng.integers(
            0, 2, (rows, 32), dtype=np.uint8)))
        t[sn] = ("F8_E8M0", np.full((rows, 1), 127 - 6, np.uint8))
    write_safetensors(dst / "model.safetensors", t)
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from conftest import stub_tokenizer_json

    d = tmp_path_factory.mktemp("v41deep")
    build_checkpoint(d)
    convert_checkpoint(str(d), str(d / "deep.gguf"), dense="f32", tokenizer=stub_tokenizer_json(d / "tok.json"),
                       progress=False)
    return RefModel(str(d / "deep.gguf"), numerics=Numerics(fake_quant=False))


def test_state_lives_on_the_source_layers(model):
    by_layer: dict[int, set] = {}
    for p in model.layout.parts:
        by_layer.setdefault(p.layer, set()).add(p.name)
    for il in range(N_LAYERS):
        names = by_layer[il] - {"win"}
        if il in (2, 8, 14):
            assert names == {"comp_kv", "comp_score", "comp_rows", "idx_keys"}, il
        elif il == 20:
            assert names == {"comp_rows", "idx_keys"}                      # ratio 1: nothing to pool
        elif il == 1:
            assert names == {"ngram_ids"}
        else:
            assert names == set(), il
    ro = model.config.roles
    assert ro(13).kv_source == 8 and ro(13).index_source == 8 and ro(21).kv_source == 20
    assert ro(27).index_source == 24 and ro(24).index_keys == 20 and ro(24).uses_candidates and ro(20).candidate_source


def test_decode_and_chunks_equal_one_prefill(model):
    ids = np.random.default_rng(3).integers(0, 512, 72)
    whole = model.prefill(model.new_state(), ids, all_logits=True)
    assert np.isfinite(whole).all() and whole.std() > 0.1
    st = model.new_state()
    rows = [model.prefill(st, ids[:29], all_logits=True), model.prefill(st, ids[29:45], all_logits=True)]
    rows += [model.decode(st, int(t))[None] for t in ids[45:]]
    rows = np.concatenate(rows)
    assert np.abs(rows - whole).max() <= 1e-4 * max(1.0, float(np.abs(whole).max()))
    assert np.array_equal(rows.argmax(-1), whole.argmax(-1))
