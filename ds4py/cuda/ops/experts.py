"""Host wrappers of cu/experts.cu: routed / shared expert gate+up+SwiGLU, down (+ add, + hc_post), and exact
dequantisation, for every expert weight format: the ggml ones (keyed by GGML type) and VQ-8 ("vq12", "vq13": the
device layout of ds4py/cuda/vq_layout.py, codebook at the head of each matrix, every width 6 .. 13 bits; no
moe_dequant). Launch geometry and shared memory are computed here.

A decode MoE sub-layer is (the shared expert may run on the side stream, between rt.fork() and rt.join()):
    moe_gate_up(rt, shared, x, h_sh);  moe_down(rt, shared, TokenRows(x=h_sh, y=y_sh))
    moe_gate_up(rt, routed, x, h, Slots(ids, route_w, k))
    moe_down(rt, routed, TokenRows(x=h, y=X', add=y_sh), Slots(ids, k=k), HcPost(post, comb, X))
with `shared` / `routed` the layer's Experts (weights, format, shapes, clamp: built once per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as QT

from ds4py.cuda.ops.core import TokenRows, aligned, blocks_that_fit, is_dtype, need
from ds4py.cuda.ops.mhc import HcResidual, mix_record
from ds4py.cuda.signature import CU_DIR, list_of

MOE_RPT = 8                    # rows per thread (accumulators per matrix)
DEFINES = {"MOE_RPT": MOE_RPT}                                                     # -D values of cu/experts.cu
# staged rows per block (ggml formats): 3 blocks fit a GB10 SM's ~100 KB (30 KiB + 2 KiB of static tables + the
# driver's 1 KiB each), no opt-in; registers permitting (<= 80 at 256 threads: docs/cuda.md)
SMEM_BUDGET = 30 * 1024
# IQ2_XXS's static tables take 4 KiB (experts.cu: the fp32 dots' bf16 grid, moe_load_grid16; the int8 dots' grid +
# signs), 2 KiB more than the budget above leaves: its stage gets that much less, so 3 blocks still fit a GB10 SM
IQ2_TABLES_EXTRA = 2048
# VQ-8: the codebook (up to 64 KiB) + the stage + the kernels' static shared memory must fit the smallest
# per-block opt-in of the devices ds4py targets: GB10 (sm_121), 101,376 B (docs/cuda.md "Device facts").
SMEM_LIMIT = 101_376
STATIC_RESERVE = 256           # the VQ kernels' own __shared__ bytes (moe_gate_up_rows: one int), rounded up



def _formats() -> dict[QT, tuple[str, int, int]]:
    """qtype -> (kernel suffix, weights per block, bytes per block): the MOE_FORMATS list of cu/moe_formats.cuh,
    the one the kernels' entry points are generated from."""
    out = {}
    for name, _fmt_id, qk, nb, _table in list_of("MOE_FORMATS", (CU_DIR / "moe_formats.cuh").read_text()):
        out[QT[name.upper()]] = (name, int(qk), int(nb))
    return out


def _vq_formats() -> dict[str, tuple[int, int, int]]:
    """VQ-8 format key ("vq12", "vq13": the kernel suffix) -> (weights per run, bytes per run, codewords): the
    MOE_VQ_FORMATS list of cu/moe_formats.cuh (experts.cu's VQ entry points)."""
    return {name: (int(qk), int(nb), int(kc))
            for name, _fmt_id, qk, nb, kc in list_of("MOE_VQ_FORMATS", (CU_DIR / "moe_formats.cuh").read_text())}


FORMATS = _formats()
VQ_FORMATS = _vq_formats()
# the formats with int8-activation kernels (moe_gate_up_i8_<fmt> / moe_down_i8_<fmt>: x rounded as Q8_K inside,
# the reference's act_quant numerics): experts.cu's MOE_I8_FORMATS list
I8_FORMATS = frozenset(QT[e[0].upper()] for e in list_of("MOE_I8_FORMATS", (CU_DIR / "experts.cu").read_text()))


def i8_kernel(qtype: Any, act_quant: bool) -> str:
    """The kernel name infix of an expert launch: "i8_" with act_quant (refused, in one sentence, for a format
    without int8 kernels), else ""."""
    if not act_quant:
        return ""
    need(not isinstance(qtype, str) and int(qtype) in {int(q) for q in I8_FORMATS},
         f"experts: int8 activations (act_quant) have kernels for {', '.join(sorted(q.name for q in I8_FORMATS))}"
         f" only, not {_label(qtype)}")
    return "i8_"


def vq_bits(qtype: str) -> int:
    """The index width of a VQ-8 format key ("vq13" -> 13)."""
    return VQ_FORMATS[qtype][1]


def vq_format(bits: int) -> str | None:
    """The VQ-8 kernel format of a layer of `bits`-bit indices (None: no kernel reads that width)."""
    key = f"vq{bits}"
    return key if key in VQ_FORMATS else None


def _fmt(qtype: Any, where: str = "experts") -> tuple[str, int, int]:
    """(kernel suffix, weights per block, bytes per block) of an expert weight format: a GGML type with a
    MOE_FORMATS entry or a VQ-8 format key; any other refused in one sentence naming `where`."""
    if isinstance(qtype, str):
        need(qtype in VQ_FORMATS, f"{where}: no VQ-8 kernel format {qtype!r} (supported: {', '.join(VQ_FORMATS)})")
        qk, nb, _ = VQ_FORMATS[qtype]
        return qtype, qk, nb
    qt = QT(int(qtype)) if int(qtype) in QT._value2member_map_ else None
    need(qt in FORMATS, f"{where}: weight type {qt.name if qt is not None else qtype} has no kernel (supported: "
         f"{', '.join(q.name for q in FORMATS)}, {', '.join(VQ_FORMATS)})")
    return FORMATS[qt]


def kernel_suffix(qtype: Any, where: str = "experts") -> str:
    """The kernel name suffix of an expert weight format (experts.cu's and moe_prefill.cu's entry points share
    it): the MOE_FORMATS name, or the VQ-8 key."""
    return _fmt(qtype, where)[0]


def _label(qtype: Any) -> str:
    return qtype if isinstance(qtype, str) else QT(int(qtype)).name


def codebook_bytes(qtype: Any) -> int:
    """Bytes of the codebook at the head of a VQ-8 matrix's device copy (0 for the ggml formats)."""
    return 8 * VQ_FORMATS[qtype][2] if isinstance(qtype, str) else 0


VQ_LINE = 128                  # each expert's VQ-8 stream starts on a 128-byte line (a 256-index block: three lines)


def vq_row_parts(qtype: str, cols: int) -> tuple[int, int]:
    """(stream bytes, hi bytes) of one row of a VQ-8 matrix (moe_formats.cuh MoeVq): `bits` bytes (12 at 13 bits)
    and, at 13 bits, one hi byte per run of 8 indices, as in the file."""
    qk, bits, _ = VQ_FORMATS[qtype]
    runs = cols // qk
    return runs * (12 if bits == 13 else bits), (runs if bits == 13 else 0)


def vq_expert_bytes(qtype: str, rows: int, cols: int) -> int:
    """Bytes of one expert's stream in the device copy: its rows back to back, padded to whole 128-byte lines."""
    return -(-rows * vq_row_parts(qtype, cols)[0] // VQ_LINE) * VQ_LINE


def row_bytes(qtype: Any, cols: int) -> int:
    """Bytes per row: the ggml blocks; VQ-8: stream + hi plane + the f32 gain (not counting an expert's stream
    padding to a whole line: matrix_bytes)."""
    _name, qk, nb = _fmt(qtype)
    need(cols % qk == 0 and cols % 32 == 0, f"experts: a row of {cols} is not whole {_label(qtype)} blocks")
    if isinstance(qtype, str):
        return sum(vq_row_parts(qtype, cols)) + 4
    return cols // qk * nb


def matrix_bytes(qtype: Any, n_experts: int, rows: int, cols: int) -> int:
    """Device bytes of a stacked expert tensor [n_experts, rows, cols]: the ggml formats' rows; VQ-8: the codebook,
    the experts' line-padded streams, the hi rows and the f32 gains (ds4py/cuda/vq_layout.py)."""
    rb = row_bytes(qtype, cols)
    if isinstance(qtype, str):
        return (codebook_bytes(qtype) + n_experts * vq_expert_bytes(qtype, rows, cols)
                + n_experts * rows * (vq_row_parts(qtype, cols)[1] + 4))
    return n_experts * rows * rb


def room(n: int) -> int:
    return (n + 31) & ~15


def stage_bytes(qtype: Any, nr: int, cols: int) -> int:
    """Shared bytes of nr staged rows (experts.cu MoeStage::room): one span, VQ-8 three (stream, hi, gains)."""
    if isinstance(qtype, str):
        sb, hb = vq_row_parts(qtype, cols)
        return room(nr * sb) + (room(nr * hb) if hb else 0) + room(4 * nr)
    return room(nr * row_bytes(qtype, cols))


@dataclass(frozen=True)
class MoePlan:
    """Launch geometry of one expert kernel over matrices of `cols` columns."""
    threads: int               # block size
    row_lanes: int             # RL = threads // groups
    rows_per_block: int
    smem: int                  # dynamic shared memory bytes


def vq_budget(qtype: Any) -> int:
    """Dynamic shared bytes a block may stage: SMEM_BUDGET (IQ2_XXS: less IQ2_TABLES_EXTRA), and for VQ-8 at most
    what the codebook leaves of SMEM_LIMIT (35,584 B at 13 bits: above SMEM_BUDGET, so every width stages
    SMEM_BUDGET)."""
    if not isinstance(qtype, str):
        return SMEM_BUDGET - (IQ2_TABLES_EXTRA if qtype == QT.IQ2_XXS else 0)
    return min(SMEM_BUDGET, SMEM_LIMIT - codebook_bytes(qtype) - STATIC_RESERVE)


RING = 2                       # VQ-8 decode gate+up / down: stage buffers (tile i + 1 loads while tile i computes)


def ring_bytes(plan: "MoePlan") -> int:
    """One ring buffer (experts.cu moe_ring_bytes): the plan's stage / partial sums, 16-byte rounded."""
    return (plan.smem + 15) & ~15


def launch_smem(qtype: Any, plan: "MoePlan", ring: int = 1) -> int:
    """The dynamic shared memory of an expert launch: the plan's stage / sums (ring: that many buffers of it),
    after the codebook (VQ-8)."""
    return (ring * ring_bytes(plan) if ring > 1 else plan.smem) + codebook_bytes(qtype)


def decode_ring(qtype: Any) -> int:
    """Stage buffers of moe_gate_up / moe_down: RING for VQ-8 (persistent, the ring of experts.cu), else 1."""
    return RING if isinstance(qtype, str) else 1


def gate_up_plan(qtype: Any, dim: int, ff: int, rows_per_block: int | None = None) -> "MoePlan":
    """moe_gate_up's geometry: two spans (gate, up) and two partial-sum rows per block row, in 1 / RING buffers."""
    return moe_plan(qtype, dim, ff, 2, 2, rows_per_block, vq_budget(qtype) // decode_ring(qtype))


def down_plan(qtype: Any, ff: int, dim: int, n_slots: int, rows_per_block: int | None = None) -> "MoePlan":
    """moe_down's geometry: n_slots spans and one partial-sum row per block row, in 1 / RING buffers."""
    return moe_plan(qtype, ff, dim, n_slots, 1, rows_per_block, vq_budget(qtype) // decode_ring(qtype))


def moe_plan(qtype: int, cols: int, rows: int, spans: int, sums: int, rows_per_block: int | None = None,
             budget: int | None = None) -> MoePlan:
    """spans: row spans staged per block (2 for gate+up, n_slots for down); sums: partial-sum rows per block row
    (2 for gate+up, 1 for down). Rows per block: as many as fit `budget` (vq_budget), at most MOE_RPT per row
    lane."""
    row_bytes(qtype, cols)                      # refuses a row that is not whole blocks
    budget = vq_budget(qtype) if budget is None else budget
    G = cols // 32
    need(G <= 1024, f"experts: {cols} columns exceed the kernel's 1024 column groups")
    RL = max(1, 256 // G)
    threads = 32 * -(-(G * RL) // 32)
    if rows_per_block is None:
        rows_per_block = max(1, min(MOE_RPT * RL, budget // (spans * stage_bytes(qtype, 1, cols)), rows))
        while rows_per_block > 1 and 4 * sums * rows_per_block * (G + 1) > budget:     # the partial sums too
            rows_per_block -= 1
    need(1 <= rows_per_block <= MOE_RPT * RL, f"experts: {rows_per_block} rows per block exceed {MOE_RPT} per "
         f"row lane x {RL} lanes")
    stage = spans * stage_bytes(qtype, rows_per_block, cols)
    partial = 4 * sums * rows_per_block * (G + 1)
    return MoePlan(threads, RL, rows_per_block, max(stage, partial))


def _grid_x(rt: Any, qtype: Any, tiles: int, ys: int, threads: int, smem: int, kernel: str | None = None) -> int:
    """Blocks along x: one per row tile for the ggml formats; VQ-8's persistent blocks loop over the tiles, so
    (with ys blocks along y) the grid is at most one wave of the device (the kernel's occupancy: its registers and
    static shared memory from the ptxas table when named, blocks_that_fit) and each block loads the codebook once."""
    if not isinstance(qtype, str):
        return tiles
    static = 0 if kernel else STATIC_RESERVE           # a named kernel's static bytes come from the ptxas table
    return max(1, min(tiles, blocks_that_fit(rt, threads, smem + static, kernel=kernel) // ys))


def check_weights(where: str, W: Any, qtype: Any, n_experts: int, rows: int, cols: int) -> None:
    """A stacked expert tensor [n_experts, rows, cols] in qtype: raw uint8 bytes of exactly that size (a VQ-8
    device copy 16-byte aligned)."""
    need(cols % 32 == 0, f"{where}: {cols} columns are not a multiple of 32")
    need(is_dtype(W, np.uint8), f"{where}: weights must be the raw GGUF bytes or a VQ-8 device copy (uint8)")
    need(not isinstance(qtype, str) or aligned(16, W), f"{where}: a VQ-8 device copy must be 16-byte aligned")
    want = matrix_bytes(qtype, n_experts, rows, cols)
    need(W.nbytes == want, f"{where}: {W.nbytes} weight bytes for {n_experts} experts of [{rows}, {cols}] "
         f"{_label(qtype)} ({want} expected)")


@dataclass(frozen=True)
class Experts:
    """One layer's stacked experts, the same for every call (the shared expert: n_experts = 1): gate and up
    [n_experts, ff, dim] in weight format `fmt`, down [n_experts, dim, ff] in down_fmt (None: fmt); a format is a
    GGML type or a VQ-8 key ("vq13"). clamp: the SwiGLU limit (<= 0: none). act_quant: the int8-activation
    kernels (x and h rounded as Q8_K inside, the reference's act_quant numerics; moe_gate_up / moe_down and their
    _rows; moe_prefill / moe_tiles refuse it: fp32 only).
    An op reads only its own matrices (gate_up: gate, up; down: down)."""
    fmt: Any
    n_experts: int
    ff: int
    dim: int
    gate: Any = None
    up: Any = None
    down: Any = None
    clamp: float = 0.0
    down_fmt: Any = None
    act_quant: bool = False

    @property
    def down_type(self) -> Any:
        return self.fmt if self.down_fmt is None else self.down_fmt

    def check_gate_up(self, where: str) -> str:
        """Checks gate and up; returns the kernel suffix of their format."""
        name = kernel_suffix(self.fmt, where)
        for W in (self.gate, self.up):
            check_weights(where, W, self.fmt, self.n_experts, self.ff, self.dim)
        return name

    def check_down(self, where: str) -> str:
        """Checks down; returns the kernel suffix of its format."""
        name = kernel_suffix(self.down_type, where)
        check_weights(where, self.down, self.down_type, self.n_experts, self.dim, self.ff)
        return name


@dataclass(frozen=True)
class Slots:
    """The experts one call runs per row: k slots, ids int32 [rows, k] (None: slot s runs expert s), weights
    float32 [rows, k] scaling each slot's output (None: 1; the gate + up applies them)."""
    ids: Any = None
    weights: Any = None
    k: int = 1

    def check(self, where: str, pairs: int) -> None:
        need(self.k >= 1, f"{where}: at least one slot per row")
        need(self.ids is None or (is_dtype(self.ids, np.int32) and self.ids.size >= pairs),
             f"{where}: ids must be int32 with one per (row, slot) pair ({pairs})")
        need(self.weights is None or self.weights.size >= pairs, f"{where}: route weights must cover the {pairs} "
             "(row, slot) pairs")


@dataclass(frozen=True)
class HcPost:
    """The decode down projection's mHC post (the sub-layer's mix): post [hc], comb [hc, hc] and the residual
    X [hc, dim] the output is mixed with."""
    post: Any
    comb: Any
    X: Any


def moe_gate_up(rt: Any, ex: Experts, x: Any, h: Any, slots: Slots = Slots(), rows_per_block: int | None = None,
                stream: Any = None, pdl: bool = False) -> MoePlan:
    """h [k, ff] = silu(min(Wg[e] x, c)) * clamp(Wu[e] x, -c, c) * w[s], e = slots.ids[s] (None: e = s), w =
    slots.weights (None: 1); x [dim]."""
    name = i8_kernel(ex.fmt, ex.act_quant) + ex.check_gate_up("moe_gate_up")
    n_slots, ff, dim = slots.k, ex.ff, ex.dim
    need(x.size == dim and h.size >= n_slots * ff and n_slots >= 1, "moe_gate_up: x or h does not match the shapes")
    slots.check("moe_gate_up", n_slots)
    need(aligned(16, x, h), "moe_gate_up: x and h must be 16-byte aligned")
    plan = gate_up_plan(ex.fmt, dim, ff, rows_per_block)
    smem = launch_smem(ex.fmt, plan, decode_ring(ex.fmt))
    gx = _grid_x(rt, ex.fmt, -(-ff // plan.rows_per_block), n_slots, plan.threads, smem, f"moe_gate_up_{name}")
    rt.launch(f"moe_gate_up_{name}", (gx, n_slots), plan.threads, ex.gate, ex.up, x, slots.ids, slots.weights, h,
              int(ex.n_experts), int(ff), int(dim), plan.rows_per_block, float(ex.clamp), smem=smem, stream=stream,
              pdl=pdl)
    return plan


def moe_down(rt: Any, ex: Experts, io: TokenRows, slots: Slots = Slots(), hc: HcPost | None = None,
             rows_per_block: int | None = None, stream: Any = None, pdl: bool = False) -> MoePlan:
    """y = sum_s W[ids[s]] h[s] (+ io.add) with h = io.x [k, ff]: io.y [dim] = y, or with hc (the sub-layer's mHC
    post mix and residual X [hc, dim]) io.y [hc, dim] = post_k y + sum_j comb[j, k] X_j. W = ex.down."""
    name = i8_kernel(ex.down_type, ex.act_quant) + ex.check_down("moe_down")
    h, out, add, n_slots, dim, ff = io.x, io.y, io.add, slots.k, ex.dim, ex.ff
    need(1 <= n_slots and h.size >= n_slots * ff, "moe_down: h does not hold n_slots x ff")
    slots.check("moe_down", n_slots)
    need(add is None or add.size == dim, "moe_down: add must be [dim]")
    n_hc = 0
    if hc is not None:
        n_hc = int(hc.post.size)
        need(hc.comb is not None and hc.comb.size == n_hc * n_hc and hc.X is not None and hc.X.size == n_hc * dim
             and out.size == n_hc * dim, f"moe_down: hc_post needs comb [{n_hc}, {n_hc}], X and out [{n_hc}, {dim}]")
    else:
        need(out.size == dim, "moe_down: out must be [dim]")
    need(aligned(16, h), "moe_down: h must be 16-byte aligned")
    fmt = ex.down_type
    plan = down_plan(fmt, ff, dim, n_slots, rows_per_block)
    smem = launch_smem(fmt, plan, decode_ring(fmt))
    gx = _grid_x(rt, fmt, -(-dim // plan.rows_per_block), 1, plan.threads, smem, f"moe_down_{name}")
    post, comb, X = (hc.post, hc.comb, hc.X) if hc is not None else (None, None, None)
    rt.launch(f"moe_down_{name}", gx, plan.threads, ex.down, slots.ids, h, add, post, comb, X, out, int(n_slots),
              int(ex.n_experts), int(dim), int(ff), plan.rows_per_block, n_hc, smem=smem, stream=stream, pdl=pdl)
    return plan


def moe_dequant(rt: Any, qtype: int, W: Any, out: Any, n_values: int, stream: Any = None, pdl: bool = False) -> None:
    """out[:n_values] = the exact values of the first n_values weights of W (whole blocks)."""
    name, qk, nb = _fmt(qtype)
    need(n_values % qk == 0 and n_values % 32 == 0 and W.nbytes >= n_values // qk * nb and out.size >= n_values,
         f"moe_dequant: {n_values} values are not whole blocks of the given buffers")
    n_groups = n_values // 32
    rt.launch(f"moe_dequant_{name}", -(-n_groups // 256), 256, W, out, n_groups, stream=stream, pdl=pdl)


# ---- several rows: experts grouped over the rows' choices -------------------------------------------
MAX_PAIRS = 1024               # (row, slot) pairs of one grouped launch (moe_unique_id's bound)


def moe_rows_plan(qtype: int, dim: int, ff: int, rows_per_block: int | None = None,
                  budget: int | None = None) -> MoePlan:
    """The grouped gate + up keeps its stage while it runs every pair of its expert, so the partial sums sit
    beside it: as many rows per block as fit stage + partials in `budget` (the thread layout, and so every
    pair's bits, are those of moe_gate_up)."""
    G = dim // 32
    budget = vq_budget(qtype) if budget is None else budget
    one = moe_plan(qtype, dim, ff, 2, 2, 1)
    if rows_per_block is None:
        rows_per_block = MOE_RPT * one.row_lanes
        while rows_per_block > 1 and 2 * stage_bytes(qtype, rows_per_block, dim) + 8 * rows_per_block * (G + 1) > budget:
            rows_per_block -= 1
        rows_per_block = min(rows_per_block, ff)
    plan = moe_plan(qtype, dim, ff, 2, 2, rows_per_block)
    return MoePlan(plan.threads, plan.row_lanes, rows_per_block,
                   2 * stage_bytes(qtype, rows_per_block, dim) + 8 * rows_per_block * (G + 1))


def moe_gate_up_rows(rt: Any, ex: Experts, io: TokenRows, slots: Slots = Slots(),
                     rows_per_block: int | None = None, stream: Any = None, pdl: bool = False) -> MoePlan:
    """io.y = h [T * k, ff]: pair p = (row n, slot s) = n * k + s is moe_gate_up of x[n] = io.x + n * io.ldx
    (None: dim) with expert ids[p] and weight weights[p] (ids None: expert s, weights None: 1), bit-identical to
    it; each distinct expert's gate and up rows are read once for all the pairs that chose it. ex.act_quant:
    moe_gate_up's int8 pairs (x rounded as Q8_K, int8 dots)."""
    name = i8_kernel(ex.fmt, ex.act_quant) + ex.check_gate_up("moe_gate_up_rows")
    x, h, nx, k, ff, dim = io.x, io.y, io.T, slots.k, ex.ff, ex.dim
    stride = dim if io.ldx is None else int(io.ldx)
    n_pairs = nx * k
    need(1 <= k and 1 <= nx and n_pairs <= MAX_PAIRS, f"moe_gate_up_rows: 1 to {MAX_PAIRS} (row, slot) pairs")
    need(stride >= dim and stride % 4 == 0 and x.size >= (nx - 1) * stride + dim and h.size >= n_pairs * ff,
         "moe_gate_up_rows: x or h does not match the shapes")
    slots.check("moe_gate_up_rows", n_pairs)
    need(aligned(16, x, h), "moe_gate_up_rows: x and h must be 16-byte aligned")
    plan = moe_rows_plan(ex.fmt, dim, ff, rows_per_block)
    groups = k if slots.ids is None else min(n_pairs, ex.n_experts + 1)      # + 1: a bad id is a group of its own
    gx = _grid_x(rt, ex.fmt, -(-ff // plan.rows_per_block), groups, plan.threads, launch_smem(ex.fmt, plan),
                 f"moe_gate_up_rows_{name}")
    rt.launch(f"moe_gate_up_rows_{name}", (gx, groups), plan.threads, ex.gate, ex.up, x, slots.ids, slots.weights, h,
              int(ex.n_experts), int(ff), int(dim), plan.rows_per_block, float(ex.clamp), int(n_pairs), int(k),
              stride, smem=launch_smem(ex.fmt, plan), stream=stream, pdl=pdl)
    return plan


def moe_down_rows(rt: Any, ex: Experts, io: TokenRows, slots: Slots = Slots(), hc: HcResidual | None = None,
                  rows_per_block: int | None = None, stream: Any = None, pdl: bool = False) -> MoePlan:
    """Row n of io.T: moe_down on ids[n * k:], h[n * k:] (h = io.x), add[n] and, with hc (mix [T, (2 + hc) * hc]:
    pre, post, comb per row; the residual X [T, hc, dim]), io.y[n] = X'_n; bit-identical to a one-row moe_down
    (with ex.act_quant: to the int8 moe_down)."""
    name = i8_kernel(ex.down_type, ex.act_quant) + ex.check_down("moe_down_rows")
    h, out, add, nx, n_slots, dim, ff = io.x, io.y, io.add, io.T, slots.k, ex.dim, ex.ff
    need(1 <= n_slots and 1 <= nx and h.size >= nx * n_slots * ff, "moe_down_rows: h does not hold nx x n_slots x ff")
    slots.check("moe_down_rows", nx * n_slots)
    need(add is None or add.size >= nx * dim, "moe_down_rows: add must be [nx, dim]")
    if hc is not None:
        mrec = mix_record(hc.hc)
        need(hc.hc >= 1 and hc.dim == dim and hc.mix.size >= nx * mrec and hc.X is not None
             and hc.X.size >= nx * hc.hc * dim and out.size >= nx * hc.hc * dim, f"moe_down_rows: the hc_post needs "
             f"mix [{nx}, {mrec}], X and out [{nx}, {hc.hc}, {dim}]")
    else:
        need(out.size >= nx * dim, "moe_down_rows: out must be [nx, dim]")
    need(aligned(16, h), "moe_down_rows: h must be 16-byte aligned")
    fmt = ex.down_type
    plan = moe_plan(fmt, ff, dim, n_slots, 1, rows_per_block)
    gx = _grid_x(rt, fmt, -(-dim // plan.rows_per_block), nx, plan.threads, launch_smem(fmt, plan),
                 f"moe_down_rows_{name}")
    mix, X, n_hc = (hc.mix, hc.X, int(hc.hc)) if hc is not None else (None, None, 0)
    rt.launch(f"moe_down_rows_{name}", (gx, nx), plan.threads, ex.down, slots.ids, h, add, mix, X, out, int(n_slots),
              int(ex.n_experts), int(dim), int(ff), plan.rows_per_block, n_hc,
              smem=launch_smem(fmt, plan), stream=stream, pdl=pdl)
    return plan
