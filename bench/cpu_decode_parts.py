"""Where a CPU decode token's wall time goes (the reference backend's default compiled kernels), and an A/B of the
pooled kernels' threads in lockstep.

    python bench/cpu_decode_parts.py -m MODEL.gguf [--threads 2] [--tokens 24] [--bw 44] [--ab-crew]

One process decodes --tokens tokens greedily after a one-token prefill and three warm-up steps (the background
populate joined first). Every kernel call (ds4py.quant.jit._call) is timed; per call position in the token the
minimum wall over the tokens is kept (on a shared machine the minimum filters out most of the other processes'
load: report the load printed with it), with the weight bytes it reads (the routed experts: the picked experts'
slices only) and its GB/s; the serial gaps between the calls (the main thread's numpy / Python, both kernel
threads idle) likewise; `--bw` GB/s prices all the bytes at that bus rate (the floor of a step whose kernels all
ran at it). --ab-crew: tokens alternate numba's pool (A, $DS4PY_CREW=0) and ds4py.quant.jit's own threads (B, the
default),
the order swapped every pair; both tables and the per-pair B / A median. --gaps N: the N largest serial gaps, each
named by the kernel calls (name#position in the token) on either side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ds4py.model import Numerics  # noqa: E402
from ds4py.quant import jit  # noqa: E402
from ds4py.ref.engine import RefModel  # noqa: E402


def weight_bytes(name: str, args: tuple) -> int:
    """The weight bytes a kernel call reads: its read-only weight arrays, the routed experts' picked slices."""
    if name == "q8_0_iq2_xxs_ex_dec":                 # (q8, xq8, xd8, y8, n8, wa, wb, ex, ...)
        return args[0].nbytes + len(args[7]) * (args[5][0].nbytes + args[6][0].nbytes)
    if name.endswith("_ex_dec"):                      # (wa, wb, ex, ...): wb is wa for one matrix
        wa, wb, ex = args[0], args[1], args[2]
        return len(ex) * (wa[0].nbytes + (0 if wb.ctypes.data == wa.ctypes.data else wb[0].nbytes))
    seen, total = set(), 0
    for a in args:
        if (isinstance(a, np.ndarray) and not a.flags.writeable and a.dtype in (np.uint8, np.uint16)
                and a.nbytes >= 1 << 16 and a.ctypes.data not in seen):
            seen.add(a.ctypes.data)
            total += a.nbytes
    return total


def table(toks: list, bw: float, top: int = 0) -> None:
    """Per kernel: calls, the sum of its positions' minimum wall, bytes, GB/s; the head; the gaps."""
    P = len(toks[0][2])
    cmin = [min(t[2][j][2] - t[2][j][1] for t in toks) for j in range(P)]

    def gaps(t):
        w0, w1, r = t
        return [r[0][1] - w0] + [r[j][1] - r[j - 1][2] for j in range(1, P)] + [w1 - r[-1][2]]

    gmin = [min(gaps(t)[j] for t in toks) for j in range(P + 1)]
    names, nbytes = [x[0] for x in toks[0][2]], [x[3] for x in toks[0][2]]
    walls = [t[1] - t[0] for t in toks]
    print(f"  token wall min {min(walls) * 1e3:.1f} ms, median {statistics.median(walls) * 1e3:.1f} ms "
          f"({len(toks)} tokens)")
    kinds = defaultdict(lambda: [0, 0.0, 0])
    for nm, c, b in zip(names, cmin, nbytes):
        k = kinds[nm]
        k[0], k[1], k[2] = k[0] + 1, k[1] + c, k[2] + b
    print(f"  {'kernel':22s} {'calls':>5s} {'min ms':>8s} {'MB':>7s} {'GB/s':>6s} {f'at {bw:g} GB/s':>12s}")
    for nm, (cnt, c, b) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"  {nm:22s} {cnt:5d} {c * 1e3:8.2f} {b / 1e6:7.1f} {b / c / 1e9:6.1f} {b / bw / 1e6:12.2f}")
    head = max(range(P), key=lambda j: nbytes[j])
    tb = sum(nbytes)
    print(f"  largest call (the lm head): {cmin[head] * 1e3:.2f} ms for {nbytes[head] / 1e6:.0f} MB = "
          f"{nbytes[head] / cmin[head] / 1e9:.1f} GB/s")
    print(f"  kernel calls {sum(cmin) * 1e3:.2f} ms for {tb / 1e6:.0f} MB ({tb / sum(cmin) / 1e9:.1f} GB/s); "
          f"serial gaps {sum(gmin) * 1e3:.2f} ms over {P + 1}; sum {(sum(cmin) + sum(gmin)) * 1e3:.2f} ms; "
          f"all bytes at {bw:g} GB/s: {tb / bw / 1e6:.2f} ms")
    if top:
        order = sorted(range(P + 1), key=lambda j: -gmin[j])[:top]
        print(f"  largest gaps (min ms, between the calls around it): " + "; ".join(
            f"{gmin[j] * 1e3:.2f} {names[j - 1] if j else 'start'}#{j - 1} -> {names[j] if j < P else 'end'}#{j}"
            for j in order))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--bw", type=float, default=44.0, help="bus GB/s to price the bytes at")
    ap.add_argument("--gaps", type=int, default=0, help="list the N largest serial gaps")
    ap.add_argument("--ab-crew", action="store_true", help="alternate numba's pool and jit's own threads")
    a = ap.parse_args()
    if not os.path.isfile(a.model):
        sys.exit(f"cpu_decode_parts: no model file at {a.model}")
    jit.AUTO = jit.AUTO and not a.ab_crew           # --ab-crew: the crew in B even on a busy host
    m = RefModel(a.model, numerics=Numerics.ds4(), threads=a.threads)
    st = m.new_state()
    lg = m.prefill(st, [5])
    for _ in range(3):
        lg = m.decode(st, int(np.argmax(lg)))
    if getattr(m, "populating", None) is not None:
        m.populating.join()
    inner, rec = jit._call, []

    def timed(name, fn, args, threads, pool=True):
        w0 = time.perf_counter()
        inner(name, fn, args, threads, pool)
        rec.append((name, w0, time.perf_counter(), weight_bytes(name, args)))

    jit._call = timed
    variants = ("A", "B") if a.ab_crew else ("B" if jit.CREW else "A",)
    toks: dict = {v: [] for v in variants}
    load0 = os.getloadavg()[0]
    for i in range(a.tokens):
        for v in (variants if i % 2 == 0 else variants[::-1]):
            jit.CREW = v == "B"
            rec.clear()
            w0 = time.perf_counter()
            lg = m.decode(st, int(np.argmax(lg)))
            toks[v].append((w0, time.perf_counter(), list(rec)))
    jit._call = inner
    print(f"{a.model}, {a.threads} threads; load {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    for v in variants:
        if a.ab_crew:
            print(f"{v}: {'jit crew (default)' if v == 'B' else 'numba pool ($DS4PY_CREW=0)'}")
        table(toks[v], a.bw, a.gaps)
    if a.ab_crew:
        r = [(b[1] - b[0]) / (x[1] - x[0]) for x, b in zip(toks["A"], toks["B"])]
        print(f"B / A token wall per pair: median {statistics.median(r):.3f}")


if __name__ == "__main__":
    main()
