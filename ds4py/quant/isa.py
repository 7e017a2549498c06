"""Which x86 / aarch64 instruction set the compiled CPU kernels are built for (ds4py.quant.jit_decode's AVX2 /
AVX-512 paths, ds4py.quant.jit_q8_0_vnni), and how to build them for a smaller one than the host's.

numba compiles for the host CPU and its features, unless $NUMBA_CPU_NAME (another CPU: a cross-target build,
the portable IR) or $NUMBA_CPU_FEATURES (an LLVM feature string, "+avx2,-avx512f,...") says otherwise. The kernels
choose their ISA path from the same features LLVM compiles with (`target_features`), so a feature string without
AVX-512 gives the AVX2 path on an AVX-512 host: how the laptop case (AVX2 + FMA, no AVX-512) is built and measured
here. numba's disk cache keys compiled code on the CPU name and feature string, so each level keeps its own cache.

`numba_env(level)` gives the environment for a level, to set before numba is imported (a bench's --isa):
- native: the host's (nothing set);
- avx2: the host's features without AVX-512, AVX10, AMX, AVX-VNNI, GFNI, VAES, VPCLMULQDQ (Haswell .. Zen 3, most
  laptops);
- portable: NUMBA_CPU_NAME=generic (LLVM's portable IR, as on an unknown CPU).
"""

from __future__ import annotations

LEVELS = ("native", "avx2", "portable")
# feature-name prefixes an AVX2 laptop (Haswell .. Zen 3) lacks
_ABOVE_AVX2 = ("avx512", "avx10", "amx", "avxvnni", "avxifma", "avxneconvert", "evex512", "gfni", "vaes",
               "vpclmulqdq")


def target_features() -> dict[str, bool]:
    """The CPU features numba's LLVM compiles for: $NUMBA_CPU_FEATURES where set, none for a cross-target build
    ($NUMBA_CPU_NAME alone: the portable IR), else the host's ({} where the platform does not say)."""
    import numba
    from llvmlite import binding

    if numba.config.CPU_FEATURES:
        return {f[1:]: f[0] == "+" for f in numba.config.CPU_FEATURES.split(",") if f[:1] in "+-" and f[1:]}
    if numba.config.CPU_NAME:
        return {}
    try:
        return {k: bool(v) for k, v in binding.get_host_cpu_features().items()}
    except RuntimeError:                     # features unknown on this platform
        return {}


def numba_env(level: str) -> dict[str, str]:
    """The environment variables that build the kernels for `level` (LEVELS) on this host; ValueError with one
    sentence where the level is unknown or this host cannot run it."""
    from llvmlite import binding

    if level == "native":
        return {}
    if level == "portable":
        return {"NUMBA_CPU_NAME": "generic"}
    if level != "avx2":
        raise ValueError(f"unknown ISA level {level!r}: choose one of {', '.join(LEVELS)}")
    try:
        host = {k: bool(v) for k, v in binding.get_host_cpu_features().items()}
    except RuntimeError:
        host = {}
    if not (host.get("avx2") and host.get("fma")):
        raise ValueError("--isa avx2 needs an x86-64 host with AVX2 and FMA; this one has neither or does not say")
    feats = {k: v and not k.startswith(_ABOVE_AVX2) for k, v in host.items()}
    return {"NUMBA_CPU_FEATURES": ",".join(("+" if v else "-") + k for k, v in sorted(feats.items()))}
