"""The emulator as a checker (docs/cuda-emu.md "Checker builds"): each mode catches what it claims, proven on
planted bugs in test-only kernels (tests/emu_kernels/checkers.cu) next to their correct twins, and then runs
over every kernel of the CUDA engine on the golden tiny models (python -m ds4py.cuda.emu_check)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4py.cuda import emu

REPO = Path(__file__).resolve().parents[1]
CHECKERS = REPO / "tests" / "emu_kernels" / "checkers.cu"
pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the emulator needs g++")


@pytest.fixture(scope="module")
def race():
    return emu.EmuModule(CHECKERS, check="race")


def test_race_detector_reports_planted_races_and_not_their_fixes(race):
    x, y = np.arange(64, dtype=np.float32), np.zeros(64, np.float32)
    race.launch("neighbour_sum", 1, 64, [x, y, 1])                          # with the barrier: no report
    assert y[0] == 1 and y[63] == 63
    with pytest.raises(emu.EmuKernelError, match=r"neighbour_sum: thread \(1,0,0\) of block \(0,0,0\): shared-memory "
                       r"race: a write to static __shared__ byte \d+ \(address 0x[0-9a-f]+: byte 4 of "
                       r"neighbour_sum::s, 1024 bytes\) that thread \(0,0,0\) read"):
        race.launch("neighbour_sum", 1, 64, [x, y, 0])
    out = np.zeros(64, np.int32)
    race.launch("shared_counter", 1, 64, [out, 0])                          # all atomic: no race
    assert (out == 64).all()
    with pytest.raises(emu.EmuKernelError, match="an atomic write to .* that thread \\(0,0,0\\) wrote in the same"):
        race.launch("shared_counter", 1, 64, [out, 1])                      # a plain store among the atomics
    x, y = np.arange(32, dtype=np.float32), np.zeros(32, np.float32)
    race.launch("warp_swap", 1, 32, [x, y, 1])                              # __syncwarp orders the lanes
    assert y[0] == 1 and y[1] == 0
    with pytest.raises(emu.EmuKernelError, match="warp_swap: .*shared-memory race"):
        race.launch("warp_swap", 1, 32, [x, y, 0])


def test_race_on_a_template_local_shared_array_is_reported(race):
    """The shared array of a function template (g++ ignores the section attribute of a template's static local;
    the build moves it into emu_shared) is checked like any other, named by its function."""
    x, y = np.arange(64, dtype=np.float32), np.zeros(64, np.float32)
    race.launch("tpl_neighbour_sum", 1, 64, [x, y, 1])
    assert y[0] == 1 and y[63] == 63
    with pytest.raises(emu.EmuKernelError, match=r"tpl_neighbour_sum: thread \(1,0,0\) .*shared-memory race: a write "
                       r"to static __shared__ byte \d+ \(address 0x[0-9a-f]+: byte 4 of "
                       r"tpl_neighbour<256>\(float const\*, int\)::s, 1024 bytes\) that thread \(0,0,0\) read"):
        race.launch("tpl_neighbour_sum", 1, 64, [x, y, 0])


def test_template_local_shared_arrays_count_as_static_shared_memory():
    """Every __shared__ array of checkers.cu lies in the static shared-memory section the runtime poisons and the
    checkers classify: s[256] + count + s[32] + a[32] + b[32] + the template's s[256] (with alignment padding)."""
    assert emu.EmuModule(CHECKERS).static_smem_bytes >= 4 * (256 + 1 + 32 + 32 + 32 + 256)


def test_the_plain_emulator_misses_what_the_checkers_find():
    """Why the checker builds exist: the same planted bugs pass silently on the plain build."""
    m = emu.EmuModule(CHECKERS)
    y = np.zeros(64, np.float32)
    m.launch("neighbour_sum", 1, 64, [np.arange(64, dtype=np.float32), y, 0])    # the race: no error
    m.launch("shifted_copy", 1, 32, [np.arange(5, dtype=np.float32), y[:32].copy(), 5, 1])  # into the padding
    m.launch("dyn_underflow", 1, 32, [y[:32].copy(), -1], shared_mem=128)
    m.launch("static_overrun", 1, 32, [y[:32].copy(), 1])


ASAN_CASES = {   # case -> (kernel, args builder, what the report must say)
    "past_end": ("AddressSanitizer: use-after-poison", "shifted_copy", "thread (4,0,0)"),
    "before_start": ("AddressSanitizer: use-after-poison", "shifted_copy", "thread (0,0,0)"),
    "dyn": ("AddressSanitizer: use-after-poison", "dyn_underflow", "thread (0,0,0)"),
    "static": ("runtime error: index 32 out of bounds for type 'float [32]'", "static_overrun", "checkers.cu:"),
    "ub": ("runtime error: signed integer overflow", "add_overflow", "checkers.cu:"),
}
ASAN_SCRIPT = """
import sys, numpy as np
from ds4py.cuda import emu
m = emu.EmuModule(sys.argv[1], check="asan")
case, y = sys.argv[2], np.zeros(32, np.float32)
x = np.arange(5, dtype=np.float32)
if case == "clean":
    m.launch("shifted_copy", 1, 32, [x, y, 5, 0]); m.launch("static_overrun", 1, 32, [y, 0])
    m.launch("dyn_underflow", 1, 32, [y, 0], shared_mem=128)
    m.launch("add_overflow", 1, 32, [np.zeros(32, np.int32), 5])
    print("clean: no report")
    sys.exit(0)
{"past_end": lambda: m.launch("shifted_copy", 1, 32, [x, y, 5, 1]),
 "before_start": lambda: m.launch("shifted_copy", 1, 32, [x, y, 5, -1]),
 "dyn": lambda: m.launch("dyn_underflow", 1, 32, [y, -1], shared_mem=128),
 "static": lambda: m.launch("static_overrun", 1, 32, [y, 1]),
 "ub": lambda: m.launch("add_overflow", 1, 32, [np.zeros(32, np.int32), 2**31 - 1])}[case]()
print("NO REPORT")
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ with libasan")
def test_asan_build_reports_planted_overruns_and_undefined_behaviour():
    from ds4py.cuda.emu_check import asan_env

    env = {**asan_env(), "PYTHONPATH": str(REPO)}
    emu.build(CHECKERS, check="asan")                      # once, before the processes start
    procs = {c: subprocess.Popen([sys.executable, "-c", ASAN_SCRIPT, str(CHECKERS), c], env=env, cwd=REPO,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in ["clean", *ASAN_CASES]}
    out = {c: p.communicate(timeout=300)[0] for c, p in procs.items()}
    assert procs["clean"].returncode == 0 and "clean: no report" in out["clean"], out["clean"][-2000:]
    for case, (report, kernel, where) in ASAN_CASES.items():
        text = out[case]
        assert procs[case].returncode != 0 and "NO REPORT" not in text, (case, text[-2000:])
        assert report in text and kernel in text and where in text, (case, text[-3000:])
        if "AddressSanitizer" in report:      # the death callback names the emulated thread and kernel
            assert f"ds4py emulator: the error above is in {where} of block (0,0,0) of kernel {kernel}" in text


# The engine-wide asan run costs ~3.6 CPU-minutes cold (16 sanitizer builds, then the workload under ASan), the
# race run ~1.7: the race run is part of every suite, the asan one when DS4PY_EMU_CHECKS=1 (measured on the
# 2-core CI machine kind; docs/cuda-emu.md "Checker builds").
@pytest.mark.parametrize("mode", [
    "race",
    pytest.param("asan", marks=pytest.mark.skipif(not os.environ.get("DS4PY_EMU_CHECKS"), reason=(
        "the engine-wide AddressSanitizer run takes ~3.6 CPU-minutes; set DS4PY_EMU_CHECKS=1 to run it "
        "(python -m ds4py.cuda.emu_check asan by hand)"))),
])
def test_every_engine_kernel_under_the_checkers(mode, tmp_path, golden):
    """The CUDA engine's paths on ds4-tiny, v4-tiny, v41-tiny and a VQ-8 + q4_K model (emu_check.vq_q4k_model) plus
    synthetic models in the other expert formats, under the race detector and under ASan + UBSan: nothing
    reported, and every kernel of cu/*.cu launched except the documented few no engine path reaches
    (emu_check.UNREACHED)."""
    out = tmp_path / f"{mode}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS4PY_GOLDEN": str(golden)}
    r = subprocess.run([sys.executable, "-m", "ds4py.cuda.emu_check", mode, "--json", str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=1500)
    res = json.loads(out.read_text())
    assert r.returncode == 0 and res["ok"], (r.stdout[-2000:], r.stderr[-3000:])
    assert len(res["models"]) == 4 and not res["not_covered"], res
    print(f"{mode}: {len(res['launches'])} kernels, {sum(res['launches'].values())} launches, {res['seconds']} s")
