"""A GIL-free bounded spin for ds4py.quant.jit.Crew: wait for a counter another thread advances without sleeping.

    got = reached(box, i, v, iters)      # True once box[i] >= v (int64 array), False after `iters` polls

A thread that sleeps on a lock between two kernel calls is woken by the OS, which on a busy host places it on the
waker's own core and runs it late; a short spin keeps it on its core and answers in well under a microsecond.
The poll is an acquire load (the counter's writer publishes under a lock after its kernel's stores), with the
CPU's pause hint between polls on x86. Imported only through ds4py.quant.jit (numba present).
"""

from __future__ import annotations

import platform
import time

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@intrinsic
def _load_acquire(typingctx, box, i):
    """box[i] of an int64 array, as an atomic acquire load (never hoisted out of a loop)."""
    sig = types.int64(box, i)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.load_atomic(builder.gep(ary.data, [args[1]]), "acquire", 8)

    return sig, codegen


@intrinsic
def _store_release(typingctx, box, i, v):
    """box[i] = v of an int64 array, as an atomic release store (the stores before it are seen first)."""
    sig = types.void(box, i, v)

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        builder.store_atomic(args[2], builder.gep(ary.data, [args[1]]), "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _pause(typingctx):
    """The spin-wait hint (x86 `pause`: frees the core's other hyperthread, saves power); nothing elsewhere."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        if _X86:
            fn = ir.Function(builder.module, ir.FunctionType(ir.VoidType(), []), name="llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def reached(box, i, v, iters):
    """Whether box[i] >= v within `iters` polls (the GIL released throughout)."""
    for _ in range(iters):
        if _load_acquire(box, i) >= v:
            return True
        _pause()
    return _load_acquire(box, i) >= v


@njit(cache=True, nogil=True)
def publish_then_wait(box, done, v, iters):
    """A helper between jobs: box[8] = done (the job it finished), then up to `iters` polls for the next post
    (box[0] >= v) or a caller asleep on it (box[9] != 0). The store is made with the GIL released, so that the
    caller, which sees it and goes on, never waits for the GIL on this thread."""
    _store_release(box, 8, done)
    for _ in range(iters):
        if _load_acquire(box, 0) >= v or _load_acquire(box, 9) != 0:
            return True
        _pause()
    return False


def polls_per_us() -> float:
    """How many polls of `reached` take a microsecond on this CPU (measured once: `pause` costs ~10 cycles on
    older x86 cores and ~140 on Skylake and later)."""
    import numpy as np

    box = np.zeros(1, np.int64)
    reached(box, 0, 1, 10)                  # compiled / loaded from the cache first
    best = float("inf")
    n = 20000
    for _ in range(3):
        t = time.perf_counter()
        reached(box, 0, 1, n)
        best = min(best, time.perf_counter() - t)
    return max(1.0, n / (best * 1e6))
