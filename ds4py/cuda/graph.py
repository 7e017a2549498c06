"""CUDA graphs for a decode step: capture once, replay many times.

A step's launches (main stream, plus side-stream work forked and joined with events) are captured into a graph
and instantiated once. What changes from step to step (token id, position, ...) lives in a small device slot of
int32 values that the captured kernels read; `replay(values)` writes the slot with cuMemsetD32Async on the main
stream (a launch parameter, so no host buffer can be overwritten under a pending copy) and launches the graph.
Replay never re-captures, except when the arena's scratch has moved (its generation changed): the graph holds
raw pointers, so it is captured again.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ds4py.cuda.driver import api, call
from ds4py.cuda.memory import Arena, DeviceArray
from ds4py.cuda.runtime import Runtime
from ds4py.errors import Ds4Error


class StepGraph:
    def __init__(self, rt: Runtime, record: Callable[[], None], slot: DeviceArray, arena: Arena | None = None):
        """record() issues the step's launches on rt.main (and rt.side between rt.fork()/rt.join()); it runs
        once per capture, never per replay. slot: int32 device array the kernels read the step values from."""
        if np.dtype(slot.dtype) != np.int32:
            raise Ds4Error("the step slot must be an int32 device array")
        self.rt, self.record, self.slot, self.arena = rt, record, slot, arena
        self.graph: Any = None
        self.exec: Any = None
        self.generation = -1
        self.captures = 0

    def _stale(self) -> bool:
        return self.exec is None or (self.arena is not None and self.arena.generation != self.generation)

    def capture(self) -> None:
        d = api()
        self._destroy()
        call("cuStreamBeginCapture", self.rt.main, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        try:
            self.record()
        except BaseException:
            try:  # leave the stream usable
                g = call("cuStreamEndCapture", self.rt.main)
                call("cuGraphDestroy", g)
            except Exception:
                pass
            raise
        self.graph = call("cuStreamEndCapture", self.rt.main)
        self.exec = call("cuGraphInstantiate", self.graph, 0)
        self.generation = self.arena.generation if self.arena is not None else 0
        self.captures += 1

    def write_slot(self, values: Sequence[int]) -> None:
        if len(values) > self.slot.size:
            raise Ds4Error(f"{len(values)} step values do not fit the {self.slot.size}-entry slot")
        for i, v in enumerate(values):
            v = int(v)
            if not -2**31 <= v < 2**31:
                raise Ds4Error(f"step value {v} does not fit in int32")
            call("cuMemsetD32Async", self.slot.ptr + 4 * i, v & 0xFFFFFFFF, 1, self.rt.main)

    def replay(self, values: Sequence[int] = ()) -> None:
        """Write the step values, then launch the graph on the main stream (capturing first if needed)."""
        if self._stale():
            self.capture()
        self.write_slot(values)
        call("cuGraphLaunch", self.exec, self.rt.main)

    def _destroy(self) -> None:
        if self.exec is not None:
            call("cuGraphExecDestroy", self.exec)
            self.exec = None
        if self.graph is not None:
            call("cuGraphDestroy", self.graph)
            self.graph = None

    def close(self) -> None:
        self._destroy()
