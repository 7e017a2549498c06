"""numpy arrays on the emulated device for the kernel tests: an EmuRuntime (every launch in the given thread order)
with one arena. `dev.const(a)` uploads into the weights region (read-only to kernels), `dev.var(a)` into scratch;
`DeviceArray.download()` reads back. The ops wrappers get the same DeviceArrays as on a GPU, and the tests that
take the `kdev` fixture run unchanged on a real device (tests/gpu/test_cuda_attn_moe.py binds it to the GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda.emu_runtime import EmuRuntime
from ds4py.cuda.memory import DeviceArray


class KernelDevice:
    """A runtime and one arena: const() uploads into the weights region, var() into scratch (None stays None)."""

    def __init__(self, rt, weights_mib: int, scratch_mib: int):
        self.rt = rt
        self.arena = rt.arena(weights_mib << 20, scratch_mib << 20)
        self.arena.begin_step()

    def _put(self, a: np.ndarray | None, weights: bool) -> DeviceArray | None:
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        d = self.arena.weights(a.shape, a.dtype) if weights else self.arena.scratch(a.shape, a.dtype)
        d.upload(a)
        return d

    def const(self, a: np.ndarray | None) -> DeviceArray | None:
        return self._put(a, True)

    def var(self, a: np.ndarray | None) -> DeviceArray | None:
        return self._put(a, False)

    def close(self) -> None:
        self.rt.synchronize()
        self.arena.close()


class EmuDevice(KernelDevice):
    def __init__(self, order: str = "forward", seed: int = 0, weights_mib: int = 32, scratch_mib: int = 32):
        super().__init__(EmuRuntime(order=order, seed=seed, check_pdl=True), weights_mib, scratch_mib)


def devices():
    """Fixture body (a test module binds it: `kdev = pytest.fixture(devices, name="kdev")`; tests/gpu binds the
    same name to real devices): make(order="forward", seed=0) -> an EmuDevice, closed after the test."""
    made: list[EmuDevice] = []

    def make(order: str = "forward", seed: int = 0, **kw) -> EmuDevice:
        made.append(EmuDevice(order, seed, **kw))
        return made[-1]

    yield make
    for d in made:
        d.close()


def gpu_devices(rt, mib: int):
    """The same fixture body on a GPU runtime rt (tests/gpu: `def kdev(rt): yield from gpu_devices(rt, mib)`):
    make(order="forward", seed=0, weights_mib=mib, scratch_mib=mib) -> a KernelDevice of regions of at least 64 MiB.
    Thread order and seed are emulator settings: another order is skipped (the GPU runs each case once)."""
    made: list[KernelDevice] = []

    def make(order: str = "forward", seed: int = 0, **kw) -> KernelDevice:
        if order != "forward":
            pytest.skip("thread order is an emulator setting; the GPU runs each case once")
        made.append(KernelDevice(rt, max(kw.get("weights_mib", mib), 64), max(kw.get("scratch_mib", mib), 64)))
        return made[-1]

    yield make
    for d in made:
        d.close()
