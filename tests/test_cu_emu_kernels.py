"""Every kernel in cu/*.cu has an emulator test against its numpy twin (ds4py/cuda/twins/): the tests live in
tests/test_cu_emu_<stage>.py. Coverage is what those tests really launch (tests/conftest.py records every
kernel the emulator runs, and in which test file), not a hand-kept list: a kernel lands without a test, or a
test stops launching it, and a run of the whole suite fails at its end (conftest's pytest_sessionfinish, with
tests/kernel_coverage.py). Here: the check itself."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import kernel_coverage
from kernel_coverage import missing_kernels, whole_run

HERE = Path(__file__).resolve().parent


def test_the_coverage_check_sees_a_kernel_nobody_launches():
    kernels = kernel_coverage.kernels()
    assert kernels and missing_kernels({}) == sorted(kernels)
    everywhere = {k: {"test_cu_emu_gemv.py"} for k in kernels}
    assert missing_kernels(everywhere) == []
    one = sorted(kernels)[0]
    assert missing_kernels({**everywhere, one: {"test_cu_emu_portable.py"}}) == [one]   # not a twin test


def test_coverage_is_measured_over_whole_runs_only():
    files = {f.name for f in HERE.glob("test_*.py")}

    def config(keyword="", markexpr="", args=("tests",)):
        return SimpleNamespace(option=SimpleNamespace(keyword=keyword, markexpr=markexpr), args=list(args))
    assert whole_run(config(), files) is None
    assert "selects" in whole_run(config(keyword="gemv"), files)
    assert "selects" in whole_run(config(markexpr="not slow"), files)
    assert "selects" in whole_run(config(args=("tests/test_cu_emu_gemv.py::test_x",)), files)
    assert "every tests/test_cu_emu_" in whole_run(config(), files - {"test_cu_emu_gemv.py"})
