"""The emulator's value tests again, on a real GPU: the self-test kernels run through the CUDA runtime and must
meet the same numpy twins. This is what checks the PTX paths of portable.cuh (FP8 cvt byte order, the mma
fragment layout, cp.async) and that the emulator's shuffle/vote semantics are the hardware's.
Skipped without a CUDA device."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.launch import launch_arrays
from ds4py.errors import CudaUnavailableError
from test_cu_emu import (SELFTEST, test_atomics, test_barrier_orders_shared_memory,  # noqa: F401 (re-collected)
                         test_disjoint_half_warps, test_dynamic_shared_memory, test_half_and_fp8_conversions,
                         test_index3d, test_shuffles, test_votes_and_syncthreads_count, test_warp_reductions)

pytestmark = pytest.mark.gpu


class OnDevice:
    """EmuModule.launch's call shape on the GPU Runtime (order and seed do not apply to hardware)."""

    def __init__(self, rt):
        self.rt = rt

    def launch(self, name, grid, block, args, shared_mem=0, order="forward", seed=0):
        launch_arrays(self.rt, name, grid, block, args, smem=shared_mem)


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    from ds4py.cuda import driver

    try:
        driver.api()
    except CudaUnavailableError as e:
        pytest.skip(f"no CUDA device: {e}")
    from ds4py.cuda.runtime import Runtime

    d = tmp_path_factory.mktemp("selftest")
    shutil.copy(SELFTEST, d)
    for h in emu.CU_DIR.glob("*.cuh"):
        shutil.copy(h, d)
    rt = Runtime(cu_dir=d, cache=False)
    yield OnDevice(rt)
    rt.close()


def test_cp_async_on_gpu(mod):
    x = np.arange(512, dtype=np.float32)
    out = np.zeros_like(x)
    mod.launch("cp_async_tile", 2, 64, [x, out, 1])
    np.testing.assert_array_equal(out, x.reshape(2, 256)[:, ::-1].reshape(-1))


def test_ldsm_x4_on_gpu(mod):
    M = np.random.default_rng(9).integers(0, 1 << 16, (2, 16, 16), dtype=np.uint16)
    out = np.zeros((2, 32, 4), np.uint32)
    mod.launch("ldsm_tile", 1, 64, [M, out, 0])
    lane = np.arange(32)
    for j in range(4):
        rows, cols = lane // 4 + 8 * (j & 1), 8 * (j >> 1) + 2 * (lane % 4)
        want = M[:, rows, cols].astype(np.uint32) | (M[:, rows, cols + 1].astype(np.uint32) << 16)
        np.testing.assert_array_equal(out[:, :, j], want, "ldmatrix's lanes differ from the emulator's")


def test_mma_tile_on_gpu(mod):
    r = np.random.default_rng(8)
    A = r.standard_normal((2, 16, 16)).astype(np.float16)
    B = r.standard_normal((2, 16, 8)).astype(np.float16)
    C = r.standard_normal((2, 16, 8)).astype(np.float32)
    D = np.zeros_like(C)
    mod.launch("mma_tile", 1, 64, [A, B, C, D])
    want = A.astype(np.float64) @ B.astype(np.float64) + C
    mag = np.abs(A.astype(np.float64)) @ np.abs(B.astype(np.float64)) + np.abs(C)
    assert np.all(np.abs(D - want) <= 1e-5 * mag), "fragment layout or accumulation differs from the emulator's"
