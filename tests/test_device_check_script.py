"""bench/device_check.sh without a GPU, under a tiny time budget: the script parses, runs every step in order
with its limit cut to what is left of DS4PY_CHECK_BUDGET_S (so a lent GPU's 10 minutes cannot be overrun),
writes summary.json / versions.json into $OUT, and fails (exit 1) when the GPU steps cannot pass."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = ["setup", "build", "gpu_tests", "cuda_decode", "cuda_prefill", "bandwidth", "attn_moe", "sanitizer",
         "cpu_tests"]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash + timeout")
def test_device_check_keeps_its_budget_and_reports_every_step(tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc", reason="the device check's setup step needs cuda-bindings")
    budget = 4
    t0 = time.monotonic()
    r = subprocess.run(["bash", "bench/device_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OUT": str(tmp_path), "DS4PY_SKIP_SETUP": "1",
                            "DS4PY_CHECK_BUDGET_S": str(budget)})
    wall = time.monotonic() - t0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary)[:-1] == STEPS and summary["total_seconds"] <= wall + 1, r.stdout
    assert "nvrtc" in json.loads((tmp_path / "versions.json").read_text())
    assert r.returncode == 1 and summary["build"]["status"] != "0"           # 4 s cannot build every kernel
    # past the budget each remaining step gets 1 s: the script ends within the budget plus a second a step
    assert wall < budget + len(STEPS) + 15, (wall, r.stdout)
    assert all(int(s["seconds"]) <= max(budget, 2) for k, s in summary.items() if k != "total_seconds")
