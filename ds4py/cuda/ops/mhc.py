"""Host side of cu/mhc.cu: the hyper-connection mix (with its Sinkhorn), collapse + RMSNorm, and hc_post."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ds4py.cuda.memory import DeviceArray
from ds4py.cuda.ops.core import aligned, ceil_div, is_dtype, need

DEFINES = {"MIX_COLS": 512}              # columns of flatten(X) per block of hc_mix (fixes the summation order)


def mix_record(hc: int = 4) -> int:
    """Floats per token of the mix output: pre[hc], post[hc], C[hc][hc]."""
    return (2 + hc) * hc


def mix_blocks(D: int, hc: int = 4) -> int:
    return ceil_div(hc * D, DEFINES["MIX_COLS"])


def mix_partial_floats(n_tok: int, nrows: int, D: int, hc: int = 4) -> int:
    """Scratch floats hc_mix needs for its per-block partials."""
    return n_tok * mix_blocks(D, hc) * (nrows + 1)


def mix_warps(nrows: int) -> int:
    """hc_mix's warps per block: one per group of 4 fn rows plus the sum-of-squares warp, so every group's loads are
    in flight at once (a sub-layer's 24 rows: 7 warps, not 4 warps doing two groups each in turn); at least 4. The
    result is bit-identical for any warp count (a group's sum never depends on which warp runs it)."""
    return max(4, min(32, ceil_div(nrows, 4) + 1))


@dataclass(frozen=True)
class Collapse:
    """y[t] = RMSNorm(sum_j pre_j X[t, j]; w) (w None: no weight): hc_collapse_norm's work, or done by hc_mix's last
    block. pre from pre[t * pre_stride ...] (pre_stride None: mix_record(hc), one record per token; 0: one record
    for every token, V4.1's one-hot first pre-mix); in hc_mix pre None takes this launch's mix (V4.1's lagged mHC
    gives the earlier sub-layer's records)."""
    y: DeviceArray
    w: DeviceArray | None
    eps: float
    pre: DeviceArray | None = None
    pre_stride: int | None = None

    def stride(self, hc: int) -> int:
        """Floats from one token's pre to the next (0 where no pre is read)."""
        if self.pre is None:
            return 0
        return mix_record(hc) if self.pre_stride is None else int(self.pre_stride)


@dataclass(frozen=True)
class MixWeights:
    """One mHC mix, the same for every call: fn [(2+hc)*hc, hc*D] (a sub-layer's: pre, post and the Sinkhorn C) or
    [hc, hc*D] (the head's: pre only), F16 or F32 as the GGUF stores it; scale [3 or 1] and base [fn rows] float32;
    the width D, hc copies, the RMS and Sinkhorn epsilons and its iterations."""
    fn: DeviceArray
    scale: DeviceArray
    base: DeviceArray
    D: int
    norm_eps: float
    hc_eps: float
    iters: int = 20
    hc: int = 4


@dataclass(frozen=True)
class MixBuffers:
    """One hc_mix call's arrays: X [n_tok, hc, D], the mix records out [n_tok, mix_record(hc)], the partials
    (mix_partial_floats(...) float32 scratch) and ticket (n_tok zeroed uint32, left zeroed)."""
    X: DeviceArray
    n_tok: int
    mix: DeviceArray
    partial: DeviceArray
    ticket: DeviceArray


def hc_mix(rt: Any, mw: MixWeights, buf: MixBuffers, collapse: Collapse | None = None, warps: int | None = None,
           stream: Any = None, pdl: bool = False) -> None:
    """mix[t] = the mHC mix of X[t] ([hc, D]). collapse: the last block also collapses + norms (one launch instead
    of hc_mix + hc_collapse_norm; bit for bit the two launches' result with hc_collapse_norm's default block: the
    block is collapse_threads(D) threads unless `warps` says otherwise)."""
    fn, scale, base, D, hc, iters = mw.fn, mw.scale, mw.base, mw.D, mw.hc, mw.iters
    X, n_tok, mix, partial, ticket = buf.X, buf.n_tok, buf.mix, buf.partial, buf.ticket
    nrows = fn.shape[0] if len(fn.shape) == 2 else 0
    n = hc * D
    if warps is None:
        warps = collapse_threads(D) // 32 if collapse is not None else mix_warps(nrows)
    warps = int(warps)
    need(nrows in (hc, mix_record(hc)) and fn.shape[1] == n,
         f"hc_mix: fn must be [{mix_record(hc)} or {hc}, {n}], got {list(fn.shape)}")
    need(is_dtype(fn, np.float16) or is_dtype(fn, np.float32), "hc_mix: fn must be F16 or F32")
    need(n % 8 == 0 and aligned(16, fn, X), "hc_mix: hc*D must be a multiple of 8, fn and X 16-byte aligned")
    need(is_dtype(X, np.float32) and X.size >= n_tok * n, f"hc_mix: X must be float32 [{n_tok}, {hc}, {D}]")
    need(is_dtype(scale, np.float32) and scale.size >= (3 if nrows > hc else 1), "hc_mix: scale too small")
    need(is_dtype(base, np.float32) and base.size >= nrows, "hc_mix: base too small")
    need(is_dtype(partial, np.float32) and partial.size >= mix_partial_floats(n_tok, nrows, D, hc),
         "hc_mix: partial scratch too small")
    need(is_dtype(ticket, np.uint32) and ticket.size >= n_tok, "hc_mix: ticket must hold n_tok uint32")
    need(is_dtype(mix, np.float32) and mix.size >= n_tok * mix_record(hc), "hc_mix: mix too small")
    need(1 <= warps <= 32 and iters >= 1, "hc_mix: warps 1..32, iters >= 1")
    c = collapse
    if c is not None:
        need(is_dtype(c.y, np.float32) and c.y.size >= n_tok * D, "hc_mix: the collapse's y too small")
        need(c.w is None or (is_dtype(c.w, np.float32) and c.w.size == D), f"hc_mix: the collapse's w must be {D} "
             "float32")
        need(c.pre is None or (c.stride(hc) >= 0 and is_dtype(c.pre, np.float32)
                               and c.pre.size >= (n_tok - 1) * c.stride(hc) + hc),
             "hc_mix: the collapse's pre too small")
    kernel = "hc_mix_f16" if is_dtype(fn, np.float16) else "hc_mix_f32"
    rt.launch(kernel, (mix_blocks(D, hc), n_tok), 32 * warps, fn, nrows, X, n, scale, base, partial, ticket, mix,
              float(mw.norm_eps), float(mw.hc_eps), int(iters), c.pre if c else None, c.stride(hc) if c else 0,
              c.w if c else None, float(c.eps) if c else 0.0, c.y if c else None, stream=stream, pdl=pdl)


def collapse_threads(D: int) -> int:
    """hc_collapse_norm's block: one block per token reads hc*D floats, so at real widths (D = 4096) 1,024 threads
    (4 columns each, hc loads per column) keep 4x the bytes in flight of 256; small widths keep 256 (their sum
    order, hence their bits, unchanged)."""
    return max(256, min(1024, 32 * ceil_div(ceil_div(D, 4), 32)))


@dataclass(frozen=True)
class HcRows:
    """n_tok rows of a residual state X [n_tok, hc, dim]."""
    X: DeviceArray
    n_tok: int
    dim: int
    hc: int = 4


def hc_collapse_norm(rt: Any, rows: HcRows, c: Collapse, threads: int | None = None, stream: Any = None,
                     pdl: bool = False) -> None:
    """c.y[t] = RMSNorm(sum_j pre_j X[t, j]; c.w) with pre from the mix records c.pre - a sub-layer's input, or the
    head's (c.pre from hc_mix on output_hc_fn, c.w = output_norm)."""
    X, n_tok, D, hc = rows.X, rows.n_tok, rows.dim, rows.hc
    need(c.pre is not None, "hc_collapse_norm: the collapse needs its mix records (pre)")
    mix, w, eps, y, stride = c.pre, c.w, c.eps, c.y, c.stride(hc)
    threads = collapse_threads(D) if threads is None else int(threads)
    need(is_dtype(X, np.float32) and X.size >= n_tok * hc * D, "hc_collapse_norm: X must be float32 [T, hc, D]")
    need(stride >= 0 and is_dtype(mix, np.float32) and mix.size >= (n_tok - 1) * stride + hc,
         "hc_collapse_norm: mix too small")
    need(w is None or (is_dtype(w, np.float32) and w.size == D), f"hc_collapse_norm: w must be {D} float32")
    need(is_dtype(y, np.float32) and y.size >= n_tok * D, "hc_collapse_norm: y too small")
    need(threads % 32 == 0 and 32 <= threads <= 1024, "hc_collapse_norm: threads a multiple of 32 up to 1024")
    rt.launch("hc_collapse_norm", n_tok, threads, X, mix, stride, D, w, float(eps), y, stream=stream, pdl=pdl)


@dataclass(frozen=True)
class HcResidual:
    """The residual state X [T, hc, dim] a sub-layer's output f goes back into, in place or into an output of its
    shape: X'_k = post_k f + sum_j comb[j, k] X_j with mix [T, mix_record(hc)] the sub-layer's records (pre, post,
    comb; hc_mix's output)."""
    X: Any
    mix: Any
    dim: int
    hc: int = 4


def hc_post(rt: Any, f: DeviceArray, res: HcResidual, n_tok: int, threads: int = 256, stream: Any = None,
            pdl: bool = False) -> None:
    """res.X[t] <- post_k f[t] + sum_j C[j,k] X[t, j] in place (the sub-layer output back into the residual
    state); f [T, dim]."""
    X, mix, D, hc = res.X, res.mix, res.dim, res.hc
    need(is_dtype(f, np.float32) and f.size >= n_tok * D, "hc_post: f must be float32 [T, D]")
    need(is_dtype(mix, np.float32) and mix.size >= n_tok * mix_record(hc), "hc_post: mix too small")
    need(is_dtype(X, np.float32) and X.size >= n_tok * hc * D, "hc_post: X must be float32 [T, hc, D]")
    need(threads % 32 == 0 and 32 <= threads <= 1024, "hc_post: threads a multiple of 32 up to 1024")
    rt.launch("hc_post_f32", (ceil_div(D, threads), n_tok), threads, f, mix, mix_record(hc), X, D, stream=stream,
              pdl=pdl)
