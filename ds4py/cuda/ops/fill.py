"""Host wrappers of cu/fill.cu: random weights written on the device (the synthetic model of ds4py/cuda/synth.py).
Values are a function of (seed, index) only, so the grid is any: a wave of 256-thread blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.ops.core import blocks_that_fit, ceil_div, is_dtype, need

THREADS = 256


def _grid(rt: Any, n: int, kernel: str) -> int:
    return max(1, min(ceil_div(n, THREADS), blocks_that_fit(rt, THREADS, 0, kernel=kernel)))


def _seed(seed: int) -> int:
    return int(seed) & (2**64 - 1)


def fill_random_u32(rt: Any, a: Any, seed: int, stream: Any = None, pdl: bool = False) -> None:
    """Every 32-bit word of `a` (any dtype, a whole number of words) random."""
    need(a.nbytes % 4 == 0 and a.ptr % 4 == 0, "fill_random_u32: the array must be whole, aligned 32-bit words")
    n = a.nbytes // 4
    if n:
        words = a.view(0, n, np.uint32) if hasattr(a, "view") else a
        rt.launch("fill_random_u32", _grid(rt, n, "fill_random_u32"), THREADS, words, n, _seed(seed), stream=stream, pdl=pdl)


def fill_uniform(rt: Any, a: Any, lo: float, hi: float, seed: int, stream: Any = None, pdl: bool = False) -> None:
    """F16 or F32 values uniform in [lo, hi)."""
    f16 = is_dtype(a, np.float16)
    need(f16 or is_dtype(a, np.float32), "fill_uniform: the array must be float16 or float32")
    if a.size:
        name = "fill_f16_uniform" if f16 else "fill_f32_uniform"
        rt.launch(name, _grid(rt, a.size, name), THREADS, a, a.size,
                  float(lo), float(hi), _seed(seed), stream=stream, pdl=pdl)


def fill_i32_rows(rt: Any, a: Any, k: int, mod: int, seed: int, stream: Any = None, pdl: bool = False) -> None:
    """Rows of k distinct ints in [0, mod) (a random start, then consecutive values)."""
    need(is_dtype(a, np.int32) and 1 <= k <= mod and a.size % k == 0,
         "fill_i32_rows: an int32 array of whole rows of k <= mod values")
    if a.size:
        rt.launch("fill_i32_rows", _grid(rt, a.size, "fill_i32_rows"), THREADS, a, a.size, int(k), int(mod), _seed(seed),
                  stream=stream, pdl=pdl)


@dataclass(frozen=True)
class BlockFields:
    """The scale fields of a block format that random bytes must not leave invalid: blocks of block_bytes, f16
    scales at f16_at (at most two offsets; positive, about `scale`), an e8m0 byte at e8m0_at (-1: none) drawn
    from e8m0_range."""
    block_bytes: int
    f16_at: tuple[int, ...] = ()
    scale: float = 1.0
    e8m0_at: int = -1
    e8m0_range: tuple[int, int] = (127, 127)


def fix_block_fields(rt: Any, a: Any, fields: BlockFields, seed: int = 0, stream: Any = None,
                     pdl: bool = False) -> None:
    """Per block of fields.block_bytes: valid positive f16 scales at f16_at, an e8m0 byte."""
    block_bytes, f16_at, e8m0_at, e8m0_range = fields.block_bytes, fields.f16_at, fields.e8m0_at, fields.e8m0_range
    need(is_dtype(a, np.uint8) and block_bytes >= 1 and a.nbytes % block_bytes == 0,
         "fix_block_fields: raw uint8 bytes, a whole number of blocks")
    need(len(f16_at) <= 2 and all(0 <= o <= block_bytes - 2 for o in f16_at), "fix_block_fields: bad f16 offsets")
    need(e8m0_at < block_bytes and 0 <= e8m0_range[0] <= e8m0_range[1] <= 254, "fix_block_fields: bad e8m0 field")
    offs = list(f16_at) + [-1] * (2 - len(f16_at))
    n = a.nbytes // block_bytes
    if n:
        rt.launch("fix_block_fields", _grid(rt, n, "fix_block_fields"), THREADS, a, n, int(block_bytes), offs[0],
                  offs[1], float(fields.scale), int(e8m0_at), int(e8m0_range[0]), int(e8m0_range[1]), _seed(seed),
                  stream=stream, pdl=pdl)
