"""The int8-activation CPU kernels (numba): ggml's / ds4's CPU numerics, at integer-SIMD speed.

    if jit_i8.supported(qtype):
        y = jit_i8.matmul(qtype, raw, x, threads)      # raw uint8 [R, row_nbytes] (GGUF rows), x [T, C] -> [T, R]

x is quantised per block first, exactly as the reference's int8-activation mode rounds it (ds4py.ref.ops:
q8_0_round for Q8_0 / MXFP4 weights, q8_k_round for the K- and IQ-quants; `Numerics.act_quant`), then every
block's integer dot product is exact and scaled once: y equals the reference's `act_quant` products up to float32
rounding of the scale products and the summation order (tests/test_jit_i8.py states the bound).
Two kernel families: up to DECODE_ROWS tokens the decode kernels (ds4py.quant.jit_decode: explicit vector IR,
a block unpacked in registers per token; IQ2_XXS, Q2_K, Q8_0), above that the block-buffer kernels
(ds4py.quant.jit_i8_kernels: a block unpacked once for all tokens). IQ2_XXS / Q2_K give the same bits either way.
The reference backend (ds4py.ref.weights, INT8_KERNELS / INT8_DECODE_KERNELS) sends IQ2_XXS, Q2_K and Q4_K here
when act_quant is on with the compiled kernels, for every row count, and Q8_0 for steps of up to DECODE_ROWS rows;
longer Q8_0 steps and MXFP4 keep the fp32 kernels on the rounded x (the buffer kernels' int8 block of 32 costs a
horizontal sum); F16 / F32 / BF16 and VQ-8 keep the fp32 kernels on the unrounded activation, as the reference
does for them. The CLI's default numerics on the reference backend take this path (ds4py.cli._options).

numba state (cache folder, threading layer, its lock) is ds4py.quant.jit's: one compile cache, one pool.
"""

from __future__ import annotations

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as Q

from ds4py.quant import jit

F32 = np.float32
Q8_0_ACT = (Q.Q8_0, Q.MXFP4)                    # ggml's vec_dot_type for these: Q8_0 (blocks of 32)
Q8_K_ACT = (Q.Q2_K, Q.Q4_K, Q.IQ2_XXS)          # and Q8_K (blocks of 256) for these
FORMATS = Q8_0_ACT + Q8_K_ACT
_INTS = {int(q) for q in FORMATS}
# up to this many tokens IQ2_XXS / Q2_K / Q8_0 take the decode kernels (unpacked in vector registers per token,
# explicit vector IR: ds4py.quant.jit_decode); more take the kernels that unpack a block once for all tokens
# (IQ2_XXS / Q2_K: the same bits either way). The reference's fused-kernel step size (ref.weights.FUSED_MAX_ROWS):
# a verify step of up to that many rows gets a decode step's bits.
DECODE_ROWS = 8
_tables: dict = {}


def available() -> bool:
    return jit.available()


def supported(qtype) -> bool:
    return int(qtype) in _INTS


def quant_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [T, C] -> (int8 codes [T, C], float32 scales [T, C/32]): ops.q8_0_round's codes and its f16-rounded d.
    Compiled (jit_decode.quant_q8_0_rows: one pass, ~1/10 of numpy's time on a 4,096-wide decode row) where the
    kernels are loaded and x is finite, else numpy; the same bits either way."""
    x = np.ascontiguousarray(x, dtype=F32)
    T, C = x.shape
    if "dec" in _tables:
        q, d = np.empty((T, C), np.int8), np.empty((T, C // 32), F32)
        if _tables["dec"].quant_q8_0_rows(x, q, d):
            return q, d.astype(np.float16).astype(F32)
    return _quant_q8_0_numpy(x)


def _quant_q8_0_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    T, C = x.shape
    xb = x.reshape(T, C // 32, 32)
    d = np.abs(xb).max(-1) / F32(127)
    q = np.rint(xb / np.where(d > 0, d, F32(1))[..., None])
    return q.astype(np.int8).reshape(T, C), d.astype(np.float16).astype(F32)


def quant_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [T, C] -> (int8 codes [T, C], float32 d [T, C/256], int32 sums of each 16 codes [T, C/16]):
    ops.q8_k_round's codes and scale. Compiled where loaded and x is finite (as quant_q8_0), else numpy."""
    x = np.ascontiguousarray(x, dtype=F32)
    T, C = x.shape
    if "dec" in _tables:
        q, d, bs = np.empty((T, C), np.int8), np.empty((T, C // 256), F32), np.empty((T, C // 16), np.int32)
        if _tables["dec"].quant_q8_k_rows(x, q, d, bs):
            return q, d, bs
    return _quant_q8_k_numpy(x)


def _quant_q8_k_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    T, C = x.shape
    xb = x.reshape(T, C // 256, 256)
    mx = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)[..., 0]
    iscale = np.where(mx != 0, F32(-127) / np.where(mx != 0, mx, F32(1)), F32(0))
    q = np.minimum(np.rint(xb * iscale[..., None]), 127).astype(np.int8).reshape(T, C)
    d = np.where(iscale != 0, F32(1) / np.where(iscale != 0, iscale, F32(1)), F32(0)).astype(F32)
    bsums = q.reshape(T, C // 16, 16).sum(-1, dtype=np.int32)
    return q, d, bsums


def _kernels():
    k = jit._load()
    if k is None:
        raise RuntimeError(f"numba does not import: {jit.unavailable_reason()}")
    if not _tables:
        from ds4py.quant import iq2, jit_decode, jit_i8_kernels, mxfp4

        _tables["mod"] = jit_i8_kernels
        _tables["dec"] = jit_decode
        # IQ2_XXS as 64-bit words of four int16 lanes (jit_i8_kernels.iq2_xxs): magnitudes, negation masks
        _tables["grid"] = jit._readonly(np.ascontiguousarray(iq2.GRID.astype(np.uint16)).view(np.uint64))
        _tables["signs"] = jit._readonly(np.where(iq2.SIGNS < 0, np.uint16(0xFFFF), np.uint16(0)).astype(np.uint16)
                                         .view(np.uint64))
        # the decode kernels' tables (jit_decode.iq2_block_pairs): 8 magnitude bytes / 8 sign bytes (+1 / -1) per uint64
        _tables["grid8"] = jit._readonly(np.ascontiguousarray(iq2.GRID.astype(np.uint8)).view(np.uint64).ravel())
        _tables["sign8"] = jit._readonly(np.where(iq2.SIGNS < 0, np.uint8(0xFF), np.uint8(1)).astype(np.uint8)
                                         .view(np.uint64).ravel())
        _tables["kvalues"] = jit._readonly(np.ascontiguousarray(mxfp4.KVALUES.astype(np.int16)))
    return _tables["mod"]


def matmul(qtype, raw: np.ndarray, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """x @ W.T for stored GGUF rows raw (uint8 [R, row_nbytes]) of a format in FORMATS, x quantised per block
    the way the reference's act_quant mode rounds it -> float32 [T, R]."""
    k = _kernels()
    st = jit._state
    qt = int(qtype)
    raw = jit._readonly(np.ascontiguousarray(raw).view(np.uint8))
    x = np.ascontiguousarray(x, dtype=F32)
    R, (T, C) = raw.shape[0], x.shape
    y = np.empty((T, R), F32)
    parts = max(1, min(threads, R))
    f16 = st["f16"]
    if qt in (Q.Q8_0, Q.MXFP4):
        xq, xd = quant_q8_0(x)
        if qt == Q.Q8_0 and T <= DECODE_ROWS:
            jit.call_rows("q8_0", _tables["dec"], (raw.reshape(R, C // 32, 34), xq, xd, y, f16), R, raw.nbytes,
                          threads)
        elif qt == Q.Q8_0:
            r3 = raw.reshape(R, C // 32, 34)
            jit._call("i8_q8_0", k.q8_0, (r3, r3.view(np.int8), xq, xd, y, f16, parts), threads)
        else:
            jit._call("i8_mxfp4", k.mxfp4, (raw.reshape(R, C // 32, 17), xq, xd, y, st["e8m0"],
                                            _tables["kvalues"], parts), threads)
        return y
    xq, xd, xbs = quant_q8_k(x)
    if qt == Q.Q2_K and T <= DECODE_ROWS:
        jit.call_rows("q2_k", _tables["dec"], (raw.reshape(R, C // 256, 84), xq, xd, xbs, y, f16), R, raw.nbytes,
                      threads)
    elif qt == Q.IQ2_XXS and T <= DECODE_ROWS:
        jit.call_rows("iq2_xxs", _tables["dec"], (raw.reshape(R, C // 256, 66), xq, xd, y, f16, _tables["grid8"],
                                                  _tables["sign8"]), R, raw.nbytes, threads)
    elif qt == Q.Q2_K:
        jit._call("i8_q2_k", k.q2_k, (raw.reshape(R, C // 256, 84), xq, xd, xbs, y, f16, parts), threads)
    elif qt == Q.Q4_K:
        jit._call("i8_q4_k", k.q4_k, (raw.reshape(R, C // 256, 144), xq, xd, xbs, y, f16, parts), threads)
    elif qt == Q.IQ2_XXS:
        jit._call("i8_iq2_xxs", k.iq2_xxs, (raw.reshape(R, C // 256, 66), xq, xd, y, f16, _tables["grid"],
                                            _tables["signs"], parts), threads)
    else:
        raise ValueError(f"no int8-activation kernel for format {qt}")
    return y


# the formats with a decode kernel over a layer's routed experts (jit_decode.*_ex_rows / *_ex_dec)
EXPERT_FORMATS = (Q.IQ2_XXS, Q.Q2_K, Q.Q8_0)
_EX_INTS = {int(q) for q in EXPERT_FORMATS}
# ... and those whose products are the same bits at every token count (the decode kernels = the block-buffer and
# tiled prefill kernels, jit_i8_kernels / jit_i8_gemm_kernels): these take a prefill's experts too. Q8_0 over
# DECODE_ROWS rows keeps the fp32 kernels on the rounded x (ref.weights), so only a decode step's Q8_0 experts.
_EX_ANY_ROWS = {int(Q.IQ2_XXS), int(Q.Q2_K)}
_EX_BLOCK = {int(Q.IQ2_XXS): (256, 66), int(Q.Q2_K): (256, 84), int(Q.Q8_0): (32, 34)}


def experts_supported(qtype, rows: int) -> bool:
    """Whether experts_matmul takes stacked experts of this format for a step of `rows` token rows (the products
    matmul would make for each expert's rows: IQ2_XXS / Q2_K at any row count, Q8_0 up to DECODE_ROWS)."""
    return int(qtype) in _EX_ANY_ROWS or (int(qtype) in _EX_INTS and rows <= DECODE_ROWS)


def plain_supported(qtype, mats: int, rows: int) -> bool:
    """Whether experts_matmul takes a `plain` Q8_0 product of `rows` activation rows along with `mats` stacked
    expert matrices of this format (one launch when both run on the pool; else two calls, the same bits)."""
    return int(qtype) == Q.IQ2_XXS and mats == 2 and rows <= DECODE_ROWS


def experts_pooled(qtype, raws: tuple, groups: int, threads: int) -> bool:
    """Whether experts_matmul runs these stacked expert tensors (uint8 [X, R, row_nbytes]) for `groups` experts
    on the pool (else on the calling thread: a small step)."""
    X, R, nbytes = raws[0].shape
    return min(threads, len(raws) * groups * R) > 1 and len(raws) * groups * R * nbytes >= jit.SERIAL_BYTES


def _work_bounds(gs: np.ndarray, R: int, mats: int, parts: int) -> np.ndarray:
    """Task ranges for `parts` threads over the tasks (matrix, group, row), cut at equal work (a task's work is
    its group's pair count: a prefill routes some experts many more rows than others)."""
    pairs = np.diff(gs)
    G = len(pairs)
    K = mats * G * R
    if (pairs == pairs[0]).all():                     # a decode step: every expert one row, equal ranges
        return np.arange(parts + 1, dtype=np.int64) * K // parts
    cum = np.concatenate(([0], np.cumsum(np.tile(pairs, mats) * R)))
    cuts = [0]
    for i in range(1, parts):
        target = cum[-1] * i // parts
        seg = int(np.searchsorted(cum, target, side="right")) - 1
        cuts.append(max(cuts[-1], seg * R + int((target - cum[seg]) // max(1, pairs[seg % G]))))
    cuts.append(K)
    return np.array(cuts, np.int64)


def experts_matmul(qtype, raws: tuple, ex: np.ndarray, gs: np.ndarray, xr: np.ndarray, x: np.ndarray,
                   threads: int = 1, plain: tuple | None = None) -> list[np.ndarray]:
    """One layer's routed-expert products in one kernel call: for each stacked expert tensor in raws (uint8
    [X, R, row_nbytes]: one, or two of one format and shape sharing x, as gate and up), y[j] = x[xr[j]] @ W_e.T
    for each pair j in gs[g]..gs[g+1] of group g, e = ex[g] -> float32 [len(xr), R] per tensor. x [T, C] is
    quantised once. Each pair's row equals matmul(qtype, raw[e], x[xr[j:j+1]]) bit for bit (the decode kernels'
    float sequence per (token, row)); tests/test_jit_i8.py checks it.
    plain = (raw uint8 [R8, C8/32*34] of a Q8_0 matrix, its activation x8 [T8, C8]), with IQ2_XXS experts on the
    pool (plain_supported): matmul(Q8_0, raw, x8) in the same launch, appended to the list (its bits: the same row
    kernel); without the pool, its own call."""
    _kernels()
    qt = int(qtype)
    if qt not in _EX_INTS or len(raws) not in (1, 2):
        raise ValueError(f"no routed-expert kernel for format {qt} over {len(raws)} matrices")
    block, nbytes = _EX_BLOCK[qt]
    x = np.ascontiguousarray(x, dtype=F32)
    T, C = x.shape
    ws = [jit._readonly(np.ascontiguousarray(r).view(np.uint8)) for r in raws]
    X, R = ws[0].shape[:2]
    ws = [w.reshape(X, R, C // block, nbytes) for w in ws]
    if len(ws) == 2 and ws[1].shape != ws[0].shape:
        raise ValueError("the two expert tensors of one call must have one shape")
    ex = np.ascontiguousarray(ex, dtype=np.int64)
    gs = np.ascontiguousarray(gs, dtype=np.int64)
    xr = np.ascontiguousarray(xr, dtype=np.int64)
    mats = len(ws)
    ys = [np.empty((len(xr), R), F32) for _ in range(mats)]
    wa, wb = ws[0], ws[-1]
    ya, yb = ys[0], ys[-1]
    f16 = jit._state["f16"]
    if qt == Q.Q8_0:
        xq, xd = quant_q8_0(x)
        args = (wa, wb, ex, gs, xr, xq, xd, ya, yb, f16)
        name = "q8_0_ex"
    else:
        xq, xd, xbs = quant_q8_k(x)
        if qt == Q.Q2_K:
            args, name = (wa, wb, ex, gs, xr, xq, xd, xbs, ya, yb, f16), "q2_k_ex"
        else:
            args, name = (wa, wb, ex, gs, xr, xq, xd, ya, yb, f16, _tables["grid8"], _tables["sign8"]), "iq2_xxs_ex"
    tasks = mats * len(ex) * R
    work = mats * len(ex) * R * (C // block) * nbytes             # the weight bytes the call reads
    parts = max(1, min(threads, tasks))
    dec = _tables["dec"]
    if plain is not None and qt == Q.IQ2_XXS and parts > 1 and work >= jit.SERIAL_BYTES:
        q8raw, x8 = plain
        x8 = np.ascontiguousarray(x8, dtype=F32)
        T8, C8 = x8.shape
        q8 = jit._readonly(np.ascontiguousarray(q8raw).view(np.uint8)).reshape(-1, C8 // 32, 34)
        xq8, xd8 = quant_q8_0(x8)
        y8 = np.empty((T8, q8.shape[0]), F32)
        pieces = parts * dec.CHUNKS_PER_THREAD            # shared out by weight bytes, at least one each
        n8 = max(1, min(q8.shape[0], round(pieces * q8.nbytes / (q8.nbytes + work))))
        bounds = _work_bounds(gs, R, mats, max(1, min(tasks, pieces - n8)))
        jit._call("q8_0_iq2_xxs_ex_dec", dec.q8_0_iq2_xxs_ex_dec, (q8, xq8, xd8, y8, n8, *args, bounds, parts), threads)
        return ys + [y8]
    if plain is not None:
        ys = experts_matmul(qtype, raws, ex, gs, xr, x, threads)
        return ys + [matmul(Q.Q8_0, plain[0], plain[1], threads)]
    if parts == 1 or work < jit.SERIAL_BYTES:
        jit._call(f"{name}_rows", getattr(dec, f"{name}_rows"), (*args, 0, tasks), 1, pool=False)
    else:
        # pieces of equal work, CHUNKS_PER_THREAD a thread, taken by the threads in turn (jit_decode's counter)
        pieces = min(tasks, parts * dec.CHUNKS_PER_THREAD)
        jit._call(f"{name}_dec", getattr(dec, f"{name}_dec"), (*args, _work_bounds(gs, R, mats, pieces), parts), threads)
    return ys


_MANY_EMPTY: dict = {}


def _many_pad(kind: str, arrays: list, k: int) -> tuple:
    """arrays padded to k with an empty array of their numba type (jit_decode's fixed-length tuples)."""
    if kind not in _MANY_EMPTY:
        _MANY_EMPTY.update(q8=jit._readonly(np.zeros((0, 1, 34), np.uint8)),
                           h16=jit._readonly(np.zeros((0, 1), np.uint16)), y=np.zeros((0, 0), F32))
    return tuple(arrays) + (_MANY_EMPTY[kind],) * (k - len(arrays))


def many_supported(q8: int, f16: int, rows: int) -> bool:
    """Whether matmul_many takes q8 Q8_0 and f16 F16 matrices for a step of `rows` token rows (a decode step or
    a short verify: the rows the decode kernels serve; F16 only where jit_decode's f16 kernel is the one
    ds4py.quant.jit.matmul runs)."""
    if rows > DECODE_ROWS or not jit.available():
        return False
    _kernels()
    dec = _tables["dec"]
    return q8 <= dec.MANY_Q8 and f16 <= dec.MANY_F16 and (f16 == 0 or dec.NATIVE_HALF)


class ManyPlan:
    """matmul_many's matrices as its kernels take them (read-only views, the unused places empty), with their
    row counts and bytes a row: made once per set of matrices (Weights.linear_many keeps them)."""

    def __init__(self, q8: list, h16: list, cols: int):
        self.cols, self.nq, self.nh = cols, len(q8), len(h16)
        self.rows = np.array([w.shape[0] for w in q8] + [w.shape[0] for w in h16], np.int64)
        self.rbytes = np.array([w.shape[1] * 34 for w in q8] + [2 * cols] * len(h16), np.int64)
        self.q8, self.h16 = _many_pad("q8", q8, _tables["dec"].MANY_Q8), _many_pad("h16", h16, _tables["dec"].MANY_F16)
        self.total_rows, self.nbytes = int(self.rows.sum()), int(self.rows @ self.rbytes)


def many_plan(q8_raws: list, f16_raws: list, cols: int) -> ManyPlan:
    """The plan of matmul_many for these stored matrices (Q8_0: uint8 [R, cols/32*34], F16: uint8 [R, 2 cols])."""
    _kernels()
    q8 = [jit._readonly(np.ascontiguousarray(r).view(np.uint8).reshape(r.shape[0], cols // 32, 34))
          for r in q8_raws]
    h16 = [jit._readonly(np.ascontiguousarray(r).view(np.uint16).reshape(r.shape[0], cols)) for r in f16_raws]
    return ManyPlan(q8, h16, cols)


def matmul_many(q8_raws: list, f16_raws: list, x: np.ndarray, threads: int = 1) -> tuple[list, list]:
    """x @ W.T for several stored matrices that read one activation x [T, C], in one kernel call: Q8_0 rows
    (uint8 [R, C/32*34]; x quantised once as matmul quantises it) and F16 rows (uint8 [R, 2C]; the fp32 x)
    -> (the Q8_0 products, the F16 products), float32 [T, R] each: matmul's bits, matrix by matrix (the same
    row kernels). The caller checks many_supported first."""
    return many_run(many_plan(q8_raws, f16_raws, x.shape[1]), x, threads)


def many_run(plan: ManyPlan, x: np.ndarray, threads: int = 1) -> tuple[list, list]:
    """matmul_many on a plan's matrices."""
    dec = _tables["dec"]
    x = np.ascontiguousarray(x, dtype=F32)
    T, C = x.shape
    if C != plan.cols:
        raise ValueError(f"an activation of {C} columns for matrices of {plan.cols}")
    yq = [np.empty((T, plan.rows[m]), F32) for m in range(plan.nq)]
    yh = [np.empty((T, plan.rows[plan.nq + m]), F32) for m in range(plan.nh)]
    xq, xd = quant_q8_0(x) if plan.nq else (np.zeros((T, C), np.int8), np.zeros((T, max(1, C // 32)), F32))
    f16 = jit._state["f16"]
    args = (*plan.q8, *_many_pad("y", yq, dec.MANY_Q8), xq, xd)
    parts = max(1, min(threads, plan.total_rows))
    serial = parts == 1 or plan.nbytes < jit.SERIAL_BYTES
    if not plan.nh:
        if serial:
            jit._call("q8_0_many_rows", dec.q8_0_many_rows, (*args, f16, plan.nq, plan.rows, 0, plan.total_rows), 1,
                      pool=False)
        else:
            jit._call("q8_0_many_dec", dec.q8_0_many_dec, (*args, f16, plan.nq, plan.rows, plan.rbytes, parts),
                      threads)
        return yq, yh
    args += (*plan.h16, *_many_pad("y", yh, dec.MANY_F16), x, f16, plan.nq, plan.nh, plan.rows)
    if serial:
        jit._call("mixed_many_rows", dec.mixed_many_rows, (*args, 0, plan.total_rows), 1, pool=False)
    else:
        jit._call("mixed_many_dec", dec.mixed_many_dec, (*args, plan.rbytes, parts), threads)
    return yq, yh
    args += (*_many_pad("h16", h16, dec.MANY_F16), *_many_pad("y", yh, dec.MANY_F16), x, f16, len(q8), len(h16),
             rows)
    if serial:
        jit._call("mixed_many_rows", dec.mixed_many_rows, (*args, 0, int(rows.sum())), 1, pool=False)
    else:
        jit._call("mixed_many_dec", dec.mixed_many_dec, (*args, rbytes, parts), threads)
    return yq, yh
