"""A static count of each weight-streaming kernel's SASS inner loop, from the cubins NVRTC builds.

NVIDIA's `nvdisasm` (the PyPI wheel nvidia-cuda-nvdisasm, a dev / test tool: the `test` extra) disassembles a
cubin; this module finds each kernel's innermost weight loop and counts its instructions by class. The result is
committed as a generated table (ds4py/data/gpu_sass_loops.json, written by `python -m ds4py.cuda.sass --write`)
so that the time model (ds4py/cuda/timemodel.py) runs without NVRTC or nvdisasm; tests/test_cuda_compile.py checks
the table against the build it already makes.

The loop: the body of a backward branch (a BRA whose target is at or before it), less the loops nested in it. Of
the loops that load data (global or shared loads) and multiply (FFMA / FMUL / HFMA2 / HMUL2 / integer dot products
DP4A), the densest in products; the straight-line code outside every loop where a kernel's work is fully unrolled
there (inner_loop gives the rule); for a tensor-core GEMM (moe_prefill_*) the loop with the most HMMA, its
nested loops at one pass each (mma_loop), products = the HMMA multiply-adds one lane does (64 per HMMA.16816) per product (mma_pieces: bf16 pieces). Its
`products` (one FFMA or FMUL, two per HFMA2 / HMUL2, four per DP4A / IDP) stand for the weights it consumes: each
weight of a GEMV meets its activation in one multiply (with --fmad=false a multiply-add is FMUL + FADD: one
product). The loop is chosen by its multiplies; its products are the weight products only (weight_products: not a
block scale times its sum, nor x times the RMSNorm weight or a scale decoded before it meets a weight, followed
through the registers; until branch s7sass they counted, and H200's gemv_q8_0 was charged 4.94 instructions per
weight where it issues 7.41). A predicated multiply still issues: it stays an instruction of the loop.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "data" / "gpu_sass_loops.json"
# the kernels whose inner loop streams weights (decode GEMVs and expert products, single- and multi-row)
# and the prefill experts' grouped tensor-core GEMMs (moe_prefill_{gate_up,down}_<fmt>: their k-tile MMA loop)
STREAMING = re.compile(r"^(gemv_|moe_gate_up_|moe_down_|moe_prefill_gate_up_|moe_prefill_down_)")
# multiply-adds one lane's share of a warp MMA does: m x n x k / 32 (HMMA.16816: 16 x 8 x 16 / 32 = 64)
_MMA_SHAPE = re.compile(r"^HMMA\.(16)(8)(8|16|32)\b")

CLASSES = {
    "memory": re.compile(r"^(LDG|LDS|LDSM|LD|LDGSTS|LDGDEPBAR|STG|STS|ST|ATOM|RED|LDC|LDCU|ULDC|CCTL|LDL|STL)\b"),
    "fma": re.compile(r"^(FFMA|FMUL|FADD|FMNMX|HFMA2|HMUL2|HADD2|DFMA|DMUL|DADD|FSETP|FSEL|MUFU|FCHK|DP4A|IDP|"
                      r"HMMA|IMMA|FMUL2|FFMA2|FADD2)\b"),
    "convert": re.compile(r"^(I2F|F2I|F2F|I2FP|F2FP|HADD2\.F32|PRMT|I2I)\b"),
    "integer": re.compile(r"^(IMAD|IADD|IADD3|IADD32I|LEA|LOP|LOP3|SHF|SHL|SHR|ISETP|IMNMX|VIMNMX|SEL|MOV|IABS|"
                          r"UIADD3|UIMAD|ULEA|ULOP3|USHF|UMOV|USEL|UISETP|BMSK|SGXT|POPC|FLO|BFE|BFI|R2UR|S2R|"
                          r"S2UR|CS2R|P2R|R2P|PLOP3|UPLOP3|VIADD|IMUL|IMNMX|VIADDMNMX|UPRMT|IDX)\b"),
    "control": re.compile(r"^(BRA|BSYNC|BSSY|WARPSYNC|BAR|EXIT|RET|CALL|YIELD|NOP|SHFL|VOTE|DEPBAR|MEMBAR|"
                          r"WARPGROUP|ACQBULK|PREEXIT|ERRBAR|BRX|JMP|NANOSLEEP|UBLKCP|SYNCS)\b"),
}
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_FUNC = re.compile(r"^\.text\.([A-Za-z_]\w*):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


class SassUnavailableError(RuntimeError):
    """nvdisasm (pip install nvidia-cuda-nvdisasm) is not installed."""


@dataclass(frozen=True)
class LoopCount:
    """One kernel's inner weight loop: instructions per iteration by class, and the products (weights) it does."""
    kernel: str
    instructions: int
    memory: int
    fma: int
    convert: int
    integer: int
    control: int
    other: int
    products: int
    ldg_bytes: int = 0        # bytes one thread loads from global memory per pass of the region (LDG widths)
    async_copy: bool = False  # the kernel stages with cp.async (LDGSTS): its loads are in flight before its math
    pipelined: bool = False   # it waits for its cp.async groups with some left in flight (DEPBAR.LE SB0, n > 0):
                              # a ring whose next tile loads while this one computes
    prologue: int = 0         # int8-activation GEMVs: instructions (one thread) of one pass of the loop that
    prologue_values: int = 0  # quantises x into shared memory, and the x values one pass quantises per warp
                              # (quant_loop; 0: none)

    @property
    def per_product(self) -> float:
        """Instructions (one thread) per product: a warp issues this many instructions per 32 weights."""
        return self.instructions / max(self.products, 1)


def nvdisasm() -> str:
    """The nvdisasm executable: on PATH, or inside the nvidia-cuda-nvdisasm wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        nvidia = None
    for root in list(getattr(nvidia, "__path__", [])):
        for sub in ("cu13", "cu12", "cuda_nvdisasm"):
            p = Path(root) / sub / "bin" / "nvdisasm"
            if p.is_file():
                return str(p)
    raise SassUnavailableError("nvdisasm is not installed (pip install nvidia-cuda-nvdisasm, in the test extra)")


def disassemble(cubin: bytes) -> dict[str, list[tuple[int, str, str, str]]]:
    """{function: [(address, opcode, operands, label_before_or_'')]} of every function in a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([nvdisasm(), "-c", f.name], capture_output=True, text=True, check=True).stdout
    funcs: dict[str, list[tuple[int, str, str, str]]] = {}
    cur, label = None, ""
    for line in out.splitlines():
        m = _FUNC.match(line.strip())
        if m:
            cur, label = funcs.setdefault(m.group(1), []), ""
            continue
        m = _LABEL.match(line.strip())
        if m:
            label = m.group(1)
            continue
        m = _INSN.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(3), m.group(4), label))
            label = ""
    return funcs


def classify(opcode: str) -> str:
    for name, pat in CLASSES.items():
        if pat.match(opcode):
            return name
    return "other"


def _products(opcode: str, operands: str = "") -> int:
    """Weight x activation multiplies one instruction does. Not counted: a square (both factors the same register:
    the RMS of x in a norm prologue) and HFMA2 / FFMA on RZ (ptxas's idiom for moving a constant)."""
    base = opcode.split(".")[0]
    n = {"FFMA": 1, "FMUL": 1, "DFMA": 1, "DMUL": 1, "HFMA2": 2, "HMUL2": 2, "FFMA2": 2, "FMUL2": 2,
         "DP4A": 4, "IDP": 4}.get(base, 0)
    if n and operands:
        ops = [o.strip().lstrip("-|").split(".")[0] for o in operands.split(",")]
        a, b = (ops[1], ops[2]) if len(ops) >= 3 else ("", "")
        if a == b or "RZ" in (a, b):
            return 0
    return n


def mma_products(opcode: str) -> int:
    """Multiply-adds one lane's share of a tensor-core MMA does (HMMA.16816: 64, HMMA.1688: 32), 0 otherwise."""
    m = _MMA_SHAPE.match(opcode)
    return int(m.group(1)) * int(m.group(2)) * int(m.group(3)) // 32 if m else 0


def mma_loop(kernel: str, insns: list[tuple[int, str, str, str]]) -> LoopCount | None:
    """A tensor-core GEMM's weight loop (moe_prefill_*): the loop whose own body holds the most HMMA (the k-tile
    loop: stage the tile's weights and activations into shared memory, barrier, MMAs), counted over its whole span
    once with the loops nested in it (the staging / decode loops) at one pass each, less the nested loops that
    issue cp.async (the ring's fill: once per chunk of k tiles, at a chunk boundary): a lower bound of a pass's
    instructions. Its products are the HMMA multiply-adds one lane does
    (mma_products); the decode's scale multiplies (FFMA / FMUL) are not products here. Pipelined: a cp.async
    issued after a wait for all groups (DEPBAR.LE SB0, 0x0) within the loop (cu/moe_prefill.cu moep_ring_step:
    wait for chunk c, issue chunk c + 1, compute chunk c) or a wait with some groups left in flight."""
    spans = loops(insns)

    def own_mma(a: int, b: int) -> int:
        nested = [(x, y) for x, y in spans if (x, y) != (a, b) and a <= x and y <= b]
        return sum(mma_products(insns[i][1]) for i in range(a, b + 1) if not any(c <= i <= d for c, d in nested))

    best = max(spans, key=lambda sp: (own_mma(*sp), -(sp[1] - sp[0])), default=None)
    if best is None or own_mma(*best) == 0:
        return None
    span = insns[best[0]:best[1] + 1]
    staged = any(op.startswith("LDGSTS") for _, op, _, _ in span)
    # the ring's fill loops (nested loops that issue cp.async) run once per chunk of k tiles, not every pass
    fills = [(x, y) for x, y in spans if best[0] <= x and y <= best[1] and (x, y) != best
             and any(insns[i][1].startswith("LDGSTS") for i in range(x, y + 1))]
    body = [insns[i] for i in range(best[0], best[1] + 1) if not any(x <= i <= y for x, y in fills)]
    waits = [i for i, (_, op, o, _) in enumerate(span) if op.startswith("DEPBAR")]
    ring = staged and (any(re.search(r"SB0,\s*0x[1-9a-f]", span[i][2]) for i in waits)
                       or any(op.startswith("LDGSTS") and i > min(waits) for i, (_, op, _, _) in enumerate(span)
                              if waits))
    c = _count(kernel, body, staged, ring)
    return replace(c, products=sum(mma_products(op) for _, op, _, _ in body) // mma_pieces(kernel))


def mma_pieces(kernel: str) -> int:
    """MMA multiply-adds per weight x activation product of a moe_prefill_* kernel (cu/moe_prefill.cu): VQ-8's
    activations go in as three bf16 pieces (ops/moe_prefill.x_pieces: exact), F16's weights as two; else one."""
    from ds4py.cuda.ops.moe_prefill import x_pieces

    fmt = kernel.rsplit("_", 1)[-1]
    return x_pieces(fmt) if re.fullmatch(r"vq\d+", fmt) else 2 if fmt == "f16" else 1


def loops(insns: list[tuple[int, str, str, str]]) -> list[tuple[int, int]]:
    """(first index, branch index) of every backward branch's body."""
    at = {lab: i for i, (_, _, _, lab) in enumerate(insns) if lab}
    out = []
    for i, (_, op, operands, _) in enumerate(insns):
        if op.startswith("BRA"):
            m = _TARGET.search(operands)
            if m and m.group(1) in at and at[m.group(1)] <= i:
                out.append((at[m.group(1)], i))
    return out


def load_width(opcode: str) -> int:
    """Bytes one lane moves with a global load opcode (LDG.E.128: 16, LDG.E.U8: 1, plain LDG.E: 4)."""
    parts = opcode.split(".")
    for p, w in (("128", 16), ("64", 8), ("U16", 2), ("S16", 2), ("U8", 1), ("S8", 1)):
        if p in parts:
            return w
    return 4


_REG = re.compile(r"\bR(\d+)(?:\.64)?\b")
_SUM_OPS = ("FFMA", "HFMA2", "DFMA", "FFMA2", "DP4A", "IDP")     # a multiply-add: its result is a sum of products
_MUL_OPS = ("FMUL", "HMUL2", "DMUL", "FMUL2")
_ADD_OPS = ("FADD", "HADD2", "DADD", "FADD2")
_LOADS = ("LDG", "LDS", "LD", "LDC", "LDL", "LDSM")


def _dest(opcode: str, operands: str) -> list[int]:
    """The general registers an instruction writes: its first operand, 4 of them for a 128-bit load, 2 for a 64-bit
    one or a wide multiply (none: a predicate, a store, a branch)."""
    if opcode.split(".")[0] in ("STG", "STS", "ST", "STL", "RED", "BRA", "BAR", "BSSY", "BSYNC", "LDGSTS"):
        return []
    first = operands.split(",")[0].strip()
    m = re.fullmatch(r"R(\d+)(?:\.64)?", first)
    if not m:
        return []
    parts = opcode.split(".")
    n = 4 if "128" in parts else 2 if ("64" in parts or "WIDE" in parts or first.endswith(".64")) else 1
    return list(range(int(m.group(1)), int(m.group(1)) + n))


def _sources(operands: str) -> list[list[int]]:
    """The registers of each source operand (a 64-bit pair R4.64: R4 and R5), by position after the destination."""
    out = []
    for o in operands.split(",")[1:]:
        regs = []
        for m in _REG.finditer(o):
            r = int(m.group(1))
            regs += [r, r + 1] if m.group(0).endswith(".64") else [r]
        out.append(regs)
    return out


def weight_products(body: list[tuple[int, str, str, str]]) -> int:
    """The weight x activation products a loop body does (what its instructions are charged per): every multiply
    (_products: one per FFMA / FMUL, two per HFMA2 / HMUL2, four per DP4A / IDP), less those that only scale or
    prepare a product, found by following registers through the body (a loop: a value read before the body writes
    it comes from the previous pass):
      - a scale: a multiply one of whose factors is a sum of 3 or more products (a Q8_0 block's d times its
        4-weight sum; the int8 kernels' scales times the integer dot's sum);
      - a factor: a FMUL / HMUL2 whose result, through additions and conversions, only ever becomes a factor of
        another multiply (x times the RMSNorm weight, predicated or not; dx x dw before it scales the dot; a Q4_K
        nibble times its sub-block scale, less the min, before it meets x).
    A predicated multiply is an instruction either way (a predicated-off instruction still issues)."""
    n = len(body)
    writers: dict[int, list[int]] = {}
    for i, (_, op, o, _) in enumerate(body):
        for r in _dest(op, o):
            writers.setdefault(r, []).append(i)
    base = [op.split(".")[0] for _, op, _, _ in body]
    srcs = [_sources(o) for _, _, o, _ in body]
    dests = [set(_dest(op, o)) for _, op, o, _ in body]
    prods = [_products(op, o) for _, op, o, _ in body]
    passes = ("MOV", "IMAD", "PRMT", "F2F", "I2F", "I2FP", "F2FP", "HADD2", "FADD", "DADD", "FADD2", "FSEL", "SEL")

    def writer(reg: int, at: int) -> int | None:
        ws = writers.get(reg)
        if not ws:
            return None
        before = [w for w in ws if w < at]
        return before[-1] if before else ws[-1]          # else the last write of the previous pass

    def leaves(reg: int, at: int, seen: frozenset = frozenset()) -> int:
        """Products summed into reg (through additions, multiply-adds' addends and conversions)."""
        w = writer(reg, at)
        if w is None or w in seen:
            return 0
        seen = seen | {w}
        if base[w] in _SUM_OPS:
            add = srcs[w][2] if len(srcs[w]) > 2 else []
            return prods[w] + sum(leaves(r, w, seen) for r in add)
        if base[w] in _MUL_OPS:
            return 1 if prods[w] else 0
        if base[w] in _ADD_OPS or base[w] in ("MOV", "F2F", "I2F", "I2FP", "VIADD", "IADD3", "IADD"):
            return sum(leaves(r, w, seen) for regs in srcs[w] for r in regs)
        return 0

    def only_factor(i: int) -> bool:
        """The value written at i reaches only multiplies' factors (through additions and conversions)."""
        todo, seen = [i], set()
        while todo:
            d = todo.pop()
            if d in seen:
                return False                                 # it circulates: an accumulator
            seen.add(d)
            regs, used = dests[d], False
            for k in list(range(d + 1, n)) + list(range(0, d + 1)):
                for pos, rs in enumerate(srcs[k]):
                    if regs & set(rs):
                        used = True
                        if base[k] in _MUL_OPS + _SUM_OPS and pos < 2 and prods[k]:
                            if any(leaves(r, k) >= 3 for r in rs):
                                return False                 # a sum of products, scaled: they are products
                            continue
                        if base[k] in passes and base[k] not in _SUM_OPS:
                            todo.append(k)
                            continue
                        return False
                if k != d and regs & dests[k]:           # overwritten (a predicated write counts too)
                    break
            if not used:
                return False                                 # live out of the loop
        return True

    total = 0
    for i in range(n):
        if not prods[i]:
            continue
        if base[i] not in ("DP4A", "IDP"):
            if any(leaves(r, i) >= 3 for regs in srcs[i][:2] for r in regs):
                continue                                  # a scale of a sum of products
            if base[i] in _MUL_OPS and only_factor(i):
                continue                                  # a factor of a product
        total += prods[i]
    return total


def _count(kernel: str, body: list[tuple[int, str, str, str]], async_copy: bool = False,
           pipelined: bool = False) -> LoopCount:
    counts = {c: 0 for c in (*CLASSES, "other")}
    for _, op, _, _ in body:
        counts[classify(op)] += 1
    ldg = sum(load_width(op) for _, op, _, _ in body if op.startswith("LDG.") or op == "LDG")
    return LoopCount(kernel, len(body), counts["memory"], counts["fma"], counts["convert"], counts["integer"],
                     counts["control"], counts["other"], weight_products(body), ldg, async_copy, pipelined)


def inner_loop(kernel: str, insns: list[tuple[int, str, str, str]]) -> LoopCount | None:
    """The weight loop (see the module doc). Candidates: each loop's own body (its instructions outside the loops
    nested in it) that loads and does at least 8 products; of those at least half as dense (products per
    instruction) as the densest, the one doing the most products (the loop that multiplies, not the one around it
    that copies a tile and waits, nor a short cross-lane reduction nested in it). The function's straight-line
    code outside every loop replaces it when it does at least 4x its products (a kernel whose rows loop is fully
    unrolled, e.g. moe_gate_up's 8 rows per thread, works there, once per thread). Work an outer loop does once
    per tile (copies, waits, scale decoding) is not counted: the count is a lower bound of instructions per
    weight."""
    if any(mma_products(op) for _, op, _, _ in insns):
        return mma_loop(kernel, insns)
    spans = loops(insns)
    staged = any(op.startswith("LDGSTS") for _, op, _, _ in insns)
    # an int8-activation GEMV's weight loop is its integer-dot loop (not the x quantisation's divisions)
    dots_only = any(kernel.startswith(prefix) for prefix, _ in QUANT_LANE_VALUES)
    ring = staged and any(op.startswith("DEPBAR") and re.search(r"SB0,\s*0x[1-9a-f]", o) for _, op, o, _ in insns)

    def own(a: int, b: int, nested: list[tuple[int, int]]) -> tuple[LoopCount, int] | None:
        body = [insns[i] for i in range(a, b + 1) if not any(c <= i <= d for c, d in nested)]
        if not any(op.startswith(("LDG", "LDS", "LD.", "LDGSTS")) or op == "LD" for _, op, _, _ in body):
            return None
        if dots_only and not any(op.startswith(("IDP", "DP4A")) for _, op, _, _ in body):
            return None
        # (the count, its multiplies): the loop is chosen by its multiplies, charged per weight product
        return _count(kernel, body, staged, ring), sum(_products(op, o) for _, op, o, _ in body)

    cands = [c for a, b in spans
             for c in [own(a, b, [(x, y) for x, y in spans if (x, y) != (a, b) and a <= x and y <= b])]
             if c is not None and c[1] >= 8]
    dense = max((m / c.instructions for c, m in cands), default=0.0)
    best = max((cm for cm in cands if cm[1] / cm[0].instructions >= 0.5 * dense),
               key=lambda cm: (cm[1], -cm[0].instructions), default=None)
    flat = own(0, len(insns) - 1, spans) if insns else None
    if flat and flat[1] and (best is None or flat[1] >= 4 * best[1]):
        best = flat
    return best[0] if best else None


# Values one lane quantises per pass of the int8-activation GEMVs' x-quantisation loop (cu/gemv.cu, `#pragma
# unroll 1` loops): a Q8_0 block (q8_0_block_lane: gemv_i8_quantise, gemv_i8_quantise_warp) or a Q8_K group
# (gemv_q8k_quantise), 32 values either way.
QUANT_LANE_VALUES = (("gemv_q4_k_i8", 32), ("gemv_q8_0_i8", 32))


def quant_loop(kernel: str, insns: list[tuple[int, str, str, str]]) -> tuple[int, int]:
    """(instructions, x values per warp) of one pass of an int8-activation GEMV's x-quantisation loop, (0, 0) for
    other kernels: of the loops whose own body stores to shared memory, checks divisions (FCHK: the correctly
    rounded quotients of the rounding and the norm) and has no integer dot, the one with the most FCHK (the
    shortest span among equals: nvdisasm's layout gives some branches spans that reach into other loops). Its
    values: 32 lanes x QUANT_LANE_VALUES."""
    per_lane = next((v for prefix, v in QUANT_LANE_VALUES if kernel.startswith(prefix)), 0)
    if not per_lane:
        return 0, 0
    spans = loops(insns)
    best = None
    for a, b in spans:
        nested = [(x, y) for x, y in spans if (x, y) != (a, b) and a <= x and y <= b]
        body = [insns[i][1] for i in range(a, b + 1) if not any(x <= i <= y for x, y in nested)]
        fchk = sum(op.startswith("FCHK") for op in body)
        if fchk and any(op.startswith("STS") for op in body) and not any(op.startswith(("IDP", "DP4A")) for op in body):
            key = (fchk, -(b - a))
            if best is None or key > best[0]:
                best = (key, len(body))
    return (best[1], 32 * per_lane) if best else (0, 0)


def attn_tile_counts(insns: list[tuple[int, str, str, str]]) -> dict[str, float]:
    """attn_decode_partial's key-tile loop (cu/attention.cu), for the time model's tile chain: the loop around the
    cp.async staging loop; inside it the staging loop (its instructions and cp.async copies per pass), the q.k loop
    and the p.v loop (each: instructions per FMUL, the products one lane does), and the rest of the tile loop
    (barriers, online softmax), once per tile. {"stage", "stage_copies", "qk_per_mul", "pv_per_mul", "rest"}."""
    spans = loops(insns)
    has = lambda a, b, pre: sum(insns[i][1].startswith(pre) for i in range(a, b + 1))       # noqa: E731
    stage = min((sp for sp in spans if has(*sp, "LDGSTS")), key=lambda sp: sp[1] - sp[0])
    tile = min((sp for sp in spans if sp[0] <= stage[0] and stage[1] <= sp[1] and sp != stage),
               key=lambda sp: sp[1] - sp[0])
    inner = [sp for sp in spans if tile[0] <= sp[0] and sp[1] <= tile[1] and sp != tile]
    children = [sp for sp in inner if not any(o != sp and o[0] <= sp[0] and sp[1] <= o[1] for o in inner)]
    muls = sorted((sp for sp in children if has(*sp, "FMUL")), key=lambda sp: has(*sp, "FMUL"))
    qk, pv = muls[0], muls[-1]
    size = lambda sp: sp[1] - sp[0] + 1                                                          # noqa: E731
    return {"stage": size(stage), "stage_copies": has(*stage, "LDGSTS"),
            "qk_per_mul": size(qk) / has(*qk, "FMUL"), "pv_per_mul": size(pv) / has(*pv, "FMUL"),
            "rest": size(tile) - sum(size(sp) for sp in children)}


def sinkhorn_round(insns: list[tuple[int, str, str, str]]) -> dict[str, int]:
    """hc_mix's Sinkhorn round (cu/mhc.cu: its loop over the rounds, the one that shuffles and takes a reciprocal),
    for the time model's last-block tail: its shuffle rounds (runs of SHFL with nothing between them: one shuffle
    latency each on the round's dependent chain) and its IEEE divisions (MUFU.RCP). {"shuffle_rounds",
    "divisions"}."""
    for a, b in sorted(loops(insns), key=lambda sp: sp[1] - sp[0]):
        ops = [op for _, op, _, _ in insns[a:b + 1]]
        if any(op.startswith("SHFL") for op in ops) and any(op.startswith("MUFU.RCP") for op in ops):
            shfl = [op.startswith("SHFL") for op in ops]
            runs = sum(1 for i, on in enumerate(shfl) if on and (i == 0 or not shfl[i - 1]))
            return {"shuffle_rounds": runs, "divisions": sum(op.startswith("MUFU.RCP") for op in ops)}
    return {"shuffle_rounds": 0, "divisions": 0}


def count_cubin(cubin: bytes, only: re.Pattern = STREAMING) -> dict[str, LoopCount]:
    out = {}
    for k, insns in disassemble(cubin).items():
        c = inner_loop(k, insns) if only.match(k) else None
        if c is not None:
            pro, vals = quant_loop(k, insns)
            out[k] = replace(c, prologue=pro, prologue_values=vals) if pro else c
    return out


def table_from(compiled: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """{arch: {kernel: LoopCount fields}} from compiler.compile_all's {arch: {stem: CompiledModule}}."""
    out: dict[str, dict[str, dict]] = {}
    for arch, mods in sorted(compiled.items()):
        rows = {}
        for stem in sorted(mods):
            for k, c in count_cubin(mods[stem].cubin).items():
                d = asdict(c)
                del d["kernel"]
                if not d["prologue"]:                  # the kernels without an x quantisation: as before
                    del d["prologue"], d["prologue_values"]
                rows[k] = d
        out[arch] = dict(sorted(rows.items()))
    return out


def load_table(path: Path = TABLE) -> dict[str, dict[str, LoopCount]]:
    """The committed table: {arch: {kernel: LoopCount}} ({} when absent)."""
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {arch: {k: LoopCount(k, **v) for k, v in rows.items()} for arch, rows in raw["archs"].items()}


def dump_table(table: dict[str, dict[str, dict]]) -> str:
    return json.dumps({"generated_by": "python -m ds4py.cuda.sass --write (nvdisasm on the NVRTC cubins)",
                       "archs": table}, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    from ds4py.cuda import compiler

    p = argparse.ArgumentParser(prog="python -m ds4py.cuda.sass", description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true", help=f"write the table to {TABLE}")
    p.add_argument("archs", nargs="*", default=["sm_121", "sm_90"])
    a = p.parse_args(argv)
    compiled = {arch: compiler.compile_all(arch, progress=lambda m: print(m, file=sys.stderr)) for arch in a.archs}
    text = dump_table(table_from(compiled))
    if a.write:
        TABLE.parent.mkdir(parents=True, exist_ok=True)
        TABLE.write_text(text)
        print(f"wrote {TABLE}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
