"""cu/fill.cu against its twin (ds4py/cuda/twins/fill.py) on the CPU emulator, in every thread order: the random
words, uniform halves and floats, ids below a modulus and the block scale fields are exactly the twin's (a pure
function of seed and index, whatever the grid), and a filled Q8_0 / IQ2_XXS / Q2_K / MXFP4 tensor decodes to
finite values."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cu_fixtures import arena, put, requires_emulator, rt  # noqa: F401 (fixtures)
from ds4py.cuda.ops import fill
from ds4py.cuda.twins import fill as twin
from ds4py.quant import dequantize

pytestmark = requires_emulator


@pytest.mark.parametrize("n", [5, 37, 5000])
def test_random_words_and_uniform_values(rt, arena, n):
    a = arena.scratch(n, np.uint32)
    fill.fill_random_u32(rt, a, seed=7)
    np.testing.assert_array_equal(a.download(), twin.random_u32(n, 7))
    for dt in (np.float16, np.float32):
        v = arena.scratch(n, dt)
        fill.fill_uniform(rt, v, -0.25, 0.5, seed=3)
        got = v.download()
        np.testing.assert_array_equal(got, twin.uniform(n, -0.25, 0.5, 3, dt))
        assert got.min() >= -0.25 and got.max() <= 0.5
    k = 1 if n == 37 else 5
    ids = arena.scratch(n, np.int32)
    fill.fill_i32_rows(rt, ids, k, 6, seed=11)
    got = ids.download()
    np.testing.assert_array_equal(got, twin.i32_rows(n, k, 6, 11))
    rows = got.reshape(-1, k)
    assert all(len(set(r)) == k for r in rows) and got.min() >= 0 and got.max() < 6


# (type, block bytes, f16 offsets, e8m0 offset): where each format keeps its scales
FIELDS = [(QT.Q8_0, 34, (0,), -1), (QT.IQ2_XXS, 66, (0,), -1), (QT.Q2_K, 84, (80, 82), -1),
          (QT.Q4_K, 144, (0, 2), -1), (QT.MXFP4, 17, (), 0)]


@pytest.mark.parametrize("qtype,block,f16_at,e8m0_at", FIELDS, ids=[f[0].name for f in FIELDS])
def test_block_fields_make_a_valid_tensor(rt, arena, qtype, block, f16_at, e8m0_at):
    n_blocks = 12                                         # a whole number of 32-bit words for every format
    a = arena.scratch(n_blocks * block, np.uint8)
    fill.fill_random_u32(rt, a, seed=5)
    fields = fill.BlockFields(block_bytes=block, f16_at=f16_at, scale=0.01, e8m0_at=e8m0_at, e8m0_range=(120, 127))
    fill.fix_block_fields(rt, a, fields, seed=2)
    want = twin.block_fields(twin.random_u32(n_blocks * block // 4, 5).view(np.uint8), block, f16_at, 0.01, e8m0_at,
                             (120, 127), 2)
    got = a.download()
    np.testing.assert_array_equal(got, want)
    qk = 32 if qtype in (QT.Q8_0, QT.MXFP4) else 256
    values = dequantize(got, qtype, (n_blocks * qk,))
    assert np.isfinite(values).all() and np.abs(values).max() > 0
