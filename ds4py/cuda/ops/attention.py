"""Host wrappers of cu/attention.cu: shape checks and the launch geometry each kernel's comment documents.

`rt` is a Runtime (GPU) or an emulator runtime: anything with `launch(name, grid, block, *args, smem=, stream=,
pdl=)`. Arrays are DeviceArrays (or numpy arrays under emulation): only .shape/.size/.dtype (and .ptr when present)
are read. The decode position is read by the kernels from `pos_slot` (an int32 device scalar), so a captured
graph replays unchanged; only shapes and the bucket's key capacity are fixed at capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.ops.core import aligned, is_dtype, need

ATTN_TILE = 16                 # keys staged per tile
ATTN_HPW = 4                   # heads per warp
ATTN_MAX_HD = 512              # largest head dim
ATTN_COMBINE_SPLITS = 16       # splits' rows a combine thread loads before using any (16 float2: H200 keeps 2 MB
                               # in flight over a head per block; 8 left a ratio-4 layer's combine latency-bound)
DEFINES = {"ATTN_TILE": ATTN_TILE, "ATTN_HPW": ATTN_HPW, "ATTN_MAX_HD": ATTN_MAX_HD,
           "ATTN_COMBINE_SPLITS": ATTN_COMBINE_SPLITS}                                  # -D values of cu/attention.cu


def pair_threads(dim: int) -> int:
    """Block size of the one-pair-per-thread kernels: 32 * ceil(dim / 64)."""
    return 32 * (-(-dim // 64))


@dataclass(frozen=True)
class KvRow:
    """How one layer makes its kv (or key) rows, the same for every call: RMSNorm weight [hd], RoPE freqs [rd/2],
    shapes and numerics (fake_quant: the FP8 / FP4 round trip; round_f16: the f16 kv cache's rounding)."""
    norm_w: Any
    freqs: Any
    hd: int
    rd: int
    eps: float
    fake_quant: bool = True
    round_f16: bool = False


def kv_store(rt: Any, kr: KvRow, kv_raw: Any, pos_slot: Any, win: Any, stream: Any = None,
             pdl: bool = False) -> None:
    """win[pos % ring] = FP8(RoPE(RMSNorm(kv_raw; norm_w))) for the decode position in pos_slot."""
    norm_w, freqs, hd, rd = kr.norm_w, kr.freqs, kr.hd, kr.rd
    need(hd % 2 == 0 and rd % 2 == 0 and 0 < rd <= hd and (hd - rd) % 64 == 0,
         f"attn_kv_store: head dim {hd} with {rd} rope dims needs even sizes and a non-rope part in blocks of 64")
    need(kv_raw.size == hd and norm_w.size == hd and freqs.size == rd // 2,
         f"attn_kv_store: kv ({kv_raw.size}), norm ({norm_w.size}) or freqs ({freqs.size}) do not match hd {hd}")
    need(len(win.shape) == 2 and win.shape[1] == hd, f"attn_kv_store: window ring shape {tuple(win.shape)} is not "
         f"[ring, {hd}]")
    need(all(is_dtype(a, np.float32) for a in (kv_raw, norm_w, freqs, win))
         and is_dtype(pos_slot, np.int32),
         "attn_kv_store: float32 arrays and an int32 position slot expected")
    need(aligned(8, kv_raw, norm_w, win), "attn_kv_store: kv, norm weight and ring must be 8-byte aligned")
    rt.launch("attn_kv_store", 1, pair_threads(hd), kv_raw, norm_w, freqs, pos_slot, win, int(win.shape[0]), hd,
              rd, float(kr.eps), int(kr.fake_quant), int(kr.round_f16), stream=stream, pdl=pdl)


@dataclass(frozen=True)
class AttnPlan:
    """Launch plan of one decode attention for a key capacity (window + most compressed rows of the bucket)."""
    n_heads: int
    hd: int
    splits: int                # key chunks = blocks along x; part_o is [n_heads, splits, hd]
    keys_per_split: int        # a multiple of ATTN_TILE
    warps: int                 # warps per block (each holds ATTN_HPW heads)

    @property
    def head_groups(self) -> int:
        return -(-self.n_heads // (ATTN_HPW * self.warps))

    @property
    def smem(self) -> int:
        return (ATTN_TILE * (self.hd + 4) + self.warps * ATTN_HPW * (self.hd + ATTN_TILE)) * 4

    @property
    def part_o_shape(self) -> tuple[int, int, int]:
        return (self.n_heads, self.splits, self.hd)

    @property
    def part_ml_shape(self) -> tuple[int, int, int]:
        return (self.n_heads, self.splits, 2)


def attn_plan(n_heads: int, hd: int, max_keys: int, warps: int = 4, target_blocks: int = 264,
              min_tiles: int = 2) -> AttnPlan:
    """Split max_keys into chunks so that splits x head groups is about target_blocks (two per SM of an H200):
    enough blocks to spread a short key list over the device, each with at least min_tiles tiles of keys (a block's
    q preparation and its partial row are worth amortising over a few tiles). warps: 4 by default (16 heads share
    one staged key tile): at hd 512 the tile's shared memory allows one block per GB10 SM, so the warps of that
    block are all the loads it has in flight (2 warps halved them and staged every tile twice as often)."""
    need(hd % 8 == 0 and 0 < hd <= ATTN_MAX_HD, f"attention: head dim {hd} must be a multiple of 8 up to "
         f"{ATTN_MAX_HD}")
    need(1 <= warps <= 32 and n_heads >= 1 and max_keys >= 1, "attention: bad heads, warps or key capacity")
    warps = min(warps, -(-n_heads // ATTN_HPW))
    groups = -(-n_heads // (ATTN_HPW * warps))
    tiles = -(-max_keys // ATTN_TILE)
    splits = max(1, min(-(-tiles // max(1, min_tiles)), -(-target_blocks // groups)))
    kps = ATTN_TILE * -(-tiles // splits)
    return AttnPlan(n_heads, hd, -(-max_keys // kps), kps, warps)


def attn_warps(profile: Any, n_heads: int, hd: int) -> int:
    """Warps per attention block on `profile` (a DeviceProfile, or None: 4, the plan with the most splits, which
    sizes the workspace's partials): 2 where two 2-warp blocks fit on an SM (H200: more blocks over its 132 SMs), 4
    where the staged key tile leaves room for one block per SM only (GB10 at hd 512: that block's warps are all the
    SM's loads in flight, and one tile then serves 16 heads), if the 4-warp block fits the device."""
    if profile is None:
        return 4
    from ds4py.cuda import resources
    from ds4py.cuda.devices import occupancy
    res = resources.kernel(profile.arch, "attn_decode_partial")
    regs, static = (res.registers, res.smem) if res else (0, 0)
    two = occupancy(profile, 64, regs, attn_plan(n_heads, hd, ATTN_TILE, warps=2).smem + static)
    four_smem = attn_plan(n_heads, hd, ATTN_TILE, warps=4).smem + static
    return 2 if two.blocks_per_sm >= 2 or four_smem > profile.smem_per_block_optin else 4


@dataclass(frozen=True)
class AttnGeometry:
    """How a device splits decode attention: warps per block, the fewest key tiles per block, the blocks aimed at."""
    warps: int
    min_tiles: int
    target_blocks: int


DEFAULT_GEOMETRY = AttnGeometry(4, 2, 264)
MAX_TARGET_BLOCKS = 1024       # the most blocks any geometry aims at (the workspace's partials hold its splits)


def attn_geometry(profile: Any, n_heads: int, hd: int) -> AttnGeometry:
    """The decode attention geometry on `profile` (None: DEFAULT_GEOMETRY). Where 2-warp blocks fit several to an
    SM (H200), one tile per block and one wave of resident blocks: a block stages a tile, then its warps compute it
    at one instruction per clock each (~6K instructions per warp and tile, the SASS count), so a block's serial
    chain of tiles, not the bytes, sets the time; more blocks of fewer tiles shorten it until the SMs' issue slots
    fill. Where one block fills an SM (GB10 at hd 512), 4 warps and 2 tiles per block (DEFAULT_GEOMETRY)."""
    warps = attn_warps(profile, n_heads, hd)
    if profile is None or warps == DEFAULT_GEOMETRY.warps:
        return DEFAULT_GEOMETRY
    from ds4py.cuda import resources
    from ds4py.cuda.devices import occupancy
    res = resources.kernel(profile.arch, "attn_decode_partial")
    regs, static = (res.registers, res.smem) if res else (0, 0)
    occ = occupancy(profile, 32 * warps, regs, attn_plan(n_heads, hd, ATTN_TILE, warps=warps).smem + static)
    return AttnGeometry(warps, 1, min(MAX_TARGET_BLOCKS, max(1, occ.blocks_per_sm) * profile.sm_count))


def geometry_plan(geometry: AttnGeometry, n_heads: int, hd: int, max_keys: int) -> AttnPlan:
    return attn_plan(n_heads, hd, max_keys, warps=geometry.warps, target_blocks=geometry.target_blocks,
                     min_tiles=geometry.min_tiles)


def workspace_plans(n_heads: int, hd: int, max_keys: int) -> list[AttnPlan]:
    """The plans whose partials the workspace must hold: the default geometry's and the most splits a
    one-tile geometry can ask for (2 warps, MAX_TARGET_BLOCKS)."""
    return [geometry_plan(g, n_heads, hd, max_keys)
            for g in (DEFAULT_GEOMETRY, AttnGeometry(2, 1, MAX_TARGET_BLOCKS))]


@dataclass(frozen=True)
class AttnLayer:
    """What one layer's attention is, the same for every call: its per-layer arrays (RoPE freqs [rd/2], sinks
    [H]) and shapes (the head dim is the ring's width)."""
    freqs: Any
    sinks: Any
    n_heads: int
    rope_dim: int
    window: int                # window rows a query sees (the ring holds at least these)
    eps: float
    scale: float
    q_norm: bool = True        # the per-head RMS of the queries (V4; V4.1 has none)


@dataclass(frozen=True)
class AttnKeys:
    """Where one call's keys come from: the window ring [rows, hd], the compressed rows (ratio 0: none) and the
    selection sel (None: every visible compressed row; else int32 [rows, topk], the indexer's picks)."""
    ring: Any
    comp: Any = None
    ratio: int = 0
    sel: Any = None
    topk: int = 0


@dataclass(frozen=True)
class DecodeBuffers:
    """One decode attention's per-call arrays: the query [H, hd], the int32 position slot, the split partials
    (part_o [H, splits, hd], part_ml [H, splits, 2]) and the output [H, hd]."""
    q_raw: Any
    pos_slot: Any
    part_o: Any
    part_ml: Any
    out: Any


def decode_attention(rt: Any, plan: AttnPlan, layer: AttnLayer, keys: AttnKeys, buf: DecodeBuffers,
                     stream: Any = None, pdl: bool = False, combine_pdl: bool | None = None) -> None:
    """out [H, hd] = attention of the decode query over window + compressed rows (two launches). combine_pdl: the
    combine's PDL flag (None: pdl); its only dependency is the partial on the same stream, so it may take PDL where
    the partial, first after a join, may not.

    The key count at the step's position must not exceed the plan's capacity: min(pos+1, window) + the visible
    compressed rows (ratio 128, sel None) or min(visible, topk) (ratio 4, sel = the indexer's indices)."""
    H, hd = plan.n_heads, plan.hd
    win, comp, ratio, sel, topk, window = keys.ring, keys.comp, keys.ratio, keys.sel, keys.topk, layer.window
    q_raw, part_o, part_ml, out = buf.q_raw, buf.part_o, buf.part_ml, buf.out
    rd, freqs, sinks = layer.rope_dim, layer.freqs, layer.sinks
    need(q_raw.size == H * hd and out.size == H * hd, f"attention: q or out is not [{H}, {hd}]")
    need(len(win.shape) == 2 and win.shape[1] == hd and win.shape[0] >= window >= 1,
         f"attention: window ring {tuple(win.shape)} must be [>= {window}, {hd}]")
    need(ratio >= 0 and (ratio == 0 or (comp is not None and comp.shape[-1] == hd)),
         "attention: a compressed layer needs its compressed rows [n, hd]")
    need(sel is None or (ratio > 0 and is_dtype(sel, np.int32) and sel.size >= topk >= 1),
         "attention: sel must be int32 indices with room for topk")
    need(freqs.size == rd // 2 and (hd - rd) % 2 == 0 and sinks.size == H, "attention: freqs or sinks mismatch")
    need(tuple(part_o.shape) == plan.part_o_shape and tuple(part_ml.shape) == plan.part_ml_shape,
         f"attention: partial buffers must be {plan.part_o_shape} and {plan.part_ml_shape}")
    need(aligned(16, q_raw, win, comp, part_o), "attention: q, ring, rows and partials must be 16-byte aligned")
    comp_arg = comp if comp is not None else win          # never read when ratio == 0
    rt.launch("attn_decode_partial", (plan.splits, plan.head_groups), 32 * plan.warps, q_raw, freqs, buf.pos_slot,
              win, int(win.shape[0]), int(window), comp_arg, int(ratio), sel, int(topk), part_o, part_ml, H, hd, rd,
              plan.keys_per_split, float(layer.eps), float(layer.scale), int(layer.q_norm), smem=plan.smem,
              stream=stream, pdl=pdl)
    rt.launch("attn_decode_combine", H, pair_threads(hd), part_o, part_ml, sinks, freqs, buf.pos_slot, out, hd, rd,
              plan.splits, stream=stream, pdl=pdl if combine_pdl is None else combine_pdl)
