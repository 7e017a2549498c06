"""The layer schedule of V4 Flash on CUDA, recorded once for every mode (MODEL.md §2; ds4py/ref/forward.py is the
same math on the host).

    rows = RowSet(mode, parts, buckets, R, slot)        # R rows, each with its state's arrays and context bucket
    rec = Recording(cfg, numerics, freqs, ws, rows, tickets)
    record_body(ls, rec, binding)                       # embed -> per layer: attention(...), moe(...)
    record_head(ls, rec, X, n, hc_head, norm, head)     # hc head collapse + output norm -> head -> ws.logits

A row set is one of three modes (kernels.py picks each mode-dependent operation's kernel from its table):

- DECODE: one row (R = 1), the single-row kernels, captured into a graph per state and context bucket;
- ROWS: up to MAX_ROWS rows of any states (several sequences decoding, a speculative verify of 1 + k rows, the
  MTP block's rows): dense weights read once per GEMV_MAX_X rows, routed gate + up grouped by distinct expert,
  what reads a state (kv store, compressors, indexer, attention, the hash router) once per row in row order;
- BLOCK: the rows of one sequence at consecutive positions (a prefill block of up to MAX_BLOCK tokens): dense
  products on tensor cores, block compressors, indexer and attention over all rows, experts grouped by expert.

A recording may carry V4.1's DSpark taps buffer (Recording.taps: record_body then writes the mean over the hc copies
of each target layer's input state, after its Engram; a plain step's recording has none and launches nothing for
it) and its own operations table (Recording.table: the DSpark draft's block, ds4py/cuda/dspark.py).

Every row's position and token are read on the device from the row set's int32 slot [pos_0 .. pos_{cap-1} |
tok_0 .. tok_{cap-1}] (DECODE: the model's [pos, token]), so a graph replays for any positions. Only the key
capacity of each row's context bucket is fixed at recording (attention plans, indexer score count).

Streams. DECODE and ROWS run each attention sub-layer's KV branch (the kv, compressor and indexer-weight
products, the kv store and the compressors) on the side stream while the main stream computes the queries, and
each MoE sub-layer's shared expert on the side stream while the main stream routes and runs the routed gate + up;
each joins before its consumer. BLOCK runs everything on the main stream, in the same order. Every launch but the
first after a fork or join on its stream is a PDL launch (when the engine runs with PDL). Buffers are reused from
layer to layer: on one stream PDL never lets a kernel write before its predecessor finished, and the side stream
only touches buffers the main stream leaves alone between fork and join.

Rows of one state come in position order; within a layer every row's state writes come before any row's
attention reads. That equals stepping them one by one because a row only reads positions <= its own and the
rings hold window + rollback horizon slots (a chunk of at most horizon + 1 rows never overwrites a slot an earlier
row of the chunk still reads); a block stores its window rows only after its attention (kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ds4py.cuda import kernels, ops
from ds4py.cuda.kernels import BLOCK, DECODE, ROWS, Launcher
from ds4py.cuda.memory import Arena, DeviceArray, align_up
from ds4py.cuda.device_weights import DevTensor
from ds4py.cuda.ops import attention as ops_attn
from ds4py.cuda.ops import dspark as ops_dspark
from ds4py.cuda.ops import moe_prefill as ops_moep
from ds4py.errors import Ds4Error
from ds4py.cuda.ops.mhc import Collapse, MixBuffers, MixWeights, mix_partial_floats, mix_record
from ds4py.cuda.ops.sample import SampleRows, SampleRule

F32, I32, U32, U8 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.uint8)
MAX_ROWS = 16             # rows of one ROWS step (a verify of 1 + k <= 16 rows is one step)
MAX_BLOCK = 2048          # rows of one BLOCK (prefill) step
HEAD_ROWS = 16            # rows per head pass of a block (all_logits runs the head in passes of this many rows)

__all__ = ["BLOCK", "DECODE", "HEAD_ROWS", "Launcher", "MAX_BLOCK", "MAX_ROWS", "ROWS", "Recording", "RowSet",
           "Workspace", "attn_plans", "block_rows", "final_residual", "index_keys", "make_workspace", "record_body",
           "record_head", "record_layer", "record_sample", "workspace_bytes", "workspace_shapes"]


# ---- the workspace: one declaration, sized by the row set ---------------------------------------------------
def bucket_keys(cfg, ro, bucket: int) -> int:
    """Keys a decode query of this layer attends to at most, below position `bucket`: its window plus the
    compressed rows it can see (all of them, or its index source's top-k: its own indexer's, or V4.1's latest
    index source's)."""
    if not ro.compressed:
        return cfg.window
    n = bucket // ro.ratio
    return cfg.window + (min(n, cfg.index_topk) if ro.indexer or ro.index_source >= 0 else n)


def attn_plans(cfg, bucket: int, profile: Any = None) -> list[ops_attn.AttnPlan]:
    """The layers' decode attention plans on `profile`'s device (ops_attn.attn_geometry; None: the default geometry)."""
    geo = ops_attn.attn_geometry(profile, cfg.n_heads, cfg.head_dim)
    return [ops_attn.geometry_plan(geo, cfg.n_heads, cfg.head_dim, max(1, bucket_keys(cfg, cfg.roles(il), bucket)))
            for il in range(cfg.n_layers)]


def index_keys(cfg, bucket: int) -> int:
    """Indexer scores per query at most (the widest indexer layer)."""
    return max([bucket // cfg.roles(il).index_ratio for il in range(cfg.n_layers) if cfg.roles(il).indexer],
               default=0)


def block_rows(n: int) -> int:
    """The workspace rows of a block of n tokens: a power of two >= 32, at most MAX_BLOCK."""
    b = 32
    while b < n:
        b *= 2
    return min(b, MAX_BLOCK)


Shapes = dict[str, tuple[tuple[int, ...], np.dtype]]


def workspace_shapes(cfg, bucket: int, rows: int = 1, mode: str = DECODE, hidden_in: bool = False,
                     act_quant: bool = False) -> Shapes:
    """Every per-step buffer of a row set of `rows` rows (its capacity) in `mode`, for context buckets up to
    `bucket`. Per-row buffers are [rows, ...] (DECODE: one row, no leading axis); what runs once per row in row
    order (indexer scores, top-k, attention partials) is one row's scratch, except in BLOCK, whose indexer runs
    over all rows at once. hidden_in: the MTP block's input states [rows, hc, D]. act_quant (Numerics.act_quant):
    the rounded activations' buffers (kernels.act_x)."""
    hc, D, k, ih = cfg.hc_mult, cfg.dim, cfg.n_experts_used, cfg.index_heads
    comp_w = max([cfg.comp_width(il) for il in range(cfg.n_layers) if cfg.roles(il).compressor], default=2)
    idx_w = max([cfg.index_comp_width(il) for il in range(cfg.n_layers) if cfg.roles(il).index_compressor],
                default=2)
    mrec, n_keys = mix_record(hc), max(1, index_keys(cfg, bucket))
    lead = () if mode == DECODE else (rows,)
    head = () if mode == DECODE else (min(rows, HEAD_ROWS) if mode == BLOCK else rows,)
    shapes: Shapes = {}
    if mode != DECODE:                  # DECODE reads the model's [pos, token] slot and its one ticket
        shapes["slot"] = ((2 * rows,), I32)
        shapes["tickets"] = ((rows,), U32)
    shapes["mix_partial"] = ((mix_partial_floats(rows, mrec, D, hc),), F32)
    per_row = {
        "X0": (hc, D), "X1": (hc, D), "mix_attn": (mrec,), "mix_ffn": (mrec,), "x_attn": (D,), "x_ffn": (D,),
        "qa": (cfg.q_lora_rank,), "q": (cfg.q_dim,), "kv": (cfg.head_dim,), "ckv": (comp_w,), "csc": (comp_w,),
        "ikv": (idx_w,), "isc": (idx_w,), "iq_raw": (ih * cfg.index_head_dim,), "iq": (ih * cfg.index_head_dim,),
        "iw": (ih,), "o": (cfg.q_dim,), "u": (cfg.o_dim,), "router": (cfg.n_experts,), "ids": (k,), "wts": (k,),
        "h_shared": (cfg.shared_ff,), "y_shared": (D,), "h": (k, cfg.expert_ff),
    }
    for name, s in per_row.items():
        shapes[name] = (lead + s, I32 if name == "ids" else F32)
    for name, s in (("mix_head", (mrec,)), ("x_head", (D,)), ("logits", (cfg.vocab_size,))):
        shapes[name] = (head + s, F32)
    if mode == BLOCK:
        shapes["scores"] = ((rows, n_keys), F32)
        shapes["sel"] = ((rows, max(1, cfg.index_topk)), I32)
        widest = max(D, cfg.q_lora_rank, cfg.q_dim, cfg.o_dim, cfg.shared_ff)
        shapes.update({
            "kvb": ((rows, cfg.head_dim), F32),         # the block's kv rows (stored into the ring after attention)
            # the tensor-core path: normalised q_a rows, sub-layer outputs before hc_post, the shared expert's gate
            # and up, x in bf16 pieces, the grouped MoE's scratch
            "qa_n": ((rows, cfg.q_lora_rank), F32), "f": ((rows, D), F32), "hs_g": ((rows, cfg.shared_ff), F32),
            "hs_u": ((rows, cfg.shared_ff), F32), **{f"xp{i}": ((rows * widest,), F32) for i in range(3)},
            **{f"moe.{n}": v for n, v in ops_moep.MoePrefillBuffers.shapes(rows, k, cfg.n_experts, cfg.expert_ff,
                                                                             D).items()},
        })
    else:
        plans = [p for il in range(cfg.n_layers)          # every device's splits fit (ops_attn.workspace_plans)
                 for p in ops_attn.workspace_plans(cfg.n_heads, cfg.head_dim,
                                                   max(1, bucket_keys(cfg, cfg.roles(il), bucket)))]
        shapes["scores"] = ((n_keys,), F32)
        shapes["sel"] = ((cfg.index_topk,), I32)
        shapes["part_o"] = ((max(int(np.prod(p.part_o_shape)) for p in plans),), F32)
        shapes["part_ml"] = ((max(int(np.prod(p.part_ml_shape)) for p in plans),), F32)
    if cfg.traits.source_layers:        # V4.1's latent keys, candidates, shared top-k, Engram
        shapes.update(v41_shapes(cfg, rows, mode, lead, n_keys))
    if hidden_in:
        shapes["h_in"] = ((rows, hc, D), F32)
    if act_quant:
        shapes.update(act_shapes(cfg, mode, lead))
    if cfg.dspark_targets:              # V4.1 with its DSpark draft: the rows' taps (recorded only when asked for)
        shapes["taps"] = (lead + (cfg.dspark_tap_dim,), F32)
    return shapes


def v41_shapes(cfg, rows: int, mode: str, lead: tuple, n_keys: int) -> Shapes:
    """V4.1's extra buffers: the compressor latent and the key owner's wk . latent, the candidate rows (per row:
    they live from the candidate source to the indexers after it), Engram's table rows as stored (the step's input,
    FP8 codes and e8m0 scales staged by the host: [engram layers, rows, ...]), dequantised, and its wkv output. A
    row's top-k is per row too (the later layers reuse their index source's)."""
    out: Shapes = {"clat": (lead + (cfg.head_dim,), F32), "ik": (lead + (cfg.index_head_dim,), F32),
                   "cand": (lead + (n_keys,), I32)}
    if mode == ROWS:
        out["sel"] = ((rows, max(1, cfg.index_topk)), I32)
    if cfg.engram_layers:
        nE, width = len(cfg.engram_layers), cfg.engram_in_dim
        out["engram_codes"] = ((nE, rows, width), U8)
        out["engram_scales"] = ((nE, rows, width // 32), U8)
        out["engram_rows"] = ((nE, rows, width), F32)
        out["ekv"] = (lead + (cfg.engram_kv_dim,), F32)
    return out


def act_width(cfg) -> int:
    """The widest activation a product reads through a rounded copy (kernels.act_x): x_attn / x_ffn / x_head (D),
    the normalised q_a, the shared expert's h, V4.1's compressor latent and Engram rows. (o, u and the routed h are
    rounded in place: each has one reader.)"""
    return max(cfg.dim, cfg.q_lora_rank, cfg.shared_ff, cfg.head_dim,
               cfg.engram_in_dim if cfg.traits.engram and cfg.engram_layers else 0)


def act_shapes(cfg, mode: str, lead: tuple) -> Shapes:
    """The rounded copies of act_quant: one per stream (BLOCK: main only) and rounding (Q8_0, Q8_K blocks), so the
    side stream never writes what the main stream reads."""
    streams = ("main",) if mode == BLOCK else ("main", "side")
    return {f"aq.{s}.{kind}": (lead + (act_width(cfg),), F32) for s in streams for kind in ("q8_0", "q8_k")}


def workspace_bytes(shapes: Shapes) -> int:
    return sum(align_up(int(np.prod(s)) * dt.itemsize) for s, dt in shapes.values()) + 256


@dataclass
class Workspace:
    """The arrays of one workspace declaration. DECODE's live in the arena's scratch (valid until the scratch
    moves: `version` changes with it); ROWS' and BLOCK's in one zeroed store block (their tickets start, and stay,
    zero)."""
    mode: str
    bucket: int                    # the largest context bucket it serves (attention partials, indexer scores)
    rows: int                      # row capacity
    version: int                   # changes whenever its arrays move
    block: Any                     # the DeviceBlock holding every array (None: arena scratch)
    a: dict[str, DeviceArray]

    def __getattr__(self, name: str) -> DeviceArray:
        try:
            return self.__dict__["a"][name]
        except KeyError:
            raise AttributeError(name) from None


def make_workspace(cfg, bucket: int, rows: int, mode: str, version: int = 0, arena: Arena | None = None,
                   store: Any = None, rt: Any = None, hidden_in: bool = False, act_quant: bool = False) -> Workspace:
    """DECODE: from `arena`'s scratch; else one zeroed block of `store` (rt: the runtime to zero it on)."""
    shapes = workspace_shapes(cfg, bucket, rows, mode, hidden_in, act_quant)
    if mode == DECODE:
        arena.begin_step(workspace_bytes(shapes))
        return Workspace(mode, bucket, rows, version, None,
                         {name: arena.scratch(s, dt) for name, (s, dt) in shapes.items()})
    return Workspace(mode, bucket, rows, version, *zeroed_block(store, rt, shapes))


def zeroed_block(store: Any, rt: Any, shapes: Shapes) -> tuple[Any, dict[str, DeviceArray]]:
    """One zeroed block of `store` holding an array per (shape, dtype) of `shapes`, each 256-byte aligned."""
    offs, at = {}, 0
    for name, (s, dt) in shapes.items():
        offs[name] = at
        at += align_up(int(np.prod(s)) * np.dtype(dt).itemsize)
    blk = store.block(at)
    blk.zero(rt.main)
    return blk, {n: blk.array(offs[n], s, dt) for n, (s, dt) in shapes.items()}


# ---- the row set and the recording -----------------------------------------------------------------------------
@dataclass
class RowSet:
    """R rows: row n at position slot[n] with token slot[cap + n], of the state parts[n] (BLOCK: parts[0] for
    every row) in context bucket buckets[n] (BLOCK: one bucket, its last position's)."""
    mode: str
    parts: list[dict[str, DeviceArray]]
    buckets: list[int]
    R: int
    slot: DeviceArray              # int32 [cap positions | cap tokens]
    cap: int = 0                   # the slot's row capacity (0: R)
    keys: list | None = None       # per part: {indexer layer: the layer whose keys it scores} (the official decode
                                   # bug, engine._key_layers; None: each scores its key owner's)

    def __post_init__(self) -> None:
        self.cap = self.cap or self.R

    def pos(self, n: int) -> DeviceArray:
        return self.slot.view(4 * n, 1)

    def token(self, n: int) -> DeviceArray:
        return self.slot.view(4 * (self.cap + n), 1)

    @property
    def positions(self) -> DeviceArray:
        return self.slot.view(0, self.R)

    @property
    def tokens(self) -> DeviceArray:
        return self.slot.view(4 * self.cap, self.R)

    def state(self, n: int) -> dict[str, DeviceArray]:
        return self.parts[0 if self.mode == BLOCK else n]

    def index_keys(self, n: int, il: int, ro: Any, n_keys: int) -> DeviceArray:
        """The indexer keys row n's indexer at layer il scores (n_keys rows of them): its key owner's, or with the
        official decode bug the layer the engine chose for this step."""
        src = ro.index_keys if self.keys is None else self.keys[0 if self.mode == BLOCK else n].get(il, ro.index_keys)
        keys = self.state(n)[f"{src}.idx_keys"]
        if keys.shape[0] < n_keys:
            raise Ds4Error(f"the official decode bug would have layer {il} score {n_keys} keys of layer {src}, which "
                           f"holds {keys.shape[0]}")
        return keys


@dataclass
class Recording:
    """What one recording reads: the config, numerics, the layers' RoPE tables, the workspace, the row set, the
    hc_mix tickets (zero between launches) and the BLOCK products' options."""
    cfg: Any
    numerics: Any
    freqs: list
    ws: Workspace
    rows: RowSet
    tickets: DeviceArray
    onehot: DeviceArray | None = None   # V4.1: the first block's pre-mix [1, 0, .., 0] (read with stride 0)
    engram_weights: dict = field(default_factory=dict)   # V4.1: Engram e's q_w * k_w [hc, D]
    mma: bool = True                # BLOCK: dense products on tensor cores (cu/gemm.cu), else the `_rows` GEMVs
    x_pieces: int = 3               # ... with x as this many bf16 pieces (1: x rounded to bf16; 3: x exact)
    expert_mma: bool = False        # BLOCK: the experts on tensor cores too (cu/moe_prefill.cu: x, h in bf16; VQ-8: exact)
    expert_tiles: bool = False      # BLOCK, not expert_mma: the GGML experts as exact fp32 token tiles grouped by expert
                                    # (cu/moe_prefill.cu moe_*_tile_<fmt>), not the grouped rows kernels
    taps: DeviceArray | None = None  # V4.1's DSpark taps of the rows [R, n_targets * D] (None: not recorded)
    table: Any = None               # the operations table in place of kernels.of(mode, variant) (the DSpark block's)
    _plans: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.numerics.act_quant:     # int8 activations: a block's experts run the int8 grouped rows kernels (the
            self.expert_mma = self.expert_tiles = False      # prefill tiles and tensor-core experts are fp32 only)

    @property
    def mode(self) -> str:
        return self.rows.mode

    @property
    def R(self) -> int:
        return self.rows.R

    def plan(self, n: int, il: int, profile: Any = None) -> ops_attn.AttnPlan:
        """Row n's attention plan at layer il on `profile`'s device: its own context bucket's (the split a single
        step would use)."""
        b = self.rows.buckets[0 if self.mode == BLOCK else n]
        key = (b, profile.name if profile is not None else None)
        if key not in self._plans:
            self._plans[key] = attn_plans(self.cfg, b, profile)
        return self._plans[key][il]

    def fork(self, ls: Launcher) -> None:
        if self.mode != BLOCK:
            ls.fork()

    def join(self, ls: Launcher) -> None:
        if self.mode != BLOCK:
            ls.join()

    def side(self, ls: Launcher):
        """The stream the KV branch and the shared expert run on (BLOCK: main)."""
        return ls.main if self.mode == BLOCK else ls.side

    def ops(self):
        """This recording's operations table (kernels.py; V4.1 has its own roles; a recording may bring its own)."""
        return self.table if self.table is not None else kernels.of(self.mode, self.cfg.variant)

    def moe_bufs(self) -> "ops_moep.MoePrefillBuffers":
        return ops_moep.MoePrefillBuffers(**{n: self.ws.a[f"moe.{n}"] for n in
                                             ops_moep.MoePrefillBuffers.shapes(1, 1, 1, 32, 32)})


def final_residual(rec: Recording) -> DeviceArray:
    """The residual after the last layer (BLOCK's grouped experts, tensor cores or token tiles, update it in place:
    always X0)."""
    ws = rec.ws
    return ws.X0 if rec.cfg.n_layers % 2 == 0 or (rec.mode == BLOCK and grouped_experts(rec)) else ws.X1


def grouped_experts(rec: Recording) -> bool:
    """BLOCK: the routed experts of the whole block grouped by expert (route, gate + up, down, combine into ws.f),
    the sub-layer output added to the residual in place (hc_post)."""
    return rec.expert_mma or rec.expert_tiles


# ---- the schedule ----------------------------------------------------------------------------------------------
def record_body(ls: Launcher, rec: Recording, B: Any) -> None:
    """Embedding and every layer of binding B over the row set; the residual ends in final_residual(rec)."""
    cfg, ws = rec.cfg, rec.ws
    ops.embed(ls, ops.Embedding(B.embed.array, copies=cfg.hc_mult), rec.rows.tokens, ws.X0, rec.R, **ls.main())
    X, other = ws.X0, ws.X1
    for il, lw in enumerate(B.layers):
        e = cfg.roles(il).engram
        if e >= 0:                                   # V4.1: Engram before its block
            rec.ops().engram(ls, rec, e, lw.engram, X)
        if rec.taps is not None and il in cfg.dspark_targets:
            record_tap(ls, rec, il, X)
        Y = record_layer(ls, rec, il, lw, X, other)
        if Y is not X:
            X, other = Y, X


def record_tap(ls: Launcher, rec: Recording, il: int, X: DeviceArray) -> None:
    """V4.1's DSpark tap of target layer il: the mean over the hc copies of its input state (after its Engram),
    into the rows' taps at the target's place in layer order (ref/forward.py's X.mean(1), concatenated)."""
    cfg, D, R = rec.cfg, rec.cfg.dim, rec.R
    k, width = sorted(cfg.dspark_targets).index(il), cfg.dspark_tap_dim
    ops_dspark.hc_sum(ls, X, R, D, ops_dspark.HcSum(rec.taps.view(4 * k * D, (R - 1) * width + D), 1.0 / cfg.hc_mult,
                                                    y_stride=width), cfg.hc_mult, **ls.main())


def record_layer(ls: Launcher, rec: Recording, il: int, lw: Any, X: DeviceArray, X_out: DeviceArray) -> DeviceArray:
    """Layer il (weights lw, roles cfg.roles(il)) from residual X: returns the buffer holding the new residual
    (X_out, or X itself when the experts update it in place)."""
    ro = rec.cfg.roles(il)
    attention(ls, rec, il, ro, lw, X)
    return moe(ls, rec, il, ro, lw, X, X_out)


def mix_weights(cfg: Any, hw: Any) -> MixWeights:
    """A sub-layer's (or the head's) mHC mix weights with the model's widths and epsilons."""
    return MixWeights(hw.fn.array, hw.scale.array, hw.base.array, cfg.dim, cfg.norm_eps, cfg.hc_eps,
                      cfg.sinkhorn_iters, cfg.hc_mult)


def hc_pre(ls: Launcher, rec: Recording, hw: Any, norm: DevTensor, X: DeviceArray, mix: DeviceArray, x: DeviceArray,
           n: int | None = None, pre: tuple[DeviceArray, int] | None = None) -> None:
    """A sub-layer's input: the mHC mix (pre, post, Sinkhorn C) of X, then RMSNorm(sum_j pre_j X_j) with this mix's
    pre, or (V4.1's lagged mHC) pre = (the earlier sub-layer's mix records, their stride)."""
    cfg, n = rec.cfg, rec.R if n is None else n
    src, stride = pre if pre is not None else (None, 0)          # one launch: the mix's last block collapses
    ops.hc_mix(ls, mix_weights(cfg, hw), MixBuffers(X, n, mix, rec.ws.mix_partial, rec.tickets),
               Collapse(x, norm.array, cfg.norm_eps, src, stride), **ls.main())


def lagged_pre(rec: Recording, il: int, sub: str) -> tuple[DeviceArray, int] | None:
    """V4.1's lagged mHC: the attention collapses with the incoming pre-mix (the previous block's FFN mix, still in
    mix_ffn; layer 0: one-hot), the FFN with this block's attention mix. None for V4."""
    if not rec.cfg.lagged_hc:
        return None
    mrec = mix_record(rec.cfg.hc_mult)
    if sub == "ffn":
        return rec.ws.mix_attn, mrec
    return (rec.onehot, 0) if il == 0 else (rec.ws.mix_ffn, mrec)


def attention(ls: Launcher, rec: Recording, il: int, ro: Any, lw: Any, X: DeviceArray) -> None:
    cfg, ws, A, K = rec.cfg, rec.ws, lw.attn, rec.ops()
    D, eps = cfg.dim, cfg.norm_eps
    hc_pre(ls, rec, lw.hc_attn, lw.attn_norm, X, ws.mix_attn, ws.x_attn, pre=lagged_pre(rec, il, "attn"))

    # the KV branch: the kv row(s), the compressors' inputs and emissions (side stream but in BLOCK)
    rec.fork(ls)
    side = rec.side(ls)
    mats = [(A.kv, ws.kv, cfg.head_dim)]
    if ro.compressor:
        w2 = cfg.comp_width(il)
        mats += [(A.comp.kv, ws.ckv, w2)] + ([(A.comp.gate, ws.csc, w2)] if ro.gated else [])
    if ro.indexer and A.index.comp is not None:
        wi = cfg.index_comp_width(il)
        mats += [(A.index.comp.kv, ws.ikv, wi), (A.index.comp.gate, ws.isc, wi)]
    if ro.indexer:
        mats.append((A.index.proj, ws.iw, cfg.index_heads))
    K.dense(ls, rec, mats, ws.x_attn, D, side)
    K.kv_store(ls, rec, il, A, side)
    if cfg.is_v41:                           # V4.1's compressor math: one op, its indexer keys from the latent
        if ro.compressor:
            K.compress(ls, rec, il, ro, A, side)
    else:
        if ro.compressor:
            K.compress(ls, rec, il, ro, A.comp, "comp", side)
        if ro.indexer:
            K.compress(ls, rec, il, ro, A.index.comp, "idx", side)

    # the queries (main stream)
    K.dense(ls, rec, [(A.q_a, ws.qa, cfg.q_lora_rank)], ws.x_attn, D, ls.main)
    mats = [(A.q_b, ws.q, cfg.q_dim)]
    if ro.indexer:
        mats.append((A.index.q_b, ws.iq_raw, cfg.index_q_dim))
    K.dense(ls, rec, mats, ws.qa, cfg.q_lora_rank, ls.main, norm=(A.q_a_norm.array, eps))
    if ro.indexer:
        K.index_queries(ls, rec, il)
    rec.join(ls)

    # each row's attention over its state (the indexer's selection first), then the output projection
    K.attend(ls, rec, il, ro, A)
    K.dense(ls, rec, [(A.out_a, ws.u, cfg.o_dim)], ws.o, cfg.o_group_in, ls.main, x_group_rows=cfg.o_lora_rank,
            x_stride=cfg.q_dim, own=True)          # (o has no other reader: act_quant rounds it in place)
    K.dense_hc_post(ls, rec, A.out_b, ws.u, X, ws.mix_attn, cfg.o_dim)


def moe(ls: Launcher, rec: Recording, il: int, ro: Any, lw: Any, X: DeviceArray, X_out: DeviceArray) -> DeviceArray:
    cfg, ws, Fw, K = rec.cfg, rec.ws, lw.ffn, rec.ops()
    D, clamp = cfg.dim, cfg.swiglu_clamp[il]
    hc_pre(ls, rec, lw.hc_ffn, lw.ffn_norm, X, ws.mix_ffn, ws.x_ffn, pre=lagged_pre(rec, il, "ffn"))

    # the shared expert (side stream but in BLOCK)
    rec.fork(ls)
    side = rec.side(ls)
    S = Fw.shared
    kernels.pick("shared_gate_up", S.gate.qtype, rec.mode)(ls, rec, S, clamp, side)
    kernels.pick("shared_down", S.down.qtype, rec.mode)(ls, rec, S, side)

    # the router and the routed gate + up (main stream), then the routed down + the shared expert's output + the
    # mHC post into the new residual
    K.dense(ls, rec, [(Fw.gate_inp, ws.router, cfg.n_experts)], ws.x_ffn, D, ls.main)
    K.route(ls, rec, ro, Fw)
    K.experts_gate_up(ls, rec, Fw.experts, clamp)
    rec.join(ls)
    return K.experts_down(ls, rec, Fw.experts, X, X_out)


def record_head(ls: Launcher, rec: Recording, X: DeviceArray, n: int, H: Any, norm: DevTensor, head: DevTensor,
                r0: int = 0) -> None:
    """ws.logits[:n] = head(RMSNorm(hc_head(X[r0 .. r0 + n)); norm)) (H: the hc head's weights; V4.1, H None: the
    copies collapse with the last FFN's pre-mix, still in mix_ffn)."""
    cfg, ws = rec.cfg, rec.ws
    hc, D, mrec = cfg.hc_mult, cfg.dim, mix_record(cfg.hc_mult)
    Xr = X.view(4 * r0 * hc * D, (n, hc, D)) if rec.mode == BLOCK else X
    if H is None:
        mix = ws.mix_ffn.view(4 * r0 * mrec, n * mrec) if rec.mode == BLOCK else ws.mix_ffn
        ops.hc_collapse_norm(ls, ops.HcRows(Xr, n, D, hc=hc), Collapse(ws.x_head, norm.array, cfg.norm_eps, mix),
                             **ls.main())
    else:                                                        # the head's pre-only mix, then its collapse
        ops.hc_mix(ls, mix_weights(cfg, H), MixBuffers(Xr, n, ws.mix_head, ws.mix_partial, rec.tickets),
                   Collapse(ws.x_head, norm.array, cfg.norm_eps), **ls.main())
    kernels.of(rec.mode).dense(ls, rec, [(head, ws.logits, cfg.vocab_size)], ws.x_head, D, ls.main, n=n)


def record_sample(ls: Launcher, rec: Recording, sampling: tuple) -> None:
    """The sampler on ws.logits (one row): the next token into the slot (-1 when the logits are no distribution),
    its draw keyed by the sampled token's position (pos + 1). sampling = (temperature, top_k, top_p, min_p, seed)."""
    ops.sample(ls, SampleRule(*sampling), rec.ws.logits, rec.rows.token(0),
               SampleRows(n=rec.cfg.vocab_size, pos_slot=rec.rows.pos(0), pos_offset=1), **ls.main())
