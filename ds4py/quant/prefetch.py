"""The next decode kernel's first weights pulled into the last-level cache while the main thread runs a step's
serial numpy (CPU path, compiled kernels).

Why: between two parallel kernel calls of a decode step the main thread runs numpy and Python (norms, rope,
routing, the hc mixes: ~10 ms a token on the 4-layer real-width file) while the other core and the memory bus
sit idle; the dense Q8_0 / F16 kernels after those gaps are bound by the bus (~28 GB/s on two threads, where one
core reads ~34 GB/s from the cache). A native thread (a compiled loop that never takes the GIL) reads the first
BUDGET bytes of the next call's weights, one load a cache line, from where each of the call's threads will
start, until the call begins (the main thread bumps a generation counter; the loop checks it every 64 KB).

Which call comes next is learned: after a call with key (kernel, address of its first argument) the call seen
last time is predicted (a decode step's calls repeat in order every token). Only the dense kernels' read-only
weight arguments (the mapped file) are read: the routed experts' kernels take whole expert tensors, of which a
step reads a few experts. Reading changes no number a kernel computes (the same bits). Off where the model is
paged on demand (a memory budget or cgroup: prefault.wanted() says no) or $DS4PY_PREFETCH=0.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

BUDGET = int(os.environ.get("DS4PY_PREFETCH_MB", "16")) << 20    # bytes read ahead per gap (the L3 is 32 MB here)
STEP = 1 << 16                                                   # bytes between two checks of the generation
LINE = 64
MAX_JOBS = 8
CHUNKS_PER_THREAD = 8                                            # = jit_decode's
DENSE = frozenset({"q8_0_dec", "q8_0_many_dec", "mixed_many_dec", "q8_0_ex_dec", "f16_dec"})
GEN, STOP, NJOBS, READ, JOB0 = 0, 1, 2, 3, 4                     # the control words (int64); READ: bytes read
I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)


@intrinsic
def _load(typingctx, ctl, i):
    """ctl[i] (int64 array) as a sequentially consistent atomic load: never cached in a register by the loop."""
    sig = types.int64(ctl, types.intp)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        return builder.load_atomic(ptr, "seq_cst", 8)

    return sig, codegen


@intrinsic
def _fence(typingctx):
    """A full fence: the job words read before it are read before the generation's second load."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _touch(typingctx, addr):
    """One byte at address addr, an atomic (unoptimisable) load: pulls its cache line in."""
    sig = types.int64(types.int64)

    def codegen(context, builder, sig, args):
        ptr = builder.inttoptr(args[0], I8.as_pointer())
        return builder.zext(builder.load_atomic(ptr, "monotonic", 1), I64)

    return sig, codegen


@intrinsic
def _call_ptr(typingctx, fn, arg):
    """int fn(void *arg) for a C function's address fn (sem_wait): the address is an argument, so the loop
    stays in numba's disk cache."""
    sig = types.int32(types.int64, types.int64)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(I32, [I8.as_pointer()])
        f = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(f, [builder.inttoptr(args[1], I8.as_pointer())])

    return sig, codegen


@njit(nogil=True, cache=True)
def _loop(ctl, sem_wait, sem, sink):
    """The reader thread: wait for a post, copy the jobs (ctl[JOB0 + 2 j] address, + 1 bytes) under the
    generation (odd while the main thread writes them), then read their lines round-robin in STEP pieces until
    done or the generation moves on."""
    addr = np.zeros(MAX_JOBS, np.int64)
    left = np.zeros(MAX_JOBS, np.int64)
    done_gen = -1
    acc = 0
    while True:
        _call_ptr(sem_wait, sem)
        if _load(ctl, STOP) != 0:
            break
        g = _load(ctl, GEN)
        if g & 1 or g == done_gen:
            continue
        n = min(_load(ctl, NJOBS), MAX_JOBS)
        for j in range(n):
            addr[j] = _load(ctl, JOB0 + 2 * j)
            left[j] = _load(ctl, JOB0 + 2 * j + 1)
        _fence()
        if _load(ctl, GEN) != g:
            continue
        done_gen = g
        busy = True
        while busy:
            busy = False
            for j in range(n):
                if left[j] <= 0:
                    continue
                if _load(ctl, GEN) != g:
                    busy = False
                    break
                m = min(left[j], STEP)
                for o in range(0, m, LINE):
                    acc ^= _touch(addr[j] + o)
                addr[j] += m
                left[j] -= m
                ctl[READ] += m                           # written by this thread only (a count for tests)
                busy = True
    sink[0] = acc


class Prefetcher:
    """The reader thread and the learned call order (one per process; jit._call drives it)."""

    def __init__(self, budget: int = BUDGET):
        self.budget = budget
        self.ctl = np.zeros(JOB0 + 2 * MAX_JOBS, np.int64)
        self.sink = np.zeros(1, np.int64)
        self._sem = np.zeros(64, np.uint8)                    # a sem_t (32 bytes on glibc), 64-byte aligned enough
        libc = ctypes.CDLL(None, use_errno=True)
        self._post = libc.sem_post
        self._post.argtypes, self._post.restype = [ctypes.c_void_p], ctypes.c_int
        if libc.sem_init(ctypes.c_void_p(self._sem.ctypes.data), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")
        self._sem_addr = self._sem.ctypes.data
        self._wait_addr = ctypes.cast(libc.sem_wait, ctypes.c_void_p).value
        self.gen = 0
        self.prev = None                       # the key of the last call
        self.next_of: dict = {}                # key -> the key of the call that followed it last time
        self.jobs_of: dict = {}                # key -> (address, bytes) ranges to read ahead of that call, or ()
        self._hold: dict = {}                  # key -> its weight arrays (the addresses stay mapped)
        self.thread = threading.Thread(target=_loop, args=(self.ctl, self._wait_addr, self._sem_addr, self.sink),
                                       name="ds4py-prefetch", daemon=True)
        self.thread.start()

    def before(self, name: str, args: tuple, threads: int):
        """A kernel call begins: stop reading ahead; learn that it followed the previous call. Returns its key."""
        self.ctl[NJOBS] = 0                            # then a late wake-up finds nothing to read
        self.gen += 2
        self.ctl[GEN] = self.gen
        a0 = args[0]
        key = (name, a0.ctypes.data if isinstance(a0, np.ndarray) else id(a0))
        if key not in self.jobs_of:
            self.jobs_of[key] = self._jobs(name, args, threads, key)
        if self.prev is not None:
            self.next_of[self.prev] = key
        self.prev = key
        return key

    def after(self, key) -> None:
        """A kernel call returned: read ahead for the call predicted next."""
        jobs = self.jobs_of.get(self.next_of.get(key), ())
        if not jobs:
            return
        ctl = self.ctl
        ctl[GEN] = self.gen + 1                                        # odd: the jobs are being written
        for j, (a, n) in enumerate(jobs):
            ctl[JOB0 + 2 * j] = a
            ctl[JOB0 + 2 * j + 1] = n
        ctl[NJOBS] = len(jobs)
        self.gen += 2
        ctl[GEN] = self.gen
        self._post(self._sem_addr)

    def _jobs(self, name: str, args: tuple, threads: int, key) -> tuple:
        """The ranges to read ahead of a call: its read-only weight arrays laid end to end, the kernels cut them into
        CHUNKS_PER_THREAD pieces a thread of about equal bytes, taken in order, so the threads start at the first
        pieces: budget / threads bytes from each of those starts, or the stream's first budget bytes where the
        pieces are short."""
        if name not in DENSE:
            return ()
        ws, seen = [], set()
        for a in args:
            if (isinstance(a, np.ndarray) and not a.flags.writeable and a.dtype in (np.uint8, np.uint16)
                    and a.nbytes >= STEP and a.flags.c_contiguous):
                p = a.ctypes.data
                if p not in seen:
                    seen.add(p)
                    ws.append(a)
        if not ws:
            return ()
        self._hold[key] = ws
        segs = [(a.ctypes.data, a.nbytes) for a in ws]
        total = sum(n for _, n in segs)
        parts = max(1, min(threads, MAX_JOBS))
        piece = total // (parts * CHUNKS_PER_THREAD)
        if piece * parts >= self.budget:           # long pieces: the first parts pieces' starts, one per thread
            starts = [(piece * t, self.budget // parts) for t in range(parts)]
        else:                                      # short ones: the threads go through the stream's front together
            starts = [(0, min(self.budget, total))]
        jobs = []
        for off, want in starts:
            for a, n in segs:                      # [off, off + want) on the segments laid end to end
                if want <= 0:
                    break
                if off >= n:
                    off -= n
                    continue
                take = min(n - off, want)
                jobs.append((a + off, take))
                want -= take
                off = 0
        return tuple(jobs[:MAX_JOBS])

    def stop(self) -> None:
        self.ctl[STOP] = 1
        self.gen += 2
        self.ctl[GEN] = self.gen
        self._post(self._sem_addr)
        self.thread.join()
