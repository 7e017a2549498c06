"""Background jobs for the test session: self-contained, expensive work that a few tests only wait for.

CI has 2 cores and pytest runs the tests on one. The NVRTC builds of every kernel for every arch
(tests/test_cuda_compile.py), the golden tests re-run under another BLAS kernel (tests/test_blas_kernels.py) and
the GPU tests run on the emulator (tests/test_cuda_gpu_tests_on_emulator.py) each run in a process of their own
and need nothing from the tests around them, so they run on the second core: tests/conftest.py starts the jobs
that the selected tests need, one after another on one worker thread, as the session begins, and moves the tests
that wait for a job (those using a `job_<name>` fixture) to the end of the session. The work and what the tests
assert about it are unchanged; only when it runs moves. A job that fails or skips raises in the test waiting for it.
A warm-up job goes first when many CUDA test files are selected: the emulator's g++ builds of every kernel file
(nobody waits for it; a test needing a library still being built waits for that build, not for a second one).

Each job runs in a child process (so no monkeypatch of the main process can reach it) started through
`run_process`, which the session terminates if it ends early (-x, Ctrl-C).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
NVRTC_ARCHS = ("sm_121", "sm_90", "sm_90a")

# name -> "module:function"; the function takes a fresh work directory and returns the job's result.
JOBS = {
    "emu_builds": "session_jobs:emu_builds",
    "nvrtc_kernels": "session_jobs:nvrtc_kernels",
    "blas_rerun": "test_blas_kernels:blas_rerun_job",
    "gpu_tests_on_emulator": "test_cuda_gpu_tests_on_emulator:gpu_tests_job",
}

# warm-up jobs nobody waits for, started when the selected tests span at least WARMUP_FILES files whose names
# start with one of these prefixes (a run of one or two files builds just what it needs, in the foreground)
WARMUPS = {"emu_builds": ("test_cu_emu", "test_cuda")}
WARMUP_FILES = 5

_lock = threading.Lock()
_futures: dict[str, concurrent.futures.Future] = {}
_procs: set[subprocess.Popen] = set()
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_stopping = False


def _job(name: str) -> Callable[[Path], Any]:
    module, func = JOBS[name].split(":")
    return getattr(importlib.import_module(module), func)


def start(names: list[str], workdir: Callable[[str], Path]) -> None:
    """Queue the named jobs (in JOBS order) on the background worker; workdir(name) gives each a fresh folder."""
    global _executor
    with _lock:
        for name in (n for n in JOBS if n in names and n not in _futures):
            if _executor is None:
                _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ds4py-session-job")
            d = workdir(name)
            _futures[name] = _executor.submit(_job(name), d)


def scheduled(name: str) -> bool:
    return name in _futures


def result(name: str, workdir: Callable[[str], Path]) -> Any:
    """The job's result, waiting for it; a job nobody scheduled runs here and now (same work, in the foreground)."""
    with _lock:
        fut = _futures.get(name)
        if fut is None:
            fut = _futures[name] = concurrent.futures.Future()
            run_here = True
        else:
            run_here = False
    if run_here:
        try:
            fut.set_result(_job(name)(workdir(name)))
        except BaseException as e:      # pytest's skip and fail are BaseExceptions
            fut.set_exception(e)
    return fut.result()


def stop() -> None:
    """End of session: drop jobs not started, kill the processes of running ones."""
    global _stopping, _executor
    _stopping = True
    with _lock:
        for fut in _futures.values():
            fut.cancel()
        procs = [p for p in _procs if p.poll() is None]
        for p in procs:
            p.terminate()           # the children clean up (g++ temporaries, pytest's) on SIGTERM
        ex, _executor = _executor, None
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    if ex is not None:
        ex.shutdown(wait=True)
    _futures.clear()
    _stopping = False


def run_process(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw), killed by stop()."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    with _lock:
        _procs.add(p)
    try:
        if _stopping:
            p.kill()
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    finally:
        with _lock:
            _procs.discard(p)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


# ---- the emulator warm-up -------------------------------------------------------------------------------------
def emu_builds(work: Path) -> int:
    """g++ builds of every cu/*.cu for the emulator with EmuRuntime's default -D defines, into the session's
    emulator cache (the same libraries the kernel tests build on first use: ds4py.cuda.emu's build lock makes a
    test that needs one still being built wait for it rather than build it twice). Returns the exit status."""
    return run_process([sys.executable, __file__, "emu"], timeout=1800, env={**os.environ, "PYTHONPATH": str(REPO)},
                       stdin=subprocess.DEVNULL).returncode


def _emu_child() -> int:
    sys.path.insert(0, str(REPO))
    from ds4py.cuda import compiler, emu
    from ds4py.cuda.emu_runtime import EMU_OPTIONS

    if emu.compiler() is None:
        return 0
    for src in compiler.kernel_sources():
        emu.build(src, compiler.file_options(src, None, EMU_OPTIONS))
    return 0


# ---- the NVRTC job ---------------------------------------------------------------------------------------------
NO_NVRTC = 3      # the child's exit status when NVRTC cannot load (the message on stdout)


def nvrtc_kernels(work: Path) -> dict:
    """Every cu/*.cu compiled for every arch of NVRTC_ARCHS into a fresh cache (work/ds4py-cache), by
    compiler.compile_all in a child process: {"cache": Path, "compiled": {arch: {stem: CompiledModule}}}.
    Raises NvrtcUnavailableError when NVRTC cannot load."""
    from ds4py.cuda import compiler

    cache, out = work / "ds4py-cache", work / "compiled.pickle"
    r = run_process([sys.executable, __file__, "nvrtc", str(REPO / "cu"), str(cache), str(out), *NVRTC_ARCHS],
                    timeout=3600, env={**os.environ, "PYTHONPATH": str(REPO)})
    if r.returncode == NO_NVRTC:
        raise compiler.NvrtcUnavailableError(r.stdout.strip())
    if r.returncode != 0:
        raise RuntimeError(f"the NVRTC job failed (exit {r.returncode}):\n{r.stdout[-4000:]}{r.stderr[-6000:]}")
    return {"cache": cache, "compiled": pickle.loads(out.read_bytes())}


def _nvrtc_child(cu: str, cache: str, out: str, *archs: str) -> int:
    sys.path.insert(0, str(REPO))
    from ds4py.cuda import compiler

    try:
        compiler.nvrtc_version()
    except compiler.NvrtcUnavailableError as e:
        print(e)
        return NO_NVRTC
    compiled = {a: compiler.compile_all(a, Path(cu), cache=Path(cache), progress=lambda m: None) for a in archs}
    Path(out).write_bytes(pickle.dumps(compiled))
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))     # unwind: finally blocks remove temporaries
    if sys.argv[1:2] == ["nvrtc"]:
        sys.exit(_nvrtc_child(*sys.argv[2:]))
    if sys.argv[1:] == ["emu"]:
        sys.exit(_emu_child())
    sys.exit(f"usage: {sys.argv[0]} nvrtc CU_DIR CACHE OUT ARCH... | emu")
