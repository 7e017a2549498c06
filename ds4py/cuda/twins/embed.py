"""Twin of cu/embed.cu: table rows as float32, `copies` times; an id outside [0, vocab) gives NaN rows."""

from __future__ import annotations

import numpy as np


def embed(table: np.ndarray, ids: np.ndarray, copies: int = 1) -> np.ndarray:
    """An F16 or F32 table (embed_f16 / embed_f32)."""
    table = np.asarray(table)
    ids = np.asarray(ids, np.int64)
    out = np.full((len(ids), table.shape[1]), np.nan, np.float32)
    ok = (ids >= 0) & (ids < table.shape[0])
    out[ok] = table[ids[ok]].astype(np.float32)
    return out if copies == 1 else np.repeat(out[:, None, :], copies, axis=1)


def embed_f16(table: np.ndarray, ids: np.ndarray, copies: int = 1) -> np.ndarray:
    return embed(np.asarray(table, np.float16), ids, copies)
