"""A sequence's KV state in device memory: exactly the declared layout (ds4py.kv.state_layout), one float32
array per part, in the runtime's memory (outside the arena: a state outlives every step and is freed with the
state).

Rings (the window, the compressors' input rings) are allocated whole in one block and zeroed, as the reference's
are, so that a saved state holds the same bytes. Rows parts (compressed rows, indexer keys) start empty and grow
by doubling (kv.grown_capacity) between steps, to the rows a context bucket can emit: the kernels read and write
them through raw pointers, so a growth moves the part and bumps the state's `generation`, which makes the engine
capture the state's decode graph again. V4.1's n-gram ring (the one int32 ring) also has a host mirror,
`host_rings`, which the Engram feed hashes from and writes first (so a step never downloads the ring): copy()
copies it, load() fills it from the same arrays as the device, truncate() touches neither (the ring is indexed by
position modulo its capacity, as on the device); the device ring stays the saved, exported one. A dropped state's
memory (and its graph) goes back to the DeviceStore, which releases it once the device is idle and no graph is
being captured (`reclaim`).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ds4py.cuda.memory import DeviceArray, align_up
from ds4py.kv import RING, StateCounters, StateLayout, grown_capacity

F32 = np.dtype(np.float32)


class DeviceBlock:
    """One device allocation; released through DeviceStore.retire, never directly (the device may still use it)."""

    def __init__(self, rt: Any, nbytes: int):
        self.rt, self.nbytes = rt, align_up(max(int(nbytes), 256))
        self.ptr = rt.memory.alloc(self.nbytes)

    def array(self, offset: int, shape: tuple[int, ...], dtype: Any = F32) -> DeviceArray:
        return DeviceArray(self.ptr + offset, tuple(int(s) for s in shape), np.dtype(dtype), False, self.rt.memory)

    def zero(self, stream: Any) -> None:
        self.array(0, (self.nbytes // 4,), np.uint32).fill_d32(0, stream)


class DeviceStore:
    """Where the engine's persistent device memory comes from and goes back to. `retire` takes blocks (and
    graphs) that may still be in use by queued work; `reclaim` frees them after a synchronize, outside captures."""

    def __init__(self, rt: Any):
        self.rt = rt
        self._retired: list = []

    def block(self, nbytes: int) -> DeviceBlock:
        return DeviceBlock(self.rt, nbytes)

    def retire(self, things: list) -> None:
        self._retired.extend(things)

    def reclaim(self) -> None:
        if not self._retired or getattr(self.rt, "capturing", False):
            return
        self.rt.synchronize()
        things, self._retired = self._retired, []
        for t in things:
            if isinstance(t, DeviceBlock):
                self.rt.memory.free(t.ptr)
            else:                                  # a StepGraph
                t.close()


class CudaState(StateCounters):
    """The State of docs/engine.md on the device. Made by CudaModel.new_state() / load_state()."""

    def __init__(self, layout: StateLayout, store: DeviceStore):
        super().__init__(layout)
        self.store = store
        rt = store.rt
        self.parts = {p.key: p for p in layout.parts}
        offs, at = {}, 0
        for p in layout.parts:
            if p.kind == RING:
                offs[p.key] = at
                at += align_up(p.capacity * p.width * 4)
        self._rings = store.block(at)
        self._rings.zero(rt.main)
        self.arrays: dict[str, DeviceArray] = {}
        self.host_rings: dict[str, np.ndarray] = {p.key: np.zeros((p.capacity, p.width), p.dtype)
                                                  for p in layout.parts if p.kind == RING and p.dtype == "<i4"}
        self._rows: dict[str, DeviceBlock | None] = {}
        for p in layout.parts:
            if p.kind == RING:
                self.arrays[p.key] = self._rings.array(offs[p.key], (p.capacity, p.width), p.dtype)
            else:
                self._rows[p.key] = None
                self.arrays[p.key] = DeviceArray(self._rings.ptr, (0, p.width), F32, False, rt.memory)
        self.generation = 0                      # bumped whenever a part moves (graphs hold its pointers)
        self.graph: list = [None]                # the engine's decode graphs of this state: [entry or None] (one
                                                 # per index-key choice with the official decode bug)
        self.busy = False                        # a generate() iterator is running on this state
        self.device_hw = 0                       # positions whose rows the device has written (generate runs one
                                                 # step ahead of n_tokens: its rows count when a part grows)
        self._blocks = [self._rings]
        fin = weakref.finalize(self, _release, store, self._blocks, self.graph)
        fin.atexit = False

    # ---- parts ----------------------------------------------------------------------------------------------
    def part(self, layer: int, name: str) -> DeviceArray:
        return self.arrays[f"{layer}.{name}"]

    def capacity(self, key: str) -> int:
        return int(self.arrays[key].shape[0])

    def written(self) -> int:
        return max(self.n_written, self.device_hw)

    def ensure_rows(self, n_tokens: int) -> bool:
        """Every rows part holds at least n_tokens // period rows (doubling, minimum 16); the rows written so far
        are copied along on the main stream. Returns True when a part moved."""
        moved = False
        for key, blk in self._rows.items():
            have, need = self.capacity(key), n_tokens // self.parts[key].period
            if blk is None or need > have:
                self._resize(key, grown_capacity(have, need))
                moved = True
        return moved

    def _resize(self, key: str, cap: int) -> None:
        p, old, rt = self.parts[key], self._rows[key], self.store.rt
        blk = self.store.block(cap * p.width * 4)
        blk.zero(rt.main)
        keep = min(self.capacity(key), cap, self.written() // p.period)
        if keep:
            rt.copy_d2d(blk.ptr, self.arrays[key].ptr, keep * p.width * 4)
        self._rows[key] = blk
        self._blocks.append(blk)
        if old is not None:
            self._blocks.remove(old)
            self.store.retire([old])
        self.arrays[key] = blk.array(0, (cap, p.width))
        self.generation += 1

    # ---- the State contract -----------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes allocated on the device: every ring and the rows parts' capacity."""
        return sum(a.nbytes for a in self.arrays.values())

    def copy(self) -> "CudaState":
        """An independent state with the same tokens: device-to-device copies on the main stream."""
        if self.busy:
            from ds4py.errors import Ds4Error

            raise Ds4Error("this state is being generated into; copy it after the generate() iterator ends")
        rt = self.store.rt
        out = CudaState(self.layout, self.store)
        out.n_tokens, out.n_written, out.device_hw = self.n_tokens, self.n_written, self.device_hw
        rt.copy_d2d(out._rings.ptr, self._rings.ptr, self._rings.nbytes)
        out.host_rings = {k: v.copy() for k, v in self.host_rings.items()}
        for key, blk in self._rows.items():
            if blk is None:
                continue
            out._resize(key, self.capacity(key))
            n = min(self.capacity(key), self.written() // self.parts[key].period) * self.parts[key].width * 4
            if n:
                rt.copy_d2d(out.arrays[key].ptr, self.arrays[key].ptr, n)
        return out

    def export(self) -> dict[str, np.ndarray]:
        """Host arrays per part, as a saved state holds them: a ring's slots, a rows part's n_tokens // period."""
        out = {}
        for p in self.layout.parts:
            n = p.rows_for(self.n_tokens)
            a = self.arrays[p.key]
            out[p.key] = a.view(0, (n, p.width)).download() if n else np.zeros((0, p.width), p.dtype)
        return out

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Fill the parts from host arrays (ring: all slots; rows part: its first rows)."""
        self.ensure_rows(self.n_tokens)
        for p in self.layout.parts:
            a = np.ascontiguousarray(arrays[p.key], p.dtype)     # float32, or int32 (V4.1's n-gram ring)
            if a.shape[0]:
                self.arrays[p.key].view(0, a.shape).upload(a)
            if p.key in self.host_rings:
                self.host_rings[p.key][:a.shape[0]] = a.reshape(-1, p.width)


def _release(store: DeviceStore, blocks: list, graph: list) -> None:
    store.retire(list(blocks) + [run for run in graph if run is not None])


class CudaStates:
    """The state methods of every CUDA model, the engine's and its drafts' (CudaModel; CudaMtp, CudaDSpark through
    CudaDraftStates): a CudaState of the model's `layout` in its `store` (the main model's, for a draft), exported
    and imported part by part (contract.ModelBase / DraftBase's _export / _import)."""

    layout: StateLayout
    store: Any

    def new_state(self) -> CudaState:
        self.store.reclaim()
        return CudaState(self.layout, self.store)

    def _export(self, state: CudaState) -> dict[str, np.ndarray]:
        return state.export()

    def _import(self, n_tokens: int, n_written: int, arrays: dict[str, np.ndarray]) -> CudaState:
        st = self.new_state()
        st.n_tokens, st.n_written = n_tokens, n_written
        st.load(arrays)
        return st


class CudaDraftStates(CudaStates):
    """The state methods of the CUDA backend's draft models (CudaMtp, CudaDSpark; contract.DraftBase): CudaStates',
    and which states are the draft's own."""

    def owns(self, state) -> bool:
        return isinstance(state, CudaState) and state.layout == self.layout and state.store is self.store
