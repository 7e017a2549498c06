"""Host side of cu/sample.cu: temperature / top-k / top-p / min-p and a seeded draw on the device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.ops.core import is_dtype, need

DEFINES = {"SAMPLE_RADIX_BITS": 11}      # radix-select digit: 2048 bins, 3 passes over 32-bit keys
DEFAULT_THREADS = 1024


@dataclass(frozen=True)
class SampleRule:
    """ds4py.sampling's rules of one draw: temperature (0: greedy), top-k (0: all), top-p, min-p, the seed."""
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0


@dataclass(frozen=True)
class SampleRows:
    """Which rows one sample call draws: `rows` rows of n logits (the vocabulary) row_stride apart (None: n; 0:
    `rows` draws of one distribution), row r's draw at position pos_slot[0] (a device slot, so graph replays use
    the step's position; None: 0) + pos_offset + r; kept: optional uint8 [rows, n] mask of what the truncation
    keeps."""
    n: int
    rows: int = 1
    row_stride: int | None = None
    pos_slot: DeviceArray | None = None
    pos_offset: int = 0
    kept: DeviceArray | None = None


def sample(rt: Any, rule: SampleRule, logits: DeviceArray, out: DeviceArray, at: SampleRows,
           threads: int = DEFAULT_THREADS, stream: Any = None, pdl: bool = False) -> None:
    """out[r] = a token drawn from row r of logits (at.n values each) under the rule; -1 for a row with NaN / +inf
    or nothing but -inf. The draw is Philox(seed, position), the position as `at` says."""
    n = at.n
    temperature, top_k, top_p, min_p, seed = rule.temperature, rule.top_k, rule.top_p, rule.min_p, rule.seed
    rows, pos_slot, pos_offset, kept = at.rows, at.pos_slot, at.pos_offset, at.kept
    row_stride = n if at.row_stride is None else at.row_stride
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
