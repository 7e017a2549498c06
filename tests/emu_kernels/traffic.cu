// Textbook kernels for the emulator's traffic profile (tests/test_emu_traffic.py): each has a known answer
// (coalescing, re-reads, bank conflicts, bytes before pdl_wait) that the profiler must reproduce.
#include "types.cuh"
#include "portable.cuh"

// y[i] = x[i]: 32 lanes read 32 consecutive floats per request (128 bytes, 4 sectors): 100% coalesced.
extern "C" __global__ void copy_f32(const float* x, float* y, int n) {
    pdl_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i];
}

// y[i] = x[i * stride]: with stride 8 floats (32 bytes) each lane's 4 bytes sit in a sector of their own:
// 128 bytes requested over 32 sectors = 12.5%.
extern "C" __global__ void strided_f32(const float* x, float* y, int n, int stride) {
    pdl_wait();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[(size_t)i * stride];
}

// Reads its input `passes` times (every block the whole of x): re-read factor = passes (by requests).
extern "C" __global__ void read_passes(const float* x, float* y, int n, int passes) {
    pdl_wait();
    float acc = 0.0f;
    for (int p = 0; p < passes; p++)
        for (int i = threadIdx.x; i < n; i += blockDim.x) acc += x[i];
    y[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// Loads its weight before pdl_wait() (allowed: weights do not depend on the previous kernel), the
// activation after: w's bytes count as loaded before pdl_wait, x's not.
extern "C" __global__ void prefetch_weight(const float* w, const float* x, float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float wi = i < n ? w[i] : 0.0f;
    pdl_wait();
    if (i < n) y[i] = wi * x[i];
}

// Shared memory, one warp: each lane reads s[lane * stride] (4-byte words). stride 1: no conflict (1 wavefront);
// 2: lanes l and l + 16 share a bank, 2-way (2 wavefronts); 32: every lane in bank 0, 32-way (32 wavefronts);
// 0: every lane reads one word, a broadcast (1 wavefront).
extern "C" __global__ void smem_stride(const float* x, float* y, int stride) {
    __shared__ float s[32 * 33];
    pdl_wait();
    for (int i = threadIdx.x; i < 32 * 33; i += blockDim.x) s[i] = x[i];
    __syncthreads();
    y[threadIdx.x] = s[threadIdx.x * stride];
}

// smem_stride with the shared array declared inside a function template (its static lands outside emu_shared
// unless the build moves it; ds4py/cuda/emu.py _move_template_shared): the same wavefronts must be counted.
template <int N> __device__ float tpl_stride(const float* x, int stride) {
    __shared__ float s[N];
    for (int i = threadIdx.x; i < N; i += blockDim.x) s[i] = x[i];
    __syncthreads();
    return s[threadIdx.x * stride];
}
extern "C" __global__ void tpl_smem_stride(const float* x, float* y, int stride) {
    pdl_wait();
    y[threadIdx.x] = tpl_stride<32 * 33>(x, stride);
}

// A global load through cp.async: 16 bytes per lane, consecutive: 100% coalesced, counted as a load of x.
extern "C" __global__ void cp_async_copy(const float* x, float* y) {
    __shared__ __align__(16) float s[32 * 4];
    pdl_wait();
    const int t = threadIdx.x;
    cp_async_16(s + 4 * t, x + 4 * t);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    for (int k = 0; k < 4; k++) y[4 * t + k] = s[4 * t + k];
}

// One 16-byte load per lane (float4), consecutive: 512 bytes in 16 sectors per request, 100%. With `pair` each
// lane loads two float4 (32 bytes), as gemv.cu's F32 rows do: each request then has a 32-byte stride, 50%.
// (The traffic build keeps g++ from splitting a float4 into four 4-byte loads: -fno-tree-sra.)
extern "C" __global__ void copy_f32x4(const float* x, float* y, int pair) {
    pdl_wait();
    const int t = threadIdx.x;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    if (!pair) {
        const float4 a = x4[t];
        y[4 * t] = a.x + a.y + a.z + a.w;
        return;
    }
    const float4 a = x4[2 * t], b = x4[2 * t + 1];
    y[4 * t] = a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w;
}
