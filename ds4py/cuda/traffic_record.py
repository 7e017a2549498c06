"""The recording half of the traffic profile (ds4py/cuda/traffic.py is the report and its tool): the emulator's
traffic build hands each launch's counters here (emu.py), apart from the tool that runs the emulator, so the
emulator and its profile do not import each other. Records go to `RECORDS` (while `collect()` is open) and, when
DS4PY_EMU_TRAFFIC names a file, one JSON line per launch to it."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Sequence

# The counters of one argument, in cu/emu/emu_check.h's order (traffic::L_REQ ... S_LINES).
ARG_COUNTERS = ("requests", "requested_bytes", "distinct_bytes", "sectors", "lines", "unique_bytes",
                "block_unique_bytes", "pre_pdl_bytes",
                "store_requests", "store_requested_bytes", "store_distinct_bytes", "store_sectors", "store_lines",
                "unique_sectors")
# Which const pointer parameters of cu/*.cu hold model weights (a parameter name, the same across kernels): the
# report's `weight` flag and its findings. The twin tests upload activations into the arena's weights region too,
# so where the bytes live does not tell.
WEIGHT_PARAMS = frozenset({"W", "W0", "W1", "W2", "W3", "Wg", "Wu", "w", "weight", "codes", "scales", "table",
                           "ape", "norm_w", "k_norm", "bias", "sinks", "fn", "scale", "base"})
SMEM_COUNTERS = ("requests", "wavefronts", "ideal_wavefronts")

RECORDS: list[dict] | None = None


@contextlib.contextmanager
def collect() -> Iterator[list[dict]]:
    """The launch records of the traffic build made inside the block."""
    global RECORDS
    outer, RECORDS = RECORDS, []
    try:
        yield RECORDS
    finally:
        RECORDS = outer


def record(rec: dict) -> None:
    if RECORDS is not None:
        RECORDS.append(rec)
    path = os.environ.get("DS4PY_EMU_TRAFFIC")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def derive_arg(c: dict) -> dict:
    """The ratios of one argument's counters (added to a copy)."""
    out = dict(c)
    out["coalescing"] = _ratio(c["distinct_bytes"], 32 * c["sectors"])
    out["line_efficiency"] = _ratio(c["distinct_bytes"], 128 * c["lines"])
    out["reread"] = _ratio(c["distinct_bytes"], c["unique_bytes"])
    out["reread_blocks"] = _ratio(c["block_unique_bytes"], c["unique_bytes"])
    out["coverage"] = _ratio(c["unique_bytes"], c["arg_bytes"])
    out["dram_efficiency"] = _ratio(c["unique_bytes"], 32 * c["unique_sectors"])
    out["store_coalescing"] = _ratio(c["store_distinct_bytes"], 32 * c["store_sectors"])
    return out


def derive_smem(c: dict) -> dict:
    out = dict(c)
    out["conflict_factor"] = _ratio(c["wavefronts"], c["ideal_wavefronts"])
    return out


def launch_record(kernel: str, grid: Sequence[int], block: Sequence[int], smem_bytes: int, groups: Sequence[Any],
                  counters: Sequence[int]) -> dict:
    """One launch's record from the library's counters (groups: emu._Group, one per distinct argument buffer)."""
    n = len(ARG_COUNTERS)
    args = {}
    for i, g in enumerate(groups):
        c = dict(zip(ARG_COUNTERS, counters[i * n:(i + 1) * n]))
        c.update(arg_bytes=g.nbytes, weight=not g.writes and any(nm in WEIGHT_PARAMS for nm in g.names),
                 readonly_source=bool(g.weight), written=bool(g.writes))
        args["=".join(g.names)] = derive_arg(c)
    base = len(groups) * n
    load = dict(zip(SMEM_COUNTERS, counters[base:base + 3]))
    store = dict(zip(SMEM_COUNTERS, counters[base + 3:base + 6]))
    both = {k: load[k] + store[k] for k in SMEM_COUNTERS}
    smem = derive_smem(both)
    smem["load"], smem["store"] = derive_smem(load), derive_smem(store)
    return {"kernel": kernel, "grid": list(grid), "block": list(block), "smem_bytes": int(smem_bytes),
            "args": args, "smem": smem}
