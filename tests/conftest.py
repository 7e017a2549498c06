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


@pytest.fixture(scope="session")
def v4_gguf(golden, tmp_path_factory) -> str:
    """The official v4-tiny checkpoint converted losslessly (dense F32, experts MXFP4 = the FP4 codes + e8m0
    scales), once per session: window 16, ratios 0,0,4,128,4,128,4."""
    from ds4py.convert import convert_checkpoint

    out = tmp_path_factory.mktemp("v4tiny") / "v4-tiny-f32.gguf"
    convert_checkpoint(str(golden / "v4-tiny"), str(out), experts="mxfp4", dense="f32", progress=False)
    return str(out)
