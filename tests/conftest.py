"""Shared fixtures: golden data lives at ../shared/golden beside the repository (CI has it there too)."""

from __future__ import annotations

import os
import sys

# Before numpy loads: one BLAS thread. On the 2-core CI machine OpenBLAS's worker threads spin against the
# subprocesses the tests start (servers, CLIs); a small matmul then takes 15 ms instead of 0.2 ms.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from helpers import GOLDEN, stub_tokenizer_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Test this checkout, not whichever ds4py an editable install points at (git worktrees, a second clone).
sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def golden() -> Path:
    if not GOLDEN.is_dir():
        if os.environ.get("DS4PY_GOLDEN"):
            pytest.skip(f"golden data not found at {GOLDEN} (DS4PY_GOLDEN)")
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


@pytest.fixture(scope="session")
def v4_mtp_gguf(golden, tmp_path_factory) -> tuple[str, str]:
    """The official v4-tiny-mtp checkpoint converted losslessly (dense F32, experts MXFP4), once per session:
    (main GGUF, MTP draft GGUF written by convert --mtp)."""
    from ds4py.convert import convert_checkpoint

    d = tmp_path_factory.mktemp("v4tinymtp")
    out, mtp = d / "v4-tiny-mtp-f32.gguf", d / "v4-tiny-mtp-f32.mtp.gguf"
    convert_checkpoint(str(golden / "v4-tiny-mtp"), str(out), experts="mxfp4", dense="f32", progress=False,
                       mtp=str(mtp))
    return str(out), str(mtp)


@pytest.fixture(scope="session")
def v41_gguf(golden, tmp_path_factory) -> str:
    """The official v41-tiny checkpoint converted losslessly (dense F32, experts MXFP4) with the golden run's
    vocabulary, once per session; its Engram tables stay in ../shared/golden/v41-tiny (the recorded default)."""
    from ds4py.convert import convert_checkpoint

    d = tmp_path_factory.mktemp("v41tiny")
    convert_checkpoint(str(golden / "v41-tiny"), str(d / "v41-tiny-f32.gguf"), experts="mxfp4", dense="f32",
                       tokenizer=stub_tokenizer_json(d / "tokenizer.json"), progress=False)
    return str(d / "v41-tiny-f32.gguf")


@pytest.fixture(scope="session")
def dspark_gguf(golden, tmp_path_factory) -> str:
    """The official v41-tiny-dspark checkpoint (V4.1 with its DSpark draft) converted losslessly into one GGUF
    (backbone and draft; dense F32, experts MXFP4), once per session; Engram tables stay in the golden folder."""
    from ds4py.convert import convert_checkpoint

    d = tmp_path_factory.mktemp("v41dspark")
    convert_checkpoint(str(golden / "v41-tiny-dspark"), str(d / "v41-tiny-dspark-f32.gguf"), experts="mxfp4",
                       dense="f32", tokenizer=stub_tokenizer_json(d / "tokenizer.json"), progress=False)
    return str(d / "v41-tiny-dspark-f32.gguf")


# ---- emulator kernel coverage over the run (tests/kernel_coverage.py) ------------------------------------------

_LAUNCHED_KERNELS: dict[str, set[str]] = {}      # kernel name -> the test files that ran it on the emulator
_CURRENT_FILE: list[str] = [""]
_RUN = {"deselected": 0, "items": []}


def pytest_runtest_setup(item):
    _CURRENT_FILE[0] = Path(str(item.path)).name


def pytest_deselected(items):
    _RUN["deselected"] += len(items)


def pytest_collection_finish(session):
    _RUN["items"] = list(session.items)


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


def _coverage(session) -> tuple[str, list[str] | None]:
    """(what the summary says, the kernels no twin test launched, or None when this run does not measure it)."""
    import kernel_coverage as kc
    from ds4py.cuda import emu

    why = kc.whole_run(session.config, _RUN["items"])
    if why is None and _RUN["deselected"]:
        why = f"{_RUN['deselected']} tests were deselected"
    if why is None and (session.shouldstop or session.shouldfail):
        why = "the run stopped early"
    if why is None and emu.compiler() is None:
        why = "the CUDA emulator needs g++, which this machine lacks"
    if why is not None:
        return f"not measured: {why}", None
    missing = kc.missing_kernels(_LAUNCHED_KERNELS)
    n = len(kc.kernels())
    if missing:
        return f"FAILED: {len(missing)} of {n} kernels launched by no twin test: {', '.join(missing)}", missing
    return f"all {n} kernels of cu/*.cu launched by their twin tests", missing


def pytest_sessionfinish(session, exitstatus):
    """A run of the whole suite fails when a kernel went untested on the emulator (a kernel landed without a test,
    or a test stopped launching it): checked once every test has run, whatever order they ran in."""
    text, missing = _coverage(session)
    session.config.stash[_COVERAGE] = text
    if missing and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    text = config.stash.get(_COVERAGE, None)
    if text is not None:
        terminalreporter.write_sep("-", "emulator kernel coverage")
        terminalreporter.write_line(text)


_COVERAGE = pytest.StashKey[str]()


# ---- NVRTC builds of every kernel (tests/nvrtc_build.py), once per run, when a test asks ------------------------

@pytest.fixture(scope="session")
def nvrtc_kernels(tmp_path_factory) -> dict:
    """{"cache": a fresh cache folder, "compiled": {arch: {stem: CompiledModule}}}: every cu/*.cu compiled by NVRTC
    for sm_121, sm_90 and sm_90a into that cache (raises NvrtcUnavailableError without NVRTC)."""
    from ds4py.cuda import compiler
    from nvrtc_build import nvrtc_kernels as build

    try:
        return build(tmp_path_factory.mktemp("nvrtc"))
    except compiler.NvrtcUnavailableError as e:
        pytest.skip(f"NVRTC cannot load: {e}")


@pytest.fixture(scope="session")
def standin_cache(request, tmp_path_factory) -> Path:
    """The kernel cache of the stand-in driver's Runtime (tests/test_cuda_driverless.py). When this run also runs
    tests/test_cuda_compile.py, its NVRTC build holds every kernel for sm_90 (the stand-in's arch) with the same
    options: that cache is reused instead of compiling the same cubins a second time."""
    if any("nvrtc_kernels" in getattr(i, "fixturenames", ()) for i in request.session.items):
        try:
            return request.getfixturevalue("nvrtc_kernels")["cache"]
        except (Exception, pytest.skip.Exception):   # no NVRTC (the rt fixture skips) or a compile error
            pass                                        # (the Runtime reports it again)
    return tmp_path_factory.getbasetemp() / "standin-cache"
