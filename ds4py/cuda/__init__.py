"""CUDA backend on cuda-python (cuda.bindings): NVRTC kernel cache, device arena, launches with PDL, streams, graphs.

Importing this package (or any module in it) never touches the driver; `driver.api()` does, on first use, and
raises CudaUnavailableError without a GPU. Modules:
    signature  kernel signatures parsed from cu/*.cu        args      argument packing checked against them
    compiler   NVRTC -> cubin, disk cache, ptxas report     driver    lazy driver access, Device
    memory     arena, DeviceArray, pinned chunked upload    launch    kernel registry, cuLaunchKernelEx (+PDL)
    runtime    Runtime: device, kernels, main/side streams  graph     StepGraph: capture once, replay per step
    emu        the CPU emulator of cu/*.cu                  emu_runtime  EmuRuntime: Runtime's interface on it
    ops        host wrappers picking launch geometry        twins     numpy twins of every kernel (ref.ops)
See docs/cuda.md.
"""
