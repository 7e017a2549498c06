"""A GGUF's weights on the device for the CUDA engine: the tensor data uploaded once, in the file's own formats
(Q8_0 / F16 / F32 / Q4_K GEMV matrices, IQ2_XXS / Q2_K / Q4_K / MXFP4 / Q8_0 / F16 experts: no dequantised copy; VQ-8
experts re-laid once, ds4py/cuda/vq_layout.py, their file bytes not uploaded), and
the typed per-layer binding (ds4py.schema.bind) resolved to device tensors.

Only small vectors the kernels read as float32 (norms, hc scale / base, sinks, the router bias; BF16 hc `fn`
and `ape`) and a tid2eid table that is not int32 are converted on the host and uploaded beside the file's bytes.
A tensor type no kernel reads is refused at load, with one sentence naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as QT

from ds4py import schema
from ds4py.cuda import vq_layout
from ds4py.cuda.memory import ALIGN, Arena, DeviceArray, align_up
from ds4py.cuda.ops.experts import FORMATS as EXPERT_FORMATS
from ds4py.cuda.gguf_upload import upload_gguf, weights_bytes
from ds4py.errors import Ds4Error, UnsupportedByBackend
from ds4py.host.rope import layer_rope_freqs
from ds4py.quant import vq

GEMV_TYPES = (QT.Q8_0, QT.F16, QT.F32, QT.Q4_K)  # cu/gemv.cu, cu/gemm.cu
EMBED_TYPES = (QT.F16, QT.F32)                  # cu/embed.cu
HALF_OR_F32 = (QT.F16, QT.F32)                  # hc fn (cu/mhc.cu), compressor ape (cu/compressor.cu)


@dataclass(frozen=True)
class DevTensor:
    """One weight on the device: typed for F32 / F16 / I32 (numpy shape), raw GGUF bytes (uint8) otherwise."""
    name: str
    qtype: QT
    shape: tuple[int, ...]
    array: DeviceArray
    fmt: str | None = None                  # VQ-8 experts: the kernel format of the device copy ("vq12", "vq13")

    @property
    def kernel_format(self) -> Any:
        """What the expert kernels are picked by: the VQ-8 format, else the GGML type."""
        return self.fmt if self.fmt is not None else self.qtype


def check_gate_up(where: str, ffn: Any) -> None:
    """Refuse, in one sentence, a routed or shared expert set whose gate and up differ in kernel format: the CUDA
    kernels read both in one format. `where` names the layer ("layer 3", "the MTP block", "DSpark stage 0")."""
    for what, sw in (("routed", ffn.experts), ("shared", ffn.shared)):
        if sw.gate.kernel_format != sw.up.kernel_format:
            raise UnsupportedByBackend(f"{where}: the {what} experts' gate ({sw.gate.qtype.name}) and up "
                                       f"({sw.up.qtype.name}) differ in type; the CUDA kernel reads both in one format")


def role(field: str) -> str:
    """How the engine reads a binding field: gemv | vec | hcfn | ape | embed | experts | shared | ids."""
    leaf = field.rsplit(".", 1)[-1]
    if field == "embed":
        return "embed"
    if field.startswith("ffn.experts."):
        return "experts"
    if field.startswith("ffn.shared."):
        return "shared"
    if field == "ffn.tid2eid":
        return "ids"
    if field.startswith("hc_") and leaf == "fn":
        return "hcfn"
    if leaf == "ape":
        return "ape"
    if field.endswith("norm") or leaf in ("scale", "base", "sinks", "route_bias"):
        return "vec"
    return "gemv"


def _refuse(name: str, qtype: QT, what: str, allowed) -> Ds4Error:
    names = ", ".join(t.name for t in allowed)
    return UnsupportedByBackend(f"{name} is {qtype.name}, which the CUDA backend cannot read as {what} (it reads {names}); "
                    f"use --backend ref")


def conversion(gguf, e: schema.Entry) -> np.ndarray | None:
    """The host array to upload instead of the file's bytes (None: the bytes are used as they are); refuses a
    type no kernel reads."""
    t = gguf.tensor(e.name)
    qt, kind = QT(int(t.qtype)), role(e.spec.field)
    if kind == "vec":
        return None if qt == QT.F32 else np.asarray(_float(gguf, t), np.float32).reshape(t.shape)
    if kind in ("hcfn", "ape"):
        if qt in HALF_OR_F32:
            return None
        if qt == QT.BF16:
            return np.asarray(_float(gguf, t), np.float32).reshape(t.shape)
        raise _refuse(e.name, qt, "an hc or ape table", HALF_OR_F32)
    if kind == "ids":
        return None if qt == QT.I32 else np.asarray(t.raw).reshape(t.shape).astype(np.int32)
    if kind == "embed" and qt not in EMBED_TYPES:
        raise _refuse(e.name, qt, "an embedding", EMBED_TYPES)
    if kind == "gemv" and qt not in GEMV_TYPES:
        raise _refuse(e.name, qt, "a GEMV matrix", GEMV_TYPES)
    if kind == "experts":
        if qt == QT.I8 and vq.is_vq(gguf, e.name):
            return None                         # repacked at upload (vq_layout), see load()
        if qt not in EXPERT_FORMATS:
            raise _refuse(e.name, qt, "routed experts", tuple(EXPERT_FORMATS))
    if kind == "shared" and qt not in GEMV_TYPES and qt not in EXPERT_FORMATS:
        raise _refuse(e.name, qt, "the shared expert", tuple(dict.fromkeys(GEMV_TYPES + tuple(EXPERT_FORMATS))))
    return None


def _float(gguf, t) -> np.ndarray:
    from ds4py.quant import dequantize

    if QT(int(t.qtype)) in (QT.F32, QT.F16):
        return np.asarray(t.raw, np.float32)
    return dequantize(t.raw_bytes().reshape(-1), t.qtype, t.shape)


def rope_tables(cfg) -> dict[int, np.ndarray]:
    """Per layer its RoPE frequencies (float32 [rope_dim / 2]): ratio-0 layers share one table, compressed ones
    another (ds4py.host.rope.layer_rope_freqs)."""
    return {il: np.ascontiguousarray(layer_rope_freqs(cfg, il), np.float32) for il in range(cfg.n_layers)}


@dataclass
class DeviceWeights:
    arena: Arena
    binding: schema.ModelWeights            # of DevTensor
    freqs: list[DeviceArray]                # per layer
    file_bytes: int                         # the GGUF's tensor data uploaded as it is (arena bytes of its runs)
    extra_bytes: int                        # converted small tensors, RoPE tables, VQ-8 device copies


def load(rt: Any, gguf, cfg, scratch_bytes: int, progress: bool = False,
         row_scales: dict[str, list[np.ndarray]] | None = None,
         replace: dict[str, np.ndarray] | None = None, plan: Any = None) -> DeviceWeights:
    """Upload every tensor the schema names, check every type, bind the schema to the device tensors. VQ-8
    experts get a repacked device copy (ds4py/cuda/vq_layout.py) with their row gains times row_scales[name]
    (a sidecar stack's, in order); replace: float32 vectors uploaded instead of the file's (a stack's effective
    router biases); plan(weight bytes): called before the arena is allocated (the engine's memory plan)."""
    entries = list(schema.entries(cfg))
    converted = {e.name: a for e in entries if (a := conversion(gguf, e)) is not None}
    for name, a in (replace or {}).items():
        converted[name] = np.ascontiguousarray(a, np.float32)
    vq_plans = {e.name: vq_layout.plan(gguf, e.name) for e in entries
                if role(e.spec.field) == "experts" and vq.is_vq(gguf, e.name)}
    tables = rope_tables(cfg)
    distinct: dict[bytes, np.ndarray] = {}
    for a in tables.values():
        distinct.setdefault(a.tobytes(), a)
    extra = sum(align_up(a.nbytes) for a in list(converted.values()) + list(distinct.values())) + ALIGN
    extra += sum(align_up(n) for _, n in vq_plans.values())
    # the file's bytes go up only for the tensors read as they are: not the VQ-8 experts' streams, hi planes,
    # gains and codebooks (their re-laid copy holds them), the converted vectors, nor tensors the schema does not
    # bind (an MTP block in the same file is uploaded by CudaMtp)
    keep = {e.name for e in entries if e.name not in converted and e.name not in vq_plans}
    file_bytes = weights_bytes(gguf, keep)
    if plan is not None:
        plan(file_bytes + extra)                # the memory plan: may refuse before anything is allocated
    arena = rt.arena(weights_bytes=file_bytes + extra, scratch_bytes=scratch_bytes)
    uploader = rt.uploader()
    try:
        on_device = upload_gguf(gguf, arena, uploader, progress=progress, keep=keep)
    finally:
        uploader.close()

    def put(a: np.ndarray) -> DeviceArray:
        d = arena.weights(a.shape, a.dtype)
        d.upload(np.ascontiguousarray(a))
        return d

    tensors: dict[str, DevTensor] = {}
    for e in entries:
        t = gguf.tensor(e.name)
        if e.name in vq_plans:                  # one matrix repacked at a time: no whole-model host copy
            fmt, a = vq_layout.from_file(gguf, e.name, (row_scales or {}).get(e.name))
            tensors[e.name] = DevTensor(e.name, QT.I8, tuple(t.shape), put(a), fmt)
        elif e.name in converted:
            a = converted[e.name]
            tensors[e.name] = DevTensor(e.name, QT.I32 if a.dtype == np.int32 else QT.F32, tuple(a.shape), put(a))
        else:
            d = on_device[e.name]
            tensors[e.name] = DevTensor(e.name, QT(int(t.qtype)), tuple(t.shape), d.array)
    by_bytes = {k: put(a) for k, a in distinct.items()}
    freqs = [by_bytes[tables[il].tobytes()] for il in range(cfg.n_layers)]
    binding = schema.bind(cfg, tensors.__getitem__)
    return DeviceWeights(arena, binding, freqs, file_bytes, extra)


def upload_entries(rt: Any, store: Any, gguf, entries: list, field: Any = None,
                   extra: tuple[np.ndarray, ...] = ()) -> tuple[Any, dict[str, DevTensor], list[DeviceArray]]:
    """A draft's tensors (`entries` of `gguf`: the MTP block's, DSpark's) in one device block of `store`, in the
    file's formats as `load` uploads the main model's (VQ-8 experts re-laid, small vectors converted), plus the
    float32 arrays `extra` (RoPE tables) after them. field(entry): the binding field the roles are read from
    (default the entry's). Refuses a type no kernel reads, as the main load does. -> (block, tensors by name,
    extra device arrays)."""
    host: dict[str, tuple[QT, tuple, np.ndarray, str | None]] = {}
    for e in entries:
        t = gguf.tensor(e.name)
        f = field(e) if field is not None else e.spec.field
        if f.startswith("ffn.experts.") and vq.is_vq(gguf, e.name):
            fmt, a = vq_layout.from_file(gguf, e.name)          # the main model's device layout, as main layers
            host[e.name] = (QT.I8, tuple(t.shape), a, fmt)
            continue
        conv = conversion(gguf, e if f == e.spec.field else replace(e, spec=replace(e.spec, field=f)))
        if conv is not None:
            host[e.name] = (QT.I32 if conv.dtype == np.int32 else QT.F32, tuple(conv.shape), conv, None)
        else:
            qt = QT(int(t.qtype))
            a = np.asarray(t.raw, _PLAIN[qt]) if qt in _PLAIN else t.raw_bytes()     # as upload_gguf views them
            host[e.name] = (qt, tuple(t.shape), a, None)
    offs, at = {}, 0
    for name, (_, _, a, _) in host.items():
        offs[name] = at
        at += align_up(a.nbytes)
    ex_offs, at = place_after(extra, at)
    blk = store.block(max(at, ALIGN))
    tensors = {}
    for name, (qt, shape, a, fmt) in host.items():
        d = blk.array(offs[name], a.shape, a.dtype)
        d.upload(np.ascontiguousarray(a))
        tensors[name] = DevTensor(name, qt, shape, d, fmt)
    arrays = upload_float32(blk, extra, ex_offs)
    rt.synchronize()
    return blk, tensors, arrays


def place_after(extra: tuple[np.ndarray, ...], at: int) -> tuple[list[int], int]:
    """(offsets, end): the arrays `extra` laid out from byte `at` of a block, each aligned."""
    offs = []
    for a in extra:
        offs.append(at)
        at += align_up(a.nbytes)
    return offs, at


def upload_float32(blk: Any, extra: tuple[np.ndarray, ...], offs: list[int]) -> list[DeviceArray]:
    """The arrays `extra` as float32 device arrays at `offs` of `blk` (place_after's offsets); not synchronized."""
    arrays = []
    for a, o in zip(extra, offs):
        d = blk.array(o, a.shape, np.float32)
        d.upload(np.ascontiguousarray(a, np.float32))
        arrays.append(d)
    return arrays


_PLAIN = {QT.F32: np.float32, QT.F16: np.float16, QT.I32: np.int32}
