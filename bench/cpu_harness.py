"""What the CPU side-by-side benches share (bench/cpu_vs_llamacpp.py, bench/cpu_vs_ds4.py): each engine runs as a
child process measured by os.wait4 (CPU seconds, peak RSS, major faults, wall time); ds4py's child is the bench
script itself run again with --child, which prints its result as one JSON line; the engines take turns in
alternating order, round by round, so a load change on a shared machine hits both; min / median / max over rounds.

Importing it sets OPENBLAS_NUM_THREADS=1 unless set (before numpy loads: the benches compare at a thread count they
choose) and puts the repository first on sys.path (ds4py from this checkout).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def wait_child(cmd: list[str], env: dict | None = None, procs: Path | None = None) -> tuple[str, dict]:
    """Run cmd (in the cgroup whose cgroup.procs is `procs`, if given); its stdout and its own rusage (CPU s,
    peak RSS bytes, major faults, wall s, and the wall-clock time it was started: start_at). A failed run ends
    the bench with its stderr's tail."""
    t, start_at = time.perf_counter(), time.time()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env,
                             preexec_fn=None if procs is None else (lambda: procs.write_text(str(os.getpid()))))
        _, status, ru = os.wait4(p.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        so, se = out.read(), err.read()
    if code != 0:
        raise SystemExit(f"{os.path.basename(cmd[0])} failed ({code}):\n{se[-3000:]}")
    return so, {"cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss": ru.ru_maxrss * 1024,
                "major_faults": ru.ru_majflt, "wall_s": time.perf_counter() - t, "start_at": start_at}


def run_child(script: str, args: Sequence[str], procs: Path | None = None) -> tuple[dict, dict]:
    """ds4py's side: `python SCRIPT --child ARGS` with this checkout importable; (the JSON its last stdout line
    holds, its rusage as wait_child's)."""
    so, ru = wait_child([sys.executable, os.path.abspath(script), "--child", *args],
                        {**os.environ, "PYTHONPATH": REPO}, procs=procs)
    return json.loads(so.strip().splitlines()[-1]), ru


def in_turn(engines: Sequence[str], r: int) -> list[str]:
    """The engines' order in round r: as given in even rounds, reversed in odd ones (A/B, B/A, ...)."""
    return list(engines) if r % 2 == 0 else list(engines)[::-1]


def stats(vals: list[float]) -> dict:
    v = sorted(vals)
    return {"min": v[0], "median": statistics.median(v), "max": v[-1], "n": len(v)}


def save(path: str | None, summary: dict, runs: list[dict]) -> None:
    """The bench's result as JSON ({"summary", "runs"}) when --json named a file."""
    if path:
        with open(path, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)
