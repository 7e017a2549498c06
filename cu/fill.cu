// Random weights written on the device (ds4py/cuda/synth.py: the synthetic full-size model of the device check,
// with no GGUF file and no host copy). Every value is a pure function of (seed, element index) - a splitmix64
// hash - so the result does not depend on the launch geometry and the numpy twin reproduces it exactly.
//   fill_random_u32    every 32-bit word random (the bytes of quantised blocks)
//   fill_f16_uniform   halves uniform in [lo, hi] (F16 matrices and tables)
//   fill_f32_uniform   floats uniform in [lo, hi] (norms, hc scale / base, sinks, biases)
//   fill_i32_rows      rows of k distinct ints in [0, mod): a random start, then consecutive (tid2eid: distinct
//                      experts per token, as a real table has them)
//   fix_block_fields   per block of `block_bytes`: a valid positive f16 at up to two offsets (the block scales d /
//                      dmin of Q8_0, IQ2_XXS, Q2_K, Q4_K) and an e8m0 byte (MXFP4), over random bytes
// Launch (all): grid (any), block (any multiple of 32); grid-stride loops with 64-bit indices.
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"

__device__ __forceinline__ uint64_t fill_mix(uint64_t seed, uint64_t i) {     // splitmix64 of seed + i
    uint64_t z = seed + (i + 1ull) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// uniform in [0, 1): the top 24 bits (exact in fp32)
__device__ __forceinline__ float fill_unit(uint64_t seed, uint64_t i) {
    return (float)(unsigned)(fill_mix(seed, i) >> 40) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ uint64_t fill_start() { return (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ uint64_t fill_stride() { return (uint64_t)gridDim.x * blockDim.x; }

// Launch: grid (any), block (any multiple of 32): a grid-stride loop (see the header).
extern "C" __global__ void fill_random_u32(unsigned* p, long long n, unsigned long long seed) {
    pdl_wait();
    pdl_launch_dependents();
    for (uint64_t i = fill_start(); i < (uint64_t)n; i += fill_stride()) p[i] = (unsigned)(fill_mix(seed, i) >> 32);
}

// Launch: grid (any), block (any multiple of 32): a grid-stride loop (see the header).
extern "C" __global__ void fill_f16_uniform(__half* p, long long n, float lo, float hi, unsigned long long seed) {
    pdl_wait();
    pdl_launch_dependents();
    for (uint64_t i = fill_start(); i < (uint64_t)n; i += fill_stride())
        p[i] = __float2half_rn(lo + (hi - lo) * fill_unit(seed, i));
}

// Launch: grid (any), block (any multiple of 32): a grid-stride loop (see the header).
extern "C" __global__ void fill_f32_uniform(float* p, long long n, float lo, float hi, unsigned long long seed) {
    pdl_wait();
    pdl_launch_dependents();
    for (uint64_t i = fill_start(); i < (uint64_t)n; i += fill_stride()) p[i] = lo + (hi - lo) * fill_unit(seed, i);
}

// p[i] = (start(row) + i % k) % mod with row = i / k: k <= mod gives k distinct values per row.
// Launch: grid (any), block (any multiple of 32): a grid-stride loop (see the header).
extern "C" __global__ void fill_i32_rows(int* p, long long n, int k, int mod, unsigned long long seed) {
    pdl_wait();
    pdl_launch_dependents();
    for (uint64_t i = fill_start(); i < (uint64_t)n; i += fill_stride())
        p[i] = (int)((fill_mix(seed, i / (uint64_t)k) % (uint64_t)mod + i % (uint64_t)k) % (uint64_t)mod);
}

// f16 fields (offset < 0: none) get scale * (0.5 + u / 2), u uniform in [0, 1); the e8m0 byte (offset < 0: none)
// gets e8m0_lo + (hash % (e8m0_hi - e8m0_lo + 1)). Fields are written bytewise (blocks are not 2-byte aligned).
// Launch: grid (any), block (any multiple of 32): a grid-stride loop (see the header).
extern "C" __global__ void fix_block_fields(uint8_t* p, long long n_blocks, int block_bytes, int f16_a, int f16_b,
                                            float scale, int e8m0_at, int e8m0_lo, int e8m0_hi,
                                            unsigned long long seed) {
    pdl_wait();
    pdl_launch_dependents();
    for (uint64_t b = fill_start(); b < (uint64_t)n_blocks; b += fill_stride()) {
        uint8_t* blk = p + b * (uint64_t)block_bytes;
        const int offs[2] = {f16_a, f16_b};
        for (int k = 0; k < 2; ++k) {
            if (offs[k] < 0) continue;
            const __half h = __float2half_rn(scale * (0.5f + 0.5f * fill_unit(seed, 2 * b + k)));
            const unsigned short bits = __half_as_ushort(h);
            blk[offs[k]] = (uint8_t)(bits & 0xff);
            blk[offs[k] + 1] = (uint8_t)(bits >> 8);
        }
        if (e8m0_at >= 0)
            blk[e8m0_at] = (uint8_t)(e8m0_lo + (int)(fill_mix(seed ^ 0x5bd1e995ull, b) %
                                                      (uint64_t)(e8m0_hi - e8m0_lo + 1)));
    }
}
