"""Compiled twins of small reference ops (numba), used by ds4py.ref.ops once the compiled kernels are loaded
(ds4py.quant.jit: its cache folder and threading layer). They replay numpy's operations in numpy's order, so
they give ops' own bits (tests/test_ops_jit.py); they only save the per-call cost of many tiny numpy calls, which
the per-layer decode path pays every token.

- sinkhorn_rounds: ops.sinkhorn's normalising rounds on a [T, n, n] mix (the hyper-connection comb, n = hc_mult),
  ~0.1 ms of numpy calls per call on a [1, 4, 4] mix (two per layer a token) against ~1 us compiled.
- hc_post: ops.hc_post in one pass, without numpy's [T, n, n, D] temporary (26 ms a call for a 128-token
  prefill at D = 4,096, n = 4, two per layer).
"""

from __future__ import annotations

import numpy as np
from numba import njit

F32 = np.float32
# numpy adds fewer than 8 values first to last (its pairwise sum's short case; checked by the tests): the rounds
# replay that order, so they take mixes of up to this many copies
MAX_N = 7


@njit(cache=True, nogil=True, boundscheck=False)
def _cols(C, t, eps, s):
    n, m = C.shape[1], C.shape[2]
    for k in range(m):
        s[k] = C[t, 0, k]
    for j in range(1, n):
        for k in range(m):
            s[k] += C[t, j, k]
    for j in range(n):
        for k in range(m):
            C[t, j, k] = C[t, j, k] / (s[k] + eps)


@njit(cache=True, nogil=True, boundscheck=False)
def sinkhorn_rounds(C, iters, eps):
    """In place on C = exp(logits - row max) [T, n, n] float32: C / rowsum + eps, C / (colsum + eps), then iters - 1
    rounds of C / (rowsum + eps), C / (colsum + eps) (ops.sinkhorn's order of operations and of additions)."""
    T, n, m = C.shape
    s = np.empty(m, F32)
    for t in range(T):
        for j in range(n):
            r = C[t, j, 0]
            for k in range(1, m):
                r += C[t, j, k]
            for k in range(m):
                C[t, j, k] = C[t, j, k] / r + eps
        _cols(C, t, eps, s)
        for _ in range(iters - 1):
            for j in range(n):
                r = C[t, j, 0]
                for k in range(1, m):
                    r += C[t, j, k]
                r = r + eps
                for k in range(m):
                    C[t, j, k] = C[t, j, k] / r
            _cols(C, t, eps, s)
    return C


@njit(cache=True, nogil=True, boundscheck=False)
def hc_post(f, X, post, comb, out):
    """out [T, n, D] = post[:, k] * f + sum_j comb[:, j, k] * X[:, j] (ops.hc_post: the products, then the sum
    over j first to last, as numpy reduces that axis, then the add)."""
    T, n, D = X.shape
    for t in range(T):
        for k in range(n):
            pk = post[t, k]
            for d in range(D):
                s = comb[t, 0, k] * X[t, 0, d]
                for j in range(1, n):
                    s += comb[t, j, k] * X[t, j, d]
                out[t, k, d] = pk * f[t, d] + s
    return out
