"""The CUDA engine's memory plan, made before a byte is uploaded: the weights (the file's tensor data plus the
converted and repacked copies), one sequence's KV state at the requested context, the step workspaces (decode,
multi-row, a prefill block), against what the device has free. Printed as one line at load; a model that does not
fit is refused in one sentence (UnsupportedByBackend, so `--backend auto` falls back to the reference saying why).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4py.kv import StateLayout
from ds4py.model import UnsupportedByBackend

DEFAULT_CTX = 32768          # the plan's context when none is asked for (serve's default --ctx)


def kv_bytes(layout: StateLayout, ctx: int) -> int:
    """Bytes of one sequence's state after ctx tokens (rings whole, emitted rows for ctx positions)."""
    return sum(p.rows_for(ctx) * p.width * np.dtype(p.dtype).itemsize for p in layout.parts)


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    kv: int
    ctx: int
    scratch: int
    available: int           # free device memory before the load

    @property
    def need(self) -> int:
        return self.weights + self.kv + self.scratch

    @property
    def left(self) -> int:
        return self.available - self.need

    def line(self) -> str:
        gb = lambda n: f"{n / 1e9:.2f} GB"                                   # noqa: E731
        return (f"memory plan: weights {gb(self.weights)}, KV {gb(self.kv)} at {self.ctx:,} tokens, scratch "
                f"{gb(self.scratch)}; {gb(self.left)} of {gb(self.available)} free left")

    def check(self) -> None:
        if self.left < 0:
            raise UnsupportedByBackend(
                f"the model does not fit the GPU: weights {self.weights / 1e9:.2f} GB + KV {self.kv / 1e9:.2f} GB at "
                f"{self.ctx:,} tokens + scratch {self.scratch / 1e9:.2f} GB = {self.need / 1e9:.2f} GB, but "
                f"{self.available / 1e9:.2f} GB are free; use a smaller --ctx or another backend")
