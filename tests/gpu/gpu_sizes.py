"""Whether the GPU tests run on the CPU emulator (DS4PY_GPU_TESTS_ON_EMULATOR=1), and sizes cut down for it."""

from __future__ import annotations

import os

ON_EMULATOR = bool(os.environ.get("DS4PY_GPU_TESTS_ON_EMULATOR"))


def shrink(n: int, by: int, multiple: int = 1) -> int:
    """n on a GPU; n / by (rounded down to `multiple`, at least `multiple`) on the emulator."""
    if not ON_EMULATOR:
        return n
    return max(multiple, n // by // multiple * multiple)
