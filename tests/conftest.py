"""Shared fixtures: golden data lives at ../shared/golden beside the repository (CI has it there too)."""

from __future__ import annotations

import os
import sys

# Before numpy loads: one BLAS thread. On the 2-core CI machine OpenBLAS's worker threads spin against the
# subprocesses the tests start (servers, CLIs); a small matmul then takes 15 ms instead of 0.2 ms.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# Test this checkout, not whichever ds4py an editable install points at (git worktrees, a second clone).
sys.path.insert(0, str(REPO))
GOLDEN = REPO.parent / "shared" / "golden"


@pytest.fixture(scope="session")
def golden() -> Path:
    if not GOLDEN.is_dir():
        pytest.fail(f"golden data not found at {GOLDEN} (expected ../shared/golden beside the repo)")
    return GOLDEN
