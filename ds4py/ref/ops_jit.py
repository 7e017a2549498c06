"""Compiled twins of small reference ops (numba), used by ds4py.ref.ops once the compiled kernels are loaded
(ds4py.quant.jit: its cache folder and threading layer). They replay numpy's operations in numpy's order, so
they give ops' own bits (tests/test_ops_jit.py); they only save the per-call cost of many tiny numpy calls, which
the per-layer decode path pays every token.

- sinkhorn_rounds: ops.sinkhorn's normalising rounds on a [T, n, n] mix (the hyper-connection comb, n = hc_mult),
  ~0.1 ms of numpy calls per call on a [1, 4, 4] mix (two per layer a token) against ~1 us compiled.
- hc_post: ops.hc_post in one pass, without numpy's [T, n, n, D] temporary (26 ms a call for a 128-token
  prefill at D = 4,096, n = 4, two per layer).
- rmsnorm: ops.rmsnorm in one pass a row (~20 a decode token, six numpy calls each); the mean of squares is
  numpy's pairwise sum (pairwise_sum below) divided as numpy's mean divides (in float64).
- hc_collapse: ops.hc_collapse without the [T, n, D] temporary (two a layer).
- fp8_fake_quant_rows: ops.fp8_fake_quant (frexp / ldexp / rint / clip per element: exact or rounded once, as
  numpy rounds them; ~90 us of numpy calls a KV row in a decode step).
- hc_mix_exp_inputs / hc_mix_from_exps: ops.hc_coeffs around its GEMV (the mixes' rsqrt(mean of squares)
  scaling, the three scale / base affines, the negations and the comb rows' max) and after one numpy exp over all
  the values (numpy's float32 exp gives the same bits for a value wherever it lies in the array), the sigmoids,
  the + eps, the 2x and the Sinkhorn rounds: ~20 numpy calls of 1-3 us each, 8 calls a decode token.
- swiglu_gate_neg / swiglu_rows: ops.swiglu_hidden around one numpy exp (the clamps, silu's sigmoid, the
  products and the row weights in numpy's order and rounding; ~8 numpy calls, five a decode token).
- add_rows_grouped: forward._routed_run's `y[tok[a:b]] += d[a:b]` per expert group (six fancy-index adds a
  layer in a decode step).
- rope_rows: ops.rope_tail's rotation with numpy's cos / sin (numba's float32 sin / cos differ from numpy's in
  some inputs, so those stay numpy's), products and sums rounded as numpy rounds them (~40 us a call, ~14 a
  decode token).
"""

from __future__ import annotations

import math

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


@njit(cache=True, nogil=True, boundscheck=False)
def _pairwise_leaf(a, o, n):
    """numpy's pairwise_sum of up to 128 values (see pairwise_sum)."""
    if n < 8:
        r = F32(-0.0)
        for i in range(n):
            r += a[o + i]
        return r
    r0, r1, r2, r3 = a[o], a[o + 1], a[o + 2], a[o + 3]
    r4, r5, r6, r7 = a[o + 4], a[o + 5], a[o + 6], a[o + 7]
    i = 8
    while i < n - n % 8:
        r0 += a[o + i]
        r1 += a[o + i + 1]
        r2 += a[o + i + 2]
        r3 += a[o + i + 3]
        r4 += a[o + i + 4]
        r5 += a[o + i + 5]
        r6 += a[o + i + 6]
        r7 += a[o + i + 7]
        i += 8
    r = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        r += a[o + i]
        i += 1
    return r


@njit(cache=True, nogil=True, boundscheck=False)
def _half(n):
    h = n // 2
    return h - h % 8


@njit(cache=True, nogil=True, boundscheck=False)
def pairwise_sum(a, o, n):
    """a[o:o + n].sum() in numpy's order for a contiguous float32 axis (its pairwise_sum: fewer than 8 values
    first to last from -0.0; up to 128 in 8 running sums, combined ((0+1)+(2+3))+((4+5)+(6+7)), then the rest;
    a longer run is (its first half, rounded down to a multiple of 8) + (the rest), each summed the same way).
    The recursion runs on an explicit stack: numba's disk cache crashes on recursive functions (segfault seen)."""
    if n <= 128:
        return _pairwise_leaf(a, o, n)
    fo = np.empty(64, np.int64)          # the frames: offset, length, state (0 new, 1 left pending, 2 right), left sum
    fn = np.empty(64, np.int64)
    st = np.empty(64, np.int64)
    lv = np.empty(64, F32)
    fo[0], fn[0], st[0] = o, n, 0
    sp = 1
    while True:
        k = sp - 1
        if fn[k] > 128:                   # a new inner node: its left half first
            st[k] = 1
            fo[sp], fn[sp], st[sp] = fo[k], _half(fn[k]), 0
            sp += 1
            continue
        v = _pairwise_leaf(a, fo[k], fn[k])
        sp -= 1
        while True:                       # hand v up: a left half starts its right; a right half completes its node
            if sp == 0:
                return v
            p = sp - 1
            if st[p] == 1:
                lv[p], st[p] = v, 2
                h = _half(fn[p])
                fo[sp], fn[sp], st[sp] = fo[p] + h, fn[p] - h, 0
                sp += 1
                break
            v = lv[p] + v
            sp -= 1


@njit(cache=True, nogil=True, boundscheck=False)
def rmsnorm_rows(x, weight, has_weight, eps, out):
    """out [N, n] = x / sqrt(mean(x * x) + eps) [* weight] per row of x [N, n] float32 (ops.rmsnorm: the squares,
    numpy's pairwise sum, the mean's float64 division by n, the float32 add, sqrt, divide, multiply)."""
    N, n = x.shape
    sq = np.empty(n, F32)
    for t in range(N):
        for i in range(n):
            sq[i] = x[t, i] * x[t, i]
        den = np.sqrt(F32(np.float64(pairwise_sum(sq, 0, n)) / np.float64(n)) + eps)
        if has_weight:
            for i in range(n):
                out[t, i] = (x[t, i] / den) * weight[i]
        else:
            for i in range(n):
                out[t, i] = x[t, i] / den
    return out


_NO_WEIGHT = np.zeros(1, F32)


def rmsnorm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """ops.rmsnorm of float32 x (any shape, last axis normalised) with weight None or float32 [x.shape[-1]]."""
    n = x.shape[-1]
    xc = np.ascontiguousarray(x).reshape(-1, n)
    out = np.empty(xc.shape, F32)
    w = _NO_WEIGHT if weight is None else np.ascontiguousarray(weight)
    rmsnorm_rows(xc, w, weight is not None, F32(eps), out)
    return out.reshape(x.shape)


@njit(cache=True, nogil=True, boundscheck=False)
def hc_collapse(X, pre, out):
    """out [T, D] = sum_j pre[:, j] * X[:, j] (ops.hc_collapse: the products, summed over j first to last)."""
    T, n, D = X.shape
    for t in range(T):
        for d in range(D):
            s = pre[t, 0] * X[t, 0, d]
            for j in range(1, n):
                s += pre[t, j] * X[t, j, d]
            out[t, d] = s
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def fp8_fake_quant_rows(x, block, inv, floor, out):
    """ops.fp8_fake_quant on rows x [R, n] float32 (n a multiple of block) into out, numpy's operations in its
    order, each rounded to float32 as numpy rounds it: amax = max(max |x|, floor); s = 2^e from frexp(amax * inv)
    (e - 1 when the mantissa is 0.5); v = clip(x / s, -448, 448); (sign(v) * rint(|v| / step)) * step * s with
    step = 2^(max(exponent(|v|) - 1, -6) - 3). Returns False (out unfinished) where a block's amax is not finite:
    the caller then takes numpy's path."""
    R, n = x.shape
    for r in range(R):
        for b0 in range(0, n, block):
            amax = abs(x[r, b0])
            for i in range(b0 + 1, b0 + block):
                a = abs(x[r, i])
                if not a <= amax:                # a NaN wins, as numpy's max propagates it
                    amax = a
            if not amax >= floor:
                amax = floor if amax == amax else amax
            if not np.isfinite(amax):
                return False
            m, e = math.frexp(float(np.float32(amax * inv)))
            if m == 0.5:
                e -= 1
            s = np.float32(math.ldexp(1.0, e))
            for i in range(b0, b0 + block):
                v = np.float32(x[r, i] / s)
                v = min(max(v, np.float32(-448)), np.float32(448))
                a = abs(v)
                _, ea = math.frexp(float(a))
                step = np.float32(math.ldexp(1.0, max(ea - 1, -6) - 3))
                sg = np.float32(1) if v > 0 else (np.float32(-1) if v < 0 else np.float32(0))
                q = np.float32(sg * np.float32(np.rint(np.float32(a / step))))
                out[r, i] = np.float32(np.float32(q * step) * s)
    return True


@njit(cache=True, nogil=True, boundscheck=False)
def rope_rows(out, cos, sin):
    """ops.rope_tail's rotation in place on the last 2 * cos.shape[1] columns of out [T, G, d] float32 (G: the
    axes between, flattened), pair i of row t by (cos, sin)[t, i]: x0 * c - x1 * s, x0 * s + x1 * c, each product
    and sum rounded to float32 (numpy's order)."""
    T, G, d = out.shape
    h = cos.shape[1]
    o = d - 2 * h
    for t in range(T):
        for g in range(G):
            for i in range(h):
                x0, x1 = out[t, g, o + 2 * i], out[t, g, o + 2 * i + 1]
                c, s = cos[t, i], sin[t, i]
                out[t, g, o + 2 * i] = np.float32(x0 * c) - np.float32(x1 * s)
                out[t, g, o + 2 * i + 1] = np.float32(x0 * s) + np.float32(x1 * c)


@njit(cache=True, nogil=True, boundscheck=False)
def hc_mix_exp_inputs(g, xf, scale, base, n, eps, out):
    """The arguments of ops.hc_coeffs' exps, out [T, 2n + n*n] from g = xf @ fn.T [T, 2n + n*n] (BLAS, the
    caller's) and the state rows xf [T, K]: m = g / sqrt(mean(xf * xf) + eps) (ops.hc_mixes: numpy's pairwise
    sum, the mean's float64 division, float32 add, sqrt, divide); pre's and post's -(m * scale + base) (sigmoid's
    exp(-x)); the comb's m * scale[2] + base - its row's max (ops.sinkhorn's exp(C - C.max(-1)); a NaN in a row
    is that row's max, as numpy's max gives it)."""
    T, K = xf.shape
    sq = np.empty(K, F32)
    z = np.empty(n, F32)
    for t in range(T):
        for i in range(K):
            sq[i] = xf[t, i] * xf[t, i]
        den = np.sqrt(F32(np.float64(pairwise_sum(sq, 0, K)) / np.float64(K)) + eps)
        for j in range(2 * n):
            out[t, j] = -((g[t, j] / den) * scale[j // n] + base[j])
        for r in range(n):
            o = 2 * n + r * n
            for k in range(n):
                z[k] = (g[t, o + k] / den) * scale[2] + base[o + k]
            mx = z[0]
            for k in range(1, n):
                if mx != mx:
                    break
                if z[k] != z[k] or z[k] > mx:
                    mx = z[k]
            for k in range(n):
                out[t, o + k] = z[k] - mx
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def hc_mix_from_exps(e, n, hc_eps, iters, pre, post, comb):
    """ops.hc_coeffs' (pre, post, comb) from e = exp(hc_mix_exp_inputs(...)): pre = 1 / (1 + e) + hc_eps,
    post = 2 * (1 / (1 + e)), comb = the Sinkhorn rounds (sinkhorn_rounds) on the comb's exps."""
    T = e.shape[0]
    for t in range(T):
        for j in range(n):
            pre[t, j] = F32(1) / (F32(1) + e[t, j]) + hc_eps
            post[t, j] = F32(2) * (F32(1) / (F32(1) + e[t, n + j]))
            for k in range(n):
                comb[t, j, k] = e[t, 2 * n + j * n + k]
    sinkhorn_rounds(comb, iters, hc_eps)


@njit(cache=True, nogil=True, boundscheck=False)
def swiglu_gate_neg(g, clamp, gc, neg):
    """gc = np.minimum(g, clamp) where clamp > 0 (NaN stays NaN, as numpy's minimum gives it) else g, and
    neg = -gc (silu's sigmoid's exp(-x) argument), g / gc / neg float32 [N, F]."""
    N, F = g.shape
    for t in range(N):
        for i in range(F):
            v = g[t, i]
            if clamp > 0 and not (v != v) and v > clamp:
                v = clamp
            gc[t, i] = v
            neg[t, i] = -v


@njit(cache=True, nogil=True, boundscheck=False)
def swiglu_rows(gc, e, u, clamp, weight, has_weight, out):
    """out = ((gc * (1 / (1 + e))) * clip(u, -clamp, clamp)) [* weight[t]] from e = exp(-gc) (ops.swiglu_hidden:
    silu(x) = x * sigmoid(x), numpy's clip as maximum then minimum, NaN kept; each product rounded to float32)."""
    N, F = gc.shape
    for t in range(N):
        for i in range(F):
            v = u[t, i]
            if clamp > 0 and not (v != v):
                if v < -clamp:
                    v = -clamp
                if v > clamp:
                    v = clamp
            h = (gc[t, i] * (F32(1) / (F32(1) + e[t, i]))) * v
            out[t, i] = h * weight[t] if has_weight else h
    return out


@njit(cache=True, nogil=True, boundscheck=False)
def add_rows_grouped(y, d, tok, gs):
    """For each group g in order: y[tok[gs[g]:gs[g + 1]]] += d[gs[g]:gs[g + 1]] as numpy does it (the group's
    sums from y as it was before the group, then written in order: a repeated row keeps its last write)."""
    D = y.shape[1]
    for g in range(gs.shape[0] - 1):
        a, b = gs[g], gs[g + 1]
        tmp = np.empty((b - a, D), F32)
        for j in range(a, b):
            for i in range(D):
                tmp[j - a, i] = y[tok[j], i] + d[j, i]
        for j in range(a, b):
            for i in range(D):
                y[tok[j], i] = tmp[j - a, i]
    return y
