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
