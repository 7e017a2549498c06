"""Model hyper-parameters, read from a GGUF's `deepseek4.*` metadata and checked against its tensors.

    cfg = ModelConfig.from_gguf(GGUFFile("model.gguf"))     # ConfigError / GGUFError on any mismatch

Nothing here assumes the full-size model: the tiny golden models (256-wide, 96-dim heads, window 16, ...)
and the 43-layer V4 Flash file go through the same code. See MODEL.md §1 and §5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gguf import GGMLQuantizationType as Q

from ds4py.errors import ConfigError, GGUFError
from ds4py.quant import BLOCK as QUANT_BLOCK

ARCH = "deepseek4"

# Types a weight matrix may be stored in: whatever ds4py.quant decodes (ds4 files use F16/Q8_0/IQ2_XXS/Q2_K/Q4_K;
# our converter adds MXFP4/F32).
MATRIX_TYPES = tuple(QUANT_BLOCK)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)     # norms, hc parameters, sinks, biases, ape, compressor/indexer linears
INT_TYPES = (Q.I32, Q.I64, Q.I16)        # tid2eid


# The JSON-like kind of every `deepseek4.*` value read (GGUF stores a type per value; a file with a string where
# a count belongs, or ratios as strings, is refused by name instead of failing inside int()).
META_KINDS = {
    "block_count": "int", "embedding_length": "int", "vocab_size": "int", "context_length": "int",
    "attention.head_count": "int", "attention.head_count_kv": "int", "attention.key_length": "int",
    "attention.value_length": "int", "rope.dimension_count": "int", "attention.q_lora_rank": "int",
    "attention.output_lora_rank": "int", "attention.output_group_count": "int", "attention.sliding_window": "int",
    "attention.layer_norm_rms_epsilon": "float", "attention.compress_ratios": "ints",
    "rope.freq_base": "float", "attention.compress_rope_freq_base": "float", "rope.scaling.factor": "float",
    "rope.scaling.original_context_length": "int", "rope.scaling.yarn_beta_fast": "float",
    "rope.scaling.yarn_beta_slow": "float", "attention.indexer.head_count": "int",
    "attention.indexer.key_length": "int", "attention.indexer.top_k": "int", "expert_count": "int",
    "expert_used_count": "int", "expert_feed_forward_length": "int", "expert_shared_count": "int",
    "expert_weights_scale": "float", "expert_weights_norm": "bool", "hash_layer_count": "int",
    "swiglu_clamp_exp": "floats", "hyper_connection.count": "int", "hyper_connection.sinkhorn_iterations": "int",
    "hyper_connection.epsilon": "float",
}
_KIND_NAMES = {"int": "an integer", "float": "a number", "bool": "a boolean", "ints": "an array of integers",
               "floats": "an array of numbers"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


_KIND_CHECKS = {"int": _is_int, "float": _is_num, "bool": lambda v: isinstance(v, bool),
                "ints": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
                "floats": lambda v: isinstance(v, list) and all(_is_num(x) for x in v)}


def _describe(v: Any) -> str:
    kind = "a string" if isinstance(v, str) else "an array" if isinstance(v, list) else \
        "a boolean" if isinstance(v, bool) else "a non-finite number" if isinstance(v, float) else type(v).__name__
    text = repr(v)
    return f"{kind} ({text[:40] + '...' if len(text) > 40 else text})"


def check_metadata_types(f) -> None:
    """ConfigError naming the first `deepseek4.*` (or token id) metadata value of the wrong type."""
    keys = {f"{ARCH}.{k}": kind for k, kind in META_KINDS.items()}
    keys.update({"tokenizer.ggml.bos_token_id": "int", "tokenizer.ggml.eos_token_id": "int"})
    for key, kind in keys.items():
        v = f.meta(key, None)
        if v is not None and not _KIND_CHECKS[kind](v):
            raise ConfigError(f"{f.path}: metadata {key} is {_describe(v)}, expected {_KIND_NAMES[kind]}")


# Plausible ranges (generous: the tiny test models and the 43-layer V4 Flash sit well inside). Values outside
# are corrupt metadata: they would divide by zero, allocate absurd states, or poison every activation.
SIZE_LIMITS = {
    "n_layers": (1, 1024), "dim": (1, 1 << 17), "vocab_size": (2, 1 << 24), "context_length": (2, (1 << 31) - 1),
    "n_heads": (1, 4096), "head_dim": (1, 1 << 14), "rope_dim": (2, 1 << 14), "q_lora_rank": (1, 1 << 17),
    "o_lora_rank": (1, 1 << 17), "o_groups": (1, 4096), "window": (1, 1 << 20), "rope_orig_ctx": (1, (1 << 31) - 1),
    "index_heads": (1, 4096), "index_head_dim": (1, 1 << 14), "index_topk": (1, 1 << 20), "n_experts": (1, 1 << 16),
    "n_experts_used": (1, 1 << 16), "expert_ff": (1, 1 << 18), "n_shared_experts": (0, 64), "hash_layers": (0, 1024),
    "hc_mult": (1, 64), "sinkhorn_iters": (1, 1000),
}
FLOAT_LIMITS = {
    "norm_eps": (1e-12, 1e-2), "hc_eps": (1e-12, 1e-2), "rope_base": (1.0, 1e12), "compress_rope_base": (1.0, 1e12),
    "rope_factor": (1.0, 1e6), "beta_fast": (0.0, 1e6), "beta_slow": (0.0, 1e6), "route_scale": (1e-6, 1e6),
}


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    dim: int                     # D
    vocab_size: int
    context_length: int
    n_heads: int                 # H
    head_dim: int                # 512 (K = V, one shared kv head)
    rope_dim: int                # the last rope_dim dims of a head are roped
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    window: int                  # sliding window (raw kv rows per query)
    norm_eps: float
    compress_ratios: tuple[int, ...]
    rope_base: float             # ratio-0 layers, no YaRN
    compress_rope_base: float    # compressed layers, with YaRN
    rope_factor: float
    rope_orig_ctx: int
    beta_fast: float
    beta_slow: float
    index_heads: int
    index_head_dim: int
    index_topk: int
    n_experts: int
    n_experts_used: int
    expert_ff: int
    n_shared_experts: int
    route_scale: float
    route_norm: bool
    hash_layers: int
    swiglu_clamp: tuple[float, ...]
    hc_mult: int
    sinkhorn_iters: int
    hc_eps: float
    bos_id: int = 0
    eos_id: int = 1
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def hc_mix(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def has_indexer(self, layer: int) -> bool:
        return self.compress_ratios[layer] == 4

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.hash_layers

    # ---- reading -------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, f, validate: bool = True) -> "ModelConfig":
        arch = f.meta("general.architecture", None)
        if arch is not None and arch != ARCH:
            raise ConfigError(f"{f.path}: architecture is {arch!r}, expected {ARCH!r} (DeepSeek V4 Flash)")

        def m(key: str, default: Any = ...) -> Any:
            try:
                return f.meta(f"{ARCH}.{key}", default)
            except GGUFError as e:
                raise ConfigError(f"{f.path}: metadata key '{ARCH}.{key}' is missing") from e

        check_metadata_types(f)

        n_layers = int(m("block_count"))
        ratios = tuple(int(r) for r in m("attention.compress_ratios"))
        clamp = m("swiglu_clamp_exp", None)
        clamp = tuple(float(c) for c in clamp) if clamp is not None else (10.0,) * n_layers
        head_dim = int(m("attention.key_length"))
        cfg = cls(
            n_layers=n_layers,
            dim=int(m("embedding_length")),
            vocab_size=int(m("vocab_size", None) or f.tensor("token_embd.weight").shape[0]),
            context_length=int(m("context_length")),
            n_heads=int(m("attention.head_count")),
            head_dim=head_dim,
            rope_dim=int(m("rope.dimension_count")),
            q_lora_rank=int(m("attention.q_lora_rank")),
            o_lora_rank=int(m("attention.output_lora_rank")),
            o_groups=int(m("attention.output_group_count")),
            window=int(m("attention.sliding_window")),
            norm_eps=float(m("attention.layer_norm_rms_epsilon")),
            compress_ratios=ratios,
            rope_base=float(m("rope.freq_base")),
            compress_rope_base=float(m("attention.compress_rope_freq_base")),
            rope_factor=float(m("rope.scaling.factor")),
            rope_orig_ctx=int(m("rope.scaling.original_context_length")),
            beta_fast=float(m("rope.scaling.yarn_beta_fast")),
            beta_slow=float(m("rope.scaling.yarn_beta_slow")),
            index_heads=int(m("attention.indexer.head_count")),
            index_head_dim=int(m("attention.indexer.key_length")),
            index_topk=int(m("attention.indexer.top_k")),
            n_experts=int(m("expert_count")),
            n_experts_used=int(m("expert_used_count")),
            expert_ff=int(m("expert_feed_forward_length")),
            n_shared_experts=int(m("expert_shared_count")),
            route_scale=float(m("expert_weights_scale")),
            route_norm=bool(m("expert_weights_norm", True)),
            hash_layers=int(m("hash_layer_count", 0)),
            swiglu_clamp=clamp,
            hc_mult=int(m("hyper_connection.count")),
            sinkhorn_iters=int(m("hyper_connection.sinkhorn_iterations")),
            hc_eps=float(m("hyper_connection.epsilon")),
            bos_id=int(f.meta("tokenizer.ggml.bos_token_id", 0)),
            eos_id=int(f.meta("tokenizer.ggml.eos_token_id", 1)),
            extra={"head_count_kv": int(m("attention.head_count_kv", 1)),
                   "value_length": int(m("attention.value_length", head_dim))},
        )
        cfg.check_metadata(f.path)
        if validate:
            cfg.check_tensors(f)
            if hasattr(f, "tensors"):          # a real file (stand-ins in tests carry metadata only)
                from ds4py.validate import check_weights

                check_weights(f)
        return cfg

    # ---- validation ----------------------------------------------------------------------------------
    def check_metadata(self, path: str = "model") -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"{path}: {msg}")

        # ranges first: everything below divides by or allocates from these values
        for name, (lo, hi) in SIZE_LIMITS.items():
            v = getattr(self, name)
            if not lo <= v <= hi:
                bad(f"{name.replace('_', ' ')} is {v}, outside the plausible range {lo}..{hi} (corrupt metadata?)")
        for name, (lo, hi) in FLOAT_LIMITS.items():
            v = getattr(self, name)
            if not (math.isfinite(v) and lo <= v <= hi):
                bad(f"{name.replace('_', ' ')} is {v}, outside the plausible range {lo:g}..{hi:g} (corrupt metadata?)")
        if not all(math.isfinite(c) and 0 < c <= 1e4 for c in self.swiglu_clamp):
            bad(f"swiglu_clamp_exp {list(self.swiglu_clamp)} has a value that is not a finite positive number")
        if not (0 <= self.bos_id < self.vocab_size and 0 <= self.eos_id < self.vocab_size):
            bad(f"BOS / EOS token ids {self.bos_id} / {self.eos_id} are outside the vocabulary (0..{self.vocab_size - 1})")
        if self.window > self.context_length:
            bad(f"attention.sliding_window {self.window} exceeds context_length {self.context_length}")

        if self.extra.get("head_count_kv", 1) != 1:
            bad(f"attention.head_count_kv is {self.extra['head_count_kv']}, expected 1 (one shared K=V head)")
        if self.extra.get("value_length", self.head_dim) != self.head_dim:
            bad("attention.value_length differs from key_length (V4 uses one vector as K and V)")
        if len(self.compress_ratios) != self.n_layers:
            bad(f"attention.compress_ratios has {len(self.compress_ratios)} entries for {self.n_layers} layers")
        if any(r not in (0, 4, 128) for r in self.compress_ratios):
            bad(f"attention.compress_ratios {list(self.compress_ratios)} has a ratio other than 0, 4, 128")
        if len(self.swiglu_clamp) != self.n_layers:
            bad(f"swiglu_clamp_exp has {len(self.swiglu_clamp)} entries for {self.n_layers} layers")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            bad(f"rope.dimension_count {self.rope_dim} must be even and at most key_length {self.head_dim}")
        if self.nope_dim % 64:
            bad(f"key_length - rope dims = {self.nope_dim} is not a multiple of the FP8 block (64)")
        if (self.n_heads * self.head_dim) % self.o_groups:
            bad(f"{self.n_heads} heads x {self.head_dim} do not split into {self.o_groups} output groups")
        if self.n_shared_experts != 1:
            bad(f"expert_shared_count is {self.n_shared_experts}, only 1 is supported")
        if not 0 < self.n_experts_used <= self.n_experts:
            bad(f"expert_used_count {self.n_experts_used} is not within 1..expert_count {self.n_experts}")
        if self.hash_layers > self.n_layers:
            bad(f"hash_layer_count {self.hash_layers} exceeds block_count {self.n_layers}")
        if 4 in self.compress_ratios:
            ihd = self.index_head_dim
            if ihd & (ihd - 1) or ihd % 32 or ihd < self.rope_dim:
                bad(f"indexer key_length {ihd} must be a power of two, a multiple of 32 and >= the rope dims")
        if self.window <= 0:
            bad(f"attention.sliding_window is {self.window}")

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], tuple]]:
        """Every tensor the forward reads: name -> (numpy-order shape, allowed types)."""
        D, H, hd, V = self.dim, self.n_heads, self.head_dim, self.vocab_size
        hc, mix = self.hc_mult, self.hc_mix
        X, FF = self.n_experts, self.expert_ff
        M, F, I = MATRIX_TYPES, FLOAT_TYPES, INT_TYPES
        t: dict[str, tuple[tuple[int, ...], tuple]] = {
            "token_embd.weight": ((V, D), M),
            "output.weight": ((V, D), M),
            "output_norm.weight": ((D,), F),
            "output_hc_base.weight": ((hc,), F),
            "output_hc_fn.weight": ((hc, hc * D), F),
            "output_hc_scale.weight": ((1,), F),
        }
        for il in range(self.n_layers):
            p = f"blk.{il}."
            for sub in ("attn", "ffn"):
                t[p + f"hc_{sub}_fn.weight"] = ((mix, hc * D), F)
                t[p + f"hc_{sub}_scale.weight"] = ((3,), F)
                t[p + f"hc_{sub}_base.weight"] = ((mix,), F)
            t[p + "attn_norm.weight"] = ((D,), F)
            t[p + "ffn_norm.weight"] = ((D,), F)
            t[p + "attn_q_a.weight"] = ((self.q_lora_rank, D), M)
            t[p + "attn_q_a_norm.weight"] = ((self.q_lora_rank,), F)
            t[p + "attn_q_b.weight"] = ((H * hd, self.q_lora_rank), M)
            t[p + "attn_kv.weight"] = ((hd, D), M)
            t[p + "attn_kv_a_norm.weight"] = ((hd,), F)
            t[p + "attn_sinks.weight"] = ((H,), F)
            t[p + "attn_output_a.weight"] = ((self.o_groups * self.o_lora_rank, H * hd // self.o_groups), M)
            t[p + "attn_output_b.weight"] = ((D, self.o_groups * self.o_lora_rank), M)
            ratio = self.compress_ratios[il]
            if ratio:
                c = 2 if ratio == 4 else 1
                t[p + "attn_compressor_kv.weight"] = ((c * hd, D), M)
                t[p + "attn_compressor_gate.weight"] = ((c * hd, D), M)
                t[p + "attn_compressor_ape.weight"] = ((ratio, c * hd), F)
                t[p + "attn_compressor_norm.weight"] = ((hd,), F)
            if ratio == 4:
                ih, ihd = self.index_heads, self.index_head_dim
                t[p + "indexer.attn_q_b.weight"] = ((ih * ihd, self.q_lora_rank), M)
                t[p + "indexer.proj.weight"] = ((ih, D), M)
                t[p + "indexer_compressor_kv.weight"] = ((2 * ihd, D), M)
                t[p + "indexer_compressor_gate.weight"] = ((2 * ihd, D), M)
                t[p + "indexer_compressor_ape.weight"] = ((4, 2 * ihd), F)
                t[p + "indexer_compressor_norm.weight"] = ((ihd,), F)
            t[p + "ffn_gate_inp.weight"] = ((X, D), M)
            if self.is_hash_layer(il):
                t[p + "ffn_gate_tid2eid.weight"] = ((V, self.n_experts_used), I)
            else:
                t[p + "exp_probs_b.bias"] = ((X,), F)
            t[p + "ffn_gate_exps.weight"] = ((X, FF, D), M)
            t[p + "ffn_up_exps.weight"] = ((X, FF, D), M)
            t[p + "ffn_down_exps.weight"] = ((X, D, FF), M)
            t[p + "ffn_gate_shexp.weight"] = ((FF, D), M)
            t[p + "ffn_up_shexp.weight"] = ((FF, D), M)
            t[p + "ffn_down_shexp.weight"] = ((D, FF), M)
        return t

    def check_tensors(self, f) -> None:
        """Raise GGUFError naming the first tensor that is missing or has the wrong shape / type."""
        from ds4py.quant import vq

        for name, (shape, types) in self.expected_tensors().items():
            if name.endswith("_exps.weight") and vq.is_vq(f, name):     # VQ-8 routed experts (docs/vq.md)
                vq.check_expert(f, name, shape)
            else:
                f.tensor(name, types=types, shape=shape)
