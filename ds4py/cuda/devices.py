"""The GPUs ds4py is built for, as data with sources, and the launch rules they enforce.

    from ds4py.cuda.devices import PROFILES, profile, occupancy, check_launch
    gb10 = profile("gb10")
    occ = occupancy(gb10, threads=256, registers=96, smem=40_000)     # blocks per SM and what limits them
    check_launch(gb10, "moe_down_vq13", grid, block, smem, resources)  # raises LaunchRefused naming the limit
    default_numerics(profile("h200"))       # the activations the CLI runs there unless told, and why (issue 34)

Every number is sourced in docs/cuda.md ("Device profiles"). Per-arch limits (threads, warps, blocks and registers
per SM, register allocation, shared memory per SM and per block, the 1 KB the driver reserves per block) are the
CUDA C++ Programming Guide's "Technical Specifications per Compute Capability" table (compute capability 9.0 and
12.x); per-part numbers (SM count, L2, bandwidth) come from the part's datasheet / whitepaper, and the measured
copy bandwidths from the project's measurements (bench/device_check.sh's copy_gbps replaces them on first contact).

The occupancy rule is the CUDA occupancy calculator's: registers are allocated per warp in units of 256
(registers per thread rounded up to a multiple of 8), warps in groups of 4 (one per SM sub-partition); shared memory
per block is rounded up to 128 B and costs 1 KB more (reserved by the driver); a block of more registers or shared
memory than one SM holds cannot launch at all (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES / INVALID_VALUE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ds4py.cuda.args import KernelArgumentError

WARP = 32


class LaunchRefused(KernelArgumentError):
    """A launch the device would refuse (shared memory, threads, registers, grid): names kernel, device, limit."""


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU's launch limits and speeds. Arch-level fields default to the CUDA Programming Guide's values shared
    by compute capability 9.0 and 12.x; the rest are per part."""
    key: str                          # "gb10", "h200"
    name: str
    cc: tuple[int, int]
    sm_count: int
    threads_per_sm: int               # resident threads per SM (64 warps on 9.0, 48 on 12.x)
    smem_per_sm: int                  # shared memory per SM, bytes (the carve-out maximum)
    smem_per_block_optin: int         # static + dynamic shared memory per block with the opt-in attribute
    l2_bytes: int
    copy_gbps: float                  # measured device-to-device copy bandwidth, GB/s (1e9 B/s)
    nominal_gbps: float               # the datasheet's memory bandwidth, GB/s
    total_mem: int                    # bytes of device memory (GB10: the unified LPDDR5x)
    max_blocks_per_sm: int = 32
    regs_per_sm: int = 65536          # 32-bit registers
    regs_per_block: int = 65536
    max_regs_per_thread: int = 255
    reg_alloc_unit: int = 256         # registers, allocated per warp
    warp_alloc_granularity: int = 4   # warps (one per SM sub-partition)
    smem_alloc_unit: int = 128        # bytes
    smem_reserved_per_block: int = 1024   # bytes the driver keeps per block (CU_DEVICE_ATTRIBUTE_RESERVED_...)
    max_threads_per_block: int = 1024
    max_block: tuple[int, int, int] = (1024, 1024, 64)
    max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    ordinal: int = 0
    names: tuple[str, ...] = ()       # what the driver calls this part (cuDeviceGetName): a GPU of another name
                                      # borrows the profile's limits and speeds, never its declared numerics
    decode_target: tuple[str, float] | None = None   # the V4 Flash q2 decode target: ("copy" | "roofline", fraction)
    act_numerics: str | None = None   # the activations the CLI runs here unless told (ACT_NUMERICS; None: fp32,
                                      # undeclared): "exact" iff fp32 meets decode_target in the model, else "int8"

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    @property
    def warps_per_sm(self) -> int:
        return self.threads_per_sm // WARP

    def describe(self) -> str:
        return f"{self.key} ({self.arch}, {self.sm_count} SMs)"


# Sources: docs/cuda.md "Device profiles" (one line per number there).
GB10 = DeviceProfile(
    key="gb10", name="NVIDIA GB10 (DGX Spark)", cc=(12, 1),
    sm_count=48,                      # 6,144 CUDA cores / 128 per SM (DGX Spark datasheet; deviceQuery: 48)
    threads_per_sm=1536,              # CC 12.x: 48 resident warps per SM
    smem_per_sm=102400,               # CC 12.x: 100 KB of shared memory per SM
    smem_per_block_optin=101376,      # CC 12.x: 99 KB per block (100 KB less the 1 KB reserved)
    l2_bytes=24 << 20,                # 24 MB L2 (GB10)
    copy_gbps=230.0,                  # measured device copy on a DGX Spark (~230 GB/s)
    nominal_gbps=273.0,               # LPDDR5x-8533, 256-bit: 273 GB/s (DGX Spark datasheet)
    total_mem=128 << 30,              # 128 GB unified memory
    names=("NVIDIA GB10",),
    decode_target=("copy", 0.90),     # issue 34: V4 Flash q2 decode at >= 90% of the copy bandwidth
    act_numerics="exact")             # modelled (bench gpu-model, v4-flash-q2, 2K): fp32 96.0% of copy: meets
H200 = DeviceProfile(
    key="h200", name="NVIDIA H200 (SXM)", cc=(9, 0),
    sm_count=132,                     # GH100 as shipped in H100 / H200 SXM: 132 SMs (Hopper whitepaper)
    threads_per_sm=2048,              # CC 9.0: 64 resident warps per SM
    smem_per_sm=233472,               # CC 9.0: 228 KB of shared memory per SM
    smem_per_block_optin=232448,      # CC 9.0: 227 KB per block
    l2_bytes=50 << 20,                # 50 MB L2 (Hopper whitepaper)
    copy_gbps=4300.0,                 # ~90% of nominal, what a device copy reaches on HBM3e (to be measured)
    nominal_gbps=4800.0,              # 4.8 TB/s HBM3e (H200 datasheet)
    total_mem=141 << 30,              # 141 GB HBM3e
    names=("NVIDIA H200",),
    decode_target=("roofline", 0.50),  # issue 34: V4 Flash q2 decode at >= 50% of the bandwidth roofline (nominal)
    act_numerics="int8")              # modelled (bench gpu-model, v4-flash-q2, 2K): fp32 37.0% misses, int8 50.8%
PROFILES: dict[str, DeviceProfile] = {p.key: p for p in (GB10, H200)}

# ---- the default activation numerics (issue 34) ------------------------------------------------------------------
ACT_NUMERICS = ("exact", "int8")      # fp32 activations (Numerics()); int8 (Numerics.ds4(), the reference's
                                      # --act-quant mode)
TARGET_SHAPES, TARGET_CTX = "v4-flash-q2", 2048     # the decode step the targets are modelled on


@dataclass(frozen=True)
class DefaultNumerics:
    """The activation numerics a device runs when the caller leaves the choice to it, and why (one clause)."""
    act_quant: bool
    why: str


def default_numerics(p: DeviceProfile | None, emulated: bool = False) -> DefaultNumerics:
    """A device's declared default (docs/cuda.md "Activation numerics"): int8 activations where the profile
    declares them (fp32 misses its decode target in the model), else fp32: declared (fp32 meets it), or the default
    of a device no profile declares (None, or a profile without act_numerics) and of the emulator's own device."""
    where = "the emulated device's" if emulated else "this device's"
    if emulated and (p is None or p.act_numerics is None):
        return DefaultNumerics(False, "the emulator's default (no device named: $DS4PY_EMU_DEVICE names one)")
    if p is None or p.act_numerics is None:
        return DefaultNumerics(False, f"the default of a device no profile declares ({p.name if p else 'unknown'})")
    if p.act_numerics not in ACT_NUMERICS:
        raise KernelArgumentError(f"device profile {p.key}: act_numerics must be one of {', '.join(ACT_NUMERICS)}, "
                                  f"got {p.act_numerics!r}")
    if p.act_numerics == "int8":
        return DefaultNumerics(True, f"{where} default ({p.name}: fp32 misses the bandwidth target here)")
    return DefaultNumerics(False, f"{where} default ({p.name}: fp32 meets the bandwidth target here)")


def profile(key: str | DeviceProfile) -> DeviceProfile:
    """The profile named `key` ("gb10", "h200"); one sentence naming the known ones otherwise."""
    if isinstance(key, DeviceProfile):
        return key
    p = PROFILES.get(str(key).lower())
    if p is None:
        raise KernelArgumentError(f"unknown device profile {key!r}; known: {', '.join(PROFILES)}")
    return p


def profile_for_device(dev: Any) -> DeviceProfile:
    """A profile for an opened GPU (driver.Device): its own SM count, shared memory, threads per SM and L2, the
    arch-level limits of its compute capability, the bandwidths of the named profile of the same arch (if any);
    that profile's declared numerics only when the GPU is that part (its name in `names`)."""
    like = next((p for p in PROFILES.values() if p.cc[0] == dev.cc[0]), H200)
    declared = like.act_numerics if dev.name in like.names else None     # the part itself, not its arch
    smem_sm = int(dev.smem_per_sm or 0) or int(dev.smem_per_block_optin) + like.smem_reserved_per_block
    return replace(like, key=f"gpu{dev.ordinal}", name=dev.name, cc=tuple(dev.cc), sm_count=int(dev.sm_count),
                   threads_per_sm=int(dev.threads_per_sm), smem_per_sm=smem_sm,
                   smem_per_block_optin=int(dev.smem_per_block_optin), l2_bytes=int(dev.l2_bytes),
                   total_mem=int(dev.total_mem), ordinal=int(dev.ordinal), act_numerics=declared)


# ---- occupancy ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int                # 0: the block cannot be resident at all (the launch is refused)
    limiter: str                      # "threads", "registers", "shared memory", "blocks" (the per-SM block cap)
    warps_per_block: int
    by: dict                          # blocks per SM each resource allows

    @property
    def warps_per_sm(self) -> int:
        return self.blocks_per_sm * self.warps_per_block


def regs_per_warp(p: DeviceProfile, registers: int) -> int:
    """Registers one warp takes: per thread rounded up so that a warp's are a multiple of the allocation unit."""
    return math.ceil(max(1, registers) * WARP / p.reg_alloc_unit) * p.reg_alloc_unit


def smem_per_block(p: DeviceProfile, smem: int) -> int:
    """Shared memory one resident block takes from its SM: rounded to the allocation unit, plus the reserve."""
    return math.ceil(smem / p.smem_alloc_unit) * p.smem_alloc_unit + p.smem_reserved_per_block


def occupancy(p: DeviceProfile, threads: int, registers: int, smem: int) -> Occupancy:
    """Blocks of `threads` threads, `registers` per thread and `smem` bytes of shared memory (static + dynamic)
    resident on one SM, and the resource that limits them (ties: the first of threads, registers, shared memory)."""
    wpb = max(1, math.ceil(threads / WARP))
    warps_by_regs = p.regs_per_sm // regs_per_warp(p, registers)
    warps_by_regs -= warps_by_regs % p.warp_alloc_granularity
    by = {"threads": p.warps_per_sm // wpb,
          "registers": warps_by_regs // wpb if wpb * regs_per_warp(p, registers) <= p.regs_per_block else 0,
          "shared memory": p.smem_per_sm // smem_per_block(p, smem) if smem <= p.smem_per_block_optin else 0,
          "blocks": p.max_blocks_per_sm}
    limiter = min(by, key=lambda k: (by[k], list(by).index(k)))
    return Occupancy(by[limiter], limiter, wpb, by)


def waves(p: DeviceProfile, blocks: int, blocks_per_sm: int) -> float:
    """Grid blocks over what the whole device holds at once (1.0: exactly one full wave)."""
    return blocks / max(1, p.sm_count * blocks_per_sm)


# ---- the launch check ----------------------------------------------------------------------------------------------
def dims(d: Any, what: str) -> tuple[int, int, int]:
    t = (d,) if isinstance(d, int) else tuple(d)
    if not 1 <= len(t) <= 3 or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in t):
        raise KernelArgumentError(f"{what} must be 1 to 3 positive integers, got {d!r}")
    return (t + (1, 1))[:3]


@dataclass(frozen=True)
class LaunchCheck:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    occupancy: Occupancy
    waves: float
    problem: str | None               # why the device refuses it (None: it launches)


def inspect_launch(p: DeviceProfile, kernel: str, grid: Any, block: Any, smem: int, registers: int = 0,
                   static_smem: int = 0, max_threads: int = 1024) -> LaunchCheck:
    """The launch against the profile: geometry, occupancy, waves, and the first limit it breaks (or None).
    registers: per thread from the ptxas report (0: unknown, not checked); static_smem: the kernel's __shared__
    bytes; max_threads: the kernel's own limit (__launch_bounds__)."""
    g, b = dims(grid, f"{kernel}: grid"), dims(block, f"{kernel}: block")
    threads = b[0] * b[1] * b[2]
    total_smem = int(smem) + int(static_smem)
    occ = occupancy(p, threads, registers, total_smem)
    where = f"{kernel} on {p.describe()}"
    problem = None
    if smem < 0:
        problem = f"{where}: negative dynamic shared memory ({smem})"
    elif total_smem > p.smem_per_block_optin:
        problem = (f"{where}: {total_smem:,} B of shared memory per block ({smem:,} dynamic + {static_smem:,} "
                   f"static) exceeds the device's {p.smem_per_block_optin:,} B per block")
    elif threads > min(max_threads, p.max_threads_per_block):
        problem = (f"{where}: {threads} threads per block exceeds "
                   + (f"the kernel's limit of {max_threads}" if max_threads < p.max_threads_per_block
                      else f"the device's {p.max_threads_per_block}"))
    elif any(x > m for x, m in zip(b, p.max_block)):
        problem = f"{where}: block {b} exceeds the device's {p.max_block}"
    elif any(x > m for x, m in zip(g, p.max_grid)):
        problem = f"{where}: grid {g} exceeds the device's {p.max_grid}"
    elif registers > p.max_regs_per_thread:
        problem = f"{where}: {registers} registers per thread exceeds the device's {p.max_regs_per_thread}"
    elif registers and occ.by["registers"] == 0:
        problem = (f"{where}: {registers} registers x {threads} threads ({occ.warps_per_block} warps x "
                   f"{regs_per_warp(p, registers)} registers) exceeds the {p.regs_per_sm:,} registers of an SM")
    blocks = g[0] * g[1] * g[2]
    return LaunchCheck(g, b, occ, waves(p, blocks, occ.blocks_per_sm), problem)


def check_launch(p: DeviceProfile, kernel: str, grid: Any, block: Any, smem: int, registers: int = 0,
                 static_smem: int = 0, max_threads: int = 1024) -> LaunchCheck:
    """inspect_launch, raising LaunchRefused (one sentence: kernel, device, the limit) for a refused launch."""
    c = inspect_launch(p, kernel, grid, block, smem, registers, static_smem, max_threads)
    if c.problem is not None:
        raise LaunchRefused(c.problem)
    return c
