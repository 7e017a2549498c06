"""The fused CPU kernels' runner: row blocks of a stored matrix over a small thread pool.

`ds4py.quant.dot` multiplies one block of rows; this module cuts a matrix into blocks sized to stay in a core's
cache (`BLOCK_ELEMS` weights), lets the workers take blocks one at a time (each with its own scratch buffers),
and assembles y = x @ W.T. numpy releases the GIL inside its kernels (casts, takes, matmuls, ufuncs), so the
workers run in parallel; what stays serial is the Python between kernel calls (a few microseconds per call,
~20 calls per block). The calling thread works too (one part inline), so threads=1 means no pool at all.

VQ-8 experts (ds4py.quant.vq) go through the same runner: a block's indices are unpacked and gathered from the
float32 codebook into the scratch, multiplied by x, then scaled by the row gains.

compiled=True: the formats ds4py.quant.jit covers run its numba kernels instead (their own threads, the same
count; rows split evenly, each row computed by one thread), the others the numpy kernels above.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as Q

from ds4py.quant import dot, jit, vq
from ds4py.ref import blas

F32 = np.float32
BLOCK_ELEMS = 1 << 17          # weights per block: the float32 scratch of one block is 512 KiB (L2 is 1 MiB here)
# formats whose per-block Python and small-array work outweigh the cache misses of a larger scratch (measured on
# the real-width experts: IQ2_XXS 1.4 -> 1.0 ns per weight at 512 Ki weights, Q2_K 1.7 -> 1.3 at 256 Ki)
FORMAT_BLOCK_ELEMS = {int(Q.IQ2_XXS): 1 << 19, int(Q.Q2_K): 1 << 18}
MIN_SPLIT_ELEMS = 1 << 19      # matrices smaller than this run on the calling thread alone


def default_threads() -> int:
    """DS4PY_THREADS, else the CPUs this process may run on."""
    env = os.environ.get("DS4PY_THREADS")
    if env:
        return max(1, int(env))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:                                  # not Linux
        return max(1, os.cpu_count() or 1)


_FELL_BACK: set[str] = set()


def _fallback_once(what: str) -> None:
    """One stderr line per shape a compiled kernel does not take (that matrix then runs the numpy kernels)."""
    import sys

    if what not in _FELL_BACK:
        _FELL_BACK.add(what)
        print(f"ds4py: the compiled CPU kernels do not take {what}; those products use the numpy kernels",
              file=sys.stderr, flush=True)


class Runner:
    """Runs row-block kernels over `threads` workers (the calling thread included)."""

    def __init__(self, threads: int | None = None, compiled: bool = False):
        self.threads = default_threads() if threads is None else max(1, int(threads))
        self.compiled = compiled
        self._pool = ThreadPoolExecutor(self.threads - 1, "ds4py-fused") if self.threads > 1 else None
        self._local = threading.local()
        self._scratches: list[dot.Scratch] = []
        self._lock = threading.Lock()

    def scratch(self) -> dot.Scratch:
        s = getattr(self._local, "scratch", None)
        if s is None:
            s = self._local.scratch = dot.Scratch()
            with self._lock:
                self._scratches.append(s)
        return s

    def scratch_bytes(self) -> int:
        """Bytes held by every worker's scratch buffers (they are reused, never freed while the model lives)."""
        with self._lock:
            return sum(s.nbytes for s in self._scratches)

    def each(self, fn: Callable[[int], None], n: int) -> None:
        """fn(i) for i in range(n) over the workers, the calling thread included, the items taken one at a time
        from a shared iterator (as rows() takes its blocks), with BLAS on one thread meanwhile: each worker's
        products are its own, never nested in OpenBLAS's threads. Each item is computed the same whoever takes
        it, so the results do not depend on the thread count."""
        if self._pool is None or n < 2:
            for i in range(n):
                fn(i)
            return
        todo = iter(range(n))

        def run() -> None:
            for i in todo:
                fn(i)

        with blas.single_threaded():
            futures = [self._pool.submit(run) for _ in range(min(self.threads, n) - 1)]
            try:
                run()
            finally:
                for f in futures:
                    f.result()

    def rows(self, n_rows: int, n_cols: int, T: int, block: Callable[[int, int, dot.Scratch], np.ndarray],
             block_elems: int = BLOCK_ELEMS) -> np.ndarray:
        """y [T, n_rows] with y[:, a:b] = block(a, b, scratch) for blocks of rows covering [0, n_rows)."""
        y = np.empty((T, n_rows), F32)
        step = max(1, min(n_rows, block_elems // max(1, n_cols)))

        starts = range(0, n_rows, step)
        parts = self.threads if self._pool is not None and n_rows * n_cols >= MIN_SPLIT_ELEMS else 1
        parts = min(parts, len(starts))
        # the workers take blocks one at a time from a shared iterator (next() on a range iterator is atomic
        # under the GIL): on a shared machine a worker whose core is busy elsewhere just takes fewer blocks,
        # instead of the others waiting for its fixed half. Each block is computed the same whoever takes it.
        todo = iter(starts)

        def run() -> None:
            scr = self.scratch()
            for a in todo:
                b = min(a + step, n_rows)
                y[:, a:b] = block(a, b, scr)

        if parts <= 1:
            run()
            return y
        futures = [self._pool.submit(run) for _ in range(1, parts)]
        try:
            run()
        finally:
            for f in futures:
                f.result()
        return y

    def matmul(self, qtype, raw: np.ndarray, x: np.ndarray, n_cols: int, finite: bool = False) -> np.ndarray:
        """x [T, n_cols] @ W.T for a stored matrix W: raw uint8 [rows, row_nbytes] in GGUF layout (finite: its
        f16 scales are known to hold no inf / NaN, dot.scales_finite)."""
        raw = np.asarray(raw)                  # a plain view: slicing a np.memmap runs Python for every block
        if self.compiled and jit.supported(qtype):
            if jit.takes(qtype, n_cols):
                return jit.matmul(qtype, raw, x, self._jit_threads(raw.shape[0] * n_cols))
            _fallback_once(f"{Q(int(qtype)).name} rows of {n_cols} weights")
        prep = dot.prepare(qtype, x)
        qt = int(qtype)
        return self.rows(raw.shape[0], n_cols, x.shape[0],
                         lambda a, b, scr: dot.dot_rows(qt, raw[a:b], prep, scr, finite),
                         FORMAT_BLOCK_ELEMS.get(qt, BLOCK_ELEMS))

    def vq_matmul(self, stream: np.ndarray, hi: np.ndarray | None, gains: np.ndarray, layer: vq.Layer,
                  x: np.ndarray) -> np.ndarray:
        """x @ W.T for one VQ-8 expert matrix: stream [rows, row_bytes] (+ hi plane), gains [rows] float32."""
        bits = layer.header.bits
        n_cols = stream.shape[1] // vq.stream_bits(bits) * vq.ROW_QUANTUM
        x = np.ascontiguousarray(x, dtype=F32)
        stream, hi = np.asarray(stream), None if hi is None else np.asarray(hi)
        if self.compiled and n_cols % jit.VQ_ROW_MULTIPLE == 0:
            return jit.vq_matmul(stream, hi, gains, layer.codebook, bits, x, self._jit_threads(stream.shape[0] * n_cols))

        def block(a: int, b: int, scr: dot.Scratch) -> np.ndarray:
            idx = vq.unpack_indices(stream[a:b], None if hi is None else hi[a:b], bits)
            w = scr.get("vq", (b - a, n_cols // vq.GROUP, vq.GROUP), F32)
            np.take(layer.codebook, idx, axis=0, out=w, mode="clip")
            return (x @ w.reshape(b - a, n_cols).T) * gains[a:b]

        return self.rows(stream.shape[0], n_cols, x.shape[0], block)

    def _jit_threads(self, weights: int) -> int:
        """Threads for one compiled product: all of them, except for matrices too small to split."""
        return self.threads if weights >= MIN_SPLIT_ELEMS else 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
