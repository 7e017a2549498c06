"""Reading an official DeepSeek checkpoint's files: config.json under the official ModelArgs names, and the
safetensors shards' headers. Below the converters (ds4py.convert, ds4py.convert_v41) and the Engram tables
(ds4py.engram), which all read these files; it imports none of them."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any

import numpy as np

from ds4py.config import ModelConfig
from ds4py.errors import Ds4Error


class ConvertError(Ds4Error):
    """The checkpoint cannot be converted: missing/unknown tensor, wrong shape, unknown dtype, bad config."""


# official ModelArgs name (inference/config.json) -> ModelConfig field; anything else in config.json is ignored
OFFICIAL_FIELDS = {
    "n_layers": "n_layers", "dim": "dim", "vocab_size": "vocab_size", "n_heads": "n_heads", "head_dim": "head_dim",
    "rope_head_dim": "rope_dim", "q_lora_rank": "q_lora_rank", "o_groups": "o_groups", "o_lora_rank": "o_lora_rank",
    "n_routed_experts": "n_experts", "n_activated_experts": "n_experts_used", "n_shared_experts": "n_shared_experts",
    "moe_inter_dim": "expert_ff", "n_hash_layers": "hash_layers", "window_size": "window",
    "index_n_heads": "index_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "hc_mult": "hc_mult", "hc_sinkhorn_iters": "sinkhorn_iters", "hc_eps": "hc_eps", "norm_eps": "norm_eps",
    "compress_ratios": "compress_ratios", "rope_theta": "rope_base", "compress_rope_theta": "compress_rope_base",
    "rope_factor": "rope_factor", "original_seq_len": "rope_orig_ctx", "beta_fast": "beta_fast",
    "beta_slow": "beta_slow", "route_scale": "route_scale",
}
# HF-style aliases accepted in config.json besides the official ModelArgs names (inference/config.json).
CONFIG_ALIASES = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "moe_intermediate_size": "moe_inter_dim", "num_experts_per_tok": "n_activated_experts",
    "rms_norm_eps": "norm_eps", "routed_scaling_factor": "route_scale", "num_nextn_predict_layers": "n_mtp_layers",
    "sliding_window": "window_size", "qk_rope_head_dim": "rope_head_dim", "num_hash_layers": "n_hash_layers",
    "index_topk": "index_topk", "o_lora_rank": "o_lora_rank",
}


def read_json(path: str, what: str) -> dict:
    """A JSON object file (config.json, the shard index); anything else is one ConvertError naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            v = json.load(fh)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(v, dict):
        raise ConvertError(f"{path}: {what} must be a JSON object, not {type(v).__name__}")
    return v


def _official_kinds() -> dict[str, str]:
    """Official config.json key -> the kind of value it holds (ModelConfig's field type for the keys it maps)."""
    ann = {f.name: str(f.type) for f in dataclasses.fields(ModelConfig)}
    kinds = {k: "list[int]" if ann[v].startswith("tuple") else ann[v] for k, v in OFFICIAL_FIELDS.items()}
    return kinds | {"swiglu_limit": "float", "n_mtp_layers": "int"}


def _check_config_types(c: dict[str, Any]) -> None:
    """Each field config.json sets must have its field's kind: an integer where a count belongs (not
    "256" or 256.5), a number for ratios and epsilons, a list of integers for compress_ratios."""
    for name, kind in _official_kinds().items():
        if name not in c:
            continue
        v = c[name]
        ok = {"int": isinstance(v, int) and not isinstance(v, bool),
              "float": isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf"),
              "list[int]": isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)}
        if not ok.get(kind, True):
            want = {"int": "an integer", "float": "a number", "list[int]": "a list of integers"}[kind]
            raise ConvertError(f"config.json: {name!r} is {json.dumps(v)[:40]}, expected {want}")
        if kind in ("int", "float"):
            positive = name not in ("n_hash_layers", "n_mtp_layers", "beta_fast", "beta_slow")
            if v < 0 or (positive and v == 0):
                raise ConvertError(f"config.json: {name!r} is {v}, expected a {'positive' if positive else 'non-negative'}"
                                   f" number")


def official_config(cfg: dict[str, Any], required: tuple[str, ...], aliases: dict[str, str] | None = None) -> dict:
    """config.json keys under the official ModelArgs names (HF spellings through CONFIG_ALIASES, then `aliases`
    first), rope_scaling unpacked, the `required` keys present and every value of the right type."""
    aliases = aliases or {}
    c = {aliases.get(k, CONFIG_ALIASES.get(k, k)): v for k, v in cfg.items()}
    rs = c.get("rope_scaling") or {}
    if not isinstance(rs, dict):
        raise ConvertError("config.json: 'rope_scaling' must be an object")
    for src, dst in (("factor", "rope_factor"), ("original_max_position_embeddings", "original_seq_len"),
                     ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
        if src in rs and dst not in c:
            c[dst] = rs[src]
    missing = [k for k in required if k not in c]
    if missing:
        raise ConvertError(f"config.json lacks {', '.join(missing)}")
    _check_config_types(c)
    return c


ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I64": np.int64,
             "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "F8_E4M3": np.uint8,
             "F8_E8M0": np.uint8, "BOOL": np.uint8}


def read_safetensors_header(path: str) -> dict[str, tuple[str, str, tuple[int, ...], int, int]]:
    """name -> (path, dtype, shape, file offset, nbytes), checked against the file's size so that a truncated
    or foreign file is a ConvertError naming it, never a crash in the middle of a conversion."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or n > min(size - 8, 100 << 20):
            raise ConvertError(f"{path}: not a safetensors file, or truncated (header length "
                               f"{n if n is not None else 'missing'}, file size {size})")
        try:
            header = json.loads(fh.read(n))
            if not isinstance(header, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise ConvertError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    base, out = 8 + n, {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (b0, b1) = e["dtype"], tuple(int(d) for d in e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{path}: malformed safetensors entry for tensor {name!r}") from None
        if not 0 <= b0 <= b1 or base + b1 > size:
            raise ConvertError(f"{path}: tensor {name!r} lies beyond the end of the file "
                               f"(bytes {base + b0}..{base + b1} of {size}): the file is truncated")
        item = np.dtype(ST_DTYPES[dt]).itemsize if dt in ST_DTYPES else None
        if item is not None and b1 - b0 != item * int(np.prod(shape, dtype=np.int64)):
            raise ConvertError(f"{path}: tensor {name!r} has {b1 - b0} bytes for {dt} {list(shape)}")
        out[name] = (path, dt, shape, base + b0, b1 - b0)
    return out
