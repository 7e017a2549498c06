"""One-thread speed of the CPU decode kernels (ds4py.quant.jit_decode, int8 activations; F16 in fp32), in GB/s of
weights a core, against this host's copy bandwidth.

    python3 bench/cpu_kernel_gbs.py [--mb 160] [--reps 5] [--threads 2] [--isa native|avx2|neon|portable]

Each format's serial row kernel (`<fmt>_rows`: one token, the way a decode step runs it) streams a random matrix of
about --mb MB (larger than the last-level cache) at a real model width; the time is the calling thread's CPU time,
the minimum of --reps runs. `copy` is numpy copying --mb MB on one thread (GB/s read). With --threads N the
pooled kernels (`<fmt>_dec`) run on N threads too (wall time, GB/s in all): whether a format is bound by the
memory bus rather than by instructions. Numbers depend on the machine's load: report it (printed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

F32 = np.float32


def _matrix(block_bytes: int, nb: int, rows: int, rng, scale_at: tuple[int, ...]) -> np.ndarray:
    raw = rng.integers(0, 256, size=(rows, nb, block_bytes), dtype=np.uint8)
    for o in scale_at:                                       # finite f16 scales
        raw[:, :, o:o + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return raw


def _best(fn, reps: int, clock) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=160)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="also time the pooled kernels on this many threads")
    ap.add_argument("--only", default="", help="comma-separated formats (iq2_xxs,q2_k,q8_0,f16)")
    ap.add_argument("--isa", default="native",
                    help="instruction set to build the kernels for: native, avx2, neon, portable")
    a = ap.parse_args()
    from ds4py.quant import isa                    # before numba compiles anything: its target comes from the env
    try:
        os.environ.update(isa.numba_env(a.isa))
    except ValueError as e:
        sys.exit(str(e))
    from ds4py.quant import jit, jit_i8
    jit_i8._kernels()
    dec = jit_i8._tables["dec"]
    f16 = jit._state["f16"]
    rng = np.random.default_rng(0)
    print(f"load {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; AVX2 {dec.AVX2}; "
          f"AVX-512 path {dec.AVX512}; NEON sdot path {dec.NEON}")
    src = np.ones(a.mb << 20, np.uint8)
    dst = np.empty_like(src)
    t = _best(lambda: np.copyto(dst, src), a.reps, time.thread_time)
    print(f"{'copy':10s} {src.nbytes / t / 1e9:6.2f} GB/s read (one thread)")
    C = 4096
    x = (rng.standard_normal((1, C)) * 2).astype(F32)
    xq, xd, xbs = jit_i8.quant_q8_k(x)
    x0q, x0d = jit_i8.quant_q8_0(x)
    cases = {
        "iq2_xxs": (66, 256, (0,), lambda w, y: (w, xq, xd, y, f16, jit_i8._tables["grid8"], jit_i8._tables["sign8"])),
        "q2_k": (84, 256, (80, 82), lambda w, y: (w, xq, xd, xbs, y, f16)),
        "q8_0": (34, 32, (0,), lambda w, y: (w, x0q, x0d, y, f16)),
    }
    only = set(filter(None, a.only.split(",")))
    for name, (bb, blk, sc, args) in cases.items():
        if only and name not in only:
            continue
        nb = C // blk
        rows = max(1, (a.mb << 20) // (nb * bb))
        w = _matrix(bb, nb, rows, rng, sc)
        y = np.empty((1, rows), F32)
        rows_fn, dec_fn = getattr(dec, f"{name}_rows"), getattr(dec, f"{name}_dec")
        t = _best(lambda: rows_fn(*args(w, y), 0, rows), a.reps, time.thread_time)
        line = f"{name:10s} {w.nbytes / t / 1e9:6.2f} GB/s a core ({t * 1e3:.1f} ms CPU for {w.nbytes / 1e6:.0f} MB)"
        if a.threads:
            t2 = _best(lambda: dec_fn(*args(w, y), a.threads), a.reps, time.perf_counter)
            line += f"; {a.threads} threads {w.nbytes / t2 / 1e9:6.2f} GB/s wall"
        print(line)
    if not only or "f16" in only:
        rows = max(1, (a.mb << 20) // (2 * C))
        w = rng.standard_normal((rows, C)).astype(np.float16).view(np.uint16)
        xf = rng.standard_normal((1, C)).astype(F32)
        y = np.empty((1, rows), F32)
        t = _best(lambda: dec.f16_rows(w, xf, y, f16, 0, rows), a.reps, time.thread_time)
        line = f"{'f16':10s} {w.nbytes / t / 1e9:6.2f} GB/s a core ({t * 1e3:.1f} ms CPU for {w.nbytes / 1e6:.0f} MB)"
        if a.threads:
            t2 = _best(lambda: dec.f16_dec(w, xf, y, f16, a.threads), a.reps, time.perf_counter)
            line += f"; {a.threads} threads {w.nbytes / t2 / 1e9:6.2f} GB/s wall"
        print(line)


if __name__ == "__main__":
    main()
