"""Decode-kernel bandwidth at the V4 Flash shapes vs the device's measured copy bandwidth (needs a CUDA GPU;
--emu runs the same code on the CPU emulator at cut-down shapes, which checks it but measures nothing).

    python bench/gemv_bandwidth.py [--json out.json] [--reps 20] [--emu]

A decode GEMV reads each weight byte once, so its speed is weight bytes / time; the ceiling is what a
device-to-device copy achieves (bytes read + bytes written / time), measured first. The matrices are the decode
GEMVs of V4 Flash (Q8_0 q_b, wo_a in 8 input groups, wo_b, head; q_a + kv in one launch; the shared expert's
gate + up with the SwiGLU epilogue; F16 ones of the compressor / indexer size), each several times the L2, so the
numbers are DRAM numbers; `reps` launches are replayed from one CUDA graph so Python's launch cost does not count.
Then the other cuda-core kernels per call (mHC mix at D = 4096, argmax and the sampler over 129,280 logits) and a
chain of 32 small GEMVs launched plainly, with PDL, as a graph and as a graph with PDL (launch overhead).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4py.cuda import ops, twins  # noqa: E402
from ds4py.cuda.graph import StepGraph  # noqa: E402
from ds4py.cuda.ops import mhc as om  # noqa: E402
from ds4py.cuda.ops.argmax import argmax_parts  # noqa: E402
from ds4py.cuda.ops.sample import SampleRows, SampleRule  # noqa: E402
from ds4py.cuda.probe import device_copy_bandwidth_gbps  # noqa: E402
from ds4py.cuda.twins import gemv as tg  # noqa: E402
from ds4py.cuda.ops.argmax import ArgmaxParts  # noqa: E402
from ds4py.cuda.ops.gemv import GemvX, SwiGlu  # noqa: E402

PATTERN_BYTES = 32 << 20   # random data uploaded once and tiled over the big matrices

# (name, kind, matrices as (rows, cols), input groups of rows (0: none), epilogue)
GEMVS = [
    ("q_b", "Q8_0", [(32768, 1024)], 0, "plain"),
    ("wo_a", "Q8_0", [(8192, 4096)], 1024, "plain"),
    ("wo_b", "Q8_0", [(4096, 8192)], 0, "plain"),
    ("head", "Q8_0", [(129280, 4096)], 0, "plain"),
    ("q_a+kv", "Q8_0", [(1024, 4096), (512, 4096)], 0, "plain"),
    ("shexp gate+up", "Q8_0", [(2048, 4096), (2048, 4096)], 0, "swiglu"),
    ("f16 16384x4096", "F16", [(16384, 4096)], 0, "plain"),
    ("f16 4096x4096", "F16", [(4096, 4096)], 0, "plain"),
]
# F16 stages 32,896 B a warp (its cp.async ring): 3 warps are the most a GB10 block holds (101,376 B)
WARPS = {"Q8_0": (2, 4, 8), "F16": (1, 2, 3)}


def timed(rt, fn, reps: int, warmup: int = 3) -> float:
    """Mean milliseconds per call of fn() on the main stream (the runtime's timer)."""
    for _ in range(warmup):
        fn()
    t = rt.timer()
    t.start()
    for _ in range(reps):
        fn()
    ms = t.stop() / reps
    t.close()
    return ms


def timed_graph(rt, launch_once, reps: int, slot, replays: int = 5) -> float:
    """Mean milliseconds per launch, with `reps` launches captured into one graph (no Python launch overhead)."""
    g = StepGraph(rt, lambda: [launch_once() for _ in range(reps)], slot)
    ms = timed(rt, g.replay, replays, warmup=1) / reps
    g.close()
    return ms


def fill_tiled(rt, dst, pattern: np.ndarray) -> None:
    """dst <- pattern repeated (whole copies, then a partial one): one upload, then device-to-device doubling."""
    pat = np.ascontiguousarray(pattern).view(np.uint8).reshape(-1)
    n = min(pat.nbytes, dst.nbytes)
    dst.view(0, n, np.uint8).upload(pat[:n])
    off = n
    while off < dst.nbytes:
        k = min(off, dst.nbytes - off)
        rt.copy_d2d(dst.ptr + off, dst.ptr, k)
        off += k
    rt.synchronize()


def pattern_for(kind: str, r: np.random.Generator, nbytes: int) -> np.ndarray:
    if kind == "F16":
        return (0.05 * r.standard_normal(nbytes // 2)).astype(np.float16)
    return twins.quant_q8_0((0.05 * r.standard_normal(nbytes // 34 * 32)).astype(np.float32))


def shrink(shape: tuple[int, int], emu: bool) -> tuple[int, int]:
    return (min(shape[0], 64), shape[1]) if emu else shape


def bench_gemvs(rt, arena, r, copy_gbs: float, reps: int, emu: bool, res: dict) -> None:
    for name, kind, mats, groups, epi in GEMVS:
        mats = [shrink(m, emu) for m in mats]
        groups = min(groups, mats[0][0]) if groups else 0
        cols = mats[0][1]
        arena.reset_weights()
        slot = arena.weights(2, np.int32)
        slot.readonly = False
        arena.begin_step()
        pat_bytes = min(PATTERN_BYTES, sum(rows * cols for rows, _ in mats) * 2)
        pat = pattern_for(kind, r, pat_bytes)
        Ws = []
        for rows, _ in mats:
            W = arena.weights((rows, cols), np.float16) if kind == "F16" else \
                arena.weights((rows, cols // 32 * 34), np.uint8)
            fill_tiled(rt, W, pat)
            Ws.append(W)
        x_host = r.standard_normal(cols * (mats[0][0] // groups if groups else 1)).astype(np.float32)
        x = arena.scratch(x_host.size, np.float32)
        x.upload(x_host)
        ys = [arena.scratch(rows, np.float32) for rows, _ in mats]

        def launch(warps=None):
            if epi == "swiglu":
                ops.gemv_swiglu(rt, SwiGlu(Ws[0], Ws[1], mats[0][0], clamp=10.0), GemvX(x, cols), ys[0], warps=warps)
            else:
                ops.gemv(rt, [(W, y, rows) for W, y, (rows, _) in zip(Ws, ys, mats)],
                         GemvX(x, cols, x_group_rows=groups), warps=warps)

        # correctness spot check: the rows inside the first pattern copy
        launch()
        rows0 = mats[0][0]
        k = min(rows0, pat.nbytes // (Ws[0].nbytes // rows0))
        if groups:
            k = min(k, groups)
        raw = pat.reshape(-1)[: k * (Ws[0].nbytes // rows0) // pat.itemsize]
        Wk = raw.reshape(k, cols) if kind == "F16" else raw.view(np.uint8).reshape(k, -1)
        if epi == "swiglu":                            # gate and up hold the same bytes here
            g = tg.gemv(Wk, x_host, k, cols)
            want = tg.swiglu(g, g, 10.0)
            mag = (1.1 * np.abs(g) + np.abs(tg.ref.silu(g))) * tg.magnitude(Wk, x_host, k, cols) + np.abs(want)
            twins.assert_close_scaled(ys[0].download()[:k], want, mag, cols, name)
        else:
            twins.assert_close_scaled(ys[0].download()[:k], tg.gemv(Wk, x_host, k, cols),
                                      tg.magnitude(Wk, x_host, k, cols), cols, name)
        nbytes = sum(W.nbytes for W in Ws)
        best = None
        for warps in WARPS[kind]:
            ms = timed_graph(rt, lambda: launch(warps), reps, slot)
            gbs = nbytes / ms / 1e6
            row = {"name": name, "kind": kind, "matrices": mats, "x_group_rows": groups, "warps": warps,
                   "MB": nbytes / 1e6, "us": ms * 1e3, "GBps": gbs, "of_copy": gbs / copy_gbs}
            res["gemv"].append(row)
            best = row if best is None or gbs > best["GBps"] else best
            print(f"gemv {name:15} {'+'.join(f'{a}x{b}' for a, b in mats):>22} warps {warps:2}: "
                  f"{nbytes / 1e6:7.1f} MB in {ms * 1e3:8.1f} us = {gbs:6.0f} GB/s ({100 * gbs / copy_gbs:.0f}% of copy)")
        print(f"  best: {best['GBps']:.0f} GB/s with {best['warps']} warps per block")


def bench_small_kernels(rt, arena, r, reps: int, emu: bool, res: dict) -> None:
    """Per-call time of the mHC mix (D = 4096), argmax and the sampler over the vocabulary."""
    D, V = (4096, 129280) if not emu else (256, 4096)
    arena.reset_weights()
    slot = arena.weights(2, np.int32)
    slot.readonly = False
    arena.begin_step()
    fn = arena.weights((24, 4 * D), np.float16)
    fn.upload((0.05 * r.standard_normal((24, 4 * D))).astype(np.float16))
    X = arena.scratch((4, D), np.float32)
    X.upload(r.standard_normal((4, D)).astype(np.float32))
    scale, base = arena.weights(3, np.float32), arena.weights(24, np.float32)
    scale.upload(np.ones(3, np.float32))
    base.upload(np.zeros(24, np.float32))
    tickets = arena.weights(2, np.uint32)
    tickets.readonly = False
    tickets.upload(np.zeros(2, np.uint32))
    part = arena.scratch(om.mix_partial_floats(1, 24, D), np.float32)
    mix = arena.scratch(24, np.float32)
    logits = arena.scratch(V, np.float32)
    logits.upload((2 * r.standard_normal(V)).astype(np.float32))
    parts = argmax_parts(rt, V)
    pv, pi, tok = arena.scratch(parts, np.float32), arena.scratch(parts, np.int32), arena.scratch(1, np.int32)
    cases = {
        "hc_mix D=%d" % D: lambda: ops.hc_mix(rt, om.MixWeights(fn, scale, base, D, 1e-6, 1e-6, 20),
                                              om.MixBuffers(X, 1, mix, part, tickets.view(0, 1))),
        "argmax V=%d" % V: lambda: ops.argmax(rt, logits, V, ArgmaxParts(pv, pi, tickets.view(4, 1)), tok),
        "sample top_k=50 V=%d" % V: lambda: ops.sample(rt, SampleRule(1.0, top_k=50, seed=1), logits, tok,
                                                       SampleRows(n=V), threads=1024 if not emu else 128),
        "sample top_p=0.9 V=%d" % V: lambda: ops.sample(rt, SampleRule(1.0, top_p=0.9, seed=1), logits, tok,
                                                        SampleRows(n=V), threads=1024 if not emu else 128),
    }
    for name, fn_ in cases.items():
        ms = timed_graph(rt, fn_, reps, slot)
        res["kernels"][name] = ms * 1e3
        print(f"{name:28}: {ms * 1e3:8.1f} us per call")


def bench_chain(rt, arena, r, emu: bool, res: dict) -> None:
    """32 dependent small GEMVs (4096 x 4096 Q8_0, 17 MB: L2-resident): plain / PDL / graph / graph + PDL."""
    arena.reset_weights()
    slot = arena.weights(1, np.int32)
    slot.readonly = False
    arena.begin_step()
    rows = cols = 4096 if not emu else 128
    W = arena.weights(rows * cols // 32 * 34, np.uint8)
    fill_tiled(rt, W, twins.quant_q8_0((0.05 * r.standard_normal(rows * cols)).astype(np.float32)))
    v0, v1 = arena.scratch(cols, np.float32), arena.scratch(cols, np.float32)
    v0.upload(r.standard_normal(cols).astype(np.float32))

    def chain(pdl: bool) -> None:
        for _ in range(16):
            ops.gemv_q8_0(rt, W, v0, v1, rows, cols, pdl=pdl)
            ops.gemv_q8_0(rt, W, v1, v0, rows, cols, pdl=pdl)

    n = 3 if emu else 10
    for name, fn in [("plain", lambda: chain(False)), ("pdl", lambda: chain(True))]:
        ms = timed(rt, fn, n, warmup=1)
        res["chain"][name] = ms * 1e3 / 32
        print(f"chain of 32 small gemv_q8_0 ({name:9}): {ms * 1e3 / 32:6.2f} us per kernel")
    for name, pdl in [("graph", False), ("graph+pdl", True)]:
        g = StepGraph(rt, lambda pdl=pdl: chain(pdl), slot)
        ms = timed(rt, lambda: g.replay(), n, warmup=1)
        res["chain"][name] = ms * 1e3 / 32
        print(f"chain of 32 small gemv_q8_0 ({name:9}): {ms * 1e3 / 32:6.2f} us per kernel")
        g.close()


def main(argv: list[str] | None = None) -> int:
    args = bench_args(__doc__, argv)

    if args.emu:
        from ds4py.cuda.emu_runtime import EmuRuntime

        rt = EmuRuntime()
        reps = min(args.reps, 2)
    else:
        from ds4py.cuda.runtime import Runtime

        rt = Runtime()
        reps = args.reps
    dev = rt.device
    print(f"device: {dev.name} ({dev.arch}), {dev.sm_count} SMs, {dev.l2_bytes >> 20} MB L2, "
          f"{dev.total_mem / 2**30:.0f} GiB")
    res: dict = {"device": dev.name, "arch": dev.arch, "sm_count": dev.sm_count, "emulated": args.emu, "gemv": [],
                 "kernels": {}, "chain": {}}
    copy_gbs = device_copy_bandwidth_gbps(rt, nbytes=(2 << 30) if not args.emu else (4 << 20),
                                          reps=10 if not args.emu else 2)
    res["copy_GBps"] = copy_gbs
    print(f"copy (device to device, read + write): {copy_gbs:.0f} GB/s")
    r = np.random.default_rng(0)
    arena = rt.arena(weights_bytes=(1400 << 20) if not args.emu else (16 << 20), scratch_bytes=8 << 20)
    return run_and_close(rt, arena, res, args.json, lambda: bench_gemvs(rt, arena, r, copy_gbs, reps, args.emu, res),
                         lambda: bench_small_kernels(rt, arena, r, reps, args.emu, res),
                         lambda: bench_chain(rt, arena, r, args.emu, res))


def bench_args(doc: str, argv: list[str] | None) -> argparse.Namespace:
    """The options of the bandwidth benches (--json, --reps, --emu), with the script's docstring as --help."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--emu", action="store_true", help="run on the CPU emulator at cut-down shapes (a code check)")
    return ap.parse_args(argv)


def run_and_close(rt, arena, res: dict, json_path: str | None, *benches: Callable[[], None]) -> int:
    """Run the benches in turn, then free the arena and the runtime (also on an error) and write `res` as JSON to
    json_path when one is given; status 0."""
    try:
        for bench in benches:
            bench()
    finally:
        rt.synchronize()
        arena.close()
        rt.close()
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=1))
    return 0


def exit_timed(name: str, main: Callable[[], int]) -> None:
    """A bench script's entry: run main, say how long the whole run took, exit with main's status."""
    t0 = time.perf_counter()
    rc = main()
    print(f"{name}: done in {time.perf_counter() - t0:.0f} s")
    sys.exit(rc)


if __name__ == "__main__":
    exit_timed("gemv_bandwidth", main)
