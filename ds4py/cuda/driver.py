"""Lazy access to the CUDA driver through cuda.bindings.

Nothing here runs at import: `import ds4py.cuda.driver` works without cuda-bindings or a GPU. The first `api()`
imports cuda.bindings.driver and calls cuInit; any failure becomes CudaUnavailableError with one sentence.
Every driver call goes through `call(name, *args)`, which raises CudaError naming the call and the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds4py.errors import CudaUnavailableError, Ds4Error

_driver: Any = None         # cuda.bindings.driver once initialised (tests may install a stand-in)


class CudaError(Ds4Error):
    """A CUDA driver call failed."""


def api() -> Any:
    """The initialised cuda.bindings.driver module; raises CudaUnavailableError when there is no usable GPU."""
    global _driver
    if _driver is not None:
        return _driver
    try:
        from cuda.bindings import driver
    except ImportError:
        raise CudaUnavailableError(
            "the CUDA backend needs cuda-python, which is not installed (pip install 'ds4py[cuda]')") from None
    try:
        (err,) = driver.cuInit(0)
    except Exception:  # cuda.pathfinder cannot find libcuda.so
        raise CudaUnavailableError(
            "no NVIDIA driver was found (libcuda could not be loaded); the CUDA backend needs a GPU") from None
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaUnavailableError(f"the NVIDIA driver found no usable GPU (cuInit: {error_name(driver, err)})")
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or count == 0:
        raise CudaUnavailableError("the NVIDIA driver reports no CUDA device")
    _driver = driver
    return driver


def available() -> bool:
    try:
        api()
        return True
    except CudaUnavailableError:
        return False


def error_name(driver: Any, err: Any) -> str:
    try:
        e, name = driver.cuGetErrorName(err)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return str(err)


def call(name: str, *args: Any) -> Any:
    """driver.<name>(*args) with the CUresult checked: returns None, the one value, or a tuple of values."""
    d = api()
    res = getattr(d, name)(*args)
    err = res[0]
    if err != d.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{name} failed: {error_name(d, err)}")
    return None if len(res) == 1 else res[1] if len(res) == 2 else res[1:]


@dataclass
class Device:
    """One GPU with its primary context made current; the properties kernels are sized from."""
    ordinal: int
    handle: Any
    context: Any
    name: str
    cc: tuple[int, int]
    sm_count: int
    l2_bytes: int
    smem_per_block_optin: int
    total_mem: int
    threads_per_sm: int = 2048      # 1,536 on GB10 (sm_121) and other consumer Blackwell/Ada parts
    smem_per_sm: int = 0            # shared memory per SM (0: not read); the occupancy check's per-SM budget

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    @classmethod
    def open(cls, ordinal: int = 0) -> "Device":
        d = api()
        dev = call("cuDeviceGet", ordinal)
        ctx = call("cuDevicePrimaryCtxRetain", dev)
        call("cuCtxSetCurrent", ctx)
        a = d.CUdevice_attribute

        def attr(x: Any) -> int:
            return int(call("cuDeviceGetAttribute", x, dev))

        raw = call("cuDeviceGetName", 256, dev)
        name = bytes(raw).split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
        return cls(
            ordinal=ordinal, handle=dev, context=ctx, name=name,
            cc=(attr(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), attr(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
            sm_count=attr(a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            l2_bytes=attr(a.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            smem_per_block_optin=attr(a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            total_mem=int(call("cuDeviceTotalMem", dev)),
            threads_per_sm=attr(a.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR),
            smem_per_sm=attr(a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
        )

    def close(self) -> None:
        if self.context is not None:
            call("cuDevicePrimaryCtxRelease", self.handle)
            self.context = None
