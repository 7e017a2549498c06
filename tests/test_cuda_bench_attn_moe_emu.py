"""bench/attn_moe_bandwidth.py on the CPU emulator (--emu, cut-down shapes): the benchmark a lent GPU runs is checked
here - every kernel sequence it times and the JSON it writes."""

from __future__ import annotations

from cu_fixtures import bench_on_emulator, requires_emulator


@requires_emulator
def test_attn_moe_bandwidth_runs_on_the_emulator(tmp_path):
    res = bench_on_emulator("attn_moe_bandwidth.py", tmp_path / "am.json")
    assert {(e["kernel"], e["format"]) for e in res["experts"]} == {
        ("moe_gate_up", "IQ2_XXS"), ("moe_down", "Q2_K"), ("moe_gate_up", "Q4_K"), ("moe_down", "Q4_K"),
        ("shared_expert", "Q8_0")}
    assert {(a["ctx"], a["ratio"]) for a in res["attention"]} == {(4096, 4), (4096, 128)}
    assert all(row["us"] > 0 for part in ("experts", "attention", "compressor") for row in res[part])
    assert res["indexer"] and all(i["scores_us"] > 0 and i["topk_us"] > 0 for i in res["indexer"])
    assert {(c["ratio"], c["kind"], c["emits"]) for c in res["compressor"]} >= {(128, "attention", True),
                                                                                 (4, "indexer keys", True)}
