"""The IQ2_XXS encoder (ds4py.quant.iq2.quant_iq2_xxs, `convert --experts iq2_xxs`): ggml's algorithm, checked
byte for byte against blocks written by ggml's own quantize_iq2_xxs, against ds4py's and gguf's decoders, and on
the golden ds4-tiny file's IQ2_XXS blocks (ds4's layout)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from ds4py import quant
from ds4py.quant import iq2

# ggml's quantize_iq2_xxs (llama.cpp ggml/src/ggml-quants.c at ggml-org/ggml d99724f, built with gcc -O2,
# importance weights 1) on _inputs(): one 66-byte block per row
GGML_BLOCKS = bytes.fromhex(
    "9023d10e6ed4c2d816a27f9ab01bab9216aa1bdc97c5ef5f6eea605596988fa216ca255877899110a99e9abd39718eb6deaf1544d751fb4c"
    "34ff1f5595b7ae1b8a92d00cdd96211cb68c1fb4490089137e7c85c60772e9e04fdfc9928ad291007afaa5f18b1ca72d9de319b2bbb96f43"
    "940573721c77007090a897b286628b7a2fe1a29792201c000200118000f000000700004001600001001c800020720700001c800200b0006c"
    "00070000001000011100800100701cd30000006024e40000010080000080a7240000000000000000e983bede6869107058aa841f743d988b"
    "4c0527c983db29f1e2a026bf07215387ee3b5f8866cc2c909243f7911c727288e897d70d840215cf")


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(38)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[1] = rng.laplace(size=256).astype(np.float32) * 0.01           # heavy tails, small scale
    x[2] *= rng.random(256) < 0.15                                   # mostly zeros: ties among grid neighbours
    x[3, :32] = 0                                                    # an all-zero group
    return x


def test_bit_identical_to_ggml():
    got = quant.quantize(_inputs(), QT.IQ2_XXS)
    assert got.shape == (4, 66)
    assert bytes(got.reshape(-1)) == GGML_BLOCKS


def test_decodes_the_same_in_ds4py_and_gguf_and_round_trip_error_bounded():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 512)).astype(np.float32) * 0.02
    x[0, :256] = 0                                                   # all-zero super-block: zero bytes
    raw = quant.quantize(x, QT.IQ2_XXS)
    assert raw.shape == (64, quant.row_nbytes(QT.IQ2_XXS, 512))
    assert not raw[0, :66].any()
    y = quant.dequantize(raw, QT.IQ2_XXS, x.shape)
    assert np.array_equal(y, gq.dequantize(raw, QT.IQ2_XXS).reshape(x.shape))
    err = np.linalg.norm(y[1:] - x[1:]) / np.linalg.norm(x[1:])
    assert err < 0.36                                                # measured 0.344 (Q2_K: ~0.36 on such data)
    # signs: every 8 keeps its input signs except at most one (parity), never a large weight's
    wrong = (np.sign(y) != np.sign(x)) & (x != 0) & (y != 0)
    assert wrong.reshape(-1, 8).sum(1).max() <= 1


def test_importance_weights_lower_the_weighted_error():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 256)).astype(np.float32)
    qw = np.where(np.arange(256) % 8 == 0, 50.0, 1.0).astype(np.float32)
    plain = iq2.dequant_iq2_xxs(iq2.quant_iq2_xxs(x).reshape(-1)).reshape(x.shape)
    weighted = iq2.dequant_iq2_xxs(iq2.quant_iq2_xxs(x, np.broadcast_to(qw, x.shape)).reshape(-1)).reshape(x.shape)
    e = lambda y: float((qw * (y - x) ** 2).sum())                   # noqa: E731
    assert e(weighted) < 0.9 * e(plain)


def test_golden_ds4_blocks_re_encode_onto_their_grid_points(golden):
    """The golden ds4-tiny file's IQ2_XXS codes (random, ds4's layout): their decoded values re-encode onto the same
    grid points and sign patterns; only the scale differs (ggml's encoder models the grid's 8/25/43 as 1/3/5)."""
    from ds4py.gguf import GGUFFile

    t = GGUFFile(golden / "ds4-tiny" / "tiny.gguf").tensor("blk.0.ffn_gate_exps.weight")
    assert t.qtype == QT.IQ2_XXS
    raw = np.asarray(t.raw_bytes()).reshape(-1, 66)[:256]
    x = iq2.dequant_iq2_xxs(raw.reshape(-1))
    back = iq2.quant_iq2_xxs(x)
    a, b = (r[:, 2:].view("<u4").reshape(-1, 8, 2) for r in (raw, back))
    assert (a[..., 0] == b[..., 0]).mean() > 0.999                   # grid indices (measured 0.9998)
    assert np.array_equal(a[..., 1] & 0x0FFFFFFF, b[..., 1] & 0x0FFFFFFF)   # all sign patterns
    y = iq2.dequant_iq2_xxs(back.reshape(-1))
    assert np.linalg.norm(y - x) / np.linalg.norm(x) < 0.1           # measured 0.069
