"""The emulator's traffic profile (DS4PY_EMU_CHECK=traffic, docs/cuda-emu.md "Traffic profile") proven on
textbook kernels with known answers (tests/emu_kernels/traffic.cu): a coalesced copy at 100%, a 32-byte stride at
12.5%, 2-way and 32-way shared-memory bank conflicts and a broadcast, an input read twice, a weight loaded before
pdl_wait, a cp.async load; then the profile of one real kernel through the twin tests' runtime."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

from ds4py.cuda import emu, traffic
from ds4py.cuda.ops.gemv import GemvX

REPO = Path(__file__).resolve().parents[1]
TEXTBOOK = REPO / "tests" / "emu_kernels" / "traffic.cu"
pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the emulator needs g++")


@pytest.fixture(scope="module")
def mod():
    return emu.EmuModule(TEXTBOOK, check="traffic")


def profile(mod, name, grid, block, args, order="forward", seed=0):
    with traffic.collect() as recs:
        mod.launch(name, grid, block, args, order=order, seed=seed)
    assert len(recs) == 1
    return recs[0]


def f32(n):
    return np.arange(n, dtype=np.float32)


def test_coalesced_copy_is_100_percent(mod):
    r = profile(mod, "copy_f32", 4, 128, [f32(512), np.zeros(512, np.float32), 512])
    x = r["args"]["x"]
    assert (x["requests"], x["requested_bytes"], x["sectors"], x["lines"]) == (16, 2048, 64, 16)
    assert x["coalescing"] == 1.0 and x["line_efficiency"] == 1.0
    assert (x["unique_bytes"], x["arg_bytes"], x["reread"], x["coverage"]) == (2048, 2048, 1.0, 1.0)
    assert (x["unique_sectors"], x["dram_efficiency"]) == (64, 1.0)
    y = r["args"]["y"]
    assert y["requests"] == 0 and y["store_requests"] == 16 and y["store_coalescing"] == 1.0 and y["written"]
    assert r["smem"]["requests"] == 0


def test_ragged_tail_requests_count_only_active_lanes(mod):
    r = profile(mod, "copy_f32", 1, 128, [f32(40), np.zeros(40, np.float32), 40])
    x = r["args"]["x"]
    assert (x["requests"], x["requested_bytes"], x["sectors"]) == (2, 160, 5)     # 32 lanes, then 8
    assert x["coalescing"] == 1.0


@pytest.mark.parametrize("stride,sectors,lines", [(8, 32, 8), (16, 32, 16), (2, 8, 2)])
def test_strided_load(mod, stride, sectors, lines):
    """Stride 8 floats = 32 bytes: each lane's 4 bytes in its own sector, 12.5%; stride 2: 50%."""
    r = profile(mod, "strided_f32", 1, 32, [f32(32 * stride), np.zeros(32, np.float32), 32, stride])
    x = r["args"]["x"]
    assert (x["requests"], x["requested_bytes"], x["sectors"], x["lines"]) == (1, 128, sectors, lines)
    assert x["coalescing"] == pytest.approx(128 / (32 * sectors))
    assert x["coverage"] == pytest.approx(1 / stride)
    assert x["unique_sectors"] == sectors and x["dram_efficiency"] == pytest.approx(128 / (32 * sectors))


@pytest.mark.parametrize("stride,wavefronts", [(1, 1), (2, 2), (32, 32), (0, 1), (33, 1), (4, 4)])
def test_shared_memory_bank_conflicts(mod, stride, wavefronts):
    """32 banks of 4 bytes: s[lane * stride] is conflict-free at stride 1 or 33, 2-way at 2, 32-way at 32;
    stride 0 is one word for all lanes: a broadcast, one wavefront."""
    r = profile(mod, "smem_stride", 1, 32, [f32(32 * 33), np.zeros(32, np.float32), stride])
    load = r["smem"]["load"]
    assert (load["requests"], load["wavefronts"], load["ideal_wavefronts"]) == (1, wavefronts, 1)
    assert load["conflict_factor"] == wavefronts
    assert r["smem"]["store"]["wavefronts"] == r["smem"]["store"]["requests"] == 33     # the conflict-free fill


@pytest.mark.parametrize("stride,wavefronts", [(1, 1), (32, 32)])
def test_bank_conflicts_on_a_template_local_shared_array(mod, stride, wavefronts):
    """A __shared__ array declared inside a function template (g++ gives that static its own COMDAT section, not
    emu_shared; the build moves it) is shared memory to the profile too: 32-way at stride 32."""
    r = profile(mod, "tpl_smem_stride", 1, 32, [f32(32 * 33), np.zeros(32, np.float32), stride])
    load = r["smem"]["load"]
    assert (load["requests"], load["wavefronts"], load["ideal_wavefronts"]) == (1, wavefronts, 1)
    assert r["smem"]["store"]["requests"] == 33


def test_input_read_twice_shows_a_reread_of_two(mod):
    r = profile(mod, "read_passes", 1, 64, [f32(256), np.zeros(64, np.float32), 256, 2])
    x = r["args"]["x"]
    assert (x["unique_bytes"], x["distinct_bytes"], x["reread"], x["reread_blocks"]) == (1024, 2048, 2.0, 1.0)
    assert x["unique_sectors"] == 32                      # read twice, fetched from DRAM once at best
    once = profile(mod, "read_passes", 1, 64, [f32(256), np.zeros(64, np.float32), 256, 1])["args"]["x"]
    assert once["reread"] == 1.0
    # three blocks each reading all of x once: each byte requested three times, by three blocks
    three = profile(mod, "read_passes", 3, 64, [f32(256), np.zeros(192, np.float32), 256, 1])["args"]["x"]
    assert (three["reread"], three["reread_blocks"]) == (3.0, 3.0)


def test_bytes_loaded_before_pdl_wait(mod):
    r = profile(mod, "prefetch_weight", 2, 128, [f32(256), f32(256), np.zeros(256, np.float32), 256])
    assert r["args"]["w"]["pre_pdl_bytes"] == 1024 and r["args"]["x"]["pre_pdl_bytes"] == 0
    r = profile(mod, "copy_f32", 2, 128, [f32(256), np.zeros(256, np.float32), 256])
    assert r["args"]["x"]["pre_pdl_bytes"] == 0


def test_cp_async_counts_as_a_global_load(mod):
    r = profile(mod, "cp_async_copy", 1, 32, [f32(128), np.zeros(128, np.float32)])
    x = r["args"]["x"]
    assert (x["requests"], x["requested_bytes"], x["sectors"], x["coalescing"]) == (1, 512, 16, 1.0)
    # then each lane reads its own 4 consecutive words of shared memory, one float at a time: 4-way conflicts,
    # and stores y the same way: 4 requests at 25%
    assert r["smem"]["load"]["wavefronts"] == 16 and r["smem"]["load"]["requests"] == 4
    assert r["args"]["y"]["store_coalescing"] == 0.25


@pytest.mark.parametrize("order,seed", [("reverse", 0), ("random", 3), ("random", 11)])
def test_grouping_does_not_depend_on_the_order_threads_run_in(mod, order, seed):
    """Lanes are regrouped into warp requests by (warp, instruction, pass), not by when their fiber ran."""
    args = [f32(300), np.zeros(192, np.float32), 300, 2]
    a = profile(mod, "read_passes", 3, 64, args)
    b = profile(mod, "read_passes", 3, 64, args, order=order, seed=seed)
    assert a["args"] == b["args"] and a["smem"] == b["smem"]


def test_the_plain_build_has_no_traffic_code():
    plain = emu.EmuModule(TEXTBOOK)
    assert not hasattr(plain._lib, "emu_traffic_begin")
    lib = ctypes.CDLL(str(emu.build(TEXTBOOK, check="traffic")[0]))
    assert hasattr(lib, "emu_traffic_begin")
    with traffic.collect() as recs:
        plain.launch("copy_f32", 1, 32, [f32(32), np.zeros(32, np.float32), 32])
    assert recs == []


def test_report_flags_uncoalesced_and_reread_weights():
    rec = {"kernel": "k", "grid": [1, 1, 1], "block": [32, 1, 1], "smem_bytes": 0, "smem": {
        **dict.fromkeys(traffic.SMEM_COUNTERS, 0), "load": dict.fromkeys(traffic.SMEM_COUNTERS, 0),
        "store": dict.fromkeys(traffic.SMEM_COUNTERS, 0)}, "args": {}}
    base = dict.fromkeys(traffic.ARG_COUNTERS, 0)
    w = dict(base, requests=1, requested_bytes=128, distinct_bytes=128, sectors=32, lines=8, unique_bytes=128,
             block_unique_bytes=128, arg_bytes=1024, weight=True, written=False)
    x = dict(w, weight=False)
    rec["args"] = {"w": traffic.derive_arg(w), "x": traffic.derive_arg(x)}
    rep = traffic.report([rec, rec])
    assert rep["kernels"]["k"]["launches"] == 2
    assert rep["kernels"]["k"]["args"]["w"]["coalescing"] == 0.125
    assert [(f["kernel"], f["arg"]) for f in rep["findings"]] == [("k", "w")]


@pytest.mark.parametrize("kind", ["F16", "Q8_0"])
def test_a_real_gemv_reads_each_weight_byte_once(kind, monkeypatch):
    """cu/gemv.cu through the EmuRuntime, as the twin tests run it: the weight (recognised by the arena's weights
    region) is read whole, each byte by one block only; the activation is not a weight."""
    from cu_fixtures import fresh_arena, gemv_weights, putter
    from ds4py.cuda import ops
    from ds4py.cuda.emu_runtime import EmuRuntime

    monkeypatch.setenv("DS4PY_EMU_CHECK", "traffic")     # what the report tool sets for the twin tests
    rt = EmuRuntime(check_pdl=True)
    rows, cols = 40, 256
    r = np.random.default_rng(0)
    with fresh_arena(rt, 1 << 20, 1 << 20) as arena:
        put = putter(arena)
        W, x = put(gemv_weights(r, kind, rows, cols)), put(r.standard_normal(cols).astype(np.float32), False)
        y = arena.scratch(rows, np.float32)
        with traffic.collect() as recs:
            ops.gemv(rt, [(W, y, rows)], GemvX(x, cols), warps=2)
    assert len(recs) == 1
    args = recs[0]["args"]
    w = [a for a in args.values() if a["weight"]]
    assert len(w) == 1 and w[0]["unique_bytes"] == w[0]["arg_bytes"] == W.nbytes
    assert w[0]["coverage"] == 1.0 and w[0]["reread_blocks"] == 1.0
    assert 0 < w[0]["coalescing"] <= 1.0


@pytest.mark.parametrize("outer", [None, "race"])
def test_traffic_build_restores_the_callers_setting(monkeypatch, outer):
    """The model-width recorders' context (traffic.traffic_build): the traffic build inside, the caller's
    DS4PY_EMU_CHECK (or none) back after, also when the block raises."""
    if outer is None:
        monkeypatch.delenv("DS4PY_EMU_CHECK", raising=False)
    else:
        monkeypatch.setenv("DS4PY_EMU_CHECK", outer)
    with pytest.raises(RuntimeError, match="inside"):
        with traffic.traffic_build():
            assert os.environ["DS4PY_EMU_CHECK"] == "traffic"
            raise RuntimeError("inside")
    assert os.environ.get("DS4PY_EMU_CHECK") == outer


@pytest.mark.parametrize("pair,requests,sectors", [(0, 1, 16), (1, 2, 64)])
def test_vector_loads_are_one_request(mod, pair, requests, sectors):
    """A float4 load is one 16-byte access per lane, as on the GPU (not four 4-byte loads: g++'s SRA is off)."""
    r = profile(mod, "copy_f32x4", 1, 32, [f32(256), np.zeros(128, np.float32), pair])
    x = r["args"]["x"]
    assert (x["requests"], x["sectors"]) == (requests, sectors)
    assert x["coalescing"] == (1.0 if not pair else 0.5) and x["dram_efficiency"] == 1.0
