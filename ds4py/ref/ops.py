"""The numpy building blocks of the V4 Flash forward (MODEL.md §2), in float32.

Each function is small and stateless so that the CUDA kernels' numpy twins can call it directly.
Shapes: T tokens, H heads, D hidden, hd head dim, rd rope dims, hc hyper-connection copies.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

import numpy as np

from ds4py.host.rope import layer_rope_freqs, rope_freqs  # noqa: F401 (ref.ops' names)

F32 = np.float32


# ---- row stability (docs/engine.md "Row stability") ------------------------------------------------------
# A BLAS matmul does not give a row the same bits whatever else is in it: OpenBLAS forwards a 1-row sgemm to
# gemv (another summation order) and picks its microkernels by the row count (measured here: a row of a 2..19
# row product differs from the same row alone, and which counts differ depends on the CPU kernel). In a
# row-stable step every row-wise product runs one token row at a time, so a row sees exactly the calls (shapes,
# operands, order) a one-row step makes: the k + 1 rows a speculative verify step computes are bit for bit the
# rows k + 1 decode steps compute, and greedy speculation is byte-identical to greedy decoding. The switch is an
# explicit argument (forward(..., row_stable=)): a step turns it into the row groups of its products
# (row_groups), which every product takes as `seg`.
def row_groups(seg: list[slice] | None, rows: int, row_stable: bool) -> list[slice] | None:
    """The row groups of a product over `rows` token rows: each row alone in a row-stable step, else `seg`
    (one group per sequence; None: all rows in one product)."""
    if row_stable and rows > 1:
        return [slice(t, t + 1) for t in range(rows)]
    return seg


#
# Batch invariance (docs/engine.md "Batch invariance") is the same fact across sequences: a step's rows hold
# several sequences (seg: their row slices, in order), and every product runs once per sequence, so that a
# sequence's rows see the calls its own step would make, whatever else the step holds.


def per_row(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, seg: list[slice] | None = None) -> np.ndarray:
    """fn(x) over token rows (axis 0): fn of each group's rows x[s] for s in seg (several sequences, or each
    row alone in a row-stable step: row_groups), stacked."""
    if seg is not None and len(seg) > 1:
        return np.concatenate([fn(x[s]) for s in seg])
    return fn(x)


def mm(a: np.ndarray, b: np.ndarray, seg: list[slice] | None = None) -> np.ndarray:
    """a @ b for activations `a` with token rows on axis 0: one product per row group (seg: per sequence, or
    per row in a row-stable step)."""
    return per_row(lambda r: r @ b, a, seg)


# ---- norms -------------------------------------------------------------------------------------------
def rmsnorm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """x * rsqrt(mean(x²) + eps) [* weight] over the last axis."""
    x = x.astype(F32, copy=False)
    fast = _ops_jit()
    if (fast is not None and x.ndim >= 1 and x.size and
            (weight is None or (weight.dtype == F32 and weight.shape == x.shape[-1:]))):
        return fast.rmsnorm(x, weight, eps)                          # numpy's operations compiled
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps))
    return y * weight if weight is not None else y


# ---- rotary embedding (the frequencies are ds4py.host.rope's, shared with the CUDA engine) -------------
def rope(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the last axis by pos·f_i. x: [T, ..., rd], pos: [T]."""
    ang = np.asarray(pos, dtype=F32)[:, None] * freqs[None, :]            # [T, rd/2], fp32 like the official
    cos, sin = np.cos(ang), np.sin(ang)
    if inverse:
        sin = -sin
    shape = (len(ang),) + (1,) * (x.ndim - 2) + (freqs.size,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty(x.shape, dtype=F32)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def rope_tail(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray, inverse: bool = False) -> np.ndarray:
    """RoPE on the last rd dims of x (the first dims are left alone); returns a new array."""
    rd = 2 * freqs.size
    out = x.astype(F32, copy=True)
    fast = _ops_jit()
    if (fast is not None and x.ndim >= 2 and out.size and rd <= x.shape[-1] and freqs.dtype == F32
            and out.flags.c_contiguous):                                  # (rotated in place through a view)
        ang = np.asarray(pos, dtype=F32)[:, None] * freqs[None, :]        # numpy's cos / sin, as rope takes them
        sin = np.sin(ang)
        fast.rope_rows(out.reshape(len(ang), -1, x.shape[-1]), np.cos(ang), -sin if inverse else sin)
        return out                                                        # rope's operations compiled
    out[..., -rd:] = rope(x[..., -rd:], pos, freqs, inverse)
    return out


# ---- fake quantisation (part of the model's numerics; MODEL.md §2.3) --------------------------------------
def pow2_scale(amax: np.ndarray, inv_max: float) -> np.ndarray:
    """2^ceil(log2(amax · inv_max)), computed in fp32 like the official kernel's bit trick."""
    x = amax.astype(F32) * F32(inv_max)
    m, e = np.frexp(x)
    e = np.where(m == 0.5, e - 1, e)        # exact powers of two keep their exponent
    return np.ldexp(F32(1.0), e).astype(F32)


def round_e4m3(y: np.ndarray) -> np.ndarray:
    """Round to the nearest FP8 e4m3 value (ties to even); |y| <= 448 assumed (callers clip)."""
    a = np.abs(y)
    _, e = np.frexp(a)
    step = np.ldexp(F32(1.0), np.maximum(e - 1, -6) - 3).astype(F32)   # 3 mantissa bits; subnormal step 2^-9
    return (np.sign(y) * np.rint(a / step) * step).astype(F32)


def round_e2m1(y: np.ndarray) -> np.ndarray:
    """Round to the nearest FP4 e2m1 value {0, .5, 1, 1.5, 2, 3, 4, 6} (ties to even); |y| <= 6 assumed."""
    a = np.abs(y)
    step = np.where(a < 2, F32(0.5), np.where(a < 4, F32(1.0), F32(2.0)))
    return (np.sign(y) * np.rint(a / step) * step).astype(F32)


def fp8_fake_quant(x: np.ndarray, block: int = 64) -> np.ndarray:
    """FP8 e4m3 quant-dequant in blocks of `block` along the last axis, scale 2^ceil(log2(amax/448))."""
    fast = _ops_jit()
    if fast is not None and x.ndim >= 1 and x.size and block > 0 and x.shape[-1] % block == 0:
        xc = np.ascontiguousarray(x, dtype=F32)
        out = np.empty(xc.shape, F32)
        if fast.fp8_fake_quant_rows(xc.reshape(-1, xc.shape[-1]), block, F32(1.0 / 448.0), F32(1e-4),
                                    out.reshape(-1, xc.shape[-1])):
            return out                                         # numpy's operations compiled (finite blocks)
    xb = x.astype(F32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), F32(1e-4))
    s = pow2_scale(amax, 1.0 / 448.0)
    return (round_e4m3(np.clip(xb / s, -448, 448)) * s).reshape(x.shape)


def fp4_fake_quant(x: np.ndarray, block: int = 32) -> np.ndarray:
    """FP4 e2m1 quant-dequant in blocks of `block` along the last axis, scale 2^ceil(log2(amax/6))."""
    xb = x.astype(F32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), F32(6 * 2.0 ** -126))
    s = pow2_scale(amax, 1.0 / 6.0)
    return (round_e2m1(np.clip(xb / s, -6, 6)) * s).reshape(x.shape)


def nvfp4_fake_quant(x: np.ndarray, block: int = 16) -> np.ndarray:
    """FP4 e2m1 quant-dequant in blocks of `block` with an FP8 e4m3 scale e4m3(amax/6), amax >= 6·2^-9 (the V4.1
    compressed rows' NVFP4-like rounding, MODEL.md §3)."""
    xb = x.astype(F32).reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), F32(6 * 2.0 ** -9))
    s = round_e4m3(np.minimum(amax / F32(6), F32(448)))
    return (round_e2m1(np.clip(xb / s, -6, 6)) * s).reshape(x.shape)


def f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(F32)


def q8_0_round(x: np.ndarray) -> np.ndarray:
    """Round activations the way ggml's Q8_0 dot products see them: blocks of 32, d = amax/127 stored as f16."""
    xb = x.astype(F32).reshape(*x.shape[:-1], -1, 32)
    d = np.abs(xb).max(-1, keepdims=True) / F32(127)
    q = np.rint(xb / np.where(d > 0, d, F32(1)))
    return (q * d.astype(np.float16).astype(F32)).reshape(x.shape)


def q8_k_round(x: np.ndarray) -> np.ndarray:
    """ggml's Q8_K activation rounding (K-quant / IQ dot products): blocks of 256, scale from the signed
    value of largest magnitude, q = rint(−127·x/max) clipped at 127, d = −max/127 in f32."""
    xb = x.astype(F32).reshape(*x.shape[:-1], -1, 256)
    mx = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
    iscale = np.where(mx != 0, F32(-127) / np.where(mx != 0, mx, F32(1)), F32(0))
    q = np.minimum(np.rint(xb * iscale), 127)
    d = np.where(iscale != 0, F32(1) / np.where(iscale != 0, iscale, F32(1)), F32(0))
    return (q * d).astype(F32).reshape(x.shape)


@lru_cache(maxsize=4)
def hadamard_matrix(n: int) -> np.ndarray:
    """Natural-order Sylvester Hadamard matrix scaled by n^-1/2 (symmetric, orthonormal)."""
    h = np.ones((1, 1), dtype=F32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / F32(math.sqrt(n))).astype(F32)


def hadamard(x: np.ndarray, seg: list[slice] | None = None) -> np.ndarray:
    return mm(x, hadamard_matrix(x.shape[-1]), seg)


# ---- hyper-connections (mHC, MODEL.md §2.2) -----------------------------------------------------------------
def hc_mixes(X: np.ndarray, fn: np.ndarray, eps: float, seg: list[slice] | None = None) -> np.ndarray:
    """m = (fn @ flatten(X)) · rsqrt(mean(flatten(X)²) + eps). X: [T, hc, D] -> [T, rows(fn)]."""
    xf = X.reshape(X.shape[0], -1)
    return mm(xf, fn.T, seg) / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + F32(eps))


_TWINS: list = []          # ds4py.ref.ops_jit once found loaded (a dozen calls a layer ask)


def _ops_jit():
    """ds4py.ref.ops_jit (compiled twins giving these ops' bits) once the compiled kernels are loaded, else None:
    the numpy reference never imports numba itself."""
    if _TWINS:
        return _TWINS[0]
    from ds4py.quant import jit

    if not jit.loaded():
        return None
    from ds4py.ref import ops_jit

    _TWINS.append(ops_jit)
    return ops_jit


def sinkhorn(C: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """Row softmax (+eps), column-normalise, then iters-1 rounds of row- then column-normalising. C: [T, j, k]."""
    eps = F32(eps)
    C = np.exp(C - C.max(-1, keepdims=True))
    fast = _ops_jit()
    if fast is not None and C.dtype == F32 and C.ndim == 3 and 0 < C.shape[1] == C.shape[2] <= fast.MAX_N:
        return fast.sinkhorn_rounds(np.ascontiguousarray(C), int(iters), eps)   # numpy's operations compiled
    C = C / C.sum(-1, keepdims=True) + eps
    C = C / (C.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdims=True) + eps)
        C = C / (C.sum(-2, keepdims=True) + eps)
    return C


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (F32(1) / (F32(1) + np.exp(-x))).astype(F32)


def hc_coeffs(X: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, norm_eps: float, hc_eps: float,
              iters: int, seg: list[slice] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mixes of the state X: (pre [T, hc], post [T, hc], comb [T, hc, hc]); seg: the rows' sequences."""
    hc = X.shape[1]
    fast = _ops_jit()
    if (fast is not None and X.dtype == fn.dtype == scale.dtype == base.dtype == F32 and X.ndim == 3
            and 0 < hc <= fast.MAX_N and fn.shape == (hc * (2 + hc), X.shape[1] * X.shape[2])
            and scale.shape == (3,) and base.shape == (hc * (2 + hc),)):
        xf = np.ascontiguousarray(X.reshape(X.shape[0], -1))
        g = np.ascontiguousarray(mm(xf, fn.T, seg), dtype=F32)
        e_in = fast.hc_mix_exp_inputs(g, xf, scale, base, hc, F32(norm_eps), np.empty_like(g))
        with np.errstate(over="ignore"):
            e = np.exp(e_in)                              # numpy's exp, one call for the three (same bits)
        T = len(X)
        pre, post, comb = np.empty((T, hc), F32), np.empty((T, hc), F32), np.empty((T, hc, hc), F32)
        fast.hc_mix_from_exps(e, hc, F32(hc_eps), int(iters), pre, post, comb)  # numpy's operations compiled
        return pre, post, comb
    m = hc_mixes(X, fn, norm_eps, seg)
    pre = sigmoid(m[:, :hc] * scale[0] + base[:hc]) + F32(hc_eps)
    post = 2 * sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = sinkhorn((m[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(-1, hc, hc), iters, hc_eps)
    return pre, post, comb


def hc_collapse(X: np.ndarray, pre: np.ndarray) -> np.ndarray:
    """Σ_j pre_j X_j; products then a sum over j, in the official order. X [T, hc, D], pre [T, hc] -> [T, D]."""
    fast = _ops_jit()
    if (fast is not None and X.dtype == F32 and pre.dtype == F32 and X.ndim == 3 and 0 < X.shape[1] <= fast.MAX_N
            and pre.shape == X.shape[:2]):
        return fast.hc_collapse(np.ascontiguousarray(X), np.ascontiguousarray(pre), np.empty((X.shape[0], X.shape[2]), F32))
    return (pre[:, :, None] * X).sum(1)


def hc_pre(X: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, norm_eps: float, hc_eps: float,
           iters: int, seg: list[slice] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Collapse the hc copies to one sub-layer input; returns (x [T, D], post [T, hc], comb [T, hc, hc])."""
    pre, post, comb = hc_coeffs(X, fn, scale, base, norm_eps, hc_eps, iters, seg)
    return hc_collapse(X, pre), post, comb


def hc_post(f: np.ndarray, X: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """X'_k = post_k · f + Σ_j comb[j, k] · X_j."""
    fast = _ops_jit()
    if (fast is not None and all(a.dtype == F32 for a in (f, X, post, comb)) and X.ndim == 3
            and 0 < X.shape[1] <= fast.MAX_N and f.shape == (X.shape[0], X.shape[2])
            and post.shape == X.shape[:2] and comb.shape == (X.shape[0], X.shape[1], X.shape[1])):
        return fast.hc_post(np.ascontiguousarray(f), np.ascontiguousarray(X), np.ascontiguousarray(post),
                            np.ascontiguousarray(comb), np.empty(X.shape, F32))     # numpy's operations compiled
    return post[:, :, None] * f[:, None, :] + (comb[:, :, :, None] * X[:, :, None, :]).sum(1)


def hc_head(X: np.ndarray, fn: np.ndarray, scale: np.ndarray, base: np.ndarray, norm_eps: float,
            hc_eps: float, seg: list[slice] | None = None) -> np.ndarray:
    """Final collapse: y = Σ_j (sigmoid(m_j·scale + base_j) + hc_eps) X_j."""
    pre = sigmoid(hc_mixes(X, fn, norm_eps, seg) * scale[0] + base) + F32(hc_eps)
    return (pre[:, :, None] * X).sum(1)


# ---- attention pieces (MODEL.md §2.3) -------------------------------------------------------------------------
def attention_with_sink(q: np.ndarray, kv: np.ndarray, mask: np.ndarray, sink: np.ndarray,
                        scale: float) -> np.ndarray:
    """o_h = Σ exp(s−m)·v / (Σ exp(s−m) + exp(sink_h − m)), K = V = kv.
    q: [T, H, hd], kv: [N, hd], mask: [T, N] bool (True = attend), sink: [H] -> [T, H, hd]."""
    s = (q @ kv.T) * F32(scale)                                   # [T, H, N]
    s = np.where(mask[:, None, :], s, F32(-np.inf))
    m = s.max(-1, keepdims=True)                      # every query sees at least its own row
    p = np.exp(s - m)
    denom = p.sum(-1) + np.exp(sink[None, :] - m[..., 0])
    return (p @ kv) / denom[..., None]


def compress_pool(kv: np.ndarray, score: np.ndarray, ratio: int, overlap: bool,
                  prev_kv: np.ndarray | None = None, prev_score: np.ndarray | None = None) -> np.ndarray:
    """Gated pooling of whole groups: per channel, softmax over the group's slots of `score`, weights on `kv`.
    kv, score: [G·ratio, c·d] (score already includes ape). Overlap (ratio 4, c = 2): group g pools its own
    tokens through half B ([d:]) and group g−1's tokens through half A ([:d]); prev_* is the group before the
    first one (None at the sequence start: kv 0, score −inf). Returns [G, d]."""
    G = kv.shape[0] // ratio
    kv = kv.reshape(G, ratio, -1)
    score = score.reshape(G, ratio, -1)
    if overlap:
        d = kv.shape[-1] // 2
        if prev_kv is None:
            prev_kv = np.zeros((ratio, 2 * d), F32)
            prev_score = np.full((ratio, 2 * d), -np.inf, F32)
        pk = np.concatenate([prev_kv[None], kv[:-1]], 0)[..., :d]
        ps = np.concatenate([prev_score[None], score[:-1]], 0)[..., :d]
        kv = np.concatenate([pk, kv[..., d:]], 1)           # [G, 2·ratio, d]
        score = np.concatenate([ps, score[..., d:]], 1)
    w = np.exp(score - score.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    return (w * kv).sum(1)


# ---- MoE (MODEL.md §2.4) ----------------------------------------------------------------------------------------
def sqrt_softplus(x: np.ndarray) -> np.ndarray:
    return np.sqrt(np.logaddexp(F32(0), x)).astype(F32)


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def swiglu(x: np.ndarray, w1: np.ndarray, w3: np.ndarray, w2: np.ndarray, clamp: float,
           weight: np.ndarray | None = None, act_in=None, act_mid=None, seg: list[slice] | None = None) -> np.ndarray:
    """y = w2(silu(min(w1 x, c)) · clamp(w3 x, −c, c) [· weight]); weights are [out, in].
    act_in / act_mid: optional activation rounding before w1,w3 / before w2 (ds4 emulation); seg: the rows'
    sequences (ops.mm)."""
    xi = act_in(x) if act_in is not None else x
    return swiglu_of(xi, lambda a: mm(a, w1.T, seg), lambda a: mm(a, w3.T, seg),
                     lambda a: mm(act_mid(a) if act_mid is not None else a, w2.T, seg), clamp, weight)


def swiglu_of(x: np.ndarray, gate, up, down, clamp: float, weight: np.ndarray | None = None) -> np.ndarray:
    """swiglu with the three projections given as functions (a -> a @ W.T, e.g. Weights.linear)."""
    g = gate(x)
    u = up(x)
    return down(swiglu_hidden(g, u, clamp, weight))


_NO_ROW_WEIGHT = np.zeros(1, F32)


def swiglu_hidden(g: np.ndarray, u: np.ndarray, clamp: float, weight: np.ndarray | None = None) -> np.ndarray:
    """swiglu's hidden activation from the gate and up products: silu(min(g, c)) · clamp(u, −c, c) [· weight]."""
    fast = _ops_jit()
    if (fast is not None and g.dtype == u.dtype == F32 and g.ndim == 2 and g.shape == u.shape
            and (weight is None or (weight.dtype == F32 and weight.shape == g.shape[:1]))):
        g, u = np.ascontiguousarray(g), np.ascontiguousarray(u)
        gc, neg = np.empty_like(g), np.empty_like(g)
        c = F32(clamp if clamp > 0 else 0)
        fast.swiglu_gate_neg(g, c, gc, neg)
        with np.errstate(over="ignore"):
            e = np.exp(neg, out=neg)                        # numpy's exp (sigmoid's), in place
        w = _NO_ROW_WEIGHT if weight is None else np.ascontiguousarray(weight)
        return fast.swiglu_rows(gc, e, u, c, w, weight is not None, np.empty_like(g))  # numpy's operations compiled
    if clamp > 0:
        g = np.minimum(g, F32(clamp))
        u = np.clip(u, F32(-clamp), F32(clamp))
    h = silu(g) * u
    if weight is not None:
        h = h * weight[:, None]
    return h


def add_rows_grouped(y: np.ndarray, d: np.ndarray, tok: np.ndarray, gs: np.ndarray) -> np.ndarray:
    """For each group g in order, y[tok[gs[g]:gs[g+1]]] += d[gs[g]:gs[g+1]] (in place; returns y)."""
    fast = _ops_jit()
    if (fast is not None and y.dtype == d.dtype == F32 and y.ndim == d.ndim == 2 and y.flags.c_contiguous
            and d.shape[1:] == y.shape[1:]):
        return fast.add_rows_grouped(y, np.ascontiguousarray(d), np.ascontiguousarray(tok, dtype=np.int64),
                                     np.ascontiguousarray(gs, dtype=np.int64))   # numpy's adds compiled
    for a, b in zip(gs[:-1], gs[1:]):
        y[tok[a:b]] += d[a:b]
    return y
