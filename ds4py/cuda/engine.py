"""CudaModel: V4 / V4.1 Flash on the GPU (or, `--backend cuda-emu`, on the CPU emulator of the same kernels).

    model = CudaModel("model.gguf")                       # Runtime() on the first GPU; emulate=True: EmuRuntime
    logits = model.step([state], [ids])[0]                # the engine contract (ds4py.model, docs/engine.md)
    for tok in model.generate(state, first, params, 64):  # device-side sampling, 4 bytes read per token
        ...

Weights stay in their GGUF formats in the arena (ds4py/cuda/device_weights.py); a sequence's KV state is the
declared layout in device memory (ds4py/cuda/kvstate.py). A step is planned as row sets (CudaModel.plan), each
recorded by the one layer schedule (ds4py/cuda/layer.py): a DECODE row captured once per state and context bucket
into a graph and replayed per token, with the position and the token in a device slot; 2 to 16 short rows in all
as one ROWS graph; a chunk longer than the rollback horizon + 1 (a prompt) in BLOCK row sets of up to 2,048
tokens (direct launches).
Numerics: fp32 activations and accumulation, the model's FP8 / FP4 fake-quant (Numerics.fake_quant) and F16 KV
storage (kv_dtype "f16") as the reference computes them; ds4's int8 activations (act_quant) are refused.
"""

from __future__ import annotations

import os
import sys
import time
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ds4py import schema
from ds4py.config import ModelConfig
from ds4py.cuda import layer, synth
from ds4py.cuda.layer import BLOCK, DECODE, MAX_ROWS, ROWS, Recording, RowSet
from ds4py.cuda.compiler import model_defines
from ds4py.cuda.kvstate import CudaState, DeviceStore
from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.device_weights import DeviceWeights, check_gate_up
from ds4py.cuda.device_weights import load as load_weights
from ds4py.cuda.engram_feed import EngramFeed
from ds4py.cuda.memory_plan import DEFAULT_CTX, MemoryPlan, kv_bytes
from ds4py.cuda.step_run import StepRun
from ds4py.cuda.ops import experts as ops_moe
from ds4py.cuda.ops import moe_prefill as ops_moep
from ds4py.cuda.gguf_upload import check_alignment
from ds4py.errors import ContextLengthError, Ds4Error, UnsupportedByBackend
from ds4py.fingerprint import file_fingerprint
from ds4py.gguf import GGUFFile
from ds4py.kv import state_layout
from ds4py.contract import DEFAULT_ROLLBACK_HORIZON, Capabilities, ModelBase, Numerics, WeightBytes
from ds4py.sampling import InvalidLogits, SamplingParams
from ds4py.vq.sidecar import Stack

MIN_BUCKET = 256            # smallest context bucket (positions); buckets double up to the context length
HEAD_GRAPHS = 8             # head graphs kept (one per sampling setting; least recently used dropped)
ROWS_GRAPHS = 32            # ROWS step graphs kept (one per set of rows' states and buckets, least recently used dropped)


def bucket_for(n_positions: int, context_length: int, min_bucket: int = MIN_BUCKET) -> int:
    """The context bucket holding positions [0, n_positions): a power of two >= min_bucket, at most the context."""
    b = min_bucket
    while b < n_positions:
        b *= 2
    return max(n_positions, min(b, context_length))


class TokenReader:
    """The sampled token back to the host without stalling the device: a 4-byte copy into pinned memory and an
    event, queued behind the step; wait(i) blocks on that event only (GPU). Elsewhere (the emulator, which runs
    work as it is issued) the value is read at once."""

    def __init__(self, rt: Any, depth: int = 4):
        from ds4py.cuda.runtime import Runtime

        self.rt, self.depth, self.n = rt, depth, 0
        self.gpu = isinstance(rt, Runtime)
        self._values: dict[int, int] = {}
        if self.gpu:
            from ds4py.cuda.driver import call
            from ds4py.cuda.memory import PinnedBuffer, _no_timing

            rt.bind_thread()
            self._call = call
            self._pinned = PinnedBuffer(4 * depth)
            self._events = [call("cuEventCreate", _no_timing()) for _ in range(depth)]

    def enqueue(self, src: DeviceArray) -> int:
        i, self.n = self.n, self.n + 1
        if not self.gpu:
            self._values[i] = int(src.download()[0])
            return i
        k = i % self.depth
        self.rt.bind_thread()                # the server's engine thread may not be the creator
        self._call("cuMemcpyDtoHAsync", self._pinned.ptr + 4 * k, src.ptr, 4, self.rt.main)
        self._call("cuEventRecord", self._events[k], self.rt.main)
        return i

    def wait(self, i: int) -> int:
        if not self.gpu:
            return self._values.pop(i)
        if self.n - i > self.depth:
            raise Ds4Error("token readback overrun (more steps in flight than the reader holds)")
        k = i % self.depth
        self.rt.bind_thread()
        self._call("cuEventSynchronize", self._events[k])
        return int(self._pinned.array[4 * k: 4 * k + 4].view(np.int32)[0])

    def close(self) -> None:
        if self.gpu:
            self.rt.bind_thread()
            for e in self._events:
                self._call("cuEventDestroy", e)
            self._pinned.free()
            self._events = []


def _runtime(emulate: bool, cfg: ModelConfig, progress: bool) -> Any:
    defines = model_defines(cfg)
    if emulate:
        from ds4py.cuda.emu_runtime import EmuRuntime

        return EmuRuntime(defines=defines)
    from ds4py.cuda.runtime import Runtime

    say = (lambda m: print(f"ds4py: {m}", file=sys.stderr, flush=True)) if progress else None
    return Runtime(defines=defines, progress=say)


class CudaModel(ModelBase):
    """The engine contract on CUDA devices (docs/engine.md, docs/cuda.md "The engine")."""

    backend = "cuda"
    state_type = CudaState
    stable_rows = MAX_ROWS     # a verify of 1 + k <= 16 rows is one multi-row step (spec: k <= 15)

    def __init__(self, path: str, numerics: Numerics | None = None,
                 rollback_horizon: int = DEFAULT_ROLLBACK_HORIZON, runtime: Any = None, emulate: bool = False,
                 pdl: bool = True, graphs: bool = True, progress: bool | None = None, sidecar: Any = None,
                 posttrain: Any = None, engram_dir: str | None = None, official_decode_bug: bool = False,
                 ctx: int | None = None):
        """runtime: a Runtime / EmuRuntime to use (default: a new one: the GPU, or the emulator with emulate).
        pdl / graphs: programmatic dependent launches and graph replay (both on by default; off for the
        bit-identity tests and the bench's comparison). sidecar / posttrain: a domain sidecar and post-training
        file (docs/vq.md), folded at load as the reference folds them. engram_dir: V4.1's Engram tables (the folder
        with the official shards; default: the one convert recorded; ignored for V4). official_decode_bug: V4.1
        only, the official decode's index-key bug as the reference reproduces it (for comparison; _key_layers).
        ctx: the context one sequence is planned for
        (default memory_plan.DEFAULT_CTX, at most the model's): the load prints the memory plan in one line and
        refuses a model that does not fit (UnsupportedByBackend) before uploading anything."""
        t0 = time.perf_counter()
        self.path = str(path)
        self.gguf = GGUFFile(self.path)
        check_alignment(self.gguf)          # before any device memory is taken
        cfg = ModelConfig.from_gguf(self.gguf)
        if official_decode_bug and not cfg.is_v41:
            raise Ds4Error(f"{self.path}: the official decode bug applies to V4.1 models only")
        self._publishers = None
        if official_decode_bug:
            from ds4py.host.keys import KeyPublishers

            self._publishers = KeyPublishers()
        header = min(t.offset for t in self.gguf.tensors.values())
        if progress is None:
            progress = not emulate and runtime is None
        fingerprint = file_fingerprint(self.path, head_bytes=header)
        # a domain sidecar / post-training stack (docs/vq.md), folded at load as the reference folds it: its gain
        # scales into the VQ row gains of the device copy, its router biases in place of the file's; a stale or
        # mismatched pair is refused here in one sentence (Stack.open); the model's fingerprint becomes the stack's
        self.stack = Stack.open(cfg, self.gguf, fingerprint, sidecar, posttrain)
        row_scales: dict[str, list[np.ndarray]] = {}
        biases: dict[str, np.ndarray] = {}
        if self.stack is not None:
            for name, sc in self.stack.row_scales():
                row_scales.setdefault(name, []).append(sc)
            biases = self.stack.biases()
            fingerprint = self.stack.fingerprint
        if ctx is not None and (not isinstance(ctx, int) or ctx < 1):
            raise Ds4Error(f"ctx must be a positive number of tokens, got {ctx!r}")
        plan_ctx = min(ctx or DEFAULT_CTX, cfg.context_length)

        def check(rt: Any, weights: int) -> None:
            """The memory plan, before the upload: one line, and a refusal when it does not fit."""
            bucket = bucket_for(plan_ctx, cfg.context_length)
            scratch = sum(layer.workspace_bytes(layer.workspace_shapes(cfg, bucket, rows, mode)) for rows, mode in
                          ((1, DECODE), (MAX_ROWS, ROWS), (layer.MAX_BLOCK, BLOCK)))
            self.memory_plan = MemoryPlan(weights, kv_bytes(self.layout, plan_ctx), plan_ctx, scratch,
                                          rt.free_bytes())
            if progress:
                print(f"ds4py: {self.memory_plan.line()}", file=sys.stderr, flush=True)
            self.memory_plan.check()

        self.engram = self._engram_feed(cfg, engram_dir)
        self._setup(cfg, numerics, rollback_horizon, runtime, emulate, pdl, graphs, bool(progress), fingerprint,
                    lambda rt, ws0: load_weights(rt, self.gguf, cfg, ws0, progress=bool(progress),
                                                 row_scales=row_scales, replace=biases,
                                                 plan=lambda n: check(rt, n)), t0)

    def _engram_feed(self, cfg: ModelConfig, engram_dir: str | None) -> EngramFeed | None:
        """V4.1's Engram: the hasher and the memory-mapped tables (refused in one sentence, as on the reference,
        when the folder or a table is missing or not the converted one)."""
        if not cfg.is_v41:
            if engram_dir is not None:
                raise Ds4Error(f"{self.path}: --engram-dir applies to V4.1 models only")
            return None
        if not cfg.engram_layers:
            return None
        from ds4py import engram

        hasher = engram.NgramHasher(cfg, *engram.gguf_vocabulary(self.gguf), self.path)
        dir_key, digest_key = engram.meta_keys(cfg.arch)
        folder = engram_dir if engram_dir is not None else self.gguf.meta(dir_key, None)
        return EngramFeed(cfg, hasher, engram.EngramTables.open(cfg, folder, self.gguf.meta(digest_key, None),
                                                                self.path))

    @classmethod
    def synthetic(cls, cfg: ModelConfig, seed: int = 0, experts: tuple = synth.Q2_EXPERTS,
                  numerics: Numerics | None = None, rollback_horizon: int = DEFAULT_ROLLBACK_HORIZON,
                  runtime: Any = None, emulate: bool = False, pdl: bool = True, graphs: bool = True,
                  vq: "synth.VqWidths | None" = None, dense: str | None = None,
                  engram_table: tuple[str, int] | None = None) -> "CudaModel":
        """A model of `cfg`'s shapes with random weights written on the device (ds4py/cuda/synth.py): the
        device check's full-size decode step, without a file. vq / dense: VQ-8 experts and Q4_K dense (the seed's
        layout); engram_table: (path, rows) of synth.write_engram_table's file, which a V4.1 config's Engram
        reads (required for one)."""
        self = cls.__new__(cls)
        self.path, self.gguf = f"synthetic:{cfg.n_layers} layers", None
        self.engram, self._publishers = None, None
        if cfg.engram_layers:
            if engram_table is None:
                raise UnsupportedByBackend("a synthetic V4.1 model reads Engram from a synthetic table: pass "
                                           "engram_table=(path, rows) of synth.write_engram_table")
            self.engram = synth.engram_feed(cfg, *engram_table, seed=seed)
        self._setup(cfg, numerics, rollback_horizon, runtime, emulate, pdl, graphs, False,
                    synth.fingerprint(cfg, experts, seed, vq, dense),
                    lambda rt, ws0: synth.load(rt, cfg, ws0, seed, experts, vq, dense), time.perf_counter())
        return self

    def _setup(self, cfg: ModelConfig, numerics: Numerics | None, rollback_horizon: int, runtime: Any,
               emulate: bool, pdl: bool, graphs: bool, progress: bool, fingerprint: str,
               load: Callable[[Any, int], DeviceWeights], t0: float) -> None:
        numerics = Numerics() if numerics is None else numerics
        if not isinstance(numerics, Numerics):
            raise Ds4Error(f"numerics must be a ds4py.model.Numerics, got {type(numerics).__name__}")
        if numerics.act_quant:
            raise UnsupportedByBackend("the CUDA backend computes fp32 activations; it has no int8 (act_quant) "
                                       "path (use --backend ref for ds4's numerics)")
        self.config, self.numerics = cfg, numerics
        self.layout = state_layout(cfg, rollback_horizon)
        self.rollback_horizon = rollback_horizon
        self.fingerprint = fingerprint
        self._check_config()
        self.rt = runtime if runtime is not None else _runtime(emulate, cfg, progress)
        want = model_defines(cfg)
        have = getattr(self.rt, "defines", None)
        if have is not None and any(have.get(k, v) != v for k, v in want.items()):
            raise Ds4Error(f"the runtime was built with defines {have}, this model needs {want}")
        from ds4py.cuda.emu_runtime import EmuRuntime

        self.emulated = isinstance(self.rt, EmuRuntime)
        self.backend = "cuda-emu" if self.emulated else "cuda"
        # device-side generation feeds each sampled token to the next step on the device; Engram's rows are
        # gathered on the host from that token, so an Engram model samples on the host (step by step)
        self.capabilities = Capabilities(speculation=True,
                                         device_generation=self.engram is None and self._publishers is None,
                                         launch_counts=True,
                                         multirow=True, block_prefill=True, emulated=self.emulated)
        self.pdl, self.graphs = bool(pdl), bool(graphs)
        self.min_bucket = MIN_BUCKET
        ws0 = layer.workspace_bytes(layer.workspace_shapes(cfg, bucket_for(1, cfg.context_length)))
        t1 = time.perf_counter()
        self.w = load(self.rt, ws0)
        self.rt.synchronize()
        self._check_weights()
        self.store = DeviceStore(self.rt)
        self._misc = self.store.block(256)
        self._misc.zero(self.rt.main)
        self.slot = self._misc.array(0, (2,), np.int32)            # [pos, token]
        self.ticket = self._misc.array(16, (1,), np.uint32)        # hc_mix's (zero between launches)
        self._v41_inputs(cfg)
        self.ws: layer.Workspace | None = None
        self._heads: OrderedDict[Any, StepRun] = OrderedDict()
        self.multirow = True                                       # several rows per step as one ROWS row set
        self.rows_ws: layer.Workspace | None = None
        self._rows_runs: OrderedDict[Any, StepRun] = OrderedDict()
        self.prefill_blocks = True                                 # long chunks as BLOCK row sets
        self.prefill_block = layer.MAX_BLOCK                       # tokens per prefill block (<= MAX_BLOCK)
        self.prefill_mma = True                                    # prefill dense products on tensor cores
        self.prefill_x_pieces = 3                                  # ... x as 3 bf16 pieces: exact (1: bf16 x)
        self.prefill_expert_mma = False                            # the experts too (bf16 x, h: less exact)
        # VQ-8 experts (every layer of a VQ file) take their own option: cu/moe_prefill.cu's VQ kernels keep x and h
        # exact (three bf16 pieces), so on tensor cores by default (False: the exact grouped rows kernels). Either
        # option holds up to the route kernel's MAX_EXPERTS (512; V4 Flash 256, V4.1 384), past it the rows kernels
        self.vq_experts = any(L.ffn.experts.gate.fmt is not None for L in self.w.binding.layers)
        self.prefill_vq_expert_mma = True
        # the exact GGML-format experts of a prefill block as fp32 token tiles grouped by expert (each expert's
        # weights read once per tile of its tokens; every (token, slot) result the decode kernels' bits, the slots
        # summed in order by the combine); False: the grouped rows kernels (weights read once per 1,024 pairs)
        self.prefill_expert_tiles = True
        self.prefill_ws: layer.Workspace | None = None
        self.last_generate: dict[str, float] = {}
        self.startup = {"weights_upload_s": time.perf_counter() - t1, "model_open_s": time.perf_counter() - t0,
                        "weights_gb": (self.w.file_bytes + self.w.extra_bytes) / 1e9}

    def _check_config(self) -> None:
        cfg = self.config
        if not cfg.is_v41:
            for il in range(cfg.n_layers):
                if cfg.is_compressed(il) and cfg.kv_source(il) != il:
                    raise UnsupportedByBackend(f"layer {il} reads compressed rows of layer {cfg.kv_source(il)}, "
                                               f"which a V4 model cannot do; use --backend ref")

    def _v41_inputs(self, cfg: ModelConfig) -> None:
        """V4.1's constant step inputs on the device: the first block's one-hot pre-mix and each Engram's q_w * k_w
        (multiplied as the reference does, in fp32)."""
        self._onehot, self._engram_w, self._v41_block = None, {}, None
        if not cfg.is_v41:
            return
        hc, D = cfg.hc_mult, cfg.dim
        self._v41_block = self.store.block(4 * hc + sum(4 * hc * D for _ in cfg.engram_layers) + 256)
        self._onehot = self._v41_block.array(0, (hc,), np.float32)
        self._onehot.upload(np.eye(1, hc, dtype=np.float32)[0], self.rt.main)
        at = 256
        for il, L in enumerate(self.w.binding.layers):
            e = cfg.roles(il).engram
            if e >= 0:
                q, k = (L.engram.q.array.download(), L.engram.k.array.download())
                self._engram_w[e] = self._v41_block.array(at, (hc, D), np.float32)
                self._engram_w[e].upload((q.astype(np.float32) * k.astype(np.float32)).reshape(hc, D), self.rt.main)
                at += 4 * hc * D

    def _recording(self, ws: layer.Workspace, rows: RowSet, tickets: DeviceArray, **kw: Any) -> Recording:
        return Recording(self.config, self.numerics, self.w.freqs, ws, rows, tickets, onehot=self._onehot,
                         engram_weights=self._engram_w, **kw)

    def _stage_engram(self, ws: layer.Workspace, chunks: list[tuple[CudaState, int, Sequence[int]]],
                      upcoming: list[tuple[CudaState, int, Sequence[int]]] | None = None) -> None:
        """Engram's rows of these (state, first position, tokens) chunks, in row order, into ws's input slot;
        upcoming: the next step's chunks when already known (gathered on a worker meanwhile)."""
        if self.engram is not None:
            self.engram.stage_chunks(self.rt, ws.engram_codes, ws.engram_scales, chunks, upcoming)

    def _check_weights(self) -> None:
        for il, lw in enumerate(self.w.binding.layers):
            check_gate_up(f"layer {il}", lw.ffn)

    # ---- the contract ----------------------------------------------------------------------------------------
    def new_state(self) -> CudaState:
        self.store.reclaim()
        return CudaState(self.layout, self.store)

    def check_state(self, state: Any, what: str = "state") -> None:
        super().check_state(state, what)
        if state.busy:
            raise Ds4Error(f"{what} is being generated into (a generate() iterator is running on it)")
        if state.store is not self.store:
            raise Ds4Error(f"{what} belongs to another CUDA model")

    # ---- the planner: one step = row sets, run in order -----------------------------------------------------------
    def plan(self, chunks: Sequence[Sequence[int]]) -> list[tuple[str, list[int]]]:
        """The row sets a step of these chunks runs as, in order: (mode, the indices of the chunks it holds).

        ROWS: short chunks (at most rollback horizon + 1 positions; a decode row, a verify) packed in order into
        multi-row steps of 2 to MAX_ROWS rows; BLOCK: a prompt (a chunk longer than the rollback horizon + 1) in
        prefill blocks; DECODE: a chunk on its own, position by position through its state's decode graph (one
        row; or a short chunk with multirow off). Sequences are independent, so the grouping changes no row's
        bits: every row is bit-identical to its single-row step."""
        lens = [len(c) for c in chunks]
        limit = self.rollback_horizon + 1
        if self.multirow and 2 <= sum(lens) <= MAX_ROWS and all(n <= limit for n in lens):
            return [(ROWS, list(range(len(lens))))]
        alone = lambda i: (BLOCK if self.prefill_blocks and lens[i] > limit else DECODE, [i])  # noqa: E731
        short = min(limit, MAX_ROWS)
        if not self.multirow or len(lens) < 2 or sum(n for n in lens if n <= short) < 2:
            return [alone(i) for i in range(len(lens))]
        out: list[tuple[str, list[int]]] = []
        group: list[int] = []

        def flush() -> None:
            if group:
                out.append((ROWS, list(group)) if sum(lens[i] for i in group) >= 2 else alone(group[0]))
                group.clear()

        for i, n in enumerate(lens):
            if n > short:
                out.append(alone(i))
                continue
            if sum(lens[j] for j in group) + n > MAX_ROWS:
                flush()
            group.append(i)
        flush()
        return out

    def _step(self, states: list[CudaState], chunks: list[np.ndarray], all_logits: bool) -> list[np.ndarray]:
        return self._run(states, chunks, all_logits, None)[0]

    def _step_hidden(self, states: list[CudaState], chunks: list[np.ndarray],
                     all_logits: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """step, and each row's final residual X [hc, D] (the head's input h_j, the MTP block's input): the same
        row sets as step, their residuals read back."""
        return self._run(states, chunks, all_logits, "hidden")

    def _step_taps(self, states: list[CudaState], chunks: list[np.ndarray],
                   all_logits: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """step, and each row's DSpark taps [n_targets * D] (V4.1's draft input): the same row sets as step with
        the tap kernel recorded after each target layer's Engram (layer.record_tap), the taps read back. Its row
        sets are graphs of their own (a plain step's keep their launches)."""
        return self._run(states, chunks, all_logits, "taps")

    def _open_dspark(self):
        from ds4py.cuda.dspark import CudaDSpark

        return CudaDSpark(self)

    def _run(self, states: list[CudaState], chunks: list[np.ndarray], all_logits: bool,
             extra: str | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The planned row sets of a step: (logits per chunk, per chunk its rows' final residuals [T, hc, D] with
        extra "hidden", their DSpark taps [T, n_targets * D] with "taps")."""
        self.store.reclaim()
        logits: list[Any] = [None] * len(states)
        rows: list[Any] = [None] * len(states)
        for mode, idx in self.plan(chunks):
            if mode == ROWS:
                sts, chs = [states[i] for i in idx], [chunks[i] for i in idx]
                # (a plain or hidden step calls the row-set runners as before taps existed: tests spy on them)
                lg = self._step_rows(sts, chs, all_logits, *([True] if extra == "taps" else []))
                hs = self._rows_extra(chs, extra) if extra else [None] * len(idx)
            else:
                i = idx[0]
                run = self._prefill if mode == BLOCK else self._positions
                got = run(states[i], np.asarray(chunks[i]), all_logits, hidden=extra == "hidden",
                          **({"taps": True} if extra == "taps" else {}))
                lg, hs = ([got[0]], [got[1]]) if extra else ([got], [None])
            for j, i in enumerate(idx):
                logits[i], rows[i] = lg[j], hs[j]
        return logits, rows

    def _positions(self, st: CudaState, ids: np.ndarray, all_logits: bool, hidden: bool = False,
                   taps: bool = False) -> Any:
        """One state's chunk position by position through its decode graph (DECODE); hidden / taps: (logits, every
        position's final residual [T, hc, D] / DSpark taps [T, n_targets * D])."""
        n0, T = st.n_tokens, len(ids)
        extra = "taps" if taps else "hidden" if hidden else None
        keys = self._key_layers(st, n0, T)
        body = self._body(st, n0 + T - 1, keys, taps)     # rows grown and graph captured before anything is written
        head = self._head(None)
        body = self._body(st, n0 + T - 1, keys, taps)     # (the head may have grown the workspace)
        X = self.ws.taps if taps else layer.final_residual(self._context(st, body.tag[0]))
        H = np.empty((T,) + self._extra_shape(extra), np.float32) if extra else None
        st.begin_step(T)
        rows = []
        for i, tok in enumerate(ids):
            st.device_hw = max(st.device_hw, n0 + i + 1)
            self._stage_engram(self.ws, [(st, n0 + i, [int(tok)])],    # the chunk's next token is known
                               [(st, n0 + i + 1, [int(ids[i + 1])])] if i + 1 < T else None)
            body.run([n0 + i, int(tok)])
            if extra:
                H[i] = X.download().reshape(H.shape[1:])
            if all_logits or i == T - 1:
                head.run(())
                rows.append(self.ws.logits.download())
        st.end_step(T)
        logits = np.stack(rows) if all_logits else rows[-1]
        return (logits, H) if extra else logits

    def _extra_shape(self, extra: str) -> tuple[int, ...]:
        cfg = self.config
        return (cfg.dspark_tap_dim,) if extra == "taps" else (cfg.hc_mult, cfg.dim)

    def _prefill(self, st: CudaState, ids: np.ndarray, all_logits: bool, hidden: bool = False,
                 taps: bool = False) -> Any:
        """A chunk longer than the rollback horizon + 1 (a prompt): BLOCK row sets of up to MAX_BLOCK tokens,
        each one launch sequence over its rows, launched directly (no graph); the head runs for the rows asked
        for. The state ends as position-by-position steps leave it. hidden: (logits, every position's final
        residual [T, hc, D]) for the MTP block, the same rows plain decoding computes; taps: their DSpark taps
        [T, n_targets * D]."""
        cfg, rt = self.config, self.rt
        extra = "taps" if taps else "hidden" if hidden else None
        n0, T = st.n_tokens, len(ids)
        bucket = bucket_for(n0 + T, cfg.context_length, self.min_bucket)
        blk = max(1, min(int(self.prefill_block), layer.MAX_BLOCK))
        rows = layer.block_rows(min(T, blk))
        expert_mma = ((self.prefill_vq_expert_mma if self.vq_experts else self.prefill_expert_mma)
                      and cfg.n_experts <= ops_moep.MAX_EXPERTS)
        expert_tiles = (not expert_mma and self.prefill_expert_tiles and not self.vq_experts
                        and cfg.n_experts <= ops_moep.MAX_EXPERTS)
        ws = self.prefill_ws
        if ws is None or ws.bucket < bucket or ws.rows < rows:
            rt.synchronize()
            if ws is not None:
                self.store.retire([ws.block])
            ws = self.prefill_ws = layer.make_workspace(
                cfg, max(bucket, ws.bucket if ws else 0), max(rows, ws.rows if ws else 0), BLOCK, store=self.store,
                rt=rt)
        st.ensure_rows(bucket)
        keys = self._key_layers(st, n0, T)
        st.begin_step(T)
        out: list[np.ndarray] = []
        H = np.empty((T,) + self._extra_shape(extra), np.float32) if extra else None
        B = self.w.binding
        for a in range(0, T, blk):
            Tb = min(blk, T - a)
            ws.slot.view(0, Tb).upload(np.arange(n0 + a, n0 + a + Tb, dtype=np.int32), rt.main)
            ws.slot.view(4 * ws.rows, Tb).upload(np.ascontiguousarray(ids[a:a + Tb], np.int32), rt.main)
            st.device_hw = max(st.device_hw, n0 + a + Tb)
            nb = a + Tb                             # the next block's rows are known: gathered while this one runs
            self._stage_engram(ws, [(st, n0 + a, ids[a:a + Tb])],
                               [(st, n0 + nb, ids[nb:nb + blk])] if nb < T else None)
            rec = self._recording(ws, RowSet(BLOCK, [dict(st.arrays)], [bucket], Tb, ws.slot, cap=ws.rows,
                                             keys=None if keys is None else [keys]),
                                  ws.tickets, mma=self.prefill_mma, x_pieces=self.prefill_x_pieces,
                                  expert_mma=expert_mma, expert_tiles=expert_tiles,
                                  taps=ws.taps if extra == "taps" else None)
            ls = layer.Launcher(rt, self.pdl)
            layer.record_body(ls, rec, B)
            X = layer.final_residual(rec)
            if extra:
                src = ws.taps if extra == "taps" else X
                H[a:a + Tb] = src.view(0, (Tb,) + H.shape[1:]).download()
            heads = range(0, Tb, layer.HEAD_ROWS) if all_logits else ([Tb - 1] if a + Tb == T else [])
            for r0 in heads:
                n = min(layer.HEAD_ROWS, Tb - r0)
                layer.record_head(ls, rec, X, n, B.hc_head, B.output_norm, B.head, r0=r0)
                out.append(ws.logits.view(0, (n, cfg.vocab_size)).download())
        st.end_step(T)
        logits = np.concatenate(out) if all_logits else out[-1][-1].copy()
        return (logits, H) if extra else logits

    def _step_rows(self, states: list[CudaState], chunks: list[np.ndarray], all_logits: bool,
                   taps: bool = False) -> list[np.ndarray]:
        """One ROWS step: every chunk's positions as rows of one graph replay; each row's logits bit-identical to
        stepping its state position by position (taps: the graph that also writes the rows' DSpark taps)."""
        plan = [(st, st.n_tokens + i, int(t)) for st, ids in zip(states, chunks) for i, t in enumerate(ids)]
        keys = {id(st): self._key_layers(st, st.n_tokens, len(ids)) for st, ids in zip(states, chunks)}
        run, order = self._rows_run(plan, keys if self._publishers is not None else None, taps)
        R = len(plan)
        rows = [plan[r] for r in order]
        values = [pos for _, pos, _ in rows] + [0] * (MAX_ROWS - R) + [tok for _, _, tok in rows]
        if self.engram is not None:
            self._stage_engram(self.rows_ws, [(st, pos, [tok]) for st, pos, tok in rows])
        for st, ids in zip(states, chunks):
            st.begin_step(len(ids))
            st.device_hw = max(st.device_hw, st.n_tokens + len(ids))
        run.run(values)
        self._rows_order = order
        got = self.rows_ws.logits.view(0, (R, self.config.vocab_size)).download()
        logits = np.empty_like(got)
        logits[order] = got                                # back into the caller's row order
        out, at = [], 0
        for st, ids in zip(states, chunks):
            T = len(ids)
            st.end_step(T)
            out.append(logits[at:at + T].copy() if all_logits else logits[at + T - 1].copy())
            at += T
        return out

    def _rows_extra(self, chunks: list[np.ndarray], extra: str) -> list[np.ndarray]:
        """The final residuals [T, hc, D] ("hidden") or DSpark taps [T, n_targets * D] ("taps") per chunk of the
        last ROWS step (in the caller's row order)."""
        cfg = self.config
        X = self.rows_ws.taps if extra == "taps" else self.rows_ws.X0 if cfg.n_layers % 2 == 0 else self.rows_ws.X1
        R = sum(len(c) for c in chunks)
        got = X.view(0, (R,) + self._extra_shape(extra)).download()
        H = np.empty_like(got)
        H[self._rows_order] = got
        out, at = [], 0
        for c in chunks:
            out.append(H[at:at + len(c)].copy())
            at += len(c)
        return out

    def _row_bucket(self, st: CudaState, pos: int) -> int:
        """The context bucket a single-row step of `st` at `pos` runs in (its attention plan): a row keeps it."""
        need = bucket_for(pos + 1, self.config.context_length, self.min_bucket)
        return max([need] + [run.tag[0] for run in st.graph if run is not None])

    def _rows_run(self, plan: list[tuple[CudaState, int, int]], keys: dict[int, dict[int, int]] | None = None,
                  taps: bool = False) -> tuple[StepRun, list[int]]:
        """The ROWS graph for these rows, captured on first use, and the order its rows run in (rows[order[j]] is
        its row j). The graph is keyed by what it baked in: each row's state arrays and context bucket, in a
        canonical order (rows grouped by state, states by address; a state's rows keep their position order), so
        the same states in another order or grouping of the scheduler's replay one graph. A row set's first step
        launches directly; it is captured when it comes again (one-off batches, such as a prompt chunk beside
        decode rows, cost no capture). keys: per state (by id) its _key_layers (the official decode bug), in the key."""
        buckets = [self._row_bucket(st, pos) for st, pos, _ in plan]
        top = max(buckets)
        if self.rows_ws is None or self.rows_ws.bucket < top:
            self.rt.synchronize()
            version = 0 if self.rows_ws is None else self.rows_ws.version + 1
            if self.rows_ws is not None:                # its graphs point into the old block: drop them
                self.store.retire([self.rows_ws.block, *self._rows_runs.values()])
                self._rows_runs.clear()
            self.rows_ws = layer.make_workspace(self.config, top, MAX_ROWS, ROWS, version, store=self.store,
                                                rt=self.rt)
        per_state: dict[int, int] = {}
        for (st, _, _), b in zip(plan, buckets):
            per_state[id(st)] = max(per_state.get(id(st), 0), b)
        for st, _, _ in plan:
            st.ensure_rows(per_state[id(st)])
        order = sorted(range(len(plan)), key=lambda r: min(a.ptr for a in plan[r][0].arrays.values()))
        plan, buckets = [plan[r] for r in order], [buckets[r] for r in order]
        ws = self.rows_ws
        row_keys = None if keys is None else [keys[id(st)] for st, _, _ in plan]
        key = (ws.version, self.pdl, self.graphs, taps, tuple(
            (b, tuple((a.ptr, a.shape[0]) for a in st.arrays.values())) for (st, _, _), b in zip(plan, buckets)),
            None if row_keys is None else tuple(tuple(sorted(k.items())) for k in row_keys))
        run = self._rows_runs.get(key)
        if run is not None:                             # seen before: worth a graph from now on
            self._rows_runs.move_to_end(key)
            run.use_graph()
            return run, order
        rec = self._recording(ws, RowSet(ROWS, [dict(st.arrays) for st, _, _ in plan], buckets, len(plan), ws.slot,
                                         cap=MAX_ROWS, keys=row_keys), ws.tickets, taps=ws.taps if taps else None)
        B = self.w.binding

        def record(ls: layer.Launcher) -> None:
            layer.record_body(ls, rec, B)
            layer.record_head(ls, rec, layer.final_residual(rec), rec.R, B.hc_head, B.output_norm, B.head)

        run = StepRun(self, record, key, slot=ws.slot, graph=False)     # its first run: direct launches
        self._rows_runs[key] = run
        while len(self._rows_runs) > ROWS_GRAPHS:
            self.store.retire([self._rows_runs.popitem(last=False)[1]])
        return run, order

    def launches_per_rows_step(self, n_rows: int) -> dict[str, int]:
        """Kernels of one multi-row step of n_rows fresh sequences (one row each)."""
        sts = [self.new_state() for _ in range(n_rows)]
        run, _ = self._rows_run([(st, 0, 0) for st in sts])
        n, side = run.count()
        return {"rows": n_rows, "total": n, "side_stream": side}

    def _export(self, state: CudaState) -> dict[str, np.ndarray]:
        return state.export()

    def _import(self, n_tokens: int, n_written: int, arrays: dict[str, np.ndarray]) -> CudaState:
        st = self.new_state()
        st.n_tokens, st.n_written = n_tokens, n_written
        st.load(arrays)
        return st

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every tensor, but one row of the embedding and n_experts_used
        of n_experts of each routed expert tensor (the bench's roofline)."""
        cfg, total = self.config, 0
        for e in schema.entries(cfg):
            t = synth._lookup(self.w.binding, e)
            if e.spec.field == "embed":
                total += t.array.nbytes // t.shape[0]
            elif e.spec.field.startswith("ffn.experts."):              # VQ-8: the codebook is read by every block
                cb = ops_moe.codebook_bytes(t.kernel_format)
                total += cb + (t.array.nbytes - cb) * cfg.n_experts_used // cfg.n_experts
            else:
                total += t.array.nbytes
        return total

    def weight_bytes(self) -> WeightBytes:
        """decode = weight_bytes_per_token(); routed: the routed experts' bytes (n_experts_used of n_experts);
        head: the output head's (the same figures as the reference's: the tensors keep their GGUF formats)."""
        cfg, B, routed = self.config, self.w.binding, 0
        for e in schema.entries(cfg):
            if e.spec.field.startswith("ffn.experts."):
                routed += synth._lookup(B, e).array.nbytes * cfg.n_experts_used // cfg.n_experts
        return WeightBytes(self.weight_bytes_per_token(), routed, int(B.head.array.nbytes))

    def open_mtp(self, path: str | None = None):
        from ds4py.cuda.mtp import CudaMtp

        return CudaMtp(self, path)

    def copy_bandwidth_gbps(self) -> float:
        """Device-to-device copy bandwidth (on the emulator: the host's, which is what it reads)."""
        if self.emulated:
            return super().copy_bandwidth_gbps()
        from ds4py.cuda.probe import device_copy_bandwidth_gbps

        return device_copy_bandwidth_gbps(self.rt)

    # ---- graphs -------------------------------------------------------------------------------------------------
    def _workspace(self, bucket: int) -> layer.Workspace:
        if self.ws is None or self.ws.bucket < bucket:
            self.rt.synchronize()                       # the old scratch may be freed: nothing may still use it
            version = 0 if self.ws is None else self.ws.version + 1
            self.ws = layer.make_workspace(self.config, bucket, 1, DECODE, version, arena=self.w.arena)
        return self.ws

    def _context(self, st: CudaState | None, bucket: int, keys: dict[int, int] | None = None,
                 taps: bool = False) -> Recording:
        """The DECODE recording of `st` (None: the head, which reads no state) in context bucket `bucket` (keys: the
        official decode bug's _key_layers; taps: with the DSpark taps)."""
        parts = [dict(st.arrays)] if st is not None else []
        rows = RowSet(DECODE, parts, [bucket], 1, self.slot, keys=None if keys is None else [keys])
        return self._recording(self.ws, rows, self.ticket, taps=self.ws.taps if taps else None)

    def _key_layers(self, st: CudaState, p0: int, T: int) -> dict[int, int] | None:
        """The official decode bug (None without it): for a chunk of T positions from p0, the layer whose indexer
        keys each indexer scores, as the reference's v41.KeyPublishers chooses them (a key owner publishes when
        its compressor emits a row in the chunk; an indexer scores the last publisher's keys), and the state's
        record of the last publisher updated. The record lives on the host per state object (a copied or loaded
        state has none: it starts from the fixed behaviour, as on the reference); the choice is baked into the
        step's graph, one captured variant per choice (_body, _rows_run)."""
        if self._publishers is None:
            return None
        seq = SimpleNamespace(state=st, key_pub=-1)
        self._publishers.begin([seq])
        keys = {}
        for il in range(self.config.n_layers):
            ro = self.config.roles(il)
            if ro.compressed and ro.indexer:
                emitted = ro.compressor and (p0 + T) // ro.ratio > p0 // ro.ratio
                keys[il] = self._publishers.keys_layer(seq, ro, emitted)
        self._publishers.end([seq])
        return keys

    def _body(self, st: CudaState, pos: int, keys: dict[int, int] | None = None, taps: bool = False) -> StepRun:
        """The state's decode graph for position `pos` (captured for the bucket holding it); keys: the step's
        _key_layers (the official decode bug); taps: the graph that also writes the row's DSpark taps. st.graph
        holds one graph per (key choice, taps) used."""
        need = bucket_for(pos + 1, self.config.context_length, self.min_bucket)
        choice = (() if keys is None else tuple(sorted(keys.items())), bool(taps))
        run = next((r for r in st.graph if r is not None and r.tag[3] == choice), None)
        if run is not None and run.tag[0] >= need and run.tag[1] == st.generation and self.ws is not None \
                and run.tag[2] == self.ws.version and run.mode == (self.pdl, self.graphs):
            return run
        bucket = self._row_bucket(st, pos)
        ws = self._workspace(bucket)
        st.ensure_rows(bucket)
        if run is not None:
            self.store.retire([run])
            st.graph.remove(run)
        rec, B = self._context(st, bucket, keys, taps), self.w.binding
        run = StepRun(self, lambda ls: layer.record_body(ls, rec, B), (bucket, st.generation, ws.version, choice))
        if st.graph == [None]:
            st.graph[0] = run
        else:
            st.graph.append(run)
        return run

    def _head(self, sampling: tuple | None) -> StepRun:
        ws = self._workspace(self.ws.bucket if self.ws is not None else
                             bucket_for(1, self.config.context_length, self.min_bucket))
        run = self._heads.get(sampling)
        if run is not None and run.tag[0] == ws.version and run.mode == (self.pdl, self.graphs):
            self._heads.move_to_end(sampling)
            return run
        if run is not None:
            self.store.retire([self._heads.pop(sampling)])
        rec, B = self._context(None, ws.bucket), self.w.binding

        def record(ls: layer.Launcher) -> None:
            layer.record_head(ls, rec, layer.final_residual(rec), 1, B.hc_head, B.output_norm, B.head)
            if sampling is not None:
                layer.record_sample(ls, rec, sampling)

        run = StepRun(self, record, (ws.version,))
        self._heads[sampling] = run
        while len(self._heads) > HEAD_GRAPHS:
            self.store.retire([self._heads.popitem(last=False)[1]])
        return run

    def set_launch_mode(self, pdl: bool, graphs: bool) -> None:
        """Programmatic dependent launches on / off, graph replay or direct launches (the bench compares them
        on one set of weights): every step is captured again in the new mode."""
        self.pdl, self.graphs = bool(pdl), bool(graphs)

    def launches_per_step(self, state: CudaState | None = None) -> dict[str, int]:
        """Kernels of one decode step at the state's bucket (a fresh state: the first one): the body, the head
        with the sampler, and how many of them run on the side stream."""
        st = state if state is not None else self.new_state()
        body, side = self._body(st, st.n_tokens).count()
        head, head_side = self._head((0.0, 0, 1.0, 0.0, 0)).count()
        return {"body": body, "head": head, "total": body + head, "side_stream": side + head_side}

    # ---- device-side generation (ds4py.model.DeviceGeneration) ---------------------------------------------------
    def generate(self, state: CudaState, token: int, params: SamplingParams, max_tokens: int) -> Iterator[int]:
        """Feed `token` at the state's next position, then yield up to max_tokens sampled tokens, each drawn on
        the device and fed by the next step without the host (docs/engine.md "Device-side generation"). When the
        iterator ends or is closed after yielding k tokens, the state has consumed `token` and the first k - 1 of
        them (the last sampled token is not fed). Checks run now; the work starts on the first next()."""
        self.check_state(state)
        if self._publishers is not None:
            raise UnsupportedByBackend("device-side generation bakes one index-key choice into its graph, and the "
                                       "official decode bug changes it per step: sample with step() on this model")
        if self.engram is not None:
            raise UnsupportedByBackend("device-side generation feeds sampled tokens without the host, and Engram's "
                                       "rows are gathered on the host: sample with step() on this model")
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) \
                or not 0 <= int(token) < self.config.vocab_size:
            raise Ds4Error(f"token {token!r} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if not isinstance(params, SamplingParams):
            raise Ds4Error(f"params must be a ds4py.sampling.SamplingParams, got {type(params).__name__}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise Ds4Error(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if state.n_tokens + int(max_tokens) > self.config.context_length:
            raise ContextLengthError(f"{state.n_tokens} + {int(max_tokens)} tokens exceed the context length "
                                     f"{self.config.context_length}")
        return self._generate(state, int(token), params, int(max_tokens))

    @staticmethod
    def sampling_key(params: SamplingParams) -> tuple:
        """The sampler's launch values: greedy, or (temperature, top_k, top_p, min_p, seed); no seed = fresh."""
        if params.greedy:
            return (0.0, 0, 1.0, 0.0, 0)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        return (float(params.temperature), int(params.top_k), float(params.top_p), float(params.min_p), seed)

    def _generate(self, st: CudaState, token: int, params: SamplingParams, max_tokens: int) -> Iterator[int]:
        self.store.reclaim()
        sampling = self.sampling_key(params)
        reader = TokenReader(self.rt)
        n0, yielded, launched, host = st.n_tokens, 0, 0, 0.0
        st.busy = True
        t_start = time.perf_counter()

        def launch(k: int) -> int:                      # feed input k (the given token, then sampled ones)
            nonlocal host, launched
            launched += 1
            t0 = time.perf_counter()
            body = self._body(st, n0 + k)
            head = self._head(sampling)
            body = self._body(st, n0 + k)
            st.device_hw = max(st.device_hw, n0 + k + 1)
            body.run([n0 + k, token] if k == 0 else [n0 + k])
            head.run(())
            i = reader.enqueue(self.slot.view(4, 1))
            host += time.perf_counter() - t0
            return i

        try:
            pending = launch(0)
            for i in range(1, max_tokens + 1):
                ahead = launch(i) if i < max_tokens else None     # feeds t_i, already on the device
                t = reader.wait(pending)
                if t < 0:
                    raise InvalidLogits("the logits contain NaN/inf or are all -inf (the backend produced "
                                        "invalid numbers)")
                yielded = i
                yield t
                pending = ahead
        finally:
            st.busy = False
            st.n_tokens = n0 + yielded                 # token and t_1 .. t_{k-1}; a run-ahead step is undone
            st.n_written = max(st.n_written, st.n_tokens)
            reader.close()
            self.last_generate = {"tokens": yielded, "host_s": host, "wall_s": time.perf_counter() - t_start,
                                  "steps": launched}

    def close(self) -> None:
        """Release the device (the model is unusable afterwards)."""
        for run in self._heads.values():
            self.store.retire([run])
        self._heads.clear()
        for run in self._rows_runs.values():
            self.store.retire([run])
        self._rows_runs.clear()
        if self.rows_ws is not None:
            self.store.retire([self.rows_ws.block])
            self.rows_ws = None
        if self.prefill_ws is not None:
            self.store.retire([self.prefill_ws.block])
            self.prefill_ws = None
        self.store.retire([self._misc])
        self.store.reclaim()
        if self.engram is not None:                 # its worker thread and pinned staging
            self.engram.close(self.rt.memory)
        self.rt.synchronize()
        self.w.arena.close()
