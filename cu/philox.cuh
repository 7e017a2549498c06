// Philox4x32-10 (Salmon et al., SC'11; Random123): a counter-based generator, so a draw is a pure function of
// (key, counter) - the sampler keys it with the request's seed and counts with the token position, and a
// replayed or re-run step draws the same number. Twin: ds4py/cuda/twins/sample.py (philox4x32_10).
#pragma once
#include "types.cuh"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

__device__ __forceinline__ void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int r = 0; r < 10; r++) {
        if (r) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        const uint32_t hi0 = __umulhi(PHILOX_M0, c[0]), lo0 = PHILOX_M0 * c[0];
        const uint32_t hi1 = __umulhi(PHILOX_M1, c[2]), lo1 = PHILOX_M1 * c[2];
        const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
}

// 64 uniform bits for (seed, position): counter (position lo, position hi, 0, 0), key (seed lo, seed hi);
// words 0 and 1 of the output, word 1 the high half.
__device__ __forceinline__ uint64_t philox_u64(uint64_t seed, uint64_t position) {
    uint32_t c[4] = {(uint32_t)position, (uint32_t)(position >> 32), 0u, 0u};
    philox4x32_10(c, (uint32_t)seed, (uint32_t)(seed >> 32));
    return (uint64_t)c[0] | ((uint64_t)c[1] << 32);
}
