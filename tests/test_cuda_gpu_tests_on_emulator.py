"""The GPU tests' own code, run on the CPU emulator (tests/gpu with DS4PY_GPU_TESTS_ON_EMULATOR=1: EmuRuntime with
the pdl check, sizes cut down): a test that would fail on a lent GPU for a reason of its own fails here first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds4py.cuda import emu

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
def test_gpu_tests_pass_on_the_emulator():
    env = {**os.environ, "DS4PY_GPU_TESTS_ON_EMULATOR": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/gpu"], cwd=REPO,
                       env=env, timeout=600, capture_output=True, text=True)
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and "failed" not in r.stdout.splitlines()[-1], tail
