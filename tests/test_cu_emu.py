"""The CPU emulator itself (cu/emu, ds4py/cuda/emu.py): indexing, barriers, shuffles, votes, atomics, dynamic
shared memory, cp.async, half/FP8 conversions against numpy, and the bugs it must report."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.args import KernelArgumentError

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")

SELFTEST = Path(__file__).parent / "emu_kernels" / "selftest.cu"
ORDERS = ("forward", "reverse", "random")


@pytest.fixture(scope="module")
def mod() -> emu.EmuModule:
    return emu.load(SELFTEST)


def warps(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1, 32)


@pytest.mark.parametrize("grid,block", [((3,), (5,)), ((2, 3), (4, 2)), ((2, 1, 2), (3, 2, 4)), ((1,), (1024,))])
def test_index3d(mod, grid, block):
    nb, nt = int(np.prod(grid)), int(np.prod(block))
    bl = np.full(nb * nt, -1, np.int32)
    tl = np.full(nb * nt, -1, np.int32)
    mod.launch("index3d", grid, block, [bl, tl])
    np.testing.assert_array_equal(bl, np.repeat(np.arange(nb), nt))
    np.testing.assert_array_equal(tl, np.tile(np.arange(nt), nb))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("block", [32, 96, 1024])
def test_barrier_orders_shared_memory(mod, block, order):
    x = np.arange(3 * block, dtype=np.int32)
    out = np.zeros_like(x)
    mod.launch("reverse_block", 3, block, [x, out, 1], order=order, seed=7)
    np.testing.assert_array_equal(out, x.reshape(3, block)[:, ::-1].reshape(-1))


def test_missing_barrier_shows_in_some_order(mod):
    # Without __syncthreads the result depends on which thread runs first; one of the orders must expose it.
    x = np.arange(64, dtype=np.int32)
    want = x[::-1]
    wrong = 0
    for order in ORDERS:
        out = np.zeros_like(x)
        mod.launch("reverse_block", 1, 64, [x, out, 0], order=order, seed=1)
        wrong += not np.array_equal(out, want)
    assert wrong >= 1


@pytest.mark.parametrize("n,block", [(100, 32), (64, 64), (37, 128)])
def test_dynamic_shared_memory(mod, n, block):
    x = np.random.default_rng(n).integers(0, 1000, 2 * n).astype(np.int32)
    out = np.zeros_like(x)
    mod.launch("reverse_dynamic", 2, block, [x, out, n], shared_mem=4 * n)
    np.testing.assert_array_equal(out, x.reshape(2, n)[:, ::-1].reshape(-1))


def shuffle_twin(v: np.ndarray, src: int, delta: int, width: int):
    """CUDA's documented shuffle semantics, per warp."""
    lane = np.arange(32)
    base = lane & ~(width - 1)
    out = []
    for w in warps(v):
        up = lane - delta
        down = lane + delta
        bfly = lane ^ (delta & 31)
        out.append((w[base + (src & (width - 1))],
                    np.where(up >= base, w[np.clip(up, 0, 31)], w),
                    np.where(down < base + width, w[np.clip(down, 0, 31)], w),
                    np.where(bfly < base + width, w[bfly], w)))
    return [np.concatenate(x) for x in zip(*out)]


@pytest.mark.parametrize("src,delta,width", [(0, 1, 32), (5, 3, 32), (37, 16, 32), (-1, 2, 8), (3, 5, 4),
                                             (1, 1, 1), (2, 4, 16)])
def test_shuffles(mod, src, delta, width):
    v = np.random.default_rng(src + 64).integers(-999, 999, 64).astype(np.int32)
    outs = [np.zeros_like(v) for _ in range(4)]
    mod.launch("shuffles", 2, 32, [v, *outs, src, delta, width], order="random", seed=src)
    for got, want, what in zip(outs, shuffle_twin(v, src, delta, width), ("idx", "up", "down", "xor")):
        np.testing.assert_array_equal(got, want, err_msg=what)


def test_shuffle_float_double_partial_mask(mod):
    f = np.arange(32, dtype=np.float32) + 0.5
    d = np.arange(32, dtype=np.float64) * 1e10
    fo, do = np.zeros_like(f), np.zeros_like(d)
    mask = 0x0000FFFF
    mod.launch("shuffle_types", 1, 32, [f, d, fo, do, mask])
    lane = np.arange(16)
    # lane 15 reads lane 16, outside the mask: undefined on the GPU, all-ones bits (NaN) here.
    np.testing.assert_array_equal(fo[:15], f[1:16])
    assert np.isnan(fo[15])
    np.testing.assert_array_equal(do[:16], d[lane ^ 1])
    np.testing.assert_array_equal(fo[16:], 0)


@pytest.mark.parametrize("order", ORDERS)
def test_disjoint_half_warps(mod, order):
    v = np.arange(64, dtype=np.int32) * 3
    out = np.zeros_like(v)
    mod.launch("half_warps", 1, 64, [v, out], order=order, seed=4)
    lane = np.arange(64) % 32
    down = np.where(lane % 16 < 15, np.roll(v, -1), v)     # width 16: the last lane of a group keeps its own
    up = np.where(lane % 16 > 0, np.roll(v, 1), v)
    np.testing.assert_array_equal(out, v + np.where(lane < 16, down, up))


@pytest.mark.parametrize("block", [32, 128])
def test_votes_and_syncthreads_count(mod, block):
    pred = (np.random.default_rng(block).random(2 * block) < 0.3).astype(np.int32)
    pred[:32] = 1                                      # one warp all true
    ballot, match = np.zeros(2 * block, np.uint32), np.zeros(2 * block, np.uint32)
    anyv, allv, count = (np.zeros(2 * block, np.int32) for _ in range(3))
    mod.launch("votes", 2, block, [pred, ballot, anyv, allv, match, count])
    bits = (1 << np.arange(32, dtype=np.uint64))
    for w, p in enumerate(warps(pred)):
        b = int((p.astype(np.uint64) * bits).sum())
        sl = slice(32 * w, 32 * w + 32)
        assert (ballot[sl] == b).all() and (anyv[sl] == int(p.any())).all() and (allv[sl] == int(p.all())).all()
        for lane in range(32):
            assert match[32 * w + lane] == int(((p == p[lane]).astype(np.uint64) * bits).sum())
    np.testing.assert_array_equal(count, np.repeat(pred.reshape(2, block).sum(1), block))


def test_warp_reductions(mod):
    v = np.random.default_rng(3).integers(0, 2**31, 64).astype(np.uint32)
    outs = [np.zeros_like(v) for _ in range(4)]
    mod.launch("warp_reduce", 1, 64, [v, *outs])
    w = warps(v).astype(np.uint64)
    want = [w.sum(1) % 2**32, w.min(1), w.max(1), np.bitwise_xor.reduce(w, axis=1)]
    for got, ref in zip(outs, want):
        np.testing.assert_array_equal(warps(got)[:, 0], ref)
        assert (warps(got) == warps(got)[:, :1]).all()


@pytest.mark.parametrize("order", ORDERS)
def test_atomics(mod, order):
    n = 300
    vals = np.random.default_rng(5).integers(0, 10_000, n).astype(np.int32)
    hist, vmax = np.zeros(16, np.int32), np.zeros(1, np.int32)
    slots, claimed, fsum = np.full(8, -1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.float32)
    mod.launch("atomics", 5, 64, [vals, n, hist, vmax, slots, claimed, fsum], order=order, seed=3)
    np.testing.assert_array_equal(hist, np.bincount(vals & 15, minlength=16))
    assert vmax[0] == vals.max() and fsum[0] == 0.5 * n
    assert claimed[0] == len(np.unique(vals & 7))
    for k, g in enumerate(slots):
        assert g == -1 if k not in (vals & 7) else (vals[g] & 7) == k


@pytest.mark.parametrize("wait", [1, 0])
def test_cp_async(mod, wait):
    x = np.arange(512, dtype=np.float32)
    out = np.zeros_like(x)
    mod.launch("cp_async_tile", 2, 64, [x, out, wait])
    want = x.reshape(2, 256)[:, ::-1].reshape(-1)
    if wait:
        np.testing.assert_array_equal(out, want)
    else:                    # copies land at the wait (or thread exit): threads read poison from the others' tile
        assert np.isnan(out).sum() > 256


# ---- the bugs it must report -----------------------------------------------------------------------------------

def test_barrier_divergence(mod):
    with pytest.raises(emu.EmuKernelError, match=r"barrier divergence.*selftest.cu:\d+"):
        mod.launch("bad_barrier", 1, 32, [np.zeros(32, np.int32)])


def test_warp_divergence(mod):
    with pytest.raises(emu.EmuKernelError, match="warp divergence"):
        mod.launch("bad_shuffle", 1, 32, [np.zeros(32, np.int32)])


def test_deadlock(mod):
    with pytest.raises(emu.EmuKernelError, match=r"deadlock.*threads 0-15 wait at __shfl_xor_sync.*"
                                                 r"threads 16-31 wait at __syncthreads"):
        mod.launch("deadlock", 1, 32, [np.zeros(32, np.int32)])


@pytest.mark.parametrize("order", ORDERS)
def test_exited_lane_in_mask(mod, order):
    with pytest.raises(emu.EmuKernelError, match="exited"):
        mod.launch("exited_lane", 1, 32, [np.zeros(32, np.int32)], order=order)


def test_mask_naming_missing_lanes(mod):
    with pytest.raises(emu.EmuKernelError, match="lanes that do not exist"):
        mod.launch("shuffles", 1, 48, [np.zeros(48, np.int32)] * 5 + [0, 1, 32])


def test_out_of_bounds_read_names_the_argument(mod):
    x, y = np.ones(64, np.float32), np.zeros(64, np.float32)
    with pytest.raises(emu.EmuKernelError, match=r"thread \(31,0,0\) of block \(1,0,0\).*past the end of argument 'x'"):
        mod.launch("read_past_end", 2, 32, [x, y, 64])
    assert (y == 0).all()                              # nothing copied back from a failed launch


def test_write_through_const_pointer(mod):
    with pytest.raises(emu.EmuKernelError, match="write to const argument 'x'"):
        mod.launch("write_const", 1, 4, [np.zeros(4, np.float32), np.zeros(4, np.float32)])


def test_write_into_padding(mod):
    with pytest.raises(emu.EmuKernelError, match="wrote past the end of argument 'y'"):
        mod.launch("write_padding", 1, 16, [np.zeros(13, np.float32), 13])


def test_stack_overflow(mod):
    with pytest.raises(emu.EmuKernelError, match="stack overflow"):
        mod.launch("stack_overflow", 1, 2, [np.zeros(2, np.int32), 100_000])
    out = np.zeros(2, np.int32)
    mod.launch("stack_overflow", 1, 2, [out, 3])      # the emulator is usable after a fault
    assert (out == 3 + 2 + 1).all()


def test_bad_launches(mod):
    z = np.zeros(32, np.int32)
    with pytest.raises(emu.EmuKernelError, match="exceeds the CUDA limits"):
        mod.launch("index3d", 1, 2048, [z, z.copy()])
    with pytest.raises(emu.EmuKernelError, match="dynamic shared memory"):
        mod.launch("reverse_dynamic", 1, 32, [z, z.copy(), 8], shared_mem=1 << 20)
    with pytest.raises(KernelArgumentError, match="takes 3 arguments"):
        mod.launch("reverse_block", 1, 32, [z, z])
    with pytest.raises(KernelArgumentError, match="declared int\\* but the buffer holds float32"):
        mod.launch("reverse_block", 1, 32, [z.astype(np.float32), z, 1])
    with pytest.raises(KernelArgumentError, match="does not fit"):
        mod.launch("reverse_block", 1, 32, [z, z.copy(), 2**40])
    with pytest.raises(KernelArgumentError, match="overlaps"):
        big = np.zeros(64, np.int32)
        mod.launch("reverse_block", 1, 32, [big[:32], big[16:48], 1])
    with pytest.raises(KernelArgumentError, match="no kernel"):
        mod.launch("nope", 1, 1, [])


def test_launch_bounds_and_division_by_zero(mod):
    out = np.zeros(64, np.int32)
    mod.launch("bounded", 1, 64, [out, 4])
    assert (out == 25).all()
    with pytest.raises(emu.EmuKernelError, match=r"exceeds its __launch_bounds__\(64\)"):
        mod.launch("bounded", 1, 65, [np.zeros(65, np.int32), 4])
    with pytest.raises(emu.EmuKernelError, match="division by zero"):
        mod.launch("bounded", 1, 8, [out, 0])


def test_same_array_twice_is_one_buffer(mod):
    x = np.arange(64, dtype=np.int32)
    mod.launch("reverse_dynamic", 1, 32, [x, x, 64], shared_mem=256)  # reads all before the barrier, then writes
    np.testing.assert_array_equal(x, np.arange(64)[::-1])


# ---- conversions against numpy ---------------------------------------------------------------------------------

def fp8_table(ebits: int, mbits: int) -> np.ndarray:
    """Value of every FP8 code (OCP e4m3fn / e5m2), from the format definition."""
    bias = (1 << (ebits - 1)) - 1
    codes = np.arange(256)
    s = np.where(codes & 0x80, -1.0, 1.0)
    e = (codes >> mbits) & ((1 << ebits) - 1)
    m = codes & ((1 << mbits) - 1)
    val = np.where(e == 0, m * 2.0 ** (1 - bias - mbits), (1 + m / 2**mbits) * 2.0 ** (e - bias))
    val = s * val
    if ebits == 4:
        val[(e == 15) & (m == 7)] = np.nan
    else:
        val[(e == 31) & (m == 0)] = s[(e == 31) & (m == 0)] * np.inf
        val[(e == 31) & (m != 0)] = np.nan
    return val


def fp8_encode_twin(f: np.ndarray, ebits: int, mbits: int) -> np.ndarray:
    """Nearest FP8 code, ties to the even code, saturating at the largest finite value, NaN -> 0x7f."""
    table = fp8_table(ebits, mbits)
    maxcode = 0x7E if ebits == 4 else 0x7B
    pos = table[: maxcode + 1]
    a = np.abs(f.astype(np.float64))
    hi = np.clip(np.searchsorted(pos, a), 0, maxcode)
    lo = np.clip(hi - 1, 0, maxcode)
    dlo, dhi = a - pos[lo], pos[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(a >= pos[maxcode], maxcode, pick)
    code = pick | np.where(np.signbit(f), 0x80, 0)
    return np.where(np.isnan(f), 0x7F, code).astype(np.uint8)


def conversion_inputs() -> np.ndarray:
    rng = np.random.default_rng(11)
    parts = [rng.standard_normal(2000) * s for s in (1e-4, 1e-2, 1, 100, 1e4)]
    for eb, mb in ((4, 3), (5, 2)):                    # every FP8 value and every midpoint (the ties)
        t = fp8_table(eb, mb)
        t = np.sort(t[np.isfinite(t) & (t >= 0)])
        parts += [t, -t, (t[1:] + t[:-1]) / 2, np.nextafter((t[1:] + t[:-1]) / 2, 0)]
    h = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)   # finite halves and midpoints
    parts += [h, -h, (h[1:] + h[:-1]) / 2]
    parts.append(np.array([0.0, -0.0, 448, 464, 480, 500, 57344, 61440, 1e6, 65504, 65519.99, 65520,
                           np.inf, -np.inf, np.nan, 2.0**-10, 2.0**-17, 1e-45]))
    return np.concatenate(parts).astype(np.float32)


def test_half_and_fp8_conversions(mod):
    f = conversion_inputs()
    n = len(f)
    h, hf = np.zeros(n, np.float16), np.zeros(n, np.float32)
    e4, e5 = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
    codes = np.arange(256, dtype=np.uint8)
    d4, d5 = np.zeros(256, np.float32), np.zeros(256, np.float32)
    h4, h5 = np.zeros(512, np.float16), np.zeros(512, np.float16)
    mod.launch("conversions", 8, 128, [f, n, h, hf, e4, e5, codes, d4, d5, h4, h5])

    with np.errstate(over="ignore"):
        want_h = f.astype(np.float16)
    nan = np.isnan(f)
    np.testing.assert_array_equal(h.view(np.uint16)[~nan], want_h.view(np.uint16)[~nan])
    assert np.isnan(h[nan]).all()
    np.testing.assert_array_equal(hf, h.astype(np.float32))

    for got, eb, mb, dec, pair in ((e4, 4, 3, d4, h4), (e5, 5, 2, d5, h5)):
        want = fp8_encode_twin(f, eb, mb)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, f"e{eb}m{mb}: {bad.size} wrong, first {f[bad[0]]!r} -> {got[bad[0]]:#x} not {want[bad[0]]:#x}"
        table = fp8_table(eb, mb).astype(np.float32)
        np.testing.assert_array_equal(dec, table)        # NaN positions compare equal
        np.testing.assert_array_equal(pair.reshape(256, 2)[:, 0], table.astype(np.float16))
        np.testing.assert_array_equal(pair.reshape(256, 2)[:, 1], table[::-1].astype(np.float16))


def test_ucontext_fallback(tmp_path, monkeypatch):
    # Non-x86-64 hosts switch fibers with swapcontext; build that path here too.
    monkeypatch.setenv("DS4PY_CACHE_DIR", str(tmp_path))
    m = emu.EmuModule(SELFTEST, extra_flags=("-DDS4_EMU_UCONTEXT",))
    x = np.arange(128, dtype=np.int32)
    out = np.zeros_like(x)
    m.launch("reverse_block", 2, 64, [x, out, 1], order="random", seed=2)
    np.testing.assert_array_equal(out, x.reshape(2, 64)[:, ::-1].reshape(-1))
    with pytest.raises(emu.EmuKernelError, match="deadlock"):
        m.launch("deadlock", 1, 32, [np.zeros(32, np.int32)])


def test_cache_reuses_the_library(mod, tmp_path, monkeypatch):
    monkeypatch.setenv("DS4PY_CACHE_DIR", str(tmp_path))
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void fill(int* o, int v) { o[threadIdx.x] = v; }\n')
    m1 = emu.EmuModule(src)
    assert m1.path.parent == tmp_path / "emu"
    assert emu.build(src)[0] == m1.path               # same source: same cached file
    out = np.zeros(8, np.int32)
    m1.launch("fill", 1, 8, [out, 5])
    assert (out == 5).all()
    src.write_text('extern "C" __global__ void fill(int* o, int v) { o[threadIdx.x] = v + 1 }\n')
    with pytest.raises(emu.EmuCompileError, match=r"k.cu:1.*expected"):
        emu.EmuModule(src)


@pytest.mark.parametrize("grid,block", [(1, 32), (2, 64)])
def test_mma_tile(mod, grid, block):
    tiles = grid * block // 32
    r = np.random.default_rng(tiles)
    A = r.standard_normal((tiles, 16, 16)).astype(np.float16)
    B = r.standard_normal((tiles, 16, 8)).astype(np.float16)
    C = r.standard_normal((tiles, 16, 8)).astype(np.float32)
    D = np.zeros_like(C)
    mod.launch("mma_tile", grid, block, [A, B, C, D], order="random", seed=1)
    want = (A.astype(np.float64) @ B.astype(np.float64) + C).astype(np.float32)
    np.testing.assert_array_equal(D, want)             # the emulator sums in double and rounds once


@pytest.mark.parametrize("grid,block", [(1, 32), (2, 64)])
def test_ldsm_x4_gives_the_mma_fragments(mod, grid, block):
    """portable.cuh ldsm_x4 (ldmatrix .x4): lane l gets, of matrix j (the quadrant whose rows lanes 8j .. 8j + 7
    named), the two values at row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1; a row address off 16 bytes is refused
    as the device would fault."""
    tiles = grid * block // 32
    M = np.random.default_rng(tiles).integers(0, 1 << 16, (tiles, 16, 16), dtype=np.uint16)
    out = np.zeros((tiles, 32, 4), np.uint32)
    mod.launch("ldsm_tile", grid, block, [M, out, 0], order="random", seed=2)
    lane = np.arange(32)
    for j in range(4):
        rows, cols = lane // 4 + 8 * (j & 1), 8 * (j >> 1) + 2 * (lane % 4)
        want = M[:, rows, cols].astype(np.uint32) | (M[:, rows, cols + 1].astype(np.uint32) << 16)
        np.testing.assert_array_equal(out[:, :, j], want)
    with pytest.raises(emu.EmuKernelError, match="16-byte aligned"):
        mod.launch("ldsm_tile", 1, 32, [M[:1], out[:1], 1])


def test_rewrite_source_only_touches_dynamic_shared_declarations():
    src = ("// extern __shared__ in a comment\n"
           "/* and\n here */ __shared__ float s[32];\n"
           "extern __shared__ float table[];\n"
           "__global__ void k() {\n"
           "    extern __shared__ __align__(16) uint8_t stage[]; // tail\n"
           "}\n")
    out, file_scope = emu.rewrite_source(src)
    assert file_scope == ["table"]
    assert out.count("\n") == src.count("\n")          # line numbers kept
    assert "__shared__ float s[32];" in out and "extern  float table[];" in out
    assert "__align__(16) uint8_t (&stage)[] = *reinterpret_cast<" in out


def test_dynamic_shared_memory_overrun(mod):
    x = np.arange(64, dtype=np.int32)
    with pytest.raises(emu.EmuKernelError, match=r"0 bytes past the end of dynamic shared memory \(128 bytes\)"):
        mod.launch("reverse_dynamic", 1, 32, [x, np.zeros_like(x), 64], shared_mem=128)
    with pytest.raises(emu.EmuKernelError, match=r"past the end of dynamic shared memory \(0 bytes\)"):
        mod.launch("reverse_dynamic", 1, 32, [x, np.zeros_like(x), 64])


def test_file_scope_dynamic_shared_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("DS4PY_CACHE_DIR", str(tmp_path))
    src = tmp_path / "fs.cu"
    src.write_text("extern __shared__ int fs[];\n"
                   'extern "C" __global__ void rev(const int* x, int* y) {\n'
                   "    fs[threadIdx.x] = x[threadIdx.x];\n"
                   "    __syncthreads();\n"
                   "    y[threadIdx.x] = fs[blockDim.x - 1 - threadIdx.x];\n"
                   "}\n")
    x = np.arange(40, dtype=np.int32)
    y = np.zeros_like(x)
    emu.EmuModule(src).launch("rev", 1, 40, [x, y], shared_mem=160)
    np.testing.assert_array_equal(y, x[::-1])
