"""The operations of the layer schedule (ds4py/cuda/layer.py) that differ by mode, and the table that picks their
kernels: (operation, weight format, mode) -> a function (ls, rec, ...).

    kernels.of(DECODE).dense(ls, rec, mats, x, cols, ls.main)          # an operation whose kernel depends on mode
    kernels.pick("shared_gate_up", S.gate.qtype, ROWS)(ls, rec, S, clamp, stream)   # ... and on a weight format

Modes: DECODE (one row, the single-row kernels), ROWS (up to 16 rows of any states: the `_rows` GEMVs, experts
grouped by distinct expert, what reads a state once per row), BLOCK (the rows of one sequence: tensor-core GEMMs,
block compressors, indexer and attention over all rows). A row of ROWS is bit-identical to its DECODE step: the
`_rows` GEMVs are the same template with more accumulator sets, the grouped gate + up runs each (row, slot) pair
through the same device function, and each row's attention plan is the one its own context bucket gives. BLOCK
differs from DECODE in summation order only (docs/cuda.md "Prefill").

Weight formats: "dense" (what the GEMVs and GEMMs read: Q8_0 / F16 / F32 / Q4_K) or "experts" (the expert formats of
cu/moe_formats.cuh's MOE_FORMATS list: a new one needs its decoder there, no entry here).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Protocol

from ds4py.cuda import ops
from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.device_weights import GEMV_TYPES, DevTensor
from ds4py.cuda.devices import DeviceProfile
from ds4py.cuda.launch import Dim
from ds4py.cuda.ops import act_quant as ops_aq
from ds4py.cuda.ops import attention as ops_attn
from ds4py.cuda.ops import compressor as ops_comp
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.ops import gemm as ops_gemm
from ds4py.cuda.ops import indexer as ops_idx
from ds4py.cuda.ops import moe_prefill as ops_moep
from ds4py.cuda.ops import prefill_attn as ops_pfa
from ds4py.cuda.ops import router as ops_route
from ds4py.cuda.ops import topk as ops_topk
from ds4py.cuda.ops import v41 as ops_v41
from ds4py.cuda.ops.core import TokenRows, need
from ds4py.cuda.ops.experts import Experts, HcPost, Slots
from ds4py.cuda.ops.gemm import GemmShape
from ds4py.cuda.ops.gemv import GEMV_MAX_X, MAX_MATS, GemvX, SwiGlu
from ds4py.cuda.ops.mhc import HcResidual, mix_record
from ds4py.cuda.ops.rmsnorm import rmsnorm
from ds4py.ggml_types import GGMLQuantizationType as QT
from ds4py.host.indexer import weight_scale
from ds4py.schema import AttentionWeights, CompressorWeights, EngramWeights, FfnWeights, SwigluWeights

if TYPE_CHECKING:
    from ds4py.config import LayerRoles, ModelConfig
    from ds4py.contract import Numerics

DECODE, ROWS, BLOCK = "decode", "rows", "block"


class Recording(Protocol):
    """What the operations read of the layer schedule's recording (ds4py/cuda/layer.py `Recording`, which imports
    this module: a Protocol here keeps the import graph pointing one way)."""
    cfg: ModelConfig
    numerics: Numerics
    freqs: list
    ws: Any                          # layer.Workspace: its arrays by name
    rows: Any                        # layer.RowSet
    engram_weights: dict
    mma: bool
    x_pieces: int
    expert_mma: bool
    expert_tiles: bool

    @property
    def mode(self) -> str: ...

    @property
    def R(self) -> int: ...

    def plan(self, n: int, il: int, profile: DeviceProfile | None = None) -> ops_attn.AttnPlan: ...

    def moe_bufs(self) -> ops_moep.MoePrefillBuffers: ...

# The operations' arguments by the names they take throughout: ls a Launcher, rec the layer schedule's Recording,
# il a layer index, ro its LayerRoles, and the layer's weights as the device binding holds them (schema structs of
# DevTensor):
Attention = AttentionWeights[DevTensor]      # A: a layer's attention
Compressor = CompressorWeights[DevTensor]    # C: a compressor (the attention's or its indexer's)
Ffn = FfnWeights[DevTensor]                  # Fw: a layer's MoE (router, routed and shared experts)
Swiglu = SwigluWeights[DevTensor]            # S: the shared expert, E: the routed experts (gate, up, down)
Engram = EngramWeights[DevTensor]            # V4.1's Engram e
WeightFormat = QT | str                      # a GGML type, or an expert kernel format ("vq12", "vq13": VQ-8)
State = dict[str, DeviceArray]               # one sequence's state arrays ("{il}.win", "{il}.comp_rows", ...)
Stream = object                              # a runtime's stream handle (CUstream, EmuStream, PlanStream): opaque
Mats = list[tuple[DevTensor, DeviceArray, int]]          # products sharing x: (weights, y, rows)
Norm = tuple[DeviceArray | None, float] | None           # an RMSNorm prologue (weights or None, eps), or none


# ---- launches: streams, PDL, counting ------------------------------------------------------------------------
class LaunchRuntime(Protocol):
    """What a Launcher drives: Runtime, EmuRuntime or the plan runtime (ds4py/cuda/plan_runtime.py)."""
    device: object                           # what ops size grids from (sm_count, ...): a device or its profile
    profile: DeviceProfile
    main: Stream
    side: Stream

    def launch(self, name: str, grid: Dim, block: Dim, *args: object, smem: int = 0, stream: Stream = None,
               pdl: bool = False) -> None: ...

    def fork(self) -> None: ...

    def join(self) -> None: ...


class Launcher:
    """The runtime as the record functions see it: counts kernel launches and picks each launch's stream and PDL
    flag (no PDL on the first launch after a fork / join on that stream: its other dependency is an event)."""

    def __init__(self, rt: LaunchRuntime, pdl: bool):
        self.rt, self.pdl = rt, pdl
        self.device, self.profile = rt.device, rt.profile
        self.launches = 0
        self.side_launches = 0
        self._fresh = {id(rt.main): True, id(rt.side): True}

    # ops.* call rt.launch(...) and read rt.device: this object stands in for the runtime there
    def launch(self, name: str, grid: Dim, block: Dim, *args: object, smem: int = 0, stream: Stream = None,
               pdl: bool = False) -> None:
        self.launches += 1
        self.side_launches += stream is self.rt.side
        self.rt.launch(name, grid, block, *args, smem=smem, stream=stream, pdl=pdl)

    def on(self, stream: Stream) -> dict:
        """stream= / pdl= for the next op on `stream` (main or side)."""
        fresh = self._fresh[id(stream)]
        self._fresh[id(stream)] = False
        return {"stream": stream, "pdl": self.pdl and not fresh}

    def main(self) -> dict:
        return self.on(self.rt.main)

    def side(self) -> dict:
        return self.on(self.rt.side)

    def fork(self) -> None:
        self.rt.fork()
        self._fresh[id(self.rt.side)] = True

    def join(self) -> None:
        self.rt.join()
        self._fresh[id(self.rt.main)] = True


# ---- views ---------------------------------------------------------------------------------------------------
def row(a: DeviceArray, n: int, width: int) -> DeviceArray:
    """Row n of a buffer used as [R, width] (width: this use's row length, not the buffer's widest)."""
    return a.view(4 * n * width, width)


def rows_of(a: DeviceArray, n0: int, n: int, width: int) -> DeviceArray:
    """Rows n0 .. n0 + n of a buffer used as [R, width]."""
    return a.view(4 * n0 * width, n * width)


# ---- dense products ------------------------------------------------------------------------------------------
def gemvs(ls: Launcher, mats: Mats, x: DeviceArray, cols: int, n: int, stream: Callable,
          norm: Norm = None, x_group_rows: int = 0, x_stride: int | None = None, add: bool = False,
          act_quant: bool = False) -> None:
    """y_m[r] = W_m x[r] for n activation rows x[r] = x + r * x_stride into y_m + r * rows_m, matrices sharing x:
    one launch per weight type, up to 4 matrices and GEMV_MAX_X rows each (one row: the single-row kernel).
    act_quant: Q8_0 matrices on the int8-activation kernels (x rounded inside)."""
    stride = x_stride if x_stride is not None else cols
    by_type: dict[WeightFormat, list] = {}
    for t, y, rows in mats:
        by_type.setdefault(t.qtype, []).append((t.array, y, rows))
    for group in by_type.values():
        for i in range(0, len(group), MAX_MATS):
            for r0 in range(0, n, GEMV_MAX_X):
                k = min(GEMV_MAX_X, n - r0)
                outs = [(W, rows_of(y, r0, k, rows), rows) for W, y, rows in group[i:i + MAX_MATS]]
                xin = GemvX(rows_of(x, r0, k, stride), cols, nx=k, x_stride=stride, x_group_rows=x_group_rows,
                            norm=norm, act_quant=act_quant)
                ops.gemv(ls, outs, xin, add=add, **stream())


# ---- int8-activation numerics (Numerics.act_quant) ----------------------------------------------------------------
# The reference's act_quant mode rounds the activation of every quantised matmul (Q8_0 blocks of 32 for Q8_0 / MXFP4
# weights, Q8_K blocks of 256 for the K- and IQ-quants; ds4py/ref/weights.py Weights.act). Here: one act_round
# launch writes the rounded copy the fp32 GEMVs / GEMMs then read (after the RMSNorm a fused norm prologue would
# apply), except where a kernel rounds x itself: the Q8_0 GEMVs (gemv_q8_0_i8*: dp4a; the grouped wo_a too), the
# Q4_K GEMVs (gemv_q4_k_i8*: x as Q8_K, dp4a; the grouped wo_a too) and the
# routed / shared experts of a format with int8 kernels (ops/experts.py I8_FORMATS: moe_*_i8_<fmt>). A copy lives in the workspace's aq.<stream>.<rounding> (layer.act_shapes);
# `own` (x has no other reader: o, u, a routed or shared h) rounds x in place.
def act_kind(rec: Recording, qtype: WeightFormat) -> str | None:
    """How a product with weights of `qtype` sees its activation in this recording's numerics (None: as it is)."""
    return ops_aq.rounding(qtype) if rec.numerics.act_quant else None


def act_x(ls: Launcher, rec: Recording, kind: str | None, x: DeviceArray, width: int, n: int, stream: Callable,
          stride: int | None = None, norm: Norm = None, own: bool = False) -> DeviceArray:
    """x's n rows of `width` floats (`stride` apart) as a product rounding by `kind` reads them, RMS-normalised
    first when norm = (w, eps): x itself (kind None, no norm), x rounded in place (own), or the stream's copy."""
    stride = width if stride is None else stride
    if kind is None and norm is None:
        return x
    if own and norm is None:
        y = x
    else:
        side = stream == ls.side and rec.mode != BLOCK
        y = rec.ws.a[f"aq.{'side' if side else 'main'}.{kind or 'q8_0'}"].view(0, (n - 1) * stride + width)
    if norm is not None:
        rmsnorm(ls, x.view(0, n * width), y.view(0, n * width), width, norm, **stream())
        x = y
    if kind is not None:
        ops_aq.act_round(ls, kind, TokenRows(x=x, y=y, T=n, ldx=stride), width, **stream())
    return y


def i8_gemv(rec: Recording, W: DevTensor, gemm: bool = False) -> bool:
    """Whether a product with W runs on an int8-activation GEMV (x rounded inside) in this recording: act_quant
    numerics, not a block's tensor-core GEMM, Q8_0 or Q4_K weights (gemv_q8_0_i8*, gemv_q4_k_i8*; with input
    groups gemv_{q8_0,q4_k}_i8_grouped, the grouped wo_a)."""
    if not rec.numerics.act_quant or isinstance(W.qtype, str) or gemm:
        return False
    return int(W.qtype) in (int(QT.Q8_0), int(QT.Q4_K))


def act_groups(ls: Launcher, rec: Recording, mats: Mats, x: DeviceArray, cols: int, n: int, stream: Callable,
               norm: Norm, x_group_rows: int, x_stride: int | None, own: bool,
               gemm: bool = False) -> list[tuple[Mats, DeviceArray, Norm, bool]]:
    """(matrices, the x they read, the norm left to their kernel, int8 GEMV) per rounding of `mats` (one group, x and
    norm as given, unless the numerics round). gemm: the block's tensor-core GEMMs (no int8 kernel)."""
    if not rec.numerics.act_quant:
        return [(mats, x, norm, False)]
    by_kind: dict[str | None, list] = {}
    for m in mats:
        key = "i8" if i8_gemv(rec, m[0], gemm=gemm) else act_kind(rec, m[0].qtype)
        by_kind.setdefault(key, []).append(m)
    width = cols * (-(-mats[0][2] // x_group_rows) if x_group_rows else 1)
    stride = x_stride if x_stride is not None else width
    out = []
    for kind, group in by_kind.items():
        if kind is None or kind == "i8":
            out.append((group, x, norm, kind == "i8"))
        else:
            xk = act_x(ls, rec, kind, x, width, n, stream, stride, norm, own and len(by_kind) == 1)
            out.append((group, xk, None, False))
    return out


def dense_gemv(ls: Launcher, rec: Recording, mats: Mats, x: DeviceArray, cols: int, stream: Callable, norm: Norm = None,
               x_group_rows: int = 0, x_stride: int | None = None, n: int | None = None, add: bool = False,
               own: bool = False) -> None:
    n = rec.R if n is None else n
    for group, xk, nk, i8 in act_groups(ls, rec, mats, x, cols, n, stream, norm, x_group_rows, x_stride, own):
        gemvs(ls, group, xk, cols, n, stream, nk, x_group_rows, x_stride, add, act_quant=i8)


def mma_ok(W: DevTensor) -> bool:
    return W.qtype in GEMV_TYPES            # the GEMM reads what the GEMVs read (Q8_0 / F16 / F32 / Q4_K)


def dense_block(ls: Launcher, rec: Recording, mats: Mats, x: DeviceArray, cols: int, stream: Callable,
                norm: Norm = None, x_group_rows: int = 0, x_stride: int | None = None, n: int | None = None,
                add: bool = False, own: bool = False) -> None:
    """y_m[t] = W_m x[t] for the block's rows on tensor cores (norm = (w, eps): x[t] RMS-normalised first), or the
    `_rows` GEMVs when the block runs without tensor cores or a matrix's type has no GEMM."""
    T = rec.R if n is None else n
    on_gemm = not add and rec.mma and all(mma_ok(W) for W, _, _ in mats)
    for group, xk, nk, i8 in act_groups(ls, rec, mats, x, cols, T, stream, norm, x_group_rows, x_stride, own,
                                        gemm=on_gemm):
        _dense_block(ls, rec, group, xk, cols, nk, x_group_rows, x_stride, T, add, i8)


def _dense_block(ls: Launcher, rec: Recording, mats: Mats, x: DeviceArray, cols: int, norm: Norm, x_group_rows: int,
                 x_stride: int | None, T: int, add: bool, i8: bool = False) -> None:
    if add or not rec.mma or not all(mma_ok(W) for W, _, _ in mats):
        gemvs(ls, mats, x, cols, T, ls.main, norm=norm, x_group_rows=x_group_rows, x_stride=x_stride, add=add,
              act_quant=i8)
        return
    if norm is not None:
        xn = rec.ws.qa_n.view(0, T * cols)
        rmsnorm(ls, x.view(0, T * cols), xn, cols, norm, **ls.main())
        x = xn
    gemm(ls, rec, mats, x, cols, T, x_group_rows, x_stride)


def gemm(ls: Launcher, rec: Recording, mats: Mats, x: DeviceArray, cols: int, T: int, x_group_rows: int = 0,
         x_stride: int | None = None) -> None:
    """y = W x on tensor cores, x as rec.x_pieces bf16 pieces accumulated (hi first): the weights are exact in the
    GEMM (Q8_0 codes and scale, F16 / F32 as bf16 pieces), so with three pieces the product sees x exactly and
    differs from the fp32 GEMV by the summation order only."""
    groups = -(-mats[0][2] // x_group_rows) if x_group_rows else 1
    ld = x_stride if x_stride is not None else cols * groups
    n = (T - 1) * ld + cols * groups
    if rec.x_pieces <= 1:
        xs = [x]
    else:
        xs = [rec.ws.a[f"xp{i}"].view(0, n) for i in range(min(3, rec.x_pieces))]
        ops_pfa.split_bf16(ls, x.view(0, n), xs, n, **ls.main())
    for W, y, rows in mats:
        for i, xi in enumerate(xs):
            ops_gemm.gemm(ls, W, xi, y, GemmShape(T=T, N=rows, K=cols, x_group_rows=x_group_rows, ldx=ld),
                          accumulate=i > 0, **ls.main())


def gemv_hc_post(ls: Launcher, rec: Recording, W: DevTensor, u: DeviceArray, X: DeviceArray, mix: DeviceArray,
                 cols: int) -> None:
    """X[r] <- post_k (W u[r]) + sum_j C[j,k] X[r, j]: the output projection into the residual, GEMV_MAX_X rows
    per launch."""
    i8 = i8_gemv(rec, W)
    if not i8:
        u = act_x(ls, rec, act_kind(rec, W.qtype), u, cols, rec.R, ls.main, own=True)
    cfg = rec.cfg
    hc, D, mrec = cfg.hc_mult, cfg.dim, mix_record(cfg.hc_mult)
    for r0 in range(0, rec.R, GEMV_MAX_X):
        k = min(GEMV_MAX_X, rec.R - r0)
        res = HcResidual(X=rows_of(X, r0, k, hc * D), mix=rows_of(mix, r0, k, mrec), dim=D, hc=hc)
        ops.gemv_hc_post(ls, W.array, GemvX(rows_of(u, r0, k, cols), cols=cols, nx=k, act_quant=i8), res, **ls.main())


def residual(rec: Recording, X: DeviceArray, mix: DeviceArray) -> HcResidual:
    """The residual X [R, hc, dim] a sub-layer's output goes back into, with that sub-layer's mix records."""
    return HcResidual(X=X, mix=mix, dim=rec.cfg.dim, hc=rec.cfg.hc_mult)


def block_hc_post(ls: Launcher, rec: Recording, W: DevTensor, u: DeviceArray, X: DeviceArray, mix: DeviceArray,
                  cols: int) -> None:
    if rec.mma and mma_ok(W):
        f = rec.ws.f
        u = act_x(ls, rec, act_kind(rec, W.qtype), u, cols, rec.R, ls.main, own=True)
        gemm(ls, rec, [(W, f, rec.cfg.dim)], u, cols, rec.R)
        ops.hc_post(ls, f, residual(rec, X, mix), rec.R, **ls.main())
    else:
        gemv_hc_post(ls, rec, W, u, X, mix, cols)


# ---- what reads a state: once per row (DECODE, ROWS), once for the block (BLOCK) -------------------------------
def _fq(rec: Recording) -> tuple[bool, bool]:
    return rec.numerics.fake_quant, rec.numerics.kv_dtype == "f16"


def kv_row(rec: Recording, il: int, A: Attention) -> ops_attn.KvRow:
    """Layer il's kv row: its kv norm, RoPE freqs, head and rope dims and the step's numerics."""
    cfg, (fq, f16) = rec.cfg, _fq(rec)
    return ops_attn.KvRow(norm_w=A.kv_norm.array, freqs=rec.freqs[il], hd=cfg.head_dim, rd=cfg.rope_dim,
                          eps=cfg.norm_eps, fake_quant=fq, round_f16=f16)


def kv_store_rows(ls: Launcher, rec: Recording, il: int, A: Attention, stream: Callable) -> None:
    """Each row's kv row, normalised and roped, into its state's window ring."""
    cfg, rows, kr = rec.cfg, rec.rows, kv_row(rec, il, A)
    for n in range(rec.R):
        ops_attn.kv_store(ls, kr, row(rec.ws.kv, n, cfg.head_dim), rows.pos(n), rows.state(n)[f"{il}.win"],
                          **stream())


def kv_store_block(ls: Launcher, rec: Recording, il: int, A: Attention, stream: Callable) -> None:
    """The block's kv rows into the block buffer kvb (the ring gets them after attention, attend_block)."""
    ops_pfa.kv_rows(ls, kv_row(rec, il, A), rec.ws.kv, rec.rows.positions, rec.ws.kvb, rec.R, **ls.main())


def _compressor(rec: Recording, il: int, ro: LayerRoles, C: Compressor, which: str) -> tuple:
    """(the op's layer struct, the state keys of its rings and rows, kv / score inputs) of a compressor."""
    cfg, ws, (fq, f16) = rec.cfg, rec.ws, _fq(rec)
    if which == "comp":
        layer = ops_comp.CompLayer(ape=C.ape.array, norm_w=C.norm.array, freqs=rec.freqs[il], ratio=ro.ratio,
                                   overlap=bool(ro.overlap), d=cfg.head_dim, rd=cfg.rope_dim, eps=cfg.norm_eps,
                                   rotate=False, fake_quant=fq, round_f16=f16)
        return layer, ("comp_kv", "comp_score", "comp_rows"), ws.ckv, ws.csc
    layer = ops_comp.CompLayer(ape=C.ape.array, norm_w=C.norm.array, freqs=rec.freqs[il], ratio=ro.index_ratio,
                               overlap=bool(ro.index_overlap), d=cfg.index_head_dim, rd=cfg.rope_dim, eps=cfg.norm_eps,
                               rotate=True, fake_quant=fq, round_f16=f16)
    return layer, ("idx_kv", "idx_score", "idx_keys"), ws.ikv, ws.isc


def _comp_state(p: State, il: int, keys: tuple) -> ops_comp.CompState:
    return ops_comp.CompState(*(p[f"{il}.{k}"] for k in keys))


def compress_rows(ls: Launcher, rec: Recording, il: int, ro: LayerRoles, C: Compressor, which: str,
                  stream: Callable) -> None:
    """Each row's compressor update (and emission when its group completes) in its state."""
    rows = rec.rows
    layer, keys, x_kv, x_sc = _compressor(rec, il, ro, C, which)
    w = layer.width
    for n in range(rec.R):
        ops_comp.compressor_decode(ls, layer, _comp_state(rows.state(n), il, keys), row(x_kv, n, w),
                                   row(x_sc, n, w), rows.pos(n), **stream())


def compress_block(ls: Launcher, rec: Recording, il: int, ro: LayerRoles, C: Compressor, which: str,
                   stream: Callable) -> None:
    """Every group the block completes, pooled in parallel, then the block's tail into the compressor's rings."""
    T = rec.R
    layer, keys, x_kv, x_sc = _compressor(rec, il, ro, C, which)
    w = layer.width
    chunk = ops_comp.CompChunk(kv=x_kv.view(0, T * w), sc=x_sc.view(0, T * w), n_tok=T, pos_slot=rec.rows.positions)
    ops_comp.compressor_prefill(ls, layer, _comp_state(rec.rows.state(0), il, keys), chunk, **ls.main())


def index_query(rec: Recording, il: int) -> ops_idx.IndexQuery:
    """Layer il's indexer queries: RoPE freqs, heads, head dim, rope dims, the step's FP4 round trip."""
    cfg = rec.cfg
    return ops_idx.IndexQuery(freqs=rec.freqs[il], n_heads=cfg.index_heads, ihd=cfg.index_head_dim, rd=cfg.rope_dim,
                              fake_quant=rec.numerics.fake_quant)


def index_scorer(rec: Recording, ro: LayerRoles) -> ops_idx.IndexScorer:
    """A layer's indexer scoring (heads, head dim, weight scale, its keys' ratio)."""
    ih, ihd = rec.cfg.index_heads, rec.cfg.index_head_dim
    return ops_idx.IndexScorer(n_heads=ih, ihd=ihd, wscale=weight_scale(ihd, ih), ratio=ro.index_ratio)


def index_queries_rows(ls: Launcher, rec: Recording, il: int) -> None:
    cfg, iqd, iq = rec.cfg, rec.cfg.index_heads * rec.cfg.index_head_dim, index_query(rec, il)
    for n in range(rec.R):
        ops_idx.indexer_q_prep(ls, iq, row(rec.ws.iq_raw, n, cfg.index_q_dim), rec.rows.pos(n),
                               row(rec.ws.iq, n, iqd), **ls.main())


def index_queries_block(ls: Launcher, rec: Recording, il: int) -> None:
    ops_idx.indexer_q_prep_rows(ls, index_query(rec, il), rec.ws.iq_raw, rec.rows.positions, rec.ws.iq, rec.R,
                                **ls.main())


def attn_layer(rec: Recording, il: int, A: Attention, q_norm: bool = True) -> ops_attn.AttnLayer:
    """Layer il's attention shapes and arrays (RoPE freqs, sinks) for the attention ops."""
    cfg = rec.cfg
    return ops_attn.AttnLayer(freqs=rec.freqs[il], sinks=A.sinks.array, n_heads=cfg.n_heads, rope_dim=cfg.rope_dim,
                              window=cfg.window, eps=cfg.norm_eps, scale=cfg.head_dim ** -0.5, q_norm=q_norm)


def _decode_buffers(rec: Recording, n: int, pos: DeviceArray, plan: ops_attn.AttnPlan) -> ops_attn.DecodeBuffers:
    """Row n's query, position slot, the shared split partials (sized by its plan) and output."""
    ws, qd = rec.ws, rec.cfg.q_dim
    return ops_attn.DecodeBuffers(q_raw=row(ws.q, n, qd), pos_slot=pos, part_o=ws.part_o.view(0, plan.part_o_shape),
                                  part_ml=ws.part_ml.view(0, plan.part_ml_shape), out=row(ws.o, n, qd))


def attend_rows(ls: Launcher, rec: Recording, il: int, ro: LayerRoles, A: Attention) -> None:
    """Each row: the indexer's scores and top-k over its state's keys (indexer layers), then split-key attention
    over its window, compressed rows and the sink, with its own context bucket's plan."""
    cfg, ws, rows = rec.cfg, rec.ws, rec.rows
    iqd = cfg.index_heads * cfg.index_head_dim
    for n in range(rec.R):
        p, pos, plan = rows.state(n), rows.pos(n), rec.plan(n, il, ls.profile)
        comp = p[f"{ro.kv_source}.comp_rows"] if ro.compressed else None
        sel = None
        if ro.indexer:
            n_keys = rows.buckets[n] // ro.index_ratio
            ops_idx.indexer_scores(ls, index_scorer(rec, ro),
                                   ops_idx.ScoreBuffers(q=row(ws.iq, n, iqd), w_raw=row(ws.iw, n, cfg.index_heads),
                                                        keys=p[f"{il}.idx_keys"], pos=pos,
                                                        scores=ws.scores.view(0, n_keys), max_keys=n_keys),
                                   **ls.main())
            ops_topk.topk(ls, ws.scores.view(0, n_keys), cfg.index_topk, ws.sel,
                          ops_topk.Visible(pos_slot=pos, ratio=ro.index_ratio), **ls.main())
            sel = ws.sel
        ops_attn.decode_attention(ls, plan, attn_layer(rec, il, A),
                                  ops_attn.AttnKeys(ring=p[f"{il}.win"], comp=comp, ratio=ro.ratio, sel=sel,
                                                    topk=cfg.index_topk),
                                  _decode_buffers(rec, n, pos, plan), **ls.main(), combine_pdl=ls.main()["pdl"])


def attend_block(ls: Launcher, rec: Recording, il: int, ro: LayerRoles, A: Attention) -> None:
    """The indexer's scores and per-query top-k for every row, attention for every query row (its window rows:
    the ring before the block, kvb inside it), and only then the block's last window rows into the ring, so no
    query reads a slot a later row of the block overwrote."""
    cfg, ws, T = rec.cfg, rec.ws, rec.R
    p, pos = rec.rows.state(0), rec.rows.positions
    comp = p[f"{ro.kv_source}.comp_rows"] if ro.compressed else None
    sel = None
    if ro.indexer:
        n_keys = rec.rows.buckets[0] // ro.index_ratio
        stride = int(ws.scores.shape[1])
        ops_idx.indexer_scores_rows(ls, index_scorer(rec, ro),
                                    ops_idx.ScoreBuffers(q=ws.iq, w_raw=ws.iw, keys=p[f"{il}.idx_keys"], pos=pos,
                                                         scores=ws.scores, max_keys=n_keys),
                                    T, stride, **ls.main())
        ops_topk.topk_rows(ls, ops_topk.ScoreRows(scores=ws.scores, pos=pos, n_rows=T, stride=stride,
                                                  ratio=ro.index_ratio), cfg.index_topk, ws.sel,
                           **ls.main())
        sel = ws.sel
    ops_pfa.prefill_attention(ls, attn_layer(rec, il, A),
                              ops_attn.AttnKeys(ring=p[f"{il}.win"], comp=comp, ratio=ro.ratio, sel=sel,
                                                topk=cfg.index_topk),
                              ops_pfa.PrefillRows(q_raw=ws.q, pos=pos, blk=ws.kvb, out=ws.o, n_rows=T), **ls.main())
    ops_pfa.ring_store(ls, ws.kvb, T, pos, p[f"{il}.win"], **ls.main())


def router(rec: Recording, ro: LayerRoles, Fw: Ffn) -> ops_route.Router:
    """A layer's routing: its bias (top-k layers) or token table (hash layers), k of n experts, scale, norms."""
    cfg = rec.cfg
    return ops_route.Router(bias=None if ro.hash_routing else Fw.route_bias.array,
                            tid2eid=Fw.tid2eid.array if ro.hash_routing else None, n_experts=cfg.n_experts,
                            k=cfg.n_experts_used, route_scale=cfg.route_scale, route_norm=cfg.route_normalises,
                            gate_temp=cfg.gate_temp, norm_eps=cfg.route_norm_eps)


def route_rows(ls: Launcher, rec: Recording, ro: LayerRoles, Fw: Ffn) -> None:
    ws, k, NX, route = rec.ws, rec.cfg.n_experts_used, rec.cfg.n_experts, router(rec, ro, Fw)
    for n in range(rec.R):
        ops_route.moe_route(ls, route, row(ws.router, n, NX), rec.rows.token(n),
                            Slots(ids=row(ws.ids, n, k), weights=row(ws.wts, n, k), k=k), **ls.main())


def route_block(ls: Launcher, rec: Recording, ro: LayerRoles, Fw: Ffn) -> None:
    ops_route.moe_route_rows(ls, router(rec, ro, Fw), rec.ws.router, rec.rows.tokens, slots(rec), rec.R, **ls.main())


# ---- experts ---------------------------------------------------------------------------------------------------
def shared_expert(rec: Recording, S: Swiglu, clamp: float = 0.0, act_quant: bool = False) -> Experts:
    """The layer's shared expert as one expert every row chooses (its Q8_0 / F16 matrices are expert formats).
    act_quant: the op runs its int8-activation kernel (expert_input says when)."""
    cfg = rec.cfg
    return Experts(fmt=S.gate.qtype, n_experts=1, ff=cfg.shared_ff, dim=cfg.dim, gate=S.gate.array, up=S.up.array,
                   down=S.down.array, down_fmt=S.down.qtype, clamp=clamp, act_quant=act_quant)


def routed_experts(rec: Recording, E: Swiglu, clamp: float = 0.0, act_quant: bool = False) -> Experts:
    """The layer's routed experts (gate and up share one kernel format; down has its own). act_quant: as
    shared_expert's."""
    cfg = rec.cfg
    need(E.up.kernel_format == E.gate.kernel_format, "experts: gate and up must have the same weight type")
    return Experts(fmt=E.gate.kernel_format, n_experts=cfg.n_experts, ff=cfg.expert_ff, dim=cfg.dim,
                   gate=E.gate.array, up=E.up.array, down=E.down.array, down_fmt=E.down.kernel_format, clamp=clamp,
                   act_quant=act_quant)


def shared_gate_up_gemv(ls: Launcher, rec: Recording, S: Swiglu, clamp: float, stream: Callable) -> None:
    """h_shared[r] = silu(min(gate x[r], c)) * clamp(up x[r], c): fused GEMVs (BLOCK with tensor cores: two GEMMs
    and the SwiGLU)."""
    ws, D, sff = rec.ws, rec.cfg.dim, rec.cfg.shared_ff
    on_gemm = rec.mode == BLOCK and rec.mma and mma_ok(S.gate) and mma_ok(S.up)
    i8 = i8_gemv(rec, S.gate, gemm=on_gemm)
    x = ws.x_ffn if i8 else act_x(ls, rec, act_kind(rec, S.gate.qtype), ws.x_ffn, D, rec.R, stream)
    if on_gemm:
        gemm(ls, rec, [(S.gate, ws.hs_g, sff), (S.up, ws.hs_u, sff)], x, D, rec.R)
        ops_pfa.swiglu(ls, ws.hs_g, ws.hs_u, ws.h_shared, rec.R * sff, clamp, **ls.main())
        return
    ffn = SwiGlu(gate=S.gate.array, up=S.up.array, rows=sff, clamp=clamp)
    for r0 in range(0, rec.R, GEMV_MAX_X):
        k = min(GEMV_MAX_X, rec.R - r0)
        ops.gemv_swiglu(ls, ffn, GemvX(rows_of(x, r0, k, D), cols=D, nx=k, act_quant=i8),
                        rows_of(ws.h_shared, r0, k, sff), **stream())


def expert_input(ls: Launcher, rec: Recording, fmt: WeightFormat, x: DeviceArray, width: int, n: int, stream: Callable,
                 own: bool = False) -> tuple[DeviceArray, bool]:
    """(the x an expert kernel of format `fmt` reads, whether it takes its int8 kernel): under act_quant a format
    with int8 kernels rounds inside (x as it is), another reads x rounded by act_x (Q8_0 / MXFP4: Q8_0 blocks; F16,
    VQ-8: unrounded, as the reference)."""
    if not rec.numerics.act_quant:
        return x, False
    if not isinstance(fmt, str) and int(fmt) in {int(q) for q in ops_moe.I8_FORMATS}:
        return x, True
    return act_x(ls, rec, act_kind(rec, fmt), x, width, n, stream, own=own), False



def shared_gate_up_expert(ls: Launcher, rec: Recording, S: Swiglu, clamp: float, stream: Callable) -> None:
    ws = rec.ws
    x, i8 = expert_input(ls, rec, S.gate.qtype, ws.x_ffn, rec.cfg.dim, 1, stream)
    ops_moe.moe_gate_up(ls, shared_expert(rec, S, clamp, i8), x, ws.h_shared, **stream())


def shared_gate_up_expert_rows(ls: Launcher, rec: Recording, S: Swiglu, clamp: float, stream: Callable) -> None:
    ws, D, sff = rec.ws, rec.cfg.dim, rec.cfg.shared_ff
    x, i8 = expert_input(ls, rec, S.gate.qtype, ws.x_ffn, D, rec.R, stream)
    ex, step = shared_expert(rec, S, clamp, i8), ops_moe.MAX_PAIRS
    for r0 in range(0, rec.R, step):
        k = min(step, rec.R - r0)
        ops_moe.moe_gate_up_rows(ls, ex, TokenRows(x=rows_of(x, r0, k, D), y=rows_of(ws.h_shared, r0, k, sff), T=k),
                                 **stream())


def shared_down_dense(ls: Launcher, rec: Recording, S: Swiglu, stream: Callable) -> None:
    of(rec.mode).dense(ls, rec, [(S.down, rec.ws.y_shared, rec.cfg.dim)], rec.ws.h_shared, rec.cfg.shared_ff, stream,
                       own=True)


def shared_down_expert(ls: Launcher, rec: Recording, S: Swiglu, stream: Callable) -> None:
    ws, cfg = rec.ws, rec.cfg
    h, i8 = expert_input(ls, rec, S.down.qtype, ws.h_shared, cfg.shared_ff, 1, stream, own=True)
    ops_moe.moe_down(ls, shared_expert(rec, S, act_quant=i8), TokenRows(x=h, y=ws.y_shared), **stream())


def shared_down_expert_rows(ls: Launcher, rec: Recording, S: Swiglu, stream: Callable) -> None:
    ws, cfg = rec.ws, rec.cfg
    h, i8 = expert_input(ls, rec, S.down.qtype, ws.h_shared, cfg.shared_ff, rec.R, stream, own=True)
    ops_moe.moe_down_rows(ls, shared_expert(rec, S, act_quant=i8), TokenRows(x=h, y=ws.y_shared, T=rec.R),
                          **stream())


def slots(rec: Recording) -> Slots:
    """The router's choices of every row: ids and weights [R, k]."""
    return Slots(ids=rec.ws.ids, weights=rec.ws.wts, k=rec.cfg.n_experts_used)


def experts_gate_up_one(ls: Launcher, rec: Recording, E: Swiglu, clamp: float) -> None:
    cfg, ws = rec.cfg, rec.ws
    x, i8 = expert_input(ls, rec, E.gate.kernel_format, ws.x_ffn, cfg.dim, 1, ls.main)
    ops_moe.moe_gate_up(ls, routed_experts(rec, E, clamp, i8), x, ws.h, slots(rec), **ls.main())


def experts_down_one(ls: Launcher, rec: Recording, E: Swiglu, X: DeviceArray, X_out: DeviceArray) -> DeviceArray:
    ws, hc = rec.ws, rec.cfg.hc_mult
    mix = ws.mix_ffn
    h, i8 = expert_input(ls, rec, E.down.kernel_format, ws.h, rec.cfg.expert_ff, rec.cfg.n_experts_used, ls.main,
                         own=True)
    ops_moe.moe_down(ls, routed_experts(rec, E, act_quant=i8), TokenRows(x=h, y=X_out, add=ws.y_shared), slots(rec),
                     hc=HcPost(post=mix.view(4 * hc, hc), comb=mix.view(8 * hc, hc * hc), X=X), **ls.main())
    return X_out


def experts_gate_up_rows(ls: Launcher, rec: Recording, E: Swiglu, clamp: float) -> None:
    """The rows' routed gate + up grouped by distinct expert: each expert's rows read once for every (row, slot)
    pair that chose it (at most MAX_PAIRS pairs per launch)."""
    ws, k, ff, D = rec.ws, rec.cfg.n_experts_used, rec.cfg.expert_ff, rec.cfg.dim
    x, i8 = expert_input(ls, rec, E.gate.kernel_format, ws.x_ffn, D, rec.R, ls.main)
    ex, step = routed_experts(rec, E, clamp, i8), max(1, ops_moe.MAX_PAIRS // k)
    for r0 in range(0, rec.R, step):
        n = min(step, rec.R - r0)
        ops_moe.moe_gate_up_rows(ls, ex, TokenRows(x=rows_of(x, r0, n, D),
                                                   y=ws.h.view(4 * r0 * k * ff, n * k * ff), T=n),
                                 Slots(ids=ws.ids.view(4 * r0 * k, n * k), weights=ws.wts.view(4 * r0 * k, n * k), k=k),
                                 **ls.main())


def experts_down_rows(ls: Launcher, rec: Recording, E: Swiglu, X: DeviceArray, X_out: DeviceArray) -> DeviceArray:
    ws, cfg = rec.ws, rec.cfg
    h, i8 = expert_input(ls, rec, E.down.kernel_format, ws.h, cfg.expert_ff, rec.R * cfg.n_experts_used, ls.main,
                         own=True)
    ops_moe.moe_down_rows(ls, routed_experts(rec, E, act_quant=i8), TokenRows(x=h, y=X_out, T=rec.R, add=ws.y_shared),
                          slots(rec), hc=residual(rec, X, ws.mix_ffn), **ls.main())
    return X_out


def experts_gate_up_block(ls: Launcher, rec: Recording, E: Swiglu, clamp: float) -> None:
    """The whole routed MoE of the block grouped by expert into ws.f: on tensor cores (expert_mma) or as exact fp32
    token tiles (expert_tiles); else the exact grouped rows kernels (gate + up here, the down in experts_down_block)."""
    if not layer_grouped(rec):
        experts_gate_up_rows(ls, rec, E, clamp)
        return
    ws = rec.ws
    run = ops_moep.moe_prefill if expert_mma(rec, E) else ops_moep.moe_tiles
    run(ls, routed_experts(rec, E, clamp), TokenRows(x=ws.x_ffn, y=ws.f, T=rec.R, add=ws.y_shared), slots(rec),
        rec.moe_bufs(), **ls.main())


def expert_mma(rec: Recording, E: Swiglu) -> bool:
    """The routed MoE of a block on tensor cores (cu/moe_prefill.cu): the engine's prefill_expert_mma for GGML-format
    experts (x and h in bf16), prefill_vq_expert_mma (default on: x and h exact) for a VQ-8 file's."""
    return rec.expert_mma


def layer_grouped(rec: Recording) -> bool:
    return rec.expert_mma or rec.expert_tiles


def experts_down_block(ls: Launcher, rec: Recording, E: Swiglu, X: DeviceArray, X_out: DeviceArray) -> DeviceArray:
    if not layer_grouped(rec):
        return experts_down_rows(ls, rec, E, X, X_out)
    ops.hc_post(ls, rec.ws.f, residual(rec, X, rec.ws.mix_ffn), rec.R, **ls.main())
    return X                        # the residual updated in place


# ---- V4.1's layer roles (MODEL.md §3; ref/forward.py with ref/v41.py): the same schedule, these operations ---------
def v41_kv_store_rows(ls: Launcher, rec: Recording, il: int, A: Attention, stream: Callable) -> None:
    """Each row's kv row (FP8 over the whole row in blocks of 32) into its state's window ring."""
    cfg, rows, kr = rec.cfg, rec.rows, kv_row(rec, il, A)
    for n in range(rec.R):
        one = ops_v41.RawRows(raw=row(rec.ws.kv, n, cfg.head_dim), pos=rows.pos(n), n_rows=1)
        ops_v41.kv_rows(ls, kr, one, rows.state(n)[f"{il}.win"], **stream())


def v41_kv_store_block(ls: Launcher, rec: Recording, il: int, A: Attention, stream: Callable) -> None:
    block = ops_v41.RawRows(raw=rec.ws.kv, pos=rec.rows.positions, n_rows=rec.R)
    ops_v41.kv_rows(ls, kv_row(rec, il, A), block, rec.ws.kvb, ring=False, **ls.main())


def _v41_compress(ls: Launcher, rec: Recording, il: int, ro: LayerRoles, A: Attention, stream: Callable,
                  parts: list) -> None:
    """parts: (state arrays, positions, first row, rows) per launch: one per row (DECODE, ROWS) or the block."""
    cfg, ws, (fq, f16) = rec.cfg, rec.ws, _fq(rec)
    C, hd, ihd = A.comp, cfg.head_dim, cfg.index_head_dim
    comp_row = ops_attn.KvRow(norm_w=C.norm.array, freqs=rec.freqs[il], hd=hd, rd=cfg.rope_dim, eps=cfg.norm_eps,
                              fake_quant=fq, round_f16=f16)
    for p, pos, r0, n in parts:
        rings = (p[f"{il}.comp_kv"], p[f"{il}.comp_score"]) if ro.gated else (None, None)
        st = ops_comp.CompState(*rings, p[f"{il}.comp_rows"])
        src = ops_v41.CompRows(kv_in=rows_of(ws.ckv, r0, n, hd), sc_in=rows_of(ws.csc, r0, n, hd) if ro.gated else None,
                               pos=pos, n_rows=n, lat=rows_of(ws.clat, r0, n, hd) if ro.owns_index_keys else None)
        ops_v41.compress(ls, comp_row, ro.ratio, st, src, **stream())
        if ro.gated:
            ops_v41.comp_ring_store(ls, st, src, **stream())
    if not ro.owns_index_keys:
        return
    of(rec.mode).dense(ls, rec, [(A.index.k, ws.ik, ihd)], ws.clat, hd, stream)     # wk . latent, every row
    keys_row = ops_attn.KvRow(norm_w=A.index.k_norm.array, freqs=rec.freqs[il], hd=ihd, rd=cfg.rope_dim,
                              eps=cfg.norm_eps, fake_quant=fq, round_f16=f16)
    for p, pos, r0, n in parts:
        keys = ops_v41.RawRows(raw=rows_of(ws.ik, r0, n, ihd), pos=pos, n_rows=n)
        ops_v41.index_keys(ls, keys_row, keys, p[f"{il}.idx_keys"], ro.ratio, **stream())


def v41_compress_rows(ls: Launcher, rec: Recording, il: int, ro: LayerRoles, A: Attention, stream: Callable) -> None:
    _v41_compress(ls, rec, il, ro, A, stream, [(rec.rows.state(n), rec.rows.pos(n), n, 1) for n in range(rec.R)])


def v41_compress_block(ls: Launcher, rec: Recording, il: int, ro: LayerRoles, A: Attention, stream: Callable) -> None:
    _v41_compress(ls, rec, il, ro, A, stream, [(rec.rows.state(0), rec.rows.positions, 0, rec.R)])


def v41_index_queries(ls: Launcher, rec: Recording, il: int) -> None:
    """Every row's indexer query at once (RoPE + FP4; each row's values do not depend on the others)."""
    ops_v41.index_q(ls, index_query(rec, il), rec.ws.iq_raw, rec.rows.positions, rec.ws.iq, rec.R, **ls.main())


def _v41_select(ls: Launcher, rec: Recording, ro: LayerRoles, sr: ops_topk.ScoreRows, cand: DeviceArray) -> None:
    """The candidate source's blocks from its scores, or an indexer after it masked to them."""
    cfg = rec.cfg
    if ro.candidate_source or ro.uses_candidates:
        ops_v41.candidates(ls, sr, cand, cfg.candidate_topk_blocks, cfg.candidate_block_size, ro.uses_candidates,
                           **ls.main())


def v41_attend_rows(ls: Launcher, rec: Recording, il: int, ro: LayerRoles, A: Attention) -> None:
    """Each row: an index source scores its key owner's rows (the candidate source publishes its blocks, the
    indexers after it score inside them) and keeps the top-k in the row's sel; a compressed layer attends to its kv
    source's rows through the latest index source's sel (written earlier in this step); no per-head q norm."""
    cfg, ws, rows = rec.cfg, rec.ws, rec.rows
    iqd, k = cfg.index_heads * cfg.index_head_dim, cfg.index_topk
    for n in range(rec.R):
        p, pos, plan = rows.state(n), rows.pos(n), rec.plan(n, il, ls.profile)
        comp, sel = (p[f"{ro.kv_source}.comp_rows"], row(ws.sel, n, k)) if ro.compressed else (None, None)
        if ro.indexer:
            n_keys = rows.buckets[n] // ro.index_ratio
            scores, cand = ws.scores.view(0, n_keys), row(ws.cand, n, n_keys)
            ops_idx.indexer_scores(ls, index_scorer(rec, ro),
                                   ops_idx.ScoreBuffers(q=row(ws.iq, n, iqd), w_raw=row(ws.iw, n, cfg.index_heads),
                                                        keys=rows.index_keys(n, il, ro, n_keys), pos=pos, scores=scores,
                                                        max_keys=n_keys),
                                   **ls.main())
            sr = ops_topk.ScoreRows(scores=scores, pos=pos, n_rows=1, stride=n_keys, ratio=ro.index_ratio)
            _v41_select(ls, rec, ro, sr, cand)
            ops_topk.topk(ls, scores, k, sel, ops_topk.Visible(pos_slot=pos, ratio=ro.index_ratio), **ls.main())
            if ro.uses_candidates:             # fewer candidate rows than k: the picks outside them are dropped
                ops_v41.drop_masked(ls, sr, sel, k, **ls.main())
        ops_attn.decode_attention(ls, plan, attn_layer(rec, il, A, q_norm=False),
                                  ops_attn.AttnKeys(ring=p[f"{il}.win"], comp=comp, ratio=ro.ratio, sel=sel, topk=k),
                                  _decode_buffers(rec, n, pos, plan), **ls.main(), combine_pdl=ls.main()["pdl"])


def v41_attend_block(ls: Launcher, rec: Recording, il: int, ro: LayerRoles, A: Attention) -> None:
    """attend_block's order with V4.1's roles: scores of every row, candidates, top-k, attention, ring store."""
    cfg, ws, T = rec.cfg, rec.ws, rec.R
    p, pos = rec.rows.state(0), rec.rows.positions
    comp, sel = (p[f"{ro.kv_source}.comp_rows"], ws.sel) if ro.compressed else (None, None)
    if ro.indexer:
        n_keys = rec.rows.buckets[0] // ro.index_ratio
        stride = int(ws.scores.shape[1])
        ops_idx.indexer_scores_rows(ls, index_scorer(rec, ro),
                                    ops_idx.ScoreBuffers(q=ws.iq, w_raw=ws.iw,
                                                         keys=rec.rows.index_keys(0, il, ro, n_keys), pos=pos,
                                                         scores=ws.scores, max_keys=n_keys), T, stride, **ls.main())
        sr = ops_topk.ScoreRows(scores=ws.scores, pos=pos, n_rows=T, stride=stride, ratio=ro.index_ratio)
        _v41_select(ls, rec, ro, sr, ws.cand)
        ops_topk.topk_rows(ls, sr, cfg.index_topk, ws.sel, **ls.main())
        if ro.uses_candidates:
            ops_v41.drop_masked(ls, sr, ws.sel, cfg.index_topk, **ls.main())
    ops_pfa.prefill_attention(ls, attn_layer(rec, il, A, q_norm=False),
                              ops_attn.AttnKeys(ring=p[f"{il}.win"], comp=comp, ratio=ro.ratio, sel=sel,
                                                topk=cfg.index_topk),
                              ops_pfa.PrefillRows(q_raw=ws.q, pos=pos, blk=ws.kvb, out=ws.o, n_rows=T), **ls.main())
    ops_pfa.ring_store(ls, ws.kvb, T, pos, p[f"{il}.win"], **ls.main())


def v41_engram(ls: Launcher, rec: Recording, e: int, E: Engram, X: DeviceArray) -> None:
    """Engram e before its block: the rows' table rows (the step's input: FP8 codes and scales staged by the host)
    dequantised, kv = wkv . rows, then the gate into every hc copy of X in place."""
    cfg, ws, R = rec.cfg, rec.ws, rec.R
    width, cap = cfg.engram_in_dim, max(1, rec.rows.cap)
    rows_in = ws.engram_rows.view(4 * e * cap * width, R * width)
    ops_v41.engram_rows(ls, ws.engram_codes.view(e * cap * width, R * width),
                        ws.engram_scales.view(e * cap * width // 32, R * width // 32), rows_in, R * width, **ls.main())
    of(rec.mode).dense(ls, rec, [(E.kv, ws.ekv, (cfg.hc_mult + 1) * cfg.dim)], rows_in, width, ls.main)
    layer = ops_v41.EngramLayer(weight=rec.engram_weights[e], hc=cfg.hc_mult, dim=cfg.dim, eps=cfg.norm_eps)
    ops_v41.engram(ls, layer, X, ws.ekv, R, **ls.main())


# ---- the table -------------------------------------------------------------------------------------------------
_BY_MODE = {
    DECODE: SimpleNamespace(dense=dense_gemv, dense_hc_post=gemv_hc_post, kv_store=kv_store_rows,
                            compress=compress_rows, index_queries=index_queries_rows, attend=attend_rows,
                            route=route_rows, experts_gate_up=experts_gate_up_one, experts_down=experts_down_one),
    ROWS: SimpleNamespace(dense=dense_gemv, dense_hc_post=gemv_hc_post, kv_store=kv_store_rows,
                          compress=compress_rows, index_queries=index_queries_rows, attend=attend_rows,
                          route=route_rows, experts_gate_up=experts_gate_up_rows, experts_down=experts_down_rows),
    BLOCK: SimpleNamespace(dense=dense_block, dense_hc_post=block_hc_post, kv_store=kv_store_block,
                           compress=compress_block, index_queries=index_queries_block, attend=attend_block,
                           route=route_block, experts_gate_up=experts_gate_up_block, experts_down=experts_down_block),
}

# (operation, weight format, mode) -> kernel, for the operations whose kernel also follows a weight's format
KERNELS: dict[tuple[str, str, str], Callable] = {
    ("shared_gate_up", "dense", DECODE): shared_gate_up_gemv,
    ("shared_gate_up", "dense", ROWS): shared_gate_up_gemv,
    ("shared_gate_up", "dense", BLOCK): shared_gate_up_gemv,
    ("shared_gate_up", "experts", DECODE): shared_gate_up_expert,
    ("shared_gate_up", "experts", ROWS): shared_gate_up_expert_rows,
    ("shared_gate_up", "experts", BLOCK): shared_gate_up_expert_rows,
    ("shared_down", "dense", DECODE): shared_down_dense,
    ("shared_down", "dense", ROWS): shared_down_dense,
    ("shared_down", "dense", BLOCK): shared_down_dense,
    ("shared_down", "experts", DECODE): shared_down_expert,
    ("shared_down", "experts", ROWS): shared_down_expert_rows,
    ("shared_down", "experts", BLOCK): shared_down_expert_rows,
}
# V4.1 (cfg.variant "v41"): the operations whose math differs; the rest are V4's
_V41_PER_ROW = dict(kv_store=v41_kv_store_rows, compress=v41_compress_rows, index_queries=v41_index_queries,
                    attend=v41_attend_rows, engram=v41_engram)          # DECODE and ROWS: row by row
_V41_BY_MODE = {
    DECODE: _V41_PER_ROW,
    ROWS: _V41_PER_ROW,
    BLOCK: dict(kv_store=v41_kv_store_block, compress=v41_compress_block, index_queries=v41_index_queries,
                attend=v41_attend_block, engram=v41_engram),
}
_V41 = {mode: SimpleNamespace(**{**vars(_BY_MODE[mode]), **ops}) for mode, ops in _V41_BY_MODE.items()}
for _mode, _ops in _BY_MODE.items():
    for _op, _fn in vars(_ops).items():
        KERNELS[(_op, "*", _mode)] = _fn


def weight_format(qtype: WeightFormat) -> str:
    """"dense" for what the GEMVs / GEMMs read (Q8_0, F16, F32, Q4_K), "experts" for the expert formats."""
    return "dense" if qtype in GEMV_TYPES else "experts"


def pick(op: str, qtype: WeightFormat, mode: str) -> Callable:
    """The kernel of `op` for weights of `qtype` (None: any) in `mode`."""
    fn = KERNELS.get((op, weight_format(qtype), mode)) if qtype is not None else None
    return fn if fn is not None else KERNELS[(op, "*", mode)]


_TABLES = {"v4": _BY_MODE, "v41": _V41}     # ModelConfig.variant -> its operations per mode


def of(mode: str, variant: str = "v4") -> SimpleNamespace:
    """The format-independent operations of `mode` (dense, kv_store, compress, attend, route, experts_*, ...) of
    a model variant (ModelConfig.variant): V4.1's has its own kv row, compressors, indexer queries, selection and
    attention, and Engram."""
    return _TABLES[variant][mode]
