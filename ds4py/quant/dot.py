"""Fused dequantise-and-multiply: y = x @ W.T straight from a GGUF tensor's stored rows.

The decode path of the numpy backend. `dequantize` (ds4py.quant) turns a whole matrix into float32 and a
matmul follows; here a few rows of x (a decode step, a short verify) meet the weights one block of rows at a
time, and a block never exists in float32 beyond what its products need:

* the codes become small integers in one table lookup or a few shifts on 64-bit words (eight codes per
  operation, the K-quant sub-block scales multiplied in while they are still bytes where the product fits),
  then one int -> float32 cast into a reusable scratch buffer sized to stay in the core's cache;
* one batched matmul gives the partial dot products of every scale group (32 or 256 weights) with x;
* the group scales (and K-quant minimums, through per-group sums of x) finish the row sums.

Products are those of the dequantised matrix up to float32 summation order (tests/test_fused.py checks every
format against `dequantize` + matmul). Nothing here keeps state between calls: `Scratch` holds the reusable
buffers (one per thread), `prepare(qtype, x)` the activation-side arrays (shared by every block and thread).

    prep = prepare(qtype, x)                       # x: [T, cols] float32
    y_block = dot_rows(qtype, raw_rows, prep, scratch)    # raw_rows: uint8 [R, row_nbytes] -> [T, R]
"""

from __future__ import annotations

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as Q

from ds4py.quant import iq2, kquants, mxfp4

F32 = np.float32
U64 = np.uint64
_P112 = F32(2.0 ** 112)
_LOW2 = U64(0x0303030303030303)
_LOW4 = U64(0x0F0F0F0F0F0F0F0F)
_SH2 = np.array([0, 2, 4, 6], U64).reshape(1, 1, 1, 4, 1)
_SH4 = np.array([0, 4], U64)

FORMATS = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q2_K, Q.IQ2_XXS, Q.MXFP4)


class Scratch:
    """Reusable buffers by tag (a fresh large array costs its page faults on every block)."""

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}
        self._views: dict[tuple, np.ndarray] = {}

    def get(self, tag: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        key = (tag, shape, dtype)
        v = self._views.get(key)
        if v is not None:
            return v
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        b = self._bufs.get(tag)
        if b is None or b.nbytes < n:
            b = np.empty(max(n, 64), np.uint8)
            self._bufs[tag] = b
            self._views = {k: w for k, w in self._views.items() if k[0] != tag}
        v = self._views[key] = b[:n].view(dt).reshape(shape)
        return v

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())


# ---- f16 bits -> float32 --------------------------------------------------------------------------------------
_F16_MASK = np.int32(-0x70002000)          # 0x8FFFE000: the sign bit and the 15 bits below it after << 13


def f16_to_f32(h: np.ndarray, out: np.ndarray) -> np.ndarray:
    """float16 bit patterns (uint16, any strides) -> float32, exactly for every finite value (numpy's own f16
    cast runs at a third of the speed). h sign-extended to int32 and shifted left by 13 holds the sign in bit
    31 and exponent + mantissa in bits 13..27 (the mask drops the sign copies between): read as float32 that is
    the value times 2^-112, subnormals included. Exponent 31 (inf / NaN) becomes a finite number >= 65536:
    callers check `f16_all_finite` (or use `f16_scales`). out: an int32 buffer of h's shape."""
    np.copyto(out, h.view(np.int16), casting="unsafe")
    np.left_shift(out, 13, out=out)
    np.bitwise_and(out, _F16_MASK, out=out)
    f = out.view(F32)
    np.multiply(f, _P112, out=f)
    return f


def f16_all_finite(h: np.ndarray) -> bool:
    """No inf / NaN code among these float16 bit patterns."""
    return not bool(((h & np.uint16(0x7C00)) == np.uint16(0x7C00)).any())


def f16_scales(h: np.ndarray, scr: Scratch, tag: str, finite: bool = False) -> np.ndarray:
    """Block scales (f16 bit patterns, any strides) as float32, inf / NaN included (finite: the caller has
    checked that there are none, see `scales_finite`)."""
    out = f16_to_f32(h, scr.get(tag, h.shape, np.int32))
    if not finite and not f16_all_finite(h):
        bad = (h & np.uint16(0x7C00)) == np.uint16(0x7C00)
        out[bad] = h[bad].view(np.float16).astype(F32)
    return out


def _aligned(src: np.ndarray, scr: Scratch, tag: str) -> np.ndarray:
    """A contiguous, 8-byte-aligned copy of a strided byte slice (so it can be read as 64-bit words)."""
    out = scr.get(tag, src.shape, np.uint8)
    np.copyto(out, src)
    return out


def _finish(P: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """y[t, r] = sum_g scale[g, r] * P[g, r, t]  (P [G, R, T], scale [G, R])."""
    if P.shape[2] == 1:
        return np.einsum("gr,gr->r", P[:, :, 0], scale)[None]
    return np.einsum("grt,gr->tr", P, scale)


def _partials(S: np.ndarray, X: np.ndarray, scr: Scratch, tag: str = "P") -> np.ndarray:
    """Per-group partial dots: S [R, G, k] (codes) with X [G, k, T] -> [G, R, T]."""
    R, G, _ = S.shape
    P = scr.get(tag, (G, R, X.shape[2]), F32)
    np.matmul(S.transpose(1, 0, 2), X, out=P)
    return P


def _group_x(x: np.ndarray, k: int) -> np.ndarray:
    """x [T, cols] -> [cols/k, k, T] contiguous (the right-hand side of the per-group matmuls)."""
    T, C = x.shape
    return np.ascontiguousarray(x.reshape(T, C // k, k).transpose(1, 2, 0))


# ---- the formats ----------------------------------------------------------------------------------------------
# Each: prepare(x [T, C] float32) -> prep;  rows(raw uint8 [R, row_nbytes], prep, scr) -> float32 [T, R].

class _AsItIs:
    """The float formats: their rows take x as it is."""

    @staticmethod
    def prepare(x):
        return x


class _F32(_AsItIs):
    @staticmethod
    def rows(raw, x, scr, finite=False):
        return x @ raw.view(F32).T


class _F16(_AsItIs):
    @staticmethod
    def rows(raw, x, scr, finite=False):
        h = raw.view(np.uint16)
        if not finite and not f16_all_finite(h):                    # inf / NaN weights: numpy's exact cast
            return x @ h.view(np.float16).astype(F32).T
        return x @ f16_to_f32(h, scr.get("w", h.shape, np.int32)).T


class _BF16(_AsItIs):
    @staticmethod
    def rows(raw, x, scr, finite=False):
        h = raw.view(np.uint16)
        w = scr.get("w", h.shape, np.uint32)
        np.copyto(w, h, casting="unsafe")
        np.left_shift(w, 16, out=w)
        return x @ w.view(F32).T


class _Q8_0:
    """34-byte blocks: f16 d, 32 int8. The whole row is cast to float32 as int8 (scale bytes too) and the
    scale bytes meet zeros in x, so the cast reads contiguous memory."""

    @staticmethod
    def prepare(x):
        T, C = x.shape
        X = np.zeros((C // 32, 34, T), F32)
        X[:, 2:, :] = x.reshape(T, C // 32, 32).transpose(1, 2, 0)
        return X

    @staticmethod
    def rows(raw, X, scr, finite=False):
        R, nb = raw.shape[0], X.shape[0]
        S = scr.get("S", (R, nb, 34), F32)
        np.copyto(S, raw.view(np.int8).reshape(R, nb, 34), casting="unsafe")
        d = f16_scales(raw.view(np.uint16).reshape(R, nb, 17)[:, :, 0].T, scr, "d", finite)       # [nb, R]
        return _finish(_partials(S, X, scr), d)


# IQ2_XXS: (grid index, sign pattern) -> the 8 signed magnitudes as float32, one 32-byte table row per pair
# (1 MiB): one gather writes a block's weights straight into the scratch, no int8 pass between
_IQ2_FTABLE = (iq2.GRID.astype(F32)[:, None, :] * iq2.SIGNS.astype(F32)[None, :, :]).reshape(-1, 8)
_IQ2_FTABLE = np.ascontiguousarray(_IQ2_FTABLE)                                  # [256 * 128, 8]
_IQ2_GROUP_SCALE = ((np.arange(16) + F32(0.5)) * F32(0.25)).astype(F32)


def _spread(v: np.ndarray, t: np.ndarray, steps) -> None:
    """In place on uint64 words: v = (v & keep) | ((v & move) << shift) for each step (bit-field spreading)."""
    for keep, move, shift in steps:
        np.bitwise_and(v, U64(move), out=t)
        np.left_shift(t, U64(shift), out=t)
        np.bitwise_and(v, U64(keep), out=v)
        np.bitwise_or(v, t, out=v)


# 4 bytes -> 4 16-bit lanes; 4 seven-bit fields (bits 0, 7, 14, 21) -> 4 16-bit lanes
_BYTES_TO_LANES = ((0x0000FFFF, 0xFFFF0000, 16), (0x000000FF000000FF, 0x0000FF000000FF00, 8))
_SEVENS_TO_LANES = ((0x3FFF, 0x0FFFC000, 18), (0x0000007F0000007F, 0x00003F8000003F80, 9))


class _IQ2_XXS:
    """66-byte blocks of 256: f16 d, then 8 groups of 32 (4 grid bytes, a u32 of 4 sign indices + scale).
    The table index grid*128 + sign of each 8 weights is assembled four at a time in the 16-bit lanes of a
    64-bit word."""

    @staticmethod
    def prepare(x):
        return _group_x(x, 32)

    @staticmethod
    def rows(raw, X, scr, finite=False):
        R = raw.shape[0]
        nb = raw.shape[1] // iq2.IQ2_XXS_BYTES
        qs = _aligned(raw.reshape(R, nb, iq2.IQ2_XXS_BYTES)[:, :, 2:], scr, "qs")      # [R, nb, 64]
        aux = qs.view(np.uint32).reshape(R, nb, 8, 2)
        g = scr.get("g", (R, nb, 8), U64)
        s = scr.get("s", (R, nb, 8), U64)
        t = scr.get("t", (R, nb, 8), U64)
        np.copyto(g, aux[:, :, :, 0], casting="unsafe")
        np.copyto(s, aux[:, :, :, 1], casting="unsafe")
        _spread(g, t, _BYTES_TO_LANES)
        np.left_shift(g, U64(7), out=g)
        _spread(s, t, _SEVENS_TO_LANES)
        np.bitwise_and(s, U64(0x007F007F007F007F), out=s)
        np.bitwise_or(g, s, out=g)
        idx = scr.get("idx", (R, nb * 8, 4), np.intp)
        np.copyto(idx, g.view(np.uint16).reshape(R, nb * 8, 4), casting="unsafe")
        S = scr.get("S", (R, nb * 8, 4, 8), F32)
        np.take(_IQ2_FTABLE, idx, axis=0, out=S, mode="clip")     # in range by construction; 32-byte rows
        P = _partials(S.reshape(R, nb * 8, 32), X, scr)
        d = f16_scales(raw.view(np.uint16).reshape(R, nb, 33)[:, :, 0].T, scr, "d", finite)       # [nb, R]
        ls = scr.get("ls", (nb, 8, R), np.intp)
        np.right_shift(aux[:, :, :, 1].transpose(1, 2, 0), np.uint32(28), out=ls, casting="unsafe")
        db = np.take(_IQ2_GROUP_SCALE, ls, mode="clip")                # (0.5 + ls) * 0.25, exact
        db *= d[:, None, :]                                            # = iq2.dequant's d * (0.5 + ls) * 0.25
        return _finish(P, db.reshape(nb * 8, R))


_SH2_PLANES = np.array([0, 2, 4, 6], U64).reshape(4, 1, 1, 1)


class _Q2_K:
    """84-byte blocks of 256: 16 scale bytes (low nibble scale, high nibble min per 16 weights), 64 bytes of
    2-bit codes, f16 d, f16 dmin. value = (d*sc)*q - dmin*m.

    Byte 32h + l holds the codes of weights 128h + 32j + l (j = 0..3): the codes are unpacked plane by plane
    (j outermost, eight per 64-bit shift) and x is permuted to that order. A code (<= 3) times its sub-block
    scale (<= 15) fits a byte, so the scales are multiplied in eight at a time while the codes are still bytes;
    one matmul per 256 weights remains, and the min terms meet per-16 sums of x."""

    @staticmethod
    def prepare(x):
        T, C = x.shape
        nb = C // 256
        xp = x.reshape(T, nb, 2, 4, 32).transpose(1, 3, 2, 4, 0)                   # [b, j, h, l, T]
        X = np.ascontiguousarray(xp).reshape(nb, 256, T)
        Xs = np.ascontiguousarray(x.reshape(T, nb, 16, 16).sum(3).transpose(1, 2, 0))   # [nb, 16, T]
        return X, Xs

    @staticmethod
    def rows(raw, prep, scr, finite=False):
        X, Xs = prep
        R, nb = raw.shape[0], X.shape[0]
        blk = raw.reshape(R, nb, kquants.Q2_K_BYTES)
        q64 = _aligned(blk[:, :, 16:80], scr, "qs").view(U64).reshape(R, nb, 1, 8)
        codes = scr.get("codes", (R, nb, 4, 8), U64)                 # [r, b, j, (h, 8-byte word w)]
        np.right_shift(q64, _SH2_PLANES.reshape(1, 1, 4, 1), out=codes)
        np.bitwise_and(codes, _LOW2, out=codes)
        sc = _aligned(blk[:, :, :16], scr, "sc")                      # [R, nb, 16]: sub-block 8h + 2j + l1
        # one multiplier per (r, b, j, h, l1) sub-block, in the codes' order: the two words of a sub-block
        # (w = 2*l1 + 0 / 1) take the same one
        mul = scr.get("mul", (R, nb, 4, 2, 2), U64)
        np.copyto(mul, sc.reshape(R, nb, 2, 4, 2).transpose(0, 1, 3, 2, 4), casting="unsafe")
        np.bitwise_and(mul, U64(15), out=mul)
        words = codes.reshape(R, nb, 4, 2, 2, 2)
        for w0 in (0, 1):
            np.multiply(words[..., w0], mul, out=words[..., w0])
        S = scr.get("S", (R, nb, 256), F32)
        np.copyto(S, codes.view(np.uint8).reshape(R, nb, 256), casting="unsafe")
        P = _partials(S, X, scr)                                       # [nb, R, T]
        m = scr.get("m", (R, nb, 16), F32)
        np.right_shift(sc, np.uint8(4), out=m, casting="unsafe")
        M = _partials(m, Xs, scr, "M")                                 # [nb, R, T]
        dd = f16_scales(raw.view(np.uint16).reshape(R, nb, 42)[:, :, 40:42].transpose(2, 1, 0), scr, "d", finite)
        y = _finish(P, dd[0])
        y -= _finish(M, dd[1])
        return y


class _Q4_K:
    """144-byte blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32, 128
    bytes of 4-bit codes (chunk c: low nibbles sub-block 2c, high nibbles 2c+1). value = (d*sc)*q - dmin*m."""

    @staticmethod
    def prepare(x):
        T, C = x.shape
        nb = C // 256
        xp = x.reshape(T, nb, 4, 2, 32).transpose(1, 3, 2, 4, 0)                   # [b, n, c, l, T]
        X = np.ascontiguousarray(xp).reshape(nb * 8, 32, T)
        Xs = np.ascontiguousarray(x.reshape(T, nb * 8, 32).sum(2).T)              # [C/32, T], natural order
        return X, Xs

    @staticmethod
    def rows(raw, prep, scr, finite=False):
        X, Xs = prep
        R = raw.shape[0]
        nb = raw.shape[1] // kquants.Q4_K_BYTES
        blk = raw.reshape(R, nb, kquants.Q4_K_BYTES)
        q64 = _aligned(blk[:, :, 16:], scr, "qs").view(U64).reshape(R, nb, 1, 16)
        codes = scr.get("codes", (R, nb, 2, 16), U64)                 # [r, b, nibble n, (chunk c, word)]
        np.right_shift(q64, _SH4.reshape(1, 1, 2, 1), out=codes)
        np.bitwise_and(codes, _LOW4, out=codes)
        S = scr.get("S", (R, nb * 8, 32), F32)                        # groups (b, n, c) = sub-block 2c + n
        np.copyto(S, codes.view(np.uint8).reshape(R, nb * 8, 32), casting="unsafe")
        P = _partials(S, X, scr)                                       # [nb*8, R, T]
        sc, mn = kquants.q4_k_scale_min(blk[:, :, 4:16].transpose(1, 0, 2).reshape(nb * R, 12))   # [nb*R, 8]
        dd = f16_scales(raw.view(np.uint16).reshape(R, nb, 72)[:, :, 0:2].transpose(2, 1, 0), scr, "d", finite)
        dl = dd[0][:, :, None] * sc.reshape(nb, R, 8).astype(F32)     # [b, r, sub] as kquants.dequant: d * sc
        ml = dd[1][:, :, None] * mn.reshape(nb, R, 8).astype(F32)
        # P's groups are (b, n, c): sub-block 2c + n
        y = _finish(P, dl.reshape(nb, R, 4, 2).transpose(0, 3, 2, 1).reshape(nb * 8, R))
        y -= Xs.T @ ml.transpose(0, 2, 1).reshape(nb * 8, R)
        return y


# MXFP4: two bytes (four codes) -> their four doubled e2m1 values as int8; a byte's low nibble is weight j of
# its block, the high nibble weight j+16, so x is permuted to match the table's order.
_MX_TABLE = np.empty((65536, 4), np.int8)
_b = np.arange(65536)
for _k, _col in enumerate((mxfp4.LOW[_b & 255], mxfp4.HIGH[_b & 255], mxfp4.LOW[_b >> 8], mxfp4.HIGH[_b >> 8])):
    _MX_TABLE[:, _k] = _col.astype(np.int8)
_MX_TABLE = _MX_TABLE.view(np.int32).reshape(-1)
_MX_ORDER = np.array([[2 * i, 2 * i + 16, 2 * i + 1, 2 * i + 17] for i in range(8)]).reshape(-1)
del _b, _k, _col


class _MXFP4:
    """17-byte blocks of 32: e8m0 exponent e (scale 2^(e-128) on the doubled e2m1 values), 16 bytes of codes."""

    @staticmethod
    def prepare(x):
        T, C = x.shape
        xp = x.reshape(T, C // 32, 32)[:, :, _MX_ORDER]
        return np.ascontiguousarray(xp.transpose(1, 2, 0))

    @staticmethod
    def rows(raw, X, scr, finite=False):
        R, nb = raw.shape[0], X.shape[0]
        blk = raw.reshape(R, nb, mxfp4.MXFP4_BYTES)
        q16 = _aligned(blk[:, :, 1:], scr, "qs").view(np.uint16)          # [R, nb, 8]
        idx = scr.get("idx", q16.shape, np.intp)
        np.copyto(idx, q16, casting="unsafe")
        codes = scr.get("codes", q16.shape, np.int32)
        np.take(_MX_TABLE, idx, out=codes, mode="clip")
        S = scr.get("S", (R, nb, 32), F32)
        np.copyto(S, codes.view(np.int8).reshape(R, nb, 32), casting="unsafe")
        return _finish(_partials(S, X, scr), mxfp4.e8m0_half(blk[:, :, 0].T))


KERNELS = {Q.F32: _F32, Q.F16: _F16, Q.BF16: _BF16, Q.Q8_0: _Q8_0, Q.Q4_K: _Q4_K, Q.Q2_K: _Q2_K,
           Q.IQ2_XXS: _IQ2_XXS, Q.MXFP4: _MXFP4}


_BY_INT = {int(q): k for q, k in KERNELS.items()}      # int keys: an enum construction per call costs ~2 us


def supported(qtype) -> bool:
    return int(qtype) in _BY_INT


def prepare(qtype, x: np.ndarray):
    """The activation-side arrays of format `qtype` for x [T, cols] (float32), shared by every row block."""
    return _BY_INT[int(qtype)].prepare(np.ascontiguousarray(x, dtype=F32))


def dot_rows(qtype, raw: np.ndarray, prep, scr: Scratch, finite: bool = False) -> np.ndarray:
    """x @ W[rows].T for a block of rows of a stored matrix: raw uint8 [R, row_nbytes] -> float32 [T, R].
    finite=True skips the per-block inf / NaN check of the f16 scales (or F16 weights): for rows whose
    `scales_finite` the caller has established."""
    return _BY_INT[int(qtype)].rows(raw, prep, scr, finite)


# where each format keeps its f16 scale bit patterns: (uint16 words per block, the scale words in a block)
_SCALE_WORDS = {Q.Q8_0: (17, slice(0, 1)), Q.IQ2_XXS: (33, slice(0, 1)), Q.Q2_K: (42, slice(40, 42)),
                Q.Q4_K: (72, slice(0, 2))}


def scales_finite(qtype, raw: np.ndarray) -> bool:
    """No inf / NaN among the f16 scales (F16: the values) of these stored rows (uint8 [rows, row_nbytes]);
    formats without f16 scales are always finite for the kernels (MXFP4's e8m0 scale is finite for every byte)."""
    qt = Q(int(qtype))
    h = raw.reshape(-1).view(np.uint16)
    if qt == Q.F16:
        return f16_all_finite(h)
    if qt in _SCALE_WORDS:
        words, where = _SCALE_WORDS[qt]
        return f16_all_finite(h.reshape(-1, words)[:, where])
    return True
