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
storage (kv_dtype "f16") as the reference computes them; with Numerics.act_quant (ds4's int8 activations, the
reference's --act-quant mode) the activation of every quantised product rounded as the reference rounds it
(kernels.act_x; the int8 expert kernels round inside), a block's experts on the int8 grouped rows kernels.
numerics="device" (contract.DEVICE_NUMERICS, what the CLI passes without --exact / --act-quant): the opened
device's declared default (ds4py/cuda/devices.py act_numerics), decided once the runtime is up, why in numerics_why.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ds4py.config import ModelConfig
from ds4py.contract import DEFAULT_ROLLBACK_HORIZON, Capabilities, ModelBase, Numerics, WeightBytes
from ds4py.cuda import generation, layer, loading, planner, synth, weight_bytes
from ds4py.cuda.device_weights import DeviceWeights, check_gate_up
from ds4py.cuda.device_weights import load as load_weights
from ds4py.cuda.gguf_upload import check_alignment
from ds4py.cuda.kvstate import CudaState, CudaStates, DeviceStore
from ds4py.cuda.layer import BLOCK, MAX_ROWS, ROWS
from ds4py.cuda.memory_plan import DEFAULT_CTX
from ds4py.cuda.options import EngineOptions, Outputs, bucket_for
from ds4py.cuda.planner import RowSetPlan
from ds4py.cuda.row_sets import RowSetRunner
from ds4py.errors import Ds4Error, UnsupportedByBackend
from ds4py.fingerprint import file_fingerprint
from ds4py.gguf import GGUFFile
from ds4py.kv import state_layout
from ds4py.sampling import SamplingParams


class CudaModel(CudaStates, ModelBase):
    """The engine contract on CUDA devices (docs/engine.md, docs/cuda.md "The engine"); new_state / _export /
    _import are CudaStates' (ds4py/cuda/kvstate.py), as its drafts' are."""

    backend = "cuda"
    state_type = CudaState
    stable_rows = MAX_ROWS     # a verify of 1 + k <= 16 rows is one multi-row step (spec: k <= 15)

    def __init__(self, path: str, numerics: Numerics | str | None = None,
                 rollback_horizon: int = DEFAULT_ROLLBACK_HORIZON, runtime: Any = None, emulate: bool = False,
                 pdl: bool | None = None, graphs: bool | None = None, progress: bool | None = None,
                 sidecar: Any = None, posttrain: Any = None, engram_dir: str | None = None,
                 official_decode_bug: bool = False, ctx: int | None = None, options: EngineOptions | None = None):
        """runtime: a Runtime / EmuRuntime to use (default: a new one: the GPU, or the emulator with emulate).
        options: how steps run (EngineOptions; default: the engine's best); pdl / graphs: those two of them
        (programmatic dependent launches and graph replay; off for the bit-identity tests and the bench).
        sidecar / posttrain: a domain sidecar and post-training file (docs/vq.md), folded at load as the
        reference folds them. engram_dir: V4.1's Engram tables (the folder with the official shards; default: the
        one convert recorded; ignored for V4). official_decode_bug: V4.1 only, the official decode's index-key
        bug as the reference reproduces it (for comparison; RowSetRunner.key_layers). ctx: the context one
        sequence is planned for (default memory_plan.DEFAULT_CTX, at most the model's): the load prints the
        memory plan in one line and refuses a model that does not fit (UnsupportedByBackend) before uploading
        anything (ds4py/cuda/loading.py)."""
        t0 = time.perf_counter()
        self.path = str(path)
        self.gguf = GGUFFile(self.path)
        check_alignment(self.gguf)          # before any device memory is taken
        cfg = ModelConfig.from_gguf(self.gguf)
        if official_decode_bug and not cfg.traits.latent_index_keys:     # no key publishers: no bug to reproduce
            raise Ds4Error(f"{self.path}: the official decode bug applies to V4.1 models only")
        self.publishers = None
        if official_decode_bug:
            from ds4py.host.keys import KeyPublishers

            self.publishers = KeyPublishers()
        header = min(t.offset for t in self.gguf.tensors.values())
        if progress is None:
            progress = not emulate and runtime is None
        self.stack, row_scales, biases, fingerprint = loading.fold_stack(
            cfg, self.gguf, file_fingerprint(self.path, head_bytes=header), sidecar, posttrain)
        if ctx is not None and (not isinstance(ctx, int) or ctx < 1):
            raise Ds4Error(f"ctx must be a positive number of tokens, got {ctx!r}")
        plan_ctx = min(ctx or DEFAULT_CTX, cfg.context_length)

        def check(rt: Any, weights: int) -> None:
            self.memory_plan = loading.memory_plan(cfg, self.layout, plan_ctx, rt, weights, bool(progress),
                                                   self.numerics.act_quant)

        self.engram = loading.engram_feed(cfg, self.gguf, self.path, engram_dir)
        self._setup(cfg, numerics, rollback_horizon, runtime, emulate, loading.options(options, pdl, graphs),
                    bool(progress), fingerprint,
                    lambda rt, ws0: load_weights(rt, self.gguf, cfg, ws0, progress=bool(progress),
                                                 row_scales=row_scales, replace=biases,
                                                 plan=lambda n: check(rt, n)), t0)

    @classmethod
    def synthetic(cls, cfg: ModelConfig, seed: int = 0, experts: tuple = synth.Q2_EXPERTS,
                  numerics: Numerics | str | None = None, rollback_horizon: int = DEFAULT_ROLLBACK_HORIZON,
                  runtime: Any = None, emulate: bool = False, pdl: bool | None = None, graphs: bool | None = None,
                  vq: "synth.VqWidths | None" = None, dense: str | None = None,
                  engram_table: tuple[str, int] | None = None, options: EngineOptions | None = None) -> "CudaModel":
        """A model of `cfg`'s shapes with random weights written on the device (ds4py/cuda/synth.py): the
        device check's full-size decode step, without a file. vq / dense: VQ-8 experts and Q4_K dense (the seed's
        layout); engram_table: (path, rows) of synth.write_engram_table's file, which a V4.1 config's Engram
        reads (required for one)."""
        self = cls.__new__(cls)
        self.path, self.gguf = f"synthetic:{cfg.n_layers} layers", None
        self.engram, self.publishers = None, None
        if cfg.engram_layers:
            if engram_table is None:
                raise UnsupportedByBackend("a synthetic V4.1 model reads Engram from a synthetic table: pass "
                                           "engram_table=(path, rows) of synth.write_engram_table")
            self.engram = synth.engram_feed(cfg, *engram_table, seed=seed)
        self._setup(cfg, numerics, rollback_horizon, runtime, emulate, loading.options(options, pdl, graphs), False,
                    synth.fingerprint(cfg, experts, seed, vq, dense),
                    lambda rt, ws0: synth.load(rt, cfg, ws0, seed, experts, vq, dense), time.perf_counter())
        return self

    def _setup(self, cfg: ModelConfig, numerics: Numerics | str | None, rollback_horizon: int, runtime: Any,
               emulate: bool, options: EngineOptions, progress: bool, fingerprint: str,
               load: Callable[[Any, int], DeviceWeights], t0: float) -> None:
        self.config, numerics = cfg, loading.numerics(numerics)
        self.layout = state_layout(cfg, rollback_horizon)
        self.rollback_horizon = rollback_horizon
        self.fingerprint = fingerprint
        self.rt = loading.runtime(runtime, emulate, cfg, progress)
        self.numerics, self.numerics_why = loading.device_numerics(numerics, self.rt)   # the device is known now
        from ds4py.cuda.emu_runtime import EmuRuntime

        self.emulated = isinstance(self.rt, EmuRuntime)
        self.backend = "cuda-emu" if self.emulated else "cuda"
        # device-side generation feeds each sampled token to the next step on the device; Engram's rows are
        # gathered on the host from that token, so an Engram model samples on the host (step by step)
        self.capabilities = Capabilities(speculation=True,
                                         device_generation=self.engram is None and self.publishers is None,
                                         launch_counts=True,
                                         multirow=True, block_prefill=True, emulated=self.emulated)
        self.options = options
        ws0 = layer.workspace_bytes(layer.workspace_shapes(cfg, bucket_for(1, cfg.context_length),
                                                           act_quant=self.numerics.act_quant))
        t1 = time.perf_counter()
        self.w = load(self.rt, ws0)
        self.rt.synchronize()
        for il, lw in enumerate(self.w.binding.layers):
            check_gate_up(f"layer {il}", lw.ffn)
        self.store = DeviceStore(self.rt)
        self._misc = self.store.block(256)
        self._misc.zero(self.rt.main)
        self.slot = self._misc.array(0, (2,), np.int32)            # [pos, token]
        self.ticket = self._misc.array(16, (1,), np.uint32)        # hc_mix's (zero between launches)
        self.vq_experts = any(L.ffn.experts.gate.fmt is not None for L in self.w.binding.layers)
        self.runner = RowSetRunner(self)
        self._onehot = self.runner.onehot                          # (the DSpark block's recording reads it)
        self.last_generate: dict[str, float] = {}
        self.startup = {"weights_upload_s": time.perf_counter() - t1, "model_open_s": time.perf_counter() - t0,
                        "weights_gb": (self.w.file_bytes + self.w.extra_bytes) / 1e9}

    # ---- options: frozen; replaced, never edited (graphs are keyed by the ones they baked in) ----------------
    @property
    def pdl(self) -> bool:
        return self.options.pdl

    @property
    def graphs(self) -> bool:
        return self.options.graphs

    @property
    def min_bucket(self) -> int:
        return self.options.min_bucket

    def set_launch_mode(self, pdl: bool, graphs: bool) -> None:
        """Programmatic dependent launches on / off, graph replay or direct launches (the bench compares them
        on one set of weights): every step is captured again in the new mode."""
        self.options = self.options.but(pdl=bool(pdl), graphs=bool(graphs))

    # ---- the contract (new_state / _export / _import: CudaStates) ----------------------------------------------
    def check_state(self, state: Any, what: str = "state") -> None:
        super().check_state(state, what)
        if state.busy:
            raise Ds4Error(f"{what} is being generated into (a generate() iterator is running on it)")
        if state.store is not self.store:
            raise Ds4Error(f"{what} belongs to another CUDA model")

    def plan(self, chunks: Sequence[Sequence[int]]) -> list[RowSetPlan]:
        """The row sets a step of these chunks runs as, in order (ds4py/cuda/planner.py)."""
        return planner.plan([len(c) for c in chunks], self.options, self.rollback_horizon)

    def _step(self, states: list[CudaState], chunks: list[np.ndarray], all_logits: bool) -> list[np.ndarray]:
        return self._run(states, chunks, all_logits, Outputs.NONE)[0]

    def _step_hidden(self, states: list[CudaState], chunks: list[np.ndarray],
                     all_logits: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """step, and each row's final residual X [hc, D] (the head's input h_j, the MTP block's input)."""
        return self._run(states, chunks, all_logits, Outputs.HIDDEN)

    def _step_taps(self, states: list[CudaState], chunks: list[np.ndarray],
                   all_logits: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """step, and each row's DSpark taps [n_targets * D] (V4.1's draft input): the tap kernel recorded after
        each target layer's Engram (layer.record_tap); its row sets are graphs of their own."""
        return self._run(states, chunks, all_logits, Outputs.TAPS)

    def _run(self, states: list[CudaState], chunks: list[np.ndarray], all_logits: bool,
             out: Outputs) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """The planned row sets of a step, in order: (logits per chunk, per chunk its rows' `out` or None)."""
        self.store.reclaim()
        logits: list[Any] = [None] * len(states)
        rows: list[Any] = [None] * len(states)
        for mode, idx in self.plan(chunks):
            if mode == ROWS:
                sts, chs = [states[i] for i in idx], [chunks[i] for i in idx]
                # (a plain or hidden step calls _step_rows with three arguments: tests spy on it)
                lg = self._step_rows(sts, chs, all_logits, *([True] if out & Outputs.TAPS else []))
                hs = self.runner.rows_extra(chs, out) if out else [None] * len(idx)
            else:
                i = idx[0]
                run = self.runner.prefill if mode == BLOCK else self.runner.positions
                got = run(states[i], np.asarray(chunks[i]), all_logits, out)
                lg, hs = ([got[0]], [got[1]]) if out else ([got], [None])
            for j, i in enumerate(idx):
                logits[i], rows[i] = lg[j], hs[j]
        return logits, rows

    def _step_rows(self, states: list[CudaState], chunks: list[np.ndarray], all_logits: bool,
                   taps: bool = False) -> list[np.ndarray]:
        return self.runner.step_rows(states, chunks, all_logits, taps)

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads (the bench's roofline; ds4py/cuda/weight_bytes.py)."""
        return weight_bytes.per_token(self.config, self.w.binding)

    def weight_bytes(self) -> WeightBytes:
        return weight_bytes.weight_bytes(self.config, self.w.binding)

    def open_mtp(self, path: str | None = None):
        from ds4py.cuda.mtp import CudaMtp

        return CudaMtp(self, path)

    def _open_dspark(self):
        from ds4py.cuda.dspark import CudaDSpark

        return CudaDSpark(self)

    def copy_bandwidth_gbps(self) -> float:
        """Device-to-device copy bandwidth (on the emulator: the host's, which is what it reads)."""
        if self.emulated:
            return super().copy_bandwidth_gbps()
        from ds4py.cuda.probe import device_copy_bandwidth_gbps

        return device_copy_bandwidth_gbps(self.rt)

    def launches_per_step(self, state: CudaState | None = None) -> dict[str, int]:
        """Kernels of one decode step at the state's bucket (a fresh state: the first one): the body, the head
        with the sampler, and how many of them run on the side stream."""
        st = state if state is not None else self.new_state()
        body, side = self.runner.body(st, st.n_tokens).count()
        head, head_side = self.runner.head((0.0, 0, 1.0, 0.0, 0)).count()
        return {"body": body, "head": head, "total": body + head, "side_stream": side + head_side}

    def launches_per_rows_step(self, n_rows: int) -> dict[str, int]:
        """Kernels of one multi-row step of n_rows fresh sequences (one row each)."""
        sts = [self.new_state() for _ in range(n_rows)]
        n, side = self.runner.rows_run([(st, 0, 0) for st in sts])[0].count()
        return {"rows": n_rows, "total": n, "side_stream": side}

    # ---- device-side generation (ds4py.contract.DeviceGeneration; ds4py/cuda/generation.py) -------------------
    def generate(self, state: CudaState, token: int, params: SamplingParams, max_tokens: int) -> Iterator[int]:
        """Feed `token` at the state's next position, then yield up to max_tokens sampled tokens, each drawn on
        the device and fed by the next step without the host (docs/engine.md "Device-side generation"). When the
        iterator ends or is closed after yielding k tokens, the state has consumed `token` and the first k - 1 of
        them (the last sampled token is not fed). Checks run now; the work starts on the first next()."""
        generation.check(self, state, token, params, max_tokens)
        return generation.generate(self, state, int(token), params, int(max_tokens))

    def close(self) -> None:
        """Release the device (the model is unusable afterwards)."""
        self.runner.close()
        self.store.retire([self._misc])
        self.store.reclaim()
        if self.engram is not None:                 # its worker thread and pinned staging
            self.engram.close(self.rt.memory)
        self.rt.synchronize()
        self.w.arena.close()

