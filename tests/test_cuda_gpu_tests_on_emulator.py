"""The GPU tests' own code, run on the CPU emulator (tests/gpu with DS4PY_GPU_TESTS_ON_EMULATOR=1: EmuRuntime with
the pdl check, sizes cut down): a test that would fail on a lent GPU for a reason of its own fails here first."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ds4py.cuda import emu

REPO = Path(__file__).resolve().parents[1]


def gpu_tests_job(work: Path):
    """The run itself: a background session job (tests/session_jobs.py), on the second core while the suite goes on."""
    from session_jobs import run_process

    if emu.compiler() is None:
        pytest.skip("the CUDA emulator needs g++")
    env = {**os.environ, "DS4PY_GPU_TESTS_ON_EMULATOR": "1", "PYTHONPATH": str(REPO)}
    return run_process([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"], cwd=REPO,
                       env=env, timeout=600)


@pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
def test_gpu_tests_pass_on_the_emulator(job_gpu_tests_on_emulator):
    r = job_gpu_tests_on_emulator()
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and "failed" not in r.stdout.splitlines()[-1], tail
