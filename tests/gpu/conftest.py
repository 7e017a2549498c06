"""GPU fixtures: one Runtime per session; every test here is skipped, with the reason, when there is no device.

DS4PY_GPU_TESTS_ON_EMULATOR=1 runs them on the CPU emulator instead (EmuRuntime with the pdl check), to check the
test code itself without a GPU (tests/test_cuda_gpu_tests_on_emulator.py does, in CI); there gpu_sizes.shrink() cuts the
real V4 Flash sizes down and tests marked real_size are skipped."""

from __future__ import annotations

import pytest

from cu_fixtures import fresh_arena, putter
from gpu_sizes import ON_EMULATOR

from ds4py.errors import CudaUnavailableError


def pytest_configure(config):
    config.addinivalue_line("markers", "real_size: V4 Flash shapes; skipped when the GPU tests run on the emulator")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if ON_EMULATOR and item.get_closest_marker("real_size"):
                item.add_marker(pytest.mark.skip(reason="real-size GPU test: too slow for the emulator"))


@pytest.fixture(scope="session")
def rt():
    if ON_EMULATOR:
        from ds4py.cuda.emu_runtime import EmuRuntime

        yield EmuRuntime(order="random", seed=3, check_pdl=True)
        return
    from ds4py.cuda import driver

    try:
        driver.api()
    except CudaUnavailableError as e:
        pytest.skip(f"no CUDA device: {e}")
    from ds4py.cuda.runtime import Runtime

    r = Runtime()
    yield r
    r.close()


@pytest.fixture
def arena(rt):
    with fresh_arena(rt, 512 << 20, 64 << 20) as a:
        yield a


@pytest.fixture
def put(arena):
    """put(host, weights=True): upload a host array into the arena (weights region, or scratch)."""
    return putter(arena)


@pytest.fixture(scope="session")
def tiny_gguf():
    """The golden tiny model (../shared/golden beside the repo, as tests/conftest.py finds it). A device machine
    gets only the repository, so there it is skipped rather than failed."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2].parent / "shared" / "golden" / "ds4-tiny" / "tiny.gguf"
    if not path.is_file():
        pytest.skip(f"golden tiny model not found at {path}")
    return path
