"""Every kernel in cu/*.cu has an emulator test against its numpy twin (ds4py/cuda/twins/): the tests live in
tests/test_cu_emu_<stage>.py. Coverage is what those tests really launch (tests/conftest.py records every
kernel the emulator runs, and in which test file), not a hand-kept list: a kernel lands without a test, or a
test stops launching it, and test_every_kernel_is_covered fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from cu_fixtures import requires_emulator
from ds4py.cuda import emu
from ds4py.cuda.signature import parse_kernels

HERE = Path(__file__).resolve().parent


def missing_kernels(launches: dict[str, set[str]]) -> list[str]:
    """Kernels of cu/*.cu that no test file comparing against the numpy twins launched on the emulator."""
    twin_tests = {p.name for p in HERE.glob("test_cu_emu_*.py") if "twins" in p.read_text()}
    kernels = {k for f in sorted(emu.CU_DIR.glob("*.cu")) for k in parse_kernels(f.read_text())}
    return sorted(k for k in kernels if not launches.get(k, set()) & twin_tests)


@requires_emulator
def test_every_kernel_is_covered(request, emulator_launches):
    """Runs last (tests/conftest.py orders it), over a run that includes every tests/test_cu_emu_*.py file."""
    cfg = request.config
    ran = {Path(str(i.path)).name for i in request.session.items}
    stage_files = {p.name for p in HERE.glob("test_cu_emu_*.py")} - {Path(__file__).name}
    if cfg.option.keyword or cfg.option.markexpr or any("::" in a for a in cfg.args) or not stage_files <= ran:
        pytest.skip("kernel coverage is measured over a run of every tests/test_cu_emu_*.py file "
                    "(no -k, -m or test ids)")
    assert emulator_launches, "no kernel ran on the emulator in this session"
    missing = missing_kernels(emulator_launches)
    assert not missing, f"kernels no twin test launched on the emulator: {', '.join(missing)}"


def test_the_coverage_check_sees_a_kernel_nobody_launches():
    kernels = {k for f in sorted(emu.CU_DIR.glob("*.cu")) for k in parse_kernels(f.read_text())}
    assert missing_kernels({}) == sorted(kernels)
    everywhere = {k: {"test_cu_emu_gemv.py"} for k in kernels}
    assert missing_kernels(everywhere) == []
    one = sorted(kernels)[0]
    assert missing_kernels({**everywhere, one: {"test_cu_emu_portable.py"}}) == [one]   # not a twin test
