"""Memory-traffic profile of kernels, measured by the CPU emulator's traffic build (DS4PY_EMU_CHECK=traffic;
cu/emu/emu_check.h does the counting, docs/cuda-emu.md "Traffic profile" defines every field).

Per launch and pointer argument: warp requests, bytes requested, the 32-byte sectors and 128-byte lines those
requests touch (coalescing), unique bytes against the argument's bytes, how often its bytes are read again
(by later requests, by other blocks), bytes loaded before pdl_wait(); per launch the shared-memory requests and
their wavefronts (bank conflicts). The records are made by ds4py/cuda/traffic_record.py (`collect()`, and
DS4PY_EMU_TRAFFIC naming a file: one JSON line per launch); this module is the report and its tool.

    python3 -m ds4py.cuda.traffic [--out bench/traffic/report.json] [tests/test_cu_emu_gemv.py ...]

runs the kernels' twin tests (tests/test_cu_emu_*.py, tiny shapes, forward order only) under the traffic build
and writes the per-kernel report (one entry per kernel, its launches summed) plus the findings: weight arguments
below 95% coalescing or read more than 1.1 times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence, TypeVar

from ds4py.cuda.traffic_record import (ARG_COUNTERS, SMEM_COUNTERS, WEIGHT_PARAMS,  # noqa: F401
                                       collect, derive_arg, derive_smem, launch_record, record)

if TYPE_CHECKING:
    import numpy as np

    from ds4py.cuda.emu_runtime import EmuRuntime
    from ds4py.cuda.memory import Arena

Case = TypeVar("Case")

COALESCING_TARGET = 0.95          # issue 34: every weight-streaming kernel's weight argument
REREAD_LIMIT = 1.1
FORMAT = "ds4py-traffic-v1"
# The profile does not depend on thread order, so the tool skips the twin tests' reverse and random re-runs
# (test_random_words is the philox kernel's test, not an order) and the order-identity tests.
ONE_ORDER = "not reverse and (not random or test_random_words) and not thread_order"


def _add(into: dict, c: dict, keys: Sequence[str]) -> None:
    for k in keys:
        into[k] = into.get(k, 0) + c[k]


def summarize(records: Sequence[dict]) -> dict:
    """Per kernel: its launches' counters summed per argument name and for shared memory, ratios re-derived."""
    kernels: dict[str, dict] = {}
    for r in records:
        k = kernels.setdefault(r["kernel"], {"launches": 0, "args": {}, "smem": {}, "smem_load": {},
                                             "smem_store": {}})
        k["launches"] += 1
        for name, c in r["args"].items():
            big = k.setdefault("largest", {}).get(name)
            if c["requests"] and (big is None or (c["arg_bytes"], c["distinct_bytes"]) >
                                  (big["arg_bytes"], big["distinct_bytes"])):
                k["largest"][name] = dict(c, grid=r["grid"], block=r["block"])
            a = k["args"].setdefault(name, {"weight": c["weight"], "written": c["written"],
                                            "readonly_source": c.get("readonly_source", False)})
            a["weight"] |= c["weight"]
            a["readonly_source"] |= c.get("readonly_source", False)
            a["written"] |= c["written"]
            _add(a, c, ARG_COUNTERS + ("arg_bytes",))
        _add(k["smem"], r["smem"], SMEM_COUNTERS)
        _add(k["smem_load"], r["smem"]["load"], SMEM_COUNTERS)
        _add(k["smem_store"], r["smem"]["store"], SMEM_COUNTERS)
    out = {}
    for name in sorted(kernels):
        k = kernels[name]
        smem = derive_smem(k["smem"]) if k["smem"] else derive_smem(dict.fromkeys(SMEM_COUNTERS, 0))
        if k["smem_load"]:
            smem["load"], smem["store"] = derive_smem(k["smem_load"]), derive_smem(k["smem_store"])
        args = {a: derive_arg(c) for a, c in k["args"].items()}
        for a, big in k.get("largest", {}).items():
            args[a]["largest_launch"] = {f: big[f] for f in LARGEST_FIELDS}
        out[name] = {"launches": k["launches"], "args": args, "smem": smem}
    return out


# What the report keeps of each argument's largest launch (the twin tests' shapes are tiny and ragged on purpose:
# a row of a few hundred bytes ends in a partly used sector, so the summed coalescing understates what the same
# code does at the model's shapes; the largest launch is the nearest to them).
LARGEST_FIELDS = ("grid", "block", "arg_bytes", "requests", "coalescing", "dram_efficiency", "reread",
                  "reread_blocks", "coverage", "pre_pdl_bytes")


# The weight-streaming kernels (issue 34's coalescing target): the decode GEMVs and expert kernels, the prefill
# GEMMs and grouped experts; their streamed matrices are these arguments (not norm weights, biases or tables).
STREAMING = re.compile(r"^(gemv_|moe_gate_up_|moe_down_|moe_prefill_gate_up_|moe_prefill_down_"
                       r"|gemm_(f16|f32|q8_0|q4_k)$)")
MATRIX_ARGS = frozenset({"W", "W0", "W1", "W2", "W3", "Wg", "Wu"})


def weight_coalescing(report: dict) -> dict[tuple[str, str], float]:
    """{(kernel, matrix argument): coalescing per warp request} of every weight-streaming kernel in a report,
    judged where the report holds the kernel at the model's width (its `model_width` section: rows that start on
    a sector as every model shape's do; also a kernel no twin test launches), else at the largest launch its twin
    tests make (as findings())."""
    wide = (report.get("model_width") or {}).get("kernels") or {}
    kernels = report.get("kernels") or {}
    out = {}
    for name in sorted(set(kernels) | set(wide)):
        if not STREAMING.search(name):
            continue
        for arg, c in (wide.get(name) or kernels[name])["args"].items():
            if arg in MATRIX_ARGS and c.get("requests") and c.get("coalescing") is not None:
                out[(name, arg)] = (c.get("largest_launch") or c)["coalescing"]
    return out


def findings(kernels: dict) -> list[dict]:
    """Weight arguments below the coalescing target or read more than REREAD_LIMIT times; kernels that load
    weights only after pdl_wait; shared-memory requests with bank conflicts."""
    out = []
    for name, k in kernels.items():
        for arg, c in k["args"].items():
            if not c["weight"] or not c["requests"]:
                continue
            c = c.get("largest_launch", c)          # judged at the largest shape the tests launch
            why = []
            if c["coalescing"] is not None and c["coalescing"] < COALESCING_TARGET:
                why.append(f"coalescing {c['coalescing']:.1%}")
            if c["reread"] is not None and c["reread"] > REREAD_LIMIT:
                why.append(f"re-read {c['reread']:.2f}x by requests")
            if c["reread_blocks"] is not None and c["reread_blocks"] > REREAD_LIMIT:
                why.append(f"re-read {c['reread_blocks']:.2f}x by blocks")
            if why:
                out.append({"kernel": name, "arg": arg, "why": why, "arg_bytes": c["arg_bytes"],
                            "coalescing": c["coalescing"], "reread": c["reread"],
                            "reread_blocks": c["reread_blocks"]})
    return out


def report(records: Sequence[dict], sources: Sequence[str] = ()) -> dict:
    kernels = summarize(records)
    return {"format": FORMAT, "sources": list(sources), "launches": len(records), "kernels": kernels,
            "findings": findings(kernels),
            "pre_pdl_weight_loads": sorted(n for n, k in kernels.items()
                                           if any(c["weight"] and c["pre_pdl_bytes"] for c in k["args"].values())),
            "bank_conflicts": {n: k["smem"]["conflict_factor"] for n, k in kernels.items()
                               if k["smem"]["conflict_factor"] and k["smem"]["conflict_factor"] > 1.0}}


def merged(old: dict, new: dict, replace: str = "") -> dict:
    """`old` report plus `new`'s kernels that it lacks, and `new`'s in place of those whose names match the regex
    `replace` (--update): findings and lists recomputed, launches summed over the kernels."""
    keep = re.compile(replace) if replace else None
    kernels = {**(old.get("kernels") or {}),
               **{n: k for n, k in new["kernels"].items()
                  if n not in (old.get("kernels") or {}) or (keep is not None and keep.search(n))}}
    kernels = dict(sorted(kernels.items()))
    rep = report([], sorted(set(old.get("sources") or []) | set(new["sources"])))
    rep.update(kernels=kernels, launches=sum(k.get("launches", 0) for k in kernels.values()) or new["launches"],
               findings=[f for f in old.get("findings") or [] if old["kernels"].get(f["kernel"]) is kernels.get(f["kernel"])]
               + [f for f in findings(kernels) if old.get("kernels", {}).get(f["kernel"]) is not kernels[f["kernel"]]],
               pre_pdl_weight_loads=sorted(n for n, k in kernels.items()
                                           if any(c["weight"] and c["pre_pdl_bytes"] for c in k["args"].values())),
               bank_conflicts={n: k["smem"]["conflict_factor"] for n, k in kernels.items()
                               if k["smem"]["conflict_factor"] and k["smem"]["conflict_factor"] > 1.0})
    if "model_width" in old:
        rep["model_width"] = old["model_width"]
    return rep


@contextlib.contextmanager
def traffic_build() -> Iterator[None]:
    """DS4PY_EMU_CHECK=traffic inside the block (the emulator builds and loads the traffic-counting kernels), the
    caller's setting restored after."""
    old = os.environ.get("DS4PY_EMU_CHECK")
    os.environ["DS4PY_EMU_CHECK"] = "traffic"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DS4PY_EMU_CHECK", None)
        else:
            os.environ["DS4PY_EMU_CHECK"] = old


def record_cases(cases: Iterable[Case], launch: Callable[[EmuRuntime, Arena, Case], None], *, weights_bytes: int,
                 scratch_bytes: int) -> list[dict]:
    """The model-width recorders' common shape: one emulator runtime of the traffic build (PDL checked) and one
    arena; per case fresh weights and a fresh step, `launch(rt, arena, case)`, synchronise; the launch records."""
    from ds4py.cuda.emu_runtime import EmuRuntime

    with traffic_build():
        rt = EmuRuntime(check_pdl=True)
        arena = rt.arena(weights_bytes=weights_bytes, scratch_bytes=scratch_bytes)
        with collect() as recs:
            for case in cases:
                arena.reset_weights()
                arena.begin_step()
                launch(rt, arena, case)
                rt.synchronize()
        arena.close()
    return recs


def model_width_gemv(rows: int = 16, cols: int = 4096, nx: int = 1) -> list[dict]:
    """The dense GEMV of every weight type at the model's width (V4 Flash: 4096 columns; the twin tests' rows are a
    few hundred bytes, where a row's partly used last sector weighs heavily), traffic build, one launch each of the
    plain kernel and its hc_post and SwiGLU epilogues (Q8_0 and Q4_K: also their int8-activation kernels, and with
    two input groups)."""
    import numpy as np

    from ds4py.cuda import ops
    from ds4py.cuda.ops.gemv import GemvX, SwiGlu
    from ds4py.cuda.ops.mhc import HcResidual
    from ds4py.quant import kquants, simple

    r = np.random.default_rng(34)
    Wf = r.standard_normal((rows, cols)).astype(np.float32)
    Uf = r.standard_normal((rows, cols)).astype(np.float32)          # SwiGLU's up matrix

    def typed(m: np.ndarray) -> dict[str, np.ndarray]:
        return {"F32": m, "F16": m.astype(np.float16), "Q8_0": simple.quant_q8_0(m).reshape(rows, -1),
                "Q4_K": kquants.quant_q4_k(m.reshape(-1, 256)).reshape(rows, -1)}

    weights, ups = typed(Wf), typed(Uf)
    hc = 4

    def launch(rt: EmuRuntime, arena: Arena, kind: str) -> None:
        host = weights[kind]
        W, Wu = arena.weights(host.shape, host.dtype), arena.weights(host.shape, host.dtype)
        W.upload(host)
        Wu.upload(ups[kind])
        x, y = arena.scratch(cols * nx, np.float32), arena.scratch(rows * nx, np.float32)
        x.upload(r.standard_normal(cols * nx).astype(np.float32))
        X, mix = arena.scratch(nx * hc * rows, np.float32), arena.scratch(nx * (2 + hc) * hc, np.float32)
        X.upload(r.standard_normal(nx * hc * rows).astype(np.float32))
        mix.upload(r.random(nx * (2 + hc) * hc).astype(np.float32))
        for act_quant in (False, True) if kind in ("Q8_0", "Q4_K") else (False,):   # and their int8 kernels
            xin = GemvX(x, cols, nx=nx, act_quant=act_quant)
            ops.gemv(rt, [(W, y, rows)], xin)
            ops.gemv_hc_post(rt, W, xin, HcResidual(X, mix, rows, hc))
            ops.gemv_swiglu(rt, SwiGlu(W, Wu, rows), xin, y)
        if kind in ("Q8_0", "Q4_K"):         # two input groups (the grouped wo_a), int8 activations
            xg = arena.scratch(2 * cols * nx, np.float32)
            xg.upload(r.standard_normal(2 * cols * nx).astype(np.float32))
            ops.gemv(rt, [(W, y, rows)], GemvX(xg, cols, nx=nx, x_group_rows=rows // 2, act_quant=True))

    return record_cases(weights, launch, weights_bytes=8 * rows * cols + (1 << 20), scratch_bytes=1 << 20)


def model_width_gemm(T: int = 64, rows: int = 128, cols: int = 4096) -> list[dict]:
    """The prefill GEMM of every dense weight type at the model's width (one token tile x one feature tile: the
    tests' ragged K leave rows that do not start on a sector), traffic build, one launch each. A launch of T tokens
    reads each weight byte once per GEMM_BM-token tile (the tiles of one feature tile share it through L2)."""
    import numpy as np

    from ds4py.cuda.ops.gemm import GemmShape, gemm
    from ds4py.quant import kquants, simple

    r = np.random.default_rng(35)
    Wf = (r.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    weights = {"F32": Wf, "F16": Wf.astype(np.float16), "Q8_0": simple.quant_q8_0(Wf).reshape(rows, -1),
               "Q4_K": kquants.quant_q4_k(Wf.reshape(-1, 256)).reshape(rows, -1)}

    def launch(rt: EmuRuntime, arena: Arena, host: np.ndarray) -> None:
        W = arena.weights(host.shape, host.dtype)
        W.upload(host)
        x, y = arena.scratch(T * cols, np.float32), arena.scratch(T * rows, np.float32)
        x.upload(r.standard_normal(T * cols).astype(np.float32))
        gemm(rt, W, x, y, GemmShape(T=T, N=rows, K=cols))

    return record_cases(weights.values(), launch, weights_bytes=4 * rows * cols + (1 << 20),
                        scratch_bytes=4 * T * (cols + rows) + (1 << 20))


def _prefill_expert_launch(r: np.random.Generator, T: int, dim: int, ff: int, rows: int, gate_up: Callable,
                           down: Callable, matrix_shape: Callable) -> Callable:
    """launch(rt, arena, (qtype, is_down)) for record_cases: one expert of `rows` weight rows and T tokens routed to
    it, random weight bytes of shape `matrix_shape(qtype, rows, cols)` (the traffic does not depend on the values;
    F16: finite halves), then the prefill experts' `gate_up` op (rows of `dim` columns) or `down` op (rows of
    `ff`)."""
    import numpy as np

    from ds4py.cuda.ops import moe_prefill as mp
    from ds4py.cuda.ops.core import TokenRows
    from ds4py.cuda.ops.experts import Experts, Slots
    from ds4py.ggml_types import GGMLQuantizationType as QT

    def launch(rt: EmuRuntime, arena: Arena, case: tuple) -> None:
        qtype, is_down = case
        cols, feat, fd = (ff, rows, (ff, rows)) if is_down else (dim, rows, (rows, dim))

        def mat():
            host = r.integers(0, 256, matrix_shape(qtype, feat, cols), dtype=np.uint8)
            if not isinstance(qtype, str) and int(qtype) == int(QT.F16):    # finite halves
                host = (r.standard_normal(host.size // 2) * 0.1).astype(np.float16).view(np.uint8)
            w = arena.weights(host.shape, np.uint8)
            w.upload(host)
            return w

        bufs = mp.MoePrefillBuffers.alloc(lambda sh, dt: arena.scratch(sh, dt), T, 1, 1, *fd)
        ids = arena.scratch((T,), np.int32)
        ids.upload(np.zeros(T, np.int32))
        mp.moe_prefill_route(rt, ids, bufs, T, 1, 1)
        if is_down:
            bufs.H.upload(r.standard_normal((T, ff)).astype(np.float32))
            down(rt, Experts(fmt=qtype, n_experts=1, ff=ff, dim=rows, down=mat()), bufs, T, 1)
        else:
            x = arena.scratch((T, dim), np.float32)
            x.upload(r.standard_normal((T, dim)).astype(np.float32))
            gate_up(rt, Experts(fmt=qtype, n_experts=1, ff=rows, dim=dim, gate=mat(), up=mat()), TokenRows(x=x, T=T),
                    Slots(k=1), bufs)

    return launch


def model_width_moe_tiles(T: int = 4, dim: int = 4096, ff: int = 2048, rows: int = 64) -> list[dict]:
    """The prefill experts' exact token tiles (moe_gate_up_tile_<fmt>: rows of `dim` columns; moe_down_tile_<fmt>:
    rows of `ff`, V4 Flash's widths) of every GGML format, one expert of `rows` weight rows and T tokens, random
    weight bytes (the traffic does not depend on the values), traffic build, one launch each."""
    import numpy as np

    from ds4py.cuda.ops import moe_prefill as mp
    from ds4py.cuda.ops.experts import FORMATS, row_bytes

    launch = _prefill_expert_launch(np.random.default_rng(36), T, dim, ff, rows, mp.moe_tile_gate_up,
                                    mp.moe_tile_down, lambda qtype, feat, cols: (1, feat, row_bytes(qtype, cols)))
    recs = record_cases([(q, down) for q in FORMATS for down in (False, True)], launch,
                        weights_bytes=8 * rows * dim + (1 << 20), scratch_bytes=16 * T * (dim + ff) + (1 << 20))
    return [x for x in recs if x["kernel"].startswith(("moe_gate_up_tile_", "moe_down_tile_"))]


def model_width_moe_prefill(T: int = 16, dim: int = 4096, ff: int = 2048, rows: int = 64,
                            formats: Sequence[object] | None = None) -> list[dict]:
    """The tensor-core prefill experts (moe_prefill_gate_up_<fmt>: rows of `dim` columns; moe_prefill_down_<fmt>:
    rows of `ff`, V4 Flash's widths) of every format (default: every GGML format and VQ-8 at every width 6 .. 13;
    V4.1's are 12 and 13), one expert of `rows` weight rows (one feature tile) and T tokens (one work item), random
    weight bytes (the traffic does not depend on the values), traffic build, one launch each."""
    import numpy as np

    from ds4py.cuda.ops import moe_prefill as mp
    from ds4py.cuda.ops.experts import FORMATS, VQ_FORMATS, matrix_bytes

    launch = _prefill_expert_launch(np.random.default_rng(37), T, dim, ff, rows, mp.moe_prefill_gate_up,
                                    mp.moe_prefill_down, lambda qtype, feat, cols: matrix_bytes(qtype, 1, feat, cols))
    formats = [*FORMATS, *VQ_FORMATS] if formats is None else formats
    recs = record_cases([(q, down) for q in formats for down in (False, True)], launch,
                        weights_bytes=8 * rows * dim + (1 << 20), scratch_bytes=16 * T * (dim + ff) + (1 << 20))
    return [x for x in recs if x["kernel"].startswith(("moe_prefill_gate_up_", "moe_prefill_down_"))]


def model_width_experts(dim: int = 4096, ff: int = 2048, rows: int = 64, k: int = 2, nx: int = 2,
                        formats: Sequence[object] | None = None, act_quant: bool = False) -> list[dict]:
    """The decode experts (moe_gate_up_<fmt>: rows of `dim` columns; moe_down_<fmt>: rows of `ff`, V4 Flash's widths;
    the twin tests' rows of 256-1,024 columns end mid-sector) and their grouped `_rows` kernels, of every format
    (default: every GGML format and VQ-8 at every width 6 .. 13; act_quant: the int8-activation kernels of the
    formats that have them), `rows` weight rows of each of k experts, k slots; the `_rows` kernels on nx rows: gate +
    up with every row choosing the same k experts (grouped: each expert's rows read once), down with each row its
    own k experts (moe_down_rows reads an expert once per row that chose it, as moe_down would); random weight bytes
    (the traffic does not depend on the values), traffic build, one launch each."""
    import numpy as np

    from ds4py.cuda.ops import experts as mx
    from ds4py.cuda.ops.core import TokenRows

    r = np.random.default_rng(38)
    if formats is None:
        formats = sorted(mx.I8_FORMATS, key=int) if act_quant else [*sorted(mx.FORMATS, key=int), *mx.VQ_FORMATS]

    def launch(rt: EmuRuntime, arena: Arena, qtype: object) -> None:
        def mat(n_experts: int, feat: int, cols: int):
            host = r.integers(0, 256, mx.matrix_bytes(qtype, n_experts, feat, cols), dtype=np.uint8)
            w = arena.weights(host.shape, np.uint8)
            w.upload(host)
            return w

        def slots(ids: np.ndarray) -> mx.Slots:
            d = arena.scratch(ids.shape, np.int32)
            d.upload(ids.astype(np.int32))
            return mx.Slots(ids=d, k=k)

        chosen = np.arange(k)[::-1]                    # every row chooses experts k - 1 .. 0
        apart = np.arange(nx * k)[::-1]                # row n chooses its own k experts (moe_down_rows)
        up = mx.Experts(fmt=qtype, n_experts=k, ff=rows, dim=dim, gate=mat(k, rows, dim), up=mat(k, rows, dim),
                        act_quant=act_quant)
        down = mx.Experts(fmt=qtype, n_experts=k, ff=ff, dim=rows, down=mat(k, rows, ff), act_quant=act_quant)
        down_nx = mx.Experts(fmt=qtype, n_experts=nx * k, ff=ff, dim=rows, down=mat(nx * k, rows, ff),
                             act_quant=act_quant)
        x, h = arena.scratch((nx, dim), np.float32), arena.scratch((nx * k, ff), np.float32)
        x.upload(r.standard_normal((nx, dim)).astype(np.float32))
        h.upload(r.standard_normal((nx * k, ff)).astype(np.float32))
        x1, y = arena.scratch((dim,), np.float32), arena.scratch((nx, rows), np.float32)
        x1.upload(r.standard_normal(dim).astype(np.float32))
        mx.moe_gate_up(rt, up, x1, arena.scratch((k, rows), np.float32), slots(chosen))
        mx.moe_down(rt, down, TokenRows(x=h, y=arena.scratch((rows,), np.float32)), slots(chosen))
        mx.moe_gate_up_rows(rt, up, TokenRows(x=x, y=arena.scratch((nx * k, rows), np.float32), T=nx),
                            slots(np.tile(chosen, nx)))
        mx.moe_down_rows(rt, down_nx, TokenRows(x=h, y=y, T=nx), slots(apart))

    weights = (3 + nx) * max(mx.matrix_bytes(q, k, rows, dim) for q in formats)
    return record_cases(formats, launch, weights_bytes=weights + (1 << 20),
                        scratch_bytes=8 * nx * k * (dim + ff) + (1 << 20))


def model_width_experts_i8(dim: int = 4096, ff: int = 2048, rows: int = 64, k: int = 2) -> list[dict]:
    """The decode experts' int8-activation kernels (moe_gate_up_i8_<fmt>, moe_down_i8_<fmt> and their `_rows`) of
    every format with int8 kernels, as model_width_experts."""
    return model_width_experts(dim, ff, rows, k, act_quant=True)


def twin_tests(repo: Path) -> list[str]:
    """The kernels' twin tests: every tests/test_cu_emu_*.py but the emulator's own and the GPU / NVRTC ones."""
    skip = {"test_cu_emu.py", "test_cu_emu_gpu.py", "test_cu_emu_portable.py", "test_cu_emu_kernels.py",
            "test_cu_emu_runtime.py"}
    return [str(p.relative_to(repo)) for p in sorted((repo / "tests").glob("test_cu_emu_*.py")) if p.name not in skip]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4py.cuda.traffic", description=__doc__.split("\n\n")[0])
    ap.add_argument("tests", nargs="*", help="test files to run (default: every kernel twin test)")
    ap.add_argument("--out", default="bench/traffic/report.json", help="the per-kernel report (JSON)")
    ap.add_argument("--records", help="keep the per-launch records (JSON lines) here")
    ap.add_argument("--from-records", help="summarise these per-launch records instead of running tests")
    ap.add_argument("--no-model-width", action="store_true",
                    help="skip the GEMVs, GEMMs, prefill and decode experts at the model's width")
    ap.add_argument("--update", nargs="?", const="", default=None, metavar="REGEX",
                    help="merge into the existing --out report: add the kernels it lacks, replace those matching "
                         "REGEX (default: none; the others keep what their own tests recorded)")
    ap.add_argument("-k", dest="keyword", default=ONE_ORDER,
                    help="pytest -k expression (default: the forward-order runs only, %(default)r)")
    a = ap.parse_args(argv)
    repo = Path(__file__).resolve().parents[2]
    if a.from_records:
        path = Path(a.from_records)
        tests: list[str] = list(a.tests)                 # what the records came from, for the report
    else:
        tests = a.tests or twin_tests(repo)
        path = Path(a.records) if a.records else Path(tempfile.mkstemp(suffix=".jsonl")[1])
        path.write_text("")
        env = dict(os.environ, DS4PY_EMU_CHECK="traffic", DS4PY_EMU_TRAFFIC=str(path.resolve()))
        cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *tests]
        if a.keyword:
            cmd += ["-k", a.keyword]
        r = subprocess.run(cmd, cwd=repo, env=env)
        if r.returncode not in (0, 1):
            print(f"traffic: pytest exited with {r.returncode}", file=sys.stderr)
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not a.records and not a.from_records:
        path.unlink(missing_ok=True)
    rep = report(records, tests)
    out = Path(a.out)
    if a.update is not None and out.is_file():
        rep = merged(json.loads(out.read_text()), rep, a.update)
    if not a.no_model_width:
        width = (model_width_gemv() + model_width_gemv(nx=4) + model_width_gemm() + model_width_moe_tiles()
                 + model_width_moe_prefill() + model_width_experts() + model_width_experts_i8())
        rep["model_width"] = {"what": "gemv of every weight type, 16 x 4096, one and four activation rows, plain, "
                                      "hc_post and SwiGLU (Q8_0: and int8 activations); "
                                      "gemm of every dense weight type, 64 tokens x 128 x 4096; the experts' "
                                      "token tiles of every GGML format, 4 tokens, 64 rows of 4096 (gate + up) "
                                      "and of 2048 columns (down); the tensor-core prefill experts of every GGML "
                                      "format and VQ-8 at every width 6-13, 16 tokens, the same rows; the decode "
                                      "experts of every GGML format and VQ-8 at every width 6-13 (and the "
                                      "int8-activation kernels of the formats that have them), one token and the "
                                      "grouped _rows kernels of 2 rows, 2 slots, 64 rows of 4096 (gate + up) and "
                                      "of 2048 columns (down); the _rows down: each row its own 2 experts",
                              "kernels": summarize(width)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1, sort_keys=True) + "\n")
    print(f"traffic: {len(rep['kernels'])} kernels, {len(records)} launches -> {out}")
    for f in rep["findings"]:
        print(f"  {f['kernel']}: {f['arg']}: {', '.join(f['why'])}")
    return 0


if __name__ == "__main__":
    # run the package's module, not this __main__ copy: emu.py records into ds4py.cuda.traffic's RECORDS
    from ds4py.cuda.traffic import main as package_main
    sys.exit(package_main())
