"""RefModel: the fp32 numpy reference backend (implements ds4py.model.Model)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ds4py.config import ModelConfig
from ds4py.errors import ContextLengthError, Ds4Error
from ds4py.gguf import GGUFFile
from ds4py.ref.forward import Trace, forward
from ds4py.ref.state import RefState
from ds4py.ref.weights import DEFAULT_CACHE_BYTES, Weights


class RefModel:
    """fp32 numpy forward of V4 Flash, straight from MODEL.md.

    fake_quant: apply the model's own FP8 (window / compressed KV) and FP4 (indexer) quant-dequant steps, as
    the official code does in its default ("qat") mode; False gives the official "train"-mode numerics.
    act_quant: additionally round activations the way ds4's CPU path does before quantised matmuls (Q8_0
    blocks for Q8_0 weights, Q8_K for K/IQ quants). Off by default: the reference is the fp32 math; on, it
    is a numpy twin of an int8-activation engine (ds4, or CUDA kernels that quantise activations).
    """

    backend = "ref"
    max_chunk = 1024        # prefill tokens per forward pass (without a trace)

    def __init__(self, path: str, fake_quant: bool = True, act_quant: bool = False,
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.path = str(path)
        self.gguf = GGUFFile(self.path)
        self.config = ModelConfig.from_gguf(self.gguf)
        self.weights = Weights(self.gguf, cache_bytes, act_quant)
        self.fake_quant, self.act_quant = fake_quant, act_quant

    def new_state(self) -> RefState:
        return RefState.empty(self.config)

    def _check_ids(self, state: RefState, ids: Sequence[int]) -> np.ndarray:
        if not isinstance(state, RefState):
            raise Ds4Error(f"state is a {type(state).__name__}, expected a RefState from this model's new_state()")
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0:
            raise Ds4Error("token ids must be a non-empty 1-D sequence")
        if not np.issubdtype(arr.dtype, np.integer):
            raise Ds4Error(f"token ids must be integers, got {arr.dtype}")
        V = self.config.vocab_size
        bad = (arr < 0) | (arr >= V)
        if bad.any():
            raise Ds4Error(f"token id {int(arr[bad][0])} at index {int(np.argmax(bad))} is outside the vocabulary "
                           f"(0..{V - 1})")
        if state.n_tokens + arr.size > self.config.context_length:
            raise ContextLengthError(f"{state.n_tokens} + {arr.size} tokens exceed the context length "
                                     f"{self.config.context_length}")
        return arr.astype(np.int64)

    def prefill(self, state: RefState, ids: Sequence[int], all_logits: bool = False,
                trace: Trace | None = None) -> np.ndarray:
        """Consume ids (continuing `state`); logits of the last position [vocab] or of all [len(ids), vocab]."""
        arr = self._check_ids(state, ids)
        if trace is not None or len(arr) <= self.max_chunk:
            return forward(self.weights, self.config, state, arr, all_logits, self.fake_quant, trace)
        # long prompts run as consecutive chunks (same math: chunked prefill == one prefill), which bounds
        # the activations ([chunk, H, head_dim] queries) on the full-size model
        out = [forward(self.weights, self.config, state, arr[a:a + self.max_chunk], all_logits, self.fake_quant)
               for a in range(0, len(arr), self.max_chunk)]
        return np.concatenate(out) if all_logits else out[-1]

    def decode(self, state: RefState, token: int, trace: Trace | None = None) -> np.ndarray:
        return self.prefill(state, [int(token)], trace=trace)

    def new_trace(self) -> Trace:
        return Trace(self.config.n_layers)

    def weight_bytes_per_token(self) -> int:
        """GGUF bytes one decode step reads: every tensor except the embedding (one row) and the routed
        experts (n_experts_used of n_experts per layer)."""
        cfg, total = self.config, 0
        for name, t in self.gguf.tensors.items():
            if name == "token_embd.weight":
                total += t.nbytes // t.shape[0]
            elif "_exps." in name:
                total += t.nbytes * cfg.n_experts_used // cfg.n_experts
            else:
                total += t.nbytes
        return total
