"""The engine contract every backend implements and every caller (session, CLI, server, bench) programs against.

    model = open_model("model.gguf", backend="ref", numerics=Numerics())
    a, b = model.new_state(), model.new_state()
    la, lb = model.step([a, b], [prompt_a, [token_b]])       # one call, several sequences; [vocab] each
    rows = model.step([a], [draft], all_logits=True)[0]      # [len(draft), vocab]: verify k+1 rows
    a.truncate(a.n_tokens - 3)                                # exact rollback, >= model.rollback_horizon deep
    blob = model.save_state(a); a2 = model.load_state(blob)   # versioned, fingerprinted, checksummed bytes
    snap = a.copy(); a.nbytes(); a.n_tokens; a.rollback_floor
    model.prefill(state, ids) / model.decode(state, token)   # thin wrappers over step

A step runs every sequence's rows through each weight matrix together (routed experts grouped across the
sequences), and attention per sequence against its own state; its results equal separate calls up to fp32
summation order. The state is declared data (ds4py.kv: one layout per model, from the config's predicates),
so copy, truncate, save and load are the same for every backend. docs/engine.md is the backend writer's page.
Backends never change the math of MODEL.md: the numpy reference (ds4py.ref) is the oracle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from ds4py import kv
from ds4py.errors import ContextLengthError, Ds4Error

DEFAULT_ROLLBACK_HORIZON = 16
KV_DTYPES = ("f32", "f16")


@dataclass(frozen=True)
class Numerics:
    """How a backend rounds, passed explicitly and recorded in saved states.

    fake_quant: the model's own FP8 (window / compressed KV) and FP4 (indexer) quant-dequant steps, as the
      official code does in its default ("qat") mode; False = the official "train" numerics.
    act_quant: round the activation side of every quantised matmul the way ds4 / ggml's CPU dot products see
      it (Q8_0 blocks for Q8_0 / MXFP4 weights, Q8_K for K- and IQ-quants): an int8-activation engine's twin.
    kv_dtype: storage rounding of KV and compressed rows, "f32" (none) or "f16" (ds4 stores F16).
    """
    fake_quant: bool = True
    act_quant: bool = False
    kv_dtype: str = "f32"

    def __post_init__(self) -> None:
        for name in ("fake_quant", "act_quant"):
            if not isinstance(getattr(self, name), bool):
                raise Ds4Error(f"Numerics.{name} must be True or False, got {getattr(self, name)!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise Ds4Error(f"Numerics.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")

    @classmethod
    def ds4(cls, fake_quant: bool = True) -> "Numerics":
        """ds4's CPU numerics: int8 activations before quantised matmuls and F16 KV storage."""
        return cls(fake_quant=fake_quant, act_quant=True, kv_dtype="f16")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class State(Protocol):
    n_tokens: int            # positions consumed
    n_written: int           # high-water mark of n_tokens (what the rollback floor is measured from)
    layout: kv.StateLayout

    @property
    def rollback_floor(self) -> int: ...

    def truncate(self, n: int) -> None: ...

    def copy(self) -> "State": ...

    def nbytes(self) -> int: ...


@runtime_checkable
class Model(Protocol):
    config: Any              # ds4py.config.ModelConfig
    path: str
    backend: str             # "ref" | "cuda" | "cuda-emu"
    numerics: Numerics
    rollback_horizon: int
    fingerprint: str         # ds4py.fingerprint.file_fingerprint of the model file
    layout: kv.StateLayout

    def new_state(self) -> State: ...

    def step(self, states: Sequence[State], chunks: Sequence[Sequence[int]],
             all_logits: bool = False) -> list[np.ndarray]: ...

    def prefill(self, state: State, ids: Sequence[int], all_logits: bool = False) -> np.ndarray: ...

    def decode(self, state: State, token: int) -> np.ndarray: ...

    def save_state(self, state: State) -> bytes: ...

    def load_state(self, data: bytes) -> State: ...

    def weight_bytes_per_token(self) -> int: ...


class ModelBase(ABC):
    """What every backend shares: input checks, the prefill / decode wrappers, save_state / load_state.

    A backend sets config, path, numerics, rollback_horizon, fingerprint, layout and `state_type`, and
    implements new_state, `_step(states, chunks, all_logits)` (checked inputs), `_export(state)` (host arrays
    per part, as encode_state wants them) and `_import(n_tokens, n_written, arrays)`."""

    backend = "?"
    state_type: type = object

    @property
    def kernels_label(self) -> str:
        """What computes the products, in words (bench's table header and JSON): the backend's name unless the
        backend says more (the reference: oracle / numpy fused / compiled, and its threads)."""
        return self.backend

    # ---- the contract --------------------------------------------------------------------------------------
    def step(self, states: Sequence[State], chunks: Sequence[Sequence[int]],
             all_logits: bool = False) -> list[np.ndarray]:
        """Advance each state by its chunk; logits per sequence: [vocab] (its last position) or
        [len(chunk), vocab] with all_logits. A rejected call changes no state."""
        arrays = self.check_step(states, chunks)
        return self._step(list(states), arrays, bool(all_logits))

    def step_hidden(self, states: Sequence[State], chunks: Sequence[Sequence[int]],
                    all_logits: bool = False) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """step, and per sequence the final hyper-connection state of every row, [len(chunk), hc_mult, dim]: the
        head's input h_j, which the MTP draft block reads (MODEL.md §2.5). Same logits, same state as step."""
        arrays = self.check_step(states, chunks)
        return self._step_hidden(list(states), arrays, bool(all_logits))

    def step_taps(self, states: Sequence[State], chunks: Sequence[Sequence[int]],
                  all_logits: bool = False) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """step, and per sequence V4.1's DSpark taps of every row, [len(chunk), n_targets·dim]: the mean over the
        hc copies of each `config.dspark_targets` layer's input state, which the DSpark draft reads (MODEL.md §3).
        Same logits, same state as step."""
        arrays = self.check_step(states, chunks)
        if not self.config.has_dspark:
            raise Ds4Error(f"{self.path}: this model has no DSpark draft, so it has no draft taps")
        return self._step_taps(list(states), arrays, bool(all_logits))

    def open_dspark(self):
        """V4.1's DSpark draft of this model (its dspark.* tensors; ds4py.ref.dspark is the reference): new_state(),
        feed(states, taps), block(state, token), greedy(block, token), save_state / load_state, call_bytes()."""
        if not self.config.has_dspark:
            raise Ds4Error(f"{self.path}: this model has no DSpark draft (no dspark.* tensors)")
        return self._open_dspark()

    def _open_dspark(self):
        raise Ds4Error(f"the {self.backend} backend cannot run V4.1's DSpark draft yet; decode without speculation "
                       "(--no-spec) or use --backend ref")

    def prefill(self, state: State, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        return self.step([state], [ids], all_logits)[0]

    def decode(self, state: State, token: int) -> np.ndarray:
        return self.step([state], [[token]])[0]

    def save_state(self, state: State) -> bytes:
        self.check_state(state)
        return kv.encode_state(self.fingerprint, self.numerics.to_dict(), self.layout, state.n_tokens,
                               state.n_written, self._export(state), self.backend)

    def load_state(self, data: bytes) -> State:
        n_tokens, n_written, arrays = kv.decode_state(data, self.fingerprint, self.numerics.to_dict(), self.layout)
        if n_tokens > self.config.context_length:
            raise ContextLengthError(f"the KV state holds {n_tokens} tokens, more than the context length "
                                     f"{self.config.context_length}")
        return self._import(n_tokens, n_written, arrays)

    # ---- checks ---------------------------------------------------------------------------------------------
    def check_state(self, state: Any, what: str = "state") -> None:
        if not isinstance(state, self.state_type):
            raise Ds4Error(f"{what} is a {type(state).__name__}, expected a {self.state_type.__name__} from this "
                           f"model's new_state() or load_state()")
        if state.layout is not self.layout and state.layout != self.layout:
            raise Ds4Error(f"{what} belongs to a model with another state layout")

    def check_step(self, states: Sequence[State], chunks: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Validate a whole step before any state is touched; the chunks as int64 arrays."""
        if isinstance(states, (str, bytes)) or not isinstance(states, Sequence) or not isinstance(chunks, Sequence):
            raise Ds4Error("step takes a list of states and a list of token-id chunks")
        if len(states) != len(chunks) or not states:
            raise Ds4Error(f"step needs one chunk per state and at least one state "
                           f"(got {len(states)} states, {len(chunks)} chunks)")
        if len({id(s) for s in states}) != len(states):
            raise Ds4Error("the same state appears twice in one step")
        V, ctx, out = self.config.vocab_size, self.config.context_length, []
        for i, (state, ids) in enumerate(zip(states, chunks)):
            where = f"sequence {i}: " if len(states) > 1 else ""
            self.check_state(state, f"{where}state".strip())
            arr = np.asarray(ids)
            if arr.ndim != 1 or arr.size == 0:
                raise Ds4Error(f"{where}token ids must be a non-empty 1-D sequence")
            if not np.issubdtype(arr.dtype, np.integer):
                raise Ds4Error(f"{where}token ids must be integers, got {arr.dtype}")
            bad = (arr < 0) | (arr >= V)
            if bad.any():
                raise Ds4Error(f"{where}token id {int(arr[bad][0])} at index {int(np.argmax(bad))} is outside the "
                               f"vocabulary (0..{V - 1})")
            if state.n_tokens + arr.size > ctx:
                raise ContextLengthError(f"{where}{state.n_tokens} + {arr.size} tokens exceed the context length {ctx}")
            out.append(arr.astype(np.int64))
        return out

    # ---- backend hooks ----------------------------------------------------------------------------------------
    @abstractmethod
    def _step(self, states: list, chunks: list[np.ndarray], all_logits: bool) -> list[np.ndarray]: ...

    def _step_hidden(self, states: list, chunks: list[np.ndarray],
                     all_logits: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        raise Ds4Error(f"the {self.backend} backend does not expose the final hyper-connection state, which the "
                       "MTP draft block needs; decode without speculation (--no-spec) or use --backend ref")

    def _step_taps(self, states: list, chunks: list[np.ndarray],
                   all_logits: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        raise Ds4Error(f"the {self.backend} backend cannot run V4.1's DSpark draft yet (its taps of the target "
                       "layers); decode without speculation (--no-spec) or use --backend ref")

    @abstractmethod
    def _export(self, state) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def _import(self, n_tokens: int, n_written: int, arrays: dict[str, np.ndarray]): ...


BACKENDS = ("ref", "cuda", "cuda-emu", "auto")


class UnsupportedByBackend(Ds4Error):
    """The backend cannot run this model or these numerics (a weight type without a kernel, int8 activations on
    CUDA, ...); `--backend auto` then falls back to the reference."""


def open_mtp(model, path: str | None = None):
    """The MTP draft block of `model` (MODEL.md §2.5) from its MTP GGUF (`path`; None: the model's own GGUF
    holds the mtp.0.* tensors). Its interface: new_state(), step(states, hidden, next_ids, all_logits, logits),
    rollback_horizon (docs/engine.md "The MTP draft block")."""
    if model.backend == "ref":
        from ds4py.ref.mtp import RefMtp

        return RefMtp(model, path)
    if model.backend in ("cuda", "cuda-emu"):
        from ds4py.cuda.mtp import CudaMtp

        return CudaMtp(model, path)
    raise Ds4Error(f"the {model.backend} backend cannot run the MTP draft block yet (it needs the verify batch's "
                   f"kernels, issue 17); use --backend ref for speculative decoding, or --no-spec")


def open_model(path: str, backend: str = "ref", **kwargs) -> Model:
    """Open a GGUF with the named backend (kwargs: numerics=Numerics(...), rollback_horizon=...):
    ref (numpy), cuda (the GPU), cuda-emu (the CUDA engine on the CPU emulator: slow, for tests), auto (cuda
    where a GPU is present and can run the model, else ref, saying why in one line on stderr).
    ctx: the context in tokens one sequence needs: the CUDA engine plans its device memory for it at load (one
    line, a refusal up front when it does not fit, docs/cuda.md "Memory"); the reference grows its state as it
    goes and needs no plan.
    Raises ds4py.errors.Ds4Error subclasses with a clear sentence."""
    ctx = kwargs.pop("ctx", None)
    if backend == "ref":
        from ds4py.ref.engine import RefModel

        return RefModel(path, **kwargs)
    if backend in ("cuda", "cuda-emu"):
        from ds4py.cuda.engine import CudaModel   # importing it never touches the driver

        return CudaModel(path, emulate=backend == "cuda-emu", ctx=ctx, **kwargs)
    if backend == "auto":
        return _open_auto(path, ctx, **kwargs)
    raise Ds4Error(f"unknown backend {backend!r} (choose one of {', '.join(BACKENDS)})")


def _open_auto(path: str, ctx: int | None = None, **kwargs) -> Model:
    import sys

    from ds4py.errors import CudaUnavailableError

    try:
        from ds4py.cuda.probe import auto_choice

        pick, why = auto_choice(path)        # a device, a driver that fits, and free memory for this model
        if pick == "cuda":
            from ds4py.cuda.engine import CudaModel

            return CudaModel(path, ctx=ctx, **kwargs)
    except (CudaUnavailableError, UnsupportedByBackend) as e:
        why = str(e).rstrip(".")
    print(f"ds4py: backend auto: {why}; using the reference backend (ref)", file=sys.stderr, flush=True)
    from ds4py.ref.engine import RefModel

    return RefModel(path, **kwargs)


# ---- optional capability: generation on the backend's device ---------------------------------------------------
@runtime_checkable
class DeviceGeneration(Protocol):
    """A backend that samples on its device and feeds each token to the next step itself, so the host reads a
    few bytes per token instead of the logits (the CUDA engine). Callers that need no host logits (the session's
    generation loop) use it when present (`device_generation(model)`); everything else uses step().

    generate(state, token, params, max_tokens) checks its arguments when called (Ds4Error / ContextLengthError)
    and returns an iterator: it feeds `token` at the state's next position and yields up to max_tokens sampled
    tokens (ds4py.sampling's rules: temperature, top-k, top-p, min-p; greedy is exact argmax, lowest id on ties;
    the draws are the device's own seeded stream, not numpy's). Closing it (or exhausting it) after k tokens
    leaves the state having consumed `token` and the first k - 1 (the last sampled token is not fed), exactly as
    the same tokens fed by step() would; no other call may use the state until then. Logits that are no
    distribution raise ds4py.sampling.InvalidLogits."""

    def generate(self, state: State, token: int, params: Any, max_tokens: int) -> Any: ...


def device_generation(model: Any):
    """model.generate when the backend offers device-side generation, else None."""
    return model.generate if isinstance(model, DeviceGeneration) else None
