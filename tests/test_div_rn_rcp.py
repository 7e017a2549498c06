"""cu/gemv.cu div_rn_rcp's claim, in exact arithmetic: from rb = RN(1 / b), q = RN(a * rb) and two fmaf residual
corrections give RN(a / b) (what __fdiv_rn returns), for b in [2^-30, 2^30] and |a| >= 2^-60. Each float32 operation
is rounded from the exact rational (fractions), so the check does not depend on the host's FMA. Cases: quotients
within an ulp of a half-integer (where rint(x / d), a Q8_0 code, would flip) and divisors with all-ones or nearly
empty mantissas. The kernels' own use is tested on the emulator (tests/test_cu_emu_gemv_i8.py)."""

from __future__ import annotations

from fractions import Fraction as F

import numpy as np

f32 = np.float32


def rn32(x: F) -> np.float32:
    """The float32 nearest to the rational x, ties to even (float(x) is correctly rounded to float64; a float64 that
    lies exactly on a float32 midpoint is decided against x itself)."""
    f = float(x)
    g = f32(f)
    if float(g) != f:
        lo, hi = (np.nextafter(g, f32(-np.inf)), g) if float(g) > f else (g, np.nextafter(g, f32(np.inf)))
        mid = (F(float(lo)) + F(float(hi))) / 2
        if F(f) == mid and x != mid:
            return hi if x > mid else lo
    return g


def fma(a, b, c) -> np.float32:
    return rn32(F(float(a)) * F(float(b)) + F(float(c)))


def div_rn_rcp(a, b) -> np.float32:
    rb = rn32(1 / F(float(b)))
    q = rn32(F(float(a)) * F(float(rb)))
    r = fma(-b, q, a)
    q = fma(r, rb, q)
    r = fma(-b, q, a)
    return fma(r, rb, q)


def test_reciprocal_quotients_are_correctly_rounded():
    r = np.random.default_rng(7)
    n = 0
    for i in range(3000):
        e = int(r.integers(-30, 30))
        if i % 3 == 2:                                         # all-ones or nearly empty mantissas
            b = f32((2 - 2.0 ** -23) * 2.0 ** e) if i % 2 else f32((1 + 2.0 ** -23 * int(r.integers(0, 64))) * 2.0 ** e)
        else:
            b = f32(r.uniform(1, 2) * 2.0 ** e)
        if i % 2:                                              # next to a half-integer quotient
            a = f32((int(r.integers(-127, 127)) + 0.5) * float(b))
            a = np.nextafter(a, f32(r.choice([-np.inf, np.inf]))) if r.random() < 0.6 else a
        else:
            a = f32(r.uniform(-128, 128) * float(b))
        if a == 0:
            continue
        assert div_rn_rcp(a, b) == rn32(F(float(a)) / F(float(b))), (a, b)
        n += 1
    assert n > 2900
