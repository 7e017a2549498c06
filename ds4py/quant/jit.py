"""Compiled CPU kernels (numba) for the decode products, behind one small interface.

    if jit.available():
        y = jit.matmul(qtype, raw, x, threads)        # raw uint8 [R, row_nbytes] (GGUF rows), x [T, C] -> [T, R]

numba is a runtime dependency, yet an environment may lack it (or have one that fails to import): `available()`
says so once, with the reason, and the caller falls back to the numpy fused kernels (ds4py.quant.dot).

The kernels (ds4py.quant.jit_kernels) are compiled on first use and cached on disk: under $NUMBA_CACHE_DIR when
set, else ~/.cache/ds4py/numba/<12 hex digits of the kernel sources' hash> (numba's default, a __pycache__ beside
the source, is not writable when the package is installed read-only, and one shared folder lets every test process
reuse one compile; the hash keeps an edited helper that another module inlines from replaying stale code). A first
compile takes seconds per kernel: a line on stderr says so first (or, when the cache has an entry that turns
out stale, once the call has taken a few seconds).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
from ds4py.ggml_types import GGMLQuantizationType as Q

F32 = np.float32
FORMATS = (Q.Q8_0, Q.F16, Q.IQ2_XXS, Q.Q2_K, Q.Q4_K, Q.MXFP4)
_INTS = {int(q) for q in FORMATS}
PROGRESS_AFTER_S = 3.0

_state: dict = {}
_lock = threading.Lock()          # numba's workqueue threading layer must not be entered by two threads at once
_init_lock = threading.Lock()
_announced: set[str] = set()


# the modules numba compiles kernels from, helpers inlined across them included: numba's disk cache checks only the
# kernel's own file, so an edit to a helper in another of them (jit_i8_kernels' unpacking, inlined by the tiled
# kernels; jit_neon's, by jit_decode) would otherwise replay stale machine code
_KERNEL_SOURCES = ("iq2.py", "isa.py", "jit_decode.py", "jit_i8_gemm_kernels.py", "jit_i8_kernels.py",
                   "jit_kernels.py", "jit_neon.py", "jit_q8_0_vnni.py", "jit_spin.py", "mxfp4.py")
_source_tag: list[str] = []


def source_tag(folder: Path | None = None) -> str:
    """12 hex digits of the kernel sources' SHA-256: the default cache's subfolder, new whenever a source changes."""
    import hashlib

    if folder is None and _source_tag:
        return _source_tag[0]
    h = hashlib.sha256()
    for name in _KERNEL_SOURCES:
        h.update(name.encode() + b"\0" + ((folder or Path(__file__).parent) / name).read_bytes())
    tag = h.hexdigest()[:12]
    if folder is None:
        _source_tag.append(tag)
    return tag


def cache_dir() -> str:
    """$NUMBA_CACHE_DIR when set (the caller's folder, as given), else ~/.cache/ds4py/numba/<source_tag()>."""
    return os.environ.get("NUMBA_CACHE_DIR") or str(Path.home() / ".cache" / "ds4py" / "numba" / source_tag())


def _load():
    """The kernel module and the tables it reads, or the reason numba is unusable (once per process)."""
    if "mod" in _state or "error" in _state:
        return _state.get("mod")
    with _init_lock:
        if "mod" in _state or "error" in _state:
            return _state.get("mod")
        return _import()


def _import():
    os.environ.setdefault("NUMBA_CACHE_DIR", cache_dir())
    # numba's own thread pool (workqueue): its idle workers sleep, where OpenMP's spin for milliseconds after
    # every parallel region: with ~150 short kernels per decode token that spinning doubled the CPU time per
    # token (1.4 s vs 0.75 s measured at 2 threads on a 4-layer real-width file). Not re-entrant: _lock.
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
    try:
        import numba
        if (numba.config.CACHE_DIR != os.environ["NUMBA_CACHE_DIR"]
                or numba.config.THREADING_LAYER != os.environ["NUMBA_THREADING_LAYER"]):   # imported before us
            numba.core.config.reload_config()
        from ds4py.quant import iq2, jit_decode, jit_kernels, jit_spin, mxfp4
    except Exception as e:                                             # missing, or broken (llvmlite mismatch)
        _state["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        return None
    _state["numba"] = numba
    _state["f16"] = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F32)
    _state["grid"] = np.ascontiguousarray(iq2.GRID, dtype=F32)
    _state["signs"] = np.ascontiguousarray(iq2.SIGNS, dtype=F32)
    _state["e8m0"] = mxfp4.e8m0_half(np.arange(256)).astype(F32)
    _state["kvalues"] = mxfp4.KVALUES.astype(F32)
    _state["spin_mod"], _state["spin"], _state["publish"] = jit_spin, jit_spin.reached, jit_spin.publish_then_wait
    _state["mod"] = jit_kernels
    _state["dec"] = jit_decode
    return jit_kernels


def loaded() -> bool:
    """Whether the kernels are loaded already (numba imported by an earlier compiled product); never imports."""
    return "mod" in _state


def available() -> bool:
    return _load() is not None


def importable() -> bool:
    """Whether numba looks importable, without importing it (the import takes ~0.2 s of CPU, 0.5 s on a busy
    machine: a model open leaves it to the first compiled product). False once an import has failed."""
    if "mod" in _state:
        return True
    if "error" in _state:
        return False
    import importlib.util

    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError):
        return False


def unavailable_reason() -> str | None:
    _load()
    return _state.get("error")


def supported(qtype) -> bool:
    return int(qtype) in _INTS


# the row lengths each kernel takes: a multiple of this many weights (the format's own block: every row the
# format allows; F16 any length)
_ROW_MULTIPLE = {int(Q.Q8_0): 32, int(Q.F16): 1, int(Q.IQ2_XXS): 256, int(Q.Q2_K): 256, int(Q.Q4_K): 256,
                 int(Q.MXFP4): 32}
VQ_ROW_MULTIPLE = 64


def takes(qtype, cols: int) -> bool:
    """Whether the compiled kernel of `qtype` takes rows of `cols` weights (callers fall back otherwise)."""
    m = _ROW_MULTIPLE.get(int(qtype))
    return m is not None and cols > 0 and cols % m == 0


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: the mapped file's rows are read-only, so every caller gets the same compiled variant."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _cached(fn) -> bool:
    """Whether numba's disk cache holds an index for this kernel (then a call loads it instead of compiling)."""
    try:
        return os.path.exists(fn._cache._cache_file._index_path)
    except AttributeError:                  # numba's internals moved: the timer below still speaks up
        return False


def _call(name: str, fn, args: tuple, threads: int, pool: bool = True) -> None:
    """fn(*args), announcing a first compile; pool=False: a serial kernel, run on this thread without numba's
    pool (or its lock); a pooled `<name>_dec` of jit_decode runs as `<name>_grab` on this thread and the crew."""
    numba = _state["numba"]
    n = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))
    grab = _state["dec"].GRAB.get(name) if pool and CREW and n > 1 and not (AUTO and host_busy()) else None
    timer = None
    key = name if grab is None else f"{name} (crew)"
    if key not in _announced:               # first call in this process: a compile (or a cache load) may follow
        _announced.add(key)
        if not _cached(grab or fn):
            print(f"ds4py: compiling the CPU kernel {name} (first use: seconds; then cached under {cache_dir()})",
                  file=sys.stderr, flush=True)
        else:                                # cached, but maybe stale (source changed) or for another CPU
            late = (f"ds4py: the first call of the CPU kernel {name} is taking a while (recompiling a stale entry "
                    f"of {cache_dir()}, or reading its first weights from disk)")
            timer = threading.Timer(PROGRESS_AFTER_S, lambda: print(late, file=sys.stderr, flush=True))
            timer.daemon = True
            timer.start()
    try:
        if not pool:
            fn(*args)
            return
        with _lock:
            if grab is None:
                numba.set_num_threads(n)
                fn(*args)
            else:
                _crew.run(grab, _grab_args(name, args), n - 1)
    finally:
        if timer is not None:
            timer.cancel()


# The pooled decode kernels (jit_decode's `<name>_dec`) run on this thread and helper threads of ours rather than
# on numba's pool (each thread runs `<name>_grab`: the same pieces from one counter, the same bits). numba's launch
# wakes two sleeping workers while the calling thread sleeps (~0.1 ms a call on a 2-core host, 29 calls a decode
# token); here the caller works at once and posts the job to one helper. syn4 at 2 threads, tokens alternating in
# one process with the machine's other load held off (autogroup nice -19): 0.66-0.85x numba's wall a token
# (per-pair median). $DS4PY_CREW=0: numba's pool (notes/s6dec.md).
CREW = os.environ.get("DS4PY_CREW", "auto") != "0"
# $DS4PY_CREW=auto (the default): numba's pool while the host is busy, the crew otherwise. In paired A/Bs at load
# 2.6-15 on 2 cores (bench/cpu_crew_ab.py, seventh session) numba's pool took 0.62-0.97x the crew's wall a token at
# the same CPU (likely, not measured: its workers are native threads, where the crew's helper is a Python thread
# that takes the GIL a few times a call, and under load a wait for the GIL is a wait for the scheduler; pinning
# the two threads to two cores did not help). Busy: the 1-minute load
# average (which counts this process's own kernel threads) above the usable CPUs + BUSY_MARGIN, read at most every
# BUSY_EVERY_S. $DS4PY_CREW=1: the crew always.
AUTO = os.environ.get("DS4PY_CREW", "auto") == "auto"
BUSY_MARGIN = 1.5
BUSY_EVERY_S = 0.5
_busy = [0.0, False]                          # when last read, and the verdict


def host_busy() -> bool:
    """Whether other processes load this host (the load average above the usable CPUs + BUSY_MARGIN)."""
    now = time.monotonic()
    if now - _busy[0] >= BUSY_EVERY_S:
        try:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            _busy[1] = os.getloadavg()[0] > cpus + BUSY_MARGIN
        except OSError:                       # no load average here: the crew
            _busy[1] = False
        _busy[0] = now
    return _busy[1]
# Under other load a helper that sleeps between calls is woken late, often onto the caller's own core, and a caller
# that waited for it lost what the helper was meant to save (1.02-1.12x llama.cpp's time at load 3-5, 0.90x quiet).
# So: a helper that has not started when the caller has taken the last piece is called off (the caller waits for
# no one); a helper spins SPIN_US (GIL-free, jit_spin) for the next job before it sleeps, and a caller spins as
# long for a helper's last piece before it sleeps. 50 us: at load 5-15 (bench/cpu_crew_ab.py, syn4, 2 threads)
# 50 us cost within 1% of the sleeping crew's CPU a token, 250 us 3-4% more; the wall of both 0.85-1.08x the
# previous crew's at load 2.6-15 and numba's pool 0.62-0.97x (bench/README.md). $DS4PY_CREW=wait: the previous crew
# (helpers sleep between calls, the caller waits for each), for A/B runs.
def _spin_us(default: float = 50.0) -> float:
    """$DS4PY_CREW_SPIN_US: microseconds, 0 to 100,000 (a bad value: one line on stderr and the default)."""
    v = os.environ.get("DS4PY_CREW_SPIN_US", "")
    try:
        us = float(v) if v else default
    except ValueError:
        us = -1.0
    if not 0.0 <= us <= 1e5:
        print(f"ds4py: DS4PY_CREW_SPIN_US={v!r} is not a number of microseconds from 0 to 100000; spinning "
              f"{default:g}", file=sys.stderr, flush=True)
        return default
    return us


SPIN_US = _spin_us()


class _Helper:
    """One helper thread: runs a posted (kernel, args) once per post (the kernels release the GIL).

    box[0]: the last posted job's number; box[8] (another cache line): the last finished one's, stored by the
    helper with the GIL released (jit_spin.publish_then_wait: a caller that sees it never waits for the GIL on
    this thread); box[9]: the job a caller sleeps on `done` for (0: none). `mu` guards the job, the error and who
    sleeps on which lock, so that a post or a finish never misses a sleeper."""

    def __init__(self, crew: "Crew"):
        self.crew = crew
        self.mu, self.go, self.done = threading.Lock(), threading.Lock(), threading.Lock()
        self.go.acquire()
        self.done.acquire()
        self.box = np.zeros(16, np.int64)
        self.seq = 0
        self.job, self.error, self.asleep = None, None, False
        threading.Thread(target=self._loop, name="ds4py-kernel", daemon=True).start()

    def _loop(self) -> None:
        seen = finished = 0
        while True:
            _state["publish"](self.box, finished, seen + 1, self.crew.npolls)
            with self.mu:
                if self.box[9] and self.box[8] >= self.box[9]:     # the caller sleeps on this job: wake it
                    self.box[9] = 0
                    self.done.release()
                job, self.job = self.job, None                     # claimed: the caller waits for it now
                seen = int(self.box[0])
                self.asleep = job is None
            if job is None:
                self.go.acquire()                                  # released by the next post
                continue
            fn, args, finished = job
            try:
                fn(*args)
            except BaseException as e:      # handed to the caller (Crew.run)
                self.error = e

    def post(self, fn, args: tuple) -> None:
        self.seq += 1
        with self.mu:
            self.job = (fn, args, self.seq)
            self.box[0] = self.seq
            wake, self.asleep = self.asleep, False
        if wake:
            self.go.release()

    def finish(self) -> BaseException | None:
        """After the caller's own share: call the job off if it has not started, else wait for it; its error."""
        seq, box = self.seq, self.box
        with self.mu:
            if self.crew.revoke and self.job is not None:
                self.job = None
                return None
        if box[8] < seq and self.crew.npolls:
            _state["spin"](box, 8, seq, self.crew.npolls)
        with self.mu:
            sleep = box[8] < seq
            if sleep:
                box[9] = seq
        if sleep:
            self.done.acquire()
        with self.mu:
            e, self.error = self.error, None
        return e


class Crew:
    """The helper threads of the pooled decode kernels (made as needed; used under _lock). spin_us: how long a
    thread spins before it sleeps; revoke: whether the caller calls off a helper that has not started."""

    def __init__(self, spin_us: float = SPIN_US, revoke: bool = True):
        self.helpers: list[_Helper] = []
        self.spin_us, self.revoke = spin_us, revoke
        self.npolls = 0

    def polls(self) -> int:
        """spin_us in polls of jit_spin.reached (0: no spin; measured once per process, by the calling thread)."""
        if self.spin_us <= 0:
            return 0
        if "polls_per_us" not in _state:            # (and the helpers' publish_then_wait loaded before they run)
            _state["publish"](np.zeros(16, np.int64), 0, 1, 0)
            _state["polls_per_us"] = _state["spin_mod"].polls_per_us()
        return int(self.spin_us * _state["polls_per_us"])

    def run(self, fn, args: tuple, k: int) -> None:
        """fn(*args) on this thread and k helpers at once; the first error raised in any of them is raised. fn
        shares one job out (each call takes pieces until none is left), so a helper that has not started when this
        thread's call returns is called off (revoke)."""
        while len(self.helpers) < k:
            self.helpers.append(_Helper(self))
        hs = self.helpers[:k]
        self.npolls = self.polls()
        for h in hs:
            h.post(fn, args)
        err = None
        try:
            fn(*args)
        except BaseException as e:
            err = e
        for h in hs:
            e = h.finish()
            err = err or e
        if err is not None:
            raise err


_crew = Crew(**({"spin_us": 0.0, "revoke": False} if os.environ.get("DS4PY_CREW") == "wait" else {}))
if hasattr(os, "register_at_fork"):          # a forked child has none of the parent's helper threads
    os.register_at_fork(after_in_child=lambda: _crew.helpers.clear())


def _grab_args(name: str, args: tuple) -> tuple:
    """`<name>_grab`'s arguments: the `_dec` call's, its x codes permuted once (jit_decode.GRAB_PERM), and a
    fresh piece counter."""
    perm = _state["dec"].GRAB_PERM.get(name)
    if perm is not None:
        i, fn = perm
        args = (*args[:i], fn(args[i]), *args[i + 1:])
    return (*args, np.zeros(1, np.int64))


# a decode kernel on a matrix smaller than this runs on the calling thread: numba's parallel launch costs ~0.1 ms
# of CPU (measured on 8-row Q8_0 products, 2 threads), as much as reading 1 MB at a core's speed
SERIAL_BYTES = 1 << 20


def call_rows(name: str, kernels, args: tuple, rows: int, nbytes: int, threads: int) -> None:
    """A decode kernel of ds4py.quant.jit_decode over `rows` rows: `<name>_rows(*args, 0, rows)` on this thread
    for a small matrix or one thread, else `<name>_dec(*args, parts)` on the pool: `parts` threads taking
    CHUNKS_PER_THREAD row ranges each from a shared counter (jit_decode)."""
    parts = max(1, min(threads, rows))
    if parts == 1 or nbytes < SERIAL_BYTES:
        _call(f"{name}_rows", getattr(kernels, f"{name}_rows"), (*args, 0, rows), 1, pool=False)
    else:
        _call(f"{name}_dec", getattr(kernels, f"{name}_dec"), (*args, parts), threads)


def matmul(qtype, raw: np.ndarray, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """x @ W.T for stored GGUF rows raw (uint8 [R, row_nbytes]) of a format in FORMATS -> float32 [T, R]."""
    k = _load()
    qt = int(qtype)
    raw = _readonly(np.ascontiguousarray(raw).view(np.uint8))
    x = np.ascontiguousarray(x, dtype=F32)
    R, (T, C) = raw.shape[0], x.shape
    if not takes(qt, C):
        raise ValueError(f"the compiled kernel of format {qt} does not take rows of {C} weights")
    y = np.empty((T, R), F32)
    parts = max(1, min(threads, R))
    f16 = _state["f16"]
    if qt == Q.Q8_0:
        r3 = raw.reshape(R, C // 32, 34)
        _call("q8_0", k.q8_0, (r3, r3.view(np.int8), x.reshape(T, C // 32, 32), y, f16, parts), threads)
    elif qt == Q.F16:
        w16 = raw.view(np.uint16).reshape(R, C)
        if _state["dec"].NATIVE_HALF:     # f16_rows' lanes with the 64-wide runs converted in vector registers
            call_rows("f16", _state["dec"], (w16, x, y, f16), R, raw.nbytes, threads)
        else:
            _call("f16", k.f16_rows, (w16, x, y, f16, parts), threads)
    elif qt == Q.IQ2_XXS:
        _call("iq2_xxs", k.iq2_xxs, (raw.reshape(R, C // 256, 66), x.reshape(T, C // 32, 32), y, f16,
                                     _state["grid"], _state["signs"], parts), threads)
    elif qt == Q.Q2_K:
        xs = np.ascontiguousarray(x.reshape(T, C // 16, 16).sum(2, dtype=F32))
        _call("q2_k", k.q2_k, (raw.reshape(R, C // 256, 84), x.reshape(T, C // 32, 32), xs, y, f16, parts), threads)
    elif qt == Q.Q4_K:
        xs = np.ascontiguousarray(x.reshape(T, C // 32, 32).sum(2, dtype=F32))
        _call("q4_k", k.q4_k, (raw.reshape(R, C // 256, 144), x.reshape(T, C // 64, 64), xs, y, f16, parts), threads)
    elif qt == Q.MXFP4:
        _call("mxfp4", k.mxfp4, (raw.reshape(R, C // 32, 17), x.reshape(T, C // 32, 32), y, _state["e8m0"],
                                 _state["kvalues"], parts), threads)
    else:
        raise ValueError(f"no compiled kernel for format {qt}")
    return y


def vq_matmul(stream: np.ndarray, hi: np.ndarray | None, gains: np.ndarray, codebook: np.ndarray, bits: int,
              x: np.ndarray, threads: int = 1) -> np.ndarray:
    """x @ W.T for one VQ-8 matrix (ds4py.quant.vq): stream uint8 [R, row_bytes] (+ hi [R, C/64] at 13 bits),
    gains float32 [R], codebook float32 [K, 8] -> float32 [T, R]."""
    from ds4py.quant import vq

    k = _load()
    stream = _readonly(np.ascontiguousarray(stream).view(np.uint8))
    R = stream.shape[0]
    hi = np.zeros((R, 0), np.uint8) if hi is None else np.ascontiguousarray(hi).view(np.uint8)
    x = np.ascontiguousarray(x, dtype=F32)
    T, C = x.shape
    y = np.empty((T, R), F32)
    args = (stream, _readonly(hi), _readonly(np.ascontiguousarray(gains, dtype=F32)),
            _readonly(np.ascontiguousarray(codebook, dtype=F32)), x.reshape(T, C // 64, 64), y, vq.stream_bits(bits), max(1, min(threads, R)))
    _call("vq8", k.vq8, args, threads)
    return y
