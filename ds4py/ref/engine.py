"""RefModel: the fp32 numpy reference backend (implements ds4py.model.Model)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ds4py import schema
from ds4py.config import ModelConfig
from ds4py.errors import Ds4Error
from ds4py.fingerprint import file_fingerprint
from ds4py.gguf import GGUFFile
from ds4py.kv import state_layout
from ds4py.model import DEFAULT_ROLLBACK_HORIZON, ModelBase, Numerics
from ds4py.quant import vq
from ds4py.ref.forward import Trace, V41Step, forward
from ds4py.ref.state import RefState
from ds4py.ref.weights import DEFAULT_CACHE_BYTES, Weights
from ds4py.vq.sidecar import mount


class RefModel(ModelBase):
    """fp32 numpy forward of V4 Flash, straight from MODEL.md; `numerics` says how it rounds (ds4py.model)."""

    backend = "ref"
    state_type = RefState
    max_chunk = 1024        # rows per forward pass, all sequences of a step together (without a trace)

    def __init__(self, path: str, numerics: Numerics | None = None,
                 rollback_horizon: int = DEFAULT_ROLLBACK_HORIZON, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 sidecar=None, posttrain=None, engram_dir: str | None = None,
                 official_decode_bug: bool = False):
        """engram_dir: V4.1 only, the folder with the official shards that hold the Engram tables (default: the
        one the converter recorded). official_decode_bug: V4.1 only, reproduce the official code's decode-time
        index-key bug instead of the fixed behaviour (for comparison; docs/v41.md)."""
        numerics = Numerics() if numerics is None else numerics
        if not isinstance(numerics, Numerics):
            raise Ds4Error(f"numerics must be a ds4py.model.Numerics, got {type(numerics).__name__}")
        self.path = str(path)
        self.gguf = GGUFFile(self.path)
        self.config = ModelConfig.from_gguf(self.gguf)
        self.numerics = numerics
        self.weights = Weights(self.gguf, cache_bytes, numerics.act_quant)
        self.layout = state_layout(self.config, rollback_horizon)
        self.rollback_horizon = rollback_horizon
        header = min(t.offset for t in self.gguf.tensors.values())       # the whole GGUF header
        self.fingerprint = self.base_fingerprint = file_fingerprint(self.path, head_bytes=header)
        # a domain sidecar / post-training file (docs/vq.md): gains folded into the VQ row gains, router biases
        # bound in place of the file's; the model's fingerprint becomes the stack's
        self.stack = mount(self, sidecar, posttrain)
        self.binding = schema.bind(self.config, self.stack.resolver(self.gguf.tensor) if self.stack
                                   else self.gguf.tensor)
        if self.stack:
            self.fingerprint = self.stack.fingerprint
        self.v41 = self._v41_step(engram_dir, official_decode_bug)

    def _v41_step(self, engram_dir: str | None, official_decode_bug: bool) -> V41Step | None:
        """The Engram hasher and tables and the decode-bug switch of a V4.1 model (None for V4)."""
        cfg = self.config
        if not cfg.is_v41:
            if engram_dir is not None or official_decode_bug:
                raise Ds4Error(f"{self.path}: --engram-dir and the official decode bug apply to V4.1 models only")
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

    def new_state(self) -> RefState:
        return RefState(self.layout)

    def _step(self, states: list[RefState], chunks: list[np.ndarray], all_logits: bool) -> list[np.ndarray]:
        # at most max_chunk rows per forward pass (bounds the activations, e.g. [rows, H, head_dim] queries, on
        # the full-size model): a long chunk continues in the next pass, which is the same math
        out: list[list[np.ndarray]] = [[] for _ in states]
        done = [0] * len(states)
        while any(d < len(c) for d, c in zip(done, chunks)):
            budget, picked, parts = self.max_chunk, [], []
            for i, c in enumerate(chunks):
                take = min(len(c) - done[i], budget)
                if take > 0:
                    picked.append(i)
                    parts.append(c[done[i]:done[i] + take])
                    done[i] += take
                    budget -= take
                if budget == 0:
                    break
            res = forward(self.weights, self.binding, self.config, self.numerics, [states[i] for i in picked],
                          parts, all_logits, extra=self.v41)
            for i, r in zip(picked, res):
                out[i].append(r)
        return [np.concatenate(o) if all_logits else o[-1] for o in out]

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
        return forward(self.weights, self.binding, self.config, self.numerics, [state], arr, all_logits, trace,
                       self.v41)[0]

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
            if name == embed:
                total += t.nbytes // t.shape[0]
            elif name in per_expert:
                total += t.nbytes * cfg.n_experts_used // cfg.n_experts
            else:
                total += t.nbytes
        return total
