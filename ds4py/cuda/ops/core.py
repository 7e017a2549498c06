"""What every host wrapper in ds4py/cuda/ops shares: argument checks and launch sizing.

A wrapper checks shapes and alignment, picks the launch geometry its kernel's `Launch:` comment documents, and
calls rt.launch (rt: a Runtime on a GPU, or an EmuRuntime on the CPU: the same calls run on both). Arguments are
DeviceArrays (None where a pointer may be null). `pdl=True` lets the kernel overlap the previous one in the stream
(every kernel calls pdl_wait() before touching that kernel's output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda import resources
from ds4py.cuda.devices import occupancy
from ds4py.cuda.memory import DeviceArray
from ds4py.errors import Ds4Error


def need(cond: bool, msg: str) -> None:
    """One-sentence Ds4Error when a wrapper's precondition fails (before anything is launched)."""
    if not cond:
        raise Ds4Error(msg)


def aligned(n: int, *arrays: DeviceArray | None) -> bool:
    """Every array present starts on an n-byte boundary (None: an absent optional pointer; a host array under
    emulation has no .ptr and passes)."""
    return all(a is None or getattr(a, "ptr", 0) % n == 0 for a in arrays)


def is_dtype(a: DeviceArray | None, dtype: Any) -> bool:
    """a is present and of dtype (a required array)."""
    return a is not None and np.dtype(a.dtype) == np.dtype(dtype)


@dataclass(frozen=True)
class TokenRows:
    """One call's T rows in and out: x [T, ldx] (ldx None: packed rows), y [T, ldy] (None: packed) and add
    (None: nothing) summed into y. What a row holds is the op's (the experts' x is the activations, their down
    projection's x is h)."""
    x: Any
    y: Any = None
    T: int = 1
    ldx: int | None = None
    ldy: int | None = None
    add: Any = None


def blocks_that_fit(rt: Any, threads: int, smem_per_block: int, cap_per_sm: int = 32, kernel: str | None = None) -> int:
    """Blocks of `threads` threads and `smem_per_block` bytes of dynamic shared memory that the whole device holds
    at once (an upper bound for a grid-stride launch: more blocks only queue behind the first wave): the
    occupancy of rt.profile (ds4py/cuda/devices.py) from threads, shared memory per SM and, for a named kernel,
    its registers and static shared memory from the committed ptxas table of the profile's arch (ds4py/cuda/
    resources.py; an arch without a table: threads and shared memory only)."""
    p = rt.profile
    res = resources.kernel(p.arch, kernel) if kernel else None
    occ = occupancy(p, threads, res.registers if res else 0, smem_per_block + (res.smem if res else 0))
    return p.sm_count * min(cap_per_sm, max(1, occ.blocks_per_sm))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
