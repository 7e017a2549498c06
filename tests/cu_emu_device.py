"""numpy arrays on the emulated device for the kernel tests: an EmuRuntime (every launch in the given thread order)
with one arena. `dev.const(a)` uploads into the weights region (read-only to kernels), `dev.var(a)` into scratch;
`DeviceArray.download()` reads back. The ops wrappers get the same DeviceArrays as on a GPU, and the tests that
take the `kdev` fixture run unchanged on a real device (tests/gpu/test_cuda_attn_moe.py binds it to the GPU)."""

from __future__ import annotations

import numpy as np

from ds4py.cuda.emu_runtime import EmuRuntime
from ds4py.cuda.memory import DeviceArray


class EmuDevice:
    def __init__(self, order: str = "forward", seed: int = 0, weights_mib: int = 32, scratch_mib: int = 32):
        self.rt = EmuRuntime(order=order, seed=seed, check_pdl=True)   # no store / return before pdl_wait()
        self.arena = self.rt.arena(weights_mib << 20, scratch_mib << 20)
        self.arena.begin_step()

    def const(self, a: np.ndarray | None) -> DeviceArray | None:
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        d = self.arena.weights(a.shape, a.dtype)
        d.upload(a)
        return d

    def var(self, a: np.ndarray | None) -> DeviceArray | None:
        if a is None:
            return None
        a = np.ascontiguousarray(a)
        d = self.arena.scratch(a.shape, a.dtype)
        d.upload(a)
        return d

    def close(self) -> None:
        self.arena.close()


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
