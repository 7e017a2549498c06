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
This module imports no backend (both import it); the factory, open_model, is ds4py.backends.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from types import MappingProxyType
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from ds4py import kv
from ds4py.errors import ContextLengthError, Ds4Error, UnsupportedByBackend  # noqa: F401 (part of the contract)

DEFAULT_ROLLBACK_HORIZON = 16
KV_DTYPES = ("f32", "f16")
# numerics=DEVICE_NUMERICS: the GPU backends run the opened device's declared default activations (fp32 or int8,
# docs/cuda.md "Activation numerics"), decided at open and said in model.numerics_why; what the CLI passes without
# --exact / --act-quant. The reference takes Numerics only.
DEVICE_NUMERICS = "device"


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


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers beyond the core contract (docs/engine.md "Capabilities"). Callers test these flags;
    they never probe a model's attributes. A method whose flag is off raises Ds4Error in one sentence."""
    speculation: bool = False         # open_mtp(): an MTP draft block on this backend, fed by step_hidden
    device_generation: bool = False   # generate(): sampling on the device, a few bytes read back per token
    launch_counts: bool = False       # launches_per_step() / launches_per_rows_step(): kernels per step
    multirow: bool = False            # several rows (sequences, a verify) in one device step: bench --verify-k
    block_prefill: bool = False       # a prompt in device blocks of up to thousands of tokens: bench --prefill-sizes
    emulated: bool = False            # runs on a CPU emulator of its device: its timings are CPU time


@dataclass(frozen=True)
class WeightBytes:
    """Bytes of weights a step reads, by part (the bench's roofline, speculation's deterministic cost model)."""
    decode: int        # one decode step: every tensor, one embedding row, n_experts_used of n_experts experts
    routed: int        # of those, the routed experts': what each further row of a verify adds (no sharing)
    head: int          # the output head (a draft step reads it too)


@runtime_checkable
class Model(Protocol):
    config: Any              # ds4py.config.ModelConfig
    path: str
    backend: str             # "ref" | "cuda" | "cuda-emu": informational (recorded in blobs, printed), never branched on
    numerics: Numerics
    rollback_horizon: int
    fingerprint: str         # ds4py.fingerprint.file_fingerprint of the model file
    layout: kv.StateLayout
    capabilities: Capabilities
    stable_rows: int         # steps whose chunks all have at most this many rows are row-stable
    gguf: Any                # the opened ds4py.gguf.GGUFFile (its metadata: tokenizer, MTP tensors), None if synthetic
    stack: Any               # the sidecar / post-training stack mounted on the weights (docs/vq.md), or None
    startup: dict            # load-time figures for the bench (seconds, GB), possibly empty

    def new_state(self) -> State: ...

    def step(self, states: Sequence[State], chunks: Sequence[Sequence[int]],
             all_logits: bool = False) -> list[np.ndarray]: ...

    def step_hidden(self, states: Sequence[State], chunks: Sequence[Sequence[int]],
                    all_logits: bool = False) -> tuple[list[np.ndarray], list[np.ndarray]]: ...

    def prefill(self, state: State, ids: Sequence[int], all_logits: bool = False) -> np.ndarray: ...

    def decode(self, state: State, token: int) -> np.ndarray: ...

    def save_state(self, state: State) -> bytes: ...

    def load_state(self, data: bytes) -> State: ...

    def weight_bytes_per_token(self) -> int: ...

    def weight_bytes(self) -> WeightBytes: ...

    def has_mtp_block(self) -> bool: ...

    def open_mtp(self, path: str | None = None) -> "Mtp": ...

    def new_request(self, params: Any, suppress: Sequence[int] = ()) -> Any: ...

    def generate(self, state: State, token: int, params: Any, max_tokens: int) -> Any: ...

    def launches_per_step(self, state: State | None = None) -> dict[str, int]: ...

    def launches_per_rows_step(self, n_rows: int) -> dict[str, int]: ...

    def copy_bandwidth_gbps(self) -> float: ...


@runtime_checkable
class Mtp(Protocol):
    """The MTP draft block of a main model (MODEL.md §2.5; docs/engine.md "The MTP draft block")."""
    config: Any              # the block's one-layer config (cfg.mtp_block())
    path: str
    backend: str
    fingerprint: str         # of the MTP file (SpecModel's pair fingerprint mixes it with the main one)
    rollback_horizon: int
    layout: kv.StateLayout

    def new_state(self) -> State: ...

    def step(self, states: Sequence[State], hidden: Sequence[np.ndarray], next_ids: Sequence[Sequence[int]],
             all_logits: bool = False, logits: bool = True) -> tuple[list[np.ndarray], list[np.ndarray]]: ...

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
    capabilities = Capabilities()
    stable_rows = 1          # a step of one-row chunks is row-stable by definition; backends declare more
    gguf: Any = None
    stack: Any = None
    numerics_why = ""        # why `numerics` are what they are when the backend chose them (DEVICE_NUMERICS)
    startup: dict = MappingProxyType({})      # type: ignore[assignment]  (read-only; backends set their own)

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

    def weight_bytes_per_token(self) -> int:
        return self.weight_bytes().decode

    def has_mtp_block(self) -> bool:
        """The model's own GGUF holds an MTP draft block (mtp.0.* tensors): open_mtp() needs no file."""
        from ds4py import schema

        return self.gguf is not None and schema.MTP_PREFIX + "e_proj.weight" in self.gguf

    def open_mtp(self, path: str | None = None) -> "Mtp":
        """The MTP draft block (MODEL.md §2.5) from its MTP GGUF (`path`; None: the model's own GGUF holds the
        mtp.0.* tensors), on this backend (capabilities.speculation)."""
        raise Ds4Error(f"the {self.backend} backend cannot run the MTP draft block; decode without speculation "
                       f"(--no-spec) or use --backend ref")

    def new_request(self, params: Any, suppress: Sequence[int] = ()) -> Any:
        """The per-request driver of speculative rounds (ds4py.spec.SpecModel's); None: decode one token a step."""
        return None

    def generate(self, state: State, token: int, params: Any, max_tokens: int) -> Any:
        """Device-side generation (capabilities.device_generation; docs/engine.md "Device-side generation")."""
        raise Ds4Error(f"the {self.backend} backend has no device-side generation; step() and sample on the host")

    def launches_per_step(self, state: State | None = None) -> dict[str, int]:
        """Kernels of one decode step: body, head, total, side_stream (capabilities.launch_counts)."""
        raise Ds4Error(f"the {self.backend} backend launches no kernels to count")

    def launches_per_rows_step(self, n_rows: int) -> dict[str, int]:
        """Kernels of one multi-row step of n_rows fresh sequences (capabilities.launch_counts)."""
        raise Ds4Error(f"the {self.backend} backend launches no kernels to count")

    def copy_bandwidth_gbps(self) -> float:
        """Measured copy bandwidth (read + write) of the memory the weights are read from: the bench's roofline.
        Here the host's (numpy memcpy)."""
        return host_copy_bandwidth_gbps()

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

    @abstractmethod
    def weight_bytes(self) -> WeightBytes: ...


class DraftBase(ABC):
    """What every draft model of every backend shares (the MTP block, the DSpark draft): its own state, saved as a
    DS4PYKV blob under its `fingerprint` (ds4py.spec pairs it with the main state). A backend's draft classes
    take new_state / owns / _export / _import from one class of that backend (ref.state.RefDraftStates,
    cuda.kvstate.CudaDraftStates); `noun` names the draft in a refusal."""

    noun = "draft"
    fingerprint: str
    backend: str
    numerics: Any
    layout: kv.StateLayout

    def save_state(self, state: State) -> bytes:
        """The draft's state as a DS4PYKV blob under its fingerprint (SpecModel pairs it with the main one)."""
        if not self.owns(state):
            raise Ds4Error(f"save_state needs a state from this {self.noun}'s new_state()")
        return kv.encode_state(self.fingerprint, self.numerics.to_dict(), self.layout, state.n_tokens,
                               state.n_written, self._export(state), self.backend)

    def load_state(self, data: bytes) -> State:
        n_tokens, n_written, arrays = kv.decode_state(data, self.fingerprint, self.numerics.to_dict(), self.layout)
        return self._import(n_tokens, n_written, arrays)

    @abstractmethod
    def new_state(self) -> State: ...

    @abstractmethod
    def owns(self, state: Any) -> bool:
        """The state is one of this draft's (its layout, its device)."""

    @abstractmethod
    def _export(self, state) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def _import(self, n_tokens: int, n_written: int, arrays: dict[str, np.ndarray]) -> State: ...


class MtpBase(DraftBase):
    """What every backend's MTP draft block shares: opening and checking its file, checking a step's arguments
    (one sentence per problem), save_state / load_state of its one-layer state (DraftBase: a DS4PYKV blob under
    the MTP file's fingerprint, which ds4py.spec pairs with the main model's).

    A backend calls `MtpBase.__init__(self, model, path)` and implements new_state, `owns(state)`,
    `_step(states, hidden, next_ids, all_logits, logits)` (checked inputs: float32 [T, hc, dim] and int64 [T]),
    `_export(state)`, `_import(n_tokens, n_written, arrays)` and weight_bytes_per_token."""

    noun = "MTP block"

    def __init__(self, model: Any, path: str | None = None):
        from ds4py.fingerprint import file_fingerprint
        from ds4py.gguf import GGUFFile

        if model.gguf is None and path is None:
            raise Ds4Error("a model without a GGUF file (synthetic) has no MTP block; pass the MTP GGUF")
        self.model = model
        self.backend = model.backend
        self.main_config = model.config
        self.config = model.config.mtp_block()
        self.path = model.path if path is None else str(path)
        self.gguf = model.gguf if path is None else GGUFFile(self.path)
        check_mtp_file(self.gguf, model.config)
        self.numerics = model.numerics
        self.rollback_horizon = model.rollback_horizon
        self.layout = kv.state_layout(self.config, model.rollback_horizon)
        header = min(t.offset for t in self.gguf.tensors.values())
        self.fingerprint = file_fingerprint(self.path, head_bytes=header)

    def step(self, states: Sequence[State], hidden: Sequence[np.ndarray], next_ids: Sequence[Sequence[int]],
             all_logits: bool = False, logits: bool = True) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Advance each state by its rows (hidden[i] [T, hc, dim], next_ids[i] [T]): (logits per sequence,
        [vocab] or [T, vocab] with all_logits; [] when logits=False), block output states [T, hc, dim]."""
        hs, ids = self.check_step(states, hidden, next_ids)
        return self._step(list(states), hs, ids, bool(all_logits), bool(logits))

    def check_step(self, states, hidden, next_ids) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """An MTP step's arguments checked and normalised: the hidden states as float32 [n, hc, D], the ids as
        int64."""
        cfg = self.main_config
        if isinstance(states, (str, bytes)) or not isinstance(states, Sequence) \
                or not (len(states) == len(hidden) == len(next_ids)) or not states:
            raise Ds4Error("an MTP step takes one hidden-state array and one id chunk per state")
        if len({id(s) for s in states}) != len(states):
            raise Ds4Error("the same MTP state appears twice in one step")
        hs, ids = [], []
        for st, h, c in zip(states, hidden, next_ids):
            if not self.owns(st):
                raise Ds4Error("an MTP step needs states from this MTP block's new_state()")
            h = np.asarray(h, dtype=np.float32)
            c = np.asarray(c)
            if c.ndim != 1 or c.size == 0 or not np.issubdtype(c.dtype, np.integer):
                raise Ds4Error("MTP next-token ids must be a non-empty 1-D integer sequence")
            if h.shape != (c.size, cfg.hc_mult, cfg.dim):
                raise Ds4Error(f"MTP hidden states must be [{c.size}, {cfg.hc_mult}, {cfg.dim}] (one final "
                               f"hyper-connection state per next token), got {list(h.shape)}")
            if ((c < 0) | (c >= cfg.vocab_size)).any():
                raise Ds4Error(f"an MTP next-token id is outside the vocabulary (0..{cfg.vocab_size - 1})")
            if st.n_tokens + c.size > cfg.context_length:
                raise ContextLengthError(f"{st.n_tokens} + {c.size} MTP positions exceed the context length "
                                         f"{cfg.context_length}")
            hs.append(h)
            ids.append(c.astype(np.int64))
        return hs, ids

    @abstractmethod
    def _step(self, states: list, hidden: list[np.ndarray], next_ids: list[np.ndarray], all_logits: bool,
              logits: bool) -> tuple[list[np.ndarray], list[np.ndarray]]: ...

    @abstractmethod
    def weight_bytes_per_token(self) -> int: ...


def host_copy_bandwidth_gbps(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Best-of-N numpy memcpy bandwidth (read + write bytes): the CPU backend's roofline."""
    a = np.ones(nbytes // 8, dtype=np.float64)
    b = np.empty_like(a)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.nbytes / best / 1e9


# metadata an MTP file may carry (ours do, as ds4's converter may not): when present it must match the main model
MTP_SHAPE_KEYS = {"embedding_length": "dim", "vocab_size": "vocab_size", "attention.head_count": "n_heads",
                  "attention.key_length": "head_dim", "hyper_connection.count": "hc_mult",
                  "expert_count": "n_experts", "expert_feed_forward_length": "expert_ff",
                  "attention.sliding_window": "window"}


def check_mtp_file(f: Any, cfg: Any) -> None:
    """GGUFError / Ds4Error naming the first thing that makes GGUF `f` not an MTP file of the model `cfg`."""
    from ds4py import schema
    from ds4py.errors import GGUFError
    from ds4py.quant import vq

    for key, field in MTP_SHAPE_KEYS.items():
        v = f.meta(f"deepseek4.{key}", None)
        if v is not None and v != getattr(cfg, field):
            raise Ds4Error(f"{f.path}: this MTP file is for another model (deepseek4.{key} is {v}, the main model's "
                           f"{field} is {getattr(cfg, field)})")
    if schema.MTP_PREFIX + "e_proj.weight" not in f:
        raise GGUFError(f"{f.path}: not an MTP draft file (no {schema.MTP_PREFIX}* tensors; convert the checkpoint "
                        "with --mtp OUT_MTP.gguf, or use ds4's MTP GGUF)")
    for name, (shape, types) in schema.expected_mtp_tensors(cfg).items():
        if name.endswith("_exps.weight") and vq.is_vq(f, name):
            vq.check_expert(f, name, shape)
        else:
            f.tensor(name, types=types, shape=shape)


def open_mtp(model: Model, path: str | None = None) -> Mtp:
    """model.open_mtp(path): the MTP draft block of `model` on its own backend."""
    return model.open_mtp(path)


def device_generation(model: Model):
    """model.generate when the backend declares device-side generation (capabilities.device_generation), else
    None. generate(state, token, params, max_tokens) checks its arguments when called (Ds4Error /
    ContextLengthError) and returns an iterator: it feeds `token` at the state's next position and yields up to
    max_tokens sampled tokens (ds4py.sampling's rules; greedy is exact argmax, lowest id on ties; the draws are the
    device's own seeded stream, not numpy's). Closing it (or exhausting it) after k tokens leaves the state having
    consumed `token` and the first k - 1 (the last sampled token is not fed), exactly as the same tokens fed by
    step() would; no other call may use the state until then. Logits that are no distribution raise
    ds4py.sampling.InvalidLogits."""
    return model.generate if model.capabilities.device_generation else None
