"""The planner: which row sets a step of chunks runs as, from the chunks' lengths and the engine options alone
(no device, no state), so a reader or a test sees a step's grouping without running it."""

from __future__ import annotations

from typing import NamedTuple, Sequence

from ds4py.cuda.layer import BLOCK, DECODE, MAX_ROWS, ROWS
from ds4py.cuda.options import EngineOptions


class RowSetPlan(NamedTuple):
    mode: str                  # ROWS, BLOCK or DECODE (ds4py/cuda/layer.py)
    chunks: list[int]          # the indices of the step's chunks it holds, in order


def plan(lengths: Sequence[int], options: EngineOptions, rollback_horizon: int) -> list[RowSetPlan]:
    """The row sets a step of chunks of these lengths runs as, in order.

    ROWS: short chunks (at most rollback horizon + 1 positions; a decode row, a verify) packed in order into
    multi-row steps of 2 to MAX_ROWS rows; BLOCK: a prompt (a chunk longer than the rollback horizon + 1) in
    prefill blocks; DECODE: a chunk on its own, position by position through its state's decode graph (one
    row; or a short chunk with multirow off). Sequences are independent, so the grouping changes no row's
    bits: every row is bit-identical to its single-row step."""
    lens = list(lengths)
    limit = rollback_horizon + 1
    if options.multirow and 2 <= sum(lens) <= MAX_ROWS and all(n <= limit for n in lens):
        return [RowSetPlan(ROWS, list(range(len(lens))))]

    def alone(i: int) -> RowSetPlan:
        return RowSetPlan(BLOCK if options.prefill_blocks and lens[i] > limit else DECODE, [i])

    short = min(limit, MAX_ROWS)
    if not options.multirow or len(lens) < 2 or sum(n for n in lens if n <= short) < 2:
        return [alone(i) for i in range(len(lens))]
    out: list[RowSetPlan] = []
    group: list[int] = []

    def flush() -> None:
        if group:
            out.append(RowSetPlan(ROWS, list(group)) if sum(lens[i] for i in group) >= 2 else alone(group[0]))
            group.clear()

    for i, n in enumerate(lens):
        if n > short:
            out.append(alone(i))
            continue
        if sum(lens[j] for j in group) + n > MAX_ROWS:
            flush()
        group.append(i)
    flush()
    return out
