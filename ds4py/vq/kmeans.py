"""Nearest-codeword search and Lloyd iterations for 8-dimensional vectors, deterministic by construction.

Search: for a block of vectors, D = ||c||^2 - 2 v.c for every codeword comes from one float32 GEMM of the
augmented vectors [v, 1] and codewords [-2c, ||c||^2] (the vectors x codewords matrix exists only one block at
a time), then the running best and second best. The GEMM's summation order depends on the BLAS kernel, so a
vector whose best two candidates are closer than 4x a rigorous bound of the float32 error is re-decided in
float64 elementwise arithmetic (no BLAS), lowest index on ties. The result is therefore the exact nearest
codeword wherever that is separated by more than the bound, the float64 one elsewhere, and never depends on
the BLAS kernel, its threads or the block size.

Lloyd: equidistant initial sampling, a fixed number of rounds, float64 sums in the update (np.bincount adds in
input order), empty codewords re-seeded from the worst-fitted vectors (stable order). No random source.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

F32, F64 = np.float32, np.float64
DIM = 8
BLOCK_ELEMS = 1 << 20            # vectors x codewords per block: 4 MiB of float32 distances
# |fl32(D) - D| <= gamma_9 (2|v||c| + |c|^2) + u |c|^2 for any summation order (9 terms, u = 2^-24); 16u bounds it
ERR_UNIT = 2.0 ** -20


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class Searcher:
    """Nearest codeword of many vectors for one fixed codebook (float32 [K, 8])."""

    def __init__(self, codebook: np.ndarray, workers: int | None = None):
        c = np.ascontiguousarray(codebook, dtype=F32)
        if c.ndim != 2 or c.shape[1] != DIM:
            raise ValueError(f"codebook must be [K, {DIM}], got {list(c.shape)}")
        self.c = c
        self.c64 = c.astype(F64)
        cc = (self.c64 * self.c64).sum(1)
        self.aug_t = np.ascontiguousarray(np.concatenate([-2 * c, cc.astype(F32)[:, None]], 1).T)   # [9, K]
        self.cmax = float(np.sqrt(cc.max())) if len(cc) else 0.0
        self.block = int(np.clip(BLOCK_ELEMS // max(len(c), 1), 32, 8192))
        self.workers = workers or default_workers()
        self.n_rechecked = 0

    def exact(self, v: np.ndarray) -> np.ndarray:
        """float64 elementwise distances to every codeword, fixed order; argmin = lowest index on ties."""
        v = v.astype(F64)
        d = np.zeros((len(v), len(self.c)), F64)
        for i in range(DIM):
            t = v[:, i:i + 1] - self.c64[:, i]
            d += t * t
        return d.argmin(1).astype(np.int32)

    def _block(self, v: np.ndarray) -> tuple[np.ndarray, int]:
        m = len(v)
        a = np.empty((m, DIM + 1), F32)
        a[:, :DIM] = v
        a[:, DIM] = 1
        d = a @ self.aug_t                                       # [m, K] = ||c||^2 - 2 v.c
        r = np.arange(m)
        i1 = d.argmin(1)
        d1 = d[r, i1]
        d[r, i1] = np.inf
        d2 = d.min(1) if d.shape[1] > 1 else np.full(m, np.inf, F32)
        vn = np.sqrt((v.astype(F64) ** 2).sum(1))
        tol = ERR_UNIT * (2 * vn * self.cmax + self.cmax ** 2)
        near = np.nonzero(d2.astype(F64) - d1.astype(F64) <= 4 * tol)[0]
        idx = i1.astype(np.int32)
        if len(near):
            idx[near] = self.exact(v[near])
        return idx, len(near)

    def __call__(self, v: np.ndarray) -> np.ndarray:
        """Indices (int32 [n]) of the nearest codeword of each vector v (float32 [n, 8])."""
        v = np.ascontiguousarray(v, dtype=F32).reshape(-1, DIM)
        n, b = len(v), self.block
        out = np.empty(n, np.int32)
        starts = range(0, n, b)

        def one(a: int) -> int:
            out[a:a + b], k = self._block(v[a:a + b])
            return k

        if self.workers > 1 and n > 4 * b:
            with ThreadPoolExecutor(self.workers) as ex:
                self.n_rechecked += sum(ex.map(one, starts))
        else:
            self.n_rechecked += sum(one(a) for a in starts)
        return out


def nearest(v: np.ndarray, codebook: np.ndarray, workers: int | None = None) -> np.ndarray:
    return Searcher(codebook, workers)(v)


def sq_error(v: np.ndarray, codebook: np.ndarray, idx: np.ndarray, chunk: int = 1 << 20) -> np.ndarray:
    """float64 squared distance of each vector to its assigned codeword (elementwise, fixed order)."""
    out = np.empty(len(v), F64)
    for a in range(0, len(v), chunk):
        d = v[a:a + chunk].astype(F64) - codebook[idx[a:a + chunk]].astype(F64)
        out[a:a + chunk] = (d * d).sum(1)
    return out


def equidistant(pool: np.ndarray, k: int) -> np.ndarray:
    """k vectors at equal strides through the pool: the initial codebook."""
    return pool[(np.arange(k, dtype=np.int64) * len(pool)) // k].astype(F32)


def lloyd(pool: np.ndarray, k: int, rounds: int, workers: int | None = None,
          report: Callable[[int, float], None] | None = None) -> np.ndarray:
    """k-means codebook (float32 [k, 8]) of pool (float32 [P, 8]) after `rounds` Lloyd rounds.

    report(round, mean squared error of the pool against the codebook it was assigned to) after each round.
    """
    pool = np.ascontiguousarray(pool, dtype=F32)
    if len(pool) < k:
        raise ValueError(f"a pool of {len(pool)} vectors cannot train {k} codewords")
    c = equidistant(pool, k)
    for r in range(rounds):
        idx = Searcher(c, workers)(pool)
        counts = np.bincount(idx, minlength=k)
        sums = np.stack([np.bincount(idx, weights=pool[:, i], minlength=k) for i in range(DIM)], 1)   # float64
        err = sq_error(pool, c, idx)
        new = c.astype(F64)
        full = counts > 0
        new[full] = sums[full] / counts[full, None]
        empty = np.nonzero(~full)[0]
        if len(empty):                                   # re-seed from the worst-fitted vectors, stable order
            worst = np.argsort(-err, kind="stable")[:len(empty)]
            new[empty] = pool[worst]
        c = new.astype(F32)
        if report is not None:
            report(r, float(err.mean()))
    return c


def throughput(n: int = 200_000, k: int = 4096, workers: int | None = None, seed: int = 0) -> float:
    """Measured nearest-codeword vectors/s on Gaussian data (for `quantize-vq` reports and the bench)."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, DIM), dtype=F32)
    s = Searcher(rng.standard_normal((k, DIM), dtype=F32), workers)
    t = time.perf_counter()
    s(v)
    return n / (time.perf_counter() - t)
