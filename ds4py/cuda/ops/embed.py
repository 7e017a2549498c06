"""Host side of cu/embed.cu."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.ops.core import aligned, is_dtype, need


@dataclass(frozen=True)
class Embedding:
    """A token table F16 or F32 [vocab, dim] and the copies of each row written (hc: the residual state)."""
    table: DeviceArray
    copies: int = 1


def embed(rt: Any, emb: Embedding, ids: DeviceArray, out: DeviceArray, n_ids: int, threads: int = 256,
          stream: Any = None, pdl: bool = False) -> None:
    """out[t, c] = float(table[ids[t]]) for c < copies. ids: an int32 device buffer (e.g. the slot the argmax or
    sampler of the previous step wrote)."""
    table, copies = emb.table, emb.copies
    f32 = is_dtype(table, np.float32)
    need(len(table.shape) == 2 and (f32 or is_dtype(table, np.float16)),
         "embed: the table must be F16 or F32 [vocab, dim]")
    vocab, dim = table.shape
    need(dim % 2 == 0 and aligned(8 if f32 else 4, table),
         "embed: dim must be even and the table 4-byte (F32: 8-byte) aligned")
    need(is_dtype(ids, np.int32) and ids.size >= n_ids >= 1, "embed: ids must be int32 with n_ids entries")
    need(is_dtype(out, np.float32) and out.size >= n_ids * copies * dim, "embed: out too small")
    need(copies >= 1 and threads % 32 == 0 and 32 <= threads <= 1024, "embed: bad copies or threads")
    rt.launch("embed_f32" if f32 else "embed_f16", n_ids, threads, table, ids, out, dim, vocab, copies, stream=stream, pdl=pdl)
