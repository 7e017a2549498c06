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


# Errors after which a CUDA context is unusable for the rest of the process ("sticky"): every later launch fails
# with the same error, so the tests after the first one would only repeat it. The device check runs each file in
# its own process and, when one of these shows up, reruns that file with CUDA_LAUNCH_BLOCKING=1 so that the
# faulting launch itself raises, naming its kernel (ds4py/cuda/launch.py).
STICKY = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED",
          "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_INVALID_PC",
          "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_LAUNCH_TIMEOUT", "CUDA_ERROR_ASSERT",
          "CUDA_ERROR_CONTEXT_IS_DESTROYED")
_context_lost: list[str] = []          # "test id (error)" of the first test that lost the context


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and not ON_EMULATOR and not _context_lost:
        text = str(rep.longrepr)
        hit = next((s for s in STICKY if s in text), None)
        if hit is not None:
            _context_lost.append(f"{item.nodeid} ({hit})")


@pytest.fixture(autouse=True)
def _cuda_context_alive(request):
    """After a sticky CUDA error, skip the rest of this process's GPU tests, naming where the context was lost."""
    if _context_lost and "tests/gpu/" in str(request.node.fspath).replace("\\", "/"):
        pytest.skip(f"CUDA context lost in {_context_lost[0]}: no more GPU work can run in this process")


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
    """The golden tiny model (../shared/golden beside the repo, or DS4PY_GOLDEN: the subset that travels to a GPU
    machine, as tests/conftest.py finds it). Skipped, with the path, where it is missing."""
    from helpers import GOLDEN

    path = GOLDEN / "ds4-tiny" / "tiny.gguf"
    if not path.is_file():
        pytest.skip(f"golden tiny model not found at {path}")
    return path
