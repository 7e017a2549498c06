"""How the CUDA engine runs a step, as one frozen value (docs/cuda.md "The engine"): CudaModel(options=...),
model.options = model.options.but(multirow=False) between steps, or `with temporarily(model, multirow=False):`.
Every graph the engine caches is keyed by what it baked in (ds4py/cuda/graphs.py), so a changed option never
replays a graph recorded under another. Also what a step returns beside the logits (Outputs) and the context
buckets a row runs in (bucket_for)."""

from __future__ import annotations

import enum
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator

from ds4py.cuda.layer import MAX_BLOCK
from ds4py.errors import Ds4Error

MIN_BUCKET = 256            # smallest context bucket (positions); buckets double up to the context length


@dataclass(frozen=True)
class EngineOptions:
    pdl: bool = True                    # programmatic dependent launches
    graphs: bool = True                 # graph replay (False: direct launches, the bit-identity reference)
    multirow: bool = True               # several short rows per step as one ROWS row set
    prefill_blocks: bool = True         # chunks longer than the rollback horizon + 1 as BLOCK row sets
    prefill_block: int = MAX_BLOCK      # tokens per prefill block (1 .. MAX_BLOCK)
    prefill_mma: bool = True            # prefill dense products on tensor cores ...
    prefill_x_pieces: int = 3           # ... x as 3 bf16 pieces: exact (1: bf16 x)
    prefill_expert_mma: bool = False    # the experts too (bf16 x, h: less exact)
    # VQ-8 experts (every layer of a VQ file) take their own option: cu/moe_prefill.cu's VQ kernels keep x and h
    # exact (three bf16 pieces), so on tensor cores by default (False: the exact grouped rows kernels). Either
    # option holds up to the route kernel's MAX_EXPERTS (512; V4 Flash 256, V4.1 384), past it the rows kernels
    prefill_vq_expert_mma: bool = True
    # the exact GGML-format experts of a prefill block as fp32 token tiles grouped by expert (each expert's weights
    # read once per tile of its tokens; every (token, slot) result the decode kernels' bits, the slots summed in order
    # by the combine); False: the grouped rows kernels (weights read once per 1,024 pairs)
    prefill_expert_tiles: bool = True
    min_bucket: int = MIN_BUCKET        # smallest context bucket (small in tests: a bucket growth in few tokens)

    def __post_init__(self) -> None:
        for name in ("prefill_block", "prefill_x_pieces", "min_bucket"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise Ds4Error(f"engine option {name} must be a positive integer, got {v!r}")
        if self.prefill_x_pieces not in (1, 3):
            raise Ds4Error(f"engine option prefill_x_pieces must be 1 or 3, got {self.prefill_x_pieces}")

    def but(self, **changes: Any) -> "EngineOptions":
        """These options with `changes` (unknown names refused by dataclasses.replace)."""
        return replace(self, **changes)

    @property
    def launch(self) -> tuple[bool, bool]:
        """(pdl, graphs): what a recorded step's launches depend on."""
        return (self.pdl, self.graphs)


@contextmanager
def temporarily(model: Any, **changes: Any) -> Iterator[EngineOptions]:
    """model.options with `changes` inside the block, restored after it."""
    keep = model.options
    model.options = keep.but(**changes)
    try:
        yield model.options
    finally:
        model.options = keep


class Outputs(enum.Flag):
    """What a step returns per row beside the logits."""
    NONE = 0
    HIDDEN = enum.auto()       # the final residual X [hc, D] (the head's input, the MTP block's input)
    TAPS = enum.auto()         # the DSpark taps [n_targets * D] (V4.1's draft input)


def bucket_for(n_positions: int, context_length: int, min_bucket: int = MIN_BUCKET) -> int:
    """The context bucket holding positions [0, n_positions): a power of two >= min_bucket, at most the context."""
    b = min_bucket
    while b < n_positions:
        b *= 2
    return max(n_positions, min(b, context_length))
