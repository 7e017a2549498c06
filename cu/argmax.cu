// Greedy sampling: index of the largest logit, written to a device slot (the next step's embedding reads it).
// Ties go to the lowest index; NaN wins like numpy.argmax. One launch: every block writes its best to a
// partial, and the last block to finish (an atomic ticket, never a spin-wait) reduces the partials in index
// order - so the result never depends on which block finished when.
#include "portable.cuh"
#include "reduce.cuh"

// Launch: grid (parts), block (threads, a multiple of 32, <= 1024). part_val / part_idx hold `parts` entries;
// ticket is one unsigned int that is 0 before the launch and is left 0 after it (by the last block), so a
// captured graph can replay the launch. Kernels sharing a ticket must not run concurrently (one per stream).
// Block b scans i = b*blockDim.x + tid, stepping gridDim.x*blockDim.x.
extern "C" __global__ void argmax_f32(const float* x, int n, float* part_val, int* part_idx, unsigned* ticket,
                                      int* out) {
    __shared__ float pv[32];
    __shared__ int pi[32];
    __shared__ int last;
    pdl_wait();
    pdl_launch_dependents();
    float best = -__int_as_float(0x7f800000);
    int best_i = 0x7fffffff;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = x[i];
        if (argmax_better(v, i, best, best_i)) { best = v; best_i = i; }
    }
    block_argmax(best, best_i, pv, pi);
    if (threadIdx.x == 0) {
        part_val[blockIdx.x] = best;
        part_idx[blockIdx.x] = best_i;
        __threadfence();                               // the partial is visible before the ticket says so
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    best = -__int_as_float(0x7f800000);
    best_i = 0x7fffffff;
    for (int p = threadIdx.x; p < (int)gridDim.x; p += blockDim.x) {
        const float v = __ldcg(part_val + p);          // written by other blocks: read through L2
        const int vi = __ldcg(part_idx + p);
        if (argmax_better(v, vi, best, best_i)) { best = v; best_i = vi; }
    }
    block_argmax(best, best_i, pv, pi);
    if (threadIdx.x == 0) {
        out[0] = best_i;
        *ticket = 0u;
    }
}
