"""Kernel argument packing, checked against the signature parsed from the kernel's source.

cuLaunchKernel takes `void** kernelParams`: one pointer per parameter, each pointing at that parameter's bytes.
`pack_args` builds both arrays in numpy (no driver needed, so CI tests it) and rejects a wrong count, a host
array where a device pointer belongs, a buffer of the wrong dtype, or a scalar of the wrong kind, before launch.
"""

from __future__ import annotations

import ctypes
import struct
from numbers import Integral, Real
from typing import Any, Sequence

import numpy as np

from ds4py.cuda.signature import POINTEE_DTYPES, SCALAR_TYPES, Param, format_signature
from ds4py.errors import Ds4Error

SLOT_BYTES = 16  # every parameter gets its own 16-byte slot (>= its size and alignment)


class KernelArgumentError(Ds4Error):
    """Arguments that do not match the kernel's declared parameters."""


class PackedArgs:
    """Each parameter's bytes in its own slot, and the void** array pointing at the slots."""
    __slots__ = ("_data", "_pointers")

    def __init__(self, data: bytes):
        self._data = (ctypes.c_uint8 * len(data)).from_buffer_copy(data) if data else (ctypes.c_uint8 * 0)()
        base = ctypes.addressof(self._data)
        n = len(data) // SLOT_BYTES
        self._pointers = (ctypes.c_uint64 * n)(*range(base, base + n * SLOT_BYTES, SLOT_BYTES))

    @property
    def data(self) -> np.ndarray:
        """uint8 [n * SLOT_BYTES] (a view)."""
        return np.ctypeslib.as_array(self._data) if len(self._data) else np.zeros(0, np.uint8)

    @property
    def pointers(self) -> np.ndarray:
        """uint64 [n]: address of each parameter's slot (a view)."""
        return np.ctypeslib.as_array(self._pointers) if len(self._pointers) else np.zeros(0, np.uint64)

    @property
    def address(self) -> int:
        """Value to pass as kernelParams (0 for a kernel without parameters). Keep `self` alive until launched."""
        return ctypes.addressof(self._pointers) if len(self._pointers) else 0


_INT_RANGES: dict[str, tuple[int, int]] = {
    c: (int(np.iinfo(dt).min), int(np.iinfo(dt).max)) for c, (_, dt) in SCALAR_TYPES.items() if dt.kind in "iu"}


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
        if want is not None and dtype is not None and dtype != want:
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


def _scalar_value(kernel: str, p: Param, v: Any) -> int | float:
    if isinstance(v, (bool, np.bool_)) or isinstance(v, np.ndarray) or hasattr(v, "ptr"):
        raise KernelArgumentError(f"{kernel}: argument {p.name!r} is a {p.ctype}, got {type(v).__name__}")
    rng = _INT_RANGES.get(p.ctype)
    if rng is not None:
        if not isinstance(v, Integral):
            raise KernelArgumentError(f"{kernel}: argument {p.name!r} is a {p.ctype}, got {v!r}")
        if not rng[0] <= int(v) <= rng[1]:
            raise KernelArgumentError(f"{kernel}: argument {p.name!r} = {v} does not fit in {p.ctype}")
        return int(v)
    if not isinstance(v, Real):
        raise KernelArgumentError(f"{kernel}: argument {p.name!r} is a {p.ctype}, got {v!r}")
    return float(v)


_layouts: dict[int, tuple[list[Param], struct.Struct]] = {}


def _layout(params: list[Param]) -> struct.Struct:
    """One struct for all slots of a parameter list (cached per list: kernels keep theirs)."""
    hit = _layouts.get(id(params))
    if hit is not None and hit[0] is params:
        return hit[1]
    fmt = "<"
    for p in params:
        f = "Q" if p.is_pointer else SCALAR_TYPES[p.ctype][0]
        fmt += f + f"{SLOT_BYTES - struct.calcsize('<' + f)}x"
    st = struct.Struct(fmt)
    _layouts[id(params)] = (params, st)
    return st


def check_args(kernel: str, params: list[Param], values: Sequence[Any]) -> list[int | float]:
    """Check `values` against `params`; returns each one's raw value (an address for pointers)."""
    if len(values) != len(params):
        raise KernelArgumentError(
            f"{kernel} takes {len(params)} arguments, got {len(values)}: {format_signature(kernel, params)}")
    return [_pointer_value(kernel, p, v) if p.is_pointer else _scalar_value(kernel, p, v)
            for p, v in zip(params, values)]


def pack_args(kernel: str, params: list[Param], values: Sequence[Any]) -> PackedArgs:
    """Check `values` against `params` and lay them out for cuLaunchKernel(Ex)."""
    return pack_raw(params, check_args(kernel, params, values))


def pack_raw(params: list[Param], raw: Sequence[int | float]) -> PackedArgs:
    """Lay out already-checked raw values (check_args) for cuLaunchKernel(Ex)."""
    return PackedArgs(_layout(params).pack(*raw))
