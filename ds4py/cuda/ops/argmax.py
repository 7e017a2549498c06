"""Host side of cu/argmax.cu."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.ops.core import blocks_that_fit, ceil_div, is_dtype, need


def argmax_parts(rt: Any, n: int, threads: int = 256) -> int:
    """Blocks (= partial entries) an argmax over n values uses: enough to spread it over the device, no more."""
    return max(1, min(ceil_div(n, threads * 8), blocks_that_fit(rt, threads, 0, cap_per_sm=1, kernel="argmax_f32")))


@dataclass(frozen=True)
class ArgmaxParts:
    """An argmax's scratch: one partial entry per block (val float32, idx int32 of one size: it sets the grid, see
    argmax_parts) and the ticket, one uint32, zero, left zero."""
    val: DeviceArray
    idx: DeviceArray
    ticket: DeviceArray


def argmax(rt: Any, x: DeviceArray, n: int, parts: ArgmaxParts, out: DeviceArray, threads: int = 256,
           stream: Any = None, pdl: bool = False) -> None:
    """out[0] = argmax(x[:n]) (lowest index on ties, first NaN) in one launch."""
    part_val, part_idx, ticket = parts.val, parts.idx, parts.ticket
    n_parts = part_val.size
    need(n >= 1 and is_dtype(x, np.float32) and x.size >= n, "argmax: x must be float32 with n >= 1 values")
    need(is_dtype(part_val, np.float32) and is_dtype(part_idx, np.int32) and part_idx.size == n_parts >= 1,
         "argmax: partial buffers must be float32 / int32 of the same size >= 1")
    need(is_dtype(ticket, np.uint32) and ticket.size >= 1, "argmax: ticket must be one uint32")
    need(is_dtype(out, np.int32) and out.size >= 1, "argmax: out must be an int32 slot")
    need(threads % 32 == 0 and 32 <= threads <= 1024, "argmax: threads must be a multiple of 32 up to 1024")
    rt.launch("argmax_f32", n_parts, threads, x, n, part_val, part_idx, ticket, out, stream=stream, pdl=pdl)
