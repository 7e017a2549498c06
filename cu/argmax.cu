// Greedy sampling: index of the largest logit. Ties go to the lowest index; NaN wins like numpy.argmax.
// Two passes (per-block partials, then one block) so the result never depends on atomics' ordering.
#include "portable.cuh"
#include "reduce.cuh"

// Pass 1. Launch: grid (parts), block (threads, a multiple of 32, <= 1024).
// Block b scans i = b*blockDim.x + tid, stepping gridDim.x*blockDim.x, and writes its best to part_*[b].
extern "C" __global__ void argmax_partial(const float* x, int n, float* part_val, int* part_idx) {
    __shared__ float pv[32];
    __shared__ int pi[32];
    pdl_wait();
    pdl_launch_dependents();
    float best = -__int_as_float(0x7f800000);
    int best_i = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = x[i];
        if (argmax_better(v, i, best, best_i)) { best = v; best_i = i; }
    }
    block_argmax(best, best_i, pv, pi);
    if (threadIdx.x == 0) { part_val[blockIdx.x] = best; part_idx[blockIdx.x] = best_i; }
}

// Pass 2. Launch: grid (1), block (threads, a multiple of 32, <= 1024). out[0] = index of the best partial.
extern "C" __global__ void argmax_final(const float* part_val, const int* part_idx, int parts, int* out) {
    __shared__ float pv[32];
    __shared__ int pi[32];
    pdl_wait();
    pdl_launch_dependents();
    float best = -__int_as_float(0x7f800000);
    int best_i = 0x7fffffff;
    for (int p = threadIdx.x; p < parts; p += blockDim.x) {
        if (argmax_better(part_val[p], part_idx[p], best, best_i)) { best = part_val[p]; best_i = part_idx[p]; }
    }
    block_argmax(best, best_i, pv, pi);
    if (threadIdx.x == 0) out[0] = best_i;
}
