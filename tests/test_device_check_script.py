"""bench/device_check.sh, proven without a GPU so that a few minutes on a lent GPU are not lost to setup.

- the plan: every tests/gpu file has its own step, the step limits add up inside the budget, the budget and the
  summary fit the shot (under 7 minutes), an --only rerun fits 3 minutes;
- the dry run: a clean Python 3.12 venv holding only the GPU machine's packages (pip --no-index, wheels cached
  under ~/.cache/ds4py/device-env), the carried wheels installed as on the machine, then every step: each must
  pass or stop for want of a GPU, $OUT must hold exactly summary.json + results.tar.gz within the device tool's
  rules, and what travels must stay under 64 MiB;
- a step that runs out of time still leaves summary.json and the archive, and the exit status says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHOT_S = 410                    # the whole script, on the GPU machine (under 7 minutes)
RERUN_S = 180                   # --only
needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def plan(*args: str) -> tuple[int, dict[str, tuple[str, int]]]:
    r = subprocess.run(["bash", "bench/device_check.sh", "--plan", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items() if k != "DS4PY_CHECK_BUDGET_S"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.split("\n")
    budget = int(lines[0].split()[1])
    steps = {n: (g, int(lim)) for n, g, lim in (ln.split() for ln in lines[1:] if ln.strip())}
    return budget, steps


@needs_bash
def test_plan_covers_every_gpu_test_file_within_the_budget():
    budget, steps = plan()
    files = sorted(p.stem for p in (REPO / "tests" / "gpu").glob("test_*.py")) + ["test_cu_emu_gpu"]
    assert all(f in steps and steps[f][0] == "tests" for f in files), (files, steps)
    assert {"setup", "doctor", "build", "memcheck", "racecheck", "synccheck", "cuda_decode", "cuda_decode_v41"} \
        <= set(steps)
    assert sum(lim for _, lim in steps.values()) <= budget <= SHOT_S - 30      # 30 s: summary, kill grace
    budget, chosen = plan("--only", "tests,memcheck")
    assert set(chosen) == {"setup", "memcheck"} | set(files)
    assert budget <= RERUN_S - 10


def dry_run(tmp_path: Path, *args: str, budget: int | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DS4PY_CHECK_SCRATCH": str(tmp_path / "scratch")}
    env.pop("PYTHONPATH", None)                  # the venv must stand on its own (the script sets its own)
    if budget is not None:
        env["DS4PY_CHECK_BUDGET_S"] = str(budget)
    r = subprocess.run(["bash", "bench/device_check.sh", "--dry-run", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=900, env=env)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    return r, summary


@pytest.fixture(scope="module")
def carried():
    """.device/: the carried wheels and the golden subset, plus the GPU machine's packages for the dry run."""
    r = subprocess.run(["bash", "bench/device_wheels.sh", "--env"], cwd=REPO, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@needs_bash
def test_dry_run_reaches_every_gpu_call(tmp_path, carried):
    r, summary = dry_run(tmp_path)
    log = r.stdout + r.stderr
    steps = summary["steps"]
    assert r.returncode == 0 and summary["ok"] and summary["mode"] == "dry-run", log[-4000:]
    bad = {k: v for k, v in steps.items() if v["status"] not in ("ok", "no_gpu", "not_installed")}
    assert not bad, bad
    # what must run without a GPU ran, and the GPU steps stopped for that reason only
    assert steps["setup"]["status"] == steps["doctor"]["status"] == steps["build"]["status"] == "ok", steps
    for bench in ("cuda_decode", "cuda_decode_v41"):   # the V4.1 one wrote its Engram table before the GPU call
        assert steps[bench]["status"] == "no_gpu" and "GPU" in steps[bench]["reason"], steps[bench]
    assert all(steps[f]["status"] == "no_gpu" for f in steps if f.startswith("test_")), steps
    assert summary["tests"]["test_gpu_engine"]["skipped"] > 0
    # the GPU machine's Python and package set
    setup = (tmp_path / "scratch" / "logs" / "setup.txt").read_text()
    versions = summary["numbers"]["versions"]
    assert versions["gguf"] and versions["nvrtc"] and "carried wheels: gguf-" in setup, setup
    if "no Python 3.12 here" not in setup:
        assert versions["python"].startswith("3.12"), versions
    carried_mib = float(setup.split("carried: ")[1].split(" = ")[1].split(" MiB")[0])
    assert carried_mib < 64, setup
    doctor = summary["numbers"]["doctor"]
    assert doctor["ok"] and doctor["auto"]["backend"] == "ref" and doctor["nvrtc"]["arch"] == "sm_90"
    # $OUT: exactly the summary and one archive, within the device tool's rules
    assert summary["out_shape"]["ok"] and sorted(summary["out_shape"]["files"]) == ["results.tar.gz", "summary.json"]
    with tarfile.open(tmp_path / "out" / "results.tar.gz") as tar:
        names = tar.getnames()
    assert "./logs/doctor.txt" in names and "./doctor.json" in names and not any("/cache/" in n for n in names)


@needs_bash
def test_a_step_out_of_time_still_leaves_the_summary(tmp_path, carried):
    r, summary = dry_run(tmp_path, "--only", "doctor", budget=3)       # setup alone takes longer than that
    assert r.returncode == 1 and not summary["ok"], r.stdout[-3000:]
    doctor = summary["steps"]["doctor"]
    assert doctor["status"] in ("timeout", "out_of_time") and doctor["seconds"] <= 3, doctor
    assert set(summary["steps"]) == {"setup", "doctor"} and summary["failed_steps"] == {"doctor": doctor["status"]}
    assert sorted(summary["out_shape"]["files"]) == ["results.tar.gz", "summary.json"]
