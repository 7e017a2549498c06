"""The GPU time model: a modelled time per kernel of one planned step, and the step's total, from launch geometry,
occupancy, DRAM bytes, coalescing and the SASS instructions per weight. A MODEL, not a measurement: every line it
prints says so, and docs/cuda.md ("The GPU time model") gives its assumptions, their sources and its limits.

    launches = plan_step("v4-flash-q2", "decode", "gb10", ctx=2048).launches      # ds4py/cuda/plan.py
    step = model_step(launches, profile("gb10"), ctx=2048, tokens=1)
    print(format_step(step)); step.to_json()

Per kernel (all times in microseconds):
    t_mem   = bytes / min(copy GB/s x coalescing, bytes in flight / DRAM latency)   (Little's law: a kernel that
              keeps too few bytes in flight cannot reach the copy bandwidth, whatever the bus could carry)
    t_issue = warp instructions / (active SMs x IPC x clock)     (the SASS count per weight x the weights; IPC at
              most the warps resident per SM: one warp issues one instruction per clock)
    t_mma   = tensor FLOPs / (the device's mma.sync rate)        (prefill GEMMs)
    t_floor = DRAM latency                                       (one round trip before the first byte)
    time    = max(t_mem, t_issue, t_mma, t_floor), or t_mem + t_issue for a kernel that stages all its loads
              before any math (cp.async, then wait for all of them: no ring) with one block per SM: nothing
              overlaps its copy
              + t_tail: a last block's serial work after an atomic ticket (tail_us: round trips, Sinkhorn)
              an int8-activation GEMV (quant_prologue) also issues its x quantisation (the SASS count of that loop x
              its passes) and cannot stream past its ring's first pieces until a warp's first quantisation is done:
              time >= that prologue (one warp's passes at its share of the SM's issue) + the rest of its bytes
              + the launch gap (smaller with PDL: the next kernel's launch overlaps this one's tail)
              bytes: less those its pre-wait loads brought in under the previous kernel of its stream, in the DRAM time
              that kernel left free and in the PDL gap (pdl_overlap, prewait_bytes)
A step is its kernels in order, except inside a fork-join region (PlannedLaunch.region: the KV branch, the shared
expert), where the side stream runs beside the main stream: the region takes max(main's time, side's time, both
streams' DRAM time at copy bandwidth, both streams' instructions over the whole device's issue rate) (step_regions).
The limiter is the term that set the time: bandwidth, latency-parallelism, issue, mma, latency floor; a kernel
whose gap is more than half its time is named by `launch gap`.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ds4py.cuda.devices import DeviceProfile

LANE_BYTES = 16           # a kernel with no SASS count: one 16-byte load per lane in flight (assumed)


def _combine_lane_bytes() -> int:
    """attn_decode_combine loads ATTN_COMBINE_SPLITS splits' float2 rows before using any (cu/attention.cu)."""
    from ds4py.cuda.ops.attention import ATTN_COMBINE_SPLITS

    return 8 * ATTN_COMBINE_SPLITS


LANE_BYTES_OF = {"attn_decode_combine": _combine_lane_bytes()}   # ... where the source says more than LANE_BYTES


def lane_bytes(launch: Any) -> int:
    """Bytes one lane keeps in flight in a kernel without a SASS count: LANE_BYTES_OF, moe_route / moe_route_rows
    every logit of its experts (n_experts / 32 floats a lane, loaded before any is scored: cu/router.cu), else
    LANE_BYTES."""
    if launch.kernel in ("moe_route", "moe_route_rows"):
        return 4 * max(1, math.ceil(int(_scalars(launch).get("n_experts", 128)) / 32))
    return LANE_BYTES_OF.get(launch.kernel, LANE_BYTES)

# attn_decode_partial's key-tile loop as nvdisasm counts it on this tree's NVRTC build (sass.attn_tile_counts;
# tests/test_gpu_model.py checks these against a fresh build): the staging loop's instructions and cp.async copies
# per pass, the q.k and p.v loops' instructions per FMUL, the rest of the tile loop (once per tile)
ATTN_TILE_SASS = {
    "sm_90": {"stage": 11, "stage_copies": 1, "qk_per_mul": 2.65625, "pv_per_mul": 2.63671875, "rest": 467},
    "sm_121": {"stage": 27, "stage_copies": 4, "qk_per_mul": 2.46875, "pv_per_mul": 2.734375, "rest": 690},
}


def attn_tile_warp_insns(arch: str, hd: int, threads: int) -> float:
    """Instructions one warp issues per 16-key tile of attn_decode_partial: the staging loop's passes (hd / 4
    16-byte copies per key row over threads / ATTN_TILE threads), q.k (ATTN_HPW x hd / 2 multiplies a lane), p.v
    (2 x ATTN_HPW x ATTN_TILE x ATTN_MAX_HD / 64: its pairs loop is unrolled for the largest head dim, predicated
    below it) and the rest."""
    from ds4py.cuda.ops.attention import ATTN_HPW, ATTN_MAX_HD, ATTN_TILE

    c = ATTN_TILE_SASS.get(arch, ATTN_TILE_SASS["sm_90"])
    passes = math.ceil(hd / 4 / max(1, threads // ATTN_TILE) / c["stage_copies"])
    return (c["rest"] + c["stage"] * passes + c["qk_per_mul"] * ATTN_HPW * hd / 2
            + c["pv_per_mul"] * 2 * ATTN_HPW * ATTN_TILE * ATTN_MAX_HD / 64)


@dataclass(frozen=True)
class Timing:
    """The time model's per-device assumptions (docs/cuda.md "The GPU time model" gives each one's source)."""
    clock_ghz: float          # SM clock under load
    ipc: float                # warp instructions issued per cycle per SM (4 schedulers; an achievable fraction)
    latency_ns: float         # DRAM round trip under load
    gap_us: float             # kernel-to-kernel gap inside a CUDA graph, no PDL
    gap_pdl_us: float         # the same with programmatic dependent launch
    mma_tflops: float         # bf16 mma.sync with fp32 accumulate, dense, achievable
    sm_bytes_per_clk: float = 64.0    # bytes one SM takes in from L2 per cycle


TIMING = {
    "gb10": Timing(clock_ghz=2.4, ipc=2.4, latency_ns=800.0, gap_us=2.5, gap_pdl_us=1.2, mma_tflops=60.0),
    "h200": Timing(clock_ghz=1.98, ipc=2.4, latency_ns=650.0, gap_us=2.0, gap_pdl_us=1.0, mma_tflops=500.0),
}


def timing_for(dev: DeviceProfile) -> Timing:
    return TIMING.get(dev.key) or (TIMING["gb10"] if dev.cc[0] >= 10 else TIMING["h200"])


# ---- formats: weights per byte, from the kernel name's suffix ------------------------------------------------------
def _formats() -> dict[str, tuple[int, int]]:
    """format suffix -> (weights, bytes) per block: the GEMV formats and every expert format of
    cu/moe_formats.cuh (ds4py/cuda/ops/experts.py reads the same list)."""
    from ds4py.cuda.ops.experts import FORMATS, VQ_FORMATS

    out = {"q8_0": (32, 34), "f16": (1, 2), "f32": (1, 4), "q4_k": (256, 144)}
    out.update({name: (qk, nb) for name, qk, nb in FORMATS.values()})
    out.update({name: (qk, nb) for name, (qk, nb, _kc) in VQ_FORMATS.items()})
    return out


_FMT: dict[str, tuple[int, int]] | None = None


def weight_format(kernel: str) -> tuple[str, int, int] | None:
    """(suffix, weights, bytes) per block of the weight format a weight-streaming kernel's name ends with."""
    global _FMT
    if _FMT is None:
        _FMT = _formats()
    base = re.sub(r"_(rows|swiglu|hc_post|i8|grouped)(?=_|$)", "", kernel)
    for suffix in sorted(_FMT, key=len, reverse=True):
        if base.endswith("_" + suffix):
            return (suffix, *_FMT[suffix])
    return None


def family(kernel: str) -> str:
    """The kernel family a report groups by: the GEMV / expert kernels by weight format, the rest by file role."""
    rules = [(r"^gemv_(q8_0|f16|f32|q4_k)", r"gemv \1"), (r"^moe_gate_up(?:_rows)?_i8_(\w+)$", r"experts gate+up \1 int8"),
             (r"^moe_down(?:_rows)?_i8_(\w+)$", r"experts down \1 int8"), (r"^act_round_(\w+)$", r"act_quant rounding \1"), (r"^moe_gate_up_tile_(\w+)$", r"expert tiles gate+up \1"),
             (r"^moe_down_tile_(\w+)$", r"expert tiles down \1"), (r"^moe_gate_up(_rows)?_(\w+)$", r"experts gate+up \2"),
             (r"^moe_down(_rows)?_(\w+)$", r"experts down \2"), (r"^moe_prefill_(gate_up|down)_(\w+)$", r"prefill experts \1 \2"),
             (r"^gemm_(\w+)$", r"gemm \1"), (r"^attn_", "attention"), (r"^prefill_attn", "attention"),
             (r"^indexer_", "indexer"), (r"^compressor_", "compressor"), (r"^(hc_|mhc)", "mHC"),
             (r"^(router|route|moe_route|topk|moe_prefill_route)", "route / top-k"), (r"^(sample|argmax)", "sample"),
             (r"^v41_", "V4.1 extras"), (r"^rmsnorm", "rmsnorm"), (r"^embed", "embed")]
    for pat, rep in rules:
        m = re.match(pat, kernel)
        if m:
            return m.expand(rep)
    return kernel


# ---- bytes -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traffic:
    weight: int               # DRAM bytes of weight tensors the launch streams
    kv: int                   # KV cache / compressed rows / indexer keys it reads at this context
    act: int                  # activations and everything else (each pointer argument's buffer, once)
    weights: int              # weight values (elements) streamed: the SASS count's unit
    rows: int                 # activation rows each weight meets (multi-row steps)
    flops: float              # tensor-core FLOPs (prefill GEMMs), else 0


def _scalars(launch: Any) -> dict[str, Any]:
    return dict(getattr(launch, "scalars", ()) or ())


def _is_weight(arg: Any) -> bool:
    """A weight tensor's bytes (the plan labels them by tensor name); not the KV state ("state.<layer>.<what>"),
    the rope tables ("rope.*"), activations or a null pointer."""
    return bool(arg.label) and arg.label not in ("activation", "null") \
        and not arg.label.startswith(("state.", "rope."))


def n_rows_written(kernel: str) -> int:
    """Rows a window-ring store writes per launch (attn_kv_store: the step's one row; 0: not a ring store)."""
    return 1 if kernel in ("attn_kv_store", "v41_kv_rows") else 0


def group_step_traffic(launch: Any) -> tuple[int, int, int] | None:
    """(weight, kv, act) DRAM bytes per decode token of a compressor launch (None: not one), the per-token average:
    the work every step does plus 1/ratio of the once-per-group emission. compressor_decode (cu/compressor.cu) stores
    its position's kv / score + ape[pos % ratio] into one ring slot every step and only at a position completing a
    group pools the group's ratio*(1+overlap) slots (d channels of kv and score each), normalises and writes one row;
    v41_compress (grid = rows, one position each) does nothing at a row that completes no group, else pools `ratio`
    slots (ratio 1: the row itself) and writes a row and the latent; v41_index_keys the same for one key row;
    v41_comp_ring_store writes its n_rows rows into each ring (not the rings)."""
    k, s = launch.kernel, _scalars(launch)
    by = {a.name: a for a in launch.args}
    has = lambda name: name in by and by[name].nbytes > 0                   # noqa: E731
    if k == "compressor_decode":
        ratio, ov, d, rd = int(s["ratio"]), int(s["overlap"]), int(s["d"]), int(s["rd"])
        width = (1 + ov) * d
        ape_b = 4 if int(s.get("ape_f32", 0)) else 2
        store = (width * ape_b, 2 * width * 4, 2 * width * 4)        # ape row; ring slots written; kv_in + sc_in
        emit = (d * 4, ratio * (1 + ov) * d * 8 + d * 4, rd // 2 * 4)  # norm; group kv+score, the row; freqs
        return tuple(a + math.ceil(b / ratio) for a, b in zip(store, emit))   # type: ignore[return-value]
    if k == "v41_compress":
        ratio, d, rd, n = max(1, int(s["ratio"])), int(s["d"]), int(s["rd"]), launch.grid[0]
        slots = ratio * (2 if has("sc_in") else 1)
        lat = d * 4 if has("lat") else 0
        emit = (d * 4, slots * d * 4 + d * 4, rd // 2 * 4 + lat)     # norm; group (+ the row) ; freqs + latent
        return tuple(math.ceil(n * b / ratio) for b in emit)         # type: ignore[return-value]
    if k == "v41_index_keys":
        ratio, ihd, rd, n = max(1, int(s["ratio"])), int(s["ihd"]), int(s["rd"]), launch.grid[0]
        emit = (ihd * 4, ihd * 4, ihd * 4 + rd // 2 * 4)             # k_norm; key row written; k_raw row + freqs
        return tuple(math.ceil(n * b / ratio) for b in emit)         # type: ignore[return-value]
    if k == "v41_comp_ring_store":
        n, cap, d = int(s["n_rows"]), int(s["cap"]), int(s["d"])
        return (0, 2 * min(n, cap) * d * 4, 2 * n * d * 4)
    return None


def expected_work_items(pairs: int, n_experts: int, bm: int | None = None) -> float:
    """Work items of cu/moe_prefill.cu's route under uniform routing: sum over experts of E[ceil(c_e / bm)], c_e
    ~ Binomial(pairs, 1 / n_experts) (an expert with more than bm = MOEP_BM pairs gets one item per bm of them)."""
    if bm is None:
        from ds4py.cuda.ops.moe_prefill import BM as bm
    p = 1.0 / max(1, n_experts)
    if p >= 1.0:
        return float(math.ceil(pairs / bm))
    logq, logp = math.log1p(-p), math.log(p)
    mean, sd = pairs * p, math.sqrt(pairs * p * (1 - p))
    lo, hi = max(1, int(mean - 12 * sd)), min(pairs, int(mean + 12 * sd) + 1)
    items = 0.0
    for c in range(lo, hi + 1):
        logpmf = math.lgamma(pairs + 1) - math.lgamma(c + 1) - math.lgamma(pairs - c + 1) + c * logp + (pairs - c) * logq
        items += math.exp(logpmf) * math.ceil(c / bm)
    return n_experts * items


def launch_traffic(launch: Any, ctx: int) -> Traffic:
    """DRAM bytes of one planned launch (ds4py/cuda/plan_runtime.PlannedLaunch) at context `ctx`.

    Every pointer argument's buffer counts once, except: a stacked expert tensor counts only the experts the launch
    reads (its slots of n_experts; a multi-row launch grouped by expert: the expected distinct experts of its
    pairs under uniform routing; moe_down_rows: every row's slots, as it stages them per row); a lookup table
    (embedding, hash routing) the tokens' rows; a row store (an output `X` with a scalar `X_cap`, or the window
    ring of attn_kv_store / v41_kv_rows) one row; the attention window ring min(ctx, window) rows, its compressed rows top-k
    (with a selection `sel`: V4's ratio 4, V4.1's 2 and 1) or ctx / ratio (V4's ratio 128); the indexer keys ctx / ratio rows. A GEMV's activation rows come from its
    `nx` (multi-row steps)."""
    k, s = launch.kernel, _scalars(launch)
    weight = kv = act = 0
    n_experts = max(1, int(s.get("n_experts", 1)))
    experts_read = 1.0                     # matrices of a stacked expert tensor the launch streams
    rows = int(s.get("nx", s.get("n_rows", 1)) or 1)
    if k.startswith(("moe_gate_up_tile_", "moe_down_tile_")):
        pairs = next((a.nbytes // (4 * int(s["ff"])) for a in launch.args if a.name == "H"), 1)   # H [P, ff]
        experts_read = expected_work_items(pairs, n_experts)    # each work item reads its expert's rows once
        rows = max(1, round(pairs / experts_read))
    elif k.startswith("moe_gate_up_rows") or (k.startswith("moe_down_rows") and "n_pairs" in s):
        pairs = int(s.get("n_pairs", 1))   # grouped by expert: each distinct expert once (uniform routing)
        experts_read = n_experts * (1.0 - (1.0 - 1.0 / n_experts) ** pairs)
        rows = max(1, round(pairs / experts_read))
    elif k.startswith("moe_down_rows"):
        experts_read = launch.grid[1] * int(s.get("n_slots", 1))   # per activation row: its slots' experts
    elif k.startswith("moe_gate_up"):
        experts_read = launch.grid[1]
    elif k.startswith("moe_down"):
        experts_read = int(s.get("n_slots", 1))
    tokens = next((a.nbytes // 4 for a in launch.args if a.name in ("ids", "token") and a.nbytes), 1)
    selected = any(a.name == "sel" and a.nbytes > 0 for a in launch.args)
    for a in launch.args:
        n = int(a.nbytes)
        if n <= 0:
            continue
        if _is_weight(a):
            if "_exps" in a.label and k.startswith(("moe_gate_up", "moe_down")):
                n = int(n * experts_read / n_experts)     # moe_down_rows may read an expert once per row
            elif a.name in ("table", "tid2eid") and "vocab" in s:      # a lookup: the tokens' rows only
                n = n // int(s["vocab"]) * tokens
            weight += n
        elif k == "attn_decode_partial" and a.name in ("win", "comp"):
            row = 4 * int(s.get("hd", 512))
            if a.name == "win":
                kv += min(ctx, int(s.get("window", ctx)), n // row) * row
            elif int(s.get("ratio", 0)) > 0 and selected:           # the indexer's / candidates' top-k rows
                kv += min(int(s.get("topk", 512)), ctx // int(s["ratio"])) * row
            elif int(s.get("ratio", 0)) > 0:
                kv += min(ctx // int(s["ratio"]), n // row) * row
        elif k.startswith("indexer_scores") and a.name == "keys":
            row = 4 * int(s.get("ihd", 128))
            kv += min(ctx // max(1, int(s.get("ratio", 4))), n // row) * row
        elif not a.const and f"{a.name}_cap" in s and int(s[f"{a.name}_cap"]) > 0:
            act += n // int(s[f"{a.name}_cap"])                   # a row store: one row written per step
        elif not a.const and int(s.get("ring", 0)) > 0 and n_rows_written(k):
            kv += n // int(s["ring"]) * n_rows_written(k)         # the window ring: its new rows written
        elif a.label.startswith("state."):
            kv += n                                               # other KV state a kernel reads (rings, rows)
        else:
            act += n
    group = group_step_traffic(launch)
    if group is not None:
        weight, kv, act = group
    fmt = weight_format(k)
    weights = weight * fmt[1] // fmt[2] if fmt else 0
    flops = 0.0
    if k.startswith("gemm_") and "T" in s:
        flops = 2.0 * s["T"] * s["N"] * s["K"]
        rows = int(s["T"])
    elif k.startswith("moe_prefill_") and fmt:
        # pairs from H [P, ff] (gate + up writes it, down reads it; only gate + up has `sorted`); a block runs a
        # whole BM-row work item (expected_work_items: padded rows count: the staging, `rows`), its warps' MMAs
        # WARP_ROWS rows at a time, skipping a warp whose rows are all padding (an expert's c pairs: 16 ceil(c / 16)
        # MMA rows), and each weight x activation product as sass.mma_pieces MMA multiply-adds (VQ-8: x in three
        # bf16 pieces, F16: the weight in two)
        from ds4py.cuda.ops.moe_prefill import BM, WARP_ROWS
        from ds4py.cuda.sass import mma_pieces

        ff = int(s.get("ff", 0))
        pairs = next((a.nbytes // (4 * ff) for a in launch.args if a.name == "H" and ff), 0)
        per_expert = weights / n_experts
        items = expected_work_items(pairs, n_experts) if pairs else 0.0
        rows = max(1, round(BM * items / n_experts))
        mma_rows = WARP_ROWS * expected_work_items(pairs, n_experts, WARP_ROWS) / n_experts if pairs else 0.0
        flops = 2.0 * mma_rows * n_experts * per_expert * mma_pieces(k)
    return Traffic(weight, kv, act, weights, rows, flops)


# ---- last-block tails ------------------------------------------------------------------------------------------
def _hc_of(nrows: int) -> int:
    """hc from an mHC mix's fn rows: (2 + hc) * hc (a sub-layer's) or hc (the head's)."""
    return next((h for h in (1, 2, 4, 8, 16) if (2 + h) * h == nrows), nrows)


# One Sinkhorn round on one warp (cu/mhc.cu, hc_mix's last block): its dependent chain is a row sum, a division, a
# column sum, a division. SINKHORN_ROUND: the round's shuffle rounds (runs of shuffles issued back to back: one
# shuffle latency each) and IEEE divisions as nvdisasm counts them (sass.sinkhorn_round; tests/test_gpu_model.py
# checks them against a fresh build); the latencies are estimates, not counts: a shuffle ~25 cycles (+ 2 to issue
# the run's other shuffles at hc 4), a division ~40 (MUFU.RCP and its 5 dependent FFMA). Until branch s6h200 the
# sums were xor butterflies, 4 dependent shuffles a round: 180 cycles.
SINKHORN_ROUND = {"sm_90": {"shuffle_rounds": 2, "divisions": 2}, "sm_121": {"shuffle_rounds": 2, "divisions": 2}}
SHUFFLE_CYCLES, DIVISION_CYCLES = 25 + 2, 40
SINKHORN_ROUND_CYCLES = (SINKHORN_ROUND["sm_90"]["shuffle_rounds"] * SHUFFLE_CYCLES
                         + SINKHORN_ROUND["sm_90"]["divisions"] * DIVISION_CYCLES)


def tail_us(launch: Any, t: Timing) -> float:
    """The serial work a launch's last block does after the grid's (an atomic ticket), which the grid-wide terms
    (bytes over all blocks' loads in flight) miss. hc_mix: one DRAM round trip for the fence + ticket, one for the
    chunk partials (staged in one pass), the Sinkhorn rounds of a sub-layer's mix (iters x SINKHORN_ROUND_CYCLES),
    and with a collapse (y given) its x / w pass(es) after the first (a thread keeps 4 columns' loads in flight: a
    pass covers 4 x threads columns; the first pass is loaded right after the ticket, under the partials' round
    trip; more than one pass re-reads y to normalise: one round trip more). 0: no tail."""
    if not launch.kernel.startswith("hc_mix"):
        return 0.0
    s = _scalars(launch)
    nrows = int(s.get("nrows", 0))
    hc = _hc_of(nrows)
    trips = 2
    y = next((a for a in launch.args if a.name == "y"), None)
    if y is not None and y.nbytes > 0:
        D = int(s.get("n", 0)) // hc
        passes = math.ceil(D / (4 * max(1, launch.block[0] * launch.block[1] * launch.block[2])))
        trips += (passes - 1) + (1 if passes > 1 else 0)
    sinkhorn = int(s.get("iters", 0)) * SINKHORN_ROUND_CYCLES / (t.clock_ghz * 1e3) if nrows == (2 + hc) * hc else 0.0
    return trips * t.latency_ns / 1e3 + sinkhorn


# ---- one kernel --------------------------------------------------------------------------------------------------
@dataclass
class KernelTime:
    index: int
    kernel: str
    family: str
    stream: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    registers: int
    blocks_per_sm: int
    occupancy_limiter: str
    waves: float
    weight_bytes: int
    kv_bytes: int
    act_bytes: int
    coalescing: float
    coalescing_source: str    # "assumed" (100%) or "traffic" (the emulator's traffic profile)
    inflight_bytes: int       # bytes in flight on the whole device (Little's law)
    instr_per_weight: float | None    # warp instructions per weight value (SASS count), None: not a streaming kernel
    t_mem_us: float
    t_issue_us: float
    t_mma_us: float
    t_floor_us: float
    t_gap_us: float
    time_us: float
    limiter: str
    refused: str | None
    t_tail_us: float = 0.0    # a last block's serial work after the grid's (tail_us)
    region: int = -1          # its fork-join region (-1: none)
    t_dram_us: float = 0.0    # its bytes at the copy bandwidth x coalescing: the DRAM time it takes from the device
    t_issue_dev_us: float = 0.0   # its warp instructions at the whole device's issue rate (all SMs x IPC)
    prefetched_bytes: int = 0     # weight bytes loaded before pdl_wait under the previous kernel (pdl_overlap)

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.act_bytes


def moe_prefill_ring(kernel: str) -> int:
    """Dynamic shared memory of a moe_prefill_{gate_up,down}_<fmt> kernel's weight sector ring (both buffers;
    ops/moe_prefill.weight_ring_bytes: at 13 bits the per-row windows), 0 for other kernels."""
    m = re.fullmatch(r"moe_prefill_(gate_up|down)_(\w+)", kernel)
    if not m:
        return 0
    from ds4py.cuda.ops.experts import FORMATS, VQ_FORMATS
    from ds4py.cuda.ops.moe_prefill import weight_ring_bytes

    fmt = m.group(2)
    qtype: int | str | None = fmt if fmt in VQ_FORMATS else next(
        (int(q) for q in FORMATS if q.name.lower() == fmt), None)
    return weight_ring_bytes(qtype, 2 if m.group(1) == "gate_up" else 1) if qtype is not None else 0


def _inflight(launch: Any, loop: Any, active_sms: int, blocks_here: int) -> int:
    """Bytes in flight on the device: per block, a cp.async stage (the dynamic shared memory: every load issued
    before the wait) or, for direct loads, each warp's loads of one loop pass (the SASS count's global bytes x 32
    lanes; LANE_BYTES per lane when unknown)."""
    warps = max(1, math.ceil(launch.block[0] * launch.block[1] * launch.block[2] / 32))
    ring = moe_prefill_ring(launch.kernel)
    if loop is not None and loop.async_copy and loop.pipelined and ring:
        # the grouped tensor-core GEMMs' sector ring: one chunk (half the ring) in flight while the block decodes
        # and multiplies the other, beside the activation tile's direct loads of the pass
        per_block = ring // 2 + warps * 32 * loop.ldg_bytes
    elif loop is not None and loop.async_copy and launch.smem > 0:
        per_block = launch.smem
    else:
        per_lane = loop.ldg_bytes if loop is not None and loop.ldg_bytes else lane_bytes(launch)
        per_block = warps * 32 * per_lane
    return active_sms * blocks_here * per_block


@dataclass(frozen=True)
class Prologue:
    warp_insns: float         # the launch's warp instructions quantising x (all warps, all quantisations)
    first_insns: float        # one warp's instructions before its first dot: its share of the first quantisation


def quant_prologue(launch: Any, loop: Any) -> Prologue | None:
    """The x quantisation of an int8-activation GEMV (cu/gemv.cu; LoopCount.prologue: instructions of one pass of
    its loop, prologue_values the values a warp quantises per pass), None for other kernels. Ungrouped
    (gemv_i8_quantise, gemv_q8k_quantise): every block quantises all nx x cols values, its warps sharing the passes;
    grouped (gemv_q8_0_i8_grouped*: gemv_i8_quantise_warp): each warp alone quantises a group's nx x cols values at
    every x group its run of row groups enters (runs of ceil(row groups / warps) groups of GEMV_ROWS rows). The
    warps' RMS of x (a norm prologue's warp_norm_den loop: each warp reads x once) is not counted."""
    from ds4py.cuda.ops.gemv import GEMV_ROWS

    if loop is None or not getattr(loop, "prologue", 0) or not loop.prologue_values:
        return None
    s = _scalars(launch)
    cols, nx, xgr = int(s.get("cols", 0)), int(s.get("nx", 1) or 1), int(s.get("x_group_rows", 0) or 0)
    warps = max(1, math.ceil(launch.block[0] * launch.block[1] * launch.block[2] / 32))
    blocks = launch.grid[0] * launch.grid[1] * launch.grid[2]
    passes = math.ceil(nx * cols / loop.prologue_values)        # one quantisation of x (or of one x group)
    if not xgr:
        per_warp = math.ceil(passes / warps)                     # a warp without a pass skips the loop
        return Prologue(blocks * passes * loop.prologue, per_warp * loop.prologue)
    rows = sum(int(v) for k, v in s.items() if re.fullmatch(r"rows\d?", k))
    groups = math.ceil(rows / GEMV_ROWS)
    nwarps = blocks * warps
    run = math.ceil(groups / nwarps)
    quantisations = 0
    for w in range(nwarps):
        g0, g1 = w * run, min(groups, (w + 1) * run)
        if g0 < g1:
            quantisations += (GEMV_ROWS * (g1 - 1)) // xgr - (GEMV_ROWS * g0) // xgr + 1
    return Prologue(quantisations * passes * loop.prologue, passes * loop.prologue)


@dataclass(frozen=True)
class TileChain:
    time_us: float            # the launch's blocks' serial chains, wave after wave
    t_issue_us: float         # the instruction part of it
    t_issue_dev_us: float     # all its warp instructions at the whole device's issue rate
    inflight: int             # bytes in flight on the device (one staged tile per resident block)


def attn_tile_chain(launch: Any, dev: DeviceProfile, t: Timing, tr: Traffic, here: int) -> TileChain | None:
    """attn_decode_partial as the hardware runs it: each block stages one 16-key tile with cp.async, waits for
    all of it, then its warps do the tile's q.k and p.v for their heads, tile after tile (no ring). A block's time
    is one DRAM round trip for its queries, then per tile a round trip, the tile's bytes through the SM's L2 intake
    and the tile's instructions (attn_tile_warp_insns) at one instruction per clock per warp, shared when an SM
    holds more warps than its issue rate; the grid runs in waves of resident blocks. Only the blocks of the
    longest split (keys_per_split keys, at most the keys visible at this context) count: the others finish
    earlier."""
    from ds4py.cuda.ops.attention import ATTN_TILE

    s = _scalars(launch)
    hd, kps = int(s.get("hd", 512)), int(s.get("keys_per_split", ATTN_TILE))
    keys = tr.kv // (4 * hd) if hd else 0
    tiles = max(1, math.ceil(min(kps, max(keys, 1)) / ATTN_TILE))
    warps = max(1, math.ceil(launch.threads / 32))
    per_tile = attn_tile_warp_insns(dev.arch, hd, launch.threads)
    blocks = launch.grid[0] * launch.grid[1] * launch.grid[2]
    waves = math.ceil(blocks / max(1, dev.sm_count * max(1, launch.occupancy.blocks_per_sm)))
    share = min(1.0, t.ipc / max(1, here * warps))             # a warp's part of its SM's issue slots
    lat = t.latency_ns / 1e3
    tile_bytes = ATTN_TILE * hd * 4
    intake = tile_bytes / (t.sm_bytes_per_clk * t.clock_ghz * 1e3)
    issue = tiles * per_tile / (t.clock_ghz * 1e3 * share)
    block = lat + tiles * (lat + intake) + issue
    all_insns = blocks * warps * tiles * per_tile
    return TileChain(waves * block, waves * issue, all_insns / (dev.sm_count * t.ipc * t.clock_ghz * 1e3),
                     min(blocks, dev.sm_count * here) * tile_bytes)


# ---- PDL: weights loaded before pdl_wait under the previous kernel ---------------------------------------------------
_GEMV_TYPE = re.compile(r"^gemv_(q8_0|f16|f32|q4_k)")
_PIECE = {"f16": 16 * 256, "f32": 32 * 32, "q4_k": 144 * 8}      # bytes of one row's staged piece (ops/gemv DEFINES)


def prewait_bytes(launch: Any, tr: Traffic) -> int:
    """Weight bytes one block of a launch issues before its pdl_wait (cu/gemv.cu; the traffic report's
    pre_pdl_bytes show it per kernel): every warp of a Q8_0 GEMV (gemv_q8_0*, the int8 ones too) its first
    Q8_STAGES - 1 ring items, of a staged F16 / F32 / Q4_K GEMV (gemv_staged, gemv_q4_k_i8*) its first item; an
    item is GEMV_ROWS rows x one piece (a chunk of a row, or the whole row when shorter); at most the block's share
    of the launch's weights; hc_mix_* (cu/mhc.cu) its chunk of fn, every 128-byte line prefetched into L2 before
    the wait; moe_route / moe_route_rows (cu/router.cu) the bias. 0 for every other kernel: they wait before
    their first weight load (the routed experts need the router's ids); the shared expert's early stage and
    VQ-8's codebook copies are not counted."""
    from ds4py.cuda.ops.gemv import DEFINES, GEMV_ROWS, Q8_0_BLOCK_BYTES

    blocks = launch.grid[0] * launch.grid[1] * launch.grid[2]
    if not tr.weight or not blocks:
        return 0
    if launch.kernel.startswith("hc_mix_"):
        return math.ceil(tr.weight / blocks)
    if launch.kernel in ("moe_route", "moe_route_rows"):              # the bias (route_bias), not tid2eid's rows
        return sum(int(a.nbytes) for a in launch.args if a.name == "bias")
    m = _GEMV_TYPE.match(launch.kernel)
    if not m:
        return 0
    cols = int(_scalars(launch).get("cols", 0))
    _, qk, nb = weight_format(launch.kernel) or ("", 1, 1)
    row = cols * nb // qk if cols else tr.weight                  # bytes of one weight row
    piece = DEFINES["Q8_CHUNK_BLOCKS"] * Q8_0_BLOCK_BYTES if m.group(1) == "q8_0" else _PIECE[m.group(1)]
    items = DEFINES["Q8_STAGES"] - 1 if m.group(1) == "q8_0" else 1
    warps = max(1, math.ceil(launch.threads / 32))
    per_block = warps * items * GEMV_ROWS * min(piece, row)
    return min(per_block, math.ceil(tr.weight / blocks))


def _fits_beside(dev: DeviceProfile, a: Any, b: Any, a_here: int) -> int:
    """Blocks of launch b one SM holds beside a_here resident blocks of launch a (threads, registers, shared
    memory and block slots, as devices.occupancy counts them), at most b's own occupancy."""
    from ds4py.cuda.devices import regs_per_warp, smem_per_block

    wa, wb = max(1, math.ceil(a.threads / 32)), max(1, math.ceil(b.threads / 32))
    room = {"warps": (dev.warps_per_sm - a_here * wa) // wb,
            "registers": (dev.regs_per_sm - a_here * wa * regs_per_warp(dev, a.registers))
            // (wb * regs_per_warp(dev, b.registers)),
            "shared memory": (dev.smem_per_sm - a_here * smem_per_block(dev, a.smem + a.static_smem))
            // smem_per_block(dev, b.smem + b.static_smem),
            "blocks": dev.max_blocks_per_sm - a_here}
    return max(0, min(min(room.values()), b.occupancy.blocks_per_sm))


def pdl_overlap(launches: Sequence[Any], ks: Sequence["KernelTime"], dev: DeviceProfile, t: Timing) -> dict[int, int]:
    """{position: weight bytes} each PDL launch's loads before pdl_wait bring in before it passes the wait. Every
    kernel here calls pdl_launch_dependents right after its own pdl_wait, so the next kernel of its stream launches
    while it runs: its blocks that fit beside the running kernel's resident blocks (and all of its first wave once
    that kernel's blocks retire) issue their pre-wait weight loads and wait (CUDA Programming Guide, "Programmatic
    Dependent Launch and Synchronization": the secondary kernel's preamble overlaps the primary's execution;
    griddepcontrol.wait then waits for the primary's completion and memory flush). Those bytes stream (a) in the
    DRAM time the previous kernel leaves free (its modelled time less its gap and its bytes at the copy bandwidth:
    a latency-bound tail, an issue-bound loop) and (b) during the launch's own PDL gap, each at the launch's own
    rate; at most what its resident blocks issue before the wait (prewait_bytes)."""
    out: dict[int, int] = {}
    prev: dict[str, int] = {}
    for i, (b, kb) in enumerate(zip(launches, ks)):
        j = prev.get(b.stream)
        prev[b.stream] = i
        if j is None or not b.pdl or kb.t_mem_us <= 0:
            continue
        per_block = prewait_bytes(b, launch_traffic_cached(b, kb))
        if not per_block:
            continue
        a, ka = launches[j], ks[j]
        rate = kb.bytes / kb.t_mem_us                               # bytes per µs the launch streams at
        a_blocks = a.grid[0] * a.grid[1] * a.grid[2]
        a_active = min(dev.sm_count, a_blocks)
        a_here = min(max(1, a.occupancy.blocks_per_sm), math.ceil(a_blocks / dev.sm_count))
        b_blocks = b.grid[0] * b.grid[1] * b.grid[2]
        beside = min(b_blocks, a_active * _fits_beside(dev, a, b, a_here)
                     + (dev.sm_count - a_active) * max(1, b.occupancy.blocks_per_sm))
        first_wave = min(b_blocks, dev.sm_count * max(1, b.occupancy.blocks_per_sm))
        free_us = max(0.0, ka.time_us - ka.t_gap_us - ka.t_dram_us)
        under_a = min(beside * per_block, free_us * rate)
        got = min(first_wave * per_block, under_a + kb.t_gap_us * rate, kb.weight_bytes)
        if got > 0:
            out[i] = int(got)
    return out


def launch_traffic_cached(launch: Any, k: "KernelTime") -> Traffic:
    """The launch's traffic as its KernelTime recorded it (weight bytes; what prewait_bytes needs)."""
    return Traffic(k.weight_bytes, k.kv_bytes, k.act_bytes, 0, 1, 0.0)


def model_kernel(launch: Any, dev: DeviceProfile, ctx: int, loops: dict | None = None,
                 coalescing: dict[str, float] | None = None, timing: Timing | None = None,
                 prefetched: int = 0) -> KernelTime:
    """The modelled time of one planned launch on `dev` (see the module doc for the formulas). loops: the SASS
    table's rows for dev's arch ({kernel: LoopCount}); coalescing: {kernel: efficiency 0..1} from a traffic
    profile (missing: 1.0, labelled assumed); prefetched: weight bytes its loads issued before pdl_wait brought in
    under the previous kernel and the launch gap (pdl_overlap), no longer in its memory time."""
    t = timing or timing_for(dev)
    loop = (loops or {}).get(launch.kernel)
    tr = launch_traffic(launch, ctx)
    occ = launch.occupancy
    bpsm = max(1, occ.blocks_per_sm)
    blocks = launch.grid[0] * launch.grid[1] * launch.grid[2]
    active = min(dev.sm_count, blocks)
    here = min(bpsm, math.ceil(blocks / dev.sm_count))          # blocks resident per active SM
    coal = (coalescing or {}).get(launch.kernel)
    coal_src = "traffic" if coal is not None else "assumed"
    coal = min(1.0, max(0.01, coal if coal is not None else 1.0))
    nbytes = tr.weight + tr.kv + tr.act
    inflight = _inflight(launch, loop, active, here)
    chain = attn_tile_chain(launch, dev, t, tr, here) if launch.kernel == "attn_decode_partial" else None
    if chain is not None:
        inflight = chain.inflight
    # bytes per microsecond: the copy bandwidth, or what the active SMs can take in (a grid of few blocks)
    bw = min(dev.copy_gbps * 1e3, active * t.sm_bytes_per_clk * t.clock_ghz * 1e3) * coal
    little = inflight / (t.latency_ns / 1e3)                      # bytes per microsecond Little's law allows
    t_mem = max(0, nbytes - prefetched) / min(bw, little) if nbytes else 0.0
    instr = None
    t_issue = t_issue_dev = 0.0
    t_dram = nbytes / (dev.copy_gbps * 1e3 * coal) if nbytes else 0.0
    pro = quant_prologue(launch, loop)
    t_pro = 0.0
    if loop is not None and tr.weights:
        instr = loop.per_product / 32.0                            # warp instructions per product
        warp_insns = tr.weights * tr.rows * instr + (pro.warp_insns if pro else 0.0)
        t_issue_dev = warp_insns / (dev.sm_count * t.ipc * t.clock_ghz * 1e3)
        # a warp issues at most one instruction per clock: an SM holding fewer warps than the IPC cannot reach it
        warps_here = here * max(1, math.ceil(launch.block[0] * launch.block[1] * launch.block[2] / 32))
        t_issue = warp_insns / (active * min(t.ipc, warps_here) * t.clock_ghz * 1e3)
        if pro:
            # a warp's first quantisation, at its share of the SM's issue slots; meanwhile only the ring's first
            # pieces (issued before pdl_wait: the bytes in flight) stream, the rest after it
            t_pro = pro.first_insns / (t.clock_ghz * 1e3 * min(1.0, t.ipc / warps_here))
            t_pro += max(0, nbytes - inflight) / min(bw, little) if nbytes else 0.0
    t_mma = tr.flops / (t.mma_tflops * 1e6) if tr.flops else 0.0
    t_floor = t.latency_ns / 1e3
    gap = t.gap_pdl_us if launch.pdl else t.gap_us
    serial = loop is not None and loop.async_copy and not loop.pipelined and here == 1
    terms = {"bandwidth" if bw <= little else "latency-parallelism": t_mem, "issue": t_issue, "mma": t_mma,
             "latency floor": t_floor, "x quantisation": t_pro}
    if chain is not None:
        t_issue, t_issue_dev = chain.t_issue_us, chain.t_issue_dev_us
        terms = {"bandwidth": t_mem, "tile chain": chain.time_us}
        limiter = max(terms, key=terms.get)
        body = terms[limiter]
    elif serial and t_issue > 0:
        body, limiter = t_mem + t_issue, "stage-then-compute"
    else:
        limiter = max(terms, key=terms.get)
        body = terms[limiter]
    t_tail = tail_us(launch, t)
    if t_tail > body:
        limiter = "last-block tail"
    body += t_tail
    if gap > body:
        limiter = "launch gap"
    return KernelTime(launch.index, launch.kernel, family(launch.kernel), launch.stream, tuple(launch.grid),
                      tuple(launch.block), launch.smem + launch.static_smem, launch.registers, occ.blocks_per_sm,
                      occ.limiter, round(launch.waves, 3), tr.weight, tr.kv, tr.act, coal, coal_src, inflight,
                      instr, t_mem, t_issue, t_mma, t_floor, gap, body + gap, limiter, launch.problem, t_tail,
                      int(getattr(launch, "region", -1)), t_dram, t_issue_dev, prefetched)


# ---- a step ----------------------------------------------------------------------------------------------------------
@dataclass
class StepModel:
    device: str
    shapes: str
    step: str                 # decode / verify / prefill
    ctx: int
    tokens: int               # tokens the step produces or consumes (1, verify rows, prefill block)
    kernels: list[KernelTime]
    copy_gbps: float
    nominal_gbps: float
    notes: list[str] = field(default_factory=list)

    @property
    def serial_time_us(self) -> float:
        """Every kernel one after the other (the side stream not overlapped: an upper bound)."""
        return sum(k.time_us for k in self.kernels)

    @property
    def time_us(self) -> float:
        """The step: kernels outside fork-join regions in order, each region its overlapped time."""
        return sum(k.time_us for k in self.kernels if k.region < 0) + sum(r["time_us"] for r in self.regions())

    def regions(self) -> list[dict]:
        """Per fork-join region: its streams' times and the overlapped time (step_regions)."""
        return step_regions(self.kernels)

    @property
    def weight_kv_bytes(self) -> int:
        return sum(k.weight_bytes + k.kv_bytes for k in self.kernels)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.time_us / 1e6) if self.time_us else 0.0

    def fraction(self, gbps: float) -> float:
        return self.weight_kv_bytes / (self.time_us * 1e3) / gbps if self.time_us else 0.0

    @property
    def refused(self) -> list[KernelTime]:
        return [k for k in self.kernels if k.refused]

    def families(self) -> list[dict]:
        """Per family: launches, bytes, modelled µs, the share of the step, the bandwidth it reaches (of copy)
        and its most common limiter; slowest first."""
        out: dict[str, dict] = {}
        for k in self.kernels:
            f = out.setdefault(k.family, {"family": k.family, "launches": 0, "bytes": 0, "time_us": 0.0, "lim": {}})
            f["launches"] += 1
            f["bytes"] += k.bytes
            f["time_us"] += k.time_us
            f["lim"][k.limiter] = f["lim"].get(k.limiter, 0.0) + k.time_us
        rows = []
        for f in out.values():
            lim = f.pop("lim")
            f["limiter"] = max(lim, key=lim.get)
            f["share"] = f["time_us"] / self.serial_time_us if self.serial_time_us else 0.0
            f["fraction_of_copy"] = f["bytes"] / (f["time_us"] * 1e3) / self.copy_gbps if f["time_us"] else 0.0
            rows.append(f)
        return sorted(rows, key=lambda f: -f["time_us"])

    def to_json(self) -> dict:
        return {"model": "ds4py GPU time model (a model, not a measurement; docs/cuda.md)",
                "device": self.device, "shapes": self.shapes, "step": self.step, "ctx": self.ctx,
                "tokens": self.tokens, "time_us": self.time_us, "serial_time_us": self.serial_time_us,
                "modelled_tokens_per_s": self.tokens_per_s,
                "weight_kv_bytes": self.weight_kv_bytes,
                "fraction_of_copy": self.fraction(self.copy_gbps),
                "fraction_of_roofline": self.fraction(self.nominal_gbps),
                "copy_gbps": self.copy_gbps, "nominal_gbps": self.nominal_gbps,
                "refused_launches": len(self.refused), "notes": self.notes,
                "families": self.families(),
                "kernels": [asdict(k) for k in self.kernels]}


def model_step(launches: Sequence[Any], dev: DeviceProfile, ctx: int, tokens: int = 1, shapes: str = "",
               step: str = "decode", loops: dict | None = None, coalescing: dict[str, float] | None = None,
               timing: Timing | None = None) -> StepModel:
    """Every planned launch of one step modelled in order, each PDL launch less the weight bytes its pre-wait loads
    brought in under the previous kernel of its stream (pdl_overlap); StepModel.time_us overlaps the fork-join
    regions (step_regions)."""
    if loops is None:
        from ds4py.cuda.sass import load_table

        loops = load_table().get(dev.arch, {})
    ks = [model_kernel(l, dev, ctx, loops, coalescing, timing) for l in launches]
    for i, got in pdl_overlap(launches, ks, dev, timing or timing_for(dev)).items():
        ks[i] = model_kernel(launches[i], dev, ctx, loops, coalescing, timing, prefetched=got)
    notes = []
    if not loops:
        notes.append("no SASS inner-loop table for this arch: issue time not modelled")
    if any(k.coalescing_source == "assumed" for k in ks):
        notes.append("coalescing assumed 100% where no traffic profile gives it")
    return StepModel(dev.key, shapes, step, ctx, tokens, ks, dev.copy_gbps, dev.nominal_gbps, notes)


def step_regions(kernels: Sequence[KernelTime]) -> list[dict]:
    """Each fork-join region's modelled time. Between a fork and its join the two streams' kernels are independent
    (graph branches), so the device runs them at once, sharing its DRAM and its SMs' issue slots: the region takes
    max(the main stream's kernels in order, the side stream's in order, both streams' bytes at copy bandwidth,
    both streams' instructions at the whole device's issue rate). Each stream's own time keeps its launch gaps and
    latency-bound tails; the shared terms assume the block scheduler places the side kernel's blocks beside the
    main kernel's (a lower bound where one kernel's blocks fill every SM's shared memory, docs/cuda.md)."""
    out: dict[int, dict] = {}
    for k in kernels:
        if k.region < 0:
            continue
        r = out.setdefault(k.region, {"region": k.region, "main_us": 0.0, "side_us": 0.0, "dram_us": 0.0,
                                      "issue_us": 0.0, "launches": 0})
        r["main_us" if k.stream != "side" else "side_us"] += k.time_us
        r["dram_us"] += k.t_dram_us
        r["issue_us"] += k.t_issue_dev_us
        r["launches"] += 1
    rows = []
    for r in out.values():
        terms = {"main": r["main_us"], "side": r["side_us"], "dram": r["dram_us"], "issue": r["issue_us"]}
        r["limiter"] = max(terms, key=terms.get)
        r["time_us"] = terms[r["limiter"]]
        rows.append(r)
    return sorted(rows, key=lambda r: r["region"])


# ---- the report ------------------------------------------------------------------------------------------------------
def format_step(m: StepModel, top: int = 12) -> str:
    """The report: a summary line and the slowest kernel families, every line labelled `model`."""
    L = [f"model | {m.device} {m.shapes} {m.step} ctx {m.ctx}: {len(m.kernels)} launches, "
         f"{m.time_us / 1e3:.2f} ms per step, {m.tokens_per_s:,.1f} tokens/s, "
         f"{m.weight_kv_bytes / 1e9:.3f} GB weights + KV, {100 * m.fraction(m.copy_gbps):.1f}% of copy "
         f"({m.copy_gbps:g} GB/s), {100 * m.fraction(m.nominal_gbps):.1f}% of roofline ({m.nominal_gbps:g} GB/s), "
         f"{len(m.refused)} refused launches"]
    if m.serial_time_us - m.time_us > 0.05:
        L.append(f"model |   side stream beside the main stream in {len(m.regions())} fork-join regions: "
                 f"{(m.serial_time_us - m.time_us) / 1e3:.2f} ms less than the kernels one after another "
                 f"({m.serial_time_us / 1e3:.2f} ms; family times below are the kernels' own)")
    L.append(f"model |   {'family':28} {'launches':>8} {'MB':>9} {'µs':>9} {'share':>6} {'of copy':>7}  limiter")
    for f in m.families()[:top]:
        L.append(f"model |   {f['family'][:28]:28} {f['launches']:8d} {f['bytes'] / 1e6:9.2f} {f['time_us']:9.1f} "
                 f"{100 * f['share']:5.1f}% {100 * f['fraction_of_copy']:6.1f}%  {f['limiter']}")
    for k in m.refused[:5]:
        L.append(f"model |   REFUSED: {k.refused}")
    for n in m.notes:
        L.append(f"model |   note: {n}")
    return "\n".join(L) + "\n"


def format_kernels(m: StepModel, limit: int | None = None) -> str:
    """One line per launch (the detail behind format_step), labelled `model`."""
    L = [f"model | {'#':>4} {'kernel':28} {'grid':>14} {'blk':>4} {'B/SM':>4} {'MB':>8} {'coal':>5} "
         f"{'ins/w':>6} {'mem':>7} {'issue':>7} {'floor':>6} {'gap':>5} {'µs':>8}  limiter"]
    for k in m.kernels[:limit]:
        ipw = f"{k.instr_per_weight:6.3f}" if k.instr_per_weight is not None else "     -"
        g = "x".join(str(v) for v in k.grid if v > 1) or "1"
        L.append(f"model | {k.index:4d} {k.kernel[:28]:28} {g:>14} {k.block[0]:4d} {k.blocks_per_sm:4d} "
                 f"{k.bytes / 1e6:8.3f} {100 * k.coalescing:4.0f}% {ipw} {k.t_mem_us:7.1f} {k.t_issue_us:7.1f} "
                 f"{k.t_floor_us:6.1f} {k.t_gap_us:5.1f} {k.time_us:8.1f}  {k.limiter}")
    return "\n".join(L) + "\n"


def summarize(models: Iterable[StepModel]) -> dict:
    return {f"{m.step}@{m.ctx}": m.to_json() for m in models}


# ---- coalescing from the emulator's traffic profile ---------------------------------------------------------------
TRAFFIC_REPORT = Path(__file__).resolve().parents[2] / "bench" / "traffic" / "report.json"


def coalescing_from_report(report: dict) -> dict[str, float]:
    """{kernel: DRAM sector efficiency of its loads} from a traffic report (ds4py-traffic-v1, `python3 -m
    ds4py.cuda.traffic`, the emulator's count per warp request at the twin tests' shapes): a kernel's entry from the
    report's `model_width` section where it has one (GEMVs at 4096 columns), else from `kernels`; per read argument
    its `largest_launch` (the nearest to the model's shapes) where given, else its sums; the argument's
    `dram_efficiency` (its bytes over the 32-byte sectors it touches at all: what DRAM moves) or, without one, its
    request `coalescing`. Arguments combine weighted by bytes (sectors = bytes / efficiency), so a 4-byte table read
    does not set the efficiency of a kernel streaming megabytes."""
    out: dict[str, float] = {}
    wide = ((report.get("model_width") or {}).get("kernels") or {})
    for name, k in (report.get("kernels") or {}).items():
        k = wide.get(name, k)
        nbytes = sectors = 0.0
        for arg in (k.get("args") or {}).values():
            ll = arg.get("largest_launch") or {}
            eff = ll.get("dram_efficiency", arg.get("dram_efficiency"))
            eff = eff if eff is not None else ll.get("coalescing", arg.get("coalescing"))
            size = ll.get("arg_bytes") or arg.get("distinct_bytes") or arg.get("arg_bytes") or 0
            if eff and size and (arg.get("requests") or ll.get("requests")):
                nbytes += size
                sectors += size / eff
        if sectors:
            out[name] = min(1.0, nbytes / sectors)
    return out


def load_coalescing(path: Path | str | None = None) -> dict[str, float] | None:
    """The traffic report's coalescing per kernel (path, or bench/traffic/report.json when it exists), else None."""
    import json

    p = Path(path) if path else TRAFFIC_REPORT
    if not p.is_file():
        if path:
            from ds4py.errors import Ds4Error

            raise Ds4Error(f"no traffic report at {p} (python3 -m ds4py.cuda.traffic --out {p} writes one)")
        return None
    try:
        return coalescing_from_report(json.loads(p.read_text()))
    except (ValueError, AttributeError) as e:
        from ds4py.errors import Ds4Error

        raise Ds4Error(f"{p} is not a traffic report ({e})") from None


# ---- numerics ----------------------------------------------------------------------------------------------------
# "exact" (Numerics(), the engine's default) or "act_quant" (Numerics.ds4(): int8 activations): plan.plan_step
# records the step as the engine runs it in those numerics (the act_round launches before the quantised dense
# products, the int8 expert kernels, a block's experts on the int8 grouped rows kernels).
NUMERICS = ("exact", "act_quant")


# ---- the bench: every step of one device x shapes ---------------------------------------------------------------
DEFAULT_CTX = (2048, 65536)
VERIFY_ROWS = 4
PREFILL_BLOCK = 2048


DRAFT_ROWS = (1, 2)               # an MTP draft step of one row (a chained draft), of two (a first draft catching up)


def run(device: str, shapes: str, ctxs: Sequence[int] = DEFAULT_CTX, coalescing: dict[str, float] | None = None,
        steps: Sequence[str] = ("decode", "rows", "prefill", "draft"), numerics: str = "exact",
        verify_rows: Sequence[int] = (VERIFY_ROWS,)) -> list[StepModel]:
    """Decode at each ctx, a verify step of each of `verify_rows` rows (VERIFY_ROWS by default), a
    PREFILL_BLOCK-token prefill block and an MTP draft step of each of DRAFT_ROWS rows at the first ctx (at least
    one block long for the prefill), planned by ds4py/cuda/plan.py and modelled on `device`. numerics "act_quant":
    the steps of the engine under Numerics.ds4() (plan_step's numerics), named "<step> act_quant"."""
    if numerics not in NUMERICS:
        from ds4py.errors import Ds4Error

        raise Ds4Error(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    from ds4py.cuda.devices import profile
    from ds4py.cuda.plan import plan_step, shapes as shapes_of

    dev = profile(device)
    shapes_of(shapes)
    if coalescing is None:
        coalescing = load_coalescing()
    out = []
    for kind in steps:
        per_kind = {"decode": [(c, 1) for c in ctxs], "rows": [(ctxs[0], r) for r in verify_rows],
                    "draft": [(ctxs[0], r) for r in DRAFT_ROWS]}.get(kind, [(ctxs[0], 1)])
        for ctx, rows in per_kind:
            c = max(ctx, PREFILL_BLOCK) if kind == "prefill" else ctx
            launches = plan_step(shapes, kind, dev.key, ctx=c, rows=rows, block=PREFILL_BLOCK, numerics=numerics)
            tokens = {"decode": 1, "rows": rows, "draft": rows, "prefill": min(PREFILL_BLOCK, c)}[kind]
            name = {"decode": "decode", "rows": f"verify {rows} rows", "prefill": f"prefill {tokens}",
                    "draft": f"mtp draft {rows} row{'s' if rows > 1 else ''}"}[kind]
            if numerics == "act_quant":
                name = f"{name} act_quant"
            out.append(model_step(launches, dev, c, tokens, shapes, name, coalescing=coalescing))
    return out


@dataclass(frozen=True)
class SpecStepTimes:
    """The modelled step times (µs) a speculative round is made of, on one device at one shapes' layout: a plain
    decode step, a verify of r rows (r = 1 + k drafts) and the MTP draft step of one and of two rows (a chained
    draft; a first draft that also catches up one pending row)."""
    device: str
    shapes: str
    ctx: int
    decode_us: float
    verify_us: dict[int, float]
    draft_us: dict[int, float]


def spec_step_times(device: str, shapes: str, ctx: int = DEFAULT_CTX[0], k_max: int = 4,
                    coalescing: dict[str, float] | None = None) -> SpecStepTimes:
    """decode, verify(2 .. k_max + 1) and the MTP draft of 1 and 2 rows at `ctx`, modelled (run)."""
    models = run(device, shapes, (ctx,), coalescing, steps=("decode", "rows", "draft"),
                 verify_rows=tuple(range(2, k_max + 2)))
    by = {m.step: m.time_us for m in models}
    return SpecStepTimes(device, shapes, ctx, by["decode"], {r: by[f"verify {r} rows"] for r in range(2, k_max + 2)},
                         {r: by[f"mtp draft {r} row{'s' if r > 1 else ''}"] for r in DRAFT_ROWS})


def bench_json(models: Sequence[StepModel], act_quant: Sequence[StepModel] = ()) -> dict:
    """The `bench gpu-model --json` document: the first decode step's fields at the top level (device, shapes,
    ctx, modelled_tokens_per_s, fraction_of_copy, fraction_of_roofline, refused_launches, kernels), every step
    under `steps`; the act_quant numerics' steps (run(numerics="act_quant"): decode) under `act_quant`."""
    head = models[0].to_json()
    head["refused_launches"] = sum(len(m.refused) for m in [*models, *act_quant])
    head["steps"] = [{k: v for k, v in m.to_json().items() if k != "kernels"} for m in models]
    head["act_quant"] = [{k: v for k, v in m.to_json().items() if k != "kernels"} for m in act_quant]
    return head
