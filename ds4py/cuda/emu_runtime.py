"""EmuRuntime: the CUDA Runtime's interface on the CPU emulator, so ds4py/cuda/ops and the CUDA engine run unchanged
in CI (no GPU). Test infrastructure and the `cuda-emu` backend; its timing means nothing.

    rt = EmuRuntime(order="random", seed=1)         # or Runtime() on a GPU: same calls below
    arena = rt.arena(weights_bytes, scratch_bytes)   # device memory = guarded host mappings
    w = arena.weights((rows, cols), np.float16); w.upload(host)
    arena.begin_step(); y = arena.scratch(rows, np.float32)
    ops.gemv(rt, ...)                                # rt.launch(name, grid, block, *args, smem=, stream=, pdl=)
    rt.fork(); ...(stream=rt.side)...; rt.join()
    g = StepGraph(rt, record, slot, arena); g.replay([token, pos])
    y.download()

What it models:
- Launches run the real cu/*.cu kernels (ds4py/cuda/emu.py: every thread a fiber, thread and block order
  `order`), each pointer argument in its own guarded copy: an access past the end of an argument, or a store
  through a const pointer, fails the launch naming thread, block, line and argument. Const arguments' copies are
  cached (weights are copied once), invalidated by any write to their bytes.
- Streams: launches run when issued, in issue order, except that with `defer_side=True` side-stream work waits
  until join() (or synchronize()): a legal schedule on a GPU, under which a missing join shows as a wrong result.
- Graphs: begin_capture()/end_capture() record launches, memsets and copies (with their stream and the fork/join
  edges) and replay them. As on a GPU, a host synchronisation (upload/download without a stream, synchronize())
  or a side-stream launch outside fork()/join() during capture is an error, and so is side-stream work left
  unjoined at the end of a capture.
- PDL is accepted and ignored (launches are sequential); every launch is checked against the device profile
  (ds4py/cuda/devices.py: shared memory, threads, grid, and the kernel's registers from the committed ptxas table)
  like on the device: an H200-like one by default, GB10 with DS4PY_EMU_DEVICE=gb10 or
  EmuRuntime(device=EmuDevice.from_profile("gb10")).
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ds4py.cuda import emu
from ds4py.cuda.args import KernelArgumentError, check_args, pack_raw
from ds4py.cuda import resources
from ds4py.cuda.compiler import CU_DIR, file_options, kernel_sources
from ds4py.cuda.devices import H200, DeviceProfile
from ds4py.cuda.devices import profile as device_profile
from ds4py.cuda.launch import check_geometry
from ds4py.cuda.memory import Arena, ArenaError, DeviceArray, Uploader, plan_chunks
from ds4py.cuda.signature import Param, parse_kernels
from ds4py.errors import Ds4Error

EMU_OPTIONS = ()      # NVRTC's base options do not apply to g++; only the -D defines are passed on


class CaptureSyncError(Ds4Error):
    """A host synchronisation (or an uncapturable call) was made while a graph was being captured."""


@dataclass
class EmuDevice:
    """The device the emulator pretends to be: limits are checked against it, ops size grids from it. Its numbers
    are a DeviceProfile's (ds4py/cuda/devices.py; H200 by default, GB10 with DS4PY_EMU_DEVICE=gb10 or
    EmuDevice.from_profile("gb10")); every launch is checked against `profile`, registers included (the committed
    ptxas table of the profile's arch, ds4py/cuda/resources.py)."""
    name: str = "CPU emulator (H200-like limits)"
    cc: tuple[int, int] = H200.cc
    sm_count: int = H200.sm_count
    l2_bytes: int = H200.l2_bytes
    smem_per_block_optin: int = H200.smem_per_block_optin
    total_mem: int = 1 << 40
    ordinal: int = 0
    threads_per_sm: int = H200.threads_per_sm
    smem_per_sm: int = 0           # 0: the per-block opt-in + the 1 KB the driver reserves (true of GB10 and H200)
    profile: DeviceProfile = H200
    named: bool = False            # made as the profiled device (from_profile, $DS4PY_EMU_DEVICE): it runs that
                                   # device's declared default numerics; False: fp32 (docs/cuda.md "Activation numerics")

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    @classmethod
    def from_profile(cls, p: str | DeviceProfile, total_mem: int = 1 << 40) -> "EmuDevice":
        """The emulator as the profiled device ("gb10", "h200" or a DeviceProfile)."""
        p = device_profile(p)
        return cls(f"CPU emulator ({p.key}-like limits)", p.cc, p.sm_count, p.l2_bytes, p.smem_per_block_optin,
                   total_mem, 0, p.threads_per_sm, p.smem_per_sm, p, named=True)

    @classmethod
    def default(cls) -> "EmuDevice":
        """H200-like, or the profile named by $DS4PY_EMU_DEVICE (gb10, h200)."""
        key = os.environ.get("DS4PY_EMU_DEVICE")
        return cls.from_profile(key) if key else cls()

    def checked_profile(self) -> DeviceProfile:
        """The profile launches are checked against: `profile` with this device's own limits (a test may shrink
        them) in place of the profile's."""
        p = self.profile
        per_sm = self.smem_per_sm or self.smem_per_block_optin + p.smem_reserved_per_block
        if (self.sm_count, self.smem_per_block_optin, self.threads_per_sm, per_sm) == \
                (p.sm_count, p.smem_per_block_optin, p.threads_per_sm, p.smem_per_sm):
            return p
        return dataclasses.replace(p, sm_count=self.sm_count, smem_per_block_optin=self.smem_per_block_optin,
                                   threads_per_sm=self.threads_per_sm, smem_per_sm=per_sm)


@dataclass
class EmuKernel:
    name: str
    module: str                    # .cu stem
    params: list[Param]
    max_threads: int = 1024


class EmuStream:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<emu stream {self.name}>"


# ---- host memory ---------------------------------------------------------------------------------------------
class EmuMemory:
    """The emulated device memory: each alloc() a host mapping between guard pages. DeviceArrays of an arena on
    this memory copy through it; kernels see guarded copies of the bytes (emu.Staging), and const copies are
    cached here until a write touches them."""

    def __init__(self, rt: "EmuRuntime"):
        self.rt = rt
        self._bases: list[int] = []                 # sorted allocation starts
        self._sizes: dict[int, int] = {}            # start -> body bytes
        self._const: dict[int, dict[tuple[int, int], emu.GuardedBuffer]] = {}   # allocation -> cached copies
        self.bytes_copied = 0                       # host -> guarded-copy traffic for const arguments

    # allocation
    def alloc(self, nbytes: int) -> int:
        body = max(emu.PAGE, (int(nbytes) + emu.PAGE - 1) // emu.PAGE * emu.PAGE)
        start = emu.map_guarded(body)
        bisect.insort(self._bases, start)
        self._sizes[start] = body
        self._const[start] = {}
        return start

    def free(self, ptr: int) -> None:
        body = self._sizes.pop(ptr, None)
        if body is None:
            raise ArenaError(f"free of {ptr:#x}, which is not an emulator allocation")
        self._bases.remove(ptr)
        for buf in self._const.pop(ptr).values():
            emu.unmap_guarded(buf.start, buf.body)
        emu.unmap_guarded(ptr, body)

    def owner(self, addr: int) -> int | None:
        """The allocation holding `addr`, or None."""
        i = bisect.bisect_right(self._bases, addr) - 1
        if i >= 0:
            start = self._bases[i]
            if addr < start + self._sizes[start]:
                return start
        return None

    def _check_range(self, addr: int, nbytes: int, what: str) -> int:
        start = self.owner(addr)
        if start is None or addr + nbytes > start + self._sizes[start]:
            raise ArenaError(f"{what}: [{addr:#x}, +{nbytes}) is not inside one emulator allocation")
        return start

    # const copies
    def const_copy(self, addr: int, nbytes: int) -> emu.GuardedBuffer:
        """A read-only guarded copy of [addr, addr + nbytes), reused while nothing writes those bytes."""
        start = self.owner(addr)
        cache = self._const.get(start) if start is not None else None
        if cache is None:                            # not arena memory (cannot track writes): a fresh copy
            raise ArenaError(f"const argument at {addr:#x} is not in emulator memory")
        buf = cache.get((addr, nbytes))
        if buf is None:
            buf = emu.GuardedBuffer(emu.map_guarded(emu._body(nbytes)), emu._body(nbytes))
            buf.place(nbytes)
            ctypes.memmove(buf.ptr, addr, nbytes)
            if buf.padding:
                ctypes.memset(buf.ptr + nbytes, 0xFF, buf.padding)
            buf.set_readonly(True)
            cache[(addr, nbytes)] = buf
            self.bytes_copied += nbytes
        return buf

    def invalidate(self, addr: int, nbytes: int) -> None:
        """Bytes [addr, addr + nbytes) changed: drop the cached const copies that overlap them."""
        start = self.owner(addr)
        if start is None:
            return
        cache = self._const[start]
        if not cache:
            return
        end = addr + nbytes
        for key in [k for k in cache if k[0] < end and addr < k[0] + k[1]]:
            buf = cache.pop(key)
            emu.unmap_guarded(buf.start, buf.body)

    def invalidate_allocation(self, addr: int) -> None:
        start = self.owner(addr)
        if start is not None:
            self.invalidate(start, self._sizes[start])

    # copies (the DeviceArray / StepGraph interface)
    def upload(self, dst: int, host: np.ndarray, stream: Any = None) -> None:
        self.rt._host_access("an upload" if stream is None else "an upload from host memory")
        self._check_range(dst, host.nbytes, "upload")
        ctypes.memmove(dst, host.ctypes.data, host.nbytes)
        self.invalidate(dst, host.nbytes)

    def upload_staged(self, dst: int, host: np.ndarray, stream: Any) -> None:
        self.rt._host_access("an upload from pageable host memory")     # a capture refuses it on a GPU too
        self._check_range(dst, host.nbytes, "upload")
        self.rt._issue(stream, _Upload(dst, bytes(host.tobytes())))

    def pinned(self, nbytes: int) -> "HostBuffer":
        """DriverMemory.pinned's stand-in: page-aligned host memory (every host page is DMA-able here)."""
        return HostBuffer(nbytes)

    def upload_pinned(self, dst: int, src_ptr: int, nbytes: int, stream: Any, fence: bool = False) -> None:
        """DriverMemory.upload_pinned: the bytes are read when the copy runs on the stream (as the DMA engine
        reads pinned memory), not when it is queued. The main stream runs each op as it is issued, so the fence
        is None; fence_wait flushes a deferred side stream (a copy queued there has then run)."""
        self.rt._host_access("an upload from pinned host memory")   # a capture would record it: keep it out
        self._check_range(dst, nbytes, "upload")
        self.rt._issue(stream, _Copy(dst, int(src_ptr), int(nbytes)))

    def fence_wait(self, fence: Any) -> None:
        self.rt._flush_side()

    def download(self, out: np.ndarray, src: int, stream: Any = None) -> None:
        self.rt._host_access("a download")
        self._check_range(src, out.nbytes, "download")
        ctypes.memmove(out.ctypes.data, src, out.nbytes)

    def memset_d32(self, dst: int, value: int, count: int, stream: Any) -> None:
        self._check_range(dst, 4 * count, "memset")
        self.rt._issue(stream, _Memset(dst, int(value) & 0xFFFFFFFF, int(count)))

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._check_range(dst, nbytes, "copy destination")
        self._check_range(src, nbytes, "copy source")
        self.rt._issue(stream, _Copy(dst, src, int(nbytes)))

    def synchronize(self) -> None:
        pass


# ---- recorded operations -------------------------------------------------------------------------------------
@dataclass
class _Launch:
    kernel: EmuKernel
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    args: tuple                    # as given (DeviceArrays: their extents are staged)
    raw: list                      # checked raw values (addresses, scalars)
    pdl: bool


@dataclass
class _Memset:
    dst: int
    value: int
    count: int


@dataclass
class _Upload:
    dst: int
    data: bytes


@dataclass
class _Copy:
    dst: int
    src: int
    nbytes: int


class _Fork:
    pass


class _Join:
    pass


@dataclass
class EmuGraph:
    """A captured step: operations with their stream, replayed in order."""
    ops: list[tuple[Any, Any]]
    launches: int


class EmuTimer:
    """Wall-clock milliseconds between start() and stop() (pending work flushed first)."""

    def __init__(self, rt: "EmuRuntime"):
        self.rt = rt
        self.t0 = 0.0

    def start(self) -> None:
        self.rt._flush_side()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        self.rt._flush_side()
        return (time.perf_counter() - self.t0) * 1e3

    def close(self) -> None:
        pass


class HostBuffer:
    """PinnedBuffer's interface (ptr, array, free) over page-aligned host memory."""

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self._raw = np.zeros(self.nbytes + emu.PAGE, np.uint8)
        at = (-self._raw.ctypes.data) % emu.PAGE
        self.array = self._raw[at: at + self.nbytes]
        self.ptr = int(self.array.ctypes.data)

    def free(self) -> None:
        self.array = self._raw = None
        self.ptr = 0


class EmuUploader(Uploader):
    """WeightUploader's interface: copies straight from the (memory-mapped) source into the emulated memory."""

    def __init__(self, rt: "EmuRuntime", chunk_bytes: int = 64 << 20):
        self.rt, self.chunk_bytes = rt, chunk_bytes

    def upload(self, src: np.ndarray, dst: DeviceArray | int, progress: bool = True, label: str = "weights",
               on_bytes: Callable[[int], None] | None = None) -> float:
        raw, dst_ptr = self.target(src, dst, label)
        t0 = time.perf_counter()
        for off, n in plan_chunks(raw.nbytes, self.chunk_bytes):
            self.rt.memory.upload(dst_ptr + off, np.ascontiguousarray(raw[off: off + n]))
            if on_bytes is not None:
                on_bytes(n)
        return raw.nbytes / 1e9 / max(time.perf_counter() - t0, 1e-9)

    def close(self) -> None:
        pass


# ---- the runtime ---------------------------------------------------------------------------------------------
class EmuRuntime:
    def __init__(self, cu_dir: Path = CU_DIR, order: str = "forward", seed: int = 0, defer_side: bool = False,
                 defines: dict[str, int] | None = None, device: EmuDevice | None = None,
                 progress: Callable[[str], None] | None = None, check_pdl: bool = False):
        """order: thread/block order of every launch ("forward", "reverse", "random"; random is seeded with
        seed + the launch number, so a run is reproducible). defines: per-model -D values (as Runtime).
        check_pdl: fail a launch in which a thread stores to an argument, or returns, before pdl_wait() (the
        rule PDL needs; costs a few system calls per block, so the kernel tests turn it on)."""
        if emu.compiler() is None:
            raise emu.EmuError("the CUDA emulator needs a host C++ compiler (g++ not found; set CXX)")
        if order not in emu.ORDERS:
            raise KernelArgumentError(f"order must be one of {', '.join(emu.ORDERS)}, got {order!r}")
        self.cu_dir = Path(cu_dir)
        self.order, self.seed, self.defer_side, self.check_pdl = order, seed, defer_side, check_pdl
        self.defines = dict(defines or {})
        self.device = device or EmuDevice.default()
        self.progress = progress
        self.main, self.side, self.copy = EmuStream("main"), EmuStream("side"), EmuStream("copy")
        self.memory = EmuMemory(self)
        self.kernels = self._registry()
        self._modules: dict[str, emu.EmuModule] = {}
        self._side_queue: list[Any] = []
        self._capture: list[tuple[Any, Any]] | None = None
        self._forked = False
        self.launches = 0                   # kernels run so far (replays included)
        self.launch_counts: dict[str, int] = {}      # per kernel name (the checkers' coverage report)
        self.capturing = False

    def _registry(self) -> "EmuKernels":
        kernels: dict[str, EmuKernel] = {}
        for src in kernel_sources(self.cu_dir):
            text = src.read_text()
            bounds = emu.launch_bounds(text)
            for name, params in parse_kernels(text).items():
                if name in kernels:
                    raise KernelArgumentError(f"kernel {name} is defined in both {kernels[name].module}.cu and "
                                              f"{src.stem}.cu")
                kernels[name] = EmuKernel(name, src.stem, params, bounds.get(name, 1024))
        return EmuKernels(kernels)

    @property
    def profile(self) -> DeviceProfile:
        """The device profile launches are checked against and ops size grids from (EmuDevice.checked_profile)."""
        return self.device.checked_profile()

    def module(self, stem: str) -> emu.EmuModule:
        """The emulator build of cu/<stem>.cu with its -D defines (built on first use, cached on disk)."""
        mod = self._modules.get(stem)
        if mod is None:
            src = self.cu_dir / f"{stem}.cu"
            flags = file_options(src, self.defines, EMU_OPTIONS)
            mod = self._modules[stem] = emu.load(src, flags, progress=self.progress)
        return mod

    # ---- memory --------------------------------------------------------------------------------------------
    def arena(self, weights_bytes: int, scratch_bytes: int = 64 << 20) -> Arena:
        return Arena(weights_bytes, scratch_bytes, allocator=self.memory)

    def uploader(self, chunk_bytes: int = 64 << 20) -> EmuUploader:
        return EmuUploader(self, chunk_bytes)

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        self.memory.copy(dst, src, nbytes, self.main if stream is None else stream)

    def bind_thread(self) -> None:
        pass

    # ---- launches ------------------------------------------------------------------------------------------
    def launch(self, name: str, grid: Any, block: Any, *args: Any, smem: int = 0, stream: Any = None,
               pdl: bool = False) -> None:
        try:
            k = self.kernels.kernels[name]
        except KeyError:
            raise KernelArgumentError(f"no kernel named {name!r}; known: {', '.join(sorted(self.kernels.kernels))}"
                                      ) from None
        mod = self.module(k.module)
        prof = self.profile
        res = resources.kernel(prof.arch, name)          # the committed ptxas report (None: a kernel not in it)
        # the kernel's own static shared memory from its ptxas report; without a row, the file's static
        # __shared__ section (every kernel of the file together: an upper bound)
        static_smem = res.smem if res is not None else mod.static_smem_bytes
        g, b = check_geometry(name, grid, block, smem, k.max_threads, self.device.smem_per_block_optin,
                              static_smem, res.registers if res is not None else 0, prof)
        raw = check_args(name, k.params, args)     # the GPU launcher's checks, before anything is queued
        for p, v in zip(k.params, args):
            if p.is_pointer and isinstance(v, DeviceArray) and v.mem is not self.memory:
                raise KernelArgumentError(f"{name}: argument {p.name!r} is not in this emulator's memory")
        op = _Launch(k, g, b, int(smem), args, raw, pdl)
        self._issue(self.main if stream is None else stream, op)

    def _issue(self, stream: Any, op: Any) -> None:
        if not isinstance(stream, EmuStream):
            raise KernelArgumentError(f"{stream!r} is not a stream of this emulator runtime")
        if self._capture is not None:
            if stream is self.side and not self._forked:
                raise CaptureSyncError("a side-stream launch outside fork()/join() during graph capture "
                                       "(the side stream would not be part of the graph)")
            if stream is self.copy:
                raise CaptureSyncError("work on the copy stream during graph capture (it is not captured)")
            if isinstance(op, _Launch):       # the graph holds the pointer values of now
                op = dataclasses.replace(op, args=tuple(dataclasses.replace(a) if isinstance(a, DeviceArray) else a
                                                        for a in op.args))
            self._capture.append((stream, op))
            return
        if stream is self.side and self.defer_side:
            if isinstance(op, _Launch):
                op = dataclasses.replace(op, args=tuple(dataclasses.replace(a) if isinstance(a, DeviceArray) else a
                                                        for a in op.args))
            self._side_queue.append(op)
            return
        self._run(op)

    def _run(self, op: Any) -> None:
        if isinstance(op, _Launch):
            self._run_launch(op)
        elif isinstance(op, _Memset):
            np.ctypeslib.as_array((ctypes.c_uint32 * op.count).from_address(op.dst))[:] = op.value
            self.memory.invalidate(op.dst, 4 * op.count)
        elif isinstance(op, _Copy):
            ctypes.memmove(op.dst, op.src, op.nbytes)
            self.memory.invalidate(op.dst, op.nbytes)
        elif isinstance(op, _Upload):
            ctypes.memmove(op.dst, op.data, len(op.data))
            self.memory.invalidate(op.dst, len(op.data))

    def _run_launch(self, op: _Launch) -> None:
        k = op.kernel
        self.launch_counts[k.name] = self.launch_counts.get(k.name, 0) + 1
        mod = self.module(k.module)
        staging = emu.Staging(k.name)
        staged: list[tuple[int, int, emu.Staged]] = []
        where: list[tuple[int, emu.Staged]] = []
        raw_writes: list[int] = []
        for i, (p, v) in enumerate(zip(k.params, op.args)):
            if p.is_pointer and isinstance(v, DeviceArray):
                s = staging.add(p, v.ptr, v.nbytes, v.dtype, v.readonly, self.memory)
                staged.append((v.ptr, v.nbytes, s))
                where.append((i, s))
            elif p.is_pointer and v and not p.is_const:
                raw_writes.append(int(op.raw[i]))    # a raw address: unguarded, and its allocation may change
        seed = (self.seed + self.launches) & (2**64 - 1)
        self.launches += 1
        with emu.launch_lock:
            try:
                staging.place(staged)
                raw = list(op.raw)
                for i, s in where:
                    raw[i] = s.ptr
                packed = pack_raw(k.params, raw)
                mod.run(k.name, op.grid, op.block, op.smem, packed.address or None, self.order, seed, staging,
                        self.check_pdl)
                staging.finish()
            finally:
                staging.release()
                for addr in raw_writes:
                    self.memory.invalidate_allocation(addr)

    # ---- streams -------------------------------------------------------------------------------------------
    def fork(self) -> None:
        """The side stream waits for everything issued on the main stream so far."""
        if self._capture is not None:
            self._capture.append((self.main, _Fork()))
        self._forked = True

    def join(self) -> None:
        """The main stream waits for everything issued on the side stream so far."""
        if self._capture is not None:
            self._capture.append((self.main, _Join()))
        else:
            self._flush_side()
        self._forked = False

    def _flush_side(self) -> None:
        queue, self._side_queue = self._side_queue, []
        for op in queue:
            self._run(op)

    def _host_access(self, what: str) -> None:
        if self._capture is not None:
            raise CaptureSyncError(f"{what} during graph capture: a host synchronisation is not allowed there "
                                   f"(write step values to a device slot instead)")
        self._flush_side()

    def free_bytes(self) -> int:
        """The emulated device's memory (EmuDevice.total_mem): host memory is what really limits the emulator."""
        return int(self.device.total_mem)

    def synchronize(self) -> None:
        self._host_access("synchronize()")

    def timer(self) -> EmuTimer:
        return EmuTimer(self)

    def close(self) -> None:
        self._flush_side()

    # ---- graphs --------------------------------------------------------------------------------------------
    def begin_capture(self) -> None:
        if self._capture is not None:
            raise CaptureSyncError("a graph capture is already in progress")
        self._flush_side()
        self._capture = []
        self._forked = False
        self.capturing = True

    def end_capture(self) -> EmuGraph:
        ops, self._capture = self._capture or [], None
        self.capturing = False
        forked = self._forked
        self._forked = False
        if forked:
            raise CaptureSyncError("the capture ended with side-stream work not joined back into the main stream")
        return EmuGraph(ops, sum(isinstance(op, _Launch) for _, op in ops))

    def abort_capture(self) -> None:
        self._capture = None
        self._forked = False
        self.capturing = False

    def launch_graph(self, graph: EmuGraph) -> None:
        for stream, op in graph.ops:
            if isinstance(op, _Fork):
                self._forked = True
            elif isinstance(op, _Join):
                self._flush_side()
                self._forked = False
            else:
                self._issue(stream, op)

    def destroy_graph(self, graph: EmuGraph) -> None:
        graph.ops = []


class EmuKernels:
    """The registry's interface (kernels by name) for the emulator's kernels."""

    def __init__(self, kernels: dict[str, EmuKernel]):
        self.kernels = kernels

    def __getitem__(self, name: str) -> EmuKernel:
        try:
            return self.kernels[name]
        except KeyError:
            raise KernelArgumentError(f"no kernel named {name!r}; known: {', '.join(sorted(self.kernels))}") from None
