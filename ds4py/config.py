"""Model hyper-parameters, read from a GGUF's `deepseek4.*` metadata and checked against its tensors.

    cfg = ModelConfig.from_gguf(GGUFFile("model.gguf"))     # ConfigError / GGUFError on any mismatch

Nothing here assumes the full-size model: the tiny golden models (256-wide, 96-dim heads, window 16, ...)
and the 43-layer V4 Flash file go through the same code. See MODEL.md §1 and §5.
"""

from __future__ import annotations

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
        return cfg

    # ---- validation ----------------------------------------------------------------------------------
    def check_metadata(self, path: str = "model") -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"{path}: {msg}")

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
