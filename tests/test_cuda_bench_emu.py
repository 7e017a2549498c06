"""bench/gemv_bandwidth.py on the CPU emulator (--emu, cut-down shapes): the benchmark code a lent GPU runs is
checked here - every kernel it times, its correctness spot checks, and the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds4py.cuda import emu

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
def test_gemv_bandwidth_runs_on_the_emulator(tmp_path):
    out = tmp_path / "gb.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "gemv_bandwidth.py"), "--emu", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["emulated"] and res["copy_GBps"] > 0
    names = {g["name"] for g in res["gemv"]}
    assert {"q_b", "wo_a", "wo_b", "head", "q_a+kv", "shexp gate+up"} <= names
    assert all(g["us"] > 0 for g in res["gemv"])
    assert set(res["chain"]) == {"plain", "pdl", "graph", "graph+pdl"}
    assert any(k.startswith("sample") for k in res["kernels"]) and any(k.startswith("hc_mix") for k in res["kernels"])
