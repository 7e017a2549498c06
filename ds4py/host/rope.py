"""RoPE frequencies (MODEL.md §2): host math both backends use (the reference rotates with them, the CUDA engine
uploads them once per layer), so neither backend imports the other for it."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

F32 = np.float32


@lru_cache(maxsize=16)
def rope_freqs(rd: int, base: float, factor: float = 1.0, orig_ctx: int = 0,
               beta_fast: float = 32.0, beta_slow: float = 1.0, v41: bool = False) -> np.ndarray:
    """Per-pair frequencies f_i = base^(-2i/rd); with orig_ctx > 0 the YaRN ramp divides the low ones by factor.
    v41: the V4.1 code's form of the same ramp (span floored at 1e-3 instead of nudged when low == high, and
    the blend written through smooth = 1 - ramp), bit for bit."""
    freqs = (F32(1.0) / (F32(base) ** (np.arange(0, rd, 2, dtype=F32) / F32(rd)))).astype(F32)
    if orig_ctx > 0:
        def corr_dim(rot: float) -> float:
            return rd * math.log(orig_ctx / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr_dim(beta_fast)), 0)
        high = min(math.ceil(corr_dim(beta_slow)), rd - 1)
        if v41:
            ramp = np.clip((np.arange(rd // 2, dtype=F32) - low) / F32(max(high - low, 1e-3)), 0, 1).astype(F32)
            smooth = (1 - ramp).astype(F32)
            return (freqs / F32(factor) * (1 - smooth) + freqs * smooth).astype(F32)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rd // 2, dtype=F32) - low) / F32(high - low), 0, 1).astype(F32)
        freqs = (freqs / F32(factor) * ramp + freqs * (1 - ramp)).astype(F32)
    return freqs


def layer_rope_freqs(cfg, layer: int) -> np.ndarray:
    """Window-only (ratio-0) layers: base theta, no YaRN. Compressed layers: compress theta with YaRN whenever
    an original context is given (the official precompute does not compare it with the context length)."""
    if not cfg.is_compressed(layer):
        return rope_freqs(cfg.rope_dim, cfg.rope_base)
    if cfg.is_v41:
        return rope_freqs(cfg.rope_dim, cfg.compress_rope_base, cfg.rope_factor, cfg.rope_orig_ctx, cfg.beta_fast,
                          cfg.beta_slow, True)
    return rope_freqs(cfg.rope_dim, cfg.compress_rope_base, cfg.rope_factor, cfg.rope_orig_ctx, cfg.beta_fast,
                      cfg.beta_slow)
