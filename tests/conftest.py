"""Shared fixtures: golden data lives at ../shared/golden beside the repository (CI has it there too)."""

from __future__ import annotations

import os
import sys

# Before numpy loads: one BLAS thread. On the 2-core CI machine OpenBLAS's worker threads spin against the
# subprocesses the tests start (servers, CLIs); a small matmul then takes 15 ms instead of 0.2 ms.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import session_jobs  # noqa: E402
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


def _jobs_needed(item) -> list[str]:
    return [n for n in session_jobs.JOBS if f"job_{n}" in getattr(item, "fixturenames", ())]


def _waits_for(item) -> int:
    """0: waits for no background job; else 1 + the position in JOBS of the last job it waits for (the stand-in
    driver's tests wait for the NVRTC job's cache through standin_cache)."""
    names = getattr(item, "fixturenames", ())
    needed = _jobs_needed(item) + (["nvrtc_kernels"] if "standin_cache" in names else [])
    return 1 + max(list(session_jobs.JOBS).index(n) for n in needed) if needed else 0


def pytest_collection_modifyitems(session, config, items):
    # tests waiting for a background job (tests/session_jobs.py) run after the others, in the order the jobs
    # finish, so each job has had the second core meanwhile; the coverage check reads what the other tests
    # launched: it runs after all of them
    last = [i for i in items if i.name == "test_every_kernel_is_covered"]
    rest = [i for i in items if i not in last]
    items[:] = sorted(rest, key=_waits_for) + last          # a stable sort: each group keeps its order


# ---- background jobs (tests/session_jobs.py): started as the session begins, waited for by job_* fixtures ---------

@pytest.fixture(scope="session", autouse=True)
def _session_jobs(request, tmp_path_factory):
    items = request.session.items
    needed = {n for item in items for n in _jobs_needed(item)}
    files = {Path(str(item.path)).name for item in items}
    needed |= {n for n, prefixes in session_jobs.WARMUPS.items()
               if sum(f.startswith(prefixes) for f in files) >= session_jobs.WARMUP_FILES}
    workdir = lambda name: tmp_path_factory.mktemp(f"job-{name}")   # noqa: E731
    request.config.stash[_JOB_WORKDIR] = workdir
    if needed and not request.config.option.collectonly:
        session_jobs.start(sorted(needed), workdir)
    try:
        yield
    finally:
        session_jobs.stop()


_JOB_WORKDIR = pytest.StashKey()


def _waiter(request, name: str):
    """What a job_* fixture gives: call it to wait for the job's result (its exception raises in the caller)."""
    workdir = request.config.stash[_JOB_WORKDIR]
    return lambda: session_jobs.result(name, workdir)


@pytest.fixture(scope="session")
def job_nvrtc_kernels(request, _session_jobs):
    """() -> {"cache": a fresh cache folder, "compiled": {arch: {stem: CompiledModule}}}: every cu/*.cu compiled by
    NVRTC for sm_121, sm_90 and sm_90a into that cache, once per session (raises NvrtcUnavailableError without it)."""
    return _waiter(request, "nvrtc_kernels")


@pytest.fixture(scope="session")
def job_blas_rerun(request, _session_jobs):
    """() -> what tests/test_blas_kernels.py's blas_rerun_job returns."""
    return _waiter(request, "blas_rerun")


@pytest.fixture(scope="session")
def job_gpu_tests_on_emulator(request, _session_jobs):
    """() -> what tests/test_cuda_gpu_tests_on_emulator.py's gpu_tests_job returns."""
    return _waiter(request, "gpu_tests_on_emulator")


@pytest.fixture(scope="session")
def standin_cache(request, tmp_path_factory) -> Path:
    """The kernel cache of the stand-in driver's Runtime (tests/test_cuda_driverless.py). When this session runs
    tests/test_cuda_compile.py, its NVRTC job builds every kernel for sm_90 (the stand-in's arch) with the same
    options: that cache is reused, after the job, instead of compiling the same cubins a second time."""
    if session_jobs.scheduled("nvrtc_kernels"):
        try:
            return _waiter(request, "nvrtc_kernels")()["cache"]
        except Exception:       # no NVRTC (the rt fixture skips) or a compile error (Runtime reports it again)
            pass
    return tmp_path_factory.getbasetemp() / "standin-cache"
