"""cu/gemm.cu under the CPU emulator against its twins: the mma fragment layouts (f16 and bf16, one tile from
per-lane registers packed by ds4py/cuda/twins/mma.py: bit-exact, the emulator sums in double and rounds once), and
the prefill GEMM for Q8_0 / F16 / F32 weights at ragged T / N / K, input groups and accumulate against
twins/gemm.py (bf16-rounded x, exact weights, float64), in every thread order; a row's bits do not depend on T or
on the rows beside it; the distance to the scalar fp32 GEMV twin is the bf16 rounding of x."""

from __future__ import annotations

import numpy as np
import pytest

from cu_fixtures import gemv_weights, requires_emulator
from ds4py.cuda.emu_runtime import EmuRuntime
from ds4py.cuda.ops import gemm as ops_gemm
from ds4py.cuda.twins import gemm as twin
from ds4py.cuda.twins import mma as twin_mma
from ds4py.cuda.twins.core import assert_close_scaled, weight_values
from ds4py.cuda.twins.gemv import gemv as gemv_twin
from ds4py.cuda.ops.gemm import GemmShape
from ds4py.errors import Ds4Error
from tests.cu_emu_device import devices

pytestmark = requires_emulator
kdev = pytest.fixture(devices, name="kdev")


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([23, *seed])


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_mma_fragment_layout_matches_the_twin(kdev, dtype):
    r = rng(1, len(dtype))
    tiles = 3
    A = r.standard_normal((tiles, 16, 16)).astype(np.float32)
    B = r.standard_normal((tiles, 16, 8)).astype(np.float32)
    C = r.standard_normal((tiles, 16, 8)).astype(np.float32)
    A[0, 3, 5], B[1, 9, 2] = 1e-3, -7.0                        # marked values: a swapped fragment moves them
    a = np.stack([twin_mma.pack_a(A[i], dtype) for i in range(tiles)])
    b = np.stack([twin_mma.pack_b(B[i], dtype) for i in range(tiles)])
    c = np.stack([twin_mma.pack_c(C[i]) for i in range(tiles)])
    for i in range(tiles):                                    # the packing itself round-trips
        np.testing.assert_array_equal(twin_mma.unpack_a(a[i], dtype),
                                      twin_mma.value16(twin_mma.bits16(A[i], dtype), dtype).reshape(16, 16))
        np.testing.assert_array_equal(twin_mma.unpack_d(c[i]), C[i])
    dev = kdev()
    d = dev.var(np.full((tiles, 32, 4), np.nan, np.float32))
    ops_gemm.mma_tile(dev.rt, dtype, dev.const(a), dev.const(b), dev.const(c), d, tiles)
    got = d.download()
    for i in range(tiles):
        want = twin_mma.mma(A[i], B[i], C[i], dtype)
        if isinstance(dev.rt, EmuRuntime):                     # double accumulation rounded once: bit-exact
            np.testing.assert_array_equal(twin_mma.unpack_d(got[i]), want)
        else:                                                  # the tensor cores' own fp32 accumulation
            Av = twin_mma.value16(twin_mma.bits16(A[i], dtype), dtype).reshape(16, 16)
            Bv = twin_mma.value16(twin_mma.bits16(B[i], dtype), dtype).reshape(16, 8)
            mag = np.abs(Av) @ np.abs(Bv) + np.abs(C[i])
            assert np.all(np.abs(twin_mma.unpack_d(got[i]) - want) <= 1e-5 * mag), "fragment layout or accumulation"
        # and the tile is really the product (not a permutation of it that happens to be consistent)
        ref = A[i].astype(np.float64) @ B[i].astype(np.float64) + C[i]
        assert np.abs(twin_mma.unpack_d(got[i]) - ref).max() < (0.05 if dtype == "bf16" else 5e-3) * np.abs(ref).max()


def test_bf16_rounding_twin():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8 + 2 ** -20), 3.4e38, np.inf, np.nan], np.float32)
    got = twin_mma.bf16_round(x)
    assert got[0] == 1.0 and got[1] == 1.0 and got[2] == 1 + 2 ** -6 and got[3] == -(1 + 2 ** -7)
    assert np.isinf(got[4]) and np.isinf(got[5]) and np.isnan(got[6])


# kind, T, N, K, x_group_rows, accumulate
CASES = [
    ("Q8_0", 70, 136, 96, 0, False), ("F16", 5, 130, 40, 0, False), ("F32", 65, 33, 64, 0, True),
    ("Q8_0", 9, 144, 64, 48, False), ("F16", 17, 64, 32, 24, True),
]
ORDERS = ("forward", "reverse", "random")


def _x(r, T, width, ldx):
    x = np.zeros((T, ldx), np.float32)
    x[:, :width] = r.standard_normal((T, width)) * 2
    return x


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[1]}-N{c[2]}-K{c[3]}-g{c[4]}-acc{int(c[5])}")
@pytest.mark.parametrize("order", ORDERS)
def test_gemm_against_the_twin(kdev, case, order):
    kind, T, N, K, xgr, acc = case
    r = rng(2, T, N, K)
    W = gemv_weights(r, kind, N, K, 0.1)
    groups = -(-N // xgr) if xgr else 1
    ldx = K * groups + 4
    x = _x(r, T, K * groups, ldx)
    y0 = r.standard_normal((T, N)).astype(np.float32) if acc else np.full((T, N), np.nan, np.float32)
    dev = kdev(order, T)
    d_y = dev.var(y0)
    ops_gemm.gemm(dev.rt, dev.const(W), dev.const(x), d_y, GemmShape(T, N, K, x_group_rows=xgr, ldx=ldx),
                  accumulate=acc)
    got = d_y.download()
    want, mag = twin.gemm(W, x, T, N, K, xgr, y0 if acc else None)
    assert_close_scaled(got, want, mag, K, f"gemm {case}", factor=2.0 if isinstance(dev.rt, EmuRuntime) else 8.0)


def test_gemm_rows_do_not_depend_on_T_or_neighbours(kdev):
    r = rng(3)
    N, K = 72, 64
    W = gemv_weights(r, "Q8_0", N, K, 0.1)
    x = _x(r, 70, K, K)
    dev = kdev()
    dW = dev.const(W)
    full, part = dev.var(np.zeros((70, N), np.float32)), dev.var(np.zeros((10, N), np.float32))
    ops_gemm.gemm(dev.rt, dW, dev.const(x), full, GemmShape(70, N, K))
    ops_gemm.gemm(dev.rt, dW, dev.const(x[60:]), part, GemmShape(10, N, K))   # rows 60.. land in another tile position
    np.testing.assert_array_equal(full.download()[60:], part.download())


@pytest.mark.parametrize("kind", ["Q8_0", "F16"])
def test_tensor_core_path_vs_scalar_fp32(kdev, kind):
    """The only systematic difference from the decode GEMV (fp32 x) is bf16 x: within 2^-9 of sum |x W|."""
    r = rng(4, len(kind))
    T, N, K = 16, 64, 256
    W = gemv_weights(r, kind, N, K, 0.1)
    x = _x(r, T, K, K)
    dev = kdev()
    d_y = dev.var(np.zeros((T, N), np.float32))
    ops_gemm.gemm(dev.rt, dev.const(W), dev.const(x), d_y, GemmShape(T, N, K))
    got = d_y.download().astype(np.float64)
    scalar = np.stack([gemv_twin(W, x[t], N, K) for t in range(T)]).astype(np.float64)
    mag = np.abs(x.astype(np.float64)) @ np.abs(weight_values(W, N, K)).T
    rel = np.abs(got - scalar) / mag
    print(f"\n{kind}: |gemm - fp32 gemv| / sum|xW|: max {rel.max():.2e}, mean {rel.mean():.2e} (2^-9 = {2**-9:.2e})")
    assert rel.max() <= 2 ** -9 and rel.mean() < 2 ** -11


def test_precise_x_splits_the_activations(kdev):
    """precise_x: x as hi + lo bf16 pieces: the twin's value exactly, and within 2^-16 of sum |x W| of the scalar path."""
    r = rng(5)
    T, N, K = 20, 40, 96
    W = gemv_weights(r, "F16", N, K, 0.1)
    x = _x(r, T, K, K)
    dev = kdev()
    d_y = dev.var(np.zeros((T, N), np.float32))
    ops_gemm.gemm(dev.rt, dev.const(W), dev.const(x), d_y, GemmShape(T, N, K, precise_x=True))
    got = d_y.download()
    want, mag = twin.gemm(W, x, T, N, K, precise_x=True)
    assert_close_scaled(got, want, mag, K, "gemm precise_x", factor=2.0 if isinstance(dev.rt, EmuRuntime) else 8.0)
    scalar = np.stack([gemv_twin(W, x[t], N, K) for t in range(T)]).astype(np.float64)
    rel = np.abs(got - scalar) / (np.abs(x.astype(np.float64)) @ np.abs(weight_values(W, N, K)).T)
    print(f"\nF16 precise_x: |gemm - fp32 gemv| / sum|xW| max {rel.max():.2e}")
    assert rel.max() <= 2 ** -16


def test_gemm_rejects_bad_input():
    z = np.zeros
    from ds4py.cuda.memory import DeviceArray  # noqa: F401  (the wrapper checks before any launch)

    class A:                                                   # a stand-in device array: only what the checks read
        def __init__(self, a, ptr=256):
            self.dtype, self.size, self.nbytes, self.ptr = a.dtype, a.size, a.nbytes, ptr

    W = A(z((8, 2 * 34), np.uint8))
    x, y = A(z((4, 64), np.float32)), A(z((4, 8), np.float32))
    with pytest.raises(Ds4Error, match="multiple of 32"):
        ops_gemm.gemm(None, W, x, y, GemmShape(4, 8, 48))
    with pytest.raises(Ds4Error, match="not 8 x 64 Q8_0"):
        ops_gemm.gemm(None, A(z(100, np.uint8)), x, y, GemmShape(4, 8, 64))
    with pytest.raises(Ds4Error, match="T must be"):
        ops_gemm.gemm(None, W, x, y, GemmShape(0, 8, 64))
    with pytest.raises(Ds4Error, match="x must be float32"):
        ops_gemm.gemm(None, W, x, y, GemmShape(5, 8, 64))
    with pytest.raises(Ds4Error, match="16-byte aligned"):
        ops_gemm.gemm(None, W, A(z((4, 64), np.float32), ptr=8), y, GemmShape(4, 8, 64))
    with pytest.raises(Ds4Error, match="ldx"):
        ops_gemm.gemm(None, W, x, y, GemmShape(4, 8, 64, ldx=66))
    with pytest.raises(Ds4Error, match="dtype must be"):
        ops_gemm.mma_tile(None, "f32", x, x, x, x)
