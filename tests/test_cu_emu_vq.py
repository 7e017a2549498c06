"""VQ-8 experts (cu/experts.cu's moe_*_vq6 .. vq13 entry points, the device layout of ds4py/cuda/vq_layout.py)
under the CPU emulator against the twin (the reference's exact decode fl32(g * c), then the products): the routed
gate + up + SwiGLU and the down sum with its add and hc_post epilogues at every width quantize-vq writes (6 .. 12
bits and 12 + 1), the grouped rows kernels bit-identical to the one-token ones, the persistent blocks' results
independent of the grid (a one-SM GB10-like device, each block looping over many tiles, = an H200-like one), and
every VQ launch's shared memory within GB10's 101,376 B per block at V4 Flash's and V4.1 Flash's real shapes."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.config import ModelConfig
from ds4py.cuda import emu, vq_layout
from ds4py.cuda.emu_runtime import EmuDevice, EmuRuntime
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.twins import experts as twin
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.cuda.ops.core import TokenRows
from ds4py.cuda.ops.experts import Experts, HcPost, Slots
from ds4py.cuda.ops.mhc import HcResidual
from ds4py.quant import vq
from tests.cu_emu_device import KernelDevice, devices

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")
WIDTHS = range(vq.MIN_BITS, vq.MAX_BITS + 1)
GB10_SMEM = 101_376                                       # shared memory per block, sm_121 (docs/cuda.md)


def one_sm_gb10(order: str = "forward") -> KernelDevice:
    """A GB10-like emulated device with one SM: the persistent VQ grids shrink to a block or a few, so every block
    loops over many row tiles."""
    dev = EmuDevice(name="one-SM GB10-like", cc=(12, 1), sm_count=1, smem_per_block_optin=GB10_SMEM,
                    threads_per_sm=1536, l2_bytes=24 << 20)
    return KernelDevice(EmuRuntime(order=order, check_pdl=True, device=dev), 32, 32)


def vq_tensor(r: np.random.Generator, bits: int, X: int, rows: int, cols: int, codes: np.ndarray):
    """(device copy, dequantised float32 [X, rows, cols]) of random indices and gains over codebook `codes`."""
    idx = r.integers(0, 1 << bits, (X, rows, cols // 8))
    stream, hi = vq.pack_indices(idx, bits)
    gains = (r.random((X, rows)) * 0.05 + 0.01).astype(np.float16).astype(np.float32)
    gains[0, 0] = 0.0
    fmt = vq_layout.kernel_format(bits, "test")
    return fmt, vq_layout.pack(fmt, codes, stream, hi, gains, cols), twin.vq_dequant(codes, stream, hi, gains, bits)


def codebook(r: np.random.Generator, bits: int) -> np.ndarray:
    c = r.integers(0, 256, ((1 << bits), 8)).astype(np.uint8)
    c[(c & 0x7F) == 0x7F] = 0x38                        # no NaN codes (the loader refuses them)
    return c


def same_bits(a, b, what):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), f"{what}: not bit-identical"


# widths x shapes: dim and the down's columns multiples of 64 (a VQ row is whole runs), ff any
CASES = [(6, 192, 40, "forward"), (7, 64, 33, "random"), (8, 128, 17, "reverse"), (9, 256, 24, "forward"),
         (10, 64, 48, "random"), (11, 192, 9, "forward"), (12, 256, 40, "forward"), (13, 128, 33, "random")]


@pytest.mark.parametrize("bits,dim,ff,order", CASES)
def test_gate_up_and_down(kdev, bits, dim, ff, order):
    r = np.random.default_rng([51, bits])
    n_exp, slots, hc = 5, 3, 4
    cb = codebook(r, bits)
    fmt, dg, Wg = vq_tensor(r, bits, n_exp, ff, dim, cb)
    _, du, Wu = vq_tensor(r, bits, n_exp, ff, dim, cb)
    ff_d = 64 * (1 + bits % 3)                             # down: rows dim, columns ff_d (a multiple of 64)
    _, dd, Wd = vq_tensor(r, bits, n_exp, dim, ff_d, cb)
    x = (r.standard_normal(dim) * 2).astype(np.float32)
    ids = r.integers(0, n_exp, slots).astype(np.int32)
    wts = (r.random(slots) + 0.2).astype(np.float32)
    dev = one_sm_gb10(order) if bits % 2 else kdev(order, dim)      # odd widths: persistent blocks loop
    d_h = dev.var(np.full((slots, ff), np.nan, np.float32))
    small = {"rows_per_block": 4} if bits % 2 else {}     # odd widths: several tiles per block
    ops_moe.moe_gate_up(dev.rt,
                        Experts(fmt=fmt, n_experts=n_exp, ff=ff, dim=dim, gate=dev.const(dg), up=dev.const(du),
                                clamp=0.5), dev.const(x), d_h,
                        Slots(ids=dev.const(ids), weights=dev.const(wts), k=slots), **small)
    want, mag = twin.gate_up(Wg, Wu, x, ids, wts, 0.5, slots)
    assert_close_scaled(d_h.download(), want, mag, dim, f"vq{bits} gate_up")
    h = r.standard_normal((slots, ff_d)).astype(np.float32)
    add = r.standard_normal(dim).astype(np.float32)
    post, comb = (r.random(hc) * 2).astype(np.float32), r.random((hc, hc)).astype(np.float32)
    X = r.standard_normal((hc, dim)).astype(np.float32)
    d_out = dev.var(np.full((hc, dim), np.nan, np.float32))
    ops_moe.moe_down(dev.rt, Experts(fmt=fmt, n_experts=n_exp, ff=ff_d, dim=dim, down=dev.const(dd)),
                     TokenRows(x=dev.const(h), y=d_out, add=dev.const(add)), Slots(ids=dev.const(ids), k=slots),
                     hc=HcPost(dev.const(post), dev.const(comb), dev.const(X)), **small)
    want, mag = twin.down(Wd, ids, h, slots, add, post, comb, X)
    assert_close_scaled(d_out.download(), want, mag, ff_d * slots + hc, f"vq{bits} down")


@pytest.mark.parametrize("bits", [7, 12, 13])
def test_grouped_rows_equal_single_rows(kdev, bits):
    r = np.random.default_rng([52, bits])
    n_exp, k, nx, dim, ff, hc = 4, 2, 3, 128, 64, 4
    cb = codebook(r, bits)
    fmt, dg, Wg = vq_tensor(r, bits, n_exp, ff, dim, cb)
    _, du, _ = vq_tensor(r, bits, n_exp, ff, dim, cb)
    _, dd, _ = vq_tensor(r, bits, n_exp, dim, ff, cb)
    x = (r.standard_normal((nx, dim)) * 2).astype(np.float32)
    ids = r.integers(0, n_exp, (nx, k)).astype(np.int32)
    ids[1] = ids[0]                                        # two rows routed to the same experts
    wts = (r.random((nx, k)) + 0.2).astype(np.float32)
    mix = r.random((nx, (2 + hc) * hc)).astype(np.float32)
    X = r.standard_normal((nx, hc, dim)).astype(np.float32)
    dev = kdev("forward", dim)
    cg, cu, cd = dev.const(dg), dev.const(du), dev.const(dd)
    d_ids, d_w = dev.const(ids.reshape(-1)), dev.const(wts.reshape(-1))
    d_h = dev.var(np.zeros((nx * k, ff), np.float32))
    ops_moe.moe_gate_up_rows(dev.rt, Experts(fmt=fmt, n_experts=n_exp, ff=ff, dim=dim, gate=cg, up=cu, clamp=0.5),
                             TokenRows(x=dev.const(x.reshape(-1)), y=d_h, T=nx), Slots(ids=d_ids, weights=d_w, k=k))
    d_out = dev.var(np.zeros((nx, hc, dim), np.float32))
    ops_moe.moe_down_rows(dev.rt, Experts(fmt=fmt, n_experts=n_exp, ff=ff, dim=dim, down=cd),
                          TokenRows(x=d_h, y=d_out, T=nx), Slots(ids=d_ids, k=k),
                          hc=HcResidual(dev.const(X.reshape(-1)), dev.const(mix.reshape(-1)), dim, hc))
    h, out = d_h.download(), d_out.download()
    for n in range(nx):
        one = dev.var(np.zeros((k, ff), np.float32))
        rid = dev.const(ids[n].copy())
        ops_moe.moe_gate_up(dev.rt, Experts(fmt=fmt, n_experts=n_exp, ff=ff, dim=dim, gate=cg, up=cu, clamp=0.5),
                            dev.const(x[n].copy()), one, Slots(ids=rid, weights=dev.const(wts[n].copy()), k=k))
        same_bits(h[n * k:(n + 1) * k], one.download(), f"vq{bits} gate_up row {n}")
        y1 = dev.var(np.zeros((hc, dim), np.float32))
        ops_moe.moe_down(dev.rt, Experts(fmt=fmt, n_experts=n_exp, ff=ff, dim=dim, down=cd), TokenRows(x=one, y=y1),
                         Slots(ids=rid, k=k),
                         hc=HcPost(dev.const(mix[n, hc:2 * hc].copy()), dev.const(mix[n, 2 * hc:].copy()),
                                   dev.const(X[n].copy())))
        same_bits(out[n], y1.download(), f"vq{bits} down row {n}")
    Wg0 = Wg[ids[0, 0]]
    assert np.isfinite(Wg0).all()


@pytest.mark.parametrize("bits", WIDTHS)
def test_results_do_not_depend_on_the_persistent_grid(kdev, bits):
    """The same launches on an H200-like device (a block per tile or nearly) and a one-SM GB10-like one (one to
    a few blocks, each looping over every tile): bit-identical, the grouped rows kernels too."""
    r = np.random.default_rng([53, bits])
    n_exp, k, nx, dim, ff, hc = 4, 2, 3, 128, 72, 4
    cb = codebook(r, bits)
    fmt, dg, _ = vq_tensor(r, bits, n_exp, ff, dim, cb)
    _, du, _ = vq_tensor(r, bits, n_exp, ff, dim, cb)
    _, dd, _ = vq_tensor(r, bits, n_exp, dim, 128, cb)
    x = (r.standard_normal((nx, dim)) * 2).astype(np.float32)
    ids = r.integers(0, n_exp, (nx, k)).astype(np.int32)
    ids[0], ids[2, 1] = [0, 1], -1                            # a bad id: NaN rows, nothing read
    wts = (r.random((nx, k)) + 0.2).astype(np.float32)
    h = r.standard_normal((nx * k, 128)).astype(np.float32)
    mix = r.random((nx, (2 + hc) * hc)).astype(np.float32)
    X = r.standard_normal((nx, hc, dim)).astype(np.float32)
    outs = []
    for dev in (kdev("random", 1), one_sm_gb10("reverse")):
        cg, cu, cd = dev.const(dg), dev.const(du), dev.const(dd)
        d_ids, d_w = dev.const(ids.reshape(-1)), dev.const(wts.reshape(-1))
        got = [dev.var(np.zeros((k, ff), np.float32)), dev.var(np.zeros((nx * k, ff), np.float32)),
               dev.var(np.zeros((hc, dim), np.float32)), dev.var(np.zeros((nx, dim), np.float32))]
        plans = [ops_moe.moe_gate_up(dev.rt,
                                     Experts(fmt=fmt, n_experts=n_exp, ff=ff, dim=dim, gate=cg, up=cu, clamp=0.5),
                                     dev.const(x[0].copy()), got[0], Slots(ids=d_ids, weights=d_w, k=k),
                                     rows_per_block=8),
                 ops_moe.moe_gate_up_rows(dev.rt,
                                          Experts(fmt=fmt, n_experts=n_exp, ff=ff, dim=dim, gate=cg, up=cu, clamp=0.5),
                                          TokenRows(x=dev.const(x.reshape(-1)), y=got[1], T=nx),
                                          Slots(ids=d_ids, weights=d_w, k=k), rows_per_block=8),
                 ops_moe.moe_down(dev.rt, Experts(fmt=fmt, n_experts=n_exp, ff=128, dim=dim, down=cd),
                                  TokenRows(x=dev.const(h), y=got[2]), Slots(ids=d_ids, k=k),
                                  hc=HcPost(dev.const(mix[0, hc:2 * hc].copy()), dev.const(mix[0, 2 * hc:].copy()),
                                            dev.const(X[0].copy())),
                                  rows_per_block=16),
                 ops_moe.moe_down_rows(dev.rt, Experts(fmt=fmt, n_experts=n_exp, ff=128, dim=dim, down=cd),
                                       TokenRows(x=dev.const(h), y=got[3], T=nx), Slots(ids=d_ids, k=k),
                                       rows_per_block=16)]
        ys, rings = (k, min(nx * k, n_exp + 1), 1, nx), (ops_moe.RING, 1, ops_moe.RING, 1)
        grids = [ops_moe._grid_x(dev.rt, fmt, -(-(ff if i < 2 else dim) // p.rows_per_block), ys[i], p.threads,
                                 ops_moe.launch_smem(fmt, p, rings[i])) for i, p in enumerate(plans)]
        if dev.rt.device.sm_count == 1:                    # every block loops over several tiles
            assert grids == [1, 1, 1, 1] if bits == 13 else max(grids) < 8, grids
        outs.append([g.download() for g in got])
    for name, a, b in zip(("gate_up", "gate_up_rows", "down", "down_rows"), *outs):
        same_bits(a, b, f"vq{bits} {name}")
    assert np.isfinite(outs[0][0]).all() and np.isnan(outs[0][3]).any()


def real_shapes() -> list[tuple[str, int, int, int, int]]:
    """(model, dim, expert_ff, n_experts, k) of V4 Flash and V4.1 Flash (MODEL.md §1, ds4py/config.py)."""
    out = []
    for name, make in (("V4 Flash", ModelConfig.v4_flash), ("V4.1 Flash", ModelConfig.v41_flash)):
        dim = {"V4 Flash": 4096, "V4.1 Flash": 5120}[name]
        cfg = make(n_layers=43, dim=dim, vocab_size=129280, n_heads=64, compress_ratios=[0] * 43)
        out.append((name, cfg.dim, cfg.expert_ff, cfg.n_experts, cfg.n_experts_used))
    return out


def test_every_vq_launch_fits_gb10_at_the_real_shapes():
    """The shared memory of every VQ-8 expert launch of cu/experts.cu (decode gate + up and down, the grouped rows
    pair; the down of a multi-row step is the decode one per row) at V4 Flash's and V4.1 Flash's shapes, every
    width: codebook + stage / sums + static shared memory <= GB10's 101,376 B per block (the emulator's H200-like
    device would run a bigger one). The static bytes and the prefill pair's (static tiles + codebook):
    tests/test_cuda_compile.py, from the ptxas report."""
    assert [n for n, *_ in real_shapes()] == ["V4 Flash", "V4.1 Flash"]
    assert {(d, f, e) for _, d, f, e, _ in real_shapes()} == {(4096, 2048, 256), (5120, 2304, 384)}
    for model, dim, ff, _, k in real_shapes():
        for bits in WIDTHS:
            fmt = vq_layout.kernel_format(bits, "test")
            plans = {"moe_gate_up": (ops_moe.gate_up_plan(fmt, dim, ff), ops_moe.RING),
                     "moe_down": (ops_moe.down_plan(fmt, ff, dim, k), ops_moe.RING),
                     "moe_gate_up_rows": (ops_moe.moe_rows_plan(fmt, dim, ff), 1),
                     "moe_down_rows": (ops_moe.moe_plan(fmt, ff, dim, k, 1), 1)}
            for name, (plan, ring) in plans.items():
                smem = ops_moe.launch_smem(fmt, plan, ring) + ops_moe.STATIC_RESERVE
                assert smem <= GB10_SMEM, f"{model}: {name}_{fmt} needs {smem:,} B of shared memory"
                assert plan.rows_per_block >= 1 and plan.threads <= 1024


def test_every_width_has_a_kernel_format():
    assert [vq_layout.kernel_format(b, "test") for b in WIDTHS] == [f"vq{b}" for b in WIDTHS]
    for b in WIDTHS:
        assert ops_moe.vq_bits(f"vq{b}") == b and ops_moe.codebook_bytes(f"vq{b}") == 8 << b
        assert ops_moe.vq_row_parts(f"vq{b}", 128) == (2 * (12 if b == 13 else b), 2 if b == 13 else 0)


@pytest.mark.parametrize("bits", [12, 13])
def test_down_rows_per_block_do_not_change_the_bits(kdev, bits):
    """moe_down's rows per block (ops picks fewer on GB10 so two VQ-8 down blocks share an SM) only regroup rows:
    every row's bits are the same at any rows per block, on either device."""
    r = np.random.default_rng([59, bits])
    n_exp, k, dim, ff = 4, 2, 128, 128
    cb = codebook(r, bits)
    fmt, dd, _ = vq_tensor(r, bits, n_exp, dim, ff, cb)
    ids = np.array([0, 3], np.int32)
    h = r.standard_normal((k, ff)).astype(np.float32)
    outs = []
    for dev in (kdev("random", 1), one_sm_gb10("reverse")):
        for rpb in (None, 16, 5, 1):
            y = dev.var(np.zeros(dim, np.float32))
            ops_moe.moe_down(dev.rt, Experts(fmt=fmt, n_experts=n_exp, ff=ff, dim=dim, down=dev.const(dd)),
                             TokenRows(x=dev.const(h.reshape(-1)), y=y), Slots(ids=dev.const(ids), k=k),
                             rows_per_block=rpb)
            outs.append(y.download())
    for i, o in enumerate(outs[1:], 1):
        same_bits(outs[0], o, f"vq{bits} down, launch {i}")
    assert np.isfinite(outs[0]).all()
