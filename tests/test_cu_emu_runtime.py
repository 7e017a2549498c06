"""EmuRuntime: the Runtime interface on the CPU emulator (ds4py/cuda/emu_runtime.py) - arena memory, guarded
arguments, the const-copy cache, streams with a deferred side stream, graphs and the capture rules."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from ds4py.cuda import emu, ops, twins
from ds4py.cuda.args import KernelArgumentError
from ds4py.cuda.emu_runtime import CaptureSyncError, EmuRuntime
from ds4py.cuda.graph import CaptureError, StepGraph
from ds4py.cuda.launch import launch_arrays
from ds4py.cuda.memory import ArenaError
from ds4py.cuda.ops.embed import Embedding
from ds4py.cuda.ops.gemv import F16_WARP_SMEM

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")

SELFTEST_DIR = Path(__file__).parent / "emu_kernels"


@pytest.fixture
def rt():
    return EmuRuntime(order="random", seed=5)


@pytest.fixture
def arena(rt):
    a = rt.arena(1 << 20, 1 << 16)
    a.begin_step()
    yield a
    a.close()


def put(arena, host, weights=True):
    d = arena.weights(host.shape, host.dtype) if weights else arena.scratch(host.shape, host.dtype)
    d.upload(host)
    return d


def test_upload_download_views_and_ops(rt, arena):
    r = np.random.default_rng(1)
    x = r.standard_normal((3, 100)).astype(np.float32)
    w = r.standard_normal(100).astype(np.float32)
    dx, dw = put(arena, x, weights=False), put(arena, w)
    assert dw.readonly and not dx.readonly and dx.ptr % 256 == 0
    np.testing.assert_array_equal(dx.download(), x)
    dy = arena.scratch((3, 100), np.float32)
    ops.rmsnorm(rt, dx, dy, 100, (dw, 1e-6), threads=64)
    ref = twins.rmsnorm(x, w, 1e-6)
    twins.assert_close_scaled(dy.download(), ref, np.abs(ref), 100, "rmsnorm on EmuRuntime")
    row = dy.view(100 * 4, 100)                            # a view of row 1
    np.testing.assert_array_equal(row.download(), dy.download()[1])
    with pytest.raises(ArenaError, match="does not fit"):
        dy.view(250 * 4, 100)
    with pytest.raises(ArenaError, match="does not match"):
        dx.upload(np.zeros(5, np.float32))


def test_const_copies_are_cached_and_invalidated(rt, arena):
    """Weights are copied into their guarded read-only buffer once; an upload or a kernel's write to the same
    bytes is seen by the next launch."""
    r = np.random.default_rng(2)
    table = r.standard_normal((8, 64)).astype(np.float16)
    dt = put(arena, table)
    ids = put(arena, np.array([3, 1], np.int32), weights=False)
    out = arena.scratch((2, 64), np.float32)
    ops.embed(rt, Embedding(dt), ids, out, 2)
    copied = rt.memory.bytes_copied
    ops.embed(rt, Embedding(dt), ids, out, 2)
    assert rt.memory.bytes_copied == copied                # nothing re-copied for unchanged const buffers
    np.testing.assert_array_equal(out.download(), twins.embed_f16(table, [3, 1]))
    table2 = (table * 2).astype(np.float16)
    dt.upload(table2)                                      # new weights: the cached copy is dropped
    ids.upload(np.array([0, 7], np.int32))
    ops.embed(rt, Embedding(dt), ids, out, 2)
    np.testing.assert_array_equal(out.download(), twins.embed_f16(table2, [0, 7]))
    # a kernel's output read as a const input by the next kernel
    x = put(arena, r.standard_normal(64).astype(np.float32), weights=False)
    y = arena.scratch(64, np.float32)
    ops.rmsnorm(rt, x, y, 64, (None, 1e-6), threads=32)
    first = y.download()
    ops.rmsnorm(rt, y, x, 64, (None, 1e-6), threads=32)     # y now const, x written
    ops.rmsnorm(rt, x, y, 64, (None, 1e-6), threads=32)     # x must be the new value, not a stale copy
    twins.assert_close_scaled(y.download(), twins.rmsnorm(first, None, 1e-6), 1.0, 64, "rmsnorm chain")


def test_guarded_arguments_catch_overruns_of_a_view(rt, arena):
    """Each argument gets its own guard page, even a view inside a larger allocation."""
    W = put(arena, np.ones((16, 64), np.float16))
    x = put(arena, np.ones(64, np.float32), weights=False)
    y = arena.scratch(16, np.float32)
    half = W.view(0, (8, 64))
    with pytest.raises(emu.EmuKernelError, match="past the end of argument 'W0'"):
        rt.launch("gemv_f16", 2, 64, half, None, None, None, 16, 0, 0, 0, y, None, None, None, x, 64, 0, None,
                  0.0, 0, smem=2 * F16_WARP_SMEM)          # 16 rows through an 8-row view
    with pytest.raises(KernelArgumentError, match="read-only"):
        ops.rmsnorm(rt, x, W.view(0, 64, np.float32), 64, (None, 1e-6))
    with pytest.raises(KernelArgumentError, match="host numpy array"):
        rt.launch("rmsnorm_f32", 1, 32, np.zeros(4, np.float32), None, y, 4, 1e-6)
    other = EmuRuntime().arena(4096, 4096)
    with pytest.raises(KernelArgumentError, match="not in this emulator's memory"):
        rt.launch("rmsnorm_f32", 1, 32, other.weights(4, np.float32), None, y, 4, 1e-6)
    with pytest.raises(KernelArgumentError, match="exceeds the limit"):
        rt.launch("rmsnorm_f32", 1, 32, x, None, y, 4, 1e-6, smem=300_000)


def test_launches_are_checked_against_the_device_profile(monkeypatch):
    """The emulator is H200 by default and GB10 on request; a launch either device would refuse is refused on the
    emulator too, registers included (the committed ptxas table: gemv_q4_k_rows has more than 64 registers on both
    archs, so 1,024 threads cannot fit an SM's 65,536), with the device's per-block shared memory."""
    from ds4py.cuda import resources
    from ds4py.cuda.devices import LaunchRefused
    from ds4py.cuda.emu_runtime import EmuDevice

    assert all(resources.require(a, "gemv_q4_k_rows").registers > 64 for a in ("sm_90", "sm_121")), \
        "pick another kernel with > 64 registers on both archs for this test"

    assert EmuRuntime().profile.key == "h200"
    monkeypatch.setenv("DS4PY_EMU_DEVICE", "gb10")
    gb10 = EmuRuntime()
    assert gb10.profile.key == "gb10" and gb10.device.sm_count == 48 and gb10.device.smem_per_block_optin == 101376
    monkeypatch.delenv("DS4PY_EMU_DEVICE")
    args = (None,) * 4 + (16, 0, 0, 0) + (None,) * 4 + (None, 256, 0, None, 0.0, 0, 2, 256)
    for rt in (EmuRuntime(), EmuRuntime(device=EmuDevice.from_profile("gb10"))):
        with pytest.raises(LaunchRefused, match=rf"gemv_q4_k_rows on {rt.profile.key} .*registers .* exceeds"):
            rt.launch("gemv_q4_k_rows", 1, 1024, *args)
    x = EmuRuntime(device=EmuDevice.from_profile("gb10"))
    with pytest.raises(KernelArgumentError, match="exceeds the limit of 101376 per block"):
        x.launch("rmsnorm_f32", 1, 32, None, None, None, 4, 1e-6, smem=101377)


def step(rt, arena, table, slot, outs):
    """embed(slot) -> rmsnorm on the side stream -> rmsnorm on main after the join."""
    a = arena.scratch(64, np.float32)
    b = arena.scratch(64, np.float32)
    c = arena.scratch(64, np.float32)
    outs[:] = [a, b, c]
    ops.embed(rt, Embedding(table), slot, a, 1)
    rt.fork()
    ops.rmsnorm(rt, a, b, 64, (None, 1e-6), threads=32, stream=rt.side)
    rt.join()
    ops.rmsnorm(rt, b, c, 64, (None, 1e-6), threads=32)


def test_graph_replay_matches_direct_and_recaptures_after_growth(rt):
    r = np.random.default_rng(3)
    arena = rt.arena(1 << 16, 4096)
    host = r.standard_normal((16, 64)).astype(np.float16)
    table = put(arena, host)
    slot = arena.weights(2, np.int32)
    slot.readonly = False
    outs: list = []
    direct = {}
    for tok in (2, 9):
        arena.begin_step()
        slot.upload(np.array([tok, 0], np.int32))
        step(rt, arena, table, slot, outs)
        direct[tok] = [o.download() for o in outs]
    g = StepGraph(rt, lambda: (arena.begin_step(), step(rt, arena, table, slot, outs)), slot, arena)
    for tok in (9, 2, 9):
        g.replay([tok, 0])
        for o, want in zip(outs, direct[tok]):
            assert o.download().tobytes() == want.tobytes()
    assert g.captures == 1
    arena.begin_step(1 << 16)                              # scratch moves: the graph is captured again
    g.replay([2, 0])
    assert g.captures == 2
    assert outs[2].download().tobytes() == direct[2][2].tobytes()
    g.close()


def test_deferred_side_stream_exposes_a_missing_join():
    rt = EmuRuntime(defer_side=True)
    arena = rt.arena(1 << 16, 1 << 16)
    arena.begin_step()
    x = put(arena, np.arange(1, 65, dtype=np.float32), weights=False)
    y = put(arena, np.zeros(64, np.float32), weights=False)
    z = arena.scratch(64, np.float32)
    rt.fork()
    ops.rmsnorm(rt, x, y, 64, (None, 1e-6), threads=32, stream=rt.side)
    ops.rmsnorm(rt, y, z, 64, (None, 1e-6), threads=32)      # no join: reads y before the side stream ran
    rt.join()
    assert np.all(z.download() == 0)                        # the race shows (zeros normalise to zeros)
    rt.fork()
    ops.rmsnorm(rt, x, y, 64, (None, 1e-6), threads=32, stream=rt.side)
    rt.join()
    ops.rmsnorm(rt, y, z, 64, (None, 1e-6), threads=32)
    twins.assert_close_scaled(z.download(), twins.rmsnorm(twins.rmsnorm(np.arange(1, 65, dtype=np.float32), None,
                                                                         1e-6), None, 1e-6), 1.0, 64, "joined")


def test_capture_rules(rt, arena):
    slot = arena.weights(2, np.int32)
    slot.readonly = False
    x = put(arena, np.ones(64, np.float32), weights=False)
    y = arena.scratch(64, np.float32)

    def upload_inside():
        x.upload(np.ones(64, np.float32))

    def side_without_fork():
        ops.rmsnorm(rt, x, y, 64, (None, 1e-6), threads=32, stream=rt.side)

    def unjoined():
        rt.fork()
        ops.rmsnorm(rt, x, y, 64, (None, 1e-6), threads=32, stream=rt.side)

    def download_inside():
        y.download()

    for record, frag in [(upload_inside, "host synchronisation"), (side_without_fork, "outside fork"),
                         (download_inside, "host synchronisation")]:
        with pytest.raises(CaptureSyncError, match=frag):
            StepGraph(rt, record, slot).capture()
        assert not rt.capturing                             # the capture was ended; the runtime works on
    with pytest.raises(CaptureError, match="not joined"):
        StepGraph(rt, unjoined, slot).capture()
    ops.rmsnorm(rt, x, y, 64, (None, 1e-6), threads=32)
    assert np.allclose(y.download(), 1.0)


def test_launch_arrays_on_the_emulator_runtime():
    """The host-array launcher (used by the GPU value tests) on the emulator's own self-test kernels."""
    rt = EmuRuntime(cu_dir=SELFTEST_DIR)
    x = np.arange(128, dtype=np.int32)
    out = np.zeros_like(x)
    launch_arrays(rt, "reverse_block", 2, 64, [x, out, 1])
    np.testing.assert_array_equal(out, x.reshape(2, 64)[:, ::-1].reshape(-1))
    same = np.arange(64, dtype=np.int32)
    launch_arrays(rt, "reverse_dynamic", 1, 32, [same, same, 64], smem=256)   # in place: one buffer
    np.testing.assert_array_equal(same, np.arange(64)[::-1])


def test_per_launch_overhead_is_reported(rt, arena, capsys):
    """Not a timed assertion: prints the emulator's fixed cost per launch (one 32-thread block, 3 pointers)."""
    x = put(arena, np.ones(32, np.float32), weights=False)
    w = put(arena, np.ones(32, np.float32))
    y = arena.scratch(32, np.float32)
    ops.rmsnorm(rt, x, y, 32, (w, 1e-6), threads=32)
    n = 200
    t0 = time.process_time()
    for _ in range(n):
        ops.rmsnorm(rt, x, y, 32, (w, 1e-6), threads=32)
    us = (time.process_time() - t0) / n * 1e6
    with capsys.disabled():
        print(f"\nemulator: {us:.0f} us CPU per launch (rmsnorm, 1 block of 32 threads)")
    assert rt.launches == n + 1


def test_pdl_check():
    """check_pdl: a store to an argument, or a return, before pdl_wait() fails the launch; loads may come first
    (weights prefetched under the previous kernel). The kernel tests run every cu/ kernel with it on."""
    rt = EmuRuntime(cu_dir=SELFTEST_DIR, check_pdl=True, order="random")
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    launch_arrays(rt, "pdl_ok", 1, 64, [x, y])
    np.testing.assert_array_equal(y, x[::-1])
    y = np.zeros(64, np.float32)
    launch_arrays(rt, "pdl_store_first", 1, 64, [y, 99])    # nobody stores early
    assert (y == 1).all()
    with pytest.raises(emu.EmuKernelError, match=r"thread \(5,0,0\).*store to global memory before pdl_wait\(\)"
                                                 r".*argument 'y' \(byte 20 of 256\)"):
        launch_arrays(rt, "pdl_store_first", 1, 64, [np.zeros(64, np.float32), 5])
    with pytest.raises(emu.EmuKernelError, match="returned without calling pdl_wait"):
        launch_arrays(rt, "pdl_return_first", 1, 64, [np.zeros(64, np.float32), 40])
    launch_arrays(rt, "pdl_return_first", 1, 64, [np.zeros(64, np.float32), 64])
    y = np.zeros(64, np.float32)
    launch_arrays(EmuRuntime(cu_dir=SELFTEST_DIR), "pdl_store_first", 1, 64, [y, 5])   # off: not checked
    assert y[5] == 2 and y[4] == 1
