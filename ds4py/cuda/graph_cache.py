"""The recorded steps (StepRun: a graph replayed, or direct launches), each under a GraphKey (step_run.py) that
names everything it baked in, in one cache with one eviction rule per kind:
- BODY: a state's decode body (one row; its parts' pointers and context bucket). Kept on the state (st.graph),
  one per variant (key choice, taps), so it is released with the state; replaced when it no longer fits.
- HEAD: the head (and the sampler), one per sampling setting; the HEAD_GRAPHS most recently used kept.
- ROWS_STEP: a multi-row step (its rows' states and buckets); the ROWS_GRAPHS most recently used kept.
- MTP_STEP: an MTP block step (its rows' states, with or without the head); the MTP_GRAPHS most recently used.
- DSPARK_BLOCK: a DSpark draft call (its state's rings); the DSPARK_GRAPHS most recently used kept.
The engine's runner has one cache, each draft one of its own (its graphs bake in its own weights and workspace).
A workspace growth (ds4py/cuda/workspaces.py) drops the kinds recorded on it; a key never matches a graph
recorded on another workspace version or launch mode (pdl, graphs)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable

from ds4py.cuda.step_run import (BODY, DSPARK_BLOCK, HEAD, MTP_STEP, ROWS_STEP, GraphKey,  # noqa: F401 (re-exported)
                                 StepRun)

HEAD_GRAPHS = 8             # head graphs kept (one per sampling setting; least recently used dropped)
ROWS_GRAPHS = 32            # ROWS step graphs kept (one per rows' states and buckets; least recently used dropped)
MTP_GRAPHS = 16             # MTP step graphs kept (per rows' states, row count and head)
DSPARK_GRAPHS = 8           # DSpark block graphs kept (one per ring state)
LIMITS = {HEAD: HEAD_GRAPHS, ROWS_STEP: ROWS_GRAPHS, MTP_STEP: MTP_GRAPHS, DSPARK_BLOCK: DSPARK_GRAPHS}


class GraphCache:
    def __init__(self, store: Any):
        self.store = store
        self._lru: dict[str, OrderedDict[GraphKey, StepRun]] = {kind: OrderedDict() for kind in LIMITS}

    # ---- every kind but BODY: exact keys, least recently used dropped -----------------------------------------
    def get(self, key: GraphKey) -> StepRun | None:
        lru = self._lru[key.kind]
        run = lru.get(key)
        if run is not None:
            lru.move_to_end(key)
        return run

    def put(self, key: GraphKey, run: StepRun) -> StepRun:
        lru = self._lru[key.kind]
        lru[key] = run
        while len(lru) > LIMITS[key.kind]:
            self.store.retire([lru.popitem(last=False)[1]])
        return run

    def second_use(self, key: GraphKey, make: Callable[[], StepRun]) -> StepRun:
        """The run of `key`: seen before, captured from now on (use_graph); else `make()`'s, kept (direct
        launches its first time: a row set seen once, such as a one-off catch-up, is not worth a capture)."""
        run = self.get(key)
        if run is not None:
            run.use_graph()
            return run
        return self.put(key, make())

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
