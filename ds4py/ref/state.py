"""The reference engine's per-sequence KV state: the declared parts (ds4py.kv.state_layout) as numpy arrays.

Rings are allocated whole; emitted rows (comp_rows, idx_keys) grow by doubling with the rows actually used.
The counters and the rollback rule are ds4py.kv.StateCounters (shared with every backend).
"""

from __future__ import annotations

import numpy as np

from ds4py.kv import RING, StateCounters, StateLayout, grown_capacity


class RefState(StateCounters):
    def __init__(self, layout: StateLayout):
        super().__init__(layout)
        self.arrays: dict[str, np.ndarray] = {
            p.key: np.zeros((p.capacity, p.width), p.dtype) for p in layout.parts}
        self._parts = {p.key: p for p in layout.parts}

    # ---- what the forward reads and writes ------------------------------------------------------------------
    def ring(self, layer: int, name: str) -> np.ndarray:
        """A ring part: position p lives in slot p % len(ring)."""
        return self.arrays[f"{layer}.{name}"]

    def rows(self, layer: int, name: str, n: int) -> np.ndarray:
        """A rows part with room for at least n rows (the capacity doubles)."""
        key = f"{layer}.{name}"
        a = self.arrays[key]
        if n > a.shape[0]:
            grown = np.zeros((grown_capacity(a.shape[0], n), a.shape[1]), a.dtype)
            grown[: a.shape[0]] = a
            self.arrays[key] = a = grown
        return a

    def view(self, layer: int, name: str) -> np.ndarray:
        """The valid rows of a part in position order (a ring: the positions still held, oldest first)."""
        p = self._parts[f"{layer}.{name}"]
        a = self.arrays[p.key]
        if p.kind != RING:
            return a[: self.n_tokens // p.period]
        pos = np.arange(max(0, self.n_written - p.capacity), self.n_tokens)
        return a[pos % p.capacity]

    # ---- the State contract -----------------------------------------------------------------------------------
    def copy(self) -> "RefState":
        out = RefState.__new__(RefState)
        out.layout, out._parts = self.layout, self._parts
        out.n_tokens, out.n_written = self.n_tokens, self.n_written
        out.arrays = {k: a.copy() for k, a in self.arrays.items()}
        return out

    def nbytes(self) -> int:
        """Bytes held: every ring and the allocated capacity of the rows parts."""
        return sum(a.nbytes for a in self.arrays.values())

    def export(self) -> dict[str, np.ndarray]:
        """Per part what a saved state holds: a ring's slots, a rows part's n_tokens // period rows."""
        return {p.key: self.arrays[p.key][: p.rows_for(self.n_tokens)] for p in self.layout.parts}

    @classmethod
    def from_parts(cls, layout: StateLayout, n_tokens: int, n_written: int,
                   arrays: dict[str, np.ndarray]) -> "RefState":
        st = cls(layout)
        st.n_tokens, st.n_written = n_tokens, n_written
        for p in layout.parts:
            a = arrays[p.key]
            if p.kind == RING:
                st.arrays[p.key] = a
            elif len(a):
                st.rows(p.layer, p.name, len(a))[: len(a)] = a
        return st


class RefDraftStates:
    """The state methods of the reference backend's draft models (RefMtp, RefDSpark; contract.DraftBase): a
    RefState of the draft's layout."""

    layout: StateLayout

    def new_state(self) -> RefState:
        return RefState(self.layout)

    def owns(self, state) -> bool:
        return isinstance(state, RefState) and state.layout == self.layout

    def _export(self, state: RefState) -> dict[str, np.ndarray]:
        return state.export()

    def _import(self, n_tokens: int, n_written: int, arrays: dict[str, np.ndarray]) -> RefState:
        return RefState.from_parts(self.layout, n_tokens, n_written, arrays)
