"""The CUDA host code without a GPU.

1. `import ds4py`, the CUDA modules, the engine, the CLI and the server import without a driver or without
   cuda-bindings; asking for the backend then raises CudaUnavailableError with one sentence, `--backend cuda` on the
   CLI exits with that sentence, `auto` falls back to the reference, `cuda-emu` still runs (checked in subprocesses).
2. A stand-in driver runs the whole host path (device open, NVRTC + module load, launches with and without PDL,
   fork/join, graph capture and replay, arena growth, pinned chunked upload). Each call first goes through the
   REAL cuda.bindings function, whose argument conversion runs before it looks for libcuda: a wrong argument type
   raises TypeError there, so these tests check our calls against the installed binding's signatures. Only the
   result is faked (after the real call fails for want of a driver).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

BLOCK_CUDA = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError("blocked for the test: " + name)
sys.meta_path.insert(0, _Block())
"""

CHECK = """
import ds4py, ds4py.cuda, ds4py.cuda.runtime, ds4py.cuda.memory, ds4py.cuda.graph, ds4py.cuda.ops
from ds4py.errors import CudaUnavailableError
assert not any(m == "cuda" or m.startswith("cuda.") for m in sys.modules if m.startswith("cuda")) or ALLOW_CUDA
try:
    ds4py.cuda.runtime.Runtime()
except CudaUnavailableError as e:
    print("ERR", e)
else:
    print("NO ERROR")
"""


# under pytest-xdist on the worker that also runs tests/test_cuda_compile.py: the NVRTC build of every kernel
# (conftest's nvrtc_kernels, minutes) is made once and shared (conftest's standin_cache)
pytestmark = pytest.mark.xdist_group("nvrtc")


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def _one_sentence(out: str) -> str:
    line = out.strip()
    assert line.startswith("ERR "), out
    msg = line[4:]
    assert "\n" not in msg and "Traceback" not in msg and len(msg) < 200
    return msg


def test_without_cuda_bindings():
    r = _run("import sys\n" + BLOCK_CUDA + "ALLOW_CUDA = False\n" + CHECK)
    assert r.returncode == 0, r.stderr
    assert "cuda-python" in _one_sentence(r.stdout)


def test_without_driver():
    """No GPU visible: here libcuda is absent; on a GPU machine CUDA_VISIBLE_DEVICES='' hides every device."""
    r = _run("import sys\nALLOW_CUDA = True\n" + CHECK, env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    msg = _one_sentence(r.stdout)
    assert "driver" in msg or "GPU" in msg or "device" in msg


def _cli_without_cuda(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m ds4py ARGS` in a process where every `cuda` import fails (a sitecustomize installs the block)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK_CUDA)
    return subprocess.run([sys.executable, "-m", "ds4py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", **(env or {})})


def test_cli_server_and_engine_import_without_cuda_bindings():
    code = ("import sys\n" + BLOCK_CUDA +
            "import ds4py.__main__, ds4py.cli, ds4py.server, ds4py.server.app, ds4py.cuda.engine, ds4py.cuda.synth\n"
            "from ds4py.cli import serve, run, score, bench\n"
            "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')))")
    r = _run(code)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_cli_backends_without_cuda_bindings(golden, tmp_path):
    """--backend cuda: one sentence and exit 2; auto: the reference, saying why once; cuda-emu needs no
    cuda-python (the emulator is g++-built) and scores the same ids."""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(2, 7))
    model = str(golden / "ds4-tiny" / "tiny.gguf")
    outs = {}
    for backend in ("cuda", "auto", "cuda-emu"):
        out = tmp_path / f"{backend}.npy"
        r = _cli_without_cuda(tmp_path, "score", "-m", model, "--ids", str(ids), "--split", "3", "--out", str(out),
                              "--backend", backend)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        if backend == "cuda":
            assert r.returncode == 2 and not out.exists(), r.stderr
            assert len(lines) == 1 and "cuda-python" in lines[0] and "Traceback" not in r.stderr, r.stderr
            continue
        if backend == "cuda-emu":
            from ds4py.cuda import emu

            if emu.compiler() is None:
                continue                                       # the emulator needs g++ (skipped where absent)
        assert r.returncode == 0, r.stderr
        if backend == "auto":
            assert sum("using the reference backend" in ln for ln in lines) == 1, r.stderr
        outs[backend] = np.load(out)
    assert outs["auto"].shape == (3, 512)
    if "cuda-emu" in outs:
        np.testing.assert_allclose(outs["cuda-emu"], outs["auto"], rtol=0, atol=1e-3 * np.abs(outs["auto"]).max())


def test_import_is_lazy():
    r = _run("import sys, ds4py, ds4py.cuda.runtime, ds4py.cuda.graph\n"
             "print(sorted(m for m in sys.modules if m.startswith('cuda.bindings.driver')))")
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------------------------
# Stand-in driver

def _real_driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        pytest.skip("cuda-bindings is not installed")
    try:
        driver.cuInit(0)
    except Exception:
        return driver
    pytest.skip("a real driver is present: the stand-in would call it with fake handles (run tests/gpu instead)")


class StandInDriver:
    """Looks like cuda.bindings.driver. Calls the real binding (arguments converted and type-checked), expects it
    to fail finding libcuda, then returns a plausible success and records the call."""

    def __init__(self, real):
        self.real = real
        self.calls: list[tuple[str, tuple]] = []
        self.next_dev_ptr = 1 << 40
        self.host_buffers: dict[int, ctypes.Array] = {}
        self.freed: list[int] = []

    def __getattr__(self, name):
        real = getattr(self.real, name)
        if not name.startswith("cu") or not callable(real):
            return real
        return lambda *args: self._call(name, real, args)

    def _call(self, name, real, args):
        try:
            real(*args)
        except TypeError:
            raise
        except Exception as e:  # the driver library is missing: the arguments were accepted
            if "cuda" not in str(e).lower() and "driver" not in str(e).lower():
                raise
        self.calls.append((name, args))
        return self._result(name, args)

    def _result(self, name, args):
        d, ok = self.real, self.real.CUresult.CUDA_SUCCESS
        a = d.CUdevice_attribute
        attrs = {a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: 9, a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: 0,
                 a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: 132, a.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: 50 << 20,
                 a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 232448,
                 a.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: 2048,
                 a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: 233472}
        if name == "cuMemAlloc":
            ptr = self.next_dev_ptr
            self.next_dev_ptr += (args[0] + (1 << 20)) // (1 << 20) * (1 << 20)
            return ok, d.CUdeviceptr(ptr)
        if name == "cuMemFree":
            self.freed.append(int(args[0]))
        if name == "cuMemHostAlloc":
            buf = (ctypes.c_uint8 * args[0])()
            self.host_buffers[ctypes.addressof(buf)] = buf
            return ok, ctypes.addressof(buf)
        simple = {
            "cuDeviceGetCount": 1, "cuDeviceGet": d.CUdevice(0), "cuDevicePrimaryCtxRetain": d.CUcontext(),
            "cuDeviceGetName": b"Stand-in H200" + b"\0" * 243, "cuDeviceTotalMem": 141 << 30,
            "cuModuleLoadData": d.CUmodule(), "cuModuleGetFunction": d.CUfunction(), "cuDriverGetVersion": 13000,
            "cuStreamCreate": d.CUstream(), "cuEventCreate": d.CUevent(), "cuStreamEndCapture": d.CUgraph(),
            "cuGraphInstantiate": d.CUgraphExec(), "cuEventElapsedTime": 1.0,
            "cuGetErrorName": b"CUDA_ERROR_STANDIN",
        }
        if name == "cuMemGetInfo":
            return ok, 140 << 30, 141 << 30
        if name == "cuDeviceGetAttribute":
            return ok, attrs[args[0]]
        if name == "cuFuncGetAttribute":   # 1024 threads, 64 bytes of static shared memory
            return ok, 1024 if args[0] == d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK else 64
        if name in simple:
            return ok, simple[name]
        return (ok,)

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]


@pytest.fixture
def standin(monkeypatch, standin_cache):
    from ds4py.cuda import driver

    fake = StandInDriver(_real_driver())
    monkeypatch.setattr(driver, "_driver", fake)
    monkeypatch.setenv("DS4PY_CACHE_DIR", str(standin_cache))
    return fake


@pytest.fixture
def rt(standin):
    from ds4py.cuda import compiler
    from ds4py.cuda.runtime import Runtime

    try:
        compiler.nvrtc_version()
    except compiler.NvrtcUnavailableError as e:
        pytest.skip(str(e))
    return Runtime(progress=lambda m: None)


def test_runtime_opens_device_and_loads_every_kernel(rt, standin):
    assert rt.device.arch == "sm_90" and rt.device.name == "Stand-in H200" and rt.device.sm_count == 132
    n_files = len(list((REPO / "cu").glob("*.cu")))
    assert standin.names().count("cuModuleLoadData") == n_files
    assert standin.names().count("cuModuleGetFunction") == len(rt.kernels.kernels)
    assert {"rmsnorm_f32", "gemv_q8_0", "argmax_f32", "hc_mix_f16", "sample_f32"} <= set(rt.kernels.kernels)


def _launch_configs(standin):
    return [args[0] for n, args in standin.calls if n == "cuLaunchKernelEx"]


def test_launch_with_and_without_pdl(rt, standin):
    from ds4py.cuda import ops
    from ds4py.cuda.memory import Arena

    arena = Arena(1 << 20, 1 << 20)
    arena.begin_step()
    W = arena.weights((64, 256), np.float16)
    x, y = arena.scratch(256, np.float32), arena.scratch(64, np.float32)
    ops.gemv_f16(rt, W, x, y, 64, 256)
    ops.gemv_f16(rt, W, x, y, 64, 256, pdl=True)
    plain, pdl = _launch_configs(standin)
    assert plain.numAttrs == 0 and pdl.numAttrs == 1
    d = standin.real
    assert pdl.attrs[0].id == d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert pdl.attrs[0].value.programmaticStreamSerializationAllowed == 1
    assert (pdl.gridDimX, pdl.blockDimX) == (16, 32)      # 16 groups of 4 rows, one warp each (few row groups: spread over SMs)


def context_sets_in_a_thread(rt, standin, work) -> list:
    """The cuCtxSetCurrent calls made while `work` runs on a new thread."""
    import threading

    before = standin.names().count("cuCtxSetCurrent")
    t = threading.Thread(target=work)
    t.start()
    t.join()
    return [args for n, args in standin.calls if n == "cuCtxSetCurrent"][before:]


def test_launch_from_another_thread_binds_the_context_once(rt, standin):
    """A context is current per thread: the engine worker thread must make it current before launching."""
    from ds4py.cuda import ops
    from ds4py.cuda.memory import Arena

    arena = Arena(1 << 20, 1 << 20)
    arena.begin_step()
    W = arena.weights((64, 256), np.float16)
    x, y = arena.scratch(256, np.float32), arena.scratch(64, np.float32)
    before = standin.names().count("cuCtxSetCurrent")
    ops.gemv_f16(rt, W, x, y, 64, 256)                      # creator thread: already current
    assert standin.names().count("cuCtxSetCurrent") == before

    def worker():
        ops.gemv_f16(rt, W, x, y, 64, 256)
        ops.gemv_f16(rt, W, x, y, 64, 256)

    sets = context_sets_in_a_thread(rt, standin, worker)
    assert len(sets) == 1 and sets[0][0] == rt.device.context


def test_q8_launch_uses_dynamic_smem_and_raises_limit(rt, standin):
    from ds4py.cuda import ops
    from ds4py.cuda.memory import Arena

    arena = Arena(1 << 22, 1 << 20)
    arena.begin_step()
    W = arena.weights(64 * 4096 // 32 * 34, np.uint8)
    x, y = arena.scratch(4096, np.float32), arena.scratch(64, np.float32)
    from ds4py.cuda.ops.gemv import Q8_WARP_SMEM

    small = (48 << 10) // Q8_WARP_SMEM                       # the most warps whose ring fits 48 KB
    ops.gemv_q8_0(rt, W, x, y, 64, 4096, warps=small)
    ops.gemv_q8_0(rt, W, x, y, 64, 4096, warps=16)           # 16 * Q8_WARP_SMEM > 48 KB: needs the opt-in
    a, b = _launch_configs(standin)
    assert a.sharedMemBytes == small * Q8_WARP_SMEM and b.sharedMemBytes == 16 * Q8_WARP_SMEM
    assert standin.names().count("cuFuncSetAttribute") == 1          # only the launch above 48 KB opts in


def test_wrong_arguments_never_reach_the_driver(rt, standin):
    from ds4py.cuda.args import KernelArgumentError

    before = len(standin.calls)
    with pytest.raises(KernelArgumentError, match="takes 5 arguments"):
        rt.launch("rmsnorm_f32", 1, 256, 0, 0, 0, 4)
    with pytest.raises(KernelArgumentError, match="host numpy array"):
        rt.launch("rmsnorm_f32", 1, 256, np.zeros(4, np.float32), None, 0, 4, 1e-6)
    with pytest.raises(KernelArgumentError, match="no kernel named"):
        rt.launch("rmsnorm", 1, 256)
    assert "cuLaunchKernelEx" not in standin.names()[before:]


def test_fork_join_records_events(rt, standin):
    rt.fork()
    rt.join()
    assert standin.names()[-4:] == ["cuEventRecord", "cuStreamWaitEvent", "cuEventRecord", "cuStreamWaitEvent"]


def test_graph_replay_never_recaptures_until_scratch_moves(rt, standin):
    from ds4py.cuda import ops
    from ds4py.cuda.graph import StepGraph
    from ds4py.cuda.memory import Arena

    arena = Arena(1 << 20, 4096)
    arena.begin_step()
    slot = arena.weights(2, np.int32)
    slot.readonly = False
    table = arena.weights((16, 64), np.float16)

    def record():
        out = arena.scratch(64, np.float32)
        ops.embed(rt, ops.Embedding(table), slot, out, 1)
        rt.fork()
        ops.rmsnorm(rt, out, out, 64, (None, 1e-6), stream=rt.side)
        rt.join()

    g = StepGraph(rt, record, slot, arena)
    for tok in (3, 5, 7):
        arena.begin_step()
        g.replay([tok, 0])
    names = standin.names()
    assert g.captures == 1 and names.count("cuStreamBeginCapture") == 1 and names.count("cuGraphLaunch") == 3
    # one copy of the step's values per replay, right before each graph launch on the main stream
    i = names.index("cuGraphLaunch")
    assert names[i - 1] == "cuMemcpyHtoDAsync" and "cuMemsetD32Async" not in names[i - 3: i]
    copies = [args for n, args in standin.calls if n == "cuMemcpyHtoDAsync" and int(args[0]) == slot.ptr]
    assert [a[2] for a in copies] == [8, 8, 8]
    # scratch growth moves the buffers: the next replay captures again
    assert arena.begin_step(1 << 16)
    g.replay([9, 1])
    assert g.captures == 2 and standin.names().count("cuGraphExecDestroy") == 1
    with pytest.raises(Exception, match="int32"):
        g.replay([2**31, 0])


def test_pinned_chunked_upload(standin):
    from ds4py.cuda.memory import Arena, WeightUploader

    arena = Arena(1 << 20)
    dst = arena.weights(1000, np.uint8)
    up = WeightUploader(standin.real.CUstream(), chunk_bytes=256)
    src = np.arange(1000, dtype=np.uint32).astype(np.uint8)
    staged = []
    real_call = standin._call

    def spy(name, real, args):
        if name == "cuMemcpyHtoDAsync":   # what sits in the pinned buffer at the moment of the copy
            staged.append((int(args[0]) - dst.ptr, bytes((ctypes.c_uint8 * args[2]).from_address(args[1]))))
        return real_call(name, real, args)

    standin._call = spy
    up.upload(src, dst, progress=False)
    assert [o for o, _ in staged] == [0, 256, 512, 768]
    assert b"".join(b for _, b in staged) == src.tobytes()
    assert len(standin.host_buffers) == 2                 # bounded: two pinned chunks, whatever the size
    assert standin.names().count("cuEventSynchronize") == 2   # chunks 3 and 4 wait for their buffer
    with pytest.raises(Exception, match="do not fit"):
        up.upload(np.zeros(2000, np.uint8), dst, progress=False)
    up.close()


def test_upload_file_reads_through_mmap(standin, tmp_path):
    from ds4py.cuda.memory import Arena, WeightUploader

    f = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
    f.write_bytes(b"HEADER" + data.tobytes())
    arena = Arena(1 << 20)
    dst = arena.weights(5000, np.uint8)
    up = WeightUploader(standin.real.CUstream(), chunk_bytes=1024)
    got = bytearray()
    real_call = standin._call

    def spy(name, real, args):
        if name == "cuMemcpyHtoDAsync":
            got.extend(bytes((ctypes.c_uint8 * args[2]).from_address(args[1])))
        return real_call(name, real, args)

    standin._call = spy
    up.upload_file(str(f), 6, 5000, dst, progress=False)
    assert bytes(got) == data.tobytes()


# ---------------------------------------------------------------------------------------------------------------
# Arena bookkeeping with a fake allocator (no driver at all)

class FakeAllocator:
    def __init__(self):
        self.live: dict[int, int] = {}
        self.next = 1 << 32

    def alloc(self, n):
        p = self.next
        self.next += (n + 4095) // 4096 * 4096 + 4096
        self.live[p] = n
        return p

    def free(self, p):
        del self.live[p]


def test_arena_alignment_no_overlap_and_reuse():
    from ds4py.cuda.memory import ALIGN, Arena

    fa = FakeAllocator()
    arena = Arena(10_000, 4096, allocator=fa)
    w = [arena.weights(n, np.uint8) for n in (1, 300, 17, 1000)]
    assert all(a.ptr % ALIGN == 0 and a.readonly for a in w)
    spans = sorted((a.ptr, a.ptr + a.nbytes) for a in w)
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
    with pytest.raises(Exception, match="weights region"):
        arena.weights(10_000, np.uint8)
    with pytest.raises(Exception, match="begin_step"):
        arena.scratch(4, np.float32)
    arena.begin_step()
    s1 = [arena.scratch(n, np.float32) for n in (10, 100, 7)]
    spans = sorted((a.ptr, a.ptr + a.nbytes) for a in s1)
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
    assert not arena.begin_step()
    s2 = [arena.scratch(n, np.float32) for n in (10, 100, 7)]
    assert [a.ptr for a in s2] == [a.ptr for a in s1]      # the same memory reused, step after step


def test_arena_grows_by_doubling_only_between_steps():
    from ds4py.cuda.memory import Arena

    fa = FakeAllocator()
    arena = Arena(1024, 4096, allocator=fa)
    arena.begin_step()
    a = arena.scratch(3000, np.uint8)
    with pytest.raises(Exception, match="grows to"):
        arena.scratch(3000, np.uint8)                        # mid-step: refuse, remember the need
    assert arena.scratch_region.capacity == 4096 and arena.generation == 0
    assert a.ptr == arena.scratch_region.base                # nothing moved under the step
    assert arena.begin_step()                                # between steps: grow to cover the failed ask
    assert arena.scratch_region.capacity == 8192 and arena.generation == 1
    assert len(fa.live) == 2                                 # the old scratch was freed
    arena.scratch(3000, np.uint8), arena.scratch(3000, np.uint8)
    assert arena.begin_step(70_000) and arena.scratch_region.capacity == 131072 and arena.generation == 2
    assert not arena.begin_step(100)
    arena.close()
    assert fa.live == {}


def test_upload_gguf_places_every_tensor(standin, golden):
    """The tiny model's whole tensor span goes up in chunks; each tensor is a view at its own offset."""
    from ds4py.cuda.memory import Arena, WeightUploader
    from ds4py.cuda.gguf_upload import data_span, upload_gguf, weights_bytes
    from ds4py.gguf import GGUFFile

    g = GGUFFile(golden / "ds4-tiny" / "tiny.gguf")
    arena = Arena(weights_bytes(g))
    up = WeightUploader(standin.real.CUstream(), chunk_bytes=4 << 20)
    device = bytearray()
    real_call = standin._call

    def spy(name, real, args):
        if name == "cuMemcpyHtoDAsync":
            assert int(args[0]) - arena.weights_region.base == len(device)   # in order, no gaps
            device.extend(bytes((ctypes.c_uint8 * args[2]).from_address(args[1])))
        return real_call(name, real, args)

    standin._call = spy
    tensors = upload_gguf(g, arena, up, progress=False)
    start, _ = data_span(g)
    base = arena.weights_region.base
    assert set(tensors) == set(g.tensors)
    for name, t in g.tensors.items():
        d = tensors[name]
        rel = d.array.ptr - base
        assert d.array.nbytes == t.nbytes and rel == t.offset - start
        assert bytes(device[rel: rel + t.nbytes]) == t.raw_bytes().tobytes(), name
        if d.qtype in ("F16", "F32"):
            assert d.array.shape == t.shape and d.array.ptr % 16 == 0
    assert {d.qtype for d in tensors.values()} >= {"F16", "F32", "Q8_0"}


# ---------------------------------------------------------------------------------------------------------------
# Runtime repairs: driver version, context binding, async uploads, shared-memory limits, failed captures

def test_a_driver_older_than_nvrtc_is_refused_in_one_sentence(standin, monkeypatch):
    from ds4py.cuda import compiler
    from ds4py.cuda.runtime import Runtime
    from ds4py.errors import CudaUnavailableError

    try:
        major = compiler.nvrtc_version()[0]
    except compiler.NvrtcUnavailableError as e:
        pytest.skip(str(e))
    real_result = standin._result
    monkeypatch.setattr(standin, "_result", lambda name, args: (standin.real.CUresult.CUDA_SUCCESS,
                                                                (major - 1) * 1000 + 40)
                        if name == "cuDriverGetVersion" else real_result(name, args))
    with pytest.raises(CudaUnavailableError) as e:
        Runtime(progress=lambda m: None)
    msg = str(e.value)
    assert f"CUDA {major - 1}.4" in msg and "NVRTC" in msg and "\n" not in msg
    assert "cuModuleLoadData" not in standin.names()          # refused before loading any module


def test_uploads_and_fork_join_bind_the_context_on_other_threads(rt, standin):
    arena = rt.arena(1 << 20, 1 << 20)
    arena.begin_step()
    x = arena.scratch(64, np.float32)

    def worker():
        x.upload(np.zeros(64, np.float32))
        x.download()
        rt.fork()
        rt.join()

    sets = context_sets_in_a_thread(rt, standin, worker)
    assert len(sets) == 1 and sets[0][0] == rt.device.context


def test_timer_and_token_reader_bind_the_context_on_other_threads(rt, standin):
    """An EventTimer or a TokenReader made on one thread and used on another (the server's engine worker) make
    the context current there before their first driver call."""
    from ds4py.cuda.generation import TokenReader

    timer, reader = rt.timer(), TokenReader(rt)
    arena = rt.arena(1 << 20, 1 << 20)
    arena.begin_step()
    src = arena.scratch(1, np.int32)

    def worker():
        timer.start()
        timer.stop()
        i = reader.enqueue(src)
        reader.wait(i)
        reader.close()
        timer.close()

    sets = context_sets_in_a_thread(rt, standin, worker)
    assert len(sets) == 1 and sets[0][0] == rt.device.context


def test_async_upload_keeps_its_host_buffer_until_done(rt, standin):
    import gc
    import weakref

    arena = rt.arena(1 << 20, 1 << 20)
    arena.begin_step()
    x = arena.scratch(1000, np.float32)
    host = np.arange(1000, dtype=np.float32)
    probe = weakref.ref(host)
    x.upload(host, stream=rt.copy)
    del host
    gc.collect()
    assert probe() is not None                              # still referenced: the copy may not have run yet
    i = max(i for i, (n, _) in enumerate(standin.calls) if n == "cuMemcpyHtoDAsync")
    assert standin.names()[i + 1: i + 3] == ["cuEventCreate", "cuEventRecord"]
    rt.synchronize()
    gc.collect()
    assert probe() is None and not rt.memory._pending       # released once its event completed


def test_static_plus_dynamic_shared_memory_is_checked(rt, standin):
    from ds4py.cuda.args import KernelArgumentError

    arena = rt.arena(1 << 22, 1 << 20)
    arena.begin_step()
    W = arena.weights(64 * 4096 // 32 * 34, np.uint8)
    x, y = arena.scratch(4096, np.float32), arena.scratch(64, np.float32)
    k = rt.kernels["gemv_q8_0"]
    assert k.static_smem == 64                              # what the stand-in reports
    limit = rt.device.smem_per_block_optin
    with pytest.raises(KernelArgumentError, match=r"\+ 64 static"):
        rt.launch("gemv_q8_0", 1, 32, W, None, None, None, 64, 0, 0, 0, y, None, None, None, x, 4096, 0, None,
                  0.0, 0, smem=limit - 63)


def test_a_failed_capture_is_never_swallowed(rt, standin, monkeypatch):
    from ds4py.cuda.graph import CaptureError, StepGraph
    from ds4py.errors import Ds4Error

    arena = rt.arena(1 << 20, 1 << 20)
    slot = arena.weights(2, np.int32)
    slot.readonly = False

    def bad_record():
        raise Ds4Error("record failed")

    g = StepGraph(rt, bad_record, slot)
    with pytest.raises(Ds4Error, match="record failed"):
        g.capture()
    assert standin.names()[-2:] == ["cuStreamEndCapture", "cuGraphDestroy"]   # out of capture, partial graph gone
    assert not rt.capturing and g.graph is None
    # the driver invalidates the capture (e.g. a host sync inside it): end_capture's error is raised
    real_result = standin._result
    monkeypatch.setattr(standin, "_result", lambda name, args: (
        standin.real.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,) if name == "cuStreamEndCapture"
        else real_result(name, args))
    with pytest.raises(CaptureError, match="CAPTURE_INVALIDATED|capture failed"):
        StepGraph(rt, lambda: None, slot).capture()
