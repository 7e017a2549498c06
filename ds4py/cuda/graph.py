"""CUDA graphs for a decode step: capture once, replay many times.

A step's launches (main stream, plus side-stream work forked and joined with events) are captured into a graph
and instantiated once. What changes from step to step (token id, position, ...) lives in a small device slot of
int32 values that the captured kernels read; `replay(values)` writes the slot on the main
stream (one asynchronous copy from a fresh pageable array, which the driver stages before the call returns, so
no host buffer can be overwritten under a pending copy) and launches the graph.
Replay never re-captures, except when the arena's scratch has moved (its generation changed): the graph holds
raw pointers, so it is captured again.

The runtime does the capturing (Runtime: cuStreamBeginCapture ... cuGraphInstantiate; EmuRuntime: a recorded
list of launches replayed on the CPU), so the same StepGraph drives both.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ds4py.cuda.memory import Arena, DeviceArray
from ds4py.errors import Ds4Error


class CaptureError(Ds4Error):
    """A graph capture failed (the step's recording raised, or the runtime invalidated the capture)."""


class StepGraph:
    def __init__(self, rt: Any, record: Callable[[], None], slot: DeviceArray, arena: Arena | None = None):
        """record() issues the step's launches on rt.main (and rt.side between rt.fork()/rt.join()); it runs
        once per capture, never per replay. slot: int32 device array the kernels read the step values from.
        rt: a Runtime or an EmuRuntime."""
        if np.dtype(slot.dtype) != np.int32:
            raise Ds4Error("the step slot must be an int32 device array")
        self.rt, self.record, self.slot, self.arena = rt, record, slot, arena
        self.graph: Any = None
        self.generation = -1
        self.captures = 0

    def _stale(self) -> bool:
        return self.graph is None or (self.arena is not None and self.arena.generation != self.generation)

    def capture(self) -> None:
        """Record the step into a fresh graph. A failure in record() or in the capture itself raises (the
        stream is taken out of capture mode first); nothing half-captured is ever kept or replayed."""
        self._destroy()
        self.rt.begin_capture()
        try:
            self.record()
        except BaseException as e:
            try:
                self.rt.abort_capture()
            except Exception as cleanup:      # the capture is unusable and the stream may be too: say both
                raise CaptureError(f"graph capture failed ({type(e).__name__}: {e}) and the stream could not "
                                   f"leave capture mode ({cleanup})") from e
            raise
        try:
            self.graph = self.rt.end_capture()
        except Ds4Error as e:
            raise CaptureError(f"graph capture failed: {e}") from e
        self.generation = self.arena.generation if self.arena is not None else 0
        self.captures += 1

    def write_slot(self, values: Sequence[int]) -> None:
        if len(values) > self.slot.size:
            raise Ds4Error(f"{len(values)} step values do not fit the {self.slot.size}-entry slot")
        words = []
        for v in values:
            v = int(v)
            if not -2**31 <= v < 2**31:
                raise Ds4Error(f"step value {v} does not fit in int32")
            words.append(v)
        if words:       # one copy of all values, queued on the main stream (staged by the driver at once)
            self.slot.memory.upload_staged(self.slot.ptr, np.asarray(words, np.int32), self.rt.main)

    def replay(self, values: Sequence[int] = ()) -> None:
        """Write the step values, then launch the graph on the main stream (capturing first if needed)."""
        if self._stale():
            self.capture()
        self.write_slot(values)
        self.rt.launch_graph(self.graph)

    def _destroy(self) -> None:
        if self.graph is not None:
            g, self.graph = self.graph, None
            self.rt.destroy_graph(g)

    def close(self) -> None:
        self._destroy()
