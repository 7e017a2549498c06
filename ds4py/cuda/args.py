"""Kernel argument packing, checked against the signature parsed from the kernel's source.

cuLaunchKernel takes `void** kernelParams`: one pointer per parameter, each pointing at that parameter's bytes.
`pack_args` builds both arrays in numpy (no driver needed, so CI tests it) and rejects a wrong count, a host
array where a device pointer belongs, a buffer of the wrong dtype, or a scalar of the wrong kind, before launch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Sequence

import numpy as np

from ds4py.cuda.signature import POINTEE_DTYPES, SCALAR_TYPES, Param, format_signature
from ds4py.errors import Ds4Error

SLOT_BYTES = 16  # every parameter gets its own 16-byte slot (>= its size and alignment)


class KernelArgumentError(Ds4Error):
    """Arguments that do not match the kernel's declared parameters."""


@dataclass
class PackedArgs:
    data: np.ndarray        # uint8 [n * SLOT_BYTES]: each parameter's bytes
    pointers: np.ndarray    # uint64 [n]: address of each parameter's slot (the void** array)

    @property
    def address(self) -> int:
        """Value to pass as kernelParams (0 for a kernel without parameters). Keep `self` alive until launched."""
        return int(self.pointers.ctypes.data) if len(self.pointers) else 0


def _pointer_value(kernel: str, p: Param, v: Any) -> int:
    if v is None:
        return 0
    if isinstance(v, np.ndarray):
        raise KernelArgumentError(
            f"{kernel}: argument {p.name!r} is a host numpy array; pass a device buffer (upload it first)")
    if isinstance(v, bool) or isinstance(v, (float, np.floating)):
        raise KernelArgumentError(f"{kernel}: argument {p.name!r} must be a device pointer, got {v!r}")
    if hasattr(v, "ptr"):
        want = POINTEE_DTYPES.get(p.ctype)
        dtype = getattr(v, "dtype", None)
        if want is not None and dtype is not None and np.dtype(dtype) != want:
            raise KernelArgumentError(
                f"{kernel}: argument {p.name!r} is declared {p.ctype}* but the buffer holds {np.dtype(dtype)}")
        if not p.is_const and getattr(v, "readonly", False):
            raise KernelArgumentError(f"{kernel}: argument {p.name!r} is written by the kernel but the buffer is read-only")
        return int(v.ptr)
    if isinstance(v, Integral):
        if not 0 <= int(v) < 2**64:
            raise KernelArgumentError(f"{kernel}: argument {p.name!r} is not a valid device address: {v}")
        return int(v)
    raise KernelArgumentError(f"{kernel}: argument {p.name!r} must be a device pointer, got {type(v).__name__}")


def _scalar_bytes(kernel: str, p: Param, v: Any) -> bytes:
    fmt, dtype = SCALAR_TYPES[p.ctype]
    if isinstance(v, (bool, np.bool_)) or isinstance(v, np.ndarray) or hasattr(v, "ptr"):
        raise KernelArgumentError(f"{kernel}: argument {p.name!r} is a {p.ctype}, got {type(v).__name__}")
    if dtype.kind in "iu":
        if not isinstance(v, Integral):
            raise KernelArgumentError(f"{kernel}: argument {p.name!r} is a {p.ctype}, got {v!r}")
        info = np.iinfo(dtype)
        if not info.min <= int(v) <= info.max:
            raise KernelArgumentError(f"{kernel}: argument {p.name!r} = {v} does not fit in {p.ctype}")
        return struct.pack("<" + fmt, int(v))
    if not isinstance(v, Real):
        raise KernelArgumentError(f"{kernel}: argument {p.name!r} is a {p.ctype}, got {v!r}")
    return struct.pack("<" + fmt, float(v))


def pack_args(kernel: str, params: list[Param], values: Sequence[Any]) -> PackedArgs:
    """Check `values` against `params` and lay them out for cuLaunchKernel(Ex)."""
    if len(values) != len(params):
        raise KernelArgumentError(
            f"{kernel} takes {len(params)} arguments, got {len(values)}: {format_signature(kernel, params)}")
    data = np.zeros(len(params) * SLOT_BYTES, dtype=np.uint8)
    for i, (p, v) in enumerate(zip(params, values)):
        raw = struct.pack("<Q", _pointer_value(kernel, p, v)) if p.is_pointer else _scalar_bytes(kernel, p, v)
        data[i * SLOT_BYTES: i * SLOT_BYTES + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    base = data.ctypes.data
    pointers = np.array([base + i * SLOT_BYTES for i in range(len(params))], dtype=np.uint64)
    return PackedArgs(data, pointers)
