"""The backend-neutral engine API: what sessions, the CLI, the server and the bench program against.

    model = open_model("model.gguf", backend="ref")       # or "cuda"
    state = model.new_state()                              # empty KV state (window ring, compressors, ...)
    logits = model.prefill(state, ids)                     # float32 [vocab]: after the last id; state advances
    logits = model.prefill(state, ids, all_logits=True)    # float32 [len(ids), vocab]
    logits = model.decode(state, token)                    # float32 [vocab]; one position
    snap = state.copy()                                    # independent deep copy (snapshot / restore)
    state.n_tokens                                         # positions consumed so far

Backends implement `Model`; `open_model` picks one. A backend never changes the math of MODEL.md: the numpy
reference (ds4py.ref) is the oracle every other backend is tested against.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class State(Protocol):
    n_tokens: int

    def copy(self) -> "State": ...

    def nbytes(self) -> int: ...


@runtime_checkable
class Model(Protocol):
    config: object          # ds4py.config.ModelConfig
    path: str
    backend: str            # "ref" | "cuda"

    def new_state(self) -> State: ...

    def prefill(self, state: State, ids: Sequence[int], all_logits: bool = False) -> np.ndarray: ...

    def decode(self, state: State, token: int) -> np.ndarray: ...

    def weight_bytes_per_token(self) -> int: ...


def open_model(path: str, backend: str = "ref", **kwargs) -> Model:
    """Open a GGUF with the named backend. Raises ds4py.errors.Ds4Error subclasses with a clear sentence."""
    if backend == "ref":
        from ds4py.ref.engine import RefModel

        return RefModel(path, **kwargs)
    from ds4py.errors import Ds4Error

    if backend == "cuda":
        try:
            from ds4py.cuda.engine import CudaModel  # raises CudaUnavailableError without a GPU
        except ModuleNotFoundError as e:
            if e.name != "ds4py.cuda.engine":
                raise
            raise Ds4Error("the CUDA backend has kernels and a runtime but no model forward yet; "
                           "use --backend ref (see docs/cuda.md)") from None
        return CudaModel(path, **kwargs)

    raise Ds4Error(f"unknown backend {backend!r} (choose 'ref' or 'cuda')")
