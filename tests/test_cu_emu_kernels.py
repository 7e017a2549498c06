"""Every kernel in cu/*.cu against its numpy twin (ds4py/cuda/twins.py) through the CPU emulator: tiny shapes,
several launch geometries and thread orders. A kernel without a test here fails test_every_kernel_is_covered."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu, twins
from ds4py.cuda.signature import parse_kernels

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")

Q8_STAGE_BYTES = 128 * 34 + 16          # per warp, = Q8_STAGE_BYTES in cu/gemv.cu
COVERED = {"rmsnorm_f32", "gemv_f16", "gemv_q8_0", "embed_f16", "argmax_partial", "argmax_final"}
# tested in tests/test_cu_emu_{attention,compressor,indexer,topk,router,experts}.py
COVERED |= {"attn_kv_store", "attn_decode_partial", "attn_decode_combine", "compressor_decode",
            "compressor_prefill_pool", "compressor_prefill_store", "indexer_q_prep", "indexer_scores",
            "topk_radix_select", "moe_route"} | {f"moe_{k}_{f}" for k in ("gate_up", "down", "dequant")
                                                 for f in ("iq2_xxs", "q2_k", "q4_k", "mxfp4", "q8_0", "f16")}


def module(stem: str) -> emu.EmuModule:
    return emu.load(emu.CU_DIR / f"{stem}.cu")


def rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng(list(seed))


def test_every_kernel_is_covered():
    kernels = {k for f in sorted(emu.CU_DIR.glob("*.cu")) for k in parse_kernels(f.read_text())}
    missing = sorted(kernels - COVERED)
    assert not missing, f"kernels without an emulator test against a numpy twin: {', '.join(missing)}"


@pytest.mark.parametrize("rows,n,block", [(1, 1, 32), (3, 100, 64), (2, 1000, 256), (2, 3000, 1024)])
@pytest.mark.parametrize("weight", [True, False])
def test_rmsnorm(rows, n, block, weight):
    r = rng(rows, n, block)
    x = (r.standard_normal((rows, n)) * 3).astype(np.float32)
    w = r.standard_normal(n).astype(np.float32) if weight else None
    y = np.zeros_like(x)
    module("rmsnorm").launch("rmsnorm_f32", rows, block, [x, w, y, n, 1e-6], order="random", seed=n)
    twins.assert_close_scaled(y, twins.rmsnorm(x, w, 1e-6), np.abs(twins.rmsnorm(x, w, 1e-6)), n, "rmsnorm")


def test_rmsnorm_in_place():
    x = rng(9).standard_normal((2, 256)).astype(np.float32)
    want = twins.rmsnorm(x, None, 1e-5)
    module("rmsnorm").launch("rmsnorm_f32", 2, 128, [x, None, x, 256, 1e-5])
    twins.assert_close_scaled(x, want, np.abs(want), 256, "rmsnorm in place")


# grid None: one block per `warps` rows; an int: fewer blocks, so warps loop over rows.
GEMV_CASES = [(1, 8, 1, None), (5, 136, 1, None), (37, 264, 3, None), (37, 264, 3, 2), (64, 1024, 8, None),
              (19, 520, 4, 1)]


@pytest.mark.parametrize("rows,cols,warps,grid", GEMV_CASES)
def test_gemv_f16(rows, cols, warps, grid):
    r = rng(rows, cols, warps)
    W = r.standard_normal((rows, cols)).astype(np.float16)
    x = r.standard_normal(cols).astype(np.float32)
    y = np.full(rows, np.nan, np.float32)
    module("gemv").launch("gemv_f16", grid or -(-rows // warps), 32 * warps, [W, x, y, rows, cols],
                          order="random", seed=rows)
    mag = np.abs(W.astype(np.float64)) @ np.abs(x.astype(np.float64))
    twins.assert_close_scaled(y, twins.gemv_f16(W, x), mag, cols, "gemv_f16")


def q8_0_weights(r: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random Q8_0 rows: f16 scale then 32 int8 quants per 34-byte block."""
    blocks = np.empty((rows * cols // 32, 34), np.uint8)
    blocks[:, :2] = (r.random((len(blocks), 1)) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    blocks[:, 2:] = r.integers(-128, 128, (len(blocks), 32)).astype(np.int8).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("rows,cols,warps,grid", [(1, 32, 1, None), (7, 96, 2, None), (13, 256, 4, 2),
                                                   (9, 4160, 2, None), (33, 512, 8, 3)])
def test_gemv_q8_0(rows, cols, warps, grid):
    r = rng(rows, cols, warps, 1)
    W = q8_0_weights(r, rows, cols)
    x = r.standard_normal(cols).astype(np.float32)
    y = np.full(rows, np.nan, np.float32)
    module("gemv").launch("gemv_q8_0", grid or -(-rows // warps), 32 * warps, [W, x, y, rows, cols],
                          shared_mem=warps * Q8_STAGE_BYTES, order="random", seed=cols)
    mag = np.abs(twins.q8_0_matrix(W, rows, cols).astype(np.float64)) @ np.abs(x.astype(np.float64))
    twins.assert_close_scaled(y, twins.gemv_q8_0(W, x, rows, cols), mag, cols, "gemv_q8_0")


@pytest.mark.parametrize("dim,block", [(1, 32), (40, 32), (300, 128), (64, 1024)])
def test_embed_f16(dim, block):
    r = rng(dim, block)
    vocab = 50
    table = r.standard_normal((vocab, dim)).astype(np.float16)
    ids = np.array([0, 49, 7, -1, 50, 7, 23], np.int32)
    out = np.zeros((len(ids), dim), np.float32)
    module("embed").launch("embed_f16", len(ids), block, [table, ids, out, dim, vocab], order="reverse")
    np.testing.assert_array_equal(out, twins.embed_f16(table, ids))   # a copy: bit-exact, NaN rows included


def argmax_inputs() -> list[np.ndarray]:
    r = rng(4)
    ties = np.zeros(700, np.float32)
    ties[[13, 400, 699]] = 5.0
    nan = r.standard_normal(500).astype(np.float32)
    nan[[321, 77]] = np.nan
    neg = np.full(97, -np.inf, np.float32)
    neg[60] = -1e30
    return [r.standard_normal(1).astype(np.float32), r.standard_normal(5000).astype(np.float32), ties, nan, neg,
            np.full(33, -np.inf, np.float32)]


@pytest.mark.parametrize("parts,block,final_block", [(1, 32, 32), (4, 64, 32), (7, 256, 64), (16, 1024, 1024)])
def test_argmax(parts, block, final_block):
    mod = module("argmax")
    for x in argmax_inputs():
        pv, pi = np.zeros(parts, np.float32), np.zeros(parts, np.int32)
        out = np.full(1, -7, np.int32)
        mod.launch("argmax_partial", parts, block, [x, len(x), pv, pi], order="random", seed=len(x))
        mod.launch("argmax_final", 1, final_block, [pv, pi, parts, out], order="reverse")
        assert out[0] == twins.argmax(x), f"n={len(x)}"
