"""A one-line progress bar for long waits (writing a GGUF, generating the demo model, a slow prefill).

It draws only on a terminal (rewriting its line with carriage returns): logs, pipes and `--json` output get
nothing from it, so callers print their own one-line summary when the work is done.

    bar = Bar("writing model.gguf", total_bytes, unit="MiB", scale=2**20)
    for ...: bar.update(done, note=name)
    bar.close()
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO


class Bar:
    def __init__(self, label: str, total: float, *, unit: str = "", scale: float = 1.0,
                 stream: TextIO | None = None, enabled: bool | None = None, min_interval: float = 0.1):
        self.label, self.total, self.unit, self.scale = label, max(float(total), 1e-9), unit, scale
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.t0 = self._last = time.monotonic()
        self.min_interval = min_interval
        self.drawn = False

    def update(self, done: float, note: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.min_interval and done < self.total:
            return
        self._last = now
        frac = min(max(done / self.total, 0.0), 1.0)
        width = shutil.get_terminal_size((100, 20)).columns
        amount = (f" {done / self.scale:.1f}/{self.total / self.scale:.1f} {self.unit}".rstrip()
                  if self.unit else "")
        head = f"{self.label} {frac * 100:3.0f}%"
        tail = f"{amount} {now - self.t0:.0f}s"
        cells = max(10, min(40, width - len(head) - len(tail) - 6 - min(len(note), 30)))
        filled = int(frac * cells)
        line = f"{head} [{'#' * filled}{'.' * (cells - filled)}]{tail}"
        if note:
            line += " " + note[: max(0, width - len(line) - 2)]
        self.stream.write("\r" + line[: width - 1].ljust(width - 1))
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        """Clear the bar's line (the caller prints its summary in its place)."""
        if self.enabled and self.drawn:
            width = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + " " * (width - 1) + "\r")
            self.stream.flush()
            self.drawn = False

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.t0
