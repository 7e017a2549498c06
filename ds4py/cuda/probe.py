"""Device copy bandwidth: the roofline that `bench --bandwidth auto` and bench/gemv_bandwidth.py compare with."""

from __future__ import annotations


def device_copy_bandwidth_gbps(rt=None, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy, counting bytes read + written, mean of `reps` after 3 warm-ups (CUDA events).

    Uses the caller's Runtime when given (a second Runtime on the same device is not needed)."""
    from ds4py.cuda.driver import call
    from ds4py.cuda.runtime import Runtime

    own = rt is None
    rt = Runtime() if own else rt
    a, b = int(call("cuMemAlloc", nbytes)), int(call("cuMemAlloc", nbytes))
    try:
        for _ in range(3):
            call("cuMemcpyDtoDAsync", b, a, nbytes, rt.main)
        t = rt.timer()
        t.start()
        for _ in range(reps):
            call("cuMemcpyDtoDAsync", b, a, nbytes, rt.main)
        ms = t.stop() / reps
        t.close()
    finally:
        call("cuMemFree", a)
        call("cuMemFree", b)
        if own:
            rt.close()
    return 2 * nbytes / ms / 1e6
