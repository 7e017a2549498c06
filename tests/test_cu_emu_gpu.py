"""The emulator's value tests again, on a real GPU: the self-test kernels run through the CUDA runtime and must
meet the same numpy twins. This is what checks the PTX paths of portable.cuh (FP8 cvt byte order, the mma
fragment layout, cp.async) and that the emulator's shuffle/vote semantics are the hardware's.
Skipped without a CUDA device."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.errors import CudaUnavailableError
from test_cu_emu import (SELFTEST, test_atomics, test_barrier_orders_shared_memory,  # noqa: F401 (re-collected)
                         test_disjoint_half_warps, test_dynamic_shared_memory, test_half_and_fp8_conversions,
                         test_index3d, test_shuffles, test_votes_and_syncthreads_count, test_warp_reductions)

pytestmark = pytest.mark.gpu


class GpuKernels:
    """EmuModule.launch's interface on the GPU: numpy arrays in, non-const ones copied back (order is ignored)."""

    def __init__(self, cu_dir):
        from ds4py.cuda.driver import Device, call
        from ds4py.cuda.launch import KernelRegistry
        from ds4py.cuda.memory import DriverAllocator

        self.call = call
        self.device = Device.open(0)
        self.registry = KernelRegistry.load(self.device.arch, cu_dir, cache=False)
        self.stream = call("cuStreamCreate", 0)
        self.alloc = DriverAllocator()

    def launch(self, name, grid, block, args, shared_mem=0, order="forward", seed=0):
        from ds4py.cuda.launch import launch
        from ds4py.cuda.memory import DeviceArray

        kernel = self.registry[name]
        dev_args, outputs, owned = [], [], []
        try:
            for p, v in zip(kernel.params, args):
                if p.is_pointer and isinstance(v, np.ndarray):
                    ptr = self.alloc.alloc(max(v.nbytes, 256))
                    owned.append(ptr)
                    d = DeviceArray(ptr, v.shape, v.dtype)
                    d.upload(np.ascontiguousarray(v))
                    if not p.is_const:
                        outputs.append((d, v))
                    dev_args.append(d)
                else:
                    dev_args.append(v)
            launch(kernel, grid, block, dev_args, self.stream, smem=shared_mem,
                   max_smem=self.device.smem_per_block_optin)
            self.call("cuStreamSynchronize", self.stream)
            for d, v in outputs:
                v[...] = d.download()
        finally:
            for ptr in owned:
                self.alloc.free(ptr)

    def close(self):
        self.call("cuStreamDestroy", self.stream)
        self.registry.unload()
        self.device.close()


@pytest.fixture(scope="module")
def mod(tmp_path_factory):
    from ds4py.cuda import driver

    try:
        driver.api()
    except CudaUnavailableError as e:
        pytest.skip(f"no CUDA device: {e}")
    d = tmp_path_factory.mktemp("selftest")
    shutil.copy(SELFTEST, d)
    shutil.copy(emu.CU_DIR / "portable.cuh", d)
    g = GpuKernels(d)
    yield g
    g.close()


def test_cp_async_on_gpu(mod):
    x = np.arange(512, dtype=np.float32)
    out = np.zeros_like(x)
    mod.launch("cp_async_tile", 2, 64, [x, out, 1])
    np.testing.assert_array_equal(out, x.reshape(2, 256)[:, ::-1].reshape(-1))


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
