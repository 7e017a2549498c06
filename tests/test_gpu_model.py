"""The GPU time model (ds4py/cuda/timemodel.py) and `bench gpu-model`: the formulas on hand-made launches (a big
streaming kernel is bandwidth-bound, a tiny one sits on the latency floor, one block cannot keep enough bytes in
flight, a long inner loop is issue-bound, stage-then-compute adds), the SASS loop finder on a hand-written listing,
the bench's JSON for both devices and model families, and bad input as one sentence."""

from __future__ import annotations

import json

import pytest

from ds4py.__main__ import main
from ds4py.cuda import sass, timemodel
from ds4py.cuda.devices import inspect_launch, profile
from ds4py.cuda.plan_runtime import PlannedArg, PlannedLaunch

GB10, H200 = profile("gb10"), profile("h200")


def launch(kernel: str, grid: int, threads: int, weight: int = 0, act: int = 0, smem: int = 0, pdl: bool = True,
           dev=GB10, scalars=(), registers: int = 32) -> PlannedLaunch:
    chk = inspect_launch(dev, kernel, grid, threads, smem, registers)
    args = [PlannedArg("W", weight, True, "blk.0.w.weight")] if weight else []
    args += [PlannedArg("x", act, True, "activation")] if act else []
    return PlannedLaunch(0, kernel, "test", chk.grid, chk.block, smem, 0, registers, "main", pdl, tuple(args),
                         tuple(scalars), chk.occupancy, chk.waves, chk.problem)


def test_a_big_streaming_kernel_runs_at_the_copy_bandwidth():
    t = timemodel.timing_for(GB10)
    n = 1 << 30
    k = timemodel.model_kernel(launch("gemv_f16", 2 * GB10.sm_count, 256, weight=n), GB10, 2048, loops={})
    assert k.limiter == "bandwidth"
    assert k.time_us == pytest.approx(n / (GB10.copy_gbps * 1e3) + t.gap_pdl_us, rel=1e-9)
    plain = timemodel.model_kernel(launch("gemv_f16", 2 * GB10.sm_count, 256, weight=n, pdl=False), GB10, 2048,
                                   loops={})
    assert plain.time_us - k.time_us == pytest.approx(t.gap_us - t.gap_pdl_us)     # PDL shortens the gap only
    half = timemodel.model_kernel(launch("gemv_f16", 2 * GB10.sm_count, 256, weight=n), GB10, 2048, loops={},
                                  coalescing={"gemv_f16": 0.5})
    assert half.coalescing_source == "traffic" and half.t_mem_us == pytest.approx(2 * k.t_mem_us)


def test_a_tiny_kernel_sits_on_the_latency_floor():
    t = timemodel.timing_for(H200)
    k = timemodel.model_kernel(launch("rmsnorm_f32", 1, 32, act=256, dev=H200), H200, 2048, loops={})
    assert k.t_floor_us == pytest.approx(t.latency_ns / 1e3)
    assert k.time_us == pytest.approx(t.latency_ns / 1e3 + t.gap_pdl_us)
    assert k.limiter == "launch gap" if t.gap_pdl_us > t.latency_ns / 1e3 else "latency floor"


def test_one_block_cannot_keep_enough_bytes_in_flight():
    """Little's law: one warp with 16 bytes per lane in flight moves 512 B per DRAM round trip, whatever the bus."""
    t = timemodel.timing_for(GB10)
    n = 1 << 20
    k = timemodel.model_kernel(launch("topk_select", 1, 32, act=n), GB10, 2048, loops={})
    assert k.limiter == "latency-parallelism" and k.inflight_bytes == 32 * timemodel.LANE_BYTES
    assert k.t_mem_us == pytest.approx(n / (k.inflight_bytes / (t.latency_ns / 1e3)))


def test_a_long_inner_loop_is_issue_bound_and_staging_serialises():
    t = timemodel.timing_for(H200)
    n = 256 << 20                                      # F16: n / 2 weights
    loop = sass.LoopCount("gemv_f16", 640, 100, 300, 40, 160, 40, 0, 32, ldg_bytes=256)   # 20 per product
    k = timemodel.model_kernel(launch("gemv_f16", 4 * H200.sm_count, 256, weight=n, dev=H200), H200, 2048,
                               loops={"gemv_f16": loop})
    warp_insns = n / 2 * 20 / 32
    assert k.instr_per_weight == pytest.approx(20 / 32)
    assert k.t_issue_us == pytest.approx(warp_insns / (H200.sm_count * t.ipc * t.clock_ghz * 1e3))
    assert k.limiter == "issue" and k.t_issue_us > k.t_mem_us
    # a kernel that stages everything with cp.async and then computes, one block per SM: copy + math, not max
    staged = sass.LoopCount("moe_down_q8_0", 64, 8, 40, 0, 10, 6, 0, 32, ldg_bytes=0, async_copy=True)
    ln = launch("moe_down_q8_0", H200.sm_count, 256, weight=n, smem=200_000, dev=H200)
    k = timemodel.model_kernel(ln, H200, 2048, loops={"moe_down_q8_0": staged})
    assert ln.occupancy.blocks_per_sm == 1 and k.limiter == "stage-then-compute"
    assert k.time_us == pytest.approx(k.t_mem_us + k.t_issue_us + t.gap_pdl_us)
    ring = sass.LoopCount("moe_down_q8_0", 64, 8, 40, 0, 10, 6, 0, 32, ldg_bytes=0, async_copy=True, pipelined=True)
    k = timemodel.model_kernel(ln, H200, 2048, loops={"moe_down_q8_0": ring})   # a cp.async ring overlaps
    assert k.limiter != "stage-then-compute" and k.time_us == pytest.approx(max(k.t_mem_us, k.t_issue_us)
                                                                            + t.gap_pdl_us)


def test_step_totals_and_fractions():
    ls = [launch("gemv_f16", 96, 256, weight=1 << 30), launch("rmsnorm_f32", 1, 32, act=256)]
    m = timemodel.model_step(ls, GB10, 2048, tokens=1, shapes="hand", loops={})
    assert m.time_us == pytest.approx(sum(k.time_us for k in m.kernels))
    assert m.weight_kv_bytes == 1 << 30
    assert m.fraction(GB10.copy_gbps) == pytest.approx((1 << 30) / (m.time_us * 1e3) / GB10.copy_gbps)
    assert 0.9 < m.fraction(GB10.copy_gbps) < 1.0 < GB10.nominal_gbps / GB10.copy_gbps
    assert all(line.startswith("model |") for line in timemodel.format_step(m).splitlines())
    # a launch GB10 would refuse (more shared memory than a block may have) is counted and named
    big = launch("moe_down_vq13", 48, 256, weight=1 << 20, smem=108_352)
    m = timemodel.model_step(ls + [big], GB10, 2048, loops={})
    assert len(m.refused) == 1 and m.to_json()["refused_launches"] == 1
    assert "REFUSED: moe_down_vq13 on gb10" in timemodel.format_step(m)


def listing(products: int) -> list[tuple[int, str, str, str]]:
    """A norm loop (squares: no products), a weight loop (`products` multiplies after a shared load and a
    conversion) and an outer loop around it that stages with cp.async and waits."""
    ins = [("S2R", " R0, SR_TID.X ", ""),
           ("LDG.E.128", " R4, desc[UR4][R2.64] ", ".L_x_1"), ("FFMA", " R8, R4, R4, R8 ", ""),
           ("ISETP.GE.AND", " P0, PT, R0, 0x10, PT ", ""), ("BRA", " `(.L_x_1) ", ""),
           ("LDGSTS.E.BYPASS.128", " [R1], desc[UR4][R2.64] ", ".L_x_2"),
           ("LDS.128", " R4, [R1] ", ".L_x_3"), ("I2F.S8", " R5, R4 ", "")]
    ins += [("FFMA", f" R{20 + i}, R5, R{40 + i}, R{20 + i} ", "") for i in range(products)]
    ins += [("HFMA2", " R16, -RZ, RZ, 0, 0 ", ""), ("IADD3", " R1, R1, 0x10, RZ ", ""), ("BRA", " `(.L_x_3) ", ""),
            ("BAR.SYNC", " 0x0 ", ""), ("BRA", " `(.L_x_2) ", ""), ("EXIT", "", "")]
    return [(16 * i, op, o, lab) for i, (op, o, lab) in enumerate(ins)]


def test_the_sass_loop_finder_on_a_listing():
    ins = listing(8)
    n = len(ins)
    assert sass.loops(ins) == [(1, 4), (6, n - 4), (5, n - 2)]
    c = sass.inner_loop("k", ins)
    assert c is not None and c.products == 8 and c.instructions == 13 and c.async_copy
    assert (c.memory, c.fma, c.convert, c.integer, c.control) == (1, 9, 1, 1, 1)
    assert c.per_product == 13 / 8 and c.ldg_bytes == 0
    assert not c.pipelined                              # it waits for every cp.async group (no DEPBAR.LE n > 0)
    ring = listing(8)
    ring.insert(-3, (0, "DEPBAR.LE", " SB0, 0x1 ", ""))
    ring = [(16 * i, op, o, lab) for i, (_, op, o, lab) in enumerate(ring)]
    assert sass.inner_loop("k", ring).pipelined
    assert sass.inner_loop("k", listing(4)) is None     # under 8 products: no weight loop (not a norm's squares)
    assert sass.load_width("LDG.E.128") == 16 and sass.load_width("LDG.E.U8") == 1 and sass.load_width("LDG.E") == 4


def test_the_committed_sass_table_covers_the_streaming_kernels():
    table = sass.load_table()
    for arch in ("sm_121", "sm_90"):
        rows = table[arch]
        for k in ("gemv_q8_0", "gemv_f16", "gemv_q4_k", "moe_gate_up_iq2_xxs", "moe_down_q2_k", "moe_down_vq13"):
            assert k in rows and rows[k].products >= 8 and 1.0 < rows[k].per_product < 40, (arch, k, rows.get(k))


@pytest.mark.parametrize("device", ["gb10", "h200"])
@pytest.mark.parametrize("shapes", ["v4-flash-q2", "v41-flash-vq"])
def test_bench_gpu_model_json(tmp_path, capsys, device, shapes):
    out = tmp_path / "m.json"
    assert main(["bench", "gpu-model", "--device", device, "--shapes", shapes, "--ctx", "2048,65536",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text and all(line.startswith("model |") for line in text.splitlines()), text
    d = json.loads(out.read_text())
    for f in ("device", "shapes", "ctx", "modelled_tokens_per_s", "fraction_of_copy", "fraction_of_roofline",
              "refused_launches", "kernels"):
        assert f in d, f
    assert d["device"] == device and d["shapes"] == shapes and d["ctx"] == 2048
    assert 0 < d["fraction_of_copy"] <= 1.0 and d["fraction_of_roofline"] < d["fraction_of_copy"]
    assert d["modelled_tokens_per_s"] > 0 and len(d["kernels"]) > 300
    assert {s["step"] for s in d["steps"]} == {"decode", "verify 4 rows", "prefill 2048", "mtp draft 1 row",
                                              "mtp draft 2 rows"}
    assert [s["ctx"] for s in d["steps"] if s["step"] == "decode"] == [2048, 65536]
    assert all(k["limiter"] and k["time_us"] > 0 for k in d["kernels"])
    # the 64K step reads more KV than the 2K one; the decode step's weights are the same
    dec = [s for s in d["steps"] if s["step"] == "decode"]
    assert dec[1]["weight_kv_bytes"] > dec[0]["weight_kv_bytes"]
    assert d["steps"][0]["refused_launches"] == sum(1 for k in d["kernels"] if k["refused"])
    assert d["refused_launches"] == sum(s["refused_launches"] for s in d["steps"] + d["act_quant"])
    # the act_quant numerics (the engine under Numerics.ds4()): its decode steps, for every shapes
    assert [s["step"] for s in d["act_quant"]] == ["decode act_quant"] * 2


@pytest.mark.parametrize("argv, words", [
    (["--device", "foo"], "--device must be one of gb10, h200"),
    (["--shapes", "v5-huge"], "--shapes must be one of"),
    (["--ctx", "two"], "--ctx must be"),
    (["--ctx", "0"], "--ctx values must be"),
    (["--json"], "needs a file name"),
    (["-m", "x.gguf"], "not built yet"),
])
def test_bad_input_is_one_sentence(capsys, argv, words):
    assert main(["bench", "gpu-model", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_coalescing_comes_from_a_traffic_report(tmp_path, capsys):
    """The emulator's traffic report (ds4py-traffic-v1) gives each kernel's DRAM sector efficiency: model_width's entry
    where there is one, an argument's largest launch where given, dram_efficiency before coalescing, the arguments
    weighted by bytes; a missing report is one sentence."""
    rep = {"format": "ds4py-traffic-v1", "kernels": {
        "gemv_f16": {"args": {"W0": {"requests": 9, "dram_efficiency": 0.5, "distinct_bytes": 100}}},
        "moe_down_q2_k": {"args": {
            "W": {"requests": 9, "dram_efficiency": 0.99, "distinct_bytes": 999,
                  "largest_launch": {"requests": 3, "dram_efficiency": 0.5, "arg_bytes": 3000}},
            "ids": {"requests": 1, "coalescing": 0.125, "distinct_bytes": 24},
            "out": {"requests": 0, "dram_efficiency": None, "distinct_bytes": 0}}}},
        "model_width": {"what": "GEMVs at 4096 columns", "kernels": {
            "gemv_f16": {"args": {"W0": {"requests": 9, "dram_efficiency": 1.0, "distinct_bytes": 100}}}}}}
    got = timemodel.coalescing_from_report(rep)
    assert got["gemv_f16"] == 1.0                                   # model_width wins
    assert got["moe_down_q2_k"] == pytest.approx((3000 + 24) / (3000 / 0.5 + 24 / 0.125))
    f = tmp_path / "report.json"
    f.write_text(json.dumps(rep))
    assert timemodel.load_coalescing(f) == got
    assert main(["bench", "gpu-model", "--traffic", str(tmp_path / "none.json")]) == 2
    assert "no traffic report" in capsys.readouterr().err


def test_the_device_check_summary_carries_model_vs_measured():
    """bench/device_summary.py lifts cuda_decode.py --kernel-times into summary.json's model_vs_measured: per kernel
    launches, measured and modelled µs, their ratio and the model's limiter; an error stays one string."""
    from helpers import bench_module

    ds = bench_module("device_summary")
    kt = {"profile": "gpu0", "ctx": 33, "measured_us": 50.0, "modelled_us": 40.0, "ratio": 1.25, "kernels": [
        {"kernel": "gemv_q8_0", "family": "gemv q8_0", "launches": 3, "measured_us": 30.0, "modelled_us": 20.0,
         "bytes": 1, "limiter": "bandwidth", "ratio": 1.5}]}
    got = ds.model_vs_measured({"cuda_decode": {"kernel_times": kt}})
    assert got["ratio"] == 1.25 and got["kernels"]["gemv_q8_0"] == {
        "launches": 3, "measured_us": 30.0, "modelled_us": 20.0, "ratio": 1.5, "limiter": "bandwidth"}
    assert ds.model_vs_measured({"cuda_decode": {"kernel_times": {"error": "StaleResourceTable: x"}}}) == {
        "error": "StaleResourceTable: x"}
    assert ds.model_vs_measured({}) is None


def test_attention_reads_the_window_and_the_selected_rows():
    """Decode attention's KV bytes at a context: the window ring's min(ctx, window) rows plus top-k compressed rows
    where a selection is passed (V4 ratio 4, V4.1 ratio 2 / 1), else ctx / ratio rows (V4 ratio 128); the buffers'
    capacities do not count."""
    row = 4 * 512

    def attn(ratio: int, sel: bool) -> PlannedLaunch:
        chk = inspect_launch(GB10, "attn_decode_partial", (20, 8), 64, 0)
        args = (PlannedArg("win", 144 * row, True, "state.2.win"),
                PlannedArg("comp", 65536 * row, True, "state.2.comp_rows"),
                PlannedArg("sel", 2048 if sel else 0, True, "activation" if sel else "null"))
        sc = (("ring", 144), ("window", 128), ("ratio", ratio), ("topk", 512), ("hd", 512))
        return PlannedLaunch(0, "attn_decode_partial", "attention", chk.grid, chk.block, 0, 0, 32, "main", True,
                             args, sc, chk.occupancy, chk.waves, None)

    assert timemodel.launch_traffic(attn(2, True), 65536).kv == (128 + 512) * row
    assert timemodel.launch_traffic(attn(128, False), 65536).kv == (128 + 65536 // 128) * row
    assert timemodel.launch_traffic(attn(2, True), 100).kv == (100 + 50) * row


def _comp_launch(kernel: str, grid: int, threads: int, args: tuple, scalars: tuple) -> PlannedLaunch:
    chk = inspect_launch(GB10, kernel, grid, threads, 0)
    return PlannedLaunch(0, kernel, "compressor", chk.grid, chk.block, 0, 0, 40, "side", True, args, scalars,
                         chk.occupancy, chk.waves, None)


@pytest.mark.parametrize("ratio,overlap,cap", [(128, 0, 144), (4, 1, 24)])
def test_a_compressor_step_is_its_ring_store_plus_a_ratioth_of_the_group(ratio, overlap, cap):
    """compressor_decode stores one ring slot every step and pools its group only at a position completing one
    (cu/compressor.cu): per token, the store plus 1/ratio of the group read, whatever the rings' or rows' capacity."""
    d, rd = 512, 64
    width = (1 + overlap) * d

    def comp(ring_cap: int, rows_cap: int) -> PlannedLaunch:
        args = (PlannedArg("kv_in", width * 4, True, "activation"), PlannedArg("sc_in", width * 4, True, "activation"),
                PlannedArg("ape", ratio * width * 2, True, "blk.5.attn_compressor_ape.weight"),
                PlannedArg("norm_w", d * 4, True, "blk.5.attn_compressor_norm.weight"),
                PlannedArg("freqs", rd * 2, True, "rope.2"), PlannedArg("pos_slot", 4, True, "activation"),
                PlannedArg("ring_kv", ring_cap * width * 4, False, "state.5.comp_kv"),
                PlannedArg("ring_sc", ring_cap * width * 4, False, "state.5.comp_score"),
                PlannedArg("rows", rows_cap * d * 4, False, "state.5.comp_rows"))
        sc = (("ape_f32", 0), ("rows_cap", rows_cap), ("ratio", ratio), ("overlap", overlap), ("cap", ring_cap),
              ("d", d), ("rd", rd))
        return _comp_launch("compressor_decode", 1, 1024, args, sc)

    tr = timemodel.launch_traffic(comp(cap, 512), 65536)
    group = ratio * (1 + overlap) * d * 8                   # the group's kv and scores, d channels a slot
    assert tr.kv == 2 * width * 4 + -(-(group + d * 4) // ratio)
    assert tr.weight == width * 2 + d * 4 // ratio
    assert tr.kv + tr.act + tr.weight < 2 * (cap * width * 4) / ratio + 6 * width * 4
    assert timemodel.launch_traffic(comp(4 * cap, 4096), 65536) == tr
    t = timemodel.model_kernel(comp(cap, 512), GB10, 65536)
    assert t.time_us < 5.0                                  # not a 0.7 MB read every step (was 36.8 us at ratio 128)


def test_v41_compressor_steps_write_rows_not_rings():
    """V4.1's ring store writes its rows into each ring; its compressor pools only at a completing row (1/ratio of
    the rows), so neither is charged the rings' or the rows' capacity."""
    d, cap = 512, 18
    store = _comp_launch("v41_comp_ring_store", 2, 256, (
        PlannedArg("kv_in", d * 4, True, "activation"), PlannedArg("sc_in", d * 4, True, "activation"),
        PlannedArg("pos", 4, True, "activation"), PlannedArg("ring_kv", cap * d * 4, False, "state.2.comp_kv"),
        PlannedArg("ring_sc", cap * d * 4, False, "state.2.comp_score")), (("n_rows", 1), ("cap", cap), ("d", d)))
    assert timemodel.launch_traffic(store, 2048).kv == 2 * d * 4
    comp = _comp_launch("v41_compress", 1, 256, (
        PlannedArg("kv_in", d * 4, True, "activation"), PlannedArg("sc_in", d * 4, True, "activation"),
        PlannedArg("ring_kv", cap * d * 4, True, "state.2.comp_kv"),
        PlannedArg("ring_sc", cap * d * 4, True, "state.2.comp_score"),
        PlannedArg("norm_w", d * 4, True, "blk.2.attn_compressor_norm.weight"),
        PlannedArg("freqs", 128, True, "rope.2"), PlannedArg("pos", 4, True, "activation"),
        PlannedArg("rows", 2048 * d * 4, False, "state.2.comp_rows"), PlannedArg("lat", d * 4, False, "activation")),
        (("rows_cap", 2048), ("ratio", 2), ("cap", cap), ("d", d), ("rd", 64)))
    assert timemodel.launch_traffic(comp, 2048).kv == (2 * 2 * d * 4 + d * 4) // 2


def test_gb10_vq8_down_overlaps_its_copies():
    """The VQ-8 down kernels load tile i+1 while tile i computes (a two-buffer cp.async ring, seen in the SASS
    table), so even at one block per GB10 SM the model does not charge them stage-then-compute."""
    from ds4py.cuda.plan import plan_step

    downs = {l.kernel: l for l in plan_step("v41-flash-vq", "decode", "gb10", ctx=2048)
             if l.kernel.startswith("moe_down_vq")}
    for k in ("moe_down_vq12", "moe_down_vq13"):
        assert timemodel.model_kernel(downs[k], GB10, 2048).limiter != "stage-then-compute", k


def test_hc_mix_is_charged_its_last_block_tail():
    """hc_mix's last block (after the ticket): the ticket and partials round trips, a sub-layer mix's Sinkhorn rounds,
    and with a collapse (y given) the x passes after the first (one pass at 1,024 threads and D 4,096; two at 512
    threads, plus the normalise's re-read of y)."""
    t = timemodel.timing_for(H200)
    lat, sink = t.latency_ns / 1e3, 20 * timemodel.SINKHORN_ROUND_CYCLES / (t.clock_ghz * 1e3)

    def mix(threads: int, nrows: int, y: bool) -> PlannedLaunch:
        base = launch("hc_mix_f16", 32, threads, weight=nrows * 16384 * 2, act=65536, dev=H200,
                      scalars=(("nrows", nrows), ("n", 16384), ("iters", 20)))
        args = base.args + ((PlannedArg("y", 16384, False, "activation"),) if y else ())
        return PlannedLaunch(0, base.kernel, "test", base.grid, base.block, 0, 0, 32, "main", True, args,
                             base.scalars, base.occupancy, base.waves, base.problem)

    kt = {(th, rows, y): timemodel.model_kernel(mix(th, rows, y), H200, 2048, loops={}).t_tail_us
          for th, rows, y in [(1024, 24, True), (1024, 24, False), (1024, 4, True), (512, 24, True)]}
    assert kt[1024, 24, False] == pytest.approx(2 * lat + sink)
    assert kt[1024, 24, True] == pytest.approx(2 * lat + sink)           # the one pass loads under the partials
    assert kt[1024, 4, True] == pytest.approx(2 * lat)                   # the head's mix: pre only, no Sinkhorn
    assert kt[512, 24, True] == pytest.approx(4 * lat + sink)            # 4,096 columns in two passes
    k = timemodel.model_kernel(mix(1024, 24, True), H200, 2048, loops={})
    assert k.time_us == pytest.approx(max(k.t_mem_us, k.t_floor_us) + k.t_tail_us + t.gap_pdl_us)


def test_v4_decode_collapses_inside_the_mix():
    """One hc_mix per sub-layer and one for the head, no separate collapse: 987 - 87 launches a V4 decode step."""
    from ds4py.cuda.plan import plan_step

    L = plan_step("v4-flash-q2", "decode", "h200", ctx=2048)
    mixes = [ln for ln in L if ln.kernel.startswith("hc_mix")]
    assert len(L) == 900 and not any(ln.kernel == "hc_collapse_norm" for ln in L)
    assert len(mixes) == 87 and all(any(a.name == "y" and a.nbytes > 0 for a in ln.args) for ln in mixes)


@pytest.mark.parametrize("device", ["gb10", "h200"])
def test_act_quant_numerics_are_planned_as_the_engine_runs_them(device):
    """plan_step(numerics="act_quant") records the engine under Numerics.ds4(): the V4 q2 decode's experts on their
    int8 kernels (own registers from the ptxas table, none refused), every Q8_0 GEMV on gemv_q8_0_i8* (x rounded
    inside), the grouped wo_a too (gemv_q8_0_i8_grouped: no act_round launch left in decode); the same weight bytes
    and launches; a verify step's experts and wo_a on the int8 rows kernels."""
    from ds4py.cuda.plan import plan_step

    exact = plan_step("v4-flash-q2", "decode", device, ctx=2048)
    quant = plan_step("v4-flash-q2", "decode", device, ctx=2048, numerics="act_quant")
    names = [ln.kernel for ln in quant]
    assert all(ln.problem is None for ln in quant)
    assert names.count("moe_gate_up_i8_iq2_xxs") == names.count("moe_down_i8_q2_k") == 43
    assert not any(n in ("moe_gate_up_iq2_xxs", "moe_down_q2_k") for n in names)
    assert not any(n.startswith("act_round") for n in names)
    q8 = [n for n in names if n.startswith("gemv_q8_0")]
    assert q8 and all(n.startswith("gemv_q8_0_i8") for n in q8)
    assert names.count("gemv_q8_0_i8_grouped") == 43                         # the grouped wo_a, x rounded inside
    assert len(quant) == len(exact)
    from ds4py.cuda import resources
    arch = profile(device).arch
    assert all(ln.registers == resources.require(arch, ln.kernel).registers for ln in quant if "_i8" in ln.kernel)
    assert (sum(timemodel.launch_traffic(ln, 2048).weight for ln in quant)
            == sum(timemodel.launch_traffic(ln, 2048).weight for ln in exact))
    steps = timemodel.run(device, "v4-flash-q2", (2048,), steps=("decode", "rows"), numerics="act_quant")
    assert [m.step for m in steps] == ["decode act_quant", "verify 4 rows act_quant"]
    rows = {k.kernel for k in steps[1].kernels}
    assert {"moe_gate_up_rows_i8_iq2_xxs", "moe_down_rows_i8_q2_k", "gemv_q8_0_i8_rows",
            "gemv_q8_0_i8_grouped_rows"} <= rows


@pytest.mark.parametrize("device", ["gb10", "h200"])
def test_act_quant_v41_q4_k_gemvs_take_the_int8_kernels(device):
    """V4.1 under act_quant: every Q4_K GEMV on gemv_q4_k_i8* (x rounded as Q8_K inside: no act_round_q8_k left in
    decode), the grouped wo_a on gemv_q4_k_i8_grouped; the same weight bytes and launches as exact (less nothing:
    every rounding is in a GEMV); a verify step on the _rows kernels; none refused."""
    from ds4py.cuda.plan import plan_step

    exact = plan_step("v41-flash-vq", "decode", device, ctx=2048)
    quant = plan_step("v41-flash-vq", "decode", device, ctx=2048, numerics="act_quant")
    names = [ln.kernel for ln in quant]
    assert all(ln.problem is None for ln in quant)
    assert not [ln for ln in quant if ln.kernel.startswith("gemv_q4_k") and "_i8" not in ln.kernel]
    assert "act_round_q8_k" not in names
    grouped = [ln for ln in quant if ln.kernel == "gemv_q4_k_i8_grouped"]
    assert grouped and all(dict(ln.scalars)["x_group_rows"] > 0 for ln in grouped)     # the grouped wo_a
    assert {"gemv_q4_k_i8", "gemv_q4_k_i8_hc_post", "gemv_q4_k_i8_swiglu"} <= set(names)
    assert (sum(timemodel.launch_traffic(ln, 2048).weight for ln in quant)
            == sum(timemodel.launch_traffic(ln, 2048).weight for ln in exact))
    rows = plan_step("v41-flash-vq", "rows", device, ctx=2048, numerics="act_quant")
    assert {"gemv_q4_k_i8_rows", "gemv_q4_k_i8_hc_post_rows", "gemv_q4_k_i8_swiglu_rows",
            "gemv_q4_k_i8_grouped_rows"} <= {ln.kernel for ln in rows}
    assert all(ln.problem is None for ln in rows)


def test_the_x_quantisation_of_the_int8_gemvs_is_counted():
    """The committed SASS table holds each int8 GEMV's x-quantisation pass (sass.quant_loop: 1,024 values a warp
    pass); the model adds its instructions (every block of an ungrouped kernel quantises all of x, its warps sharing
    the passes; a grouped kernel's warp quantises each x group its run enters) and a warp's first quantisation
    before the rest of its bytes stream."""
    table = sass.load_table()["sm_90"]
    for k in ("gemv_q8_0_i8", "gemv_q8_0_i8_grouped", "gemv_q8_0_i8_rows", "gemv_q4_k_i8", "gemv_q4_k_i8_swiglu_rows"):
        assert table[k].prologue > 0 and table[k].prologue_values == 1024, k
    assert table["gemv_q8_0"].prologue == 0 and table["moe_gate_up_i8_q4_k"].prologue == 0
    loop = table["gemv_q8_0_i8"]
    cols, rows = 4096, 4096
    sc = (("rows0", rows), ("cols", cols), ("x_group_rows", 0))
    base = launch("gemv_q8_0_i8", 256, 128, weight=rows * cols // 32 * 34, dev=H200, scalars=sc)
    pro = timemodel.quant_prologue(base, loop)
    assert pro.warp_insns == 256 * (cols // 1024) * loop.prologue             # each block: x's 4 passes
    assert pro.first_insns == loop.prologue                                    # 4 warps, one pass each
    with_pro = timemodel.model_kernel(base, H200, 2048, loops={"gemv_q8_0_i8": loop})
    without = timemodel.model_kernel(base, H200, 2048, loops={"gemv_q8_0_i8": sass.LoopCount(
        "gemv_q8_0_i8", loop.instructions, loop.memory, loop.fma, loop.convert, loop.integer, loop.control,
        loop.other, loop.products, loop.ldg_bytes, loop.async_copy, loop.pipelined)})
    assert with_pro.t_issue_us > without.t_issue_us and with_pro.time_us >= without.time_us
    # grouped: 8,192 rows in groups of 1,024 over 128 x 4 warps: runs of 4 row groups (16 rows), one group each
    g = launch("gemv_q8_0_i8_grouped", 128, 128, weight=8192 * cols // 32 * 34, dev=H200,
               scalars=(("rows0", 8192), ("cols", cols), ("x_group_rows", 1024)))
    gl = table["gemv_q8_0_i8_grouped"]
    gp = timemodel.quant_prologue(g, gl)
    assert gp.first_insns == 4 * gl.prologue and gp.warp_insns == 512 * 4 * gl.prologue


def test_an_sm_with_one_warp_issues_at_most_one_instruction_per_clock():
    t = timemodel.timing_for(H200)
    n = 1 << 20
    loop = sass.LoopCount("gemv_f16", 640, 100, 300, 40, 160, 40, 0, 32, ldg_bytes=256)
    one = timemodel.model_kernel(launch("gemv_f16", H200.sm_count, 32, weight=n, dev=H200), H200, 2048,
                                 loops={"gemv_f16": loop})
    four = timemodel.model_kernel(launch("gemv_f16", H200.sm_count, 128, weight=n, dev=H200), H200, 2048,
                                  loops={"gemv_f16": loop})
    assert one.t_issue_us == pytest.approx(four.t_issue_us * t.ipc)    # 1 warp per SM: IPC 1, not 2.4


@pytest.mark.parametrize("device", ["gb10", "h200"])
def test_small_q8_and_f16_gemvs_spread_over_the_sms(device):
    """A decode step's Q8_0 / F16 GEMVs of few row groups (the router gate's 64, a 512-row projection's 128) take
    fewer warps per block so their blocks cover min(groups, SMs) SMs; the big ones keep 4 / 8 warps."""
    from ds4py.cuda.ops.gemv import DEFAULT_WARPS
    from ds4py.cuda.plan import plan_step

    dev = profile(device)
    L = [ln for ln in plan_step("v4-flash-q2", "decode", device, ctx=2048)
         if ln.kernel in ("gemv_q8_0", "gemv_f16", "gemv_q8_0_swiglu", "gemv_q8_0_hc_post")]
    assert L
    for ln in L:
        warps = ln.block[0] // 32
        default = DEFAULT_WARPS["F16" if ln.kernel == "gemv_f16" else "Q8_0"]
        assert 1 <= warps <= default
        if warps < default:                        # shrunk: the grid covers the SMs, or every block is one warp
            assert ln.grid[0] >= dev.sm_count or warps == 1
    router = [ln for ln in L if ln.kernel == "gemv_f16" and any("ffn_gate_inp" in a.label for a in ln.args)]
    assert router and all(ln.grid[0] == 64 and ln.block[0] == 32 for ln in router)


@pytest.mark.parametrize("device", ["gb10", "h200"])
@pytest.mark.parametrize("numerics", ["exact", "act_quant"])
def test_the_iq2_gate_up_keeps_three_blocks_per_sm_beside_its_tables(device, numerics):
    """cu/experts.cu's IQ2_XXS kernels hold 4 KiB of static tables (the fp32 dots' bf16 grid, the int8 dots' grid +
    signs): ops/experts.py stages IQ2_TABLES_EXTRA less for them, so 3 blocks of the decode gate + up still fit a
    GB10 SM's shared memory (registers allow 3 at <= 80 per thread: the committed ptxas table)."""
    from ds4py.cuda.devices import occupancy
    from ds4py.cuda.plan import plan_step

    dev = profile(device)
    name = "moe_gate_up_iq2_xxs" if numerics == "exact" else "moe_gate_up_i8_iq2_xxs"
    gu = next(ln for ln in plan_step("v4-flash-q2", "decode", device, ctx=2048, numerics=numerics)
              if ln.kernel == name)
    assert gu.static_smem >= 4096
    assert gu.occupancy.by["shared memory"] >= 3
    # with the full budget's stage (14 rows of 4096 columns, not 13) the tables would leave GB10 two blocks
    full = 2 * ((14 * 1056 + 31) & ~15)
    assert gu.smem < full
    assert device == "h200" or occupancy(dev, gu.threads, gu.registers, full + gu.static_smem).by["shared memory"] < 3


def test_prefill_expert_tiles_read_each_expert_about_once_per_block():
    """A 2,048-token V4 Flash q2 prefill block: the token tiles (the default) stream each layer's expert tensors
    once per work item (~1.01x their bytes: 259 items for 256 experts at 12,288 pairs); the grouped rows kernels
    they replace read them ~13x (gate + up, once per <= 1,024 pairs) and ~48x (down, once per token's slot). The
    model's prefill step is more than twice as fast on both devices."""
    from ds4py.cuda.plan import plan_step

    assert abs(timemodel.expected_work_items(12288, 256) - 258.8) < 0.1
    assert timemodel.expected_work_items(10, 1) == 1.0 and timemodel.expected_work_items(65, 1) == 2.0
    expert_bytes, times = {}, {}
    for tiles in (True, False):
        launches = plan_step("v4-flash-q2", "prefill", "h200", expert_tiles=tiles)
        experts = [ln for ln in launches if ln.kernel.startswith(("moe_gate_up", "moe_down"))
                   and any("_exps" in a.label for a in ln.args)]
        assert experts and all(("_tile_" in ln.kernel) == tiles for ln in experts)
        expert_bytes[tiles] = sum(timemodel.launch_traffic(ln, 2048).weight for ln in experts)
        if tiles:
            for ln in experts:
                whole = sum(a.nbytes for a in ln.args if "_exps" in a.label)
                assert 1.0 <= timemodel.launch_traffic(ln, 2048).weight / whole <= 1.02, ln.kernel
        for dev in (H200, GB10):
            times[tiles, dev.key] = timemodel.model_step(launches, dev, 2048, tokens=2048).time_us
    assert expert_bytes[False] > 15 * expert_bytes[True], expert_bytes
    for dev in ("h200", "gb10"):       # H200: 2.45x since branch s7h200x's faster IQ2_XXS rows kernels (2.9x before)
        assert times[True, dev] * 2 < times[False, dev], times


def test_a_fork_join_region_overlaps_the_side_stream_within_the_shared_dram_and_issue():
    """Between a fork and its join the side stream's kernels run beside the main stream's: the region takes the
    longer stream, unless both streams' bytes at copy bandwidth (or instructions at the device's issue rate) take
    longer; outside a region kernels add up."""
    from dataclasses import replace

    t = timemodel.timing_for(H200)
    big = launch("gemv_f16", 4 * H200.sm_count, 256, weight=64 << 20, dev=H200)        # bandwidth-bound
    tiny = launch("rmsnorm_f32", 1, 32, act=256, dev=H200)                             # latency-bound
    side = replace(tiny, stream="side", pdl=False, region=0)
    m = timemodel.model_step([replace(big, region=0), side, tiny], H200, 2048, loops={})
    kb, ks, kt = m.kernels
    assert m.serial_time_us == pytest.approx(kb.time_us + ks.time_us + kt.time_us)
    (r,) = m.regions()
    assert r["limiter"] == "main" and r["time_us"] == pytest.approx(kb.time_us)
    assert m.time_us == pytest.approx(kb.time_us + kt.time_us)                         # the side kernel is hidden
    # two bandwidth-bound kernels beside each other share the DRAM: the region is their bytes at copy bandwidth
    both = [replace(big, region=0), replace(big, stream="side", pdl=False, region=0)]
    m = timemodel.model_step(both, H200, 2048, loops={})
    (r,) = m.regions()
    dram = 2 * (64 << 20) / (H200.copy_gbps * 1e3)
    assert r["limiter"] == "dram" and m.time_us == pytest.approx(dram) and m.time_us > max(k.time_us for k in
                                                                                              m.kernels)
    assert m.serial_time_us == pytest.approx(sum(k.time_us for k in m.kernels)) and m.serial_time_us > dram
    # ... and the SMs' issue slots: two issue-bound loops take their instructions at the device's rate
    loop = sass.LoopCount("gemv_f16", 640, 100, 300, 40, 160, 40, 0, 32, ldg_bytes=256)   # 20 per product
    m = timemodel.model_step(both, H200, 2048, loops={"gemv_f16": loop})
    (r,) = m.regions()
    insns = 2 * (64 << 20) / 2 * 20 / 32
    assert r["limiter"] == "issue" and r["time_us"] == pytest.approx(insns / (H200.sm_count * t.ipc * t.clock_ghz
                                                                                 * 1e3))


def test_v4_decode_forks_the_kv_branch_and_the_shared_expert():
    """Each layer forks twice (KV branch, shared expert); every side-stream launch is inside a region, and the
    step with them overlapped is shorter than the serial sum but not shorter than either stream alone."""
    from ds4py.cuda.plan import plan_step

    launches = plan_step("v4-flash-q2", "decode", "h200", ctx=2048)
    assert all(ln.region >= 0 for ln in launches if ln.stream == "side")
    regions = {ln.region for ln in launches if ln.region >= 0}
    assert len(regions) == 2 * 43
    m = timemodel.model_step(launches, H200, 2048)
    main_only = sum(k.time_us for k in m.kernels if k.stream != "side")
    assert main_only <= m.time_us < m.serial_time_us
    assert "fork-join regions" in timemodel.format_step(m)


def test_decode_attention_is_charged_its_tile_chain():
    """attn_decode_partial stages a whole 16-key tile with cp.async and computes it before the next: a block's time
    is a round trip for its queries plus, per tile, a round trip, the tile's intake and the tile loop's
    instructions (nvdisasm count) at one per clock per warp; its bytes in flight are one tile per resident block.
    The combine keeps ATTN_COMBINE_SPLITS (16) splits' rows (128 bytes a lane) in flight."""
    from ds4py.cuda.ops.attention import ATTN_TILE, attn_plan

    row = 4 * 512
    for dev in (H200, GB10):
        t = timemodel.timing_for(dev)
        plan = attn_plan(64, 512, 128, warps=2)                   # window only at 2K: 4 splits of 2 tiles
        assert (plan.splits, plan.keys_per_split) == (4, 32)
        chk = inspect_launch(dev, "attn_decode_partial", (plan.splits, plan.head_groups), 64, plan.smem)
        args = (PlannedArg("win", 144 * row, True, "state.0.win"),)
        sc = (("window", 128), ("ratio", 0), ("hd", 512), ("keys_per_split", 32))
        ln = PlannedLaunch(0, "attn_decode_partial", "attention", chk.grid, chk.block, plan.smem, 0, 32, "main",
                           True, args, sc, chk.occupancy, chk.waves, None)
        k = timemodel.model_kernel(ln, dev, 2048, loops={})
        lat, clk = t.latency_ns / 1e3, t.clock_ghz * 1e3
        insns = timemodel.attn_tile_warp_insns(dev.arch, 512, 64)
        assert 5000 < insns < 7000                                # ~2.6 instructions per product, 2 x 1,024
        intake = ATTN_TILE * row / (t.sm_bytes_per_clk * clk)
        assert k.limiter == "tile chain"
        assert k.time_us == pytest.approx(lat + 2 * (lat + intake) + 2 * insns / clk + t.gap_pdl_us)
        assert k.inflight_bytes == 32 * ATTN_TILE * row
    comb = timemodel.model_kernel(launch("attn_decode_combine", 64, 256, act=1 << 20, dev=H200), H200, 2048, loops={})
    from ds4py.cuda.ops.attention import ATTN_COMBINE_SPLITS

    assert ATTN_COMBINE_SPLITS == 16 and comb.inflight_bytes == 64 * 256 * 8 * ATTN_COMBINE_SPLITS   # float2 rows


def _listing(stem: str, arch: str) -> dict:
    """nvdisasm's listing of this tree's cu/<stem>.cu built for arch (the test is skipped without NVRTC or
    nvdisasm)."""
    from ds4py.cuda import compiler

    try:
        sass.nvdisasm()
        compiler.nvrtc_version()
    except Exception as e:                                        # noqa: BLE001 - any missing tool skips
        pytest.skip(f"no NVRTC / nvdisasm here: {e}")
    src = compiler.CU_DIR / f"{stem}.cu"
    return sass.disassemble(compiler.compile_file(src, arch, compiler.file_options(src)).cubin)


def test_the_attention_tile_counts_equal_the_build():
    """timemodel.ATTN_TILE_SASS is what nvdisasm counts in this tree's attn_decode_partial (skipped without NVRTC or
    nvdisasm); a kernel change that moves them fails here until the constants are updated."""
    for arch, want in timemodel.ATTN_TILE_SASS.items():
        assert sass.attn_tile_counts(_listing("attention", arch)["attn_decode_partial"]) == want, arch


def test_the_sinkhorn_round_counts_equal_the_build():
    """timemodel.SINKHORN_ROUND (a round's dependent shuffle rounds and divisions, which set hc_mix's last-block
    tail) is what nvdisasm counts in this tree's hc_mix (skipped without NVRTC or nvdisasm): 2 shuffle rounds (a
    row and a column sum, each partner shuffled at once) and 2 divisions; the xor butterflies it replaced were 4."""
    for arch, want in timemodel.SINKHORN_ROUND.items():
        listing = _listing("mhc", arch)
        for k in ("hc_mix_f16", "hc_mix_f32"):
            assert sass.sinkhorn_round(listing[k]) == want, (arch, k)
    want = timemodel.SINKHORN_ROUND["sm_90"]
    assert timemodel.SINKHORN_ROUND_CYCLES == (want["shuffle_rounds"] * timemodel.SHUFFLE_CYCLES
                                               + want["divisions"] * timemodel.DIVISION_CYCLES)


def test_the_sinkhorn_round_finder_on_a_listing():
    """sass.sinkhorn_round: the loop that shuffles and takes a reciprocal; a run of back-to-back shuffles is one
    round on the dependent chain."""
    import unittest.mock as um

    body = ["SHFL.BFLY", "SHFL.BFLY", "FADD", "MUFU.RCP", "FFMA", "SHFL.BFLY", "FADD", "SHFL.BFLY", "FADD",
            "MUFU.RCP", "FFMA"]

    def listing(ops):
        return [(16 * i, op, "", "") for i, op in enumerate(["MOV", *ops, "BRA"])]

    with um.patch.object(sass, "loops", lambda ins: [(1, len(ins) - 1)]):     # the loop: all but the first MOV
        assert sass.sinkhorn_round(listing(body)) == {"shuffle_rounds": 3, "divisions": 2}
        assert sass.sinkhorn_round(listing(["FADD", "LDS"])) == {"shuffle_rounds": 0, "divisions": 0}


def test_the_route_keeps_every_logit_of_its_lane_in_flight():
    """moe_route loads the lane's n_experts / 32 logits before scoring any (cu/router.cu): 32 B a lane at 256
    experts, not the 16-byte guess."""
    ln = launch("moe_route", 1, 32, act=1024, dev=H200, scalars=(("n_experts", 256),))
    k = timemodel.model_kernel(ln, H200, 2048, loops={})
    assert k.inflight_bytes == 32 * 32


@pytest.mark.parametrize("device", ["gb10", "h200"])
def test_the_mtp_draft_step_and_the_verify_rows(device):
    """The speculative round's steps at V4 Flash q2 shapes: the MTP draft step (one layer and the main model's
    head, planned on a synthetic MTP block) reads the head and the block's bytes and costs a fraction of a decode
    step; a verify of r rows costs more with every row and less than r decode steps."""
    from ds4py.cuda.plan import planned_model

    t = timemodel.spec_step_times(device, "v4-flash-q2", 2048, k_max=3)
    assert set(t.verify_us) == {2, 3, 4} and set(t.draft_us) == {1, 2}
    assert t.decode_us < t.verify_us[2] < t.verify_us[3] < t.verify_us[4]
    assert all(t.verify_us[r] < r * t.decode_us for r in (2, 3, 4))
    assert 0 < t.draft_us[1] < 0.2 * t.decode_us and t.draft_us[2] < 2 * t.draft_us[1]
    (draft,) = [m for m in timemodel.run(device, "v4-flash-q2", (2048,), steps=("draft",)) if m.tokens == 1]
    head = planned_model("v4-flash-q2", device).w.binding.head.array.nbytes
    assert draft.weight_kv_bytes > head and not draft.refused


def mma_listing(fill_after_wait: bool) -> list[tuple[int, str, str, str]]:
    """A tensor-core k-tile loop (cu/moe_prefill.cu's shape): at a chunk boundary wait for all cp.async groups and
    fill the ring's next chunk (a nested loop of cp.async copies), a nested staging loop (decode, 2 FFMA), a
    barrier, 4 HMMA.16816 and a scale FFMA on the accumulators. fill_after_wait False: the copies come before the
    wait (stage, then wait for all of it: no ring)."""
    wait = [("DEPBAR.LE", " SB0, 0x0 ", ""), ("BAR.SYNC.DEFER_BLOCKING", " 0x0 ", "")]
    fill = [("LDGSTS.E.BYPASS.128", " [R27], desc[UR8][R24.64] ", ".L_x_2"), ("IADD3", " R1, R1, 0x80, RZ ", ""),
            ("BRA", " `(.L_x_2) ", ""), ("LDGDEPBAR", "", "")]
    ins = [("S2R", " R0, SR_TID.X ", ""), ("LOP3.LUT", " P0, RZ, R23, 0x1, RZ, 0xc0, !PT ", ".L_x_1")]
    ins += wait + fill if fill_after_wait else fill + wait
    ins += [("LDG.E.128", " R28, desc[UR8][R46.64] ", ""),
            ("LDS", " R4, [R1] ", ".L_x_3"), ("FFMA", " R5, R4, R6, R7 ", ""), ("FFMA", " R8, R4, R9, R7 ", ""),
            ("STS", " [R2], R5 ", ""), ("BRA", " `(.L_x_3) ", ""), ("BAR.SYNC.DEFER_BLOCKING", " 0x0 ", "")]
    ins += [("HMMA.16816.F32.BF16", f" R{28 + 4 * i}, R52, R36, R{28 + 4 * i} ", "") for i in range(4)]
    ins += [("FFMA", " R28, R28, R10, R11 ", ""), ("BRA", " `(.L_x_1) ", ""), ("EXIT", "", "")]
    return [(16 * i, op, o, lab) for i, (op, o, lab) in enumerate(ins)]


def test_the_sass_mma_loop_of_the_tensor_core_experts_on_a_listing():
    """A tensor-core GEMM's weight loop is its k-tile loop: the nested staging loop counted once, the ring's fill
    loop (cp.async, once per chunk) left out; products are the HMMA multiply-adds one lane does (16 x 8 x 16 / 32 =
    64 each, over mma_pieces: VQ-8's x in 3 bf16 pieces, F16's weights in 2), not the decode's FFMA; a cp.async
    issued after a wait for all groups (the next chunk while this one computes) is a ring."""
    ins = mma_listing(True)
    assert sass.mma_products("HMMA.16816.F32.BF16") == 64 and sass.mma_products("HMMA.1688.F32") == 32
    assert sass.mma_products("FFMA") == 0
    n = len(ins)
    c = sass.inner_loop("moe_prefill_down_q2_k", ins)
    assert c is not None and c.products == 4 * 64 and c.async_copy and c.pipelined
    assert c.instructions == (n - 2) - 3 and c.ldg_bytes == 16       # the loop's span (1 .. n - 2) less the fill's 3
    assert (c.memory, c.fma) == (4, 7)          # LDGDEPBAR, LDG, LDS, STS; FFMA x 3, HMMA x 4
    assert sass.inner_loop("moe_prefill_down_vq12", ins).products == 4 * 64 // 3
    assert sass.inner_loop("moe_prefill_gate_up_f16", ins).products == 4 * 64 // 2
    assert sass.mma_pieces("moe_prefill_down_vq13") == 3 and sass.mma_pieces("moe_prefill_down_iq2_xxs") == 1
    staged = sass.inner_loop("moe_prefill_down_q2_k", mma_listing(False))
    assert staged.async_copy and not staged.pipelined


@pytest.mark.parametrize("arch", ["sm_121", "sm_90"])
def test_the_committed_sass_table_holds_the_tensor_core_prefill_experts(arch):
    """Every moe_prefill_{gate_up,down}_<fmt> has its k-tile MMA loop in the table: 16 HMMA.16816 per matrix and
    k tile (a 64 x 64 block tile of 32 k columns over 4 warps: 1,024 multiply-adds a lane) over the format's
    pieces, pipelined on the sector ring (cp.async; VQ-8 at 13 bits: its per-row windows, waiting with copies
    still in flight), and several SASS instructions per HMMA (the decode and the scales run on the CUDA cores beside
    the tensor cores)."""
    rows = {k: v for k, v in sass.load_table()[arch].items() if k.startswith("moe_prefill_")}
    fmts = ("iq2_xxs", "q2_k", "q4_k", "q8_0", "mxfp4", "f16", "vq12", "vq13")
    for f in fmts:
        for mats, name in ((2, f"moe_prefill_gate_up_{f}"), (1, f"moe_prefill_down_{f}")):
            c = rows[name]
            assert c.products == 1024 * mats, (name, c)
            assert c.async_copy and c.pipelined, (name, c)
            hmma = 16 * mats * sass.mma_pieces(name)
            assert 4 * hmma < c.instructions < 40 * hmma, (name, c)


def test_the_tensor_core_prefill_experts_are_issue_bound_not_bandwidth_bound():
    """H200 V4.1 prefill: the ring's chunk in flight (half its shared memory per resident block, beside the
    activation tile's loads) is credited, so the weight stream is no longer latency-bound; the experts' time is
    their SASS instructions (issue), or on GB10 the tensor cores (mma: VQ-8's three bf16 pieces of x), both above
    their DRAM time. The down kernel's tensor work is counted (its pairs come from H: it has no `sorted`)."""
    from ds4py.cuda.plan import plan_step

    for dev, bound in ((H200, {"issue"}), (GB10, {"issue", "mma"})):
        launches = plan_step("v41-flash-vq", "prefill", dev.key, ctx=2048, block=2048)
        seen = set()
        for ln in launches:
            if not ln.kernel.startswith(("moe_prefill_gate_up_vq12", "moe_prefill_down_vq12")) or ln.kernel in seen:
                continue
            seen.add(ln.kernel)
            kt = timemodel.model_kernel(ln, dev, 2048, loops=sass.load_table()[dev.arch])
            ring = timemodel.moe_prefill_ring(ln.kernel)
            assert ring in (24576, 12288), ln.kernel
            blocks = min(ln.grid[0] * ln.grid[1], dev.sm_count * kt.blocks_per_sm)
            assert kt.inflight_bytes == blocks * (ring // 2 + 128 * 64), (ln.kernel, kt.inflight_bytes)
            assert kt.t_mma_us > 0 and kt.limiter in bound and kt.t_mem_us < kt.time_us / 2, (dev.key, kt)
        assert seen == {"moe_prefill_gate_up_vq12", "moe_prefill_down_vq12"}


def test_the_tensor_core_prefill_counts_its_mma_work_per_16_row_warp():
    """cu/moe_prefill.cu: a work item's MMAs run 16 rows per warp and a warp whose rows are all the item's padding
    runs its k loop without them, so the modelled tensor work of an expert with c pairs is 16 ceil(c / 16) rows
    (V4.1 prefill: 384 experts, 32 pairs each on average: ~1.23x the pairs), while its staging (the issue count)
    still covers whole 64-row work items (~2.0x)."""
    from ds4py.cuda.ops.moe_prefill import BM, WARP_ROWS
    from ds4py.cuda.plan import plan_step

    assert (BM, WARP_ROWS) == (64, 16)
    assert timemodel.expected_work_items(40, 1, 16) == 3.0 and timemodel.expected_work_items(40, 1) == 1.0
    launches = plan_step("v41-flash-vq", "prefill", "h200", ctx=2048, block=2048)
    for name, pieces in (("moe_prefill_gate_up_vq12", 3), ("moe_prefill_down_vq12", 3)):
        ln = next(x for x in launches if x.kernel == name)
        s = timemodel._scalars(ln)
        n_experts, ff = int(s["n_experts"]), int(s["ff"])
        pairs = next(a.nbytes // (4 * ff) for a in ln.args if a.name == "H")
        tr = timemodel.launch_traffic(ln, 2048)
        mma_rows = tr.flops / (2.0 * tr.weights * pieces)           # rows per expert the tensor cores run
        assert mma_rows == pytest.approx(WARP_ROWS * timemodel.expected_work_items(pairs, n_experts, WARP_ROWS)
                                         / n_experts)
        assert 1.1 < mma_rows * n_experts / pairs < 1.3, (name, mma_rows, pairs)
        assert tr.rows * n_experts / pairs > 1.9, (name, tr.rows)


def test_a_pdl_gemv_streams_its_pre_wait_ring_items_under_the_previous_kernel():
    """Every kernel calls pdl_launch_dependents right after its pdl_wait, so the next PDL kernel of its stream
    starts while it runs: a GEMV's ring items issued before pdl_wait (Q8_0: Q8_STAGES - 1 per warp) stream in the
    DRAM time the previous kernel leaves free and in the PDL gap, and leave its memory time. Nothing is credited
    without PDL, to a kernel that loads no weights before its wait, or from a kernel of the other stream."""
    from dataclasses import replace

    from ds4py.cuda.ops.gemv import DEFINES, GEMV_ROWS, Q8_0_BLOCK_BYTES, WARP_SMEM

    t = timemodel.timing_for(H200)
    cols, rows = 4096, 8192
    weight = rows * cols // 32 * Q8_0_BLOCK_BYTES
    gemv = launch("gemv_q8_0", 4 * H200.sm_count, 128, weight=weight, smem=4 * WARP_SMEM["Q8_0"], dev=H200,
                  scalars=(("rows0", rows), ("cols", cols)))
    per_block = 4 * (DEFINES["Q8_STAGES"] - 1) * GEMV_ROWS * DEFINES["Q8_CHUNK_BLOCKS"] * Q8_0_BLOCK_BYTES
    tr = timemodel.launch_traffic(gemv, 2048)
    assert timemodel.prewait_bytes(gemv, tr) == per_block
    assert timemodel.prewait_bytes(launch("moe_gate_up_i8_iq2_xxs", 64, 256, weight=weight, dev=H200), tr) == 0
    # a one-block latency-bound kernel leaves the DRAM almost idle: the GEMV's pre-wait items stream meanwhile
    tiny = launch("rmsnorm_f32", 1, 1024, act=1 << 16, dev=H200)
    alone = timemodel.model_step([gemv], H200, 2048, loops={}).kernels[0]
    m = timemodel.model_step([tiny, gemv], H200, 2048, loops={})
    ka, kb = m.kernels
    rate = kb.bytes / alone.t_mem_us
    free = ka.time_us - ka.t_gap_us - ka.t_dram_us
    assert kb.prefetched_bytes == pytest.approx((free + kb.t_gap_us) * rate, rel=1e-6)
    assert kb.prefetched_bytes <= 4 * H200.sm_count * per_block
    assert kb.t_mem_us == pytest.approx(alone.t_mem_us - kb.prefetched_bytes / rate, rel=1e-6)
    assert m.time_us == pytest.approx(ka.time_us + kb.time_us) and kb.time_us < alone.time_us
    # after a bandwidth-bound kernel only the PDL gap is free DRAM time
    m = timemodel.model_step([gemv, gemv], H200, 2048, loops={})
    assert m.kernels[1].prefetched_bytes == pytest.approx(t.gap_pdl_us * rate, rel=1e-6)
    # no PDL, no pre-wait weight loads, or the previous kernel on the other stream: nothing
    for seq in ([tiny, replace(gemv, pdl=False)], [tiny, launch("rmsnorm_f32", 64, 256, act=1 << 24, dev=H200)],
                [replace(tiny, stream="side"), gemv]):
        assert all(k.prefetched_bytes == 0 for k in timemodel.model_step(seq, H200, 2048, loops={}).kernels)
    # the pre-wait items cap it: a long latency-bound kernel before a small GEMV brings in at most what its
    # blocks issue before the wait
    small = launch("gemv_q8_0", 32, 64, weight=weight, smem=2 * WARP_SMEM["Q8_0"], dev=H200,
                   scalars=(("rows0", rows), ("cols", cols)))
    slow = launch("topk_select", 1, 32, act=8 << 20, dev=H200)
    kb = timemodel.model_step([slow, small], H200, 2048, loops={}).kernels[1]
    assert kb.prefetched_bytes == 32 * 2 * (DEFINES["Q8_STAGES"] - 1) * GEMV_ROWS * DEFINES["Q8_CHUNK_BLOCKS"] \
        * Q8_0_BLOCK_BYTES


def test_the_gemvs_credited_with_pre_wait_loads_load_weights_before_pdl_wait_in_the_traffic_report():
    """timemodel.prewait_bytes credits the gemv_* kernels, hc_mix and the route's bias; the emulator's traffic
    report (model-width records; hc_mix's and the router's twin tests) shows each of them loading its weights
    before pdl_wait, and the routed experts (which wait for the router's ids first) none."""
    report = json.loads(timemodel.TRAFFIC_REPORT.read_text())
    for k, w in (("hc_mix_f16", "fn"), ("hc_mix_f32", "fn"), ("moe_route", "bias")):
        assert report["kernels"][k]["args"][w]["pre_pdl_bytes"] > 0, k
    for k in ("hc_mix_f16", "hc_mix_f32"):
        mix = launch(k, 32, 1024, weight=24 * 16384 * 2, dev=H200)
        assert timemodel.prewait_bytes(mix, timemodel.launch_traffic(mix, 2048)) == 24 * 16384 * 2 // 32
    base = launch("moe_route", 1, 32, weight=1024, act=1024, dev=H200)          # its W stands for the bias here
    route = PlannedLaunch(0, "moe_route", "test", base.grid, base.block, 0, 0, 32, "main", True,
                          (PlannedArg("logits", 1024, True, "activation"),
                           PlannedArg("bias", 1024, True, "blk.5.exp_probs_b.bias"),
                           PlannedArg("tid2eid", 0, True, "null")), (("n_experts", 256),), base.occupancy,
                          base.waves, base.problem)
    assert timemodel.prewait_bytes(route, timemodel.launch_traffic(route, 2048)) == 1024
    wide = report["model_width"]["kernels"]
    weights = lambda k: [a for n, a in wide[k]["args"].items() if n.startswith("W")]       # noqa: E731
    gemvs = [k for k in wide if k.startswith("gemv_")]
    assert len(gemvs) >= 20
    for k in gemvs:
        assert sum(a.get("pre_pdl_bytes", 0) for a in weights(k)) > 0, k
    routed = [k for k in wide if k.startswith(("moe_gate_up_i8_", "moe_down_i8_"))]
    assert routed
    for k in routed:
        assert sum(a.get("pre_pdl_bytes", 0) for a in weights(k)) == 0, k


def q8_listing(norm: bool) -> list[tuple[int, str, str, str]]:
    """A Q8_0 GEMV pass as ptxas writes it (cu/gemv.cu gemv_q8, --fmad=false): a block's f16 scale and 4 int8
    weights from shared memory, decoded (byte permute, exact subtraction), x from global memory (times the norm
    weight, predicated: issued in every launch), 4 weight products summed, the sum scaled by d, accumulated."""
    ins = [("LDS.U16", " R30, [R33] ", ".L_x_9"), ("LDS", " R13, [R37] ", ""),
           ("LDG.E.128", " R8, desc[UR8][R28.64] ", ""), ("LDG.E.128", " R20, desc[UR8][R26.64] ", ""),
           ("HADD2.F32", " R30, -RZ, R30.H0_H0 ", "")]
    if norm:
        ins += [("FMUL", f" R{8 + i}, R{8 + i}, R{20 + i} ", "") for i in range(4)]   # @!P1 (disassemble
                                                                                            # drops predicates)
    for i in range(4):
        ins += [("PRMT", f" R{14 + i}, R13, 0x765{i}, R12 ", ""), ("FADD", f" R{14 + i}, R{14 + i}, -8388736 ", ""),
                ("FMUL", f" R{14 + i}, R{14 + i}, R{8 + i} ", "")]
    ins += [("FADD", " R14, R14, R15 ", ""), ("FADD", " R14, R14, R16 ", ""), ("FADD", " R14, R14, R17 ", ""),
            ("FMUL", " R14, R30, R14 ", ""), ("FADD", " R7, R7, R14 ", ""), ("BRA", " `(.L_x_9) ", "")]
    return [(16 * i, op, o, lab) for i, (op, o, lab) in enumerate(ins)]


@pytest.mark.parametrize("norm", [False, True])
def test_a_loop_is_charged_per_weight_not_per_multiply(norm):
    """The weights a Q8_0 pass consumes are its 4 weight x activation products: not the block scale's multiply of
    their sum, nor x times the RMSNorm weight (predicated: still issued, so still instructions). Until branch
    s7sass the table counted every multiply (5 or 9 here; 4.94 SASS instructions per weight for H200's
    gemv_q8_0 where it does 7.41)."""
    ins = q8_listing(norm)
    assert sum(sass._products(op, o) for _, op, o, _ in ins) == (9 if norm else 5)     # the old count
    assert sass.weight_products(ins) == 4
    if norm:                                  # 9 multiplies: a weight loop (the finder needs 8)
        c = sass.inner_loop("gemv_q8_0", ins)
        assert c is not None and c.products == 4 and c.instructions == len(ins) and c.per_product == len(ins) / 4


def test_int8_dots_and_decoded_weights_are_charged_per_weight():
    """An int8 pass: each IDP.4A is 4 products; its sum (through the magic-number conversion) times dx x dw (a
    factor, not a product) is a scale. A Q4_K-style decode: q x (d x sc) - dmin x m is a weight, not 2 products;
    the weight times x is the one product."""
    i8 = [("LDS", " R54, [R56] ", ".L_x_5"), ("LDS.U16", " R59, [R72] ", ""), ("LDS", " R28, [R76] ", ""),
          ("LDS.U16", " R55, [R47] ", ""), ("IDP.4A.S8.S8", " R59, R59, R54, RZ ", ""),
          ("VIADD", " R59, R59, 0x4b400000 ", ""), ("FADD", " R50, R59, -12582912 ", ""),
          ("HADD2.F32", " R55, -RZ, R55.H0_H0 ", ""), ("FMUL", " R55, R55, R28 ", ""),
          ("FFMA", " R11, R50, R55, R11 ", ""), ("BRA", " `(.L_x_5) ", "")]
    c = sass.weight_products([(16 * i, *x) for i, x in enumerate(i8)])
    assert c == 4
    q4 = [("LDS.64", " R4, [R2] ", ".L_x_6"), ("LDG.E.128", " R8, desc[UR8][R28.64] ", ""),
          ("FMUL", " R20, R30, R31 ", ""), ("FMUL", " R21, R32, R33 ", "")]
    for i in range(4):
        q4 += [("PRMT", f" R{12 + i}, R4, 0x765{i}, R40 ", ""), ("FADD", f" R{12 + i}, R{12 + i}, -8388608 ", ""),
               ("FMUL", f" R{12 + i}, R{12 + i}, R20 ", ""), ("FADD", f" R{12 + i}, R{12 + i}, -R21 ", ""),
               ("FMUL", f" R{12 + i}, R{12 + i}, R{8 + i} ", "")]
    q4 += [("FADD", " R12, R12, R13 ", ""), ("FADD", " R12, R12, R14 ", ""), ("FADD", " R12, R12, R15 ", ""),
           ("FADD", " R7, R7, R12 ", ""), ("BRA", " `(.L_x_6) ", "")]
    assert sass.weight_products([(16 * i, *x) for i, x in enumerate(q4)]) == 4


def test_the_committed_table_charges_whole_weights():
    """gemv_q8_0 (one weight loop, its norm multiplies predicated) does 32 weights a pass on both archs: 2 blocks'
    4 quants for 4 rows; the int8 Q8_0 GEMVs the same 32 (8 IDP.4A); the experts' loops whole 256s."""
    table = sass.load_table()
    for arch in ("sm_90", "sm_121"):
        rows = table[arch]
        for k in ("gemv_q8_0", "gemv_q8_0_hc_post", "gemv_q8_0_swiglu", "gemv_q8_0_i8", "gemv_q8_0_i8_grouped"):
            assert rows[k].products == 32, (arch, k, rows[k])
        for k in ("moe_down_iq2_xxs", "moe_down_q8_0", "moe_down_vq8"):
            assert rows[k].products == 256, (arch, k, rows[k])
