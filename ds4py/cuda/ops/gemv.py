"""Host side of cu/gemv.cu: decode GEMVs on F32 / F16 / Q8_0 / Q4_K weights straight from the GGUF.

    gemv(rt, [(W_q_a, q, 1024), (W_kv, kv, 512)], GemvX(x, 4096))              # two matrices, one launch, one x
    gemv(rt, [(W_q_b, qb, 32768)], GemvX(qr, 1024, norm=(q_a_norm, eps)))     # RMSNorm prologue on x
    gemv(rt, [(W_o_a, u, 8192)], GemvX(o, 4096, x_group_rows=1024))           # grouped wo_a: group g reads x[g]
    gemv_hc_post(rt, W_o_b, GemvX(u, 8192), HcResidual(X, mix, 4096))        # X'_k = post_k W u + sum_j C[j,k] X_j
    gemv_swiglu(rt, SwiGlu(W_gate, W_up, 2048, clamp=10.0), GemvX(x, 4096), mid)   # shared expert gate + up
    gemv(rt, [(W_q_a, q, 1024)], GemvX(x, 4096, nx=8))                  # 8 activation rows x[n], y[n]: W read once

The weight type follows the array: float32 -> F32, float16 -> F16, uint8 bytes -> Q8_0 ([rows, cols/32*34]) or
Q4_K ([rows, cols/256*144]: told apart by the byte count, weight_type).
Launch geometry: warps of 32 lanes, 4 rows (slots) per warp step, grid-stride over row groups, the grid capped
at what the device holds at once. Results do not depend on the geometry (see cu/gemv.cu).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.ops.core import aligned, blocks_that_fit, ceil_div, is_dtype, need
from ds4py.cuda.ops.mhc import HcResidual
from ds4py.errors import Ds4Error

# Geometry shared with cu/gemv.cu (passed to NVRTC and the emulator as -D values; see compiler.file_defines).
DEFINES = {
    "GEMV_ROWS": 4,              # rows per warp step (slots); warp_sum4 reduces exactly 4
    "Q8_CHUNK_BLOCKS": 32,       # Q8_0 blocks (x32 columns) of one row staged per piece
    "Q8_STAGES": 3,              # Q8_0 ring depth: pieces in flight while one is decoded + 1 (H200's latency x
                                 # bandwidth needs more than one 4.4 KB piece per warp in flight)
    "Q4_CHUNK_BLOCKS": 8,        # Q4_K blocks (x256 columns) of one row staged per piece
    "F32_CHUNK_PIECES": 32,      # F32 pieces of 8 columns (32 bytes) of one row staged per piece (256 columns)
    "F16_CHUNK_PIECES": 256,     # F16 pieces of 8 columns (16 bytes) of one row staged per piece (2,048 columns)
    "GEMV_MAX_X": 8,             # activation rows of one multi-row launch (the `_rows` kernels' accumulator sets)
}
GEMV_MAX_X = DEFINES["GEMV_MAX_X"]
GEMV_ROWS = DEFINES["GEMV_ROWS"]
Q8_0_BLOCK_BYTES = 34
Q4_K_BLOCK_BYTES = 144                                    # 256 columns: f16 d, f16 dmin, 12 scale bytes, 128 nibbles
Q8_PIECE_BYTES = DEFINES["Q8_CHUNK_BLOCKS"] * Q8_0_BLOCK_BYTES + 16
Q8_WARP_SMEM = DEFINES["Q8_STAGES"] * GEMV_ROWS * Q8_PIECE_BYTES   # a ring of pieces of 4 rows, per warp
Q4_PIECE_BYTES = DEFINES["Q4_CHUNK_BLOCKS"] * Q4_K_BLOCK_BYTES + 16
Q4_WARP_SMEM = 2 * GEMV_ROWS * Q4_PIECE_BYTES           # the same for Q4_K (9,344 B per warp)
F32_WARP_SMEM = 2 * GEMV_ROWS * (DEFINES["F32_CHUNK_PIECES"] * 32 + 16)   # and F32 (8,320 B per warp)
F16_WARP_SMEM = 2 * GEMV_ROWS * (DEFINES["F16_CHUNK_PIECES"] * 16 + 16)   # and F16 (32,896 B per warp)
WARP_SMEM = {"Q8_0": Q8_WARP_SMEM, "Q4_K": Q4_WARP_SMEM, "F32": F32_WARP_SMEM, "F16": F16_WARP_SMEM}
MAX_MATS = 4
NORM, ADD = 1, 2                                          # flags (GEMV_NORM, GEMV_ADD)
DEFAULT_WARPS = {"Q8_0": 4, "F16": 2, "F32": 4, "Q4_K": 4}
FILL_TYPES = ("Q8_0", "F16")                              # the types whose small launches spread over the SMs
_KERNEL = {"Q8_0": "gemv_q8_0", "F16": "gemv_f16", "F32": "gemv_f32", "Q4_K": "gemv_q4_k"}
COL_MULTIPLE = {"Q8_0": 32, "Q4_K": 256, "F16": 8, "F32": 8}


def byte_rows(qtype: str, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] matrix of a block format (Q8_0, Q4_K)."""
    return rows * (cols // 32) * Q8_0_BLOCK_BYTES if qtype == "Q8_0" else rows * (cols // 256) * Q4_K_BLOCK_BYTES


def weight_type(W: DeviceArray, rows: int | None = None, cols: int | None = None) -> str:
    """The GGML type a GEMV weight array holds: float32 -> F32, float16 -> F16, uint8 bytes -> Q8_0, or Q4_K
    when the bytes are those of [rows, cols] in Q4_K (the two sizes never coincide: 34/32 vs 144/256 bytes per
    value)."""
    dt = np.dtype(W.dtype)
    if dt == np.float32:
        return "F32"
    if dt == np.float16:
        return "F16"
    if dt == np.uint8:
        if rows is not None and cols is not None and cols % 256 == 0 and W.nbytes == byte_rows("Q4_K", rows, cols):
            return "Q4_K"
        return "Q8_0"
    raise Ds4Error(f"a GEMV weight must be float32, float16 or Q8_0 / Q4_K bytes (uint8), not {dt}")


def _check_matrix(what: str, W: DeviceArray, rows: int, cols: int, qtype: str) -> None:
    need(weight_type(W, rows, cols) == qtype, f"{what}: all matrices of one launch have the same type ({qtype}), "
                                              f"got {weight_type(W, rows, cols)}")
    need(rows >= 1, f"{what}: rows must be >= 1, got {rows}")
    if qtype == "Q8_0":
        need(W.nbytes == byte_rows(qtype, rows, cols),
             f"{what}: W holds {W.nbytes} bytes, not {rows} x {cols} Q8_0 ({byte_rows(qtype, rows, cols)})")
        need(W.ptr % 2 == 0, f"{what}: Q8_0 weights must be 2-byte aligned")
    elif qtype == "Q4_K":
        need(aligned(16, W), f"{what}: Q4_K weights must be 16-byte aligned")
    else:
        need(W.size == rows * cols, f"{what}: W has {W.size} values, not {rows} x {cols}")
        need(aligned(16, W), f"{what}: {qtype} weights must be 16-byte aligned")


def _check_common(what: str, qtype: str, x: DeviceArray, cols: int, x_groups: int,
                  norm: tuple[DeviceArray | None, float] | None, nx: int = 1,
                  x_stride: int = 0) -> tuple[DeviceArray | None, float, int]:
    need(cols % COL_MULTIPLE[qtype] == 0, f"{what}: cols ({cols}) must be a multiple of {COL_MULTIPLE[qtype]} for {qtype}")
    nvals = (nx - 1) * x_stride + cols * max(x_groups, 1)
    need(is_dtype(x, np.float32) and x.size >= nvals, f"{what}: x must be float32 with {nvals} values")
    need(aligned(16, x), f"{what}: x must be 16-byte aligned")
    flags, norm_w, eps = 0, None, 0.0
    if norm is not None:
        norm_w, eps = norm
        need(norm_w is None or (is_dtype(norm_w, np.float32) and norm_w.size == cols and aligned(16, norm_w)),
             f"{what}: the norm weight must be {cols} float32, 16-byte aligned")
        need(x_groups == 0, f"{what}: an RMSNorm prologue does not combine with input groups")
        flags |= NORM
    return norm_w, float(eps), flags


def _rows(what: str, nx: int, x_stride: int | None, width: int) -> tuple[str, tuple, int]:
    """The kernel suffix and extra arguments of an nx-row launch (x_stride: floats between rows' x, default
    `width`, the floats one row's x occupies)."""
    need(isinstance(nx, (int, np.integer)) and 1 <= nx <= GEMV_MAX_X,
         f"{what}: 1 to {GEMV_MAX_X} activation rows per launch, got {nx}")
    stride = width if x_stride is None else int(x_stride)
    need(nx == 1 or (stride >= width and stride % 4 == 0),
         f"{what}: x_stride ({stride}) must be a multiple of 4 and at least one row's x ({width})")
    return ("", (), 0) if nx == 1 else ("_rows", (int(nx), stride), stride)


def _fill_warps(rt: Any, qtype: str, groups: int) -> int:
    """Warps per block: the type's default, fewer where its blocks would leave SMs idle. A warp owns whole row
    groups (its columns in a fixed order: the bits do not depend on the geometry), so a launch of few groups (the
    router gate's 64, a 512-row projection's 128) spreads them over as many SMs as there are groups: the largest
    count <= the default whose ceil(groups / warps) blocks still cover every SM, else one warp per block. Q8_0
    and F16 only (Q4_K / F32 keep their default)."""
    default = DEFAULT_WARPS[qtype]
    if qtype not in FILL_TYPES:
        return default
    sms = rt.profile.sm_count
    for w in range(default, 0, -1):
        if ceil_div(groups, w) >= sms:
            return w
    return 1


def _geometry(rt: Any, qtype: str, groups: int, warps: int | None, grid: int | None,
              kernel: str | None = None) -> tuple[int, int, int]:
    """(grid, threads, dynamic smem): one wave at most, the wave sized by the kernel's occupancy (its registers,
    not threads alone: blocks_that_fit)."""
    warps = warps or _fill_warps(rt, qtype, groups)
    need(1 <= warps <= 32, f"gemv: warps must be 1..32, got {warps}")
    smem = warps * WARP_SMEM.get(qtype, 0)
    grid = grid or min(ceil_div(groups, warps), blocks_that_fit(rt, 32 * warps, smem, kernel=kernel))
    return grid, 32 * warps, smem


@dataclass(frozen=True)
class GemvX:
    """The activations of a GEMV launch: nx rows x[n] = x + n * x_stride (None: one row's width), each `cols`
    values per input group. x_group_rows > 0: rows [g*x_group_rows, (g+1)*x_group_rows) of every matrix read
    x[g*cols:(g+1)*cols] (a multiple of 4). norm = (w, eps): x RMS-normalised first (times w unless None).
    act_quant: the activations' numerics are int8 (Numerics.act_quant): Q8_0 or Q4_K weights, x rounded inside the
    kernel (after the norm) as the reference rounds that product's input, dp4a block dots (Q8_0: gemv_q8_0_i8*, x as
    Q8_0; Q4_K: gemv_q4_k_i8*, x as Q8_K; with input groups gemv_{q8_0,q4_k}_i8_grouped*, plain gemv only)."""
    x: DeviceArray
    cols: int
    nx: int = 1
    x_stride: int | None = None
    x_group_rows: int = 0
    norm: tuple[DeviceArray | None, float] | None = None
    act_quant: bool = False


@dataclass(frozen=True)
class SwiGlu:
    """A SwiGLU pair, the same for every call (the shared expert's gate + up): gate, up [rows, cols] of one weight
    type; clamp (<= 0: none)."""
    gate: DeviceArray
    up: DeviceArray
    rows: int
    clamp: float = 0.0


# ---- int8 activations (Numerics.act_quant): gemv_{q8_0,q4_k}_i8[_hc_post | _swiglu][_rows] ------------------------
# x is quantised (Q8_0 blocks, the reference's q8_0_round) once per block into shared memory behind the weight ring:
# nx * (cols + cols / 8) bytes. A launch takes as many activation rows as fit I8_SMEM_LIMIT (GB10's 101,376 B per
# block, less the driver's and static bytes); more rows are more launches, each row's bits the same.
I8_SMEM_LIMIT = 101_376 - 2048
I8_Q4_K_WARPS = 4                                         # warps of a one-row Q4_K int8 launch (at most)


def _i8_row_bytes(cols: int, qtype: str = "Q8_0") -> int:
    """Shared bytes of one row of quantised x: Q8_0, codes + an f32 scale per 32; Q4_K (x as Q8_K), codes + an f32
    scale per 256 + an int code sum per 32."""
    return cols + cols // 8 + (cols // 64 if qtype == "Q4_K" else 0)


def i8_x_bytes(nx: int, cols: int, qtype: str = "Q8_0") -> int:
    """Shared bytes of nx rows of quantised x (16-byte rounded): codes, then scales (and Q4_K's code sums)."""
    return (nx * _i8_row_bytes(cols, qtype) + 15) & ~15


def i8_rows_per_launch(cols: int, warps: int, qtype: str = "Q8_0") -> int:
    """Activation rows of int8 x that fit one block's shared memory beside `warps` warps' weight ring."""
    return max(1, (I8_SMEM_LIMIT - warps * WARP_SMEM[qtype]) // _i8_row_bytes(cols, qtype))


def _i8_launches(rt: Any, what: str, qtype: str, groups: int, cols: int, nx: int, x_group_rows: int,
                 warps: int | None, grid: int | None, kernel: str) -> tuple[int, int, int, int]:
    """(grid, threads, dynamic smem, rows per launch) of an int8-activation Q8_0 or Q4_K launch. With input groups
    (gemv_q8_0_i8_grouped*: each warp's x group quantised into its own shared memory) see _i8_grouped_launches."""
    need(qtype in I8_TYPES, f"{what}: int8 activations (act_quant) have kernels for Q8_0 and Q4_K weights only, "
                            f"not {qtype}")
    if x_group_rows > 0:
        return _i8_grouped_launches(rt, what, qtype, groups, cols, nx, warps, grid, kernel)
    if warps is None:
        warps = max(2, _fill_warps(rt, qtype, groups))         # >= 2 warps share the x quantisation
        if qtype == "Q4_K" and nx == 1:
            # every block quantises all of x: Q4_K's smaller ring lets a block take more warps, so fewer blocks
            # (the same wave) repeat it
            warps = I8_Q4_K_WARPS
            while warps > 2 and warps * WARP_SMEM[qtype] + i8_x_bytes(1, cols, qtype) > I8_SMEM_LIMIT:
                warps -= 1
    need(1 <= warps <= 32, f"gemv: warps must be 1..32, got {warps}")
    ring = warps * WARP_SMEM[qtype]
    per = min(nx, i8_rows_per_launch(cols, warps, qtype))
    need(ring + i8_x_bytes(1, cols, qtype) <= I8_SMEM_LIMIT,
         f"{what}: {cols} columns of int8 x do not fit shared memory")
    smem = ring + i8_x_bytes(per, cols, qtype)
    grid = grid or min(ceil_div(groups, warps), blocks_that_fit(rt, 32 * warps, smem, kernel=kernel))
    return grid, 32 * warps, smem, per


# With input groups (gemv_q8_0_i8_grouped*, gemv_q4_k_i8_grouped*) each warp quantises its current x group into its
# own shared memory (i8_x_bytes(nx, cols) beside its ring) and takes a run of consecutive row groups, so that one
# quantisation serves I8_GROUP_RUN row groups (16 rows) or more: the grid is sized for that, never above one wave.
I8_GROUP_RUN = 4


def _i8_grouped_launches(rt: Any, what: str, qtype: str, groups: int, cols: int, nx: int, warps: int | None,
                         grid: int | None, kernel: str) -> tuple[int, int, int, int]:
    """(grid, threads, dynamic smem, rows per launch) of gemv_{q8_0,q4_k}_i8_grouped*: the type's default warps
    (fewer when a warp's nx rows of x would not fit beside its ring), as many rows per launch as fit."""
    per_warp = lambda k: WARP_SMEM[qtype] + i8_x_bytes(k, cols, qtype)          # noqa: E731
    need(per_warp(1) <= I8_SMEM_LIMIT, f"{what}: {cols} columns of int8 x do not fit shared memory")
    if warps is None:
        warps = DEFAULT_WARPS[qtype]
        while warps > 1 and warps * per_warp(nx) > I8_SMEM_LIMIT:
            warps -= 1
    need(1 <= warps <= 32 and warps * per_warp(1) <= I8_SMEM_LIMIT,
         f"{what}: {warps} warps of int8 x with input groups do not fit shared memory")
    per = nx
    while per > 1 and warps * per_warp(per) > I8_SMEM_LIMIT:
        per -= 1
    smem = warps * per_warp(per)
    g = grid or min(ceil_div(groups, warps * I8_GROUP_RUN), blocks_that_fit(rt, 32 * warps, smem, kernel=kernel))
    return g, 32 * warps, smem, per


def _i8_kernel(base: str, n: int) -> str:
    return base + ("_rows" if n > 1 else "")


I8_TYPES = ("Q8_0", "Q4_K")                               # the weight types with int8-activation kernels


def _i8_base(qtype: str, variant: str = "") -> str:
    """gemv_q8_0_i8 / gemv_q4_k_i8 (+ _hc_post / _swiglu): the int8 kernel of a type (checked by _i8_launches)."""
    return _KERNEL.get(qtype, "gemv") + "_i8" + variant


def gemv(rt: Any, outs: Sequence[tuple[DeviceArray, DeviceArray, int]], xin: GemvX, add: bool = False,
         warps: int | None = None, grid: int | None = None, stream: Any = None, pdl: bool = False) -> None:
    """y_m = W_m @ x (y_m += with add) for up to 4 (W_m, y_m, rows_m) of one weight type sharing x (GemvX: its
    rows, input groups, norm prologue and numerics). nx > 1: y_m[n*rows_m:] from x[n], each weight read once for
    all of them, row n's bits the same as alone (nx = 1). warps / grid: the launch geometry (None: the default)."""
    x, cols, nx, x_group_rows, act_quant = xin.x, xin.cols, xin.nx, xin.x_group_rows, xin.act_quant
    need(1 <= len(outs) <= MAX_MATS, f"gemv: 1 to {MAX_MATS} matrices per launch, got {len(outs)}")
    _rows("gemv", nx, None, 0)
    qtype = weight_type(outs[0][0], outs[0][2], cols)
    groups = 0
    for i, (W, y, rows) in enumerate(outs):
        _check_matrix(f"gemv matrix {i}", W, rows, cols, qtype)
        need(is_dtype(y, np.float32) and y.size >= nx * rows,
             f"gemv matrix {i}: y must be float32 with {nx * rows} values")
        groups += ceil_div(rows, GEMV_ROWS)
    need(x_group_rows >= 0 and x_group_rows % GEMV_ROWS == 0,
         f"gemv: x_group_rows ({x_group_rows}) must be a multiple of {GEMV_ROWS}")
    x_groups = max(ceil_div(r, x_group_rows) for _, _, r in outs) if x_group_rows else 0
    suffix, extra, stride = _rows("gemv", nx, xin.x_stride, cols * max(x_groups, 1))
    norm_w, eps, flags = _check_common("gemv", qtype, x, cols, x_groups, xin.norm, nx, stride)
    flags |= ADD if add else 0
    Ws = [o[0] for o in outs] + [None] * (MAX_MATS - len(outs))
    ys = [o[1] for o in outs] + [None] * (MAX_MATS - len(outs))
    rows = [o[2] for o in outs] + [0] * (MAX_MATS - len(outs))
    if act_quant:
        base = _i8_base(qtype, "_grouped" if x_group_rows else "")
        g, b, smem, per = _i8_launches(rt, "gemv", qtype, groups, cols, nx, x_group_rows, warps, grid,
                                       _i8_kernel(base, nx))
        for n0 in range(0, nx, per):
            k = min(per, nx - n0)
            ys_n = [y.view(4 * n0 * r, k * r) if y is not None else None for y, r in zip(ys, rows)]
            extra_n = (k, stride) if k > 1 else ()
            rt.launch(_i8_kernel(base, k), g, b, *Ws, *rows, *ys_n, x.view(4 * n0 * stride, x.size - n0 * stride),
                      cols, x_group_rows, norm_w, eps, flags, *extra_n, smem=smem, stream=stream, pdl=pdl and n0 == 0)
        return
    g, b, smem = _geometry(rt, qtype, groups, warps, grid, _KERNEL[qtype] + suffix)
    rt.launch(_KERNEL[qtype] + suffix, g, b, *Ws, *rows, *ys, x, cols, x_group_rows, norm_w, eps, flags, *extra,
              smem=smem, stream=stream, pdl=pdl)


def gemv_hc_post(rt: Any, W: DeviceArray, xin: GemvX, res: HcResidual, warps: int | None = None,
                 grid: int | None = None, stream: Any = None, pdl: bool = False) -> None:
    """f = W @ x (W [rows = res.dim, xin.cols]), then res.X [hc, D] <- post_k f + sum_j C[j,k] X_j in place (res.mix:
    [pre(hc), post(hc), comb(hc*hc)], cu/mhc.cu's hc_mix output for this sub-layer). nx > 1: rows n of x, of
    X [nx, hc, D] and of mix [nx, (2+hc)*hc]. xin.act_quant: as gemv's."""
    x, cols, nx, x_group_rows, act_quant = xin.x, xin.cols, xin.nx, xin.x_group_rows, xin.act_quant
    X, mix, rows, hc = res.X, res.mix, res.dim, res.hc
    qtype = weight_type(W, rows, cols)
    _check_matrix("gemv_hc_post", W, rows, cols, qtype)
    need(is_dtype(X, np.float32) and X.size == nx * hc * rows,
         f"gemv_hc_post: X must be float32 [{nx}, {hc}, {rows}]" if nx > 1 else
         f"gemv_hc_post: X must be float32 [{hc}, {rows}]")
    need(is_dtype(mix, np.float32) and mix.size >= nx * (2 + hc) * hc,
         f"gemv_hc_post: mix must hold {nx * (2 + hc) * hc} float32")
    need(x_group_rows % GEMV_ROWS == 0, f"gemv_hc_post: x_group_rows must be a multiple of {GEMV_ROWS}")
    x_groups = ceil_div(rows, x_group_rows) if x_group_rows else 0
    suffix, extra, stride = _rows("gemv_hc_post", nx, xin.x_stride, cols * max(x_groups, 1))
    norm_w, eps, flags = _check_common("gemv_hc_post", qtype, x, cols, x_groups, xin.norm, nx, stride)
    if act_quant:
        need(x_group_rows == 0, "gemv_hc_post: int8 activations do not combine with input groups here (round x first)")
        g, b, smem, per = _i8_launches(rt, "gemv_hc_post", qtype, ceil_div(rows, GEMV_ROWS), cols, nx, x_group_rows,
                                       warps, grid, _i8_kernel(_i8_base(qtype, "_hc_post"), nx))
        mrec = (2 + hc) * hc
        for n0 in range(0, nx, per):
            k = min(per, nx - n0)
            rt.launch(_i8_kernel(_i8_base(qtype, "_hc_post"), k), g, b, W, rows, x.view(4 * n0 * stride, x.size - n0 * stride),
                      cols, 0, norm_w, eps, flags, mix.view(4 * n0 * mrec, k * mrec),
                      X.view(4 * n0 * hc * rows, k * hc * rows), *((k, stride) if k > 1 else ()), smem=smem,
                      stream=stream, pdl=pdl and n0 == 0)
        return
    g, b, smem = _geometry(rt, qtype, ceil_div(rows, GEMV_ROWS), warps, grid, _KERNEL[qtype] + "_hc_post" + suffix)
    rt.launch(_KERNEL[qtype] + "_hc_post" + suffix, g, b, W, rows, x, cols, x_group_rows, norm_w, eps, flags, mix, X,
              *extra, smem=smem, stream=stream, pdl=pdl)


def gemv_swiglu(rt: Any, ffn: SwiGlu, xin: GemvX, y: DeviceArray, warps: int | None = None, grid: int | None = None,
                stream: Any = None, pdl: bool = False) -> None:
    """y = silu(min(Wg x, clamp)) * clamp(Wu x, -clamp, clamp) (clamp <= 0: no clamp); Wg, Wu [rows, cols].
    nx > 1: rows n of x (x_stride apart) into y[n*rows:]. No input groups. xin.act_quant: as gemv's."""
    Wg, Wu, rows, x, cols, nx = ffn.gate, ffn.up, ffn.rows, xin.x, xin.cols, xin.nx
    clamp, act_quant = ffn.clamp, xin.act_quant
    need(xin.x_group_rows == 0, "gemv_swiglu: no input groups")
    qtype = weight_type(Wg, rows, cols)
    _check_matrix("gemv_swiglu gate", Wg, rows, cols, qtype)
    _check_matrix("gemv_swiglu up", Wu, rows, cols, qtype)
    need(is_dtype(y, np.float32) and y.size >= nx * rows,
         f"gemv_swiglu: y must be float32 with {nx * rows} values")
    suffix, extra, stride = _rows("gemv_swiglu", nx, xin.x_stride, cols)
    norm_w, eps, flags = _check_common("gemv_swiglu", qtype, x, cols, 0, xin.norm, nx, stride)
    if act_quant:
        g, b, smem, per = _i8_launches(rt, "gemv_swiglu", qtype, ceil_div(rows, 2), cols, nx, 0, warps, grid,
                                       _i8_kernel(_i8_base(qtype, "_swiglu"), nx))
        for n0 in range(0, nx, per):
            k = min(per, nx - n0)
            rt.launch(_i8_kernel(_i8_base(qtype, "_swiglu"), k), g, b, Wg, Wu, rows, y.view(4 * n0 * rows, k * rows),
                      x.view(4 * n0 * stride, x.size - n0 * stride), cols, norm_w, eps, flags, float(clamp),
                      *((k, stride) if k > 1 else ()), smem=smem, stream=stream, pdl=pdl and n0 == 0)
        return
    g, b, smem = _geometry(rt, qtype, ceil_div(rows, 2), warps, grid, _KERNEL[qtype] + "_swiglu" + suffix)
    rt.launch(_KERNEL[qtype] + "_swiglu" + suffix, g, b, Wg, Wu, rows, y, x, cols, norm_w, eps, flags, float(ffn.clamp),
              *extra, smem=smem, stream=stream, pdl=pdl)


def gemv_q8_0(rt: Any, W: DeviceArray, x: DeviceArray, y: DeviceArray, rows: int, cols: int, **kw: Any) -> None:
    """y[rows] = W[rows, cols] @ x[cols], Q8_0 weights (raw uint8 blocks, rows * cols/32 * 34 bytes)."""
    need(weight_type(W) == "Q8_0", "gemv_q8_0: W must be Q8_0 bytes (uint8)")
    gemv(rt, [(W, y, rows)], GemvX(x, cols), **kw)


def gemv_f16(rt: Any, W: DeviceArray, x: DeviceArray, y: DeviceArray, rows: int, cols: int, **kw: Any) -> None:
    """y[rows] = W[rows, cols] @ x[cols], F16 weights."""
    need(weight_type(W) == "F16", "gemv_f16: W must be float16")
    gemv(rt, [(W, y, rows)], GemvX(x, cols), **kw)
