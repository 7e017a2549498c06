"""Shared fixtures: golden data lives at ../shared/golden beside the repository (CI has it there too)."""

from __future__ import annotations

import os
import sys

# Before numpy loads: one BLAS thread. On the 2-core CI machine OpenBLAS's worker threads spin against the
# subprocesses the tests start (servers, CLIs); a small matmul then takes 15 ms instead of 0.2 ms.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from helpers import GOLDEN, TRAINED, stub_tokenizer_json  # noqa: E402

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
def trained() -> Path:
    """../shared/trained/v4-tiny-trained: a tiny V4 + MTP trained on code and prose (its README)."""
    if not TRAINED.is_dir():
        pytest.skip(f"the trained tiny model is not at {TRAINED}")
    return TRAINED


@pytest.fixture(scope="session")
def trained_gguf(trained, tmp_path_factory) -> tuple[str, str]:
    """The trained tiny checkpoint converted losslessly with its tokenizer (dense F16, F32 where F16 is not
    exact; experts MXFP4), once per session: (main GGUF, MTP draft GGUF)."""
    from ds4py.convert import convert_checkpoint

    d = tmp_path_factory.mktemp("v4trained")
    out, mtp = d / "v4-tiny-trained.gguf", d / "v4-tiny-trained.mtp.gguf"
    convert_checkpoint(str(trained), str(out), experts="mxfp4", dense="f16", progress=False, mtp=str(mtp),
                       tokenizer=str(trained / "tokenizer.json"))
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


# ---- pytest-xdist: how many workers, which tests share one ------------------------------------------------------
# pyproject's addopts runs the suite with `-n auto --dist loadgroup`; `-n 0` runs it in this one process.

MAX_WORKERS = 8      # each worker holds its own emulated models (~1-2 GB at its peak)
# the work units that take minutes (xdist_group names, test file names), sent out first: started last, one of them
# would run on alone while the other workers have nothing left
FIRST_UNITS = ("nvrtc",)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """-n auto: one worker per CPU this process may run on (xdist's own count takes physical cores when psutil is
    there: 1 on a 2-vCPU machine), at most MAX_WORKERS; PYTEST_XDIST_AUTO_NUM_WORKERS still decides when set."""
    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if env:
        return int(env)
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                      MAX_WORKERS))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, by file: every test file is one unit of work (its module fixtures are built once, on one
    worker), and the files marked with one xdist_group (they share a session fixture, e.g. the NVRTC build) go to
    one worker together. Units go out in collection order, FIRST_UNITS first (pytest_collection_modifyitems)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    config.option.loadscopereorder = False     # xdist's order (most tests first) would undo FIRST_UNITS

    class FileOrGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return super()._split_scope(nodeid).split("::", 1)[0]   # a group's name, or the test's file

    return FileOrGroupScheduling(config, log)


def _unit(item) -> str:
    group = item.get_closest_marker("xdist_group")
    return group.args[0] if group is not None and group.args else Path(str(item.path)).name


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """xdist workers: FIRST_UNITS' tests first, the rest in their order (every worker sorts alike: the controller
    checks that all collected the same list)."""
    if _is_xdist_worker(config):
        items.sort(key=lambda item: FIRST_UNITS.index(u) if (u := _unit(item)) in FIRST_UNITS else len(FIRST_UNITS))


# ---- emulator kernel coverage over the run (tests/kernel_coverage.py) ------------------------------------------
# Under pytest-xdist (the default, pyproject's addopts) every worker records the launches of the tests it ran and
# hands them to the controller at its end (workeroutput); the controller checks the union. With -n 0 this one
# process records and checks.

_LAUNCHED_KERNELS: dict[str, set[str]] = {}      # kernel name -> the test files that ran it on the emulator
_CURRENT_FILE: list[str] = [""]
# what this run collected and deselected, and why its launches are incomplete (a worker that died, a stopped run)
_RUN: dict = {"deselected": 0, "files": set(), "incomplete": []}
_COVERAGE_OUT = "ds4py_kernel_coverage"            # the key of a worker's launches in its workeroutput


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_runtest_setup(item):
    _CURRENT_FILE[0] = Path(str(item.path)).name


def pytest_deselected(items):
    _RUN["deselected"] += len(items)


def pytest_collection_finish(session):
    _RUN["files"] = {Path(str(i.path)).name for i in session.items}


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


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist controller: a worker finished (or died); take its launches and what it collected."""
    out = getattr(node, "workeroutput", None) or {}
    got = out.get(_COVERAGE_OUT)
    if error is not None or got is None:
        _RUN["incomplete"].append(f"worker {node.gateway.id} died")
        return
    for kernel, files in got["launches"].items():
        _LAUNCHED_KERNELS.setdefault(kernel, set()).update(files)
    _RUN["files"] |= set(got["files"])
    _RUN["deselected"] = max(_RUN["deselected"], got["deselected"])   # every worker deselects the same tests
    if got["stopped"]:
        _RUN["incomplete"].append("the run stopped early")


def _coverage(session) -> tuple[str, list[str] | None]:
    """(what the summary says, the kernels no twin test launched, or None when this run does not measure it)."""
    import kernel_coverage as kc
    from ds4py.cuda import emu

    why = kc.whole_run(session.config, _RUN["files"])
    if why is None and _RUN["deselected"]:
        why = f"{_RUN['deselected']} tests were deselected"
    if why is None and (session.shouldstop or session.shouldfail or _RUN["incomplete"]):
        why = (_RUN["incomplete"] or ["the run stopped early"])[0]
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
    or a test stopped launching it): checked once every test has run, whatever order they ran in (under xdist: by
    the controller, over every worker's launches)."""
    if _is_xdist_worker(session.config):
        session.config.workeroutput[_COVERAGE_OUT] = {
            "launches": {k: sorted(v) for k, v in _LAUNCHED_KERNELS.items()}, "files": sorted(_RUN["files"]),
            "deselected": _RUN["deselected"], "stopped": bool(session.shouldstop or session.shouldfail)}
        return
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
    for sm_121 and sm_90 (sm_90a for the arch-specific sources) into that cache (raises NvrtcUnavailableError
    without NVRTC)."""
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
