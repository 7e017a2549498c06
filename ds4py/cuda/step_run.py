"""StepRun: one recorded step of the CUDA engine (a body, a head, a multi-row step, an MTP or DSpark draft call),
captured into a StepGraph and replayed, or launched directly, under the GraphKey naming everything it baked in;
beside the graphs, so the drafts use it without importing the engine. `model` is the CudaModel it runs on (its
runtime, weights' arena, slot, pdl and graphs switches). graph_cache.GraphCache keeps StepRuns by their keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ds4py.cuda.graph import StepGraph
from ds4py.cuda.kernels import Launcher
from ds4py.cuda.memory import DeviceArray

# the kinds of recorded steps (GraphKey.kind); graph_cache.py keeps each kind under its own rule
BODY, HEAD, ROWS_STEP = "body", "head", "rows"      # the engine's (row_sets.py)
MTP_STEP, DSPARK_BLOCK = "mtp", "dspark"            # the drafts' (mtp.py, dspark.py)


@dataclass(frozen=True)
class GraphKey:
    """What a recorded step baked in: a run is replayed only for an equal key (BODY: graph_cache.fits)."""
    kind: str                               # BODY, HEAD, ROWS_STEP, MTP_STEP or DSPARK_BLOCK
    workspace: int                          # the version of the workspace it was recorded on
    launch: tuple[bool, bool]               # (pdl, graphs) it was recorded under
    buckets: tuple[int, ...] = ()           # per row its context bucket (BODY, DSPARK_BLOCK: the state's one)
    states: tuple = ()                      # ROWS_STEP, MTP_STEP: per row its state's parts as ((address, rows),
                                            # ...) (parts_of); DSPARK_BLOCK: the one state's
    generation: int = 0                     # BODY: the state's generation (bumped when a part moves)
    keys: tuple | None = None               # per row the official decode bug's key choice (sorted (layer, owner))
    taps: bool = False                      # with the DSpark taps
    sampling: tuple | None = None           # HEAD: the sampler's values (None: the head alone)
    head: bool = False                      # MTP_STEP: with the block's head (the draft logits)

    @property
    def bucket(self) -> int:
        return self.buckets[0]


def parts_of(st: Any) -> tuple[tuple[int, int], ...]:
    """A state's parts as a graph bakes them in: (address, rows) per part, in the layout's order."""
    return tuple((a.ptr, a.shape[0]) for a in st.arrays.values())


class StepRun:
    """One recorded step (GraphKey.kind): captured into a graph and replayed, or launched directly each time
    (graphs=False). `launches` counts the kernels of one run."""

    def __init__(self, model: Any, record: Callable[[Launcher], None], tag: GraphKey,
                 slot: DeviceArray | None = None, graph: bool = True):
        """tag: what the run baked in (its GraphKey). graph=False: direct launches until use_graph() (a row set
        seen once is not worth a capture)."""
        self.model, self._record, self.tag = model, record, tag
        self.slot = model.slot if slot is None else slot
        self.mode = (model.pdl, model.graphs)
        self.launches = 0
        self.side_launches = 0
        self.graph: StepGraph | None = None
        if graph:
            self.use_graph()

    def use_graph(self) -> None:
        """Capture on the next run and replay from then on (when the model runs with graphs)."""
        if self.graph is None and self.mode[1]:
            self.graph = StepGraph(self.model.rt, self._capture, self.slot, self.model.w.arena)

    def _capture(self) -> None:
        ls = Launcher(self.model.rt, self.model.pdl)
        self._record(ls)
        self.launches, self.side_launches = ls.launches, ls.side_launches

    def run(self, values: Sequence[int]) -> None:
        if self.graph is not None:
            self.graph.replay(values)
        else:
            for i, v in enumerate(values):
                self.slot.memory.memset_d32(self.slot.ptr + 4 * i, int(v), 1, self.model.rt.main)
            self._capture()

    def count(self) -> tuple[int, int]:
        """(kernels, of which on the side stream) one run launches: the recording against a runtime that only
        counts (no capture, no launch)."""
        ls = Launcher(_CountingRuntime(self.model.rt), self.model.pdl)
        self._record(ls)
        return ls.launches, ls.side_launches

    @property
    def captures(self) -> int:
        return self.graph.captures if self.graph is not None else 0

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()


class _CountingRuntime:
    """The runtime's streams and device limits, launches that do nothing: what launches_per_step records on."""

    def __init__(self, rt: Any):
        self.device, self.profile, self.main, self.side = rt.device, rt.profile, rt.main, rt.side

    def launch(self, *args: Any, **kw: Any) -> None:
        pass

    def fork(self) -> None:
        pass

    def join(self) -> None:
        pass
