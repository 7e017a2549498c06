"""The indexer's host-side constant both the CUDA kernels' launches and their twins use (MODEL.md §2.3)."""

from __future__ import annotations

import numpy as np

F32 = np.float32


def weight_scale(ihd: int, ih: int) -> float:
    """The fp32 factor on proj(x): ihd^-0.5 * IH^-0.5, rounded once like the reference."""
    return float(F32(ihd ** -0.5 * ih ** -0.5))
