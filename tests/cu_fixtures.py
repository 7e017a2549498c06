"""Fixtures for the kernel tests that run on the CPU emulator (tests/test_cu_emu_<stage>.py): an EmuRuntime in
each thread order, its arena, and `put` to upload host arrays. tests/gpu/conftest.py builds the same arena and
put on a GPU runtime, and re-runs the same test functions there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from ds4py.cuda import emu

# The traffic profile (python -m ds4py.cuda.traffic) does not depend on the order threads run in (its warp
# requests are regrouped by instruction and pass): under it the twin tests run forward only.
ORDERS = ("forward",) if os.environ.get("DS4PY_EMU_TRAFFIC") else ("forward", "reverse", "random")

requires_emulator = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")
REPO = Path(__file__).resolve().parents[1]


def bench_on_emulator(script: str, out: Path) -> dict:
    """bench/<script> --emu --json out (its cut-down shapes on the CPU emulator): the JSON it wrote, once it exited
    0 and says it was emulated and measured the copy bandwidth."""
    r = subprocess.run([sys.executable, str(REPO / "bench" / script), "--emu", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["emulated"] and res["copy_GBps"] > 0
    return res


@contextmanager
def fresh_arena(rt: Any, weights_bytes: int, scratch_bytes: int) -> Iterator[Any]:
    """An arena on rt, in a step; closed (after the work on it finished) at exit."""
    a = rt.arena(weights_bytes=weights_bytes, scratch_bytes=scratch_bytes)
    a.begin_step()
    try:
        yield a
    finally:
        rt.synchronize()
        a.close()


def putter(arena: Any) -> Callable[..., Any]:
    """put(host, weights=True): upload a host array into the arena (weights region, or scratch)."""

    def put(host: np.ndarray, weights: bool = True):
        host = np.ascontiguousarray(host)
        d = arena.weights(host.shape, host.dtype) if weights else arena.scratch(host.shape, host.dtype)
        d.upload(host)
        return d

    return put


@pytest.fixture(params=ORDERS)
def rt(request):
    """Every launch also checks the PDL rule: no store to an argument and no return before pdl_wait()."""
    from ds4py.cuda.emu_runtime import EmuRuntime

    return EmuRuntime(order=request.param, seed=17, check_pdl=True)


@pytest.fixture
def arena(rt):
    with fresh_arena(rt, 48 << 20, 16 << 20) as a:
        yield a


@pytest.fixture
def put(arena):
    return putter(arena)


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng(list(seed))


GEMV_KINDS = ("F32", "F16", "Q8_0")


def gemv_weights(r: np.random.Generator, kind: str, rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
    """A random [rows, cols] matrix as the GEMV kernels take it: F32, F16, or Q8_0 / Q4_K blocks (one row of bytes
    each; Q4_K: cols % 256 == 0)."""
    from ds4py.cuda import twins

    Wf = (r.standard_normal((rows, cols)) * scale).astype(np.float32)
    if kind == "F32":
        return Wf
    if kind == "F16":
        return Wf.astype(np.float16)
    if kind == "Q4_K":
        from ds4py.quant import kquants
        return kquants.quant_q4_k(Wf.reshape(-1, 256)).reshape(rows, -1)
    return twins.quant_q8_0(Wf).reshape(rows, -1)


def check_gemv(got: np.ndarray, W: np.ndarray, x: np.ndarray, rows: int, cols: int, what: str, norm=None,
               x_group_rows: int = 0, base: np.ndarray | None = None) -> None:
    """A GEMV's y against its twin (ds4py/cuda/twins/gemv.py) within the fp32 rounding of its sums, scaled by
    sum |W x| (assert_close_scaled; with the RMSNorm prologue 4x that); base: what an accumulating launch added to."""
    from ds4py.cuda import twins
    from ds4py.cuda.twins import gemv as tg

    want = tg.gemv(W, x, rows, cols, norm=norm, x_group_rows=x_group_rows)
    xm = x if norm is None else tg.ref.rmsnorm(np.asarray(x, np.float32), norm[0], norm[1])
    mag = tg.magnitude(W, xm, rows, cols, x_group_rows)
    if base is not None:
        want, mag = want + base, mag + np.abs(base)
    twins.assert_close_scaled(got, want, mag, cols, what, factor=1.0 if norm is None else 4.0)


def check_several_matrices(rt: Any, arena: Any, put: Callable, r: np.random.Generator, kind: str, cols: int,
                           label: str, norms: list) -> None:
    """q_a + kv style: three `kind` matrices of 5, 12 and 7 rows share x in one launch, under each (device, host)
    RMSNorm prologue of `norms` (None: none); then an accumulating launch of the first. Draws from r in that order."""
    from ds4py.cuda import ops
    from ds4py.cuda.ops.gemv import GemvX

    shapes = [5, 12, 7]
    Ws = [gemv_weights(r, kind, n, cols) for n in shapes]
    x = (r.standard_normal(cols) * 3).astype(np.float32)
    nw = (1 + 0.1 * r.standard_normal(cols)).astype(np.float32)
    dx, dnw = put(x, False), put(nw)
    for norm_dev, norm_host in [(None, None), ((dnw, 1e-6), (nw, 1e-6))] + norms:
        ys = [arena.scratch(n, np.float32) for n in shapes]
        ops.gemv(rt, [(put(W), y, n) for W, y, n in zip(Ws, ys, shapes)], GemvX(dx, cols, norm=norm_dev), warps=2)
        for W, y, n in zip(Ws, ys, shapes):
            check_gemv(y.download(), W, x, n, cols, f"{label} multi {n}", norm=norm_host)
    base = r.standard_normal(shapes[0]).astype(np.float32)
    y = put(base, False)
    ops.gemv(rt, [(put(Ws[0]), y, shapes[0])], GemvX(dx, cols), add=True)
    check_gemv(y.download(), Ws[0], x, shapes[0], cols, f"{label} add", base=base)
