"""Byte accounting of a CUDA model's weights (the bench's roofline and the contract's WeightBytes): the tensors
keep their GGUF formats on the device, so the figures are the reference's."""

from __future__ import annotations

from typing import Any

from ds4py import schema
from ds4py.config import ModelConfig
from ds4py.contract import WeightBytes
from ds4py.cuda import synth
from ds4py.cuda.ops import experts as ops_moe


def per_token(cfg: ModelConfig, binding: Any) -> int:
    """Bytes of weights one decode step reads: every tensor, but one row of the embedding and n_experts_used
    of n_experts of each routed expert tensor."""
    total = 0
    for e in schema.entries(cfg):
        t = synth._lookup(binding, e)
        if e.spec.field == "embed":
            total += t.array.nbytes // t.shape[0]
        elif e.spec.field.startswith("ffn.experts."):              # VQ-8: the codebook is read by every block
            cb = ops_moe.codebook_bytes(t.kernel_format)
            total += cb + (t.array.nbytes - cb) * cfg.n_experts_used // cfg.n_experts
        else:
            total += t.array.nbytes
    return total


def weight_bytes(cfg: ModelConfig, binding: Any) -> WeightBytes:
    """decode = per_token(); routed: the routed experts' bytes (n_experts_used of n_experts); head: the output
    head's."""
    routed = 0
    for e in schema.entries(cfg):
        if e.spec.field.startswith("ffn.experts."):
            routed += synth._lookup(binding, e).array.nbytes * cfg.n_experts_used // cfg.n_experts
    return WeightBytes(per_token(cfg, binding), routed, int(binding.head.array.nbytes))
