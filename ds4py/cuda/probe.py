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


GIB = 1 << 30
AUTO_MARGIN_BYTES = 2 * GIB     # workspaces, KV state of a default context, graphs, the CUDA context itself


def device_memory(ordinal: int = 0) -> tuple[int, int]:
    """(free, total) bytes of the device, through its primary context (retained and released again)."""
    from ds4py.cuda.driver import Device, call

    dev = Device.open(ordinal)
    try:
        free, total = call("cuMemGetInfo")
        return int(free), int(total)
    finally:
        dev.close()


def model_device_bytes(path: str) -> int:
    """About what the CUDA engine takes for `path`: its tensor data (uploaded as stored) plus a fixed margin."""
    from ds4py.cuda.gguf_upload import data_span
    from ds4py.gguf import GGUFFile

    start, end = data_span(GGUFFile(path))
    return end - start + AUTO_MARGIN_BYTES


def auto_choice(path: str | None = None) -> tuple[str, str]:
    """What `--backend auto` picks for `path` (None: any model) and why: ("cuda", why) or ("ref", why). Checks,
    in order: a driver and a device, a driver new enough for this NVRTC, and free device memory for the model."""
    from ds4py.cuda import driver
    from ds4py.cuda.compiler import check_driver_version, nvrtc_version
    from ds4py.errors import CudaUnavailableError, Ds4Error

    try:
        driver.api()
        check_driver_version(int(driver.call("cuDriverGetVersion")), nvrtc_version())
        free, total = device_memory()
    except (CudaUnavailableError, Ds4Error) as e:
        return "ref", str(e).rstrip(".")
    if path is not None:
        need = model_device_bytes(path)
        if need > free:
            return "ref", (f"the GPU has {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB and this model needs "
                           f"about {need / GIB:.1f} GiB")
        return "cuda", f"a GPU with {free / GIB:.1f} GiB free, {need / GIB:.1f} GiB needed"
    return "cuda", f"a GPU with {free / GIB:.1f} GiB free"
