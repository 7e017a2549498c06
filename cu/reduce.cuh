// Warp and block reductions shared by the ds4py kernels.
// Fixed reduction trees: for a given blockDim the result is bit-identical from run to run, which the graph and
// PDL tests rely on. Only CUDA intrinsics here (no inline PTX: that lives in portable.cuh).
#pragma once

#define DS4_FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(DS4_FULL_MASK, v, o);
    return v;
}

// Sum over the whole block; every thread gets the result. blockDim.x must be a multiple of 32 (<= 1024);
// `part` is a __shared__ float[32] owned by the caller (kept out of this function so the emulator sees plain
// kernel-scope shared memory).
__device__ __forceinline__ float block_sum(float v, float* part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();                       // part[] may still be read by a previous call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < nwarps ? part[lane] : 0.0f;
    return warp_sum(v);
}

// Argmax order, matching numpy.argmax: NaN beats every number (first NaN wins), then larger value, then lower index.
__device__ __forceinline__ bool argmax_better(float v, int i, float bv, int bi) {
    const bool vnan = v != v, bnan = bv != bv;
    if (vnan || bnan) return vnan && (!bnan || i < bi);
    return v > bv || (v == bv && i < bi);
}

// Warp-wide argmax; every lane ends with the warp's best (value, index).
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(DS4_FULL_MASK, v, o);
        const int oi = __shfl_xor_sync(DS4_FULL_MASK, i, o);
        if (argmax_better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// Block-wide argmax; every thread ends with the block's best. `pv`/`pi` are __shared__ [32] arrays.
__device__ __forceinline__ void block_argmax(float& v, int& i, float* pv, int* pi) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    warp_argmax(v, i);
    __syncthreads();
    if (lane == 0) { pv[warp] = v; pi[warp] = i; }
    __syncthreads();
    if (lane < nwarps) { v = pv[lane]; i = pi[lane]; }
    else { v = -__int_as_float(0x7f800000); i = 0x7fffffff; }   // -inf, beaten by any real entry
    warp_argmax(v, i);
}

// Four sums at once across the warp, transposed so that it takes 6 shuffles instead of 20: lane l contributes
// v[0..3]; afterwards lane 8*s holds the total of slot s (s = 0..3), and every lane l holds the total of slot
// (l >> 3) & 3. The tree is fixed, so each slot's sum is bit-identical from run to run.
__device__ __forceinline__ float warp_sum4(const float v[4]) {
    const int lane = threadIdx.x & 31;
    const bool hi16 = lane & 16, hi8 = lane & 8;
    // lanes 0-15 keep slots 0,1 and receive them from lanes 16-31, which keep slots 2,3
    const float s0 = __shfl_xor_sync(DS4_FULL_MASK, hi16 ? v[0] : v[2], 16);
    const float s1 = __shfl_xor_sync(DS4_FULL_MASK, hi16 ? v[1] : v[3], 16);
    const float k0 = (hi16 ? v[2] : v[0]) + s0;
    const float k1 = (hi16 ? v[3] : v[1]) + s1;
    // within each half, lanes 0-7 keep the first of the two, lanes 8-15 the second
    const float s = __shfl_xor_sync(DS4_FULL_MASK, hi8 ? k0 : k1, 8);
    float t = (hi8 ? k1 : k0) + s;
    t += __shfl_xor_sync(DS4_FULL_MASK, t, 4);
    t += __shfl_xor_sync(DS4_FULL_MASK, t, 2);
    t += __shfl_xor_sync(DS4_FULL_MASK, t, 1);
    return t;
}

// Block-wide exclusive scan from the top thread down (a suffix sum): returns the sum of v over threads with a
// larger index; `total` gets the sum over all. blockDim.x a multiple of 32; `part` a __shared__ T[32] of the
// caller. Integer T (counts, fixed-point masses): exact, and independent of the order of the threads.
template <class T>
__device__ __forceinline__ T block_suffix_exclusive(T v, T* part, T& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    T incl = v;                                  // inclusive suffix within the warp: lanes >= this one
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T u = __shfl_down_sync(DS4_FULL_MASK, incl, o);
        if (lane + o < 32) incl += u;
    }
    __syncthreads();                             // part[] may still be read by a previous call
    if (lane == 0) part[warp] = incl;            // the warp's total
    __syncthreads();
    T above = 0, all = 0;
    for (int w = 0; w < nwarps; w++) {
        const T pw = part[w];
        all += pw;
        if (w > warp) above += pw;
    }
    total = all;
    return above + incl - v;
}

// Larger float -> larger unsigned key (negative floats have their bits flipped, positive ones the sign set).
__device__ __forceinline__ unsigned order_key(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive prefix sum over the block of v (the radix selects of cu/topk.cu and cu/v41.cu) (blockDim.x a multiple of 32); *total gets the block's sum.
// `wsum` is a __shared__ int[32] owned by the caller.
__device__ __forceinline__ int block_exclusive_scan(int v, int* wsum, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(DS4_FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();                                  // wsum may still be read by the previous call
    if (lane == 31) wsum[warp] = x;
    __syncthreads();
    int w = lane < nw ? wsum[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(DS4_FULL_MASK, w, o);
        if (lane >= o) w += y;
    }
    const int before = __shfl_sync(DS4_FULL_MASK, w, (warp + 31) & 31);   // inclusive sum of the warps before
    *total = __shfl_sync(DS4_FULL_MASK, w, nw - 1);
    return (warp ? before : 0) + x - v;
}
