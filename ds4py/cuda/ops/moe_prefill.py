"""Host side of cu/moe_prefill.cu: the routed experts of a block of T tokens, grouped by expert on tensor cores.

    bufs = MoePrefillBuffers.alloc(arena.scratch, T, k, n_experts, ff, dim)     # or from any allocator
    ex = Experts(fmt=gate_type, n_experts=n_experts, ff=ff, dim=dim, gate=Wg, up=Wu, down=Wd, down_fmt=down_type,
                 clamp=clamp)                                                    # ops/experts.py, once per layer
    moe_prefill(rt, ex, TokenRows(x=x_ffn, y=y, T=T, add=y_shared), Slots(ids, wts, k), bufs)

x [T, dim] float32 (ldx apart), ids [T, k] int32 and wts [T, k] float32 (the router's), y [T, dim] float32
(ldy apart) = sum_s w_s * down_e(silu(min(gate_e x, c)) * clamp(up_e x, -c, c)) over the token's k slots (+ add
[T, dim]). Four launches: route (count / scan / scatter, one block), gate + up, down, combine. The grids are sized
for the worst case, so nothing is read back to the host (graph-capturable). The stages are separate functions
too (moe_prefill_route, _gate_up, _down, _combine) for tests and for callers that fuse other work between them.

Numerics: x and the SwiGLU output are rounded to bf16 before their products, the expert weights stay exact (their
integer codes on the tensor cores, scales and mins in fp32); fp32 accumulation in a fixed order; the combine sums
the k slots in slot order (twin: ds4py/cuda/twins/moe_prefill.py). VQ-8 experts (weight type "vq12" / "vq13", the
device copies of ds4py/cuda/vq_layout.py) keep x and the SwiGLU output exact too (three bf16 pieces, x_pieces()):
E4M3 codewords on the tensor cores, the row gain in fp32, so the result is the fp32 reference's up to summation
order.

The shared expert of a prefill block runs through the same kernels as one expert chosen by every token:
n_experts = 1, k = 1, ids all 0, wts None (its Q8_0 / F16 gate, up and down are expert formats too).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

import numpy as np

from ds4py.ggml_types import GGMLQuantizationType as QT

from ds4py.cuda.ops.core import TokenRows, aligned, blocks_that_fit, ceil_div, is_dtype, need
from ds4py.cuda.ops.experts import (FORMATS, SMEM_BUDGET, VQ_FORMATS, Experts, Slots, codebook_bytes,
                                   kernel_suffix, room, row_bytes)

DEFINES = {
    "MOEP_WARPS_M": 2,            # warps along the routed rows (32 each): MOEP_BM = 64 rows per work item
    "MOEP_WARPS_N": 2,            # warps along the features (32 each): MOEP_BN = 64 features per block (2: the A
                                  # staging has two threads per row, one per 16 columns)
    "MOEP_MAX_EXPERTS": 512,      # routed experts the route kernel's shared counters hold (V4 Flash 256, V4.1 384)
    "MOEP_ROUTE_WARPS": 16,       # the route kernel's warps, each counting a chunk of the pairs per expert (16 x 513
                                  # counters: 33 KB of static shared memory)
    "MOEP_WIN_S": 2,              # VQ-8 at 13 bits: 32-byte slots of each tile row's stream window (cu MoepWin)
    "MOEP_WIN_H": 1,              # ... and of its hi row's window
    "MOET_NT": 16,                # the exact token tiles (moe_*_tile_<fmt>): tokens one decoded weight group meets
                                  # while its codes sit in registers
}
BM = 32 * DEFINES["MOEP_WARPS_M"]
BN = 32 * DEFINES["MOEP_WARPS_N"]
THREADS = 32 * DEFINES["MOEP_WARPS_M"] * DEFINES["MOEP_WARPS_N"]
MAX_EXPERTS = DEFINES["MOEP_MAX_EXPERTS"]
ROUTE_THREADS = 32 * DEFINES["MOEP_ROUTE_WARPS"]
TILE_ROWS = 32                    # weight rows per block of the exact token tiles at most (8 threads each)
WARP_ROWS = 16                    # cu/moe_prefill.cu MOEP_WTM: a tensor-core warp's rows of a work item (a warp
                                  # whose rows are all the item's padding skips its MMAs)


def max_tiles(n_pairs: int, n_experts: int) -> int:
    """Work items at most: sum over buckets of ceil(c_b / BM) <= P / BM + (non-empty buckets, <= E + 1)."""
    return n_pairs // BM + min(n_experts + 1, n_pairs)


@dataclass
class MoePrefillBuffers:
    """Device scratch of one grouped MoE (P = T * k pairs): int32 offsets [E + 2], sorted [P], pos [P],
    tile_bucket / tile_row [max_tiles], info [1]; float32 H [P, ff], Yp [P, dim]."""
    offsets: Any
    sorted: Any
    pos: Any
    tile_bucket: Any
    tile_row: Any
    info: Any
    H: Any
    Yp: Any

    @staticmethod
    def shapes(T: int, k: int, n_experts: int, ff: int, dim: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        P, i32, f32 = T * k, np.dtype(np.int32), np.dtype(np.float32)
        mt = max_tiles(P, n_experts)
        return {"offsets": ((n_experts + 2,), i32), "sorted": ((P,), i32), "pos": ((P,), i32),
                "tile_bucket": ((mt,), i32), "tile_row": ((mt,), i32), "info": ((4,), i32),
                "H": ((P, ff), f32), "Yp": ((P, dim), f32)}

    @classmethod
    def alloc(cls, make: Callable[[tuple[int, ...], np.dtype], Any], T: int, k: int, n_experts: int, ff: int,
              dim: int) -> "MoePrefillBuffers":
        """make(shape, dtype) -> a DeviceArray (arena.scratch, or arena.weights ... ), one call per buffer."""
        return cls(**{n: make(s, dt) for n, (s, dt) in cls.shapes(T, k, n_experts, ff, dim).items()})

    def check(self, T: int, k: int, n_experts: int, ff: int, dim: int) -> None:
        for f in fields(self):
            shape, dt = self.shapes(T, k, n_experts, ff, dim)[f.name]
            a = getattr(self, f.name)
            need(a is not None and is_dtype(a, dt) and a.size >= int(np.prod(shape)),
                 f"moe_prefill: buffer {f.name} must be {dt} with {int(np.prod(shape))} values")
        need(aligned(16, self.H, self.Yp), "moe_prefill: H and Yp must be 16-byte aligned")


def x_pieces(qtype: int | str) -> int:
    """The bf16 pieces x and H go into the tensor cores as (moe_prefill.cu MoepF::XP): 3 (exact) for VQ-8, 1
    (rounded to bf16) for the GGML formats."""
    return 3 if isinstance(qtype, str) else 1


def ring_pitch(qtype: int | str) -> int:
    """Bytes per weight row of one buffer of the kernels' sector ring (cu/moe_prefill.cu MoepRing): a chunk of KT k
    tiles (>= 48 bytes of a row, whole blocks of the format) spans at most this many whole 32-byte sectors, its
    start at a multiple of G (the row and chunk starts' alignment in a 16-byte aligned matrix)."""
    if isinstance(qtype, str):
        qk, bits, _ = VQ_FORMATS[qtype]
        nbytes = 12 if bits == 13 else bits
    else:
        _, qk, nbytes = FORMATS[QT(int(qtype))]
    kt = qk // 32
    while kt * 32 // qk * nbytes < 48:
        kt *= 2
    g = min(16, nbytes & -nbytes)
    return 32 * ceil_div(32 - g + kt * 32 // qk * nbytes, 32)


def ring_on(qtype: int | str) -> bool:
    """Whether the kernel streams its weight rows through the sector ring of chunk buffers (VQ-8 at 13 bits: no room
    for it beside its 64 KiB codebook within GB10's 101,376 bytes per block: a window of whole sectors per tile row
    instead, cu/moe_prefill.cu MoepWin)."""
    return not (isinstance(qtype, str) and VQ_FORMATS[qtype][1] == 13)


def weight_ring_bytes(qtype: int | str, mats: int) -> int:
    """Dynamic shared memory of the weight rows' staging for BN rows of `mats` matrices (gate + up: 2, down: 1): the
    sector ring's two buffers, or at 13 bits each row's windows (MOEP_WIN_S stream + MOEP_WIN_H hi slots of 32
    bytes)."""
    if ring_on(qtype):
        return 2 * mats * BN * ring_pitch(qtype)
    return mats * BN * 32 * (DEFINES["MOEP_WIN_S"] + DEFINES["MOEP_WIN_H"])


def launch_smem(qtype: int | str, mats: int) -> int:
    """Dynamic shared memory of a moe_prefill_gate_up (mats 2) / _down (mats 1) launch: the VQ-8 codebook, then the
    ring."""
    return codebook_bytes(qtype) + weight_ring_bytes(qtype, mats)


def _grid(rt: Any, qtype: int | str, tiles: int, items: int, kernel: str) -> tuple[int, int]:
    """(feature tiles, work items) for the GGML formats; VQ-8's persistent down blocks loop over the (tile, item) pairs,
    so their grid is at most one wave of the device (the kernel's occupancy: blocks_that_fit, its registers and
    static shared memory from the ptxas table) and each block copies the codebook once."""
    if not isinstance(qtype, str):
        return tiles, items
    return max(1, min(tiles * items, blocks_that_fit(rt, THREADS, launch_smem(qtype, 1), kernel=kernel))), 1


def moe_prefill_route(rt: Any, ids: Any, bufs: MoePrefillBuffers, T: int, k: int, n_experts: int,
                      stream: Any = None, pdl: bool = False) -> None:
    """Count / scan / scatter the T*k pairs by expert (ids [T, k] int32): bufs.offsets, sorted, pos, the work
    items and info[0] (their number). Exact and deterministic (within an expert: pair order t*k + s)."""
    P = T * k
    need(1 <= n_experts <= MAX_EXPERTS, f"moe_prefill: 1 to {MAX_EXPERTS} experts, got {n_experts}")
    need(T >= 1 and k >= 1, "moe_prefill: T and k must be >= 1")
    need(is_dtype(ids, np.int32) and ids.size >= P, f"moe_prefill: ids must be int32 [{T}, {k}]")
    rt.launch("moe_prefill_route", 1, ROUTE_THREADS, ids, bufs.offsets, bufs.sorted, bufs.pos, bufs.tile_bucket,
              bufs.tile_row, bufs.info, int(P), int(n_experts), max_tiles(P, n_experts), stream=stream, pdl=pdl)


def _check_x(where: str, io: TokenRows, slots: Slots, dim: int) -> int:
    """The block's x [T, ldx] and the route weights [T, k]; returns ldx."""
    T, x, wts = io.T, io.x, slots.weights
    ldx = dim if io.ldx is None else int(io.ldx)
    need(ldx >= dim and ldx % 4 == 0 and is_dtype(x, np.float32) and x.size >= (T - 1) * ldx + dim,
         f"{where}: x must be float32 [{T}, {ldx}] with ldx % 4 == 0")
    need(aligned(16, x), f"{where}: x must be 16-byte aligned")
    need(wts is None or (is_dtype(wts, np.float32) and wts.size >= T * slots.k), f"{where}: wts must be "
         f"float32 [{T}, {slots.k}]")
    return ldx


def moe_prefill_gate_up(rt: Any, ex: Experts, io: TokenRows, slots: Slots, bufs: MoePrefillBuffers,
                        stream: Any = None, pdl: bool = False) -> None:
    """bufs.H[row] = silu(min(x_t Wg[e]^T, c)) * clamp(x_t Wu[e]^T, -c, c) * wts[p] for every sorted row (pair
    p = t*k + s of expert e; wts = slots.weights, None: 1; x_t: row t of io.x)."""
    name = ex.check_gate_up("moe_prefill_gate_up")
    need(aligned(16, ex.gate, ex.up), "moe_prefill_gate_up: the gate and up tensors must be 16-byte aligned")
    T, k, ff, dim = io.T, slots.k, ex.ff, ex.dim
    need(ff % 32 == 0, f"moe_prefill_gate_up: ff ({ff}) must be a multiple of 32")
    ldx = _check_x("moe_prefill_gate_up", io, slots, dim)
    bufs.check(T, k, ex.n_experts, ff, dim)
    rt.launch(f"moe_prefill_gate_up_{name}", (ceil_div(ff, BN), max_tiles(T * k, ex.n_experts)), THREADS, ex.gate,
              ex.up, io.x, slots.weights, bufs.sorted, bufs.tile_bucket, bufs.tile_row, bufs.offsets, bufs.info,
              bufs.H, int(ex.n_experts), int(ff), int(dim), int(k), ldx, float(ex.clamp), smem=launch_smem(ex.fmt, 2),
              stream=stream, pdl=pdl)


def moe_prefill_down(rt: Any, ex: Experts, bufs: MoePrefillBuffers, T: int, k: int, stream: Any = None,
                     pdl: bool = False) -> None:
    """bufs.Yp[row] = bufs.H[row] W[e]^T for every sorted row of the T * k pairs (W = ex.down [n_experts, dim,
    ff])."""
    name = ex.check_down("moe_prefill_down")
    need(aligned(16, ex.down), "moe_prefill_down: the down tensor must be 16-byte aligned")
    fmt, n_experts, ff, dim = ex.down_type, ex.n_experts, ex.ff, ex.dim
    bufs.check(T, k, n_experts, ff, dim)
    rt.launch(f"moe_prefill_down_{name}", _grid(rt, fmt, ceil_div(dim, BN), max_tiles(T * k, n_experts),
                                                f"moe_prefill_down_{name}"), THREADS, ex.down, bufs.H,
              bufs.tile_bucket, bufs.tile_row, bufs.offsets, bufs.info, bufs.Yp, int(n_experts), int(dim), int(ff),
              smem=launch_smem(fmt, 1), stream=stream, pdl=pdl)


def moe_prefill_combine(rt: Any, bufs: MoePrefillBuffers, io: TokenRows, k: int, dim: int, stream: Any = None,
                        pdl: bool = False) -> None:
    """io.y[t] = sum_{s<k} Yp[pos[t*k + s]] (s ascending) (+ io.add[t], [T, dim]); io.x is not read."""
    T, y, add = io.T, io.y, io.add
    ldy = dim if io.ldy is None else int(io.ldy)
    need(ldy >= dim and is_dtype(y, np.float32) and y.size >= (T - 1) * ldy + dim,
         f"moe_prefill_combine: y must be float32 [{T}, {ldy}]")
    need(add is None or (is_dtype(add, np.float32) and add.size >= T * dim),
         f"moe_prefill_combine: add must be float32 [{T}, {dim}]")
    rt.launch("moe_prefill_combine", (ceil_div(dim, 256), T), 256, bufs.Yp, bufs.pos, add, y, int(k), int(dim), ldy,
              stream=stream, pdl=pdl)


def moe_prefill(rt: Any, ex: Experts, io: TokenRows, slots: Slots, bufs: MoePrefillBuffers, stream: Any = None,
                pdl: bool = False) -> None:
    """The whole routed MoE of io.T tokens: ex's stacked expert tensors (GGML raw bytes or VQ-8 device copies),
    x = io.x, y = io.y (+ io.add), the router's slots (ids [T, k] int32, weights [T, k]). See the module
    docstring."""
    need(not ex.act_quant, "moe_prefill: the tensor-core experts are fp32 only (act_quant: the int8 moe_*_rows)")
    moe_prefill_route(rt, slots.ids, bufs, io.T, slots.k, ex.n_experts, stream=stream, pdl=pdl)
    moe_prefill_gate_up(rt, ex, io, slots, bufs, stream=stream, pdl=pdl)
    moe_prefill_down(rt, ex, bufs, io.T, slots.k, stream=stream, pdl=pdl)
    moe_prefill_combine(rt, bufs, io, slots.k, ex.dim, stream=stream, pdl=pdl)


# ---- the exact fp32 token tiles (cu/moe_prefill.cu moe_gate_up_tile_<fmt> / moe_down_tile_<fmt>) -------------------
# The GGML formats' default prefill experts: per work item of the route (up to BM sorted rows of one expert) and
# tile of weight rows, the rows staged once and every sorted row run against them; a pair's H row is bit for bit
# moe_gate_up_rows' h of that pair, its Yp row moe_down's y with that one slot (ds4py/cuda/twins/experts.py), and
# the combine sums the k slots in slot order. Each expert's weights are read once per work item.
def tile_rows(qtype: int, cols: int, mats: int) -> int:
    """Weight rows per block: as many as fit SMEM_BUDGET with `mats` matrices staged (1 .. TILE_ROWS)."""
    rb = row_bytes(qtype, cols)
    nr = TILE_ROWS
    while nr > 1 and mats * room(nr * rb) > SMEM_BUDGET:
        nr -= 1
    return nr


def tile_threads(rows_per_block: int) -> int:
    return 32 * ceil_div(8 * rows_per_block, 32)


# the formats whose dot takes the half sums of x (the K-quants' mins: moe_formats.cuh's xs); the token tiles keep
# them in shared memory per chunk of MOET_NT rows
XS_FORMATS = (QT.Q2_K, QT.Q4_K)


def tile_smem(qtype: int, cols: int, mats: int, rows_per_block: int) -> int:
    """Dynamic shared memory of a token-tile launch: `mats` staged row spans, + the chunk's half sums."""
    xs = 8 * DEFINES["MOET_NT"] * (cols // 32) if QT(int(qtype)) in XS_FORMATS else 0
    return mats * room(rows_per_block * row_bytes(qtype, cols)) + xs


def _tile_name(qtype: int, where: str) -> str:
    need(not isinstance(qtype, str), f"{where}: the token tiles read the GGML formats (VQ-8: moe_prefill_*)")
    return kernel_suffix(qtype, where)


def moe_tile_gate_up(rt: Any, ex: Experts, io: TokenRows, slots: Slots, bufs: MoePrefillBuffers,
                     rows_per_block: int | None = None, stream: Any = None, pdl: bool = False) -> None:
    """bufs.H[row] = silu(min(x_t Wg[e]^T, c)) * clamp(x_t Wu[e]^T, -c, c) * wts[p] in fp32, for every sorted row
    (pair p = t*k + s of expert e; wts = slots.weights, None: 1), the bits of moe_gate_up_rows_<fmt>."""
    name = _tile_name(ex.fmt, "moe_tile_gate_up")
    ex.check_gate_up("moe_tile_gate_up")
    T, k, ff, dim = io.T, slots.k, ex.ff, ex.dim
    ldx = _check_x("moe_tile_gate_up", io, slots, dim)
    bufs.check(T, k, ex.n_experts, ff, dim)
    nr = int(rows_per_block or tile_rows(ex.fmt, dim, 2))
    need(1 <= nr <= TILE_ROWS, f"moe_tile_gate_up: 1 to {TILE_ROWS} rows per block")
    rt.launch(f"moe_gate_up_tile_{name}", (ceil_div(ff, nr), max_tiles(T * k, ex.n_experts)), tile_threads(nr),
              ex.gate, ex.up, io.x, slots.weights, bufs.sorted, bufs.tile_bucket, bufs.tile_row, bufs.offsets,
              bufs.info, bufs.H, int(ex.n_experts), int(ff), int(dim), int(k), ldx, nr, float(ex.clamp),
              smem=tile_smem(ex.fmt, dim, 2, nr), stream=stream, pdl=pdl)


def moe_tile_down(rt: Any, ex: Experts, bufs: MoePrefillBuffers, T: int, k: int, rows_per_block: int | None = None,
                  stream: Any = None, pdl: bool = False) -> None:
    """bufs.Yp[row] = bufs.H[row] W[e]^T in fp32 for every sorted row, the bits of moe_down_<fmt> with one slot."""
    fmt, n_experts, ff, dim = ex.down_type, ex.n_experts, ex.ff, ex.dim
    name = _tile_name(fmt, "moe_tile_down")
    ex.check_down("moe_tile_down")
    bufs.check(T, k, n_experts, ff, dim)
    nr = int(rows_per_block or tile_rows(fmt, ff, 1))
    need(1 <= nr <= TILE_ROWS, f"moe_tile_down: 1 to {TILE_ROWS} rows per block")
    rt.launch(f"moe_down_tile_{name}", (ceil_div(dim, nr), max_tiles(T * k, n_experts)), tile_threads(nr), ex.down,
              bufs.H, bufs.tile_bucket, bufs.tile_row, bufs.offsets, bufs.info, bufs.Yp, int(n_experts), int(dim),
              int(ff), nr, smem=tile_smem(fmt, ff, 1, nr), stream=stream, pdl=pdl)


def moe_tiles(rt: Any, ex: Experts, io: TokenRows, slots: Slots, bufs: MoePrefillBuffers, stream: Any = None,
              pdl: bool = False) -> None:
    """The whole routed MoE of io.T tokens in exact fp32 (GGML formats): route, the token tiles' gate + up and
    down, combine (y as moe_prefill; every (token, slot) result the decode kernels' bits, the slots summed in
    order)."""
    need(not ex.act_quant, "moe_tiles: the token tiles are fp32 only (act_quant: the int8 moe_*_rows)")
    moe_prefill_route(rt, slots.ids, bufs, io.T, slots.k, ex.n_experts, stream=stream, pdl=pdl)
    moe_tile_gate_up(rt, ex, io, slots, bufs, stream=stream, pdl=pdl)
    moe_tile_down(rt, ex, bufs, io.T, slots.k, stream=stream, pdl=pdl)
    moe_prefill_combine(rt, bufs, io, slots.k, ex.dim, stream=stream, pdl=pdl)
