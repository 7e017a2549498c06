"""The FMA decision (ds4py/cuda/compiler.py BASE_OPTIONS): NVRTC builds every kernel with --fmad=false, so the GPU
rounds a * b + c in two steps like the emulator's -ffp-contract=off build, and the bit-identity properties the
emulator proves (multi-row rows = single steps, speculative greedy = plain) hold on the GPU for the same reason.
Proven on the PTX of a planted multiply-add: contracted without the option, two roundings with it."""

from __future__ import annotations

import pytest

from ds4py.cuda import compiler

SRC = b'extern "C" __global__ void axpy(float* y, const float* x, float a) { y[threadIdx.x] = a * x[threadIdx.x] + y[threadIdx.x]; }'


def ptx(options: tuple[str, ...]) -> str:
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-bindings (NVRTC)")
    try:
        compiler.nvrtc_version()
    except compiler.NvrtcUnavailableError as e:
        pytest.skip(str(e))
    err, prog = nvrtc.nvrtcCreateProgram(SRC, b"axpy.cu", 0, [], [])
    opts = [b"-arch=compute_90", *[o.encode() for o in options]]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    err, n = nvrtc.nvrtcGetPTXSize(prog)
    buf = b" " * n
    (err,) = nvrtc.nvrtcGetPTX(prog, buf)
    nvrtc.nvrtcDestroyProgram(prog)
    return buf.decode(errors="replace")


def test_kernels_are_built_without_multiply_add_contraction():
    opts = tuple(o for o in compiler.BASE_OPTIONS if not o.startswith("--ptxas"))
    assert "--fmad=false" in compiler.BASE_OPTIONS
    contracted = ptx(tuple(o for o in opts if o != "--fmad=false"))
    assert "fma.rn.f32" in contracted                      # NVRTC's default contracts the planted a * x + y
    separate = ptx(opts)
    assert "fma.rn.f32" not in separate and "mul.rn.f32" in separate and "add.rn.f32" in separate
