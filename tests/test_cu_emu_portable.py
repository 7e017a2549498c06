"""The emulator's self-test kernels (which use every portable.cuh wrapper) are real CUDA: NVRTC compiles them, so
the PTX paths of portable.cuh build for each arch we target. Runs without a GPU; skipped without NVRTC."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from ds4py.cuda import emu

SELFTEST = Path(__file__).parent / "emu_kernels" / "selftest.cu"


@pytest.fixture(scope="module")
def nvrtc():
    from ds4py.cuda import compiler

    try:
        compiler.nvrtc_version()
    except Exception as e:
        pytest.skip(f"NVRTC not available: {e}")
    return compiler


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90", "sm_120", "sm_121"])
def test_selftest_and_portable_compile_with_nvrtc(nvrtc, arch, tmp_path):
    if int(arch[3:]) not in nvrtc.supported_archs():
        pytest.skip(f"this NVRTC does not know {arch}")
    shutil.copy(emu.CU_DIR / "portable.cuh", tmp_path)
    src = tmp_path / SELFTEST.name
    shutil.copy(SELFTEST, src)
    mod = nvrtc.compile_file(src, arch, cache=False)
    assert set(mod.kernels) <= {r.name for r in mod.resources.values()} and len(mod.cubin) > 0


def test_inline_ptx_only_in_portable():
    # The convention that keeps the emulator honest: no asm() in kernels, only in portable.cuh's wrappers.
    asm = re.compile(r"\b(?:asm|__asm__)\s*(?:volatile\s*|__volatile__\s*)?\(")
    offenders = [f.name for f in sorted(emu.CU_DIR.glob("*.cu*")) if f.name != "portable.cuh"
                 and asm.search(f.read_text())]
    assert asm.search((emu.CU_DIR / "portable.cuh").read_text())
    assert not offenders, f"inline PTX outside cu/portable.cuh: {offenders}"
