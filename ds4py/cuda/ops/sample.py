"""Host side of cu/sample.cu: temperature / top-k / top-p / min-p and a seeded draw on the device."""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.ops.core import is_dtype, need

DEFINES = {"SAMPLE_RADIX_BITS": 11}      # radix-select digit: 2048 bins, 3 passes over 32-bit keys
DEFAULT_THREADS = 1024


def sample(rt: Any, logits: DeviceArray, n: int, out: DeviceArray, temperature: float, top_k: int = 0,
           top_p: float = 1.0, min_p: float = 0.0, seed: int = 0, pos_slot: DeviceArray | None = None,
           pos_offset: int = 0, rows: int = 1, row_stride: int | None = None, kept: DeviceArray | None = None,
           threads: int = DEFAULT_THREADS, stream: Any = None, pdl: bool = False) -> None:
    """out[r] = a token drawn from row r of logits (n values each) under ds4py.sampling's rules; -1 for a row
    with NaN / +inf or nothing but -inf. The draw is Philox(seed, position) with position = pos_slot[0] (a
    device slot, so graph replays use the step's position) + pos_offset + r. rows > 1 with row_stride 0 draws
    `rows` samples of one distribution. kept: optional uint8 [rows, n] mask of what the truncation keeps."""
    row_stride = n if row_stride is None else row_stride
    need(n >= 1 and rows >= 1 and row_stride >= 0, "sample: n and rows must be >= 1")
    need(is_dtype(logits, np.float32) and logits.size >= (rows - 1) * row_stride + n,
         "sample: logits must be float32 holding every row")
    need(is_dtype(out, np.int32) and out.size >= rows, "sample: out must be an int32 slot per row")
    need(pos_slot is None or (is_dtype(pos_slot, np.int32) and pos_slot.size >= 1), "sample: pos_slot is int32")
    need(kept is None or (is_dtype(kept, np.uint8) and kept.size >= rows * n), "sample: kept is uint8 [rows, n]")
    need(np.isfinite(temperature) and temperature >= 0, f"sample: temperature must be >= 0, got {temperature}")
    need(top_k >= 0 and 0 < top_p <= 1 and 0 <= min_p <= 1, "sample: top_k >= 0, top_p in (0, 1], min_p in [0, 1]")
    need(0 <= seed < 2**64, "sample: seed must fit in 64 bits")
    need(threads & (threads - 1) == 0 and 32 <= threads <= min(1024, 1 << DEFINES["SAMPLE_RADIX_BITS"]),
         "sample: threads must be a power of two, 32..1024")
    rt.launch("sample_f32", rows, threads, logits, n, row_stride, float(temperature), int(min(top_k, 2**31 - 1)),
              float(top_p), float(min_p), int(seed), pos_slot, int(pos_offset), out, kept, stream=stream, pdl=pdl)
