"""The engine's recorded steps (StepRun: a graph replayed, or direct launches), each under a GraphKey that names
everything it baked in, in one cache with one eviction rule per kind:
- BODY: a state's decode body (one row; its parts' pointers and context bucket). Kept on the state (st.graph),
  one per variant (key choice, taps), so it is released with the state; replaced when it no longer fits.
- HEAD: the head (and the sampler), one per sampling setting; the HEAD_GRAPHS most recently used kept.
- ROWS: a multi-row step (its rows' states and buckets); the ROWS_GRAPHS most recently used kept.
A workspace growth (ds4py/cuda/workspaces.py) drops the kinds recorded on it; a key never matches a graph
recorded on another workspace version or launch mode (pdl, graphs)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from ds4py.cuda.step_run import StepRun

BODY, HEAD, ROWS_STEP = "body", "head", "rows"
HEAD_GRAPHS = 8             # head graphs kept (one per sampling setting; least recently used dropped)
ROWS_GRAPHS = 32            # ROWS step graphs kept (one per rows' states and buckets; least recently used dropped)


@dataclass(frozen=True)
class GraphKey:
    kind: str                               # BODY, HEAD or ROWS_STEP
    workspace: int                          # the version of the workspace it was recorded on
    launch: tuple[bool, bool]               # (pdl, graphs) it was recorded under
    buckets: tuple[int, ...] = ()           # per row its context bucket (BODY: the state's one)
    states: tuple = ()                      # ROWS_STEP: per row its state's parts as ((address, rows), ...)
    generation: int = 0                     # BODY: the state's generation (bumped when a part moves)
    keys: tuple | None = None               # per row the official decode bug's key choice (sorted (layer, owner))
    taps: bool = False                      # with the DSpark taps
    sampling: tuple | None = None           # HEAD: the sampler's values (None: the head alone)

    @property
    def bucket(self) -> int:
        return self.buckets[0]


class GraphCache:
    def __init__(self, store: Any):
        self.store = store
        self._lru: dict[str, OrderedDict[GraphKey, StepRun]] = {HEAD: OrderedDict(), ROWS_STEP: OrderedDict()}
        self._limit = {HEAD: HEAD_GRAPHS, ROWS_STEP: ROWS_GRAPHS}

    # ---- HEAD and ROWS_STEP: exact keys, least recently used dropped ------------------------------------------
    def get(self, key: GraphKey) -> StepRun | None:
        lru = self._lru[key.kind]
        run = lru.get(key)
        if run is not None:
            lru.move_to_end(key)
        return run

    def put(self, key: GraphKey, run: StepRun) -> StepRun:
        lru = self._lru[key.kind]
        lru[key] = run
        while len(lru) > self._limit[key.kind]:
            self.store.retire([lru.popitem(last=False)[1]])
        return run

    def count(self, kind: str) -> int:
        return len(self._lru[kind])

    def drop(self, kind: str) -> None:
        """Retire every graph of `kind` (their workspace moved)."""
        lru = self._lru.get(kind)
        if lru:
            self.store.retire(list(lru.values()))
            lru.clear()

    # ---- BODY: one per state and variant, on the state ---------------------------------------------------------
    @staticmethod
    def body_of(st: Any, key: GraphKey) -> StepRun | None:
        """The state's body of key's variant (key choice, taps), current or not."""
        return next((r for r in st.graph if r is not None and (r.tag.keys, r.tag.taps) == (key.keys, key.taps)),
                    None)

    @staticmethod
    def fits(run: StepRun, key: GraphKey) -> bool:
        """The body serves `key`: recorded under the same workspace, generation and launch mode, in a bucket
        holding key's (a row keeps its bucket once grown)."""
        return run.tag.bucket >= key.bucket and replace(run.tag, buckets=key.buckets) == key

    def put_body(self, st: Any, run: StepRun, stale: StepRun | None) -> StepRun:
        if stale is not None:
            self.store.retire([stale])
            st.graph.remove(stale)
        if st.graph == [None]:
            st.graph[0] = run
        else:
            st.graph.append(run)
        return run

    def close(self) -> None:
        for kind in self._lru:
            self.drop(kind)
