"""cu/fill.cu's splitmix64 stream on the host, in numpy (uint64 arithmetic wraps like the device's): the twin of
cu/fill.cu (ds4py/cuda/twins/fill.py re-exports it) and what `ds4py doctor`'s smoke check compares the device with."""

from __future__ import annotations

import numpy as np

U64 = np.uint64
_M = [U64(0x9E3779B97F4A7C15), U64(0xBF58476D1CE4E5B9), U64(0x94D049BB133111EB)]


def mix(seed: int, i: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = U64(seed & (2**64 - 1)) + (np.asarray(i, U64) + U64(1)) * _M[0]
        z = (z ^ (z >> U64(30))) * _M[1]
        z = (z ^ (z >> U64(27))) * _M[2]
        return z ^ (z >> U64(31))


def unit(seed: int, i: np.ndarray) -> np.ndarray:
    return (mix(seed, i) >> U64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)


def random_u32(n: int, seed: int) -> np.ndarray:
    return (mix(seed, np.arange(n)) >> U64(32)).astype(np.uint32)


def uniform(n: int, lo: float, hi: float, seed: int, dtype) -> np.ndarray:
    v = np.float32(lo) + (np.float32(hi) - np.float32(lo)) * unit(seed, np.arange(n))
    return v.astype(dtype)


def i32_rows(n: int, k: int, mod: int, seed: int) -> np.ndarray:
    i = np.arange(n, dtype=np.uint64)
    return ((mix(seed, i // U64(k)) % U64(mod) + i % U64(k)) % U64(mod)).astype(np.int32)


def block_fields(raw: np.ndarray, block_bytes: int, f16_at: tuple[int, ...], scale: float, e8m0_at: int,
                 e8m0_range: tuple[int, int], seed: int) -> np.ndarray:
    out = np.array(raw, np.uint8).reshape(-1, block_bytes)
    b = np.arange(out.shape[0])
    for k, off in enumerate(f16_at):
        h = (np.float32(scale) * (np.float32(0.5) + np.float32(0.5) * unit(seed, 2 * b + k))).astype(np.float16)
        out[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    if e8m0_at >= 0:
        lo, hi = e8m0_range
        out[:, e8m0_at] = (lo + mix(seed ^ 0x5bd1e995, b) % U64(hi - lo + 1)).astype(np.uint8)
    return out.reshape(-1)
