"""The CUDA runtime object: device + context, compiled kernels, a main and a side stream, and launches.

    rt = Runtime()                       # raises CudaUnavailableError without a GPU
    arena = rt.arena(weights_bytes, scratch_bytes)
    rt.launch("rmsnorm_f32", rows, 256, x, w, y, n, eps, pdl=True)
    rt.fork(); rt.launch(..., stream=rt.side); rt.join()    # side-stream work joined back with events
    rt.synchronize()

Work on the side stream overlaps the main stream between fork() and join(); both are plain event edges, so the
same calls work during graph capture (see graph.py). ds4py/cuda/emu_runtime.py's EmuRuntime has the same
interface and runs the same kernels on the CPU.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from ds4py.cuda.compiler import CU_DIR
from ds4py.cuda.devices import profile_for_device
from ds4py.cuda.driver import CudaError, Device, api, call, error_name
from ds4py.cuda.launch import KernelRegistry, launch
from ds4py.cuda.memory import Arena, DriverMemory, WeightUploader


class Runtime:
    def __init__(self, ordinal: int = 0, cu_dir: Path = CU_DIR, cache: Path | None | bool = True,
                 progress: Callable[[str], None] | None = None, defines: dict[str, int] | None = None):
        """defines: per-model shape constants (compiler.model_defines(cfg)); they reach NVRTC as -D values and
        are part of every cubin's cache key. Missing ones take the V4 Flash values."""
        d = api()
        self.device = Device.open(ordinal)
        self.profile = profile_for_device(self.device)     # launches are checked against it (registers included)
        self._bound = threading.local()
        self._bound.ok = True            # Device.open made the context current on this thread
        self.driver_version = int(call("cuDriverGetVersion"))
        self.kernels = KernelRegistry.load(self.device.arch, cu_dir, cache=cache, progress=progress, defines=defines,
                                           driver_version=self.driver_version)
        self.memory = DriverMemory(self.bind_thread)
        self.capturing = False
        flags = d.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.main = call("cuStreamCreate", flags)
        self.side = call("cuStreamCreate", flags)
        self.copy = call("cuStreamCreate", flags)
        no_timing = d.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._fork_event = call("cuEventCreate", no_timing)
        self._join_event = call("cuEventCreate", no_timing)

    def bind_thread(self) -> None:
        """Make this runtime's context current on the calling thread. A CUDA context is current per thread:
        a thread other than the creator (e.g. the server's engine worker) needs this once before any call.
        launch() does it on first use from a new thread."""
        if getattr(self._bound, "ok", False):
            return
        call("cuCtxSetCurrent", self.device.context)
        self._bound.ok = True

    def free_bytes(self) -> int:
        """Device memory free now (cuMemGetInfo): what a model's memory plan is checked against."""
        self.bind_thread()
        free, _total = call("cuMemGetInfo")
        return int(free)

    def launch(self, name: str, grid: Any, block: Any, *args: Any, smem: int = 0, stream: Any = None,
               pdl: bool = False) -> None:
        self.bind_thread()
        launch(self.kernels[name], grid, block, args, self.main if stream is None else stream, smem=smem, pdl=pdl,
               max_smem=self.device.smem_per_block_optin, profile=self.profile)

    def arena(self, weights_bytes: int, scratch_bytes: int = 64 << 20) -> Arena:
        """An arena in this device's memory; its arrays copy with this runtime's context bound."""
        return Arena(weights_bytes, scratch_bytes, allocator=self.memory)

    def uploader(self, chunk_bytes: int = 64 << 20) -> WeightUploader:
        """Chunked file/array upload on the copy stream through two pinned buffers."""
        return WeightUploader(self.copy, chunk_bytes, bind=self.bind_thread)

    def fork(self) -> None:
        """The side stream waits for everything issued on the main stream so far."""
        self.bind_thread()
        call("cuEventRecord", self._fork_event, self.main)
        call("cuStreamWaitEvent", self.side, self._fork_event, 0)

    def join(self) -> None:
        """The main stream waits for everything issued on the side stream so far."""
        self.bind_thread()
        call("cuEventRecord", self._join_event, self.side)
        call("cuStreamWaitEvent", self.main, self._join_event, 0)

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        self.memory.copy(dst, src, nbytes, self.main if stream is None else stream)

    def synchronize(self) -> None:
        self.bind_thread()
        for s in (self.main, self.side, self.copy):
            call("cuStreamSynchronize", s)
        self.memory.synchronize()

    # ---- graphs (driven by graph.StepGraph) ------------------------------------------------------------------
    def begin_capture(self) -> None:
        self.bind_thread()
        call("cuStreamBeginCapture", self.main, api().CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        self.capturing = True

    def end_capture(self) -> tuple[Any, Any]:
        """(graph, instantiated graph). A capture the driver invalidated (an illegal call during it, or work left
        on the side stream without a join) raises here."""
        self.capturing = False
        graph = call("cuStreamEndCapture", self.main)
        try:
            return graph, call("cuGraphInstantiate", graph, 0)
        except Exception:
            call("cuGraphDestroy", graph)
            raise

    def abort_capture(self) -> None:
        """Leave capture mode after a failed record(); the partial graph is destroyed."""
        self.capturing = False
        d = api()
        err, graph = d.cuStreamEndCapture(self.main)
        if err == d.CUresult.CUDA_SUCCESS:
            call("cuGraphDestroy", graph)
        elif err != d.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:   # invalidated: out of capture, no graph
            raise CudaError(f"cuStreamEndCapture failed: {error_name(d, err)}")

    def launch_graph(self, graph: tuple[Any, Any]) -> None:
        self.bind_thread()
        call("cuGraphLaunch", graph[1], self.main)

    def destroy_graph(self, graph: tuple[Any, Any]) -> None:
        self.bind_thread()
        call("cuGraphExecDestroy", graph[1])
        call("cuGraphDestroy", graph[0])

    def timer(self) -> "EventTimer":
        return EventTimer(self.main, bind=self.bind_thread)

    def close(self) -> None:
        self.synchronize()
        for e in (self._fork_event, self._join_event):
            call("cuEventDestroy", e)
        for s in (self.main, self.side, self.copy):
            call("cuStreamDestroy", s)
        self.kernels.unload()
        self.device.close()


class EventTimer:
    """GPU time between start() and stop() on one stream, in milliseconds (cuEventElapsedTime)."""

    def __init__(self, stream: Any, bind: Callable[[], None] | None = None):
        """bind: makes the stream's context current on the calling thread (Runtime.bind_thread): a timer
        created on one thread may be started or read on another."""
        self.stream = stream
        self.bind = bind or (lambda: None)
        self.bind()
        self.begin = call("cuEventCreate", 0)
        self.end = call("cuEventCreate", 0)

    def start(self) -> None:
        self.bind()
        call("cuEventRecord", self.begin, self.stream)

    def stop(self) -> float:
        self.bind()
        call("cuEventRecord", self.end, self.stream)
        call("cuEventSynchronize", self.end)
        return float(call("cuEventElapsedTime", self.begin, self.end))

    def close(self) -> None:
        self.bind()
        call("cuEventDestroy", self.begin)
        call("cuEventDestroy", self.end)
