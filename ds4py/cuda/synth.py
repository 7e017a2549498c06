"""A synthetic model's weights written straight into the device arena: every tensor of the schema at its real
shape and in the storage types of the public q2 file (ds4's slots: Q8_0 dense, F16 compressors / indexer /
router / embedding / hc `fn`, F32 vectors, IQ2_XXS gate + up and Q2_K down experts), filled with random values
by cu/fill.cu. No GGUF file and no host copy: the device check runs a full-size 43-layer decode step this way
(an 80 GB file would take longer to write than the check may run).

Magnitudes follow ds4py/tiny.py (make-tiny): projections ~ N(0, 1/fan_in)-sized, norms near 1, the IQ2_XXS /
Q2_K block scales make-tiny uses, ids below the expert count, so the forward stays finite and the router
spreads tokens over experts as a real model does. `to_host(weights)` reads every tensor back (for writing the
same model as a GGUF the reference can run: tests/test_cuda_engine_synth.py).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as QT

from ds4py import quant, schema
from ds4py.cuda.memory import DeviceArray, align_up
from ds4py.cuda.device_weights import DevTensor, DeviceWeights, role, rope_tables
from ds4py.cuda.ops import fill

SLOT_TYPES = {"q8": QT.Q8_0, "f16": QT.F16, "f32": QT.F32, "i32": QT.I32}
Q2_EXPERTS = (QT.IQ2_XXS, QT.Q2_K)                   # the public q2 file's gate + up and down

# per block format: (block bytes, f16 scale offsets, e8m0 offset)
BLOCK_FIELDS = {QT.Q8_0: (34, (0,), -1), QT.IQ2_XXS: (66, (0,), -1), QT.Q2_K: (84, (80, 82), -1),
                QT.Q4_K: (144, (0, 2), -1), QT.MXFP4: (17, (), 0)}


def tensor_type(e: schema.Entry, experts: tuple[QT, QT]) -> QT:
    if e.spec.slot == "experts":
        return experts[1] if e.spec.field.endswith(".down") else experts[0]
    return SLOT_TYPES[e.spec.slot]


def _dtype(qt: QT) -> np.dtype:
    return np.dtype({QT.F32: np.float32, QT.F16: np.float16, QT.I32: np.int32}.get(qt, np.uint8))


def _device_shape(qt: QT, shape: tuple[int, ...]) -> tuple[int, ...]:
    if qt in (QT.F32, QT.F16, QT.I32):
        return tuple(shape)
    return (*shape[:-1], quant.row_nbytes(qt, shape[-1]))


def fingerprint(cfg, experts: tuple[QT, QT], seed: int) -> str:
    text = f"{cfg!r}|{experts[0].name},{experts[1].name}|{seed}"
    return "synthetic-" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _vec_range(field: str) -> tuple[float, float]:
    leaf = field.rsplit(".", 1)[-1]
    if leaf in ("base", "sinks", "route_bias"):
        return -0.5, 0.5
    return 0.9, 1.1                                  # norms, hc scales


def load(rt: Any, cfg, scratch_bytes: int, seed: int = 0, experts: tuple[QT, QT] = Q2_EXPERTS) -> DeviceWeights:
    """The schema's tensors of `cfg` in one arena, filled on the device; bound like a loaded GGUF."""
    entries = list(schema.entries(cfg))
    plan = []
    at = 0
    for e in entries:
        qt = tensor_type(e, experts)
        shape = _device_shape(qt, e.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * _dtype(qt).itemsize
        plan.append((e, qt, shape, at))
        at += align_up(nbytes)
    tables = rope_tables(cfg)
    distinct: dict[bytes, np.ndarray] = {}
    for a in tables.values():
        distinct.setdefault(a.tobytes(), a)
    extra = sum(align_up(a.nbytes) for a in distinct.values()) + 256
    arena = rt.arena(weights_bytes=at + extra, scratch_bytes=scratch_bytes)
    blob = arena.weights(at, np.uint8)                   # read-only to the model's kernels ...
    writable = DeviceArray(blob.ptr, blob.shape, blob.dtype, False, blob.mem)    # ... written by the fills
    fill.fill_random_u32(rt, writable, seed)             # every byte random (quantised blocks: valid codes)
    tensors: dict[str, DevTensor] = {}
    for i, (e, qt, shape, off) in enumerate(plan):
        tensors[e.name] = DevTensor(e.name, qt, tuple(e.shape), blob.view(off, shape, _dtype(qt)))
        _fill(rt, e, qt, writable.view(off, shape, _dtype(qt)), cfg, seed * 1000003 + i)
    by_bytes = {}
    for k, a in distinct.items():
        d = arena.weights(a.shape, a.dtype)
        d.upload(a)
        by_bytes[k] = d
    freqs = [by_bytes[tables[il].tobytes()] for il in range(cfg.n_layers)]
    rt.synchronize()
    return DeviceWeights(arena, schema.bind(cfg, tensors.__getitem__), freqs, at, extra)


def _fill(rt: Any, e: schema.Entry, qt: QT, arr, cfg, seed: int) -> None:
    kind, fan_in = role(e.spec.field), e.shape[-1]
    a = math.sqrt(3.0 / fan_in)                      # uniform [-a, a]: variance 1 / fan_in
    if qt == QT.I32:
        fill.fill_i32_rows(rt, arr, cfg.n_experts_used, cfg.n_experts, seed)
    elif qt == QT.F32 or (qt == QT.F16 and kind in ("vec",)):
        lo, hi = _vec_range(e.spec.field) if kind == "vec" else (-0.5, 0.5)
        fill.fill_uniform(rt, arr, lo, hi, seed)
    elif qt == QT.F16:
        lim = 1.0 if kind in ("embed", "ape") else a
        fill.fill_uniform(rt, arr, -lim, lim, seed)
    else:
        block, f16_at, e8m0_at = BLOCK_FIELDS[qt]
        k = math.sqrt(256.0 / fan_in)
        scale = {QT.Q8_0: a / 128.0, QT.IQ2_XXS: 0.003 * k, QT.Q2_K: 0.004 * k, QT.Q4_K: a / 256.0}.get(qt, 1.0)
        e8 = max(0, min(254, 127 + int(round(math.log2(a / 6.0)))))
        fill.fix_block_fields(rt, arr.view(0, arr.nbytes, np.uint8), block, f16_at, scale, e8m0_at, (e8 - 1, e8),
                              seed)


def to_host(w: DeviceWeights, cfg) -> dict[str, tuple[QT, np.ndarray]]:
    """Every schema tensor back on the host: (type, array as a GGUF writer takes it)."""
    out = {}
    for e in schema.entries(cfg):
        t = _lookup(w.binding, e)
        out[e.name] = (t.qtype, t.array.download())
    return out


def _lookup(b: schema.ModelWeights, e: schema.Entry) -> DevTensor:
    obj: Any = b if e.layer is None else b.layers[e.layer]
    for part in e.spec.field.split("."):
        obj = getattr(obj, part)
    return obj
