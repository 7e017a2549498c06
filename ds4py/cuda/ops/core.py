"""Host-side wrappers: one function per kernel that checks shapes and picks the launch geometry.

Each mirrors the launch comment above its kernel in cu/*.cu. Arguments are DeviceArrays (or, for pointers
that may be null, None). `pdl=True` lets the kernel overlap the previous one in the stream (it calls pdl_wait()
before touching that kernel's output).
"""

from __future__ import annotations

from typing import Any

from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.runtime import Runtime
from ds4py.errors import Ds4Error

Q8_0_BLOCK_BYTES = 34
Q8_CHUNK_BLOCKS = 128                                    # = Q8_CHUNK_BLOCKS in cu/gemv.cu
Q8_STAGE_BYTES = Q8_CHUNK_BLOCKS * Q8_0_BLOCK_BYTES + 16  # = Q8_STAGE_BYTES in cu/gemv.cu (per warp)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise Ds4Error(msg)


def _aligned16(*arrays: DeviceArray | None) -> bool:
    return all(a is None or a.ptr % 16 == 0 for a in arrays)


def rmsnorm(rt: Runtime, x: DeviceArray, w: DeviceArray | None, y: DeviceArray, n: int, eps: float,
            threads: int = 256, stream: Any = None, pdl: bool = False) -> None:
    """y[r] = RMSNorm(x[r]) (* w) for every row r of n floats."""
    _need(n > 0 and x.size % n == 0 and y.size == x.size, f"rmsnorm: x has {x.size} floats, not rows of {n}")
    _need(w is None or w.size == n, f"rmsnorm: weight has {w.size if w else 0} floats, expected {n}")
    _need(threads % 32 == 0 and 32 <= threads <= 1024, "rmsnorm: threads must be a multiple of 32 up to 1024")
    rt.launch("rmsnorm_f32", x.size // n, threads, x, w, y, n, float(eps), stream=stream, pdl=pdl)


def gemv_f16(rt: Runtime, W: DeviceArray, x: DeviceArray, y: DeviceArray, rows: int, cols: int,
             warps: int = 8, grid: int | None = None, stream: Any = None, pdl: bool = False) -> None:
    """y[rows] = W[rows, cols] @ x[cols], F16 weights."""
    _need(cols % 8 == 0, f"gemv_f16: cols ({cols}) must be a multiple of 8")
    _need(W.size == rows * cols and x.size >= cols and y.size >= rows, "gemv_f16: shapes do not match rows x cols")
    _need(_aligned16(W, x), "gemv_f16: W and x must be 16-byte aligned")
    _need(1 <= warps <= 32, "gemv_f16: warps must be 1..32")
    grid = grid or -(-rows // warps)
    rt.launch("gemv_f16", grid, 32 * warps, W, x, y, rows, cols, stream=stream, pdl=pdl)


def gemv_q8_0(rt: Runtime, W: DeviceArray, x: DeviceArray, y: DeviceArray, rows: int, cols: int,
              warps: int = 8, grid: int | None = None, stream: Any = None, pdl: bool = False) -> None:
    """y[rows] = W[rows, cols] @ x[cols], Q8_0 weights (raw uint8 blocks, rows * cols/32 * 34 bytes)."""
    _need(cols % 32 == 0, f"gemv_q8_0: cols ({cols}) must be a multiple of 32")
    _need(W.nbytes == rows * cols // 32 * Q8_0_BLOCK_BYTES, "gemv_q8_0: W does not hold rows x cols Q8_0 blocks")
    _need(x.size >= cols and y.size >= rows, "gemv_q8_0: x or y too small")
    _need(_aligned16(x) and W.ptr % 2 == 0, "gemv_q8_0: x must be 16-byte aligned and W 2-byte aligned")
    _need(1 <= warps <= 32, "gemv_q8_0: warps must be 1..32")
    grid = grid or -(-rows // warps)
    rt.launch("gemv_q8_0", grid, 32 * warps, W, x, y, rows, cols, smem=warps * Q8_STAGE_BYTES, stream=stream,
              pdl=pdl)


def embed(rt: Runtime, table: DeviceArray, ids: DeviceArray, out: DeviceArray, n_ids: int,
          threads: int = 256, stream: Any = None, pdl: bool = False) -> None:
    """out[t] = float(table[ids[t]]); table is F16 [vocab, dim]."""
    _need(len(table.shape) == 2, "embed: the table must be 2-D [vocab, dim]")
    vocab, dim = table.shape
    _need(ids.size >= n_ids >= 1 and out.size >= n_ids * dim, "embed: ids or out too small")
    rt.launch("embed_f16", n_ids, threads, table, ids, out, dim, vocab, stream=stream, pdl=pdl)


def argmax(rt: Runtime, x: DeviceArray, n: int, part_val: DeviceArray, part_idx: DeviceArray, out: DeviceArray,
           threads: int = 256, stream: Any = None, pdl: bool = False) -> None:
    """out[0] = argmax(x[:n]) in two launches; part_* hold one entry per pass-1 block (their size sets the grid)."""
    parts = part_val.size
    _need(n >= 1 and x.size >= n, "argmax: x is empty or shorter than n")
    _need(part_idx.size == parts >= 1 and out.size >= 1, "argmax: partial buffers must have the same size >= 1")
    rt.launch("argmax_partial", parts, threads, x, n, part_val, part_idx, stream=stream, pdl=pdl)
    rt.launch("argmax_final", 1, threads, part_val, part_idx, parts, out, stream=stream, pdl=pdl)
