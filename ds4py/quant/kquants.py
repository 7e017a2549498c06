"""K-quants Q2_K and Q4_K (super-blocks of 256 weights), decode and llama.cpp-style encode.

Q4_K block (144 bytes): f16 d, f16 dmin, 12 bytes of packed 6-bit (scale, min) for 8 sub-blocks of 32,
128 bytes of 4-bit q. Chunk c (64 weights) uses qs[32c:32c+32]: low nibbles are sub-block 2c, high
nibbles sub-block 2c+1.   value = (d * sc) * q - dmin * m
Q2_K block (84 bytes): 16 bytes (low nibble scale, high nibble min, one per 16 weights), 64 bytes of 2-bit
q, f16 d, f16 dmin. Weight 128h + 32j + l is bits 2j..2j+1 of qs[32h + l].
    value = (d * (sc & 15)) * q - dmin * (sc >> 4)

The encoders follow llama.cpp's reference (`make_qkx2_quants`: a weighted least-squares fit of scale and
min, tried at 21 / 16 trial inverse scales), vectorised over all sub-blocks at once.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
Q4_K_BYTES = 2 + 2 + 12 + 128
Q2_K_BYTES = 16 + 64 + 2 + 2


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def q4_k_scale_min(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12 scale bytes into 8 six-bit scales and 8 six-bit mins, each (n, 8)."""
    a, b, c = sc12[:, 0:4], sc12[:, 4:8], sc12[:, 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def dequant_q4_k(raw: np.ndarray) -> np.ndarray:
    blk = raw.reshape(-1, Q4_K_BYTES)
    n = blk.shape[0]
    d, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])
    sc, mn = q4_k_scale_min(blk[:, 4:16])
    dl = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    qs = blk[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 15).reshape(n, 8, 32).astype(np.float32)
    q *= dl
    q -= ml
    return q.reshape(n, QK_K)


def dequant_q2_k(raw: np.ndarray) -> np.ndarray:
    blk = raw.reshape(-1, Q2_K_BYTES)
    n = blk.shape[0]
    sc = blk[:, 0:16]
    d, dmin = _f16(blk[:, 80:82]), _f16(blk[:, 82:84])
    dl = (d * (sc & 15).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (sc >> 4).astype(np.float32)).reshape(n, 16, 1)
    qs = blk[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (qs & 3).reshape(n, 16, 16).astype(np.float32)
    q *= dl
    q -= ml
    return q.reshape(n, QK_K)


# ----------------------------------------------------------------------------------------------- encode
def make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                     use_mad: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x (sub-blocks), fit x ~ scale * L - mn with L in [0, nmax]; returns (scale, mn), both (rows,).

    Same search as llama.cpp: start from the min/max grid, then try nstep+1 inverse scales
    (rmin + rdelta*i + nmax) / (max - min) with the weighted least-squares (scale, min) for each;
    keep the lowest weighted error (squared, or absolute when use_mad). mn is returned positive
    (value = scale*L - mn); the fitted min is clamped to <= 0.
    """
    x = x.astype(np.float32)
    dot = lambda a, b: np.einsum("ij,ij->i", a, b)          # noqa: E731  (fused multiply + row sum)
    lo = np.minimum(x.min(axis=1), 0)
    rng = x.max(axis=1) - lo
    flat = rng == 0
    rng = np.where(flat, 1, rng).astype(np.float32)
    xs = x - lo[:, None]
    sum_w = w.sum(axis=1)
    sum_x = dot(w, x)
    sum_x2 = dot(w * x, x)

    def err(scale, mn, L, sum_l, sum_l2, sum_xl):
        if use_mad:
            return dot(w, np.abs(scale[:, None] * L + mn[:, None] - x))
        # sum w (s L + m - x)^2 expanded, from sums already at hand
        return (scale * scale * sum_l2 + 2 * scale * mn * sum_l + mn * mn * sum_w
                - 2 * scale * sum_xl - 2 * mn * sum_x + sum_x2)

    def fit(iscale):
        L = np.clip(np.rint(iscale[:, None] * xs), 0, nmax)
        wL = w * L
        return L, wL.sum(axis=1), dot(wL, L), dot(wL, x)

    iscale = (nmax / rng).astype(np.float32)
    L, sl, sl2, sxl = fit(iscale)
    best_scale, best_min = 1 / iscale, lo.copy()
    best_err = err(best_scale, best_min, L, sl, sl2, sxl)
    for i in range(nstep + 1):
        La, sum_l, sum_l2, sum_xl = fit(((rmin + rdelta * i + nmax) / rng).astype(np.float32))
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, 1)
        scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        mn = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = mn > 0   # a positive offset is not representable: refit the scale alone with min 0
        scale = np.where(pos, sum_xl / np.where(sum_l2 > 0, sum_l2, 1), scale)
        mn = np.where(pos, 0, mn)
        e = err(scale, mn, La, sum_l, sum_l2, sum_xl)
        better = ok & (e < best_err)
        best_err = np.where(better, e, best_err)
        best_scale = np.where(better, scale, best_scale)
        best_min = np.where(better, mn, best_min)
    best_scale = np.where(flat, 0, best_scale).astype(np.float32)
    best_min = np.where(flat, lo, best_min).astype(np.float32)
    return best_scale, -best_min


def _requant(x: np.ndarray, d: np.ndarray, dm: np.ndarray, nmax: int) -> np.ndarray:
    """Final integer codes for the stored (f16-rounded) scales; sub-blocks with d == 0 get code 0."""
    dz = d == 0
    q = np.rint((x + dm) / np.where(dz, 1, d))
    return np.where(dz, 0, np.clip(q, 0, nmax)).astype(np.uint8)


def _scale_codes(v: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block scales (or mins) v [n, sub] -> codes rint(v * nmax / max) capped at nmax, and the max [n]."""
    vmax = v.max(axis=1)
    inv = np.where(vmax > 0, nmax / np.where(vmax > 0, vmax, 1), 0)
    return np.minimum(np.rint(inv[:, None] * v), nmax).astype(np.uint8), vmax


def quant_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 (n*256,) -> Q4_K bytes (n, 144)."""
    xb = np.asarray(x, dtype=np.float32).reshape(-1, 8, 32)
    n = xb.shape[0]
    sub = xb.reshape(-1, 32)
    av = np.sqrt((sub * sub).sum(axis=1, keepdims=True) / 32)
    scale, mn = make_qkx2_quants(sub, av + np.abs(sub), 15, -1.0, 0.1, 20, False)
    scale, mn = scale.reshape(n, 8), mn.reshape(n, 8)
    ls, max_scale = _scale_codes(scale, 63)
    lm, max_min = _scale_codes(mn, 63)
    d16 = (max_scale / 63).astype(np.float16)
    m16 = (max_min / 63).astype(np.float16)
    sc12 = np.empty((n, 12), np.uint8)
    sc12[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    sc12[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    sc12[:, 8:12] = (ls[:, 4:] & 15) | ((lm[:, 4:] & 15) << 4)
    d = d16.astype(np.float32)[:, None] * ls.astype(np.float32)
    dm = m16.astype(np.float32)[:, None] * lm.astype(np.float32)
    L = _requant(xb, d[..., None], dm[..., None], 15)                  # (n, 8, 32)
    L = L.reshape(n, 4, 2, 32)
    out = np.empty((n, Q4_K_BYTES), np.uint8)
    out[:, 0:2] = d16.reshape(n, 1).view(np.uint8)
    out[:, 2:4] = m16.reshape(n, 1).view(np.uint8)
    out[:, 4:16] = sc12
    out[:, 16:] = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(n, 128)
    return out


def quant_q2_k(x: np.ndarray) -> np.ndarray:
    """float32 (n*256,) -> Q2_K bytes (n, 84)."""
    xb = np.asarray(x, dtype=np.float32).reshape(-1, 16, 16)
    n = xb.shape[0]
    sub = xb.reshape(-1, 16)
    scale, mn = make_qkx2_quants(sub, np.abs(sub), 3, -0.5, 0.1, 15, True)
    scale, mn = scale.reshape(n, 16), mn.reshape(n, 16)
    ls, max_scale = _scale_codes(scale, 15)
    lm, max_min = _scale_codes(mn, 15)
    d16 = np.where(max_scale > 0, max_scale / 15, 0).astype(np.float16)
    m16 = np.where(max_min > 0, max_min / 15, 0).astype(np.float16)
    d = d16.astype(np.float32)[:, None] * ls.astype(np.float32)
    dm = m16.astype(np.float32)[:, None] * lm.astype(np.float32)
    L = _requant(xb, d[..., None], dm[..., None], 3).reshape(n, 2, 4, 32)
    out = np.empty((n, Q2_K_BYTES), np.uint8)
    out[:, 0:16] = ls | (lm << 4)
    out[:, 16:80] = (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(n, 64)
    out[:, 80:82] = d16.reshape(n, 1).view(np.uint8)
    out[:, 82:84] = m16.reshape(n, 1).view(np.uint8)
    return out
