"""Device copy bandwidth: the roofline that `bench --bandwidth auto` and bench/gemv_bandwidth.py compare with."""

from __future__ import annotations


def device_copy_bandwidth_gbps(rt=None, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy, counting bytes read + written, mean of `reps` after 3 warm-ups (the runtime's timer:
    CUDA events on a GPU). Uses the caller's Runtime (or EmuRuntime) when given."""
    own = rt is None
    if own:
        from ds4py.cuda.runtime import Runtime

        rt = Runtime()
    a, b = rt.memory.alloc(nbytes), rt.memory.alloc(nbytes)
    try:
        for _ in range(3):
            rt.copy_d2d(b, a, nbytes)
        t = rt.timer()
        t.start()
        for _ in range(reps):
            rt.copy_d2d(b, a, nbytes)
        ms = t.stop() / reps
        t.close()
    finally:
        rt.synchronize()
        rt.memory.free(a)
        rt.memory.free(b)
        if own:
            rt.close()
    return 2 * nbytes / max(ms, 1e-9) / 1e6
