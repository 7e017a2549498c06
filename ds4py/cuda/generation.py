"""Device-side generation (docs/engine.md "Device-side generation"): each sampled token drawn on the device and
fed to the next step without the host, one step run ahead; the host reads 4 bytes per token (TokenReader)."""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

import numpy as np

from ds4py.cuda.kvstate import CudaState
from ds4py.cuda.memory import DeviceArray
from ds4py.errors import ContextLengthError, Ds4Error, UnsupportedByBackend
from ds4py.sampling import InvalidLogits, SamplingParams


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


def sampling_key(params: SamplingParams) -> tuple:
    """The sampler's launch values: greedy, or (temperature, top_k, top_p, min_p, seed); no seed = fresh."""
    if params.greedy:
        return (0.0, 0, 1.0, 0.0, 0)
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    return (float(params.temperature), int(params.top_k), float(params.top_p), float(params.min_p), seed)


def check(model: Any, state: CudaState, token: int, params: SamplingParams, max_tokens: int) -> None:
    """The refusals of generate(), in one sentence each, before any work."""
    model.check_state(state)
    if model.publishers is not None:
        raise UnsupportedByBackend("device-side generation bakes one index-key choice into its graph, and the "
                                   "official decode bug changes it per step: sample with step() on this model")
    if model.engram is not None:
        raise UnsupportedByBackend("device-side generation feeds sampled tokens without the host, and Engram's "
                                   "rows are gathered on the host: sample with step() on this model")
    vocab = model.config.vocab_size
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= int(token) < vocab:
        raise Ds4Error(f"token {token!r} is outside the vocabulary (0..{vocab - 1})")
    if not isinstance(params, SamplingParams):
        raise Ds4Error(f"params must be a ds4py.sampling.SamplingParams, got {type(params).__name__}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
        raise Ds4Error(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if state.n_tokens + int(max_tokens) > model.config.context_length:
        raise ContextLengthError(f"{state.n_tokens} + {int(max_tokens)} tokens exceed the context length "
                                 f"{model.config.context_length}")


def generate(model: Any, st: CudaState, token: int, params: SamplingParams, max_tokens: int) -> Iterator[int]:
    """Feed `token` at the state's next position, then yield up to max_tokens sampled tokens (checked first:
    check()). When the iterator ends or is closed after yielding k tokens, the state has consumed `token` and the
    first k - 1 of them (the last sampled token is not fed). model.last_generate: tokens, host and wall seconds,
    steps launched."""
    model.store.reclaim()
    runner = model.runner
    sampling = sampling_key(params)
    reader = TokenReader(model.rt)
    n0, yielded, launched, host = st.n_tokens, 0, 0, 0.0
    st.busy = True
    t_start = time.perf_counter()

    def launch(k: int) -> int:                      # feed input k (the given token, then sampled ones)
        nonlocal host, launched
        launched += 1
        t0 = time.perf_counter()
        body = runner.body(st, n0 + k)
        head = runner.head(sampling)
        body = runner.body(st, n0 + k)
        st.device_hw = max(st.device_hw, n0 + k + 1)
        body.run([n0 + k, token] if k == 0 else [n0 + k])
        head.run(())
        i = reader.enqueue(model.slot.view(4, 1))
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
        model.last_generate = {"tokens": yielded, "host_s": host, "wall_s": time.perf_counter() - t_start,
                               "steps": launched}
