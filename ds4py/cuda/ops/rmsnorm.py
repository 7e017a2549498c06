"""Host side of cu/rmsnorm.cu."""

from __future__ import annotations

from typing import Any

import numpy as np

from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.ops.core import is_dtype, need


def rmsnorm(rt: Any, x: DeviceArray, y: DeviceArray, n: int, norm: tuple[DeviceArray | None, float],
            threads: int = 256, stream: Any = None, pdl: bool = False) -> None:
    """y[r] = RMSNorm(x[r]) (* w) for every row r of n floats, norm = (w or None, eps) (as ops.gemv's); y may
    be x."""
    w, eps = norm
    need(n > 0 and x.size % n == 0 and y.size == x.size, f"rmsnorm: x has {x.size} floats, not rows of {n}")
    need(is_dtype(x, np.float32) and is_dtype(y, np.float32), "rmsnorm: x and y must be float32")
    need(w is None or w.size == n, f"rmsnorm: weight has {w.size if w else 0} floats, expected {n}")
    need(threads % 32 == 0 and 32 <= threads <= 1024, "rmsnorm: threads must be a multiple of 32 up to 1024")
    rt.launch("rmsnorm_f32", x.size // n, threads, x, w, y, n, float(eps), stream=stream, pdl=pdl)
