"""ds4py.quant against ggml's reference decoders (gguf.quants), documented formulas and the v4-tiny checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from ds4py import quant
from ds4py.quant import official
from ds4py.quant.mxfp4 import mxfp4_from_official

GGUF_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q2_K, QT.Q4_K, QT.IQ2_XXS, QT.MXFP4]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qt", GGUF_TYPES, ids=lambda q: q.name)
def test_random_blocks_bit_exact_vs_ggml(qt):
    # random bytes reach every code, scale, sign pattern, and also NaN / inf halves
    rng = np.random.default_rng(int(qt))
    rows, cols = 24, 1024
    raw = rng.integers(0, 256, size=(rows, quant.row_nbytes(qt, cols)), dtype=np.uint8)
    with np.errstate(all="ignore"):
        got = quant.dequantize(raw, qt, (rows, cols))
        ref = gq.dequantize(raw, qt).reshape(rows, cols)
    assert same_bits(got, ref)


def test_every_tensor_of_ds4_tiny_bit_exact(golden):
    from ds4py.gguf import GGUFFile

    f = GGUFFile(golden / "ds4-tiny" / "tiny.gguf")
    seen = set()
    for t in f.tensors.values():
        if t.qtype == QT.I32:
            continue
        seen.add(t.qtype)
        got = quant.dequantize(t.raw_bytes(), t.qtype, t.shape)
        assert same_bits(got, gq.dequantize(t.raw_bytes(), t.qtype).reshape(t.shape)), t.name
    assert seen == {QT.F32, QT.F16, QT.Q8_0, QT.Q2_K, QT.IQ2_XXS}


@pytest.mark.parametrize("qt", GGUF_TYPES, ids=lambda q: q.name)
def test_row_slices_match_the_whole(qt):
    rng = np.random.default_rng(7)
    shape = (3, 10, 512)                       # experts x rows x cols, like ffn_*_exps
    raw = rng.integers(0, 256, size=(3, 10, quant.row_nbytes(qt, 512)), dtype=np.uint8)
    if qt in (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q2_K, QT.Q4_K, QT.IQ2_XXS):
        raw[..., :] = rng.integers(0, 256, size=raw.shape, dtype=np.uint8) & 0x3F   # keep halves finite
    with np.errstate(all="ignore"):
        whole = quant.dequantize(raw, qt, shape)
        assert same_bits(quant.dequantize(raw[1, 3:7], qt, (4, 512)), whole[1, 3:7])
        assert same_bits(quant.dequantize(raw[2], qt, (10, 512)), whole[2])


def test_row_nbytes_and_bad_input():
    assert quant.row_nbytes(QT.Q8_0, 4096) == 128 * 34
    assert quant.row_nbytes(QT.Q4_K, 4096) == 16 * 144
    assert quant.row_nbytes(QT.Q2_K, 256) == 84
    assert quant.row_nbytes(QT.IQ2_XXS, 512) == 132
    assert quant.row_nbytes(QT.MXFP4, 64) == 34
    with pytest.raises(ValueError, match="multiple of the block size 256"):
        quant.row_nbytes(QT.Q4_K, 100)
    with pytest.raises(ValueError, match="Q5_K is not supported"):
        quant.dequantize(np.zeros(176, np.uint8), QT.Q5_K, (1, 256))
    with pytest.raises(ValueError, match="expected 34"):
        quant.dequantize(np.zeros(35, np.uint8), QT.Q8_0, (1, 32))


# ----------------------------------------------------------------------------------------------- official formats
def e4m3_by_bits(c: int) -> float:
    """Independent decode: build the float32 bit pattern (normal) or scale the integer mantissa (subnormal)."""
    s, e, m = c >> 7, (c >> 3) & 15, c & 7
    if e == 15 and m == 7:
        return float("nan")
    if e == 0:
        v = np.ldexp(float(m), -9)
    else:
        v = float(np.array([((e - 7 + 127) << 23) | (m << 20)], np.uint32).view(np.float32)[0])
    return -v if s else v


def test_e4m3_all_256_codes():
    got = official.e4m3_to_f32(np.arange(256, dtype=np.uint8))
    ref = np.array([e4m3_by_bits(c) for c in range(256)], np.float32)
    assert np.array_equal(got, ref, equal_nan=True)
    assert np.isnan(got[[0x7F, 0xFF]]).all() and np.isnan(got).sum() == 2     # fn variant: no inf, 2 NaNs
    assert got[0x7E] == 448 and got[0xFE] == -448                             # max finite
    assert got[0x38] == 1.0 and got[0x01] == 2.0 ** -9 and got[0x08] == 2.0 ** -6 and got[0x80] == 0


def test_e8m0_and_e2m1_tables():
    e = official.e8m0_to_f32(np.array([0, 1, 120, 127, 128, 254, 255], np.uint8))
    assert list(e[:6]) == [2.0 ** -127, 2.0 ** -126, 2.0 ** -7, 1.0, 2.0, 2.0 ** 127] and np.isnan(e[6])
    mags = [0, .5, 1, 1.5, 2, 3, 4, 6]
    assert list(official.E2M1) == mags + [-m for m in mags]


def test_fp4_nibble_order_and_scale():
    packed = np.array([[0x21, 0x9F] + [0] * 14], np.uint8)         # 32 values, one e8m0 scale
    w = official.dequant_fp4(packed, np.array([[128]], np.uint8))   # scale 2
    assert list(w[0, :4]) == [1.0, 2.0, -12.0, -1.0]                # low nibble = even element


def test_fp8_tiles_with_partial_edges():
    rng = np.random.default_rng(3)
    w = rng.integers(0, 256, size=(130, 200), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0
    s = rng.integers(110, 140, size=(2, 2), dtype=np.uint8)
    assert official.fp8_block_size(w.shape, s.shape) == 128
    got = official.dequant_fp8(w, s)
    i, j = np.indices(w.shape)
    ref = np.vectorize(e4m3_by_bits)(w).astype(np.float32) * np.ldexp(1.0, s[i // 128, j // 128].astype(int) - 127)
    assert np.array_equal(got, ref.astype(np.float32))
    # V4.1-style 32x32 tiles are recognised from the shapes too
    assert official.fp8_block_size((64, 96), (2, 3)) == 32


def test_v4_tiny_checkpoint_decodes_to_documented_magnitudes(golden):
    """README: FP8 tile scale = 2^ceil(log2(amax/448)), FP4 group scale = 2^ceil(log2(amax/6)), master
    weights N(0,1)*fan_in^-0.5*gain. So each decoded tile's amax lies in [scale*224, scale*448] and each
    FP4 group's in [scale*3, scale*6] (the bounds after rounding); the decoded std matches gain/sqrt(fan_in)."""
    from ds4py.convert import Checkpoint

    ck = Checkpoint(str(golden / "v4-tiny"))
    w = ck.floats("layers.3.attn.wq_a.weight")                     # [64, 256], tiles 128x128 -> [1, 2]
    s = official.e8m0_to_f32(ck.raw("layers.3.attn.wq_a.scale"))
    for tj in range(2):
        amax = np.abs(w[:, 128 * tj: 128 * (tj + 1)]).max()
        assert s[0, tj] * 224 <= amax <= s[0, tj] * 448
    assert abs(w.std() * 16 - 1) < 0.1
    e = ck.floats("layers.4.ffn.experts.5.w1.weight")              # [96, 256] FP4, gain 1.5
    es = official.e8m0_to_f32(ck.raw("layers.4.ffn.experts.5.w1.scale"))
    amax = np.abs(e.reshape(96, 8, 32)).max(axis=2)
    assert ((es * 3 <= amax) & (amax <= es * 6)).all() and (amax > es * 3).mean() > 0.5
    assert abs(e.std() * 16 / 1.5 - 1) < 0.1
    d = ck.floats("layers.4.ffn.experts.5.w2.weight")              # [256, 96], fan_in 96
    assert abs(d.std() * np.sqrt(96) - 1) < 0.1


def test_mxfp4_repack_is_lossless():
    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, size=(8, 64), dtype=np.uint8)    # 8 rows x 128 values
    scale = rng.integers(0, 255, size=(8, 4), dtype=np.uint8)      # every finite e8m0 incl. 0 and 254
    scale[0, :2] = [0, 1]
    ref = official.dequant_fp4(packed, scale)
    got = quant.dequantize(mxfp4_from_official(packed, scale), QT.MXFP4, (8, 128))
    assert np.array_equal(got, ref)      # equal values (ggml decodes code 8 as +0, the official table as -0)
    assert (np.abs(ref) > 0).mean() > 0.8


# ----------------------------------------------------------------------------------------------- quantisers
def test_q8_0_and_bf16_encoders_bit_exact_vs_ggml():
    x = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    x[0, :32] = 0                                                   # an all-zero block
    x[1, :32] = np.linspace(-2.5, 2.5, 32) / 127 * 2.5              # halves that roundf must send away from 0
    assert np.array_equal(quant.quantize(x, QT.Q8_0), gq.quantize(x, QT.Q8_0))
    assert np.array_equal(quant.quantize(x, QT.BF16).view(np.uint8), gq.quantize(x, QT.BF16).view(np.uint8))


@pytest.mark.parametrize("qt,rel_rms", [(QT.Q4_K, 0.12), (QT.Q2_K, 0.45)], ids=["Q4_K", "Q2_K"])
def test_k_quant_round_trip_error_bounded(qt, rel_rms):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, 1024)).astype(np.float32) * 0.02
    x[0, :256] = 0                                                   # flat super-block: decodes to exactly 0
    x[1, :256] = 0.01                                                # constant positive block
    raw = quant.quantize(x, qt)
    assert raw.shape == (32, quant.row_nbytes(qt, 1024))
    y = quant.dequantize(raw, qt, x.shape)
    assert same_bits(y, gq.dequantize(raw, qt).reshape(x.shape))     # ggml reads what we wrote
    assert np.all(y[0, :256] == 0)
    assert np.abs(y[1, :256] - 0.01).max() < 0.01 * 0.05
    err = np.sqrt(np.mean((y[2:] - x[2:]) ** 2)) / np.sqrt(np.mean(x[2:] ** 2))
    assert err < rel_rms
    # the least-squares search must beat a plain min/max grid on the same blocks
    nmax = 15 if qt == QT.Q4_K else 3
    sub = 32 if qt == QT.Q4_K else 16
    b = x[2:].reshape(-1, sub)
    lo, hi = np.minimum(b.min(1, keepdims=True), 0), b.max(1, keepdims=True)
    naive = lo + np.rint((b - lo) / (hi - lo) * nmax) * (hi - lo) / nmax
    assert err < np.sqrt(np.mean((naive - b) ** 2)) / np.sqrt(np.mean(b ** 2))


def test_fp4_encoder_rounds_to_nearest_even_and_round_trips():
    # with amax 6 the scale is 2^0: midpoints between e2m1 magnitudes go to the even code
    x = np.array([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6] + [0.3, 0.8, 5.2, -2.9] + [0] * 20], np.float32)
    packed, scale = official.quant_fp4(np.concatenate([x, -x]))
    assert (scale == 127).all()
    y = official.dequant_fp4(packed, scale)
    assert list(y[0, :12]) == [0, 1, 1, 2, 2, 4, 4, 6, 0.5, 1, 6, -3] and np.array_equal(y[1], -y[0])
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    p2, s2 = official.quant_fp4(w)
    assert np.array_equal(official.dequant_fp4(*official.quant_fp4(official.dequant_fp4(p2, s2))),
                          official.dequant_fp4(p2, s2))            # decoded values are fixed points
