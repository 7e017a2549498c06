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


class Waiting:
    """A line that says what a silent wait is (`reading the prompt (812 tokens)... 12 s`), drawn on a terminal
    only once the wait has lasted `delay` seconds, updated every second, and cleared by done() (or on exit).

        with Waiting("reading the prompt (812 tokens)") as w:
            for ev in generate(...):
                w.done()            # the first token: the wait is over
    """

    def __init__(self, what: str, *, stream: TextIO | None = None, enabled: bool | None = None,
                 delay: float = 1.0):
        import threading

        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.delay = delay
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._drawn = False
        self._thread = threading.Thread(target=self._run, name="ds4py-waiting", daemon=True) if self.enabled else None

    def _run(self) -> None:
        t0 = time.monotonic()
        if self._stop.wait(self.delay):
            return
        while True:
            with self._lock:
                if self._stop.is_set():
                    return
                self.stream.write(f"\r[{self.what}... {time.monotonic() - t0:.0f} s]")
                self.stream.flush()
                self._drawn = True
            if self._stop.wait(1.0):
                return

    def __enter__(self) -> "Waiting":
        if self._thread is not None:
            self._thread.start()
        return self

    def done(self) -> None:
        if self._stop.is_set():
            return
        with self._lock:
            self._stop.set()
            if self._drawn:
                width = shutil.get_terminal_size((100, 20)).columns
                self.stream.write("\r" + " " * (width - 1) + "\r")
                self.stream.flush()
                self._drawn = False

    def __exit__(self, *exc) -> None:
        self.done()


def size_text(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _duration(s: float) -> str:
    s = int(s)
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"


class Transfer:
    """Progress of a long byte transfer (a download, a checksum, a model upload): on a terminal a bar with the bytes,
    the rate and the time left; elsewhere (a log, the journal) one line every `every` seconds. `initial`: bytes
    already there (a resumed download), shown as done but not counted in the rate.

        t = Transfer("pull v4-flash-q2", total, initial=resumed)
        t.update(done)
        t.close()             # clears the bar; the caller prints its summary
    """

    def __init__(self, label: str, total: int, *, initial: int = 0, stream: TextIO | None = None,
                 tty: bool | None = None, every: float = 60.0, min_interval: float = 0.2):
        self.label, self.total, self.initial = label, max(int(total), 1), int(initial)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every = every if not self.tty else min_interval
        self.t0 = time.monotonic()
        self._last = self.t0
        self.done = self.initial
        self._drawn = False

    def rate(self) -> float:
        """Bytes per second moved by this run."""
        return (self.done - self.initial) / max(time.monotonic() - self.t0, 1e-9)

    def text(self) -> str:
        rate = self.rate()
        left = (self.total - self.done) / rate if rate > 0 else None
        return (f"{size_text(self.done)} of {size_text(self.total)} ({100 * self.done / self.total:.0f}%), "
                f"{size_text(rate)}/s, {_duration(left) + ' left' if left is not None else 'starting'}")

    def update(self, done: int) -> None:
        self.done = int(done)
        now = time.monotonic()
        if now - self._last < self.every and self.done < self.total:
            return
        self._last = now
        if not self.tty:
            self.stream.write(f"{self.label}: {self.text()}\n")
            self.stream.flush()
            return
        width = shutil.get_terminal_size((100, 20)).columns
        tail = " " + self.text()
        cells = max(10, min(40, width - len(self.label) - len(tail) - 4))
        filled = int(min(self.done / self.total, 1.0) * cells)
        line = f"{self.label} [{'#' * filled}{'.' * (cells - filled)}]{tail}"
        self.stream.write("\r" + line[: width - 1].ljust(width - 1))
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.tty and self._drawn:
            width = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + " " * (width - 1) + "\r")
            self.stream.flush()
            self._drawn = False


class LoadMeter:
    """The model load in progress in this process: the weight bytes uploaded of the total. The CUDA engine's
    upload feeds it (ds4py/cuda/gguf_upload.py); the server's /health reads it ("loading", 42%). Thread-safe: the
    load runs on its own thread."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.label, self.done, self.total, self.t0, self.t1 = "", 0, 0, 0.0, 0.0

    def begin(self, label: str, total: int) -> None:
        with self._lock:
            self.label, self.done, self.total, self.t0, self.t1 = label, 0, int(total), time.monotonic(), 0.0

    def add(self, n: int) -> None:
        with self._lock:
            self.done += int(n)

    def end(self) -> None:
        with self._lock:
            self.t1 = time.monotonic()

    def snapshot(self) -> dict | None:
        """{"label", "done", "total", "fraction", "rate" (bytes/s), "seconds"} or None before any upload."""
        with self._lock:
            if not self.total:
                return None
            elapsed = (self.t1 or time.monotonic()) - self.t0
            return {"label": self.label, "done": self.done, "total": self.total,
                    "fraction": min(self.done / self.total, 1.0), "rate": self.done / max(elapsed, 1e-9),
                    "seconds": elapsed}


LOAD = LoadMeter()
