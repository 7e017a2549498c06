"""Decode GEMV bandwidth vs the device's measured copy bandwidth (needs a CUDA GPU).

    python bench/gemv_bandwidth.py [--json out.json] [--reps 20]

A decode GEMV reads each weight byte once, so its speed is weight bytes / time; the ceiling is what a
device-to-device copy achieves (bytes read + bytes written / time), measured here first. Each matrix is several
times the L2 so the numbers are DRAM numbers; the launches are replayed from a CUDA graph so Python's launch
overhead does not count. Also times a chain of small GEMVs launched plainly, with PDL,
and as a replayed CUDA graph (launch overhead, which is what PDL and graphs remove).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4py.cuda import ops, twins  # noqa: E402
from ds4py.cuda.driver import call  # noqa: E402
from ds4py.cuda.graph import StepGraph  # noqa: E402
from ds4py.cuda.memory import Arena  # noqa: E402
from ds4py.cuda.probe import device_copy_bandwidth_gbps  # noqa: E402
from ds4py.cuda.runtime import Runtime  # noqa: E402

PATTERN_BYTES = 32 << 20   # random data uploaded once and tiled over the big matrices


def timed(rt: Runtime, fn, reps: int, warmup: int = 3) -> float:
    """Mean milliseconds per call of fn() on the main stream (CUDA events)."""
    for _ in range(warmup):
        fn()
    t = rt.timer()
    t.start()
    for _ in range(reps):
        fn()
    ms = t.stop() / reps
    t.close()
    return ms


def timed_graph(rt: Runtime, launch_once, reps: int, slot, replays: int = 5) -> float:
    """Mean milliseconds per launch, with `reps` launches captured into one graph (no Python launch overhead)."""
    g = StepGraph(rt, lambda: [launch_once() for _ in range(reps)], slot)
    ms = timed(rt, g.replay, replays, warmup=1) / reps
    g.close()
    return ms


def fill_tiled(rt: Runtime, dst, pattern: np.ndarray) -> None:
    """dst <- pattern repeated (whole copies, then a partial one), via one upload and device-to-device copies."""
    pat = np.ascontiguousarray(pattern).view(np.uint8).reshape(-1)
    n = min(pat.nbytes, dst.nbytes)
    call("cuCtxSynchronize")
    call("cuMemcpyHtoD", dst.ptr, pat.ctypes.data, n)
    off = n
    while off < dst.nbytes:
        k = min(off, dst.nbytes - off)
        call("cuMemcpyDtoD", dst.ptr + off, dst.ptr, k)
        off += k
    call("cuCtxSynchronize")     # device-to-device copies are asynchronous to the host and our streams


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()

    rt = Runtime()
    dev = rt.device
    print(f"device: {dev.name} ({dev.arch}), {dev.sm_count} SMs, {dev.l2_bytes >> 20} MB L2, "
          f"{dev.total_mem / 2**30:.0f} GiB")
    res: dict = {"device": dev.name, "arch": dev.arch, "sm_count": dev.sm_count, "gemv": [], "chain": {}}

    # copy ceiling: 2 GiB device-to-device, counting bytes read + written
    copy_gbs = device_copy_bandwidth_gbps(rt)
    res["copy_GBps"] = copy_gbs
    print(f"copy (device to device, read + write): {copy_gbs:.0f} GB/s")

    r = np.random.default_rng(0)
    shapes = [("f16", 65536, 8192), ("f16", 16384, 4096), ("q8_0", 129280, 4096), ("q8_0", 32768, 16384)]
    arena = Arena(weights_bytes=1400 << 20, scratch_bytes=8 << 20)
    for kind, rows, cols in shapes:
        arena.reset_weights()                  # reuse the weight region for each shape
        slot = arena.weights(1, np.int32)      # graphs need a step slot; these read nothing from it
        slot.readonly = False
        arena.begin_step()
        if kind == "f16":
            W = arena.weights((rows, cols), np.float16)
            pat = (0.05 * r.standard_normal(PATTERN_BYTES // 2)).astype(np.float16)
            fn = ops.gemv_f16
        else:
            W = arena.weights(rows * cols // 32 * 34, np.uint8)
            pat = twins.quant_q8_0((0.05 * r.standard_normal(PATTERN_BYTES // 34 * 32)).astype(np.float32))
            fn = ops.gemv_q8_0
        fill_tiled(rt, W, pat)
        x_host = r.standard_normal(cols).astype(np.float32)
        x, y = arena.scratch(cols, np.float32), arena.scratch(rows, np.float32)
        x.upload(x_host)
        # correctness spot check: the rows inside the first pattern copy
        fn(rt, W, x, y, rows, cols)
        k = min(rows, (pat.nbytes // (W.nbytes // rows)))
        got = y.download()[:k]
        if kind == "f16":
            Wk = pat[: k * cols].reshape(k, cols)
            ref, mag = twins.gemv_f16(Wk, x_host), np.abs(Wk.astype(np.float64)) @ np.abs(x_host)
        else:
            rawk = pat.reshape(-1)[: k * cols // 32 * 34]
            ref = twins.gemv_q8_0(rawk, x_host, k, cols)
            mag = np.abs(twins.q8_0_matrix(rawk, k, cols).astype(np.float64)) @ np.abs(x_host)
        twins.assert_close_scaled(got, ref, mag, cols, f"{kind} {rows}x{cols}")
        best = None
        for warps in (4, 8, 16):
            ms = timed_graph(rt, lambda: fn(rt, W, x, y, rows, cols, warps=warps), args.reps, slot)
            gbs = W.nbytes / ms / 1e6
            row = {"kind": kind, "rows": rows, "cols": cols, "warps": warps, "MB": W.nbytes / 1e6, "us": ms * 1e3,
                   "GBps": gbs, "of_copy": gbs / copy_gbs}
            res["gemv"].append(row)
            best = row if best is None or gbs > best["GBps"] else best
            print(f"gemv_{kind:5} {rows:6}x{cols:<6} warps {warps:2}: {W.nbytes / 1e6:7.1f} MB in {ms * 1e3:8.1f} us"
                  f" = {gbs:6.0f} GB/s ({100 * gbs / copy_gbs:.0f}% of copy)")
        print(f"  best: {best['GBps']:.0f} GB/s with {best['warps']} warps per block")

    # launch overhead: 32 dependent small GEMVs (4096 x 4096 Q8_0, 17 MB: L2-resident) plain / PDL / graph
    arena.reset_weights()
    slot = arena.weights(1, np.int32)
    slot.readonly = False
    arena.begin_step()
    rows = cols = 4096
    W = arena.weights(rows * cols // 32 * 34, np.uint8)
    fill_tiled(rt, W, twins.quant_q8_0((0.05 * r.standard_normal(rows * cols)).astype(np.float32)))
    v0, v1 = arena.scratch(cols, np.float32), arena.scratch(cols, np.float32)
    v0.upload(r.standard_normal(cols).astype(np.float32))

    def chain(pdl: bool) -> None:
        for i in range(16):
            ops.gemv_q8_0(rt, W, v0, v1, rows, cols, pdl=pdl)
            ops.gemv_q8_0(rt, W, v1, v0, rows, cols, pdl=pdl)

    for name, fn in [("plain", lambda: chain(False)), ("pdl", lambda: chain(True))]:
        ms = timed(rt, fn, 10)
        res["chain"][name] = ms * 1e3 / 32
        print(f"chain of 32 small gemv_q8_0 ({name:5}): {ms * 1e3 / 32:6.2f} us per kernel")
    for name, pdl in [("graph", False), ("graph+pdl", True)]:
        g = StepGraph(rt, lambda pdl=pdl: chain(pdl), slot)
        ms = timed(rt, lambda: g.replay(), 10)
        res["chain"][name] = ms * 1e3 / 32
        print(f"chain of 32 small gemv_q8_0 ({name:9}): {ms * 1e3 / 32:6.2f} us per kernel")
        g.close()
    rt.synchronize()
    arena.close()
    rt.close()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"gemv_bandwidth: done in {time.perf_counter() - t0:.0f} s")
    sys.exit(rc)
