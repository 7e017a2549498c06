"""The CUDA engine's memory plan, made before a byte is uploaded: the weights (the file's tensor data plus the
converted and repacked copies), one sequence's KV state at the requested context, the step workspaces (decode,
multi-row, a prefill block), against what the device has free. Printed as one line at load; a model that does not
fit is refused in one sentence (UnsupportedByBackend, so `--backend auto` falls back to the reference saying why).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ds4py.kv import StateLayout
from ds4py.errors import UnsupportedByBackend

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


def seed_bytes_per_token(cfg, bits: int = 12, bits_shallow: int = 13, shallow_layers: int = 14) -> int:
    """weight_bytes_per_token() of the CUDA engine for the seed's layout of `cfg`, counted from the schema without a
    file: a ds4-layout model (Q8_0 linears, F16 / F32 slots) through `quantize-vq --dense q4_k` (the attention
    projections, the shared expert and the head in Q4_K where rows are 256-multiples) with VQ-8 routed experts at
    bits_shallow bits for the first shallow_layers layers and `bits` for the rest, in the engine's device layout
    (ds4py/cuda/vq_layout.py: each matrix's codebook once, k of n_experts experts' rows)."""
    from ds4py import schema
    from ds4py.cuda.ops.experts import codebook_bytes, matrix_bytes
    from ds4py.vq.quantize import Q4K_SUFFIXES

    total = 0
    for e in schema.entries(cfg):
        shape, slot = tuple(e.shape), e.spec.slot
        n = int(np.prod(shape))
        if slot == "experts":
            X, rows, cols = shape
            il = int(e.name.split(".")[1])
            fmt = f"vq{bits_shallow if il < shallow_layers else bits}"
            cb = codebook_bytes(fmt)
            total += cb + (matrix_bytes(fmt, X, rows, cols) - cb) // X * cfg.n_experts_used
            continue
        if slot == "q8":
            cols = shape[-1]
            q4k = (e.name == "output.weight" or e.name.endswith(Q4K_SUFFIXES)) and cols % 256 == 0
            nbytes = n // 256 * 144 if q4k else n // 32 * 34
        else:
            nbytes = n * (2 if slot == "f16" else 4)
        total += nbytes // shape[0] if e.spec.field == "embed" else nbytes
    return total
