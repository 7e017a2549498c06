"""numpy twins of cu/attention.cu: the decode step's kv store and attention, with ds4py/ref/ops.py doing the math.

Each twin returns the value and, where the kernel's fp32 rounding differs from the reference's, a per-element
magnitude for `assert_close_scaled` (the sum of the |terms| whose rounding errors add up). Fake-quantised values
are compared with `assert_fake_quant_close` (an element whose pre-quantisation value sits on a rounding boundary
may land on either neighbour).
"""

from __future__ import annotations

import numpy as np

from ds4py.ref import ops

F32 = np.float32
EPS32 = float(np.finfo(np.float32).eps)


def rope_tail_mag(mag: np.ndarray, rd: int) -> np.ndarray:
    """Magnitude after a rotation of the last rd dims: each output mixes its pair, so |x0| + |x1| bounds it."""
    out = np.array(mag, np.float64, copy=True)
    if rd:
        pair = mag[..., -rd:].reshape(*mag.shape[:-1], rd // 2, 2).sum(-1)
        out[..., -rd:] = np.repeat(pair, 2, axis=-1)
    return out


def kv_row(kv_raw: np.ndarray, norm_w: np.ndarray, freqs: np.ndarray, pos: int, rd: int, eps: float,
           fake_quant: bool, round_f16: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, pre-quant row, magnitude of the pre-quant row): RMSNorm, RoPE at pos, FP8 on the non-rope dims."""
    hd = kv_raw.shape[-1]
    x = ops.rmsnorm(kv_raw[None].astype(F32), norm_w, eps)
    pre = ops.rope_tail(x, np.array([pos]), freqs)[0]
    mag = rope_tail_mag(np.abs(x[0]).astype(np.float64), rd)
    row = pre.copy()
    if fake_quant:
        row[: hd - rd] = ops.fp8_fake_quant(pre[None, : hd - rd], 64)[0]
    if round_f16:
        row = ops.f16_round(row)
    return row, pre, mag


def window_keys(win: np.ndarray, ring: int, window: int, pos: int) -> np.ndarray:
    """The window rows a query at pos attends to, oldest first."""
    first = max(0, pos - window + 1)
    return win[np.arange(first, pos + 1) % ring]


def decode_keys(win: np.ndarray, ring: int, window: int, pos: int, comp: np.ndarray | None, ratio: int,
                sel: np.ndarray | None, topk: int) -> np.ndarray:
    """Window rows then compressed rows (all visible, or the selected ones; a selection entry -1, V4.1's dropped
    pick, is no key), as attn_decode_partial reads them."""
    keys = [window_keys(win, ring, window, pos)]
    if ratio:
        n = (pos + 1) // ratio
        if sel is not None:
            picks = np.asarray(sel[: min(n, topk)], np.int64)
            keys.append(comp[picks[picks >= 0]])
        else:
            keys.append(comp[:n])
    return np.concatenate(keys).astype(F32)


def decode_attention(q_raw: np.ndarray, keys: np.ndarray, sinks: np.ndarray, freqs: np.ndarray, pos: int,
                     n_heads: int, rd: int, eps: float, scale: float,
                     q_norm: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(out [H, hd], magnitude): per-head RMS (q_norm; V4.1 has none) + RoPE of q, attention with sink over
    `keys`, inverse RoPE."""
    hd = keys.shape[1]
    p = np.array([pos])
    q = q_raw.reshape(1, n_heads, hd).astype(F32)
    q = ops.rope_tail(ops.rmsnorm(q, None, eps) if q_norm else q, p, freqs)
    mask = np.ones((1, keys.shape[0]), bool)
    o = ops.attention_with_sink(q, keys, mask, sinks.astype(F32), scale)
    out = ops.rope_tail(o, p, freqs, inverse=True)[0]
    # magnitude: the weighted |v| sum, inflated by the score error (|q||k| terms, and |s| through exp)
    q64, k64 = q[0].astype(np.float64), keys.astype(np.float64)
    s = (q64 @ k64.T) * scale
    m = s.max(1, keepdims=True)
    w = np.exp(s - m)
    L = w.sum(1) + np.exp(sinks.astype(np.float64) - m[:, 0])
    sterm = (np.abs(q64) @ np.abs(k64).T) * scale + np.abs(s)
    spread = 1.0 + (w * sterm).sum(1) / np.maximum(w.sum(1), 1e-300)
    mag = (w @ np.abs(k64)) / L[:, None] * (spread[:, None] + 1.0)
    return out, rope_tail_mag(mag, rd)


def _grid_round(y: np.ndarray, kind: str) -> np.ndarray:
    return ops.round_e4m3(np.clip(y, -448, 448)) if kind == "fp8" else ops.round_e2m1(np.clip(y, -6, 6))


def assert_fake_quant_close(got: np.ndarray, pre: np.ndarray, tol: np.ndarray, kind: str, block: int,
                            what: str = "") -> None:
    """got must be the fake-quantisation of some value within tol of pre, elementwise, with the block scale taken
    from pre's block max (or the max within tol of it). Rounding is monotone, so the allowed set of an element is
    [q(pre - tol), q(pre + tol)]: exact everywhere but at rounding boundaries."""
    inv_max, floor = (1.0 / 448.0, 1e-4) if kind == "fp8" else (1.0 / 6.0, 6 * 2.0 ** -126)
    got = np.asarray(got, F32).reshape(-1, block)
    pre = np.asarray(pre, np.float64).reshape(-1, block)
    tol = np.broadcast_to(np.asarray(tol, np.float64).reshape(-1), pre.size).reshape(pre.shape)
    ok = np.zeros(got.shape, bool)
    amax = np.abs(pre).max(1)
    for a in (np.abs(pre) - tol).clip(0).max(1), amax, (np.abs(pre) + tol).max(1):
        s = ops.pow2_scale(np.maximum(a.astype(F32), F32(floor)), inv_max)[:, None].astype(np.float64)
        lo = _grid_round(((pre - tol) / s).astype(F32), kind) * s
        hi = _grid_round(((pre + tol) / s).astype(F32), kind) * s
        ok |= (got >= np.minimum(lo, hi)) & (got <= np.maximum(lo, hi))
    if not ok.all():
        i = int(np.flatnonzero(~ok.reshape(-1))[0])
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.size} fake-quantised values off; first at {i}: "
                             f"got {got.reshape(-1)[i]!r} from pre-quant {pre.reshape(-1)[i]!r} (tol "
                             f"{tol.reshape(-1)[i]:.3g})")
