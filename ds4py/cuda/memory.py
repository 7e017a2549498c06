"""Device memory: one arena per context, typed views, pinned staging and chunked weight upload.

The arena holds two regions, each one allocation of its memory (cuMemAlloc on a GPU, a host mapping under the
emulator, ds4py/cuda/emu_runtime.py):
  weights  sized once from the model; bump-allocated while loading, never freed piecemeal
  scratch  activations of one step; bump-allocated, reset by begin_step(), and grown (by doubling) only there,
           so no pointer handed out during a step ever moves. Growth bumps `generation`: captured CUDA graphs
           hold raw pointers and must be re-captured.
Every allocation is 256-byte aligned (16-byte vector loads, and room for TMA/cp.async alignment later).
A DeviceArray copies through the memory it lives in (`mem`): DriverMemory binds its Runtime's context first.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

import numpy as np

from ds4py.cuda.driver import call
from ds4py.errors import Ds4Error

ALIGN = 256


class ArenaError(Ds4Error):
    """An arena region is too small for what was asked of it."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class Allocator(Protocol):
    def alloc(self, nbytes: int) -> int: ...

    def free(self, ptr: int) -> None: ...


class DriverMemory:
    """Device memory through the driver: cuMemAlloc / cuMemFree and the copies DeviceArray makes.

    `bind` makes the owning Runtime's context current on the calling thread (a context is current per thread,
    so an upload from the server's engine worker would otherwise run in no context or the wrong one).
    An asynchronous upload keeps its host array alive until the copy has completed (an event per copy,
    released on a later call once the event has fired, or at synchronize())."""

    def __init__(self, bind: Callable[[], None] | None = None):
        self.bind = bind or (lambda: None)
        self._pending: list[tuple[Any, np.ndarray]] = []     # (event, host array) of async uploads in flight

    def alloc(self, nbytes: int) -> int:
        self.bind()
        return int(call("cuMemAlloc", nbytes))

    def free(self, ptr: int) -> None:
        self.bind()
        call("cuMemFree", ptr)

    def _reap(self, wait: bool = False) -> None:
        keep = []
        for event, host in self._pending:
            if wait:
                call("cuEventSynchronize", event)
            elif not _event_done(event):
                keep.append((event, host))
                continue
            call("cuEventDestroy", event)
        self._pending = keep

    def upload(self, dst: int, host: np.ndarray, stream: Any = None) -> None:
        self.bind()
        self._reap()
        if stream is None:
            call("cuCtxSynchronize")     # our streams are non-blocking: order against them explicitly
            call("cuMemcpyHtoD", dst, host.ctypes.data, host.nbytes)
            # A pageable-memory cuMemcpyHtoD may return once the bytes are staged, before they reach the device,
            # and non-blocking streams do not wait for it: synchronise so "finished on return" holds.
            call("cuCtxSynchronize")
            return
        call("cuMemcpyHtoDAsync", dst, host.ctypes.data, host.nbytes, stream)
        event = call("cuEventCreate", _no_timing())
        call("cuEventRecord", event, stream)
        self._pending.append((event, host))

    def upload_staged(self, dst: int, host: np.ndarray, stream: Any) -> None:
        """A small upload queued on `stream` whose host array may be reused at once: from pageable memory (a
        fresh numpy array) the driver copies the bytes into its staging buffer before cuMemcpyHtoDAsync returns
        (CUDA's documented behaviour), so no event has to keep the array alive. Never pass pinned memory."""
        self.bind()
        call("cuMemcpyHtoDAsync", dst, host.ctypes.data, host.nbytes, stream)

    def pinned(self, nbytes: int) -> "PinnedBuffer":
        """Page-locked host memory (cuMemHostAlloc) for step inputs copied asynchronously (upload_pinned)."""
        self.bind()
        return PinnedBuffer(nbytes)

    def upload_pinned(self, dst: int, src_ptr: int, nbytes: int, stream: Any, fence: bool = False) -> Any:
        """Queue a copy of nbytes of pinned memory at src_ptr to dst on `stream`; with fence, returns an event
        that fence_wait() waits on before the caller rewrites those bytes (the DMA engine reads them when the
        copy runs, not now), else None."""
        self.bind()
        call("cuMemcpyHtoDAsync", dst, src_ptr, nbytes, stream)
        if not fence:
            return None
        event = call("cuEventCreate", _no_timing())
        call("cuEventRecord", event, stream)
        return event

    def fence_wait(self, fence: Any) -> None:
        """The copy behind an upload_pinned fence has run (its pinned bytes may be rewritten)."""
        if fence is not None:
            self.bind()
            call("cuEventSynchronize", fence)
            call("cuEventDestroy", fence)

    def download(self, out: np.ndarray, src: int, stream: Any = None) -> None:
        self.bind()
        if stream is not None:
            call("cuStreamSynchronize", stream)
        else:
            call("cuCtxSynchronize")
        call("cuMemcpyDtoH", out.ctypes.data, src, out.nbytes)
        self._reap()

    def memset_d32(self, dst: int, value: int, count: int, stream: Any) -> None:
        self.bind()
        call("cuMemsetD32Async", dst, value & 0xFFFFFFFF, count, stream)

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.bind()
        call("cuMemcpyDtoDAsync", dst, src, nbytes, stream)

    def synchronize(self) -> None:
        """Every async upload has landed; their host buffers are released."""
        self._reap(wait=True)


DriverAllocator = DriverMemory            # the name Arena's callers used before copies moved here too


def _no_timing() -> Any:
    from ds4py.cuda.driver import api

    return api().CUevent_flags.CU_EVENT_DISABLE_TIMING


def _event_done(event: Any) -> bool:
    from ds4py.cuda.driver import api

    d = api()
    (err,) = d.cuEventQuery(event)
    if err == d.CUresult.CUDA_SUCCESS:
        return True
    if err == d.CUresult.CUDA_ERROR_NOT_READY:
        return False
    call("cuEventSynchronize", event)     # raises CudaError naming the failure
    return True


_DEFAULT_MEMORY: DriverMemory | None = None


def _default_memory() -> DriverMemory:
    global _DEFAULT_MEMORY
    if _DEFAULT_MEMORY is None:
        _DEFAULT_MEMORY = DriverMemory()
    return _DEFAULT_MEMORY


@dataclass
class DeviceArray:
    """A typed view of device memory (no ownership: the arena owns the bytes).

    `mem` is the memory it lives in (DriverMemory of a Runtime, or the emulator's host arena); None means the
    driver with whatever context is current."""
    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    readonly: bool = False
    mem: Any = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __post_init__(self) -> None:
        self.dtype = np.dtype(self.dtype)

    @property
    def memory(self) -> Any:
        return self.mem if self.mem is not None else _default_memory()

    def _check(self, host: np.ndarray) -> np.ndarray:
        host = np.ascontiguousarray(host)
        if host.dtype != self.dtype or host.size != self.size:
            raise ArenaError(f"host array {host.dtype}{list(host.shape)} does not match device "
                             f"{np.dtype(self.dtype)}{list(self.shape)}")
        return host

    def upload(self, host: np.ndarray, stream: Any = None) -> None:
        """Copy host -> device. Without a stream: after all queued work in the context, and finished on return.
        With a stream: queued there; the host array is kept alive until the copy completes (for real overlap
        it should be pinned)."""
        self.memory.upload(self.ptr, self._check(host), stream)

    def download(self, stream: Any = None) -> np.ndarray:
        """Copy device -> host after the work queued on `stream` (default: all work in the context)."""
        out = np.empty(self.shape, dtype=self.dtype)
        self.memory.download(out, self.ptr, stream)
        return out

    def fill_d32(self, value: int, stream: Any) -> None:
        """Every 32-bit word set to `value` (int bits), queued on `stream` (cuMemsetD32Async)."""
        if self.nbytes % 4:
            raise ArenaError(f"fill_d32 needs a whole number of 32-bit words, the array holds {self.nbytes} bytes")
        self.memory.memset_d32(self.ptr, int(value), self.nbytes // 4, stream)

    def view(self, offset: int, shape: tuple[int, ...] | int, dtype: Any = None,
             readonly: bool | None = None) -> "DeviceArray":
        """A sub-array starting `offset` bytes in, of `shape` and `dtype` (default: this array's); it must fit."""
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
        v = DeviceArray(self.ptr + int(offset), shape, np.dtype(dtype if dtype is not None else self.dtype),
                        self.readonly if readonly is None else readonly, self.mem)
        if offset < 0 or offset + v.nbytes > self.nbytes:
            raise ArenaError(f"a view of {v.nbytes} bytes at offset {offset} does not fit a {self.nbytes}-byte array")
        return v

    def reshape(self, *shape: int) -> "DeviceArray":
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ArenaError(f"cannot reshape {list(self.shape)} to {list(shape)}")
        return DeviceArray(self.ptr, tuple(shape), self.dtype, self.readonly, self.mem)


class Region:
    """A bump allocator over [base, base + capacity)."""

    def __init__(self, name: str, base: int, capacity: int):
        self.name, self.base, self.capacity, self.used = name, base, capacity, 0

    def take(self, nbytes: int) -> int | None:
        start = align_up(self.used)
        if start + nbytes > self.capacity:
            return None
        self.used = start + nbytes
        return self.base + start


class Arena:
    def __init__(self, weights_bytes: int, scratch_bytes: int = 64 << 20, allocator: Allocator | None = None):
        self.allocator = allocator if allocator is not None else DriverMemory()
        # the arrays handed out copy through the allocator when it is a memory (DriverMemory, the emulator's)
        self.memory = self.allocator if hasattr(self.allocator, "upload") else None
        wcap, scap = align_up(max(weights_bytes, ALIGN)), align_up(max(scratch_bytes, ALIGN))
        self.weights_region = Region("weights", self.allocator.alloc(wcap), wcap)
        self.scratch_region = Region("scratch", self.allocator.alloc(scap), scap)
        self.generation = 0          # bumped whenever scratch moves
        self.high_water = 0          # largest scratch a step asked for (even a failed ask)
        self.in_step = False

    def weights(self, shape: tuple[int, ...] | int, dtype: Any) -> DeviceArray:
        """Room for one weight tensor; read-only for kernels (only uploads write it)."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        arr = DeviceArray(0, shape, np.dtype(dtype), readonly=True, mem=self.memory)
        ptr = self.weights_region.take(arr.nbytes)
        if ptr is None:
            raise ArenaError(f"the weights region ({self.weights_region.capacity} bytes) is full: cannot add "
                             f"{arr.nbytes} bytes (size the arena from the model)")
        arr.ptr = ptr
        return arr

    def reset_weights(self) -> None:
        """Forget every weight allocation (benchmarks that load one matrix after another)."""
        self.weights_region.used = 0

    def begin_step(self, scratch_bytes: int = 0) -> bool:
        """Start a step: frees all scratch, and grows it (by doubling) to hold max(scratch_bytes, the largest
        earlier ask). Returns True when scratch moved (graphs that captured its pointers must be re-captured)."""
        need = max(scratch_bytes, self.high_water)
        grew = False
        if need > self.scratch_region.capacity:
            cap = self.scratch_region.capacity
            while cap < need:
                cap *= 2
            self.allocator.free(self.scratch_region.base)
            self.scratch_region = Region("scratch", self.allocator.alloc(cap), cap)
            self.generation += 1
            grew = True
        self.scratch_region.used = 0
        self.in_step = True
        return grew

    def scratch(self, shape: tuple[int, ...] | int, dtype: Any) -> DeviceArray:
        """Room for one activation tensor, valid until the next begin_step()."""
        if not self.in_step:
            raise ArenaError("scratch memory is handed out only inside a step: call begin_step() first")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        arr = DeviceArray(0, shape, np.dtype(dtype), mem=self.memory)
        ptr = self.scratch_region.take(arr.nbytes)
        if ptr is None:
            self.high_water = max(self.high_water, align_up(self.scratch_region.used) + arr.nbytes)
            raise ArenaError(f"this step needs more than the {self.scratch_region.capacity} bytes of scratch; "
                             f"it grows to {self.high_water} bytes at the next begin_step()")
        arr.ptr = ptr
        self.high_water = max(self.high_water, self.scratch_region.used)
        return arr

    def close(self) -> None:
        for r in (self.weights_region, self.scratch_region):
            if r.base:
                self.allocator.free(r.base)
                r.base = 0


class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc) with a numpy uint8 view; the DMA engine reads it directly."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ptr = int(call("cuMemHostAlloc", nbytes, 0))
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))

    def free(self) -> None:
        if self.ptr:
            self.array = None
            call("cuMemFreeHost", self.ptr)
            self.ptr = 0


def plan_chunks(total: int, chunk: int) -> Iterator[tuple[int, int]]:
    """(offset, nbytes) pieces covering [0, total) in order."""
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    for off in range(0, total, chunk):
        yield off, min(chunk, total - off)


class Uploader:
    """What every uploader shares: the source/target checks and uploads from a file through a memory map."""

    def upload(self, src: np.ndarray, dst: DeviceArray | int, progress: bool = True, label: str = "weights",
               on_bytes: Callable[[int], None] | None = None) -> float:
        """Copy all of src to dst; on_bytes(n) after each chunk of n bytes (a load's progress). Returns GB/s."""
        raise NotImplementedError

    @staticmethod
    def target(src: np.ndarray, dst: DeviceArray | int, label: str) -> tuple[np.ndarray, int]:
        """(the source's raw bytes, the destination address); a source larger than the array is refused."""
        raw = np.asarray(src).reshape(-1).view(np.uint8)
        if isinstance(dst, DeviceArray) and dst.nbytes < raw.nbytes:
            raise ArenaError(f"{label}: {raw.nbytes} bytes do not fit the {dst.nbytes}-byte device buffer")
        return raw, dst.ptr if isinstance(dst, DeviceArray) else int(dst)

    def upload_file(self, path: str, offset: int, nbytes: int, dst: DeviceArray | int, progress: bool = True,
                    on_bytes: Callable[[int], None] | None = None) -> float:
        """Upload bytes [offset, offset + nbytes) of a file, read through a read-only memory map."""
        mm = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))
        try:
            return self.upload(mm, dst, progress=progress, label=path, on_bytes=on_bytes)
        finally:
            del mm


def file_filler(fd: int, path: str, offset: int) -> Callable[[np.ndarray, int, int], None]:
    """fill(buf, off, n): bytes [offset + off, offset + off + n) of the open file into buf (os.preadv, no memory
    map), then those pages dropped from the page cache (POSIX_FADV_DONTNEED): the host side of a weight upload
    (WeightUploader.upload_file; bench/load_time.py times it cold and from the page cache)."""
    def fill(buf: np.ndarray, off: int, n: int) -> None:
        got = 0
        while got < n:
            k = os.preadv(fd, [memoryview(buf[got:n])], offset + off + got)
            if k <= 0:
                raise ArenaError(f"{path}: the file ended at byte {offset + off + got} while uploading")
            got += k
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset + off, n, os.POSIX_FADV_DONTNEED)
    return fill


class WeightUploader(Uploader):
    """Streams bytes (e.g. an np.memmap of the GGUF's tensor data) to the device on a copy stream through two
    pinned chunks: the host fills one while the DMA engine drains the other, so pinned memory stays at
    2 x chunk_bytes whatever the model size."""

    def __init__(self, copy_stream: Any, chunk_bytes: int = 64 << 20, bind: Callable[[], None] | None = None):
        self.bind = bind or (lambda: None)
        self.bind()
        self.stream = copy_stream
        self.chunk_bytes = chunk_bytes
        self.buffers = [PinnedBuffer(chunk_bytes) for _ in range(2)]
        self.events = [call("cuEventCreate", 0) for _ in range(2)]

    def upload(self, src: np.ndarray, dst: DeviceArray | int, progress: bool = True, label: str = "weights",
               on_bytes: Callable[[int], None] | None = None) -> float:
        """Copy all of `src` (any array; its raw bytes) to dst. Returns GB/s. Blocks until the copy is done."""
        raw, dst_ptr = self.target(src, dst, label)

        def fill(buf: np.ndarray, off: int, n: int) -> None:
            buf[:n] = raw[off: off + n]                          # reads the source (page faults on an mmap)

        return self._stream(fill, raw.nbytes, dst_ptr, progress, label, on_bytes)

    def upload_file(self, path: str, offset: int, nbytes: int, dst: DeviceArray | int, progress: bool = True,
                    on_bytes: Callable[[int], None] | None = None) -> float:
        """Upload bytes [offset, offset + nbytes) of a file: read straight into the pinned chunks (os.preadv, no
        memory map), each chunk's pages dropped from the page cache once read (POSIX_FADV_DONTNEED), so the
        weights are never held twice - on the device and in the page cache, which on an integrated GPU (GB10)
        are the same memory. Reading is sequential, so the kernel's read-ahead keeps the disk busy."""
        if isinstance(dst, DeviceArray) and dst.nbytes < nbytes:
            raise ArenaError(f"{path}: {nbytes} bytes do not fit the {dst.nbytes}-byte device buffer")
        dst_ptr = dst.ptr if isinstance(dst, DeviceArray) else int(dst)
        fd = os.open(path, os.O_RDONLY)
        try:
            return self._stream(file_filler(fd, path, offset), nbytes, dst_ptr, progress, path, on_bytes)
        finally:
            os.close(fd)

    def _stream(self, fill: Callable[[np.ndarray, int, int], None], total: int, dst_ptr: int, progress: bool,
                label: str, on_bytes: Callable[[int], None] | None = None) -> float:
        """Fill the two pinned chunks in turn (fill(buffer, offset, n)) while the copy stream drains the other."""
        self.bind()
        pending = [False, False]
        t0 = last = time.perf_counter()
        for i, (off, n) in enumerate(plan_chunks(total, self.chunk_bytes)):
            slot = i % 2
            if pending[slot]:
                call("cuEventSynchronize", self.events[slot])   # the DMA engine is done with this buffer
            fill(self.buffers[slot].array, off, n)
            call("cuMemcpyHtoDAsync", dst_ptr + off, self.buffers[slot].ptr, n, self.stream)
            call("cuEventRecord", self.events[slot], self.stream)
            pending[slot] = True
            if on_bytes is not None:
                on_bytes(n)
            now = time.perf_counter()
            if progress and (now - last > 0.5 or off + n == total):
                last = now
                done = off + n
                print(f"\rds4py: uploading {label} {done / 1e9:.2f}/{total / 1e9:.2f} GB "
                      f"({100 * done / max(total, 1):.0f}%) {done / 1e9 / max(now - t0, 1e-9):.1f} GB/s",
                      end="", file=sys.stderr, flush=True)
        call("cuStreamSynchronize", self.stream)
        secs = time.perf_counter() - t0
        if progress and total:
            print(file=sys.stderr)
        return total / 1e9 / max(secs, 1e-9)

    def close(self) -> None:
        for b in self.buffers:
            b.free()
        for e in self.events:
            call("cuEventDestroy", e)
        self.buffers, self.events = [], []
