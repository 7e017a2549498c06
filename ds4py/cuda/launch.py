"""Kernel registry and launches.

Each cu/*.cu becomes one module (cuModuleLoadData on its cubin); every `extern "C" __global__` kernel's handle is
looked up once (cuModuleGetFunction) and kept with the signature parsed from its source. `launch` checks the
arguments and the geometry, then calls cuLaunchKernelEx, with programmatic dependent launch (PDL) when asked:
the kernel may then start while the previous kernel in the stream is still running, and its `pdl_wait()` waits
for that kernel's memory to be visible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ds4py.cuda.args import KernelArgumentError, pack_args
from ds4py.cuda.compiler import CU_DIR, CompiledModule, KernelResources, check_driver_version, compile_all
from ds4py.cuda.devices import DeviceProfile, check_launch
from ds4py.cuda.driver import CudaError, api, call
from ds4py.cuda.signature import Param

STATIC_SMEM_LIMIT = 48 * 1024   # dynamic shared memory above this needs cuFuncSetAttribute


Dim = int | tuple[int, ...]


def dim3(d: Dim, what: str) -> tuple[int, int, int]:
    t = (d,) if isinstance(d, int) else tuple(d)
    if not 1 <= len(t) <= 3 or any(not isinstance(x, int) or x < 1 for x in t):
        raise KernelArgumentError(f"{what} must be 1 to 3 positive integers, got {d!r}")
    return (t + (1, 1))[:3]


def check_geometry(kernel: str, grid: Dim, block: Dim, smem: int, max_threads: int, max_smem: int,
                   static_smem: int = 0, registers: int = 0,
                   profile: DeviceProfile | None = None) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Reject a launch the driver would refuse (or that breaks the kernels' warp assumptions) with a clear error.
    max_threads: the kernel's limit (registers and __launch_bounds__ included); max_smem: the device's shared
    memory per block (opt-in); static_smem: the kernel's own __shared__ bytes, which count against it too.
    profile: the device's DeviceProfile (ds4py/cuda/devices.py): the launch is also checked against its per-SM
    limits with `registers` per thread (the ptxas report; 0: unknown), LaunchRefused naming the limit."""
    g, b = dim3(grid, f"{kernel}: grid"), dim3(block, f"{kernel}: block")
    threads = b[0] * b[1] * b[2]
    if threads > max_threads:
        raise KernelArgumentError(f"{kernel}: {threads} threads per block exceeds this kernel's limit of {max_threads}")
    if b[0] > 1024 or b[1] > 1024 or b[2] > 64:
        raise KernelArgumentError(f"{kernel}: block {b} exceeds the device limits (1024, 1024, 64)")
    if g[0] >= 2**31 or g[1] > 65535 or g[2] > 65535:
        raise KernelArgumentError(f"{kernel}: grid {g} exceeds the device limits")
    if smem < 0 or smem + static_smem > max_smem:
        raise KernelArgumentError(f"{kernel}: {smem} bytes of dynamic shared memory (+ {static_smem} static) "
                                  f"exceeds the limit of {max_smem} per block")
    if profile is not None:
        check_launch(profile, kernel, g, b, smem, registers, static_smem, max_threads)
    return g, b


@dataclass
class Kernel:
    name: str
    module: str                    # .cu stem
    params: list[Param]
    func: Any                      # CUfunction
    resources: KernelResources | None
    max_threads: int = 1024
    static_smem: int = 0           # bytes of __shared__ declared by the kernel
    smem_opt_in: int = 0           # dynamic smem allowed by cuFuncSetAttribute so far (0: the default 48 KB total)


@dataclass
class KernelRegistry:
    arch: str
    modules: dict[str, CompiledModule] = field(default_factory=dict)
    kernels: dict[str, Kernel] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)

    @classmethod
    def load(cls, arch: str, cu_dir: Path = CU_DIR, cache: Path | None | bool = True,
             progress: Callable[[str], None] | None = None, defines: dict[str, int] | None = None,
             driver_version: int | None = None) -> "KernelRegistry":
        """Compile (or read from the cache) every kernel file and load it. With driver_version, a driver too old
        for the NVRTC that built the cubins is refused in one sentence before any module load."""
        reg = cls(arch, compile_all(arch, cu_dir, cache=cache, progress=progress, defines=defines))
        if driver_version is not None:
            for mod in reg.modules.values():
                check_driver_version(driver_version, mod.nvrtc)
        d = api()
        for stem, mod in reg.modules.items():
            handle = call("cuModuleLoadData", mod.cubin)
            reg.handles.append(handle)
            res = mod.resources
            for name, params in mod.kernels.items():
                if name in reg.kernels:
                    raise KernelArgumentError(f"kernel {name} is defined in both {reg.kernels[name].module}.cu "
                                              f"and {stem}.cu")
                func = call("cuModuleGetFunction", handle, name.encode())
                fa = d.CUfunction_attribute
                max_threads = int(call("cuFuncGetAttribute", fa.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, func))
                static = int(call("cuFuncGetAttribute", fa.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, func))
                reg.kernels[name] = Kernel(name, stem, params, func, res.get(name), max_threads, static)
        return reg

    def __getitem__(self, name: str) -> Kernel:
        try:
            return self.kernels[name]
        except KeyError:
            raise KernelArgumentError(f"no kernel named {name!r}; known: {', '.join(sorted(self.kernels))}") from None

    def unload(self) -> None:
        for h in self.handles:
            call("cuModuleUnload", h)
        self.handles, self.kernels = [], {}


def launch(kernel: Kernel, grid: Dim, block: Dim, args: Sequence[Any], stream: Any, smem: int = 0,
           pdl: bool = False, max_smem: int = STATIC_SMEM_LIMIT, profile: DeviceProfile | None = None) -> None:
    """One cuLaunchKernelEx. pdl=True adds CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION. profile: the
    device's limits, checked with the kernel's own ptxas register count (this build's report)."""
    d = api()
    regs = kernel.resources.registers if kernel.resources is not None else 0
    g, b = check_geometry(kernel.name, grid, block, smem, kernel.max_threads, max(max_smem, STATIC_SMEM_LIMIT),
                          kernel.static_smem, regs, profile)
    packed = pack_args(kernel.name, kernel.params, args)
    if smem + kernel.static_smem > STATIC_SMEM_LIMIT and smem > kernel.smem_opt_in:
        call("cuFuncSetAttribute", kernel.func,
             d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        kernel.smem_opt_in = smem
    cfg = d.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = g
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = b
    cfg.sharedMemBytes = smem
    cfg.hStream = stream
    if pdl:
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs = [attr]
        cfg.numAttrs = 1
    else:
        cfg.numAttrs = 0
    try:
        call("cuLaunchKernelEx", cfg, kernel.func, packed.address, 0)
    except CudaError as e:
        # With CUDA_LAUNCH_BLOCKING=1 (the device check's rerun of a file that lost its context) a kernel's own
        # fault is returned here, so the message names the kernel that faulted; otherwise a launch error.
        raise CudaError(f"{kernel.name} ({kernel.module}.cu, grid {g}, block {b}, {smem} B shared): {e}") from None
    del packed   # the driver copied the parameters at launch


def launch_arrays(rt: Any, name: str, grid: Dim, block: Dim, args: Sequence[Any], smem: int = 0) -> None:
    """One launch on host numpy arrays through any runtime (Runtime or EmuRuntime): each array is uploaded into
    a fresh arena, the kernel runs, and the arrays behind non-const pointers are updated in place. For tests and
    the device check (a kernel on a few arrays); the engine keeps its buffers on the device instead."""
    import numpy as np

    params = rt.kernels[name].params
    if len(args) != len(params):
        pack_args(name, params, args)                       # raises the count error with the signature
    sizes = [np.asarray(v).nbytes for p, v in zip(params, args) if p.is_pointer and isinstance(v, np.ndarray)]
    arena = rt.arena(sum(s + 256 for s in sizes) + 256, 256)
    try:
        values, outputs, placed = [], {}, {}
        for p, v in zip(params, args):
            if p.is_pointer and isinstance(v, np.ndarray):
                if not v.flags.c_contiguous:
                    raise KernelArgumentError(f"{name}: argument {p.name!r} must be a C-contiguous array")
                d = placed.get(id(v))
                if d is None:                               # the same array twice is one device buffer
                    d = placed[id(v)] = arena.weights(v.shape, v.dtype)
                    d.upload(v)
                    d.readonly = not v.flags.writeable
                if not p.is_const:
                    outputs[id(v)] = (d, v)
                values.append(d)
            else:
                values.append(v)
        rt.launch(name, grid, block, *values, smem=smem)
        rt.synchronize()
        for d, v in outputs.values():
            v[...] = d.download()
    finally:
        arena.close()
