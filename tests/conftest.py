"""Shared fixtures: golden data lives at ../shared/golden beside the repository (CI has it there too)."""

from __future__ import annotations

import os
import sys

# Before numpy loads: one BLAS thread. On the 2-core CI machine OpenBLAS's worker threads spin against the
# subprocesses the tests start (servers, CLIs); a small matmul then takes 15 ms instead of 0.2 ms.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Test this checkout, not whichever ds4py an editable install points at (git worktrees, a second clone).
sys.path.insert(0, str(REPO))
GOLDEN = REPO.parent / "shared" / "golden"


@pytest.fixture(scope="session")
def golden() -> Path:
    if not GOLDEN.is_dir():
        pytest.fail(f"golden data not found at {GOLDEN} (expected ../shared/golden beside the repo)")
    return GOLDEN


@pytest.fixture(scope="session")
def v4_gguf(golden, tmp_path_factory) -> str:
    """The official v4-tiny checkpoint converted losslessly (dense F32, experts MXFP4 = the FP4 codes + e8m0
    scales), once per session: window 16, ratios 0,0,4,128,4,128,4."""
    from ds4py.convert import convert_checkpoint

    out = tmp_path_factory.mktemp("v4tiny") / "v4-tiny-f32.gguf"
    convert_checkpoint(str(golden / "v4-tiny"), str(out), experts="mxfp4", dense="f32", progress=False)
    return str(out)


def stub_tokenizer_json(path) -> str:
    """The vocabulary the V4.1 golden run used (tt-metal's StubTokenizer: token 2k decodes to "w{k}", 2k+1 to
    " W{k}") as a HF tokenizer.json, so that the converted GGUF carries it and Engram's token map is built from
    its strings."""
    import json

    vocab = {(f"w{i // 2}" if i % 2 == 0 else f"\u0120W{i // 2}"): i for i in range(512)}
    Path(path).write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": []}))
    return str(path)


@pytest.fixture(scope="session")
def v41_gguf(golden, tmp_path_factory) -> str:
    """The official v41-tiny checkpoint converted losslessly (dense F32, experts MXFP4) with the golden run's
    vocabulary, once per session; its Engram tables stay in ../shared/golden/v41-tiny (the recorded default)."""
    from ds4py.convert import convert_checkpoint

    d = tmp_path_factory.mktemp("v41tiny")
    convert_checkpoint(str(golden / "v41-tiny"), str(d / "v41-tiny-f32.gguf"), experts="mxfp4", dense="f32",
                       tokenizer=stub_tokenizer_json(d / "tokenizer.json"), progress=False)
    return str(d / "v41-tiny-f32.gguf")


# ---- emulator kernel coverage: what the tests really launch (tests/test_cu_emu_kernels.py checks it) -----------

_LAUNCHED_KERNELS: dict[str, set[str]] = {}      # kernel name -> the test files that ran it on the emulator
_CURRENT_FILE: list[str] = [""]


def pytest_runtest_setup(item):
    _CURRENT_FILE[0] = Path(str(item.path)).name


@pytest.fixture(scope="session", autouse=True)
def _record_emulator_launches():
    """Every kernel the CPU emulator runs during this session, by name (graph replays included)."""
    try:
        from ds4py.cuda import emu_runtime
    except Exception:              # no emulator runtime in this checkout: nothing to record
        yield
        return
    real = emu_runtime.EmuRuntime._run_launch

    def run_launch(self, op):
        real(self, op)
        _LAUNCHED_KERNELS.setdefault(op.kernel.name, set()).add(_CURRENT_FILE[0])
    emu_runtime.EmuRuntime._run_launch = run_launch
    try:
        yield
    finally:
        emu_runtime.EmuRuntime._run_launch = real


@pytest.fixture
def emulator_launches() -> dict[str, set[str]]:
    return _LAUNCHED_KERNELS


def pytest_collection_modifyitems(session, config, items):
    # the coverage check reads what the other tests launched: it runs after all of them
    last = [i for i in items if i.name == "test_every_kernel_is_covered"]
    if last:
        items[:] = [i for i in items if i not in last] + last
