"""numpy's OpenBLAS thread count, set around a decode step (ds4py.ref.forward).

In a decode step the compiled kernels make every large product on their own threads; BLAS is left the small ones
(the hyper-connection mixes, attention over a window), where OpenBLAS's worker threads cost more than they save:
they spin after each call. Measured on the 4-layer real-width file at 2 kernel threads: 165-200 ms of CPU a token
with OpenBLAS's default threads against 104-120 ms with one, and a shorter token. So a step whose products go
through the decode kernels runs BLAS on the calling thread, and the thread count is put back after it (prefill
keeps OpenBLAS's threads). OpenBLAS splits a product over output rows / columns, never over the summed axis, so
the results do not change (tests/test_ops_jit.py checks a model's logits both ways).

OpenBLAS is found among the loaded libraries (numpy's wheels bundle it as scipy_openblas); where it is absent
(another BLAS, another platform) this does nothing.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Iterator

_SUFFIXES = ("", "64_", "_64")
_PREFIXES = ("openblas", "scipy_openblas")
_api: list = []            # [(get, set)] once looked up, [None] where there is none


def _lookup():
    if _api:
        return _api[0]
    found = None
    try:
        import numpy  # noqa: F401  (loads its BLAS)

        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
        for path in sorted(paths):
            lib = ctypes.CDLL(path)
            for pre in _PREFIXES:
                for suf in _SUFFIXES:
                    get = getattr(lib, f"{pre}_get_num_threads{suf}", None)
                    put = getattr(lib, f"{pre}_set_num_threads{suf}", None)
                    if get is not None and put is not None:
                        get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
                        found = (get, put)
                        break
                if found:
                    break
            if found:
                break
    except OSError:                          # no /proc (not Linux), or a library that will not open
        found = None
    _api.append(found)
    return found


@contextmanager
def single_threaded(on: bool = True) -> Iterator[None]:
    """BLAS on the calling thread for the duration (when `on` and OpenBLAS is found), then as before."""
    api = _lookup() if on else None
    if api is None:
        yield
        return
    get, put = api
    before = get()
    if before == 1:
        yield
        return
    put(1)
    try:
        yield
    finally:
        put(before)
