"""The model's weights, declared once (MODEL.md §5 names, §6 official sources).

Each `TensorSpec` says: the GGUF name, the numpy-order shape in ModelConfig's terms, the types a loader
accepts, the storage slot our writers use (the ds4 convention), the official checkpoint tensor it comes from,
which layers have it (a ModelConfig predicate), and where it lives in the typed binding the forward reads.
Everything else derives from this table:

    expected_tensors(cfg)          -> model_tensors / check_tensors (loading: ModelConfig.from_gguf)
    entries(cfg)                   -> convert.ds4_layout (the converter's and make-tiny's output, in file order)
    bind(cfg, resolve)             -> ModelWeights: per-layer dataclasses of a backend's tensor handles

so the forward never assembles a weight name from strings: it reads `layer.attn.comp.kv`.
Order is ds4's file order (the golden ds4-tiny GGUF's), which `entries` preserves.

V4.1's DSpark draft (MODEL.md §3, docs/dspark.md) lives in the V4.1 GGUF itself, after the backbone: its head
tensors `dspark.{main_proj,main_norm,output_norm,markov_embd,markov_head,confidence}` (DSPARK_HEAD_TENSORS) and
one V4.1 block per stage under the layer tensors' names with `blk.{l}.` replaced by `dspark.{s}.` (the stages as
the layers of `ModelConfig.dspark_block_config()`); it shares the main embedding and head. `dspark_entries` /
`expected_dspark_tensors` / `bind_dspark` are its three views.

The MTP draft block (MODEL.md §2.5) lives in a GGUF of its own in ds4's layout, so ds4's published MTP file
loads unchanged: `mtp.0.{e_proj,h_proj,enorm,hnorm,norm,hc_head_*}` plus one block under the layer tensors'
names with `blk.{l}.` replaced by `mtp.0.` (ds4.c `mtp_weights_bind`), declared here as MTP_TENSORS; it shares
the main file's embedding and head. `mtp_entries` / `expected_mtp_tensors` / `bind_mtp` are its three views.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Generic, Iterator, Protocol, TypeVar

from ds4py.quant import FLOAT_TYPES as F
from ds4py.quant import INT_TYPES as I
from ds4py.quant import MATRIX_TYPES as M
from ds4py.quant import vq



class Config(Protocol):
    """What the schema reads of a model's config (a ds4py.config.ModelConfig): the layer and stage counts and the
    draft blocks by name, every other dim and predicate by the TensorSpecs' names. The schema sits below the
    config, which checks a file's tensors against it (check_tensors), so it names no config class."""
    n_layers: int
    dspark_stages: int
    has_dspark: bool

    def mtp_block(self) -> "Config": ...

    def dspark_block_config(self) -> "Config": ...

T = TypeVar("T")                 # a backend's tensor handle (ref: the GGUF TensorInfo; cuda: a device array)


@dataclass(frozen=True)
class TensorSpec:
    name: str                    # GGUF name; "{l}" is the layer
    shape: tuple                 # numpy order; each dim a ModelConfig attribute, a per-layer method, or an int
    types: tuple                 # GGML types a loader accepts
    slot: str                    # what our writers store: q8 | f16 | f32 | experts | i32 (ds4's choice per tensor)
    field: str                   # path in the binding, e.g. "attn.comp.kv"
    src: str                     # official tensor; "{l}" layer, "{e}" expert (slot "experts": one per expert)
    layers: str | None = None    # None: model-level; "all" or a ModelConfig predicate taking the layer
    when: str | None = None      # model-level: a ModelConfig property that must hold (None: always)

    def present(self, cfg: Config, layer: int | None = None) -> bool:
        if self.layers is None:
            return self.when is None or bool(getattr(cfg, self.when))
        return self.layers == "all" or bool(getattr(cfg, self.layers)(layer))

    def dims(self, cfg: Config, layer: int | None = None) -> tuple[int, ...]:
        out = []
        for d in self.shape:
            v = d if isinstance(d, int) else getattr(cfg, d)
            out.append(int(v(layer) if callable(v) else v))
        return tuple(out)


def _model(name: str, shape: tuple, types: tuple, slot: str, field: str, src: str,
           when: str | None = None) -> TensorSpec:
    return TensorSpec(name, shape, types, slot, field, src, None, when)


def _layer(name: str, shape: tuple, types: tuple, slot: str, field: str, src: str,
           layers: str = "all") -> TensorSpec:
    return TensorSpec("blk.{l}." + name, shape, types, slot, field, "layers.{l}." + src, layers)


def _compressor(name: str, field: str, src: str, ratio: str, width: str, out: str, layers: str,
                gate: str, ape: str) -> tuple:
    """A compressor's tensors (MODEL.md §2.3): ape [ratio, c·d], wkv and wgate [c·d, D], norm [d]. V4.1 has no
    ape and no gate on ratio 1 (§3): `gate` / `ape` are the predicates of those two."""
    return (_layer(f"{name}_ape.weight", (ratio, width), F, "f16", f"{field}.ape", f"{src}.ape", ape),
            _layer(f"{name}_kv.weight", (width, "dim"), M, "f16", f"{field}.kv", f"{src}.wkv.weight", layers),
            _layer(f"{name}_gate.weight", (width, "dim"), M, "f16", f"{field}.gate", f"{src}.wgate.weight", gate),
            _layer(f"{name}_norm.weight", (out,), F, "f32", f"{field}.norm", f"{src}.norm.weight", layers))


MODEL_TENSORS = (
    _model("token_embd.weight", ("vocab_size", "dim"), M, "f16", "embed", "embed.weight"),
    _model("output_hc_base.weight", ("hc_mult",), F, "f32", "hc_head.base", "hc_head_base", "has_hc_head"),
    _model("output_hc_fn.weight", ("hc_mult", "hc_dim"), F, "f16", "hc_head.fn", "hc_head_fn", "has_hc_head"),
    _model("output_hc_scale.weight", (1,), F, "f32", "hc_head.scale", "hc_head_scale", "has_hc_head"),
    _model("output_norm.weight", ("dim",), F, "f32", "output_norm", "norm.weight"),
    _model("output.weight", ("vocab_size", "dim"), M, "q8", "head", "head.weight"),
)

LAYER_TENSORS = (
    # Engram (V4.1, MODEL.md §3), applied before the block; its table stays in the official shards (docs/v41.md)
    _layer("engram_kv.weight", ("engram_kv_dim", "engram_in_dim"), M, "q8", "engram.kv", "engram.wkv.weight",
           "is_engram_layer"),
    _layer("engram_q.weight", ("hc_mult", "dim"), F, "f32", "engram.q", "engram.q_weight", "is_engram_layer"),
    _layer("engram_k.weight", ("hc_mult", "dim"), F, "f32", "engram.k", "engram.k_weight", "is_engram_layer"),
    _layer("hc_attn_fn.weight", ("hc_mix", "hc_dim"), F, "f16", "hc_attn.fn", "hc_attn_fn"),
    _layer("hc_attn_scale.weight", (3,), F, "f32", "hc_attn.scale", "hc_attn_scale"),
    _layer("hc_attn_base.weight", ("hc_mix",), F, "f32", "hc_attn.base", "hc_attn_base"),
    _layer("hc_ffn_fn.weight", ("hc_mix", "hc_dim"), F, "f16", "hc_ffn.fn", "hc_ffn_fn"),
    _layer("hc_ffn_scale.weight", (3,), F, "f32", "hc_ffn.scale", "hc_ffn_scale"),
    _layer("hc_ffn_base.weight", ("hc_mix",), F, "f32", "hc_ffn.base", "hc_ffn_base"),
    _layer("attn_norm.weight", ("dim",), F, "f32", "attn_norm", "attn_norm.weight"),
    _layer("attn_q_a.weight", ("q_lora_rank", "dim"), M, "q8", "attn.q_a", "attn.wq_a.weight"),
    _layer("attn_q_a_norm.weight", ("q_lora_rank",), F, "f32", "attn.q_a_norm", "attn.q_norm.weight"),
    _layer("attn_q_b.weight", ("q_dim", "q_lora_rank"), M, "q8", "attn.q_b", "attn.wq_b.weight"),
    _layer("attn_kv.weight", ("head_dim", "dim"), M, "q8", "attn.kv", "attn.wkv.weight"),
    _layer("attn_kv_a_norm.weight", ("head_dim",), F, "f32", "attn.kv_norm", "attn.kv_norm.weight"),
    _layer("attn_sinks.weight", ("n_heads",), F, "f32", "attn.sinks", "attn.attn_sink"),
    _layer("attn_output_a.weight", ("o_dim", "o_group_in"), M, "q8", "attn.out_a", "attn.wo_a.weight"),
    _layer("attn_output_b.weight", ("dim", "o_dim"), M, "q8", "attn.out_b", "attn.wo_b.weight"),
    # the attention compressor (layers that compute compressed rows), the indexer and its own compressor
    *_compressor("attn_compressor", "attn.comp", "attn.compressor", "ratio", "comp_width", "head_dim",
                 "has_compressor", "has_compressor_gate", "has_compressor_ape"),
    _layer("indexer.attn_q_b.weight", ("index_q_dim", "q_lora_rank"), M, "f16", "attn.index.q_b",
           "attn.indexer.wq_b.weight", "has_indexer"),
    _layer("indexer.proj.weight", ("index_heads", "dim"), M, "f16", "attn.index.proj",
           "attn.indexer.weights_proj.weight", "has_indexer"),
    *_compressor("indexer_compressor", "attn.index.comp", "attn.indexer.compressor", "index_ratio",
                 "index_comp_width", "index_head_dim", "has_index_compressor", "has_index_compressor",
                 "has_index_compressor"),
    # V4.1 key owners: indexer keys k = RMSNorm(wk · latent; k_norm) from the compressor's latent
    _layer("indexer.attn_k.weight", ("index_head_dim", "head_dim"), M, "f16", "attn.index.k",
           "attn.indexer.wk.weight", "has_index_key_proj"),
    _layer("indexer.k_norm.weight", ("index_head_dim",), F, "f32", "attn.index.k_norm",
           "attn.indexer.k_norm.weight", "has_index_key_proj"),
    # MoE
    _layer("ffn_norm.weight", ("dim",), F, "f32", "ffn_norm", "ffn_norm.weight"),
    _layer("ffn_gate_inp.weight", ("n_experts", "dim"), M, "f16", "ffn.gate_inp", "ffn.gate.weight"),
    _layer("exp_probs_b.bias", ("n_experts",), F, "f32", "ffn.route_bias", "ffn.gate.bias", "has_route_bias"),
    _layer("ffn_gate_exps.weight", ("n_experts", "expert_ff", "dim"), M, "experts", "ffn.experts.gate",
           "ffn.experts.{e}.w1.weight"),
    _layer("ffn_up_exps.weight", ("n_experts", "expert_ff", "dim"), M, "experts", "ffn.experts.up",
           "ffn.experts.{e}.w3.weight"),
    _layer("ffn_down_exps.weight", ("n_experts", "dim", "expert_ff"), M, "experts", "ffn.experts.down",
           "ffn.experts.{e}.w2.weight"),
    _layer("ffn_gate_shexp.weight", ("shared_ff", "dim"), M, "q8", "ffn.shared.gate", "ffn.shared_experts.w1.weight"),
    _layer("ffn_up_shexp.weight", ("shared_ff", "dim"), M, "q8", "ffn.shared.up", "ffn.shared_experts.w3.weight"),
    _layer("ffn_down_shexp.weight", ("dim", "shared_ff"), M, "q8", "ffn.shared.down", "ffn.shared_experts.w2.weight"),
    _layer("ffn_gate_tid2eid.weight", ("vocab_size", "n_experts_used"), I, "i32", "ffn.tid2eid", "ffn.gate.tid2eid",
           "is_hash_layer"),
)


# The MTP draft block: its own head tensors (official `mtp.0.*`), then one block of LAYER_TENSORS under `mtp.0.`
# (only the tensors of a ratio-0, score-routed layer: ModelConfig.mtp_block()'s layer 0).
MTP_PREFIX = "mtp.0."
MTP_HEAD_TENSORS = (
    _model("mtp.0.hc_head_base.weight", ("hc_mult",), F, "f32", "hc_head.base", "mtp.0.hc_head_base"),
    _model("mtp.0.hc_head_fn.weight", ("hc_mult", "hc_dim"), F, "f16", "hc_head.fn", "mtp.0.hc_head_fn"),
    _model("mtp.0.hc_head_scale.weight", (1,), F, "f32", "hc_head.scale", "mtp.0.hc_head_scale"),
    _model("mtp.0.e_proj.weight", ("dim", "dim"), M, "q8", "e_proj", "mtp.0.e_proj.weight"),
    _model("mtp.0.h_proj.weight", ("dim", "dim"), M, "q8", "h_proj", "mtp.0.h_proj.weight"),
    _model("mtp.0.enorm.weight", ("dim",), F, "f32", "enorm", "mtp.0.enorm.weight"),
    _model("mtp.0.hnorm.weight", ("dim",), F, "f32", "hnorm", "mtp.0.hnorm.weight"),
    _model("mtp.0.norm.weight", ("dim",), F, "f32", "norm", "mtp.0.norm.weight"),
)
MTP_BLOCK_TENSORS = tuple(replace(sp, name=sp.name.replace("blk.{l}.", MTP_PREFIX), field="block." + sp.field,
                                  src=sp.src.replace("layers.{l}.", MTP_PREFIX)) for sp in LAYER_TENSORS)


# The DSpark draft (V4.1): the head tensors (stage 0's main_proj / main_norm, the last stage's norm, Markov head and
# confidence head; "{last}" is the last stage), then each stage's block of LAYER_TENSORS under `dspark.{s}.`.
DSPARK_PREFIX = "dspark."
DSPARK_HEAD_TENSORS = (
    _model("dspark.main_proj.weight", ("dim", "dspark_tap_dim"), M, "q8", "main_proj", "mtp.0.main_proj.weight"),
    _model("dspark.main_norm.weight", ("dim",), F, "f32", "main_norm", "mtp.0.main_norm.weight"),
    _model("dspark.output_norm.weight", ("dim",), F, "f32", "norm", "mtp.{last}.norm.weight"),
    _model("dspark.markov_embd.weight", ("vocab_size", "dspark_rank"), M, "f16", "markov_embed",
           "mtp.{last}.markov_head.embed.weight"),
    _model("dspark.markov_head.weight", ("vocab_size", "dspark_rank"), M, "f16", "markov_head",
           "mtp.{last}.markov_head.head.weight"),
    _model("dspark.confidence.weight", (1, "dspark_conf_dim"), F + M, "f32", "confidence",
           "mtp.{last}.confidence_head.proj.weight"),
)
DSPARK_STAGE_TENSORS = tuple(replace(sp, name=sp.name.replace("blk.{l}.", DSPARK_PREFIX + "{l}."),
                                     src=sp.src.replace("layers.{l}.", "mtp.{l}.")) for sp in LAYER_TENSORS)


@dataclass(frozen=True)
class Entry:
    """One tensor of one model: its spec, layer (None: model-level), GGUF name, shape and official source(s)."""
    spec: TensorSpec
    layer: int | None
    name: str
    shape: tuple[int, ...]

    @property
    def src(self) -> str | list[str]:
        """The official tensor name (a list with one name per expert for stacked experts)."""
        s = self.spec.src.replace("{l}", str(self.layer))
        if self.spec.slot == "experts":
            return [s.replace("{e}", str(e)) for e in range(self.shape[0])]
        return s


def entries(cfg: Config) -> Iterator[Entry]:
    """Every tensor of the model in ds4's file order: the model-level head tensors, then each layer's."""
    for sp in MODEL_TENSORS:
        if sp.present(cfg):
            yield Entry(sp, None, sp.name, sp.dims(cfg))
    for il in range(cfg.n_layers):
        for sp in LAYER_TENSORS:
            if sp.present(cfg, il):
                yield Entry(sp, il, sp.name.replace("{l}", str(il)), sp.dims(cfg, il))


def expected_tensors(cfg: Config) -> dict[str, tuple[tuple[int, ...], tuple]]:
    return {e.name: (e.shape, e.spec.types) for e in entries(cfg)}


def mtp_entries(cfg: Config) -> Iterator[Entry]:
    """Every tensor of the MTP draft file of the model `cfg` (the main config), in ds4's bind order."""
    blk = cfg.mtp_block()
    for sp in MTP_HEAD_TENSORS:
        yield Entry(sp, None, sp.name, sp.dims(cfg))
    for sp in MTP_BLOCK_TENSORS:
        if sp.present(blk, 0):
            yield Entry(sp, 0, sp.name, sp.dims(blk, 0))


def expected_mtp_tensors(cfg: Config) -> dict[str, tuple[tuple[int, ...], tuple]]:
    return {e.name: (e.shape, e.spec.types) for e in mtp_entries(cfg)}


def dspark_entries(cfg: Config) -> Iterator[Entry]:
    """Every tensor of the DSpark draft of the V4.1 model `cfg` (the main config): head tensors, then the stages."""
    last = str(cfg.dspark_stages - 1)
    for sp in DSPARK_HEAD_TENSORS:
        yield Entry(replace(sp, src=sp.src.replace("{last}", last)), None, sp.name, sp.dims(cfg))
    blk = cfg.dspark_block_config()
    for s in range(blk.n_layers):
        for sp in DSPARK_STAGE_TENSORS:
            if sp.present(blk, s):
                yield Entry(sp, s, sp.name.replace("{l}", str(s)), sp.dims(blk, s))


def expected_dspark_tensors(cfg: Config) -> dict[str, tuple[tuple[int, ...], tuple]]:
    return {e.name: (e.shape, e.spec.types) for e in dspark_entries(cfg)}


def model_tensors(cfg: Config) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """Every tensor the forward reads: name -> (numpy-order shape, allowed types), the DSpark draft's included."""
    return expected_tensors(cfg) | (expected_dspark_tensors(cfg) if cfg.has_dspark else {})


def check_tensors(cfg: Config, f: Any) -> None:
    """Raise GGUFError naming the first tensor of GGUF `f` that is missing or has the wrong shape / type."""
    for name, (shape, types) in model_tensors(cfg).items():
        if name.endswith("_exps.weight") and vq.is_vq(f, name):     # VQ-8 routed experts (docs/vq.md)
            vq.check_expert(f, name, shape)
        else:
            f.tensor(name, types=types, shape=shape)


# ---- the typed binding -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HcWeights(Generic[T]):
    fn: T
    scale: T
    base: T


@dataclass(frozen=True)
class CompressorWeights(Generic[T]):
    kv: T
    norm: T
    gate: T | None = None        # absent on V4.1 ratio-1 compressors (no pooling)
    ape: T | None = None         # absent on V4.1


@dataclass(frozen=True)
class IndexerWeights(Generic[T]):
    q_b: T
    proj: T
    comp: CompressorWeights[T] | None = None     # V4: the indexer's own compressor
    k: T | None = None                           # V4.1 key owners: wk and k_norm
    k_norm: T | None = None


@dataclass(frozen=True)
class EngramWeights(Generic[T]):
    kv: T                        # wkv [(hc + 1)·D, n_cols·row]
    q: T                         # q_weight [hc, D]
    k: T                         # k_weight [hc, D]


@dataclass(frozen=True)
class AttentionWeights(Generic[T]):
    q_a: T
    q_a_norm: T
    q_b: T
    kv: T
    kv_norm: T
    sinks: T
    out_a: T
    out_b: T
    comp: CompressorWeights[T] | None = None
    index: IndexerWeights[T] | None = None


@dataclass(frozen=True)
class SwigluWeights(Generic[T]):
    gate: T                      # w1
    up: T                        # w3
    down: T                      # w2


@dataclass(frozen=True)
class FfnWeights(Generic[T]):
    gate_inp: T
    experts: SwigluWeights[T]    # stacked [n_experts, out, in]
    shared: SwigluWeights[T]
    route_bias: T | None = None
    tid2eid: T | None = None


@dataclass(frozen=True)
class LayerWeights(Generic[T]):
    hc_attn: HcWeights[T]
    attn_norm: T
    attn: AttentionWeights[T]
    hc_ffn: HcWeights[T]
    ffn_norm: T
    ffn: FfnWeights[T]
    engram: EngramWeights[T] | None = None       # V4.1 Engram layers


@dataclass(frozen=True)
class ModelWeights(Generic[T]):
    embed: T
    output_norm: T
    head: T
    hc_head: HcWeights[T] | None = None          # V4 (V4.1 collapses with the last pre-mix)
    layers: tuple[LayerWeights[T], ...] = ()


@dataclass(frozen=True)
class MtpWeights(Generic[T]):
    """The MTP draft block (MODEL.md §2.5); the embedding and the head are the main model's."""
    e_proj: T
    h_proj: T
    enorm: T
    hnorm: T
    norm: T
    hc_head: HcWeights[T]
    block: LayerWeights[T]


@dataclass(frozen=True)
class DSparkWeights(Generic[T]):
    """The DSpark draft (MODEL.md §3); the embedding and the head are the main model's."""
    main_proj: T                 # [D, n_targets·D]: the taps -> main_x
    main_norm: T
    norm: T                      # the last stage's norm before the shared head
    markov_embed: T              # [V, r]
    markov_head: T               # [V, r]: bias = markov_head @ markov_embed[token]
    confidence: T                # [1, D + r]
    stages: tuple[LayerWeights[T], ...] = ()


# field name -> the dataclass a group of dotted paths builds
_GROUPS = {"hc_attn": HcWeights, "hc_ffn": HcWeights, "hc_head": HcWeights, "attn": AttentionWeights,
           "comp": CompressorWeights, "index": IndexerWeights, "ffn": FfnWeights, "experts": SwigluWeights,
           "shared": SwigluWeights, "block": LayerWeights, "engram": EngramWeights}


def _build(cls: type, values: dict[str, T], prefix: str = ""):
    kw = {}
    for f in fields(cls):
        path = prefix + f.name
        if f.name in _GROUPS:
            if any(k.startswith(path + ".") for k in values):
                kw[f.name] = _build(_GROUPS[f.name], values, path + ".")
        elif path in values:
            kw[f.name] = values[path]
    return cls(**kw)


def bind(cfg: Config, resolve: Callable[[str], T]) -> ModelWeights[T]:
    """The typed binding: `resolve(gguf_name)` gives a backend's handle for each tensor of the schema."""
    top: dict[str, T] = {}
    per_layer: list[dict[str, T]] = [{} for _ in range(cfg.n_layers)]
    for e in entries(cfg):
        (top if e.layer is None else per_layer[e.layer])[e.spec.field] = resolve(e.name)
    return replace(_build(ModelWeights, top), layers=tuple(_build(LayerWeights, d) for d in per_layer))


def bind_mtp(cfg: Config, resolve: Callable[[str], T]) -> MtpWeights[T]:
    """The MTP draft block's typed binding (`resolve` over the MTP file's tensors); `cfg` is the main config."""
    return _build(MtpWeights, {e.spec.field: resolve(e.name) for e in mtp_entries(cfg)})


def bind_dspark(cfg: Config, resolve: Callable[[str], T]) -> DSparkWeights[T]:
    """The DSpark draft's typed binding (`resolve` over the V4.1 file's tensors); `cfg` is the main config."""
    top: dict[str, T] = {}
    per_stage: list[dict[str, T]] = [{} for _ in range(cfg.dspark_stages)]
    for e in dspark_entries(cfg):
        (top if e.layer is None else per_stage[e.layer])[e.spec.field] = resolve(e.name)
    return replace(_build(DSparkWeights, top), stages=tuple(_build(LayerWeights, d) for d in per_stage))
