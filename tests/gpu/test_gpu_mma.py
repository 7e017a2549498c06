"""The tensor-core prefill kernels on a GPU (skipped without one): the emulator tests of cu/gemm.cu
and cu/moe_prefill.cu again on the hardware (the PTX mma path: fragment layout within 1e-5 of the twin's exact
sum, the GEMM and the grouped MoE within the same scaled tolerances, rows independent of T; the VQ-8 grouped MoE's
stages and whole within fp32 tolerances at 12 and 12 + 1 bits), then V4 Flash sizes:
the Q8_0 / F16 GEMM at T = 2048 x 4096 x 4096 and the grouped MoE of 2048 tokens (k = 6 of 16 experts, IQ2_XXS
gate / up 2048 x 4096, Q2_K down) against the twins on sample rows, bit-identical on a second run, timed."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cu_fixtures import gemv_weights
from ds4py.cuda.ops import gemm as ops_gemm
from ds4py.cuda.ops import moe_prefill as ops_mp
from ds4py.cuda.twins import gemm as twin_gemm
from ds4py.cuda.twins import moe_prefill as twin_mp
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.cuda.ops.core import TokenRows
from ds4py.cuda.ops.experts import Experts, Slots
from ds4py.cuda.ops.gemm import GemmShape
from tests.cu_emu_device import gpu_devices
from tests.test_cu_emu_experts import expert_tensor
from test_cu_emu_gemm import (test_gemm_against_the_twin, test_gemm_rows_do_not_depend_on_T_or_neighbours,  # noqa: F401
                              test_mma_fragment_layout_matches_the_twin, test_tensor_core_path_vs_scalar_fp32)
from test_cu_emu_moe_prefill import (test_route_is_exact, test_vq_down_stage, test_vq_gate_up_stage,  # noqa: F401
                                     test_vq_whole_moe_against_twin_and_reference,
                                     test_whole_moe_against_twin_and_reference)

pytestmark = pytest.mark.gpu


@pytest.fixture
def kdev(rt):
    """The emulator tests' device factory on the GPU (1024 MiB regions unless a test asks for more)."""
    yield from gpu_devices(rt, 1024)


def _timed(rt, fn, reps: int = 5) -> float:
    fn()
    rt.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    rt.synchronize()
    return (time.perf_counter() - t0) / reps


@pytest.mark.real_size
@pytest.mark.parametrize("kind", ["Q8_0", "F16"])
def test_gemm_real_size(kdev, kind):
    T, N, K = 2048, 4096, 4096
    r = np.random.default_rng(11)
    W = gemv_weights(r, kind, N, K, 0.05)
    x = r.standard_normal((T, K)).astype(np.float32)
    dev = kdev()
    dW, dx, dy = dev.const(W), dev.const(x), dev.var(np.zeros((T, N), np.float32))
    sec = _timed(dev.rt, lambda: ops_gemm.gemm(dev.rt, dW, dx, dy, GemmShape(T, N, K)))
    got = dy.download()
    rows = np.r_[0:64, T - 64:T]
    want, mag = twin_gemm.gemm(W, x[rows], len(rows), N, K)
    assert_close_scaled(got[rows], want, mag, K, f"gemm {kind} 2048x4096x4096", factor=8.0)
    ops_gemm.gemm(dev.rt, dW, dx, dy, GemmShape(T, N, K))
    np.testing.assert_array_equal(dy.download(), got)
    print(f"\ngemm {kind} T={T} N={N} K={K}: {sec * 1e3:.2f} ms, {2 * T * N * K / sec / 1e12:.1f} TFLOP/s")


@pytest.mark.real_size
def test_moe_prefill_real_size(kdev):
    T, k, E, D, FF = 2048, 6, 16, 4096, 2048
    r = np.random.default_rng(12)
    rg, Wg = expert_tensor(r, QT.IQ2_XXS, E, FF, D)
    ru, Wu = expert_tensor(r, QT.IQ2_XXS, E, FF, D)
    rd, Wd = expert_tensor(r, QT.Q2_K, E, D, FF)
    x = (r.standard_normal((T, D)) * 0.5).astype(np.float32)
    ids = np.stack([r.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
    wts = (r.random((T, k)) + 0.2).astype(np.float32)
    dev = kdev()
    bufs = ops_mp.MoePrefillBuffers.alloc(lambda s, dt: dev.var(np.zeros(s, dt)), T, k, E, FF, D)
    y = dev.var(np.zeros((T, D), np.float32))
    ex = Experts(fmt=QT.IQ2_XXS, n_experts=E, ff=FF, dim=D, gate=dev.const(rg), up=dev.const(ru), down=dev.const(rd),
                 down_fmt=QT.Q2_K, clamp=10.0)
    args = (ex, TokenRows(x=dev.const(x), y=y, T=T), Slots(ids=dev.const(ids), weights=dev.const(wts), k=k), bufs)
    sec = _timed(dev.rt, lambda: ops_mp.moe_prefill(dev.rt, *args))
    got = y.download()
    sel = np.r_[0:4, T - 4:T]                         # a token's result does not depend on the others
    want, mag = twin_mp.moe(Wg, Wu, Wd, x[sel], ids[sel], wts[sel], 10.0, ops_mp.BM,
                            ops_mp.max_tiles(len(sel) * k, E))
    assert (np.abs(got[sel] - want) <= 2 ** -8 * mag).all()
    ops_mp.moe_prefill(dev.rt, *args)
    np.testing.assert_array_equal(y.download(), got)
    flops = 2 * T * k * 3 * D * FF
    print(f"\nmoe_prefill T={T} k={k} E={E} {D}x{FF}: {sec * 1e3:.2f} ms, {flops / sec / 1e12:.1f} TFLOP/s, "
          f"{T / sec:.0f} tokens/s per layer")
