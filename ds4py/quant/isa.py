"""Which x86 / aarch64 instruction set the compiled CPU kernels are built for (ds4py.quant.jit_decode's AVX2 /
AVX-512 paths and its aarch64 sdot path, ds4py.quant.jit_neon; ds4py.quant.jit_q8_0_vnni), and how to build them
for a smaller one than the host's.

numba compiles for the host CPU and its features, unless $NUMBA_CPU_NAME (another CPU: a cross-target build,
the portable IR) or $NUMBA_CPU_FEATURES (an LLVM feature string, "+avx2,-avx512f,...") says otherwise. The kernels
choose their ISA path from the same features LLVM compiles with (`target_features`), so a feature string without
AVX-512 gives the AVX2 path on an AVX-512 host: how the laptop case (AVX2 + FMA, no AVX-512) is built and measured
here. numba's disk cache keys compiled code on the CPU name and feature string, so each level keeps its own cache.

`numba_env(level)` gives the environment for a level, to set before numba is imported (a bench's --isa):
- native: the host's (nothing set): on aarch64, the sdot path where LLVM sees the dot-product extension;
- avx2: the host's features without AVX-512, AVX10, AMX, AVX-VNNI, GFNI, VAES, VPCLMULQDQ (Haswell .. Zen 3, most
  laptops);
- neon: aarch64 with the dot-product extension (the sdot path) on a host whose kernel says it has it (AT_HWCAP)
  where LLVM's own detection, from /proc/cpuinfo, does not see it (qemu-aarch64 shows the host's x86 cpuinfo);
- portable: NUMBA_CPU_NAME=generic (LLVM's portable IR, as on an unknown CPU; on aarch64 plain NEON, no sdot).
"""

from __future__ import annotations

LEVELS = ("native", "avx2", "neon", "portable")
# feature-name prefixes an AVX2 laptop (Haswell .. Zen 3) lacks
_ABOVE_AVX2 = ("avx512", "avx10", "amx", "avxvnni", "avxifma", "avxneconvert", "evex512", "gfni", "vaes",
               "vpclmulqdq")


def target_features() -> dict[str, bool]:
    """The CPU features numba's LLVM compiles for: $NUMBA_CPU_FEATURES where set, none for a cross-target build
    ($NUMBA_CPU_NAME alone: the portable IR), else the host's ({} where the platform does not say)."""
    import numba

    if numba.config.CPU_FEATURES:
        return {f[1:]: f[0] == "+" for f in numba.config.CPU_FEATURES.split(",") if f[:1] in "+-" and f[1:]}
    if numba.config.CPU_NAME:
        return {}
    return _host_features()


def _host_features() -> dict[str, bool]:
    from llvmlite import binding

    try:
        return {k: bool(v) for k, v in binding.get_host_cpu_features().items()}
    except RuntimeError:                     # features unknown on this platform
        return {}


def aarch64_dotprod() -> bool:
    """Whether this is an aarch64 Linux host whose kernel reports the dot-product instructions (AT_HWCAP's ASIMDDP
    bit, what /proc/cpuinfo's "asimddp" shows; qemu-aarch64 sets it for the CPU it emulates)."""
    import ctypes
    import platform

    if platform.machine().lower() not in ("aarch64", "arm64"):
        return False
    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return False
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    return bool(getauxval(16) & (1 << 20))               # AT_HWCAP = 16, HWCAP_ASIMDDP = 1 << 20


def numba_env(level: str) -> dict[str, str]:
    """The environment variables that build the kernels for `level` (LEVELS) on this host; ValueError with one
    sentence where the level is unknown or this host cannot run it."""
    if level == "native":
        return {}
    if level == "portable":
        return {"NUMBA_CPU_NAME": "generic"}
    if level == "neon":
        if not aarch64_dotprod():
            raise ValueError("--isa neon needs an aarch64 host with the dot-product extension (asimddp); "
                             "this one has neither or does not say")
        feats = {**_host_features(), "neon": True, "dotprod": True}
        return {"NUMBA_CPU_FEATURES": ",".join(("+" if v else "-") + k for k, v in sorted(feats.items()))}
    if level != "avx2":
        raise ValueError(f"unknown ISA level {level!r}: choose one of {', '.join(LEVELS)}")
    host = _host_features()
    if not (host.get("avx2") and host.get("fma")):
        raise ValueError("--isa avx2 needs an x86-64 host with AVX2 and FMA; this one has neither or does not say")
    feats = {k: v and not k.startswith(_ABOVE_AVX2) for k, v in host.items()}
    return {"NUMBA_CPU_FEATURES": ",".join(("+" if v else "-") + k for k, v in sorted(feats.items()))}
