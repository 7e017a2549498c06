"""RefModel: the fp32 numpy reference backend (implements ds4py.model.Model)."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from ds4py import schema
from ds4py.config import ModelConfig
from ds4py.errors import Ds4Error
from ds4py.fingerprint import file_fingerprint
from ds4py.gguf import GGUFFile
from ds4py.kv import state_layout
from ds4py.contract import DEFAULT_ROLLBACK_HORIZON, Capabilities, ModelBase, Numerics, WeightBytes
from ds4py.quant import vq
from ds4py.ref import heap, prefault
from ds4py.ref.forward import Net, Trace, V41Step, Wanted, forward
from ds4py.ref.state import RefState
from ds4py.ref.weights import DEFAULT_CACHE_BYTES, KERNEL_LABELS, LEAN_CACHE_BYTES, LEAN_STREAM_BYTES, Weights
from ds4py.vq.sidecar import Stack


def memory_plan(cache_bytes: int | None, mem_budget_mb: float | None,
                lean: bool = False) -> tuple[int, int | None]:
    """(dequant cache bytes, streamed-chunk bytes) for an explicit cache size or a memory budget: the budget
    bounds what ds4py keeps beside the mapped file: an eighth for one streamed chunk of a matrix (at most
    64 MiB), the rest for the dequantised-tensor cache. Neither given: the 512 MiB cache, or with the decode
    kernels (lean: decode never dequantises; only prefill does, one matrix at a time) LEAN_CACHE_BYTES and
    chunks of LEAN_STREAM_BYTES, so the private memory stays small at any layer count (bench/cpu_memory.py)."""
    if mem_budget_mb is None:
        if cache_bytes is None and lean:
            return LEAN_CACHE_BYTES, LEAN_STREAM_BYTES
        return (DEFAULT_CACHE_BYTES if cache_bytes is None else cache_bytes), None
    if not mem_budget_mb > 0:
        raise Ds4Error(f"--mem-budget-mb must be positive, got {mem_budget_mb}")
    budget = int(mem_budget_mb * 2**20)
    stream = min(64 << 20, budget // 8)
    return (budget - stream if cache_bytes is None else min(cache_bytes, budget - stream)), stream


HEAP_REUSE_ROWS = 64       # steps with a longer chunk (a prefill) run inside heap.reuse()


class RefModel(ModelBase):
    """fp32 numpy forward of V4 Flash, straight from MODEL.md; `numerics` says how it rounds (ds4py.model)."""

    backend = "ref"
    state_type = RefState
    capabilities = Capabilities(speculation=True)
    max_chunk = 1024        # rows per forward pass, all sequences of a step together (without a trace)

    def __init__(self, path: str, numerics: Numerics | None = None,
                 rollback_horizon: int = DEFAULT_ROLLBACK_HORIZON, cache_bytes: int | None = None,
                 sidecar=None, posttrain=None, engram_dir: str | None = None,
                 official_decode_bug: bool = False, kernels: str | None = None, threads: int | None = None,
                 mem_budget_mb: float | None = None, madvise: bool | None = None):
        """engram_dir: V4.1 only, the folder with the official shards that hold the Engram tables (default: the
        one the converter recorded). official_decode_bug: V4.1 only, reproduce the official code's decode-time
        index-key bug instead of the fixed behaviour (for comparison; docs/v41.md). kernels: "auto" (the
        default, else $DS4PY_KERNELS: "jit" where numba imports, else "fused"), "jit" (compiled), "fused" (numpy)
        or "dequant" (the oracle); `kernels` then holds the set in use. threads: the decode kernels' workers,
        mem_budget_mb: bounds the dequant cache and streamed chunks (memory_plan); madvise: paging hints on the
        mapped file (random for the routed experts, will-need one layer ahead and for the routed experts;
        default: $DS4PY_MADVISE=1 / 0 if set, else on exactly when a memory budget is given)."""
        numerics = Numerics() if numerics is None else numerics
        if not isinstance(numerics, Numerics):
            raise Ds4Error(f"numerics must be a ds4py.model.Numerics, got {type(numerics).__name__}")
        self.path = str(path)
        self.gguf = GGUFFile(self.path)
        self.config = ModelConfig.from_gguf(self.gguf)
        self.numerics = numerics
        kernels = os.environ.get("DS4PY_KERNELS", "auto") if kernels is None else kernels
        lean = kernels != "dequant" and cache_bytes is None and mem_budget_mb is None
        cache_bytes, stream_bytes = memory_plan(cache_bytes, mem_budget_mb, lean)
        self.mem_budget_mb = mem_budget_mb
        if madvise is None:
            env = os.environ.get("DS4PY_MADVISE")
            madvise = env == "1" if env in ("0", "1") else mem_budget_mb is not None
        self.weights = Weights(self.gguf, cache_bytes, numerics.act_quant, kernels, threads, stream_bytes,
                               advise=bool(madvise), lean=lean)
        # no memory budget: the file is mapped into the page tables in the background (ds4py.ref.prefault), the
        # dense tensors first, as llama.cpp's MAP_POPULATE does at load, so decode steps take no page faults
        self.populating = None if mem_budget_mb is not None or madvise else prefault.start(
            self.gguf, [(t.offset, t.nbytes) for n, t in self.gguf.tensors.items() if "_exps" not in n])
        self.layout = state_layout(self.config, rollback_horizon)
        self.rollback_horizon = rollback_horizon
        header = min(t.offset for t in self.gguf.tensors.values())       # the whole GGUF header
        self.fingerprint = self.base_fingerprint = file_fingerprint(self.path, head_bytes=header)
        # a domain sidecar / post-training file (docs/vq.md): gains folded into the VQ row gains, router biases
        # bound in place of the file's; the model's fingerprint becomes the stack's
        self.stack = Stack.open(self.config, self.gguf, self.fingerprint, sidecar, posttrain)
        if self.stack is not None:             # decoded experts are not cached yet: fold the gains in now
            for name, scale in self.stack.row_scales():
                self.weights.vq.scale_rows(name, scale)
        self.binding = schema.bind(self.config, self.stack.resolver(self.gguf.tensor) if self.stack
                                   else self.gguf.tensor)
        if self.stack:
            self.fingerprint = self.stack.fingerprint
        self.v41 = self._v41_step(engram_dir, official_decode_bug)

    def _v41_step(self, engram_dir: str | None, official_decode_bug: bool) -> V41Step | None:
        """The Engram hasher and tables and the decode-bug switch of a V4.1 model (None for V4)."""
        cfg = self.config
        t = cfg.traits
        if (engram_dir is not None and not t.engram) or (official_decode_bug and not t.latent_index_keys):
            raise Ds4Error(f"{self.path}: --engram-dir and the official decode bug apply to V4.1 models only")
        if not (t.engram or t.latent_index_keys):
            return None
        from ds4py import engram
        from ds4py.ref import v41

        step = V41Step(publishers=v41.KeyPublishers() if official_decode_bug else None)
        if cfg.engram_layers:
            step.ngram = v41.NgramIds(cfg, engram.NgramHasher(cfg, *engram.gguf_vocabulary(self.gguf), self.path))
            dir_key, digest_key = engram.meta_keys(cfg.arch)
            folder = engram_dir if engram_dir is not None else self.gguf.meta(dir_key, None)
            step.tables = engram.EngramTables.open(cfg, folder, self.gguf.meta(digest_key, None), self.path)
        return step

    @property
    def kernels(self) -> str:
        """The kernel set in use ("auto" resolved; "fused" if numba, found at open, then failed to import)."""
        return self.weights.kernels

    @property
    def kernels_label(self) -> str:
        label = KERNEL_LABELS[self.kernels]
        runner = self.weights.runner
        return label if runner is None else f"{label}, {runner.threads} thread{'s' if runner.threads > 1 else ''}"

    def new_state(self) -> RefState:
        return RefState(self.layout)

    def open_mtp(self, path: str | None = None):
        from ds4py.ref.mtp import RefMtp

        return RefMtp(self, path)

    @property
    def stable_rows(self) -> int:
        """Steps whose chunks all have at most this many rows (decode, batched decode, a speculative verify of
        up to rollback_horizon + 1 rows) run row-stable: each row bit-identical to it stepped alone."""
        return self.rollback_horizon + 1

    def _step(self, states: list[RefState], chunks: list[np.ndarray], all_logits: bool) -> list[np.ndarray]:
        return self._run(states, chunks, all_logits, None)

    def _step_hidden(self, states: list[RefState], chunks: list[np.ndarray],
                     all_logits: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        hidden: list[list[np.ndarray]] = [[] for _ in states]
        logits = self._run(states, chunks, all_logits, hidden)
        return logits, [np.concatenate(h) for h in hidden]

    def _step_taps(self, states: list[RefState], chunks: list[np.ndarray],
                   all_logits: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
        taps: list[list[np.ndarray]] = [[] for _ in states]
        logits = self._run(states, chunks, all_logits, None, taps)
        return logits, [np.concatenate(t) for t in taps]

    def _run(self, states: list[RefState], chunks: list[np.ndarray], all_logits: bool,
             hidden: list[list[np.ndarray]] | None, taps: list[list[np.ndarray]] | None = None) -> list[np.ndarray]:
        # a long prefill keeps its freed temporaries in the heap (ds4py.ref.heap: no page faults on every new
        # array); not under a memory budget, where every private byte is page cache the weights lose
        with heap.reuse(self.mem_budget_mb is None and max(map(len, chunks)) > HEAP_REUSE_ROWS):
            return self._passes(states, chunks, all_logits, hidden, taps)

    def _passes(self, states: list[RefState], chunks: list[np.ndarray], all_logits: bool,
                hidden: list[list[np.ndarray]] | None, taps: list[list[np.ndarray]] | None) -> list[np.ndarray]:
        # at most max_chunk rows per forward pass (bounds the activations, e.g. [rows, H, head_dim] queries, on
        # the full-size model): a long chunk continues in the next pass, which is the same math. A chunk is cut
        # into pieces of max_chunk from its own start, whatever else the step holds, and a pass takes whole
        # pieces: a sequence's passes (and so its arithmetic) never depend on the other sequences
        out: list[list[np.ndarray]] = [[] for _ in states]
        done = [0] * len(states)
        while any(d < len(c) for d, c in zip(done, chunks)):
            budget, picked, parts = self.max_chunk, [], []
            for i, c in enumerate(chunks):
                take = min(len(c) - done[i], self.max_chunk)
                if take > 0 and (take <= budget or not picked):
                    picked.append(i)
                    parts.append(c[done[i]:done[i] + take])
                    done[i] += take
                    budget -= take
            hid = None if hidden is None else []
            tap = None if taps is None else []
            res = forward(self._net(), [states[i] for i in picked], parts,
                          Wanted(all_logits, hidden=hid, taps=tap), row_stable=max(map(len, parts)) <= self.stable_rows)
            for j, (i, r) in enumerate(zip(picked, res)):
                out[i].append(r)
                if hid is not None:
                    hidden[i].append(hid[j])
                if tap is not None:
                    taps[i].append(tap[j])
        return [np.concatenate(o) if all_logits else o[-1] for o in out]

    def _net(self) -> Net:
        return Net(self.weights, self.binding, self.config, self.numerics, self.v41)

    def _open_dspark(self):
        from ds4py.ref.dspark import RefDSpark

        return RefDSpark(self)

    def _export(self, state: RefState) -> dict[str, np.ndarray]:
        return state.export()

    def _import(self, n_tokens: int, n_written: int, arrays: dict[str, np.ndarray]) -> RefState:
        return RefState.from_parts(self.layout, n_tokens, n_written, arrays)

    # ---- reference-only: a one-sequence step recording its intermediates ----------------------------------------
    def prefill(self, state: RefState, ids: Sequence[int], all_logits: bool = False,
                trace: Trace | None = None) -> np.ndarray:
        """Consume ids (continuing `state`); logits of the last position [vocab] or of all [len(ids), vocab].
        With a trace (model.new_trace()) the whole chunk runs as one pass and records per-layer intermediates."""
        if trace is None:
            return super().prefill(state, ids, all_logits)
        arr = self.check_step([state], [ids])
        return forward(self._net(), [state], arr, Wanted(all_logits, trace=trace),
                       row_stable=len(ids) <= self.stable_rows)[0]

    def decode(self, state: RefState, token: int, trace: Trace | None = None) -> np.ndarray:
        return self.prefill(state, [token], trace=trace)

    def new_trace(self) -> Trace:
        return Trace(self.config.n_layers)

    def weight_bytes_per_token(self) -> int:
        """GGUF bytes one decode step reads: every tensor of the file except the embedding (one row) and the
        routed experts (n_experts_used of n_experts per layer, with their VQ-8 companions: row gains, hi plane)."""
        cfg, entries = self.config, list(schema.entries(self.config))
        embed = next(e.name for e in entries if e.spec.field == "embed")
        experts = {e.name for e in entries if e.spec.field.startswith("ffn.experts.")}
        per_expert = experts | {vq.gain_name(n) for n in experts} | {vq.hi_name(n) for n in experts}
        total = 0
        for name, t in self.gguf.tensors.items():
            if name.startswith((schema.MTP_PREFIX, schema.DSPARK_PREFIX)):   # a draft in the same file: not read
                continue
            if name == embed:
                total += t.nbytes // t.shape[0]
            elif name in per_expert:
                total += t.nbytes * cfg.n_experts_used // cfg.n_experts
            else:
                total += t.nbytes
        return total

    def weight_bytes(self) -> WeightBytes:
        """decode = weight_bytes_per_token(); routed: the routed experts' GGUF bytes (n_experts_used of
        n_experts); head: the output head's."""
        cfg, routed = self.config, 0
        for e in schema.entries(cfg):
            if e.spec.field.startswith("ffn.experts."):
                routed += self.gguf.tensor(e.name).nbytes * cfg.n_experts_used // cfg.n_experts
        return WeightBytes(self.weight_bytes_per_token(), routed, int(self.binding.head.nbytes))
