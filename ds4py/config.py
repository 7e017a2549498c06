"""Model hyper-parameters, read from a GGUF's `deepseek4.*` metadata and checked against its tensors.

    cfg = ModelConfig.from_gguf(GGUFFile("model.gguf"))     # ConfigError / GGUFError on any mismatch

Nothing here assumes the full-size model: the tiny golden models (256-wide, 96-dim heads, window 16, ...)
and the 43-layer V4 Flash file go through the same code. See MODEL.md §1 and §5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from dataclasses import fields as dataclass_fields
from functools import cached_property
from typing import Any

from ds4py.ggml_types import GGMLQuantizationType as Q

from ds4py import schema
from ds4py.errors import ConfigError, GGUFError
from ds4py.quant import BLOCK as QUANT_BLOCK

ARCH = "deepseek4"                       # V4 Flash GGUFs (the ds4 layout)
ARCH_V41 = "deepseek41"                  # V4.1 Flash GGUFs (docs/v41.md)
VARIANTS = {ARCH: "v4", ARCH_V41: "v41"}  # general.architecture -> ModelConfig.variant
ARCH_OF = {v: a for a, v in VARIANTS.items()}

# the types a tensor may be stored in live beside the decoders (ds4py.quant), so that ds4py.schema needs no config
from ds4py.quant import FLOAT_TYPES, INT_TYPES, MATRIX_TYPES  # noqa: E402,F401

# V4 Flash's ratio roles (MODEL.md §2.3), V4_VARIANT's data
V4_OVERLAP_RATIO = 4                     # the overlapping compressor
V4_INDEXER_RATIO = 4                     # layers with an indexer


# V4 Flash's sizes (MODEL.md §1) in ModelConfig's names; n_layers, dim, vocab_size, n_heads and compress_ratios
# are always given
V4_FLASH: dict[str, Any] = dict(
    head_dim=512, rope_dim=64, q_lora_rank=1024, o_lora_rank=1024, o_groups=8, window=128, norm_eps=1e-6,
    rope_base=10000.0, compress_rope_base=160000.0, rope_factor=16.0, rope_orig_ctx=65536, beta_fast=32.0,
    beta_slow=1.0, index_heads=64, index_head_dim=128, index_topk=512, n_experts=256, n_experts_used=6,
    expert_ff=2048, n_shared_experts=1, route_scale=1.5, route_norm=True, hash_layers=3, hc_mult=4,
    sinkhorn_iters=20, hc_eps=1e-6, bos_id=0, eos_id=1)

# V4.1 Flash's sizes (MODEL.md §1, §3; the official inference/config.json)
V41_FLASH: dict[str, Any] = dict(
    variant="v41", head_dim=512, rope_dim=64, q_lora_rank=1280, o_lora_rank=1024, o_groups=8, window=128,
    norm_eps=1e-20, rope_base=10000.0, compress_rope_base=160000.0, rope_factor=16.0, rope_orig_ctx=65536,
    beta_fast=32.0, beta_slow=1.0, index_heads=32, index_head_dim=128, index_topk=512, n_experts=384,
    n_experts_used=6, expert_ff=2304, n_shared_experts=1, route_scale=1.5, route_norm=True, hash_layers=0, hc_mult=4,
    sinkhorn_iters=20, hc_eps=1e-6, bos_id=0, eos_id=1, kv_source_layers=(2, 8, 14, 20),
    index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36), candidate_source_layer=20, candidate_topk_blocks=2048,
    candidate_block_size=8, gate_temp=1.0, engram_layers=(1, 14), engram_rows=(384006168, 384016682),
    engram_max_ngram=4, engram_heads=8, engram_head_dim=256, engram_bucket_base=16000000, engram_pad_id=2,
    engram_compressed_vocab=99092)


@dataclass(frozen=True)
class Variant:
    """What a model variant is, as data (MODEL.md §2 V4 vs §3 V4.1): the config's predicates below read these
    fields, so the forward, the engines and the converters ask a predicate or a layer's roles, never the name."""
    title: str                   # "V4 Flash" / "V4.1 Flash" (messages)
    source_layers: bool          # compressed rows and indexer top-k come from the listed source layers (the latest
                                 # at or below a layer: kv_source_layers / index_source_layers), candidate blocks
                                 # from candidate_source_layer; False: every compressed layer is its own source
    latent_index_keys: bool      # indexer keys are wk . the kv source's compressor latent (key owners publish
                                 # them); False: each indexer's own compressor makes them
    indexer_ratio: int           # without source layers: the layers of this ratio run an indexer
    overlap_ratio: int           # compressors of this ratio pool two groups (0: none)
    compressor_ape: bool         # the compressor gate adds a learned per-slot bias
    index_overlap: int           # 1: the indexer's own compressor overlaps
    lagged_hc: bool              # see ModelConfig.lagged_hc
    q_head_norm: bool
    index_hadamard: bool
    kv_fp8_rope: bool            # the window KV's FP8 fake-quant covers the rope dims too
    kv_fp8_block: int
    route_norm_eps: float
    normalise_single_expert: bool  # the routing weights of a single used expert are normalised too
    engram: bool                 # the variant's metadata may name Engram layers (and an Engram table folder)
    ratios: tuple[int, ...] | None  # the compress ratios a file may use (None: any 0..65536)
    min_norm_eps: float          # the plausible range's floor for norm_eps
    checkpoint_fp8_block: int    # the official checkpoint's FP8 weight block (convert)
    draft: str                   # "mtp": an MTP block, in a GGUF of its own; "dspark": DSpark, in the model's GGUF


V4_VARIANT = Variant(
    title="V4 Flash", source_layers=False, latent_index_keys=False, indexer_ratio=V4_INDEXER_RATIO,
    overlap_ratio=V4_OVERLAP_RATIO,
    compressor_ape=True, index_overlap=1, lagged_hc=False, q_head_norm=True, index_hadamard=True,
    kv_fp8_rope=False, kv_fp8_block=64, route_norm_eps=0.0, normalise_single_expert=True, engram=False,
    ratios=(0, 4, 128), min_norm_eps=1e-12, checkpoint_fp8_block=128, draft="mtp")
V41_VARIANT = Variant(
    title="V4.1 Flash", source_layers=True, latent_index_keys=True, indexer_ratio=0, overlap_ratio=0,
    compressor_ape=False, index_overlap=0, lagged_hc=True, q_head_norm=False, index_hadamard=False,
    kv_fp8_rope=True, kv_fp8_block=32, route_norm_eps=1e-20, normalise_single_expert=False, engram=True,
    ratios=None, min_norm_eps=1e-30, checkpoint_fp8_block=32, draft="dspark")
VARIANT_OF = {"v4": V4_VARIANT, "v41": V41_VARIANT}     # ModelConfig.variant -> its Variant


@dataclass(frozen=True)
class LayerRoles:
    """What one layer does, from the config's predicates (ModelConfig.roles(l))."""
    layer: int
    ratio: int                   # compress ratio (0: window only)
    compressed: bool             # attends to compressed rows
    kv_source: int               # whose compressed rows it reads (itself in V4)
    compressor: bool             # computes compressed rows (owns comp_* state)
    overlap: int                 # 1: group g also pools group g-1 (2x-wide compressor)
    indexer: bool                # top-k selection of compressed rows (owns idx_* state)
    index_ratio: int
    index_overlap: int
    hash_routing: bool           # experts from tid2eid[token] instead of biased top-k
    gated: bool = True           # the compressor pools its group through a softmax gate (ratio > 1)
    index_source: int = -1       # whose indexer top-k this layer's compressed attention uses (-1: all rows)
    index_keys: int = -1         # whose idx_keys rows the indexer scores (-1: no indexer)
    owns_index_keys: bool = False  # the layer computes (and its state holds) indexer keys
    index_compressor: bool = False  # the indexer's own compressor makes its keys (V4)
    shares_topk: bool = False    # later layers may reuse this indexer's top-k ([T, Nc] mask, no per-query picks)
    candidate_source: bool = False  # the indexer publishes candidate blocks (V4.1)
    uses_candidates: bool = False   # the indexer scores only inside the candidate blocks (V4.1)
    engram: int = -1             # index of the Engram applied before this block (-1: none)


GATING_SQRTSOFTPLUS = 4      # deepseek4.expert_gating_func (llama.cpp's llama_expert_gating_func_type)
ROPE_SCALING = "yarn"        # deepseek4.rope.scaling.type

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
    "hyper_connection.epsilon": "float", "expert_gating_func": "int", "rope.scaling.type": "str",
}
# V4.1 (prefix `deepseek41.`): the keys above (hash_layer_count absent) plus the cross-layer sharing, the
# candidate blocks, the gate temperature and Engram (docs/v41.md)
META_KINDS_V41 = {
    **{k: v for k, v in META_KINDS.items() if k != "hash_layer_count"},
    "attention.kv_source_layers": "ints", "attention.indexer.source_layers": "ints",
    "attention.indexer.candidate_source_layer": "int", "attention.indexer.candidate_top_k": "int",
    "attention.indexer.candidate_block_size": "int", "expert_gating_temperature": "float",
    "engram.layer_ids": "ints", "engram.table_rows": "ints", "engram.max_ngram_size": "int",
    "engram.head_count": "int", "engram.key_length": "int", "engram.bucket_base": "int",
    "engram.pad_token_id": "int", "engram.compressed_vocab_size": "int",
    "dspark.stage_count": "int", "dspark.block_size": "int", "dspark.noise_token_id": "int",
    "dspark.target_layers": "ints", "dspark.markov_rank": "int", "dspark.expert_count": "int",
    "dspark.expert_used_count": "int",
}
_KIND_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean", "ints": "an array of integers",
               "floats": "an array of numbers"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


_KIND_CHECKS = {"str": lambda v: isinstance(v, str), "int": _is_int, "float": _is_num, "bool": lambda v: isinstance(v, bool),
                "ints": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
                "floats": lambda v: isinstance(v, list) and all(_is_num(x) for x in v)}


def _describe(v: Any) -> str:
    kind = "a string" if isinstance(v, str) else "an array" if isinstance(v, list) else \
        "a boolean" if isinstance(v, bool) else "a non-finite number" if isinstance(v, float) else type(v).__name__
    text = repr(v)
    return f"{kind} ({text[:40] + '...' if len(text) > 40 else text})"


def check_metadata_types(f, arch: str = ARCH) -> None:
    """ConfigError naming the first `deepseek4.*` / `deepseek41.*` (or token id) metadata value of the wrong type."""
    keys = {f"{arch}.{k}": kind for k, kind in (META_KINDS_V41 if arch == ARCH_V41 else META_KINDS).items()}
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
    # ---- V4.1 Flash (MODEL.md §3); V4 leaves the defaults ---------------------------------------------
    variant: str = "v4"                          # "v4" | "v41" (the GGUF's general.architecture)
    kv_source_layers: tuple[int, ...] = ()       # the layers that compute compressed KV (V4.1)
    index_source_layers: tuple[int, ...] = ()    # the layers that run an indexer (V4.1)
    candidate_source_layer: int = -1             # its indexer publishes candidate blocks (-1: none)
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    gate_temp: float = 1.0                       # router logits are divided by it
    engram_layers: tuple[int, ...] = ()          # Engram runs before these blocks
    engram_rows: tuple[int, ...] = ()            # table rows per Engram layer
    engram_max_ngram: int = 0                    # n-grams of 2..max_ngram tokens
    engram_heads: int = 0                        # hash heads per n-gram size
    engram_head_dim: int = 0                     # one table row
    engram_bucket_base: int = 0                  # the official engram_vocab_size: bucket primes start above it
    engram_pad_id: int = 2                       # the token whose compressed id fills missing history
    engram_compressed_vocab: int = 0             # size of the compressed token map (checked against the vocab)
    # ---- V4.1's DSpark draft (MODEL.md §3; docs/dspark.md); 0 stages: the file has no draft -------------
    dspark_stages: int = 0                       # draft stages (V4.1 blocks after the backbone)
    dspark_block: int = 0                        # positions one draft call proposes (B)
    dspark_noise_id: int = 0                     # the token filling block positions 1..B-1
    dspark_targets: tuple[int, ...] = ()         # layers whose input HC state (mean over copies) the draft reads
    dspark_rank: int = 0                         # the Markov bigram head's rank r
    dspark_experts: int = 0                      # routed experts per stage
    dspark_experts_used: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes (the names the weight schema and the state layout use) -------------------------
    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def hc_mix(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def hc_dim(self) -> int:                 # the flattened residual state: hc copies of D
        return self.hc_mult * self.dim

    @property
    def q_dim(self) -> int:                  # all query heads
        return self.n_heads * self.head_dim

    @property
    def o_dim(self) -> int:                  # the grouped output projection's inner width
        return self.o_groups * self.o_lora_rank

    @property
    def o_group_in(self) -> int:             # one output group's input: n_heads / o_groups heads
        return self.n_heads * self.head_dim // self.o_groups

    @property
    def index_q_dim(self) -> int:
        return self.index_heads * self.index_head_dim

    @property
    def shared_ff(self) -> int:
        return self.expert_ff * self.n_shared_experts

    @property
    def is_v41(self) -> bool:
        """Only where V4.1's math differs (its kernels, compressor, RoPE ramp); data reads `traits`."""
        return self.variant == "v41"

    @property
    def traits(self) -> Variant:
        """What this variant is, as data (Variant); an unknown variant is refused by check_metadata."""
        return VARIANT_OF.get(self.variant, V4_VARIANT)

    @property
    def arch(self) -> str:
        """The GGUF `general.architecture` (and metadata prefix) of this variant."""
        return ARCH_OF[self.variant]

    @property
    def engram_cols(self) -> int:            # table rows one position reads per Engram layer
        return max(self.engram_max_ngram - 1, 0) * self.engram_heads

    @property
    def engram_in_dim(self) -> int:          # the flattened rows Engram's wkv reads
        return self.engram_cols * self.engram_head_dim

    @property
    def engram_kv_dim(self) -> int:          # one key per hc copy plus a shared value
        return (self.hc_mult + 1) * self.dim

    # ---- variant predicates: the only code that knows what a ratio or a variant means --------------------
    # The forward, the weight schema and the KV state layout ask these; none of them compares ratios or
    # variants. V4 Flash (MODEL.md §2.3): ratio 4 layers have an overlapping compressor and an indexer whose own
    # compressor has the same ratio and overlap; ratio 128 layers a plain compressor and attend to every row;
    # every compressed layer owns its rows. V4.1 (§3): ratios 2 and 1 without overlap or ape (ratio 1 without a
    # gate); only kv source layers compress, the others read the latest source's rows; only index sources run
    # an indexer, the others reuse the latest source's top-k; indexer keys come from the kv source's latent.
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def is_compressed(self, layer: int) -> bool:
        """The layer attends to compressed rows (and uses the compressed-layer RoPE)."""
        return self.compress_ratios[layer] > 0

    def kv_source(self, layer: int) -> int:
        """The layer whose compressed rows this layer attends to (V4: its own; V4.1: the latest kv source at
        or below it; -1 for a window-only layer)."""
        if not self.is_compressed(layer):
            return -1
        return _latest(self.kv_source_layers, layer) if self.traits.source_layers else layer

    def has_compressor(self, layer: int) -> bool:
        """The layer computes (and its state holds) compressed rows."""
        return self.is_compressed(layer) and self.kv_source(layer) == layer

    def has_compressor_gate(self, layer: int) -> bool:
        """The compressor pools its group through a softmax gate (every ratio above 1)."""
        return self.has_compressor(layer) and self.compress_ratios[layer] > 1

    def has_compressor_ape(self, layer: int) -> bool:
        """The gate adds a learned per-slot bias (V4 only)."""
        return self.has_compressor(layer) and self.traits.compressor_ape

    def compress_overlap(self, layer: int) -> int:
        """1 when group g also pools group g-1's tokens (through the first half of a 2x-wide compressor)."""
        overlap = self.traits.overlap_ratio
        return int(overlap > 0 and self.compress_ratios[layer] == overlap)

    def comp_width(self, layer: int) -> int:
        return (1 + self.compress_overlap(layer)) * self.head_dim

    def has_indexer(self, layer: int) -> bool:
        """The layer runs an indexer (scores compressed rows, keeps the top-k)."""
        if self.traits.source_layers:
            return self.is_compressed(layer) and layer in self.index_source_layers
        return self.compress_ratios[layer] == self.traits.indexer_ratio

    def index_source(self, layer: int) -> int:
        """The layer whose top-k this layer's compressed attention uses (V4: itself on indexer layers, -1 on
        ratio-128 layers, which attend to every visible row; V4.1: the latest index source at or below it)."""
        if not self.is_compressed(layer):
            return -1
        if self.traits.source_layers:
            return _latest(self.index_source_layers, layer)
        return layer if self.has_indexer(layer) else -1

    def has_index_compressor(self, layer: int) -> bool:
        """The indexer keys come from the indexer's own compressor (V4)."""
        return self.has_indexer(layer) and not self.traits.latent_index_keys

    def owns_index_keys(self, layer: int) -> bool:
        """The layer computes (and its state holds) indexer keys: V4 every indexer layer; V4.1 the indexer
        layers that are kv sources (keys from the compressor's latent)."""
        if self.traits.latent_index_keys:
            return self.has_indexer(layer) and self.has_compressor(layer)
        return self.has_indexer(layer)

    def has_index_key_proj(self, layer: int) -> bool:
        """wk + k_norm turn the compressed latent into indexer keys (V4.1 key owners)."""
        return self.traits.latent_index_keys and self.owns_index_keys(layer)

    def index_keys(self, layer: int) -> int:
        """The layer whose idx_keys this layer's indexer scores (-1: no indexer)."""
        if not self.has_indexer(layer):
            return -1
        return self.kv_source(layer) if self.traits.latent_index_keys else layer

    def index_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def index_overlap(self, layer: int) -> int:
        return self.traits.index_overlap

    def index_comp_width(self, layer: int) -> int:
        return (1 + self.index_overlap(layer)) * self.index_head_dim

    def is_candidate_source(self, layer: int) -> bool:
        return self.traits.source_layers and layer == self.candidate_source_layer and self.has_indexer(layer)

    def uses_candidates(self, layer: int) -> bool:
        """The indexer masks its scores to the candidate source's blocks (every indexer after it)."""
        return self.traits.source_layers and 0 <= self.candidate_source_layer < layer and self.has_indexer(layer)

    def is_engram_layer(self, layer: int) -> bool:
        return layer in self.engram_layers

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.hash_layers

    def has_route_bias(self, layer: int) -> bool:
        """Biased top-k routing (the bias picks experts, never weighs them); hash layers use tid2eid."""
        return not self.is_hash_layer(layer)

    # ---- variant-wide numerics (MODEL.md §2 vs §3) ---------------------------------------------------------
    @property
    def lagged_hc(self) -> bool:
        """V4.1: each sub-layer collapses the copies with the pre-mix the previous one computed (layer 0:
        one-hot); the head collapses with the last FFN's; no hc_head tensors."""
        return self.traits.lagged_hc

    @property
    def has_hc_head(self) -> bool:
        return not self.lagged_hc

    @property
    def q_head_norm(self) -> bool:
        """Per-head RMS normalisation of the queries (V4 only)."""
        return self.traits.q_head_norm

    @property
    def kv_fp8(self) -> tuple[int, int]:
        """(leading dims, block) of the window KV's FP8 fake-quant: V4 the non-rope dims in blocks of 64,
        V4.1 the whole row in blocks of 32."""
        t = self.traits
        return (self.head_dim if t.kv_fp8_rope else self.nope_dim, t.kv_fp8_block)

    @property
    def index_hadamard(self) -> bool:
        """Indexer queries and keys are Hadamard-rotated before their FP4 fake-quant (V4 only)."""
        return self.traits.index_hadamard

    @property
    def route_norm_eps(self) -> float:
        """Added to the routing weights' sum before normalising (V4.1: 1e-20; V4: none)."""
        return self.traits.route_norm_eps

    @property
    def route_normalises(self) -> bool:
        """The routing weights are normalised to sum 1 (V4.1 skips it for a single expert)."""
        return self.route_norm and (self.n_experts_used > 1 or self.traits.normalise_single_expert)

    def roles(self, layer: int) -> "LayerRoles":
        return self._roles[layer]

    @property
    def has_dspark(self) -> bool:
        return self.dspark_stages > 0

    @property
    def dspark_tap_dim(self) -> int:         # the draft's input: the target layers' taps, concatenated
        return len(self.dspark_targets) * self.dim

    @property
    def dspark_conf_dim(self) -> int:        # the confidence head's input: [pre-norm hidden, Markov embedding]
        return self.dim + self.dspark_rank

    def dspark_block_config(self) -> "ModelConfig":
        """The DSpark stages as a model of their own (MODEL.md §3): dspark_stages V4.1 blocks that attend to their
        window ring only (ratio 0, base-theta RoPE, no Engram / compressor / indexer) with their own small MoE;
        their weights are ds4py.schema's DSPARK_STAGE_TENSORS, their rings kv.state_layout of it."""
        S = self.dspark_stages
        return replace(self, n_layers=S, compress_ratios=(0,) * S, hash_layers=0,
                       swiglu_clamp=self.swiglu_clamp[-1:] * S, n_experts=self.dspark_experts,
                       n_experts_used=self.dspark_experts_used, kv_source_layers=(), index_source_layers=(), candidate_source_layer=-1, engram_layers=(), engram_rows=(),
                       dspark_stages=0, dspark_targets=())

    def mtp_block(self) -> "ModelConfig":
        """The MTP draft block's config (MODEL.md §2.5): one layer of this model's shapes that attends to its
        window only (ratio 0, base-theta RoPE) and routes by score (the official MTPBlock's layer id is
        n_layers >= n_hash_layers); its weights are ds4py.schema.MTP_TENSORS, its state kv.state_layout of it."""
        return replace(self, n_layers=1, compress_ratios=(0,), hash_layers=0, swiglu_clamp=self.swiglu_clamp[-1:])

    @cached_property
    def _roles(self) -> tuple["LayerRoles", ...]:
        return tuple(LayerRoles(
            layer=il, ratio=self.ratio(il), compressed=self.is_compressed(il), kv_source=self.kv_source(il),
            compressor=self.has_compressor(il), overlap=self.compress_overlap(il), indexer=self.has_indexer(il),
            index_ratio=self.index_ratio(il) if self.has_indexer(il) else 0,
            index_overlap=self.index_overlap(il) if self.has_indexer(il) else 0,
            hash_routing=self.is_hash_layer(il), gated=self.ratio(il) > 1, index_source=self.index_source(il),
            index_keys=self.index_keys(il), owns_index_keys=self.owns_index_keys(il),
            index_compressor=self.has_index_compressor(il),
            shares_topk=self.traits.source_layers and self.has_indexer(il),
            candidate_source=self.is_candidate_source(il), uses_candidates=self.uses_candidates(il),
            engram=self.engram_layers.index(il) if il in self.engram_layers else -1)
            for il in range(self.n_layers))

    @classmethod
    def v4_flash(cls, **fields: Any) -> "ModelConfig":
        """V4 Flash's values (MODEL.md §1) for every field not given: the converter (official config.json)
        and make-tiny (small shapes) build their configs here, so one set of names serves every size."""
        return cls._with_defaults(V4_FLASH, fields)

    @classmethod
    def v41_flash(cls, **fields: Any) -> "ModelConfig":
        """V4.1 Flash's values (MODEL.md §1, §3) for every field not given (the V4.1 converter's config)."""
        for name in ("kv_source_layers", "index_source_layers", "engram_layers", "engram_rows"):
            if name in fields:
                fields[name] = tuple(int(v) for v in fields[name])
        return cls._with_defaults(V41_FLASH, fields)

    @classmethod
    def _with_defaults(cls, defaults: dict[str, Any], fields: dict[str, Any]) -> "ModelConfig":
        unknown = set(fields) - {f.name for f in dataclass_fields(cls)} | ({"extra"} & set(fields))
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(sorted(unknown))}")
        args = {**defaults, **fields}
        n = args["n_layers"]
        args.setdefault("context_length", int(args["rope_orig_ctx"] * args["rope_factor"]))
        args.setdefault("swiglu_clamp", (10.0,) * n)
        args["compress_ratios"] = tuple(int(r) for r in args["compress_ratios"])
        args["swiglu_clamp"] = tuple(float(c) for c in args["swiglu_clamp"])
        return cls(**args)

    # ---- reading -------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, f, validate: bool = True) -> "ModelConfig":
        arch = f.meta("general.architecture", None)
        if arch is None:
            arch = ARCH
        if arch not in VARIANTS:
            raise ConfigError(f"{f.path}: architecture is {arch!r}, expected {ARCH!r} (DeepSeek V4 Flash) or "
                              f"{ARCH_V41!r} (DeepSeek V4.1 Flash)")

        def m(key: str, default: Any = ...) -> Any:
            try:
                return f.meta(f"{arch}.{key}", default)
            except GGUFError as e:
                raise ConfigError(f"{f.path}: metadata key '{arch}.{key}' is missing") from e

        check_metadata_types(f, arch)

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
            hash_layers=int(m("hash_layer_count", 0)) if arch == ARCH else 0,
            swiglu_clamp=clamp,
            hc_mult=int(m("hyper_connection.count")),
            sinkhorn_iters=int(m("hyper_connection.sinkhorn_iterations")),
            hc_eps=float(m("hyper_connection.epsilon")),
            bos_id=int(f.meta("tokenizer.ggml.bos_token_id", 0)),
            eos_id=int(f.meta("tokenizer.ggml.eos_token_id", 1)),
            extra={"head_count_kv": int(m("attention.head_count_kv", 1)),
                   "value_length": int(m("attention.value_length", head_dim)),
                   # optional (ds4py wrote neither before issue 35; ds4's and llama.cpp's files carry both)
                   "gating_func": int(m("expert_gating_func", GATING_SQRTSOFTPLUS)),
                   "rope_scaling": str(m("rope.scaling.type", ROPE_SCALING))},
            **(_v41_fields(m) if arch == ARCH_V41 else {}),
        )
        cfg.check_metadata(f.path)
        if validate:
            schema.check_tensors(cfg, f)
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
            if name == "norm_eps":
                lo = self.traits.min_norm_eps    # V4.1 uses 1e-20 everywhere
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
        if self.extra.get("gating_func", GATING_SQRTSOFTPLUS) != GATING_SQRTSOFTPLUS:
            bad(f"expert_gating_func is {self.extra['gating_func']}, expected {GATING_SQRTSOFTPLUS} (sqrt(softplus), "
                f"the only expert scoring V4 Flash uses)")
        if self.extra.get("rope_scaling", ROPE_SCALING) != ROPE_SCALING:
            bad(f"rope.scaling.type is {self.extra['rope_scaling']!r}, expected {ROPE_SCALING!r} (V4 Flash's YaRN)")
        if self.extra.get("value_length", self.head_dim) != self.head_dim:
            bad("attention.value_length differs from key_length (V4 uses one vector as K and V)")
        if len(self.compress_ratios) != self.n_layers:
            bad(f"attention.compress_ratios has {len(self.compress_ratios)} entries for {self.n_layers} layers")
        if self.variant not in ARCH_OF:
            bad(f"variant {self.variant!r} is not one of {', '.join(ARCH_OF)}")
        allowed = self.traits.ratios
        if allowed is None:
            if any(not 0 <= r <= 1 << 16 for r in self.compress_ratios):
                bad(f"attention.compress_ratios {list(self.compress_ratios)} has a ratio outside 0..65536")
        elif any(r not in allowed for r in self.compress_ratios):
            bad(f"attention.compress_ratios {list(self.compress_ratios)} has a ratio other than "
                f"{', '.join(map(str, allowed))}")
        if len(self.swiglu_clamp) != self.n_layers:
            bad(f"swiglu_clamp_exp has {len(self.swiglu_clamp)} entries for {self.n_layers} layers")
        if self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            bad(f"rope.dimension_count {self.rope_dim} must be even and at most key_length {self.head_dim}")
        fp8_dims, fp8_block = self.kv_fp8
        if fp8_dims % fp8_block:
            what = "key_length" if self.traits.kv_fp8_rope else "key_length - rope dims"
            bad(f"{what} = {fp8_dims} is not a multiple of the FP8 block ({fp8_block})")
        if (self.n_heads * self.head_dim) % self.o_groups:
            bad(f"{self.n_heads} heads x {self.head_dim} do not split into {self.o_groups} output groups")
        if self.n_shared_experts != 1:
            bad(f"expert_shared_count is {self.n_shared_experts}, only 1 is supported")
        if not 0 < self.n_experts_used <= self.n_experts:
            bad(f"expert_used_count {self.n_experts_used} is not within 1..expert_count {self.n_experts}")
        if self.hash_layers > self.n_layers:
            bad(f"hash_layer_count {self.hash_layers} exceeds block_count {self.n_layers}")
        if any(self.has_indexer(il) for il in range(self.n_layers)):
            ihd = self.index_head_dim
            if (self.index_hadamard and ihd & (ihd - 1)) or ihd % 32 or ihd < self.rope_dim:
                bad(f"indexer key_length {ihd} must be {'a power of two, ' if self.index_hadamard else ''}a "
                    f"multiple of 32 and >= the rope dims")
        if self.window <= 0:
            bad(f"attention.sliding_window is {self.window}")
        if self.traits.source_layers:
            self._check_v41(bad)

    def _check_v41(self, bad) -> None:
        """The V4.1 layer map (MODEL.md §3): every compressed layer reads rows of a kv source and top-k of an index
        source at or below it, with its own ratio; every kv source indexes (its latent gives the indexer keys);
        the candidate source is an index source and the indexers after it share its ratio; Engram's layers,
        hashing and table sizes fit. The official code would read another layer's stale buffers otherwise."""
        n, compressed = self.n_layers, [il for il in range(self.n_layers) if self.is_compressed(il)]
        for name in ("kv_source_layers", "index_source_layers", "engram_layers"):
            v = getattr(self, name)
            if len(set(v)) != len(v) or any(not 0 <= x < n for x in v):
                bad(f"{name} {list(v)} must be distinct layers below block_count {n}")
        for name in ("kv_source_layers", "index_source_layers"):
            if any(not self.is_compressed(x) for x in getattr(self, name)):
                bad(f"{name} {list(getattr(self, name))} names a layer without compression (ratio 0)")
        if self.head_dim % 16:
            bad(f"key_length {self.head_dim} is not a multiple of the compressed rows' FP4 block (16)")
        for il in compressed:
            kv, ix = self.kv_source(il), self.index_source(il)
            if kv < 0 or ix < 0:
                bad(f"compressed layer {il} has no {'kv' if kv < 0 else 'index'} source layer at or below it")
            if self.ratio(kv) != self.ratio(il) or self.ratio(ix) != self.ratio(il):
                bad(f"layer {il} (ratio {self.ratio(il)}) reads rows or top-k of a layer with another ratio")
        for kv in self.kv_source_layers:
            if kv not in self.index_source_layers:
                bad(f"kv source layer {kv} is not an index source (its latent gives the indexer keys)")
        c = self.candidate_source_layer
        if c >= 0:
            if c >= n or c not in self.index_source_layers:
                bad(f"candidate_source_layer {c} is not an index source layer")
            if self.candidate_topk_blocks < 1 or self.candidate_block_size < 1:
                bad(f"candidate blocks {self.candidate_topk_blocks} x {self.candidate_block_size} must be positive")
            if any(self.ratio(il) != self.ratio(c) for il in self.index_source_layers if il > c):
                bad(f"an index source after the candidate source {c} has another ratio")
        elif c != -1:
            bad(f"candidate_source_layer is {c} (a layer, or -1 for none)")
        if not 0 < self.gate_temp <= 1e6:
            bad(f"expert_gating_temperature {self.gate_temp} must be a positive number")
        if self.engram_layers:
            e = self
            if len(e.engram_rows) != len(e.engram_layers):
                bad(f"engram.table_rows has {len(e.engram_rows)} entries for {len(e.engram_layers)} Engram layers")
            if not (2 <= e.engram_max_ngram <= 16 and 1 <= e.engram_heads <= 1024 and 32 <= e.engram_head_dim <= 1 << 14
                    and e.engram_head_dim % 32 == 0):
                bad(f"Engram n-gram size {e.engram_max_ngram}, heads {e.engram_heads}, row width {e.engram_head_dim} "
                    f"are out of range (2..16, 1..1024, a multiple of 32)")
            if not (1 <= e.engram_compressed_vocab <= self.vocab_size and 0 <= e.engram_pad_id < self.vocab_size
                    and 1 <= e.engram_bucket_base < 1 << 40):
                bad(f"Engram compressed vocab {e.engram_compressed_vocab}, pad id {e.engram_pad_id} or bucket base "
                    f"{e.engram_bucket_base} is out of range")
            if any(not 1 <= r < 1 << 40 for r in e.engram_rows):
                bad(f"engram.table_rows {list(e.engram_rows)} are out of range")
        if self.dspark_stages:
            self._check_dspark(bad)

    def _check_dspark(self, bad) -> None:
        """The DSpark draft's metadata (docs/dspark.md): stages, block, target layers, Markov rank, its MoE."""
        if not 1 <= self.dspark_stages <= 64:
            bad(f"dspark.stage_count {self.dspark_stages} is outside 1..64")
        if not 1 <= self.dspark_block <= 64:
            bad(f"dspark.block_size {self.dspark_block} is outside 1..64")
        if not 0 <= self.dspark_noise_id < self.vocab_size:
            bad(f"dspark.noise_token_id {self.dspark_noise_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        t = self.dspark_targets
        if not t or len(set(t)) != len(t) or any(not 0 <= x < self.n_layers for x in t) or list(t) != sorted(t):
            bad(f"dspark.target_layers {list(t)} must be distinct layers below block_count {self.n_layers}, ascending")
        if not 1 <= self.dspark_rank <= 1 << 14:
            bad(f"dspark.markov_rank {self.dspark_rank} is outside 1..16384")
        if not 0 < self.dspark_experts_used <= self.dspark_experts <= 1 << 16:
            bad(f"dspark expert counts {self.dspark_experts_used} of {self.dspark_experts} are out of range")


def _latest(layers: tuple[int, ...], layer: int) -> int:
    """The largest entry of `layers` at or below `layer` (-1 when there is none)."""
    return max((x for x in layers if x <= layer), default=-1)


def _v41_fields(m) -> dict[str, Any]:
    """The V4.1 fields from `deepseek41.*` metadata (m: the from_gguf reader)."""
    ints = lambda key: tuple(int(v) for v in m(key))      # noqa: E731
    return dict(
        variant="v41",
        kv_source_layers=ints("attention.kv_source_layers"),
        index_source_layers=ints("attention.indexer.source_layers"),
        candidate_source_layer=int(m("attention.indexer.candidate_source_layer", -1)),
        candidate_topk_blocks=int(m("attention.indexer.candidate_top_k", 0)),
        candidate_block_size=int(m("attention.indexer.candidate_block_size", 0)),
        gate_temp=float(m("expert_gating_temperature", 1.0)),
        engram_layers=tuple(int(v) for v in m("engram.layer_ids", [])),
        engram_rows=tuple(int(v) for v in m("engram.table_rows", [])),
        engram_max_ngram=int(m("engram.max_ngram_size", 0)),
        engram_heads=int(m("engram.head_count", 0)),
        engram_head_dim=int(m("engram.key_length", 0)),
        engram_bucket_base=int(m("engram.bucket_base", 0)),
        engram_pad_id=int(m("engram.pad_token_id", 2)),
        engram_compressed_vocab=int(m("engram.compressed_vocab_size", 0)),
        dspark_stages=int(m("dspark.stage_count", 0)),
        dspark_block=int(m("dspark.block_size", 0)),
        dspark_noise_id=int(m("dspark.noise_token_id", 0)),
        dspark_targets=tuple(int(v) for v in m("dspark.target_layers", [])),
        dspark_rank=int(m("dspark.markov_rank", 0)),
        dspark_experts=int(m("dspark.expert_count", 0)),
        dspark_experts_used=int(m("dspark.expert_used_count", 0)),
    )
