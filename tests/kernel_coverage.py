"""Emulator kernel coverage over a test run: which kernels of cu/*.cu the CPU emulator really ran, and from which
test file (tests/conftest.py records every launch, graph replays included). At the end of a run that includes
every tests/test_cu_emu_*.py file unfiltered, a kernel that no twin test (a test_cu_emu_* file comparing against
ds4py/cuda/twins) launched fails the run (conftest's pytest_sessionfinish; under pytest-xdist the controller's, over
every worker's launches); the terminal summary says what was measured."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def kernels() -> set[str]:
    from ds4py.cuda import emu
    from ds4py.cuda.signature import parse_kernels

    return {k for f in sorted(emu.CU_DIR.glob("*.cu")) for k in parse_kernels(f.read_text())}


def twin_test_files() -> set[str]:
    return {p.name for p in HERE.glob("test_cu_emu_*.py") if "twins" in p.read_text()}


def missing_kernels(launches: dict[str, set[str]]) -> list[str]:
    """Kernels of cu/*.cu that no test file comparing against the numpy twins launched on the emulator."""
    twins = twin_test_files()
    return sorted(k for k in kernels() if not launches.get(k, set()) & twins)


def whole_run(config, files: set[str]) -> str | None:
    """None when the run measures coverage (every test_cu_emu_*.py file among the collected test files' names, no
    -k / -m / test ids), else why it does not."""
    opt = config.option
    if opt.keyword or opt.markexpr or any("::" in a for a in config.args):
        return "the run selects tests (-k, -m or test ids)"
    stage_files = {p.name for p in HERE.glob("test_cu_emu_*.py")}
    if not stage_files <= set(files):
        return "the run does not include every tests/test_cu_emu_*.py file"
    return None
