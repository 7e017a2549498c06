"""PlanRuntime: the Runtime's interface with launches recorded, never run, and device memory never allocated, so
a step of the engine at the real V4 Flash / V4.1 Flash shapes is planned in seconds on any machine.

    rt = PlanRuntime("gb10")                         # or "h200", or a DeviceProfile
    m = CudaModel.synthetic(cfg, runtime=rt, graphs=False)     # ~80 GB of weights at fake addresses
    rt.clear(); ...one step...; rt.launches          # [PlannedLaunch]: kernel, geometry, occupancy, arguments
    plan_step("v4-flash-q2", "decode", "gb10", ctx=2048)      # the same in one call (ds4py/cuda/plan.py)

Each launch gets the checks a GPU launch gets (argument kinds and dtypes, ds4py/cuda/args.py) and is inspected
against the device profile with the kernel's registers and static shared memory from the committed ptxas table
(ds4py/cuda/resources.py): blocks per SM, the limiter, waves, and `problem`, the sentence a refused launch gets.
A refused launch is recorded (strict=False, the default: a whole step's refusals are listed at once) or raised
(strict=True). Memory: addresses from a bump counter; uploads and copies do nothing (downloads read zeros), so
nothing computed on the "device" is meaningful, only the launch sequence, which never depends on data.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ds4py.cuda import resources
from ds4py.cuda.args import KernelArgumentError, check_args
from ds4py.cuda.compiler import CU_DIR, kernel_sources
from ds4py.cuda.devices import DeviceProfile, LaunchRefused, Occupancy, inspect_launch
from ds4py.cuda.devices import profile as device_profile
from ds4py.cuda.emu import launch_bounds
from ds4py.cuda.memory import Arena, DeviceArray, Uploader
from ds4py.cuda.signature import Param, parse_kernels

BASE = 1 << 44                 # fake device addresses start here (never a host address)


@dataclass(frozen=True)
class PlannedArg:
    """One pointer argument of a launch."""
    name: str                  # the kernel parameter's name
    nbytes: int                # bytes of the buffer passed (a DeviceArray's extent; 0: a raw address or null)
    const: bool                # declared const (read only)
    label: str                 # what it points into: a weight tensor's name (e.g. "blk.3.ffn_down_exps.weight"),
                               # "state.<layer>.<part>" (KV state), "rope.<layer>", else "activation" ("null": none)
    ptr: int = 0


@dataclass(frozen=True)
class PlannedLaunch:
    index: int                 # order in the recording
    kernel: str
    module: str                # cu/<module>.cu
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int                  # dynamic shared memory, bytes
    static_smem: int           # the kernel's __shared__ bytes (ptxas report)
    registers: int             # per thread (ptxas report of the profile's arch)
    stream: str                # "main" / "side"
    pdl: bool
    args: tuple[PlannedArg, ...]          # pointer arguments, in parameter order
    scalars: tuple[tuple[str, Any], ...]  # (name, value) of the scalar arguments
    occupancy: Occupancy
    waves: float
    problem: str | None        # why the device refuses this launch (None: it launches)
    region: int = -1           # the fork-join region it was launched in (rt.fork() .. rt.join(): the side stream
                               # runs beside the main stream there), -1: outside every region

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


@dataclass
class PlannedCopy:
    kind: str                  # "copy", "memset", "upload"
    dst: int
    nbytes: int
    stream: str


@dataclass
class PlanKernel:
    name: str
    module: str
    params: list[Param]
    max_threads: int = 1024


class PlanStream:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<plan stream {self.name}>"


class PlanHostBuffer:
    """PinnedBuffer's interface over ordinary host memory."""

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self.array = np.zeros(self.nbytes, np.uint8)
        self.ptr = int(self.array.ctypes.data)

    def free(self) -> None:
        self.array, self.ptr = None, 0


class PlanMemory:
    """Fake device memory: alloc() hands out addresses from a counter; copies are recorded by size only."""

    def __init__(self, rt: "PlanRuntime"):
        self.rt = rt
        self.next = BASE
        self.allocated = 0

    def alloc(self, nbytes: int) -> int:
        ptr = self.next
        self.next += (int(nbytes) + (1 << 21) - 1) // (1 << 21) * (1 << 21) + (1 << 21)   # 2 MB apart
        self.allocated += int(nbytes)
        return ptr

    def free(self, ptr: int) -> None:
        pass

    def upload(self, dst: int, host: np.ndarray, stream: Any = None) -> None:
        self.rt._copy("upload", dst, host.nbytes, stream)

    def upload_staged(self, dst: int, host: np.ndarray, stream: Any) -> None:
        self.rt._copy("upload", dst, host.nbytes, stream)

    def pinned(self, nbytes: int) -> PlanHostBuffer:
        return PlanHostBuffer(nbytes)

    def upload_pinned(self, dst: int, src_ptr: int, nbytes: int, stream: Any, fence: bool = False) -> None:
        self.rt._copy("upload", dst, nbytes, stream)
        return None

    def fence_wait(self, fence: Any) -> None:
        pass

    def download(self, out: np.ndarray, src: int, stream: Any = None) -> None:
        out[...] = 0

    def memset_d32(self, dst: int, value: int, count: int, stream: Any) -> None:
        self.rt._copy("memset", dst, 4 * count, stream)

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.rt._copy("copy", dst, nbytes, stream)

    def synchronize(self) -> None:
        pass


class PlanUploader(Uploader):
    def __init__(self, rt: "PlanRuntime"):
        self.rt = rt

    def upload(self, src: np.ndarray, dst: DeviceArray | int, progress: bool = True, label: str = "weights") -> float:
        raw, ptr = self.target(src, dst, label)
        self.rt._copy("upload", ptr, raw.nbytes, None)
        return 0.0

    def upload_file(self, path: str, offset: int, nbytes: int, dst: DeviceArray | int, progress: bool = True) -> float:
        self.rt._copy("upload", dst.ptr if isinstance(dst, DeviceArray) else int(dst), nbytes, None)
        return 0.0

    def close(self) -> None:
        pass


class PlanGraph:
    def __init__(self, launches: list[PlannedLaunch]):
        self.launches = launches


class PlanTimer:
    def start(self) -> None:
        pass

    def stop(self) -> float:
        return 0.0

    def close(self) -> None:
        pass


class PlanRuntime:
    """The Runtime interface (launch, arena, streams, fork / join, graphs) that records launches against a device
    profile. device: "gb10", "h200" or a DeviceProfile; defines: the model's -D values (as Runtime); strict: raise
    LaunchRefused at a refused launch instead of recording it."""

    def __init__(self, device: str | DeviceProfile = "h200", defines: dict[str, int] | None = None,
                 cu_dir: Path = CU_DIR, strict: bool = False):
        self.profile = device_profile(device)
        self.device = self.profile            # ops size grids from rt.device (sm_count, threads_per_sm, ...)
        self.defines = dict(defines or {})
        self.strict = strict
        self.main, self.side, self.copy = PlanStream("main"), PlanStream("side"), PlanStream("copy")
        self.memory = PlanMemory(self)
        self.kernels = PlanKernels(_registry(Path(cu_dir)))
        self.launches: list[PlannedLaunch] = []
        self.copies: list[PlannedCopy] = []
        self.capturing = False
        self._labels: list[tuple[int, int, str]] = []      # (start, end, label), sorted by start
        self._region, self._regions = -1, 0                 # the open fork-join region (-1: none), regions so far
        self._starts: list[int] = []

    # ---- labels --------------------------------------------------------------------------------------------------
    def label(self, array: DeviceArray, name: str) -> None:
        """Name the bytes of `array` (a weight tensor): pointer arguments inside them carry the name."""
        i = bisect.bisect_left(self._starts, array.ptr)
        self._starts.insert(i, array.ptr)
        self._labels.insert(i, (array.ptr, array.ptr + array.nbytes, name))

    def label_of(self, ptr: int) -> str:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i >= 0 and ptr < self._labels[i][1]:
            return self._labels[i][2]
        return "activation"

    # ---- memory ----------------------------------------------------------------------------------------------------
    def arena(self, weights_bytes: int, scratch_bytes: int = 64 << 20) -> Arena:
        return Arena(weights_bytes, scratch_bytes, allocator=self.memory)

    def uploader(self, chunk_bytes: int = 64 << 20) -> PlanUploader:
        return PlanUploader(self)

    def free_bytes(self) -> int:
        return int(self.profile.total_mem)

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        self._copy("copy", dst, nbytes, stream)

    def _copy(self, kind: str, dst: int, nbytes: int, stream: Any) -> None:
        self.copies.append(PlannedCopy(kind, int(dst), int(nbytes), getattr(stream, "name", "host")))

    def bind_thread(self) -> None:
        pass

    # ---- launches --------------------------------------------------------------------------------------------------
    def launch(self, name: str, grid: Any, block: Any, *args: Any, smem: int = 0, stream: Any = None,
               pdl: bool = False) -> None:
        k = self.kernels[name]
        res = resources.require(self.profile.arch, name)
        check = inspect_launch(self.profile, name, grid, block, int(smem), res.registers, res.smem, k.max_threads)
        if check.problem is not None and self.strict:
            raise LaunchRefused(check.problem)
        raw = check_args(name, k.params, args)
        s = self.main if stream is None else stream
        if not isinstance(s, PlanStream):
            raise KernelArgumentError(f"{stream!r} is not a stream of this plan runtime")
        ptrs, scalars = [], []
        for p, v, r in zip(k.params, args, raw):
            if p.is_pointer:
                nbytes = v.nbytes if isinstance(v, DeviceArray) else 0
                ptrs.append(PlannedArg(p.name, nbytes, p.is_const, self.label_of(int(r)) if r else "null", int(r)))
            else:
                scalars.append((p.name, r))
        self.launches.append(PlannedLaunch(len(self.launches), name, k.module, check.grid, check.block, int(smem),
                                           res.smem, res.registers, s.name, bool(pdl), tuple(ptrs), tuple(scalars),
                                           check.occupancy, check.waves, check.problem, self._region))

    def clear(self) -> None:
        """Forget what was recorded so far (e.g. the model's load) before recording a step."""
        self.launches, self.copies = [], []
        self._region, self._regions = -1, 0

    def refused(self) -> list[PlannedLaunch]:
        return [ln for ln in self.launches if ln.problem is not None]

    # ---- streams and graphs ------------------------------------------------------------------------------------
    def fork(self) -> None:
        """Opens a fork-join region: launches until the join carry its number (the time model overlaps the side
        stream's with the main stream's there)."""
        self._region, self._regions = self._regions, self._regions + 1

    def join(self) -> None:
        self._region = -1

    def synchronize(self) -> None:
        pass

    def timer(self) -> PlanTimer:
        return PlanTimer()

    def close(self) -> None:
        pass

    def begin_capture(self) -> None:
        self.capturing = True
        self._capture_from = len(self.launches)

    def end_capture(self) -> PlanGraph:
        self.capturing = False
        return PlanGraph(self.launches[self._capture_from:])

    def abort_capture(self) -> None:
        self.capturing = False

    def launch_graph(self, graph: PlanGraph) -> None:
        """A replay: the captured launches once more, in order."""
        at = len(self.launches)
        self.launches += [replace(ln, index=at + i) for i, ln in enumerate(graph.launches)]

    def destroy_graph(self, graph: PlanGraph) -> None:
        pass


class PlanKernels:
    """The registry's interface (kernels by name)."""

    def __init__(self, kernels: dict[str, PlanKernel]):
        self.kernels = kernels

    def __getitem__(self, name: str) -> PlanKernel:
        try:
            return self.kernels[name]
        except KeyError:
            raise KernelArgumentError(f"no kernel named {name!r}; known: {', '.join(sorted(self.kernels))}") from None


_REGISTRIES: dict[Path, dict[str, PlanKernel]] = {}


def _registry(cu_dir: Path) -> dict[str, PlanKernel]:
    """Every kernel's signature and __launch_bounds__ from the sources (cached per folder)."""
    hit = _REGISTRIES.get(cu_dir)
    if hit is None:
        hit = {}
        for src in kernel_sources(cu_dir):
            text = src.read_text()
            bounds = launch_bounds(text)
            for name, params in parse_kernels(text).items():
                hit[name] = PlanKernel(name, src.stem, params, bounds.get(name, 1024))
        _REGISTRIES[cu_dir] = hit
    return hit
