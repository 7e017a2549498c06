"""bench/gemv_bandwidth.py on the CPU emulator (--emu, cut-down shapes): the benchmark code a lent GPU runs is
checked here - every kernel it times, its correctness spot checks, and the JSON it writes."""

from __future__ import annotations

from cu_fixtures import bench_on_emulator, requires_emulator


@requires_emulator
def test_gemv_bandwidth_runs_on_the_emulator(tmp_path):
    res = bench_on_emulator("gemv_bandwidth.py", tmp_path / "gb.json")
    names = {g["name"] for g in res["gemv"]}
    assert {"q_b", "wo_a", "wo_b", "head", "q_a+kv", "shexp gate+up"} <= names
    assert all(g["us"] > 0 for g in res["gemv"])
    assert set(res["chain"]) == {"plain", "pdl", "graph", "graph+pdl"}
    assert any(k.startswith("sample") for k in res["kernels"]) and any(k.startswith("hc_mix") for k in res["kernels"])
