"""The V4.1 Flash parts of `convert` (docs/v41.md): the config (official ModelArgs-style inference/config.json or
the HF-style config.json with its text_config), the `deepseek41.*` metadata, the checkpoint tensors that are
not converted, and the Engram table digests.

Everything else (the tensor layout, the writers, FP8 / FP4 decoding) is ds4py.convert's, driven by the weight
schema of the V4.1 ModelConfig.
"""

from __future__ import annotations

import os
from typing import Any

from ds4py import engram
from ds4py.checkpoint import OFFICIAL_FIELDS, ConvertError, official_config
from ds4py.config import ARCH_V41, ModelConfig
from ds4py.errors import ConfigError

# official ModelArgs name -> ModelConfig field (V4.1 adds these to ds4py.checkpoint.OFFICIAL_FIELDS)
V41_FIELDS = {
    "kv_source_layers": "kv_source_layers", "index_source_layers": "index_source_layers",
    "candidate_source_layer": "candidate_source_layer", "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size", "gate_temp": "gate_temp", "engram_layer_ids": "engram_layers",
    "engram_num_embeddings": "engram_rows", "engram_max_ngram_size": "engram_max_ngram",
    "engram_n_heads": "engram_heads", "engram_head_dim": "engram_head_dim", "engram_vocab_size": "engram_bucket_base",
    "engram_pad_id": "engram_pad_id", "engram_compressed_vocab_size": "engram_compressed_vocab",
}
# the DSpark draft's ModelArgs (docs/dspark.md); n_mtp_layers is its stage count when dspark_block_size is set
DSPARK_FIELDS = {
    "dspark_block_size": "dspark_block", "dspark_noise_token_id": "dspark_noise_id",
    "dspark_target_layer_ids": "dspark_targets", "dspark_markov_rank": "dspark_rank",
    "dspark_n_routed_experts": "dspark_experts", "dspark_n_activated_experts": "dspark_experts_used",
}
# HF text_config names -> official ModelArgs names (besides ds4py.convert.CONFIG_ALIASES)
# HF text_config names -> official ModelArgs names (besides ds4py.checkpoint.CONFIG_ALIASES)
V41_ALIASES = {
    "kv_source_layer_ids": "kv_source_layers", "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer", "engram_pad_token_id": "engram_pad_id",
    "scoring_func": "score_func", "gate_temperature": "gate_temp",
}
# keys whose presence marks a V4.1 config
V41_MARKERS = ("kv_source_layers", "index_source_layers", "engram_layer_ids", "candidate_source_layer",
               "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id")
LIST_FIELDS = ("kv_source_layers", "index_source_layers", "engram_layer_ids", "engram_num_embeddings",
               "dspark_target_layer_ids")
INT_FIELDS = ("candidate_source_layer", "candidate_topk_blocks", "candidate_block_size", "engram_max_ngram_size",
              "engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_pad_id", "engram_compressed_vocab_size",
              "dspark_block_size", "dspark_noise_token_id", "dspark_markov_rank", "dspark_n_routed_experts",
              "dspark_n_activated_experts")

# checkpoint tensors V4.1 keeps out of the GGUF, by prefix: (prefix, why)
NOT_CONVERTED = (
    ("mtp.", "DSpark draft stages (the config declares no DSpark draft: no dspark_block_size / n_mtp_layers)"),
    ("vision.", "vision tower (text only)"),
    ("aligner.", "vision aligner (text only)"),
    ("image_", "image span embeddings (text only)"),
    ("engram_hash.", "hash buffers a reference run derived (ds4py derives its own from the vocabulary)"),
)


def is_v41_config(cfg: dict) -> bool:
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    return (str(cfg.get("model_type", "")).startswith("deepseek_v41") or any(k in cfg for k in V41_MARKERS)
            or any(k in text for k in V41_MARKERS))


def shape_from_config(cfg: dict[str, Any]) -> ModelConfig:
    """A V4.1 config.json (ModelArgs or HF style) -> the ModelConfig the GGUF describes."""
    if isinstance(cfg.get("text_config"), dict):            # HF: {"architectures", "text_config", "vision_config"}
        cfg = cfg["text_config"]
    c = official_config(cfg, ("n_layers", "dim", "vocab_size", "n_heads", "compress_ratios"), V41_ALIASES)
    for k in LIST_FIELDS:
        v = c.get(k)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                                              for x in v)):
            raise ConvertError(f"config.json: {k!r} is {str(v)[:40]}, expected a list of integers")
    for k in INT_FIELDS:
        v = c.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ConvertError(f"config.json: {k!r} is {str(v)[:40]}, expected an integer")
    if c.get("score_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise ConvertError(f"config.json: score_func {c['score_func']!r} is not supported (V4.1 uses sqrtsoftplus)")
    if c.get("n_hash_layers", 0):
        raise ConvertError("config.json: V4.1 has no hash-routed layers, but n_hash_layers is set")
    fields = {OFFICIAL_FIELDS[k]: v for k, v in c.items() if k in OFFICIAL_FIELDS and k != "n_hash_layers"}
    fields |= {V41_FIELDS[k]: v for k, v in c.items() if k in V41_FIELDS}
    fields |= dspark_fields(c)
    n = int(fields["n_layers"])
    if len(fields["compress_ratios"]) < n:
        raise ConvertError(f"config: compress_ratios has {len(fields['compress_ratios'])} entries for {n} layers")
    fields["compress_ratios"] = [int(r) for r in fields["compress_ratios"][:n]]     # the rest: DSpark stages
    fields["swiglu_clamp"] = (float(c.get("swiglu_limit", 10.0)),) * n
    if "norm_topk_prob" in c:
        fields["route_norm"] = bool(c["norm_topk_prob"])
    for key in ("max_position_embeddings", "max_seq_len"):   # else the YaRN context (orig x factor)
        if isinstance(c.get(key), int) and c[key] > 0:
            fields["context_length"] = int(c[key])
            break
    try:
        shape = ModelConfig.v41_flash(**fields)
        shape.check_metadata("config.json")
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    if shape.n_heads % shape.o_groups:
        raise ConvertError(f"config: n_heads {shape.n_heads} is not a multiple of o_groups {shape.o_groups}")
    return shape


def dspark_fields(c: dict[str, Any]) -> dict[str, Any]:
    """The DSpark draft's ModelConfig fields from the official args (none when the config declares no draft);
    its MoE defaults to the backbone's, as the official get_moe_config does."""
    from ds4py.checkpoint import ConvertError

    stages = int(c.get("n_mtp_layers", 0) or 0)
    if "dspark_block_size" not in c or stages == 0:
        return {}
    out = {DSPARK_FIELDS[k]: v for k, v in c.items() if k in DSPARK_FIELDS}
    out["dspark_stages"] = stages
    out["dspark_targets"] = tuple(sorted(int(x) for x in out.get("dspark_targets", ())))  # official: layer order
    out.setdefault("dspark_experts", c.get("n_routed_experts", 0))
    out.setdefault("dspark_experts_used", c.get("n_activated_experts", 0))
    ratios = c.get("compress_ratios") or []
    n = int(c["n_layers"])
    if len(ratios) > n and any(int(r) for r in ratios[n:]):
        raise ConvertError(f"config.json: the DSpark stages' compress ratios are {ratios[n:]}; they attend to their "
                           "window only (ratio 0)")
    missing = [k for k in ("dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank") if k not in c]
    if missing:
        raise ConvertError(f"config.json declares a DSpark draft but lacks {', '.join(missing)}")
    return out


def without_draft(s: ModelConfig) -> ModelConfig:
    """The config with no DSpark draft (a checkpoint whose config declares one but holds no mtp.* tensors)."""
    import dataclasses

    return dataclasses.replace(s, dspark_stages=0, dspark_block=0, dspark_noise_id=0, dspark_targets=(),
                               dspark_rank=0, dspark_experts=0, dspark_experts_used=0)


def gguf_metadata(s: ModelConfig, base: list[tuple[str, str, Any]], source_dir: str,
                  digests: list[str]) -> list[tuple[str, str, Any]]:
    """The `deepseek41.*` keys: V4's (renamed; no hash layers) plus the V4.1 ones (docs/v41.md)."""
    A = ARCH_V41 + "."
    out = [(A + k.split(".", 1)[1], t, v) for k, t, v in base if not k.endswith(".hash_layer_count")]
    out += [
        (A + "attention.kv_source_layers", "i32[]", list(s.kv_source_layers)),
        (A + "attention.indexer.source_layers", "i32[]", list(s.index_source_layers)),
        (A + "attention.indexer.candidate_source_layer", "i32", s.candidate_source_layer),
        (A + "attention.indexer.candidate_top_k", "u32", s.candidate_topk_blocks),
        (A + "attention.indexer.candidate_block_size", "u32", s.candidate_block_size),
        (A + "expert_gating_temperature", "f32", s.gate_temp),
    ]
    if s.has_dspark:
        out += [
            (A + "dspark.stage_count", "u32", s.dspark_stages),
            (A + "dspark.block_size", "u32", s.dspark_block),
            (A + "dspark.noise_token_id", "u32", s.dspark_noise_id),
            (A + "dspark.target_layers", "i32[]", list(s.dspark_targets)),
            (A + "dspark.markov_rank", "u32", s.dspark_rank),
            (A + "dspark.expert_count", "u32", s.dspark_experts),
            (A + "dspark.expert_used_count", "u32", s.dspark_experts_used),
        ]
    if s.engram_layers:
        out += [
            (A + "engram.layer_ids", "i32[]", list(s.engram_layers)),
            (A + "engram.table_rows", "i32[]", list(s.engram_rows)),
            (A + "engram.max_ngram_size", "u32", s.engram_max_ngram),
            (A + "engram.head_count", "u32", s.engram_heads),
            (A + "engram.key_length", "u32", s.engram_head_dim),
            (A + "engram.bucket_base", "u32", s.engram_bucket_base),
            (A + "engram.pad_token_id", "u32", s.engram_pad_id),
            (A + "engram.compressed_vocab_size", "u32", s.engram_compressed_vocab),
            (A + "engram.source_dir", "str", os.path.abspath(source_dir)),
            (A + "engram.table_digests", "str[]", digests),
        ]
    return out


def engram_digests(ck, s: ModelConfig) -> list[str]:
    """Per Engram layer, the digest of its table in the checkpoint (checked at load: ds4py.engram), after
    checking the tables' dtypes and shapes; the tables themselves are not converted."""
    out = []
    for e, layer in enumerate(s.engram_layers):
        wn, sn = engram.table_names(layer)
        want = {wn: ("F8_E4M3", (s.engram_rows[e], s.engram_head_dim)),
                sn: ("F8_E8M0", (s.engram_rows[e], s.engram_head_dim // 32))}
        for n, (dt, shape) in want.items():
            if ck.dtype(n) not in (dt, "U8") or tuple(ck.shape(n)) != shape:
                raise ConvertError(f"{ck.src}: Engram table {n!r} is {ck.dtype(n)} {list(ck.shape(n))}, expected {dt} "
                                   f"{list(shape)} from config.json")
        entries = {n: (None, dt, shape) for n, (dt, shape) in want.items()}
        out.append(engram.table_digest(entries, ck.raw(wn), ck.raw(sn)))
        ck.release()
    return out


def skipped(names: list[str], s: ModelConfig) -> tuple[list[str], list[str]]:
    """(notes about the checkpoint tensors left out on purpose, the unexpected rest)."""
    tables = {n for layer in s.engram_layers for n in engram.table_names(layer)}
    notes, other = [], []
    groups: dict[str, int] = {}
    for n in names:
        if n in tables:
            continue
        why = next((w for p, w in NOT_CONVERTED if n.startswith(p)), None)
        if why is None:
            other.append(n)
        else:
            groups[why] = groups.get(why, 0) + 1
    notes = [f"note: skipping {k} tensors: {why}" for why, k in groups.items()]
    if tables:
        notes.append(f"note: the {len(tables) // 2} Engram tables stay in the checkpoint's shards (read at run time "
                     f"with --engram-dir; this folder is recorded as the default)")
    return notes, other
