"""VQ-8 experts (cu/experts.cu's moe_*_vq12 / vq13 entry points, the device layout of ds4py/cuda/vq_layout.py)
under the CPU emulator against the twin (the reference's exact decode fl32(g * c), then the products): the routed
gate + up + SwiGLU and the down sum with its add and hc_post epilogues at 12 bits and 12 + 1 bits, and the grouped
rows kernels bit-identical to the one-token ones."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu, vq_layout
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.twins import experts as twin
from ds4py.cuda.twins.core import assert_close_scaled
from ds4py.quant import vq
from tests.cu_emu_device import devices

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
kdev = pytest.fixture(devices, name="kdev")


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


@pytest.mark.parametrize("bits,dim,ff,order", [(12, 256, 40, "forward"), (13, 128, 33, "random")])
def test_gate_up_and_down(kdev, bits, dim, ff, order):
    r = np.random.default_rng([51, bits])
    n_exp, slots, hc = 5, 3, 4
    cb = codebook(r, bits)
    fmt, dg, Wg = vq_tensor(r, bits, n_exp, ff, dim, cb)
    _, du, Wu = vq_tensor(r, bits, n_exp, ff, dim, cb)
    ff_d = 128                                             # down: rows dim, columns ff_d (a multiple of 64)
    _, dd, Wd = vq_tensor(r, bits, n_exp, dim, ff_d, cb)
    x = (r.standard_normal(dim) * 2).astype(np.float32)
    ids = r.integers(0, n_exp, slots).astype(np.int32)
    wts = (r.random(slots) + 0.2).astype(np.float32)
    dev = kdev(order, dim)
    d_h = dev.var(np.full((slots, ff), np.nan, np.float32))
    ops_moe.moe_gate_up(dev.rt, fmt, dev.const(dg), dev.const(du), dev.const(x), dev.const(ids), dev.const(wts), d_h,
                        n_exp, ff, dim, slots, 0.5)
    want, mag = twin.gate_up(Wg, Wu, x, ids, wts, 0.5, slots)
    assert_close_scaled(d_h.download(), want, mag, dim, f"vq{bits} gate_up")
    h = r.standard_normal((slots, ff_d)).astype(np.float32)
    add = r.standard_normal(dim).astype(np.float32)
    post, comb = (r.random(hc) * 2).astype(np.float32), r.random((hc, hc)).astype(np.float32)
    X = r.standard_normal((hc, dim)).astype(np.float32)
    d_out = dev.var(np.full((hc, dim), np.nan, np.float32))
    ops_moe.moe_down(dev.rt, fmt, dev.const(dd), dev.const(ids), dev.const(h), d_out, n_exp, dim, ff_d, slots,
                     add=dev.const(add), hc_post=dev.const(post), hc_comb=dev.const(comb), hc_x=dev.const(X))
    want, mag = twin.down(Wd, ids, h, slots, add, post, comb, X)
    assert_close_scaled(d_out.download(), want, mag, ff_d * slots + hc, f"vq{bits} down")


@pytest.mark.parametrize("bits", [12, 13])
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
    ops_moe.moe_gate_up_rows(dev.rt, fmt, cg, cu, dev.const(x.reshape(-1)), d_ids, d_w, d_h, n_exp, ff, dim, k, nx,
                             0.5)
    d_out = dev.var(np.zeros((nx, hc, dim), np.float32))
    ops_moe.moe_down_rows(dev.rt, fmt, cd, d_ids, d_h, d_out, n_exp, dim, ff, k, nx, mix=dev.const(mix.reshape(-1)),
                          hc=hc, hc_x=dev.const(X.reshape(-1)))
    h, out = d_h.download(), d_out.download()
    for n in range(nx):
        one = dev.var(np.zeros((k, ff), np.float32))
        rid = dev.const(ids[n].copy())
        ops_moe.moe_gate_up(dev.rt, fmt, cg, cu, dev.const(x[n].copy()), rid, dev.const(wts[n].copy()), one, n_exp,
                            ff, dim, k, 0.5)
        same_bits(h[n * k:(n + 1) * k], one.download(), f"vq{bits} gate_up row {n}")
        y1 = dev.var(np.zeros((hc, dim), np.float32))
        ops_moe.moe_down(dev.rt, fmt, cd, rid, one, y1, n_exp, dim, ff, k, hc_post=dev.const(mix[n, hc:2 * hc].copy()),
                         hc_comb=dev.const(mix[n, 2 * hc:].copy()), hc_x=dev.const(X[n].copy()))
        same_bits(out[n], y1.download(), f"vq{bits} down row {n}")
    Wg0 = Wg[ids[0, 0]]
    assert np.isfinite(Wg0).all()


def test_other_widths_are_refused_in_one_sentence():
    from ds4py.model import UnsupportedByBackend

    with pytest.raises(UnsupportedByBackend, match="8-bit VQ-8 experts; the CUDA kernels read 12 and 13-bit"):
        vq_layout.kernel_format(8, "blk.3.ffn_up_exps.weight")
