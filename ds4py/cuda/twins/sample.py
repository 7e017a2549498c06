"""Twin of cu/sample.cu. The distribution and the kept set are the CPU sampler's (ds4py.sampling); what is the
kernel's own is its random stream (Philox4x32-10 keyed by the seed, counting positions) and its fixed-point draw,
reproduced here so that a draw whose masses are exact can be checked token for token."""

from __future__ import annotations

import numpy as np

from ds4py.sampling import Sampler, SamplingParams

_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _U32, (k1 + _W1) & _U32
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _U32, p1 & _U32, ((p0 >> 32) ^ c3 ^ k1) & _U32, p0 & _U32
    return c0, c1, c2, c3


def philox_u64(seed: int, position: int) -> int:
    """The 64 uniform bits the kernel draws for (seed, position)."""
    w = philox4x32_10((position & _U32, (position >> 32) & _U32, 0, 0), (seed & _U32, (seed >> 32) & _U32))
    return w[0] | (w[1] << 32)


def params(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=0)


def distribution(logits: np.ndarray, prm: SamplingParams) -> np.ndarray:
    """The CPU sampler's final probabilities (float64, sums to 1)."""
    return Sampler(prm).distribution(np.asarray(logits, np.float32))


def kept(logits: np.ndarray, prm: SamplingParams) -> np.ndarray:
    """The tokens the CPU sampler can draw (bool mask)."""
    return distribution(logits, prm) > 0


def masses(logits: np.ndarray, temperature: float) -> np.ndarray:
    """The kernel's fixed-point masses floor(exp((l - max) / T) * 2^32) (float32 exp, as on the device)."""
    l = np.asarray(logits, np.float32)
    p = np.exp((l - l.max()) * np.float32(1.0 / np.float32(temperature)), dtype=np.float32)
    return np.floor(p.astype(np.float64) * 2.0**32).astype(np.uint64)


def draw(logits: np.ndarray, keep: np.ndarray, temperature: float, seed: int, position: int, threads: int) -> int:
    """The token the kernel picks given its kept mask: target = floor(u * Z / 2^64), walked in the kernel's order
    (threads from the highest down, each over its indices t, t + threads, ... ascending)."""
    w = np.where(keep, masses(logits, temperature), np.uint64(0))
    n = len(w)
    order = [i for t in range(threads - 1, -1, -1) for i in range(t, n, threads)]
    z = int(w.sum(dtype=np.uint64))
    target = (z * philox_u64(seed, position)) >> 64
    run = 0
    for i in order:
        run += int(w[i])
        if run > target:
            return i
    raise AssertionError("the draw ran past the kept mass")
