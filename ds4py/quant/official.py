"""The official DeepSeek checkpoint's low-precision storage (MODEL.md §6).

* float8 e4m3 (fn variant: no infinities; S.1111.111 is NaN; max 448): sign bit 7, exponent bits 3-6
  (bias 7), mantissa bits 0-2; exponent 0 is subnormal: man/8 * 2^-6.
* e8m0 scale byte e: 2^(e-127); 0xFF is NaN.
* e2m1 (FP4) nibble: bit 3 sign, bits 0-2 index into magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6].
Dense linears: e4m3 weight [out, in] with one e8m0 scale per b x b tile (b = 128 for V4, 32 for V4.1;
edge tiles are partial). Routed experts: two e2m1 per byte (low nibble = even element), one e8m0 scale
per 32 consecutive inputs of a row.
"""

from __future__ import annotations

import numpy as np


def _e4m3_table() -> np.ndarray:
    c = np.arange(256)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp = (c >> 3) & 15
    man = c & 7
    mag = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    val = sign * mag
    val[(c & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


E4M3 = _e4m3_table()                                           # code -> float32
E8M0 = np.array([2.0 ** (e - 127) for e in range(255)] + [np.nan], dtype=np.float32)
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def e4m3_to_f32(codes: np.ndarray) -> np.ndarray:
    return E4M3[np.asarray(codes).view(np.uint8)]


def e8m0_to_f32(codes: np.ndarray) -> np.ndarray:
    return E8M0[np.asarray(codes).view(np.uint8)]


def fp8_block_size(wshape: tuple[int, ...], sshape: tuple[int, ...], prefer: tuple[int, ...] = (128, 32)) -> int:
    """The square tile size b with scale shape == (ceil(out/b), ceil(in/b)).

    Small tensors can fit several b; then `prefer` decides (V4 first), else the smallest power of two.
    """
    out, inp = wshape
    fits = [b for b in (*prefer, *(2 ** k for k in range(1, 13)))
            if (-(-out // b), -(-inp // b)) == tuple(sshape)]
    if not fits:
        raise ValueError(f"FP8 weight {list(wshape)} and scale {list(sshape)} fit no square block size")
    return fits[0]


def dequant_fp8(weight: np.ndarray, scale: np.ndarray, block: int | None = None) -> np.ndarray:
    """e4m3 weight [out, in] with e8m0 tile scales -> float32 [out, in] (exact)."""
    w = np.asarray(weight).view(np.uint8)
    s = np.asarray(scale).view(np.uint8)
    b = block or fp8_block_size(w.shape, s.shape)
    out, inp = w.shape
    x = np.take(E4M3, w)
    sf = E8M0[s]
    for i in range(sf.shape[0]):                      # one band of b rows at a time shares a row of scales
        x[i * b: (i + 1) * b] *= np.repeat(sf[i], b)[:inp]
    return x


def dequant_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Packed e2m1 [out, in/2] (low nibble = even element) with e8m0 per 32 inputs -> float32 [out, in]."""
    p = np.asarray(packed).view(np.uint8)
    s = np.asarray(scale).view(np.uint8)
    rows, half = p.shape
    if s.shape != (rows, half * 2 // 32):
        raise ValueError(f"FP4 weight {list(p.shape)} needs scale {[rows, half * 2 // 32]}, got {list(s.shape)}")
    vals = np.empty((rows, half * 2), np.float32)
    vals[:, 0::2] = E2M1[p & 15]
    vals[:, 1::2] = E2M1[p >> 4]
    return (vals.reshape(rows, -1, 32) * E8M0[s][:, :, None]).reshape(rows, half * 2)


def quant_fp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> official FP4 (packed e2m1 [out, in/2], e8m0 [out, in/32]), like the reference code:
    per 32 inputs scale 2^ceil(log2(amax/6)), codes = nearest e2m1 magnitude, ties to the even code."""
    x = np.asarray(x, dtype=np.float32)
    rows, cols = x.shape
    g = x.reshape(rows, cols // 32, 32)
    amax = np.maximum(np.abs(g).max(axis=2), np.float32(2.0 ** -120))
    e = np.clip(np.ceil(np.log2(amax / 6)), -127, 127).astype(np.int32)
    y = np.abs(g / np.ldexp(np.float32(1), e)[:, :, None])
    mid = (E2M1[:7] + E2M1[1:8]) / 2                          # decision points between magnitudes k and k+1
    code = np.searchsorted(mid, y, side="left")                # y == mid[k] lands on k ...
    tie = (code < 7) & (y == mid[np.minimum(code, 6)])
    code = code + (tie & (code % 2 == 1))                      # ... and moves up when k is odd (ties to even)
    code = code.astype(np.uint8) | np.where(g < 0, np.uint8(8), np.uint8(0))
    code = code.reshape(rows, cols)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8), (e + 127).astype(np.uint8)
