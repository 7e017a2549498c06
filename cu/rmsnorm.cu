// RMSNorm (MODEL.md): y = x * rsqrt(mean(x^2) + eps) * w, or without the weight when w is null.
#include "portable.cuh"
#include "reduce.cuh"

// Launch: grid (rows), block (threads, a multiple of 32, <= 1024); one block per row of n floats.
// x and y may be the same buffer (each element is read before it is written by the same thread).
extern "C" __global__ void rmsnorm_f32(const float* x, const float* w, float* y, int n, float eps) {
    __shared__ float part[32];
    pdl_wait();
    pdl_launch_dependents();
    const float* xr = x + (size_t)blockIdx.x * n;
    float* yr = y + (size_t)blockIdx.x * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = xr[i];
        ss += v * v;
    }
    ss = block_sum(ss, part);
    const float r = rsqrtf(ss / (float)n + eps);
    if (w) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * r * w[i];
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * r;
    }
}
