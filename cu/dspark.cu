// V4.1's DSpark draft on CUDA (docs/dspark.md "On CUDA"; ds4py/ref/dspark.py is the same math on the host). The
// draft's stages are V4.1 blocks run by the layer recorder; its attention is cu/prefill_attn.cu's attn_prefill with
// block_keys (every block query sees the ring before the block and all block keys); the greedy chain's Markov bias
// is a GEMV and cu/argmax.cu's argmax. Two kernels are its own:
//   dspark_hc_sum   y[t] = scale * sum_j w_j X[t, j] over the hc copies, w_j = mix[t * mix_stride + j] or 1 (mix
//                   null): with mix null and scale 1 / hc the draft taps (the plain mean over the copies of a target
//                   layer's input state, written at that target's column offset of the taps row); with the last
//                   stage's FFN pre-mix the block's pre-norm hidden h = hc_collapse(X, pre) (the confidence head's
//                   input). Products, then the sum over j ascending, then the scale: as numpy's (w X).sum(1) and
//                   X.mean(1) (a power-of-two scale is exact, so sum then scale equals the mean's divide).
//   dspark_add      out = a + b elementwise: a block position's logits, its base logits plus its Markov bias.
#include "types.cuh"
#include "portable.cuh"

#ifndef DS4_HC
#error "DS4_HC comes from the model defines of ds4py/cuda/compiler.py"
#endif

// X [T, HC, D], mix [T, mix_stride] (or null), y row t at y + t * y_stride (D values).
// Launch: grid (ceil(D / threads), T), block (threads).
extern "C" __global__ void dspark_hc_sum(const float* X, const float* mix, int mix_stride, int D, float scale,
                                         float* y, int y_stride) {
    pdl_wait();
    pdl_launch_dependents();
    const int t = blockIdx.y, d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    const float* x = X + (size_t)t * DS4_HC * D + d;
    const float* w = mix ? mix + (size_t)t * mix_stride : nullptr;
    float s = w ? w[0] * x[0] : x[0];
#pragma unroll
    for (int j = 1; j < DS4_HC; j++) s += w ? w[j] * x[(size_t)j * D] : x[(size_t)j * D];
    y[(size_t)t * y_stride + d] = s * scale;
}

// out[i] = a[i] + b[i] for n values. Launch: grid (ceil(n / threads)), block (threads).
extern "C" __global__ void dspark_add(const float* a, const float* b, float* out, int n) {
    pdl_wait();
    pdl_launch_dependents();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
