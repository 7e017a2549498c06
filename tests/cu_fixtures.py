"""Fixtures for the kernel tests that run on the CPU emulator (tests/test_cu_emu_<stage>.py): an EmuRuntime in
each thread order, its arena, and `put` to upload host arrays. tests/gpu/ re-runs the same test functions with
its own rt / arena / put fixtures on a real device."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu

ORDERS = ("forward", "reverse", "random")

requires_emulator = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")


@pytest.fixture(params=ORDERS)
def rt(request):
    """Every launch also checks the PDL rule: no store to an argument and no return before pdl_wait()."""
    from ds4py.cuda.emu_runtime import EmuRuntime

    return EmuRuntime(order=request.param, seed=17, check_pdl=True)


@pytest.fixture
def arena(rt):
    a = rt.arena(weights_bytes=48 << 20, scratch_bytes=16 << 20)
    a.begin_step()
    yield a
    rt.synchronize()
    a.close()


@pytest.fixture
def put(arena):
    """put(host, weights=True): upload a host array into the arena (weights region, or scratch)."""

    def _put(host: np.ndarray, weights: bool = True):
        host = np.ascontiguousarray(host)
        d = arena.weights(host.shape, host.dtype) if weights else arena.scratch(host.shape, host.dtype)
        d.upload(host)
        return d

    return _put


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng(list(seed))
