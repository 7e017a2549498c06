"""glibc's malloc around a long prefill: large temporaries reused from the heap instead of fresh mappings.

glibc hands out a large allocation (above its mmap threshold: 128 KiB at start, growing with what is freed up to
32 MiB) as a mapping of its own and unmaps it on free, so the next array of that size takes a page fault on every
4 KiB page again. A prefill pass of 1,024 rows makes many such arrays ([rows, 64, 512] float32 queries are
128 MiB, the hyper-connection state 64 MiB): measured on the 4-layer real-width file at 2 threads, 68k minor faults
and 3.7 s of system CPU in a 512-token prefill, 242k and 12.8 s in a 2,048-token one, all on the calling thread.
Inside `reuse()` the mmap and trim thresholds are raised so freed blocks stay in the heap and the next array
takes their pages; after it, the thresholds go to glibc's largest dynamic values (32 MiB / 64 MiB, where a
process that has freed large arrays ends up anyway) and malloc_trim gives the free pages back, so what the
process keeps after a prefill does not grow. Not glibc (another libc, another platform): nothing happens.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Iterator

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
PREFILL_BYTES = 1 << 30          # thresholds inside reuse(): every prefill temporary comes from the heap
AFTER_MMAP, AFTER_TRIM = 32 << 20, 64 << 20   # glibc's dynamic maxima (DEFAULT_MMAP_THRESHOLD_MAX, 2x it)
_libc: list = []


def _glibc():
    if not _libc:
        lib = None
        try:
            c = ctypes.CDLL(None)
            if hasattr(c, "gnu_get_libc_version") and hasattr(c, "mallopt") and hasattr(c, "malloc_trim"):
                c.mallopt.argtypes, c.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                c.malloc_trim.argtypes, c.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
                lib = c
        except OSError:
            lib = None
        _libc.append(lib)
    return _libc[0]


@contextmanager
def reuse(on: bool = True) -> Iterator[None]:
    """Freed blocks stay in the heap for the duration (when `on` and glibc is found); after it, the free pages
    go back to the system."""
    c = _glibc() if on else None
    if c is None:
        yield
        return
    c.mallopt(M_MMAP_THRESHOLD, PREFILL_BYTES)
    c.mallopt(M_TRIM_THRESHOLD, PREFILL_BYTES)
    try:
        yield
    finally:
        c.mallopt(M_MMAP_THRESHOLD, AFTER_MMAP)
        c.mallopt(M_TRIM_THRESHOLD, AFTER_TRIM)
        c.malloc_trim(0)
