"""bench/attn_moe_bandwidth.py on the CPU emulator (--emu, cut-down shapes): the benchmark a lent GPU runs is checked
here - every kernel sequence it times and the JSON it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ds4py.cuda import emu

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
def test_attn_moe_bandwidth_runs_on_the_emulator(tmp_path):
    out = tmp_path / "am.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "attn_moe_bandwidth.py"), "--emu", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["emulated"] and res["copy_GBps"] > 0
    assert {(e["kernel"], e["format"]) for e in res["experts"]} == {
        ("moe_gate_up", "IQ2_XXS"), ("moe_down", "Q2_K"), ("moe_gate_up", "Q4_K"), ("moe_down", "Q4_K"),
        ("shared_expert", "Q8_0")}
    assert {(a["ctx"], a["ratio"]) for a in res["attention"]} == {(4096, 4), (4096, 128)}
    assert all(row["us"] > 0 for part in ("experts", "attention", "compressor") for row in res[part])
    assert res["indexer"] and all(i["scores_us"] > 0 and i["topk_us"] > 0 for i in res["indexer"])
    assert {(c["ratio"], c["kind"], c["emits"]) for c in res["compressor"]} >= {(128, "attention", True),
                                                                                 (4, "indexer keys", True)}
