"""What CudaModel's constructors check and prepare before the weights go to the device: the runtime, the numerics
and the config it can run, the options, a sidecar stack folded at load, V4.1's Engram feed and the memory plan
(each refusal one sentence, before any upload)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ds4py.config import ModelConfig
from ds4py.contract import DEVICE_NUMERICS, Numerics
from ds4py.cuda import layer
from ds4py.cuda.compiler import model_defines
from ds4py.cuda.engram_feed import EngramFeed
from ds4py.cuda.layer import BLOCK, DECODE, MAX_ROWS, ROWS
from ds4py.cuda.memory_plan import MemoryPlan, kv_bytes
from ds4py.cuda.options import EngineOptions, bucket_for
from ds4py.errors import Ds4Error
from ds4py.vq.sidecar import Stack


def runtime(given: Any, emulate: bool, cfg: ModelConfig, progress: bool) -> Any:
    """`given`, or a new Runtime (the first GPU) / EmuRuntime (emulate), built with the model's defines."""
    want = model_defines(cfg)
    if given is None and emulate:
        from ds4py.cuda.emu_runtime import EmuRuntime

        given = EmuRuntime(defines=want)
    elif given is None:
        from ds4py.cuda.runtime import Runtime

        say = (lambda m: print(f"ds4py: {m}", file=sys.stderr, flush=True)) if progress else None
        given = Runtime(defines=want, progress=say)
    have = getattr(given, "defines", None)
    if have is not None and any(have.get(k, v) != v for k, v in want.items()):
        raise Ds4Error(f"the runtime was built with defines {have}, this model needs {want}")
    return given


def numerics(given: Numerics | str | None) -> Numerics | str:
    """The constructor's numerics, checked before the runtime starts: a Numerics (default: Numerics(), fp32), or
    DEVICE_NUMERICS, which device_numerics resolves once the device is open."""
    given = Numerics() if given is None else given
    if isinstance(given, str) and given == DEVICE_NUMERICS:
        return given
    if not isinstance(given, Numerics):
        raise Ds4Error(f"numerics must be a ds4py.model.Numerics or {DEVICE_NUMERICS!r} (the device's default), "
                       f"got {given!r}")
    return given


def device_numerics(given: Numerics | str, rt: Any) -> tuple[Numerics, str]:
    """(numerics, why): `given` as it is (why ""), or for DEVICE_NUMERICS the opened device's declared default
    (ds4py.cuda.devices.default_numerics of the runtime's profile: the GPU's when it is a profiled part, the
    emulator's when it was made as one, $DS4PY_EMU_DEVICE) and why, in one clause."""
    if isinstance(given, Numerics):
        return given, ""
    from ds4py.cuda.devices import default_numerics
    from ds4py.cuda.emu_runtime import EmuRuntime

    if isinstance(rt, EmuRuntime):
        d = default_numerics(rt.profile if rt.device.named else None, emulated=True)
    else:
        d = default_numerics(rt.profile)         # Runtime: profile_for_device, declared only for a profiled part
    return (Numerics.ds4() if d.act_quant else Numerics()), d.why


def options(given: EngineOptions | None, pdl: bool | None, graphs: bool | None) -> EngineOptions:
    """The constructor's options: `given` (default: EngineOptions()) with pdl / graphs when passed."""
    given = EngineOptions() if given is None else given
    if not isinstance(given, EngineOptions):
        raise Ds4Error(f"options must be a ds4py.cuda.options.EngineOptions, got {type(given).__name__}")
    changes = {k: bool(v) for k, v in (("pdl", pdl), ("graphs", graphs)) if v is not None}
    return given.but(**changes) if changes else given


def fold_stack(cfg: ModelConfig, gguf: Any, fingerprint: str, sidecar: Any,
               posttrain: Any) -> tuple[Any, dict[str, list[np.ndarray]], dict[str, np.ndarray], str]:
    """A domain sidecar / post-training stack (docs/vq.md), folded at load as the reference folds it: its gain
    scales into the VQ row gains of the device copy, its router biases in place of the file's; a stale or
    mismatched pair is refused in one sentence (Stack.open). (stack or None, row scales per tensor, biases, the
    model's fingerprint: the stack's when there is one.)"""
    stack = Stack.open(cfg, gguf, fingerprint, sidecar, posttrain)
    row_scales: dict[str, list[np.ndarray]] = {}
    biases: dict[str, np.ndarray] = {}
    if stack is not None:
        for name, sc in stack.row_scales():
            row_scales.setdefault(name, []).append(sc)
        biases = stack.biases()
        fingerprint = stack.fingerprint
    return stack, row_scales, biases, fingerprint


def engram_feed(cfg: ModelConfig, gguf: Any, path: str, engram_dir: str | None) -> EngramFeed | None:
    """V4.1's Engram: the hasher and the memory-mapped tables (refused in one sentence, as on the reference,
    when the folder or a table is missing or not the converted one)."""
    if not cfg.traits.engram:
        if engram_dir is not None:
            raise Ds4Error(f"{path}: --engram-dir applies to V4.1 models only")
        return None
    if not cfg.engram_layers:
        return None
    from ds4py import engram

    hasher = engram.NgramHasher(cfg, *engram.gguf_vocabulary(gguf), path)
    dir_key, digest_key = engram.meta_keys(cfg.arch)
    folder = engram_dir if engram_dir is not None else gguf.meta(dir_key, None)
    return EngramFeed(cfg, hasher, engram.EngramTables.open(cfg, folder, gguf.meta(digest_key, None), path))


def memory_plan(cfg: ModelConfig, layout: Any, ctx: int, rt: Any, weights: int, progress: bool,
                act_quant: bool = False) -> MemoryPlan:
    """The memory plan, before the upload: one line (progress), and a refusal when it does not fit."""
    bucket = bucket_for(ctx, cfg.context_length)
    scratch = sum(layer.workspace_bytes(layer.workspace_shapes(cfg, bucket, rows, mode, act_quant=act_quant))
                  for rows, mode in
                  ((1, DECODE), (MAX_ROWS, ROWS), (layer.MAX_BLOCK, BLOCK)))
    plan = MemoryPlan(weights, kv_bytes(layout, ctx), ctx, scratch, rt.free_bytes())
    if progress:
        print(f"ds4py: {plan.line()}", file=sys.stderr, flush=True)
    plan.check()
    return plan
