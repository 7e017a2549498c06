// Routed and shared experts of V4 Flash (MODEL.md §2.4, ds4py/ref/forward.moe), decode (one token), reading the
// GGUF blocks directly and only the chosen experts' rows:
//   moe_gate_up_<fmt>   h[s] = silu(min(w1 x, c)) * clamp(w3 x, -c, c) * route_w[s] for the slots s (expert ids[s])
//   moe_down_<fmt>      y = sum_s w2[ids[s]] h[s] (+ add: the shared expert's output), in a fixed order, with the
//                       hc_post epilogue X'_k = post_k y + sum_j comb[j,k] X_j, or y itself
//   moe_dequant_<fmt>   the format's exact values (bit-identical to ds4py.quant), for tests and tools
// Formats: IQ2_XXS, Q2_K, Q4_K, MXFP4, Q8_0, F16 (ggml block layouts; see ds4py/quant/). The shared expert runs
// through the same kernels with ids = null (slot s is expert s) and route_w = null (weight 1).
//
// Geometry: a block owns `rows_per_block` consecutive rows of one matrix; those rows are one contiguous span of
// bytes, staged into shared memory with 16-byte cp.async (the blocks of most formats are not 16-byte aligned in
// place: 66, 84, 17, 34 bytes). Thread (grp = tid % G, rl = tid / G), G = cols / 32, holds the 32 activations of
// column group grp in registers for all its rows (rl, rl + RL, ...; RL = blockDim.x / G), takes the dot of that
// group of each row straight from the staged bytes (an fma per weight on its integer code, the block scales once
// per 16 or 32 weights), and the G partial sums of a row are added by 8 lanes in a fixed order: no float atomics,
// bit-identical results run to run.
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"

// Geometry (-D value from ds4py/cuda/ops/experts.py DEFINES): MOE_RPT rows per thread (accumulators per matrix),
// so rows_per_block <= MOE_RPT * (blockDim.x / G).
#ifndef MOE_RPT
#error "MOE_RPT comes from the DEFINES table of ds4py/cuda/ops/experts.py"
#endif


#define FMT_IQ2_XXS 0
#define FMT_Q2_K 1
#define FMT_Q4_K 2
#define FMT_MXFP4 3
#define FMT_Q8_0 4
#define FMT_F16 5

// llama.cpp's iq2xxs_grid: 8 magnitudes (bytes 0x08, 0x19, 0x2b) per entry, byte j = weight j.
__device__ const uint64_t moe_iq2xxs_grid[256] = {
    0x0808080808080808ull, 0x080808080808082bull, 0x0808080808081919ull, 0x0808080808082b08ull,
    0x0808080808082b2bull, 0x0808080808190819ull, 0x0808080808191908ull, 0x08080808082b0808ull,
    0x08080808082b082bull, 0x08080808082b2b08ull, 0x08080808082b2b2bull, 0x0808080819080819ull,
    0x0808080819081908ull, 0x0808080819190808ull, 0x0808080819192b08ull, 0x08080808192b0819ull,
    0x08080808192b1908ull, 0x080808082b080808ull, 0x080808082b08082bull, 0x080808082b082b2bull,
    0x080808082b2b082bull, 0x0808081908080819ull, 0x0808081908081908ull, 0x0808081908190808ull,
    0x0808081908191919ull, 0x0808081919080808ull, 0x080808192b081908ull, 0x080808192b192b08ull,
    0x0808082b08080808ull, 0x0808082b0808082bull, 0x0808082b082b082bull, 0x0808082b2b08082bull,
    0x0808190808080819ull, 0x0808190808081908ull, 0x0808190808190808ull, 0x08081908082b0819ull,
    0x08081908082b1908ull, 0x0808190819080808ull, 0x080819081908082bull, 0x0808190819082b08ull,
    0x08081908192b0808ull, 0x080819082b080819ull, 0x080819082b081908ull, 0x080819082b190808ull,
    0x080819082b2b1908ull, 0x0808191908080808ull, 0x080819190808082bull, 0x0808191908082b08ull,
    0x08081919082b0808ull, 0x080819191908192bull, 0x08081919192b2b19ull, 0x080819192b080808ull,
    0x080819192b190819ull, 0x0808192b08082b19ull, 0x0808192b08190808ull, 0x0808192b19080808ull,
    0x0808192b2b081908ull, 0x0808192b2b2b1908ull, 0x08082b0808080808ull, 0x08082b0808081919ull,
    0x08082b0808082b08ull, 0x08082b0808191908ull, 0x08082b08082b2b08ull, 0x08082b0819080819ull,
    0x08082b0819081908ull, 0x08082b0819190808ull, 0x08082b081919082bull, 0x08082b082b082b08ull,
    0x08082b1908081908ull, 0x08082b1919080808ull, 0x08082b2b0808082bull, 0x08082b2b08191908ull,
    0x0819080808080819ull, 0x0819080808081908ull, 0x0819080808190808ull, 0x08190808082b0819ull,
    0x0819080819080808ull, 0x08190808192b0808ull, 0x081908082b081908ull, 0x081908082b190808ull,
    0x081908082b191919ull, 0x0819081908080808ull, 0x0819081908082b08ull, 0x08190819082b0808ull,
    0x0819081919190808ull, 0x0819081919192b2bull, 0x081908192b080808ull, 0x0819082b082b1908ull,
    0x0819082b19081919ull, 0x0819190808080808ull, 0x0819190808082b08ull, 0x08191908082b0808ull,
    0x08191908082b1919ull, 0x0819190819082b19ull, 0x081919082b080808ull, 0x0819191908192b08ull,
    0x08191919192b082bull, 0x0819192b08080808ull, 0x0819192b0819192bull, 0x08192b0808080819ull,
    0x08192b0808081908ull, 0x08192b0808190808ull, 0x08192b0819080808ull, 0x08192b082b080819ull,
    0x08192b1908080808ull, 0x08192b1908081919ull, 0x08192b192b2b0808ull, 0x08192b2b19190819ull,
    0x082b080808080808ull, 0x082b08080808082bull, 0x082b080808082b2bull, 0x082b080819081908ull,
    0x082b0808192b0819ull, 0x082b08082b080808ull, 0x082b08082b08082bull, 0x082b0819082b2b19ull,
    0x082b081919082b08ull, 0x082b082b08080808ull, 0x082b082b0808082bull, 0x082b190808080819ull,
    0x082b190808081908ull, 0x082b190808190808ull, 0x082b190819080808ull, 0x082b19081919192bull,
    0x082b191908080808ull, 0x082b191919080819ull, 0x082b1919192b1908ull, 0x082b192b2b190808ull,
    0x082b2b0808082b08ull, 0x082b2b08082b0808ull, 0x082b2b082b191908ull, 0x082b2b2b19081908ull,
    0x1908080808080819ull, 0x1908080808081908ull, 0x1908080808190808ull, 0x1908080808192b08ull,
    0x19080808082b0819ull, 0x19080808082b1908ull, 0x1908080819080808ull, 0x1908080819082b08ull,
    0x190808081919192bull, 0x19080808192b0808ull, 0x190808082b080819ull, 0x190808082b081908ull,
    0x190808082b190808ull, 0x1908081908080808ull, 0x19080819082b0808ull, 0x19080819192b0819ull,
    0x190808192b080808ull, 0x190808192b081919ull, 0x1908082b08080819ull, 0x1908082b08190808ull,
    0x1908082b19082b08ull, 0x1908082b1919192bull, 0x1908082b192b2b08ull, 0x1908190808080808ull,
    0x1908190808082b08ull, 0x19081908082b0808ull, 0x190819082b080808ull, 0x190819082b192b19ull,
    0x190819190819082bull, 0x19081919082b1908ull, 0x1908192b08080808ull, 0x19082b0808080819ull,
    0x19082b0808081908ull, 0x19082b0808190808ull, 0x19082b0819080808ull, 0x19082b0819081919ull,
    0x19082b1908080808ull, 0x19082b1919192b08ull, 0x19082b19192b0819ull, 0x19082b192b08082bull,
    0x19082b2b19081919ull, 0x19082b2b2b190808ull, 0x1919080808080808ull, 0x1919080808082b08ull,
    0x1919080808190819ull, 0x1919080808192b19ull, 0x19190808082b0808ull, 0x191908082b080808ull,
    0x191908082b082b08ull, 0x1919081908081908ull, 0x191908191908082bull, 0x191908192b2b1908ull,
    0x1919082b2b190819ull, 0x191919082b190808ull, 0x191919082b19082bull, 0x1919191908082b2bull,
    0x1919192b08080819ull, 0x1919192b19191908ull, 0x19192b0808080808ull, 0x19192b0808190819ull,
    0x19192b0808192b19ull, 0x19192b08192b1908ull, 0x19192b1919080808ull, 0x19192b2b08082b08ull,
    0x192b080808081908ull, 0x192b080808190808ull, 0x192b080819080808ull, 0x192b0808192b2b08ull,
    0x192b081908080808ull, 0x192b081919191919ull, 0x192b082b08192b08ull, 0x192b082b192b0808ull,
    0x192b190808080808ull, 0x192b190808081919ull, 0x192b191908190808ull, 0x192b19190819082bull,
    0x192b19192b081908ull, 0x192b2b081908082bull, 0x2b08080808080808ull, 0x2b0808080808082bull,
    0x2b08080808082b2bull, 0x2b08080819080819ull, 0x2b0808082b08082bull, 0x2b08081908081908ull,
    0x2b08081908192b08ull, 0x2b08081919080808ull, 0x2b08082b08190819ull, 0x2b08190808080819ull,
    0x2b08190808081908ull, 0x2b08190808190808ull, 0x2b08190808191919ull, 0x2b08190819080808ull,
    0x2b081908192b0808ull, 0x2b08191908080808ull, 0x2b0819191908192bull, 0x2b0819192b191908ull,
    0x2b08192b08082b19ull, 0x2b08192b19080808ull, 0x2b08192b192b0808ull, 0x2b082b080808082bull,
    0x2b082b1908081908ull, 0x2b082b2b08190819ull, 0x2b19080808081908ull, 0x2b19080808190808ull,
    0x2b190808082b1908ull, 0x2b19080819080808ull, 0x2b1908082b2b0819ull, 0x2b1908190819192bull,
    0x2b1908192b080808ull, 0x2b19082b19081919ull, 0x2b19190808080808ull, 0x2b191908082b082bull,
    0x2b19190819081908ull, 0x2b19191919190819ull, 0x2b192b082b080819ull, 0x2b192b19082b0808ull,
    0x2b2b08080808082bull, 0x2b2b080819190808ull, 0x2b2b08082b081919ull, 0x2b2b081908082b19ull,
    0x2b2b082b08080808ull, 0x2b2b190808192b08ull, 0x2b2b2b0819190808ull, 0x2b2b2b1908081908ull
};

// ---- formats. Each has, for the 32 weights of column group `grp` counted from `base` (a row start, or a whole
// tensor: rows are whole blocks):
//   dq   the exact values, with explicit _rn operations in ds4py.quant's order (no FMA contraction changes a bit):
//        moe_dequant_*, and the reference every kernel test compares with;
//   dot  sum_j w_j x_j with the block / sub-block scales taken out of the loop (one fma per weight on the integer
//        code, the scales applied once per 16 or 32), given xs = the sums of x over its two halves (for the mins).
// Small integers become floats through the bits of 2^23 + v (exact, full rate; I2F is quarter rate on sm_90).
__device__ __forceinline__ unsigned moe_u16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }
__device__ __forceinline__ unsigned moe_u32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ float moe_f16(const uint8_t* p) { return __half2float(*reinterpret_cast<const __half*>(p)); }
__device__ __forceinline__ float moe_u2f(unsigned v) { return __uint_as_float(0x4B000000u | v) - 8388608.0f; }
__device__ __forceinline__ float moe_i8f(unsigned byte) {                 // the int8 in the low byte
    return __uint_as_float(0x4B000000u | ((byte & 255u) ^ 0x80u)) - 8388736.0f;
}

template <int F> struct MoeFmt;

// IQ2_XXS (66 B / 256): f16 d, then per 32 weights aux0 (4 grid indices) and aux1 (4 x 7 sign bits, 4-bit scale).
// value = d * (0.5 + ls) * 0.25 * grid[idx][j] * sign. 2-byte aligned: read in 16-bit halves.
template <> struct MoeFmt<FMT_IQ2_XXS> {
    static constexpr int QK = 256, BYTES = 66;
    __device__ static __forceinline__ void aux(const uint8_t* base, int grp, unsigned& a0, unsigned& a1,
                                               float& db) {
        const uint8_t* b = base + (size_t)(grp >> 3) * BYTES;
        const uint8_t* q = b + 2 + 8 * (grp & 7);
        a0 = moe_u16(q) | (moe_u16(q + 2) << 16);
        a1 = moe_u16(q + 4) | (moe_u16(q + 6) << 16);
        db = __fmul_rn(__fmul_rn(moe_f16(b), __fadd_rn(0.5f, moe_u2f(a1 >> 28))), 0.25f);
    }
    __device__ static __forceinline__ unsigned signs(unsigned a1, int k) {      // ksigns_iq2xs[7 bits]: even parity
        const unsigned si = (a1 >> (7 * k)) & 127u;
        return si | ((unsigned)(__popc(si) & 1) << 7);
    }
    __device__ static __forceinline__ void dq(const uint8_t* base, int grp, float* w, const uint64_t* grid) {
        unsigned a0, a1;
        float db;
        aux(base, grp, a0, a1, db);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint64_t g = grid[(a0 >> (8 * k)) & 255u];
            const unsigned sg = signs(a1, k);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float v = __fmul_rn(moe_u2f((unsigned)(g >> (8 * j)) & 255u), db);
                w[8 * k + j] = (sg >> j) & 1u ? -v : v;
            }
        }
    }
    __device__ static __forceinline__ float dot(const uint8_t* base, int grp, const float* x, const float*,
                                                const uint64_t* grid) {
        unsigned a0, a1;
        float db;
        aux(base, grp, a0, a1, db);
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint64_t g = grid[(a0 >> (8 * k)) & 255u];
            const unsigned sg = signs(a1, k), lo = (unsigned)g, hi = (unsigned)(g >> 32);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float v0 = moe_u2f((lo >> (8 * j)) & 255u), v1 = moe_u2f((hi >> (8 * j)) & 255u);
                s0 = fmaf((sg >> j) & 1u ? -v0 : v0, x[8 * k + j], s0);
                s1 = fmaf((sg >> (j + 4)) & 1u ? -v1 : v1, x[8 * k + j + 4], s1);
            }
        }
        return (s0 + s1) * db;
    }
};

// Q2_K (84 B / 256): 16 scale bytes (low nibble scale, high nibble min, per 16 weights), 64 bytes of 2-bit q
// (weight 128h + 32j + l = bits 2j of qs[32h + l]), f16 d, f16 dmin. value = d*sc*q - dmin*m. 4-byte aligned.
template <> struct MoeFmt<FMT_Q2_K> {
    static constexpr int QK = 256, BYTES = 84;
    __device__ static __forceinline__ void dq(const uint8_t* base, int grp, float* w, const uint64_t*) {
        const uint8_t* b = base + (size_t)(grp >> 3) * BYTES;
        const int cw = (grp & 7) * 32, sh = 2 * ((cw >> 5) & 3);
        const float d = moe_f16(b + 80), dmin = moe_f16(b + 82);
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
            const unsigned sc = b[(cw >> 4) + sub];
            const float dl = __fmul_rn(d, moe_u2f(sc & 15u)), ml = __fmul_rn(dmin, moe_u2f(sc >> 4));
            const uint8_t* qs = b + 16 + 32 * (cw >> 7) + 16 * sub;
#pragma unroll
            for (int word = 0; word < 4; ++word) {
                const unsigned u = moe_u32(qs + 4 * word);
#pragma unroll
                for (int by = 0; by < 4; ++by)
                    w[16 * sub + 4 * word + by] = __fsub_rn(__fmul_rn(moe_u2f((u >> (8 * by + sh)) & 3u), dl), ml);
            }
        }
    }
    __device__ static __forceinline__ float dot(const uint8_t* base, int grp, const float* x, const float* xs,
                                                const uint64_t*) {
        const uint8_t* b = base + (size_t)(grp >> 3) * BYTES;
        const int cw = (grp & 7) * 32, sh = 2 * ((cw >> 5) & 3);
        const float d = moe_f16(b + 80), dmin = moe_f16(b + 82);
        float acc = 0.0f;
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
            const unsigned sc = b[(cw >> 4) + sub];
            const uint8_t* qs = b + 16 + 32 * (cw >> 7) + 16 * sub;
            float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
            for (int word = 0; word < 4; ++word) {
                const unsigned u = moe_u32(qs + 4 * word) >> sh;
                s0 = fmaf(moe_u2f(u & 3u), x[16 * sub + 4 * word], s0);
                s1 = fmaf(moe_u2f((u >> 8) & 3u), x[16 * sub + 4 * word + 1], s1);
                s0 = fmaf(moe_u2f((u >> 16) & 3u), x[16 * sub + 4 * word + 2], s0);
                s1 = fmaf(moe_u2f((u >> 24) & 3u), x[16 * sub + 4 * word + 3], s1);
            }
            acc = fmaf(d * moe_u2f(sc & 15u), s0 + s1, acc);
            acc = fmaf(-dmin * moe_u2f(sc >> 4), xs[sub], acc);
        }
        return acc;
    }
};

// Q4_K (144 B / 256): f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) x 8, 128 bytes of 4-bit q (sub-block 2c in
// the low nibbles of qs[32c..], 2c+1 in the high ones). value = d*sc*q - dmin*m. 4-byte aligned.
template <> struct MoeFmt<FMT_Q4_K> {
    static constexpr int QK = 256, BYTES = 144;
    __device__ static __forceinline__ void scales(const uint8_t* b, int gi, unsigned& sc, unsigned& mn) {
        const uint8_t* s = b + 4;
        if (gi < 4) {
            sc = s[gi] & 63u;
            mn = s[gi + 4] & 63u;
        } else {
            sc = (s[gi + 4] & 15u) | ((unsigned)(s[gi - 4] >> 6) << 4);
            mn = (unsigned)(s[gi + 4] >> 4) | ((unsigned)(s[gi] >> 6) << 4);
        }
    }
    __device__ static __forceinline__ void dq(const uint8_t* base, int grp, float* w, const uint64_t*) {
        const uint8_t* b = base + (size_t)(grp >> 3) * BYTES;
        const int gi = grp & 7;
        unsigned sc, mn;
        scales(b, gi, sc, mn);
        const float dl = __fmul_rn(moe_f16(b), moe_u2f(sc)), ml = __fmul_rn(moe_f16(b + 2), moe_u2f(mn));
        const uint8_t* qs = b + 16 + 32 * (gi >> 1);
        const int sh = 4 * (gi & 1);
#pragma unroll
        for (int word = 0; word < 8; ++word) {
            const unsigned u = moe_u32(qs + 4 * word);
#pragma unroll
            for (int by = 0; by < 4; ++by)
                w[4 * word + by] = __fsub_rn(__fmul_rn(moe_u2f((u >> (8 * by + sh)) & 15u), dl), ml);
        }
    }
    __device__ static __forceinline__ float dot(const uint8_t* base, int grp, const float* x, const float* xs,
                                                const uint64_t*) {
        const uint8_t* b = base + (size_t)(grp >> 3) * BYTES;
        const int gi = grp & 7;
        unsigned sc, mn;
        scales(b, gi, sc, mn);
        const uint8_t* qs = b + 16 + 32 * (gi >> 1);
        const int sh = 4 * (gi & 1);
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int word = 0; word < 8; ++word) {
            const unsigned u = moe_u32(qs + 4 * word) >> sh;
            s0 = fmaf(moe_u2f(u & 15u), x[4 * word], s0);
            s1 = fmaf(moe_u2f((u >> 8) & 15u), x[4 * word + 1], s1);
            s0 = fmaf(moe_u2f((u >> 16) & 15u), x[4 * word + 2], s0);
            s1 = fmaf(moe_u2f((u >> 24) & 15u), x[4 * word + 3], s1);
        }
        return fmaf(moe_f16(b) * moe_u2f(sc), s0 + s1, -(moe_f16(b + 2) * moe_u2f(mn)) * (xs[0] + xs[1]));
    }
};

// MXFP4 (17 B / 32): e8m0 byte e, 16 bytes of e2m1 codes (weight j: low nibble of qs[j], j+16: high nibble).
// value = {0,1,2,3,4,6,8,12}[code & 7] * sign * 2^(e-128). Byte aligned.
__device__ __forceinline__ float moe_mxfp4_code(unsigned c) {
    const float v = moe_u2f((0xC8643210u >> (4u * (c & 7u))) & 15u);   // the 8 magnitudes, one nibble each
    return (c & 8u) && (c & 7u) ? -v : v;                               // code 8 is +0, as in ggml's table
}
template <> struct MoeFmt<FMT_MXFP4> {
    static constexpr int QK = 32, BYTES = 17;
    __device__ static __forceinline__ float scale(const uint8_t* b) {
        const unsigned e = b[0];
        return __uint_as_float(e < 2u ? 0x00200000u << e : (e - 1u) << 23);
    }
    __device__ static __forceinline__ void dq(const uint8_t* base, int grp, float* w, const uint64_t*) {
        const uint8_t* b = base + (size_t)grp * BYTES;
        const float d = scale(b);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const unsigned q = b[1 + j];
            w[j] = __fmul_rn(moe_mxfp4_code(q & 15u), d);
            w[j + 16] = __fmul_rn(moe_mxfp4_code(q >> 4), d);
        }
    }
    __device__ static __forceinline__ float dot(const uint8_t* base, int grp, const float* x, const float*,
                                                const uint64_t*) {
        const uint8_t* b = base + (size_t)grp * BYTES;
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const unsigned q = b[1 + j];
            s0 = fmaf(moe_mxfp4_code(q & 15u), x[j], s0);
            s1 = fmaf(moe_mxfp4_code(q >> 4), x[j + 16], s1);
        }
        return (s0 + s1) * scale(b);
    }
};

// Q8_0 (34 B / 32): f16 d, 32 int8 q. value = q * d. 2-byte aligned.
template <> struct MoeFmt<FMT_Q8_0> {
    static constexpr int QK = 32, BYTES = 34;
    __device__ static __forceinline__ void dq(const uint8_t* base, int grp, float* w, const uint64_t*) {
        const uint8_t* b = base + (size_t)grp * BYTES;
        const float d = moe_f16(b);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const unsigned u = moe_u16(b + 2 + 2 * j);
            w[2 * j] = __fmul_rn(moe_i8f(u), d);
            w[2 * j + 1] = __fmul_rn(moe_i8f(u >> 8), d);
        }
    }
    __device__ static __forceinline__ float dot(const uint8_t* base, int grp, const float* x, const float*,
                                                const uint64_t*) {
        const uint8_t* b = base + (size_t)grp * BYTES;
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const unsigned u = moe_u16(b + 2 + 2 * j);
            s0 = fmaf(moe_i8f(u), x[2 * j], s0);
            s1 = fmaf(moe_i8f(u >> 8), x[2 * j + 1], s1);
        }
        return (s0 + s1) * moe_f16(b);
    }
};

// F16: 32 halves (64 bytes; 16-byte aligned when the row length is a multiple of 8).
template <> struct MoeFmt<FMT_F16> {
    static constexpr int QK = 32, BYTES = 64;
    __device__ static __forceinline__ void dq(const uint8_t* base, int grp, float* w, const uint64_t*) {
        const uint4* p = reinterpret_cast<const uint4*>(base + (size_t)grp * BYTES);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const uint4 u = p[v];
            const __half* hh = reinterpret_cast<const __half*>(&u);
#pragma unroll
            for (int j = 0; j < 8; ++j) w[8 * v + j] = __half2float(hh[j]);
        }
    }
    __device__ static __forceinline__ float dot(const uint8_t* base, int grp, const float* x, const float*,
                                                const uint64_t*) {
        const uint4* p = reinterpret_cast<const uint4*>(base + (size_t)grp * BYTES);
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const uint4 u = p[v];
            const __half* hh = reinterpret_cast<const __half*>(&u);
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                s0 = fmaf(__half2float(hh[j]), x[8 * v + j], s0);
                s1 = fmaf(__half2float(hh[j + 1]), x[8 * v + j + 1], s1);
            }
        }
        return s0 + s1;
    }
};

template <int F> __device__ __forceinline__ int moe_row_bytes(int cols) {
    return cols / MoeFmt<F>::QK * MoeFmt<F>::BYTES;
}

// ---- block helpers ------------------------------------------------------------------------------------------
// Start copying n bytes from global src into shared dst + (src % 16), so 16-byte words stay 16-byte aligned: the
// aligned middle by cp.async, the ends byte by byte. dst is 16-byte aligned with n + 16 bytes of room; the whole
// block calls it, then cp_async_commit / cp_async_wait_all / __syncthreads before reading.
__device__ __forceinline__ const uint8_t* moe_stage(uint8_t* dst, const uint8_t* src, int n) {
    const int phase = (int)(reinterpret_cast<size_t>(src) & 15);
    int head = phase ? 16 - phase : 0;
    if (head > n) head = n;
    const int words = (n - head) >> 4;
    uint8_t* out = dst + phase;
    for (int i = threadIdx.x; i < words; i += blockDim.x) cp_async_16(out + head + 16 * i, src + head + 16 * i);
    for (int i = threadIdx.x; i < head; i += blockDim.x) out[i] = src[i];
    for (int i = head + 16 * words + threadIdx.x; i < n; i += blockDim.x) out[i] = src[i];
    return out;
}

__device__ __forceinline__ int moe_room(int n) { return (n + 31) & ~15; }      // n + 16, rounded up to 16

__device__ __forceinline__ void moe_load_x(const float* x, float* xv) {
    const float4* p = reinterpret_cast<const float4*>(x);
#pragma unroll
    for (int v = 0; v < 8; ++v) {
        const float4 f = p[v];
        xv[4 * v] = f.x;
        xv[4 * v + 1] = f.y;
        xv[4 * v + 2] = f.z;
        xv[4 * v + 3] = f.w;
    }
}

// The sums of x over the two halves of a column group (the K-quants' mins multiply them).
__device__ __forceinline__ void moe_half_sums(const float* xv, float* xs) {
    float a = 0.0f, b = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        a += xv[j];
        b += xv[j + 16];
    }
    xs[0] = a;
    xs[1] = b;
}

// tot[row] = sum over g < G of red[row * G + g] for rows < n_rows: 8 lanes per row, each a strided partial sum,
// then a fixed butterfly. Every thread calls it (it has barriers); blockDim.x a multiple of 32.
__device__ __forceinline__ void moe_row_sums(const float* red, float* tot, int n_rows, int G) {
    const int per_pass = blockDim.x / 8, part = threadIdx.x & 7;
    for (int base = 0; base < n_rows; base += per_pass) {
        const int row = base + (int)threadIdx.x / 8;
        float s = 0.0f;
        if (row < n_rows)
            for (int g = part; g < G; g += 8) s += red[row * G + g];
        s += __shfl_xor_sync(DS4_FULL_MASK, s, 4);
        s += __shfl_xor_sync(DS4_FULL_MASK, s, 2);
        s += __shfl_xor_sync(DS4_FULL_MASK, s, 1);
        if (part == 0 && row < n_rows) tot[row] = s;
    }
    __syncthreads();
}

// ---- gate + up + clamped SwiGLU -----------------------------------------------------------------------------------
// One (x, slot) pair against the block's staged gate / up rows sg / su: hout[i] = silu(min(g, c)) * clamp(u) * rw.
// Both entry points (one token; several rows grouped by expert) run exactly this, so a pair's bits do not depend
// on which other pairs share its block or launch. red: partial-sum room (may alias the stage: a barrier comes
// before it is written).
template <int F>
__device__ __forceinline__ void moe_gate_up_pair(const uint64_t* grid, const uint8_t* sg, const uint8_t* su,
                                                 int rb, int nr, const float* x, float rw, float* hout, float clamp,
                                                 float* red, int dim) {
    const int G = dim / 32, RL = blockDim.x / G, tid = threadIdx.x;
    const int grp = tid % G, rl = tid / G;
    const bool worker = rl < RL;
    float xv[32], xs[2] = {0.0f, 0.0f};
    if (worker) {
        moe_load_x(x + 32 * grp, xv);
        moe_half_sums(xv, xs);
    }
    float ag[MOE_RPT], au[MOE_RPT];
#pragma unroll
    for (int i = 0; i < MOE_RPT; ++i) {
        const int r = rl + RL * i;
        ag[i] = au[i] = 0.0f;
        if (worker && r < nr) {
            ag[i] = MoeFmt<F>::dot(sg + (size_t)r * rb, grp, xv, xs, grid);
            au[i] = MoeFmt<F>::dot(su + (size_t)r * rb, grp, xv, xs, grid);
        }
    }
    __syncthreads();                                              // the stage is read (when red aliases it)
    float* tot = red + 2 * nr * G;                                // red [2][nr][G], then tot [2][nr]
#pragma unroll
    for (int i = 0; i < MOE_RPT; ++i) {
        const int r = rl + RL * i;
        if (worker && r < nr) {
            red[r * G + grp] = ag[i];
            red[(nr + r) * G + grp] = au[i];
        }
    }
    __syncthreads();
    moe_row_sums(red, tot, 2 * nr, G);
    for (int i = tid; i < nr; i += blockDim.x) {
        float g = tot[i], u = tot[nr + i];
        if (clamp > 0.0f) {
            g = fminf(g, clamp);
            u = fminf(fmaxf(u, -clamp), clamp);
        }
        const float silu = g * (1.0f / (1.0f + expf(-g)));
        hout[i] = silu * u * rw;
    }
}

template <int F>
__device__ __forceinline__ void moe_gate_up_impl(uint8_t* smem, const uint64_t* grid, const uint8_t* Wg,
                                                 const uint8_t* Wu, const float* x, const int* ids,
                                                 const float* route_w, float* h, int n_experts, int ff, int dim,
                                                 int rows_per_block, float clamp) {
    const int tid = threadIdx.x;
    const int slot = blockIdx.y, r0 = blockIdx.x * rows_per_block;
    const int nr = min(rows_per_block, ff - r0);
    if (nr <= 0) return;                                          // block-uniform
    const int e = ids ? ids[slot] : slot;
    const float rw = route_w ? route_w[slot] : 1.0f;
    float* hout = h + (size_t)slot * ff + r0;
    if (e < 0 || e >= n_experts) {                                // a bad id: NaN rows, nothing read
        for (int i = tid; i < nr; i += blockDim.x) hout[i] = __int_as_float(0x7fc00000);
        return;
    }
    const int rb = moe_row_bytes<F>(dim), span = nr * rb;
    const uint8_t* sg = moe_stage(smem, Wg + ((size_t)e * ff + r0) * rb, span);
    const uint8_t* su = moe_stage(smem + moe_room(span), Wu + ((size_t)e * ff + r0) * rb, span);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    moe_gate_up_pair<F>(grid, sg, su, rb, nr, x, rw, hout, clamp, reinterpret_cast<float*>(smem), dim);
}

// An expert id, every id outside [0, n_experts) as -1 (so the distinct ids are at most n_experts + 1).
__device__ __forceinline__ int moe_canon(int v, int n_experts) { return v >= 0 && v < n_experts ? v : -1; }

// The u-th distinct expert (moe_canon) of ids[0 .. n) in ascending order (INT_MAX when there are fewer); every
// thread gets it. n <= 1024 (ops/experts.py MAX_PAIRS); `pick` is a __shared__ int the caller owns.
__device__ __forceinline__ int moe_unique_id(const int* ids, int n, int n_experts, int u, int* pick) {
    if (threadIdx.x == 0) *pick = 0x7fffffff;
    __syncthreads();
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        const int v = moe_canon(ids[p], n_experts);
        bool first = true;
        int below = 0;                                            // distinct values < v
        for (int q = 0; q < n; ++q) {
            const int w = moe_canon(ids[q], n_experts);
            if (w == v && q < p) first = false;
            if (w < v) {
                bool seen = false;                                // count w once: at its first occurrence
                for (int t = 0; t < q && !seen; ++t) seen = moe_canon(ids[t], n_experts) == w;
                below += !seen;
            }
        }
        if (first && below == u) *pick = v;
    }
    __syncthreads();
    return *pick;
}

// Several rows (issue 17): the pairs p = (row n, slot s), p = n * k + s, of ids [nx * k] (null: pair p is expert
// p % k) grouped by expert: block (x, u) stages rows [r0, r0 + rows_per_block) of the u-th distinct expert's gate
// and up once, then runs every pair that chose it (ascending p) with x + n * x_stride, writing h[p]. A bad id's
// pairs get NaN rows (nothing read). The stage stays while the pairs run: red sits after it.
template <int F>
__device__ __forceinline__ void moe_gate_up_rows_impl(uint8_t* smem, const uint64_t* grid, const uint8_t* Wg,
                                                      const uint8_t* Wu, const float* x, const int* ids,
                                                      const float* route_w, float* h, int n_experts, int ff,
                                                      int dim, int rows_per_block, float clamp, int n_pairs, int k,
                                                      int x_stride, int* pick) {
    const int tid = threadIdx.x;
    const int r0 = blockIdx.x * rows_per_block;
    const int nr = min(rows_per_block, ff - r0);
    if (nr <= 0) return;                                          // block-uniform
    int e;
    if (ids) {
        e = moe_unique_id(ids, n_pairs, n_experts, blockIdx.y, pick);
        if (e == 0x7fffffff) return;                              // fewer distinct experts than blocks
    } else {
        if ((int)blockIdx.y >= k) return;
        e = moe_canon(blockIdx.y, n_experts);
    }
    if (e < 0) {                                                  // the bad ids' group: NaN pairs
        for (int p = 0; p < n_pairs; ++p)
            if (moe_canon(ids ? ids[p] : p % k, n_experts) < 0)
                for (int i = tid; i < nr; i += blockDim.x) h[(size_t)p * ff + r0 + i] = __int_as_float(0x7fc00000);
        return;
    }
    const int rb = moe_row_bytes<F>(dim), span = nr * rb;
    const uint8_t* sg = moe_stage(smem, Wg + ((size_t)e * ff + r0) * rb, span);
    const uint8_t* su = moe_stage(smem + moe_room(span), Wu + ((size_t)e * ff + r0) * rb, span);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem + 2 * moe_room(span));
    for (int p = 0; p < n_pairs; ++p) {                           // block-uniform loop
        if (moe_canon(ids ? ids[p] : p % k, n_experts) != e) continue;
        moe_gate_up_pair<F>(grid, sg, su, rb, nr, x + (size_t)(p / k) * x_stride, route_w ? route_w[p] : 1.0f,
                            h + (size_t)p * ff + r0, clamp, red, dim);
    }
}

// ---- down (+ shared expert's output, + hc_post) -----------------------------------------------------------------
template <int F>
__device__ __forceinline__ void moe_down_impl(uint8_t* smem, const uint64_t* grid, const uint8_t* W, const int* ids,
                                              const float* h, const float* add, const float* hc_post,
                                              const float* hc_comb, const float* hc_x, float* out, int n_slots,
                                              int n_experts, int dim, int ff, int rows_per_block, int hc) {
    const int G = ff / 32, RL = blockDim.x / G, tid = threadIdx.x;
    const int grp = tid % G, rl = tid / G;
    const bool worker = rl < RL;
    const int r0 = blockIdx.x * rows_per_block, nr = min(rows_per_block, dim - r0);
    if (nr <= 0) return;                                          // block-uniform
    const int rb = moe_row_bytes<F>(ff), span = nr * rb, room = moe_room(span);
    bool bad = false;
    for (int s = 0; s < n_slots; ++s) {
        const int e = ids ? ids[s] : s;
        if (e < 0 || e >= n_experts) bad = true;
        else moe_stage(smem + s * room, W + ((size_t)e * dim + r0) * rb, span);
    }
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();

    float acc[MOE_RPT];
#pragma unroll
    for (int i = 0; i < MOE_RPT; ++i) acc[i] = 0.0f;
    for (int s = 0; s < n_slots; ++s) {                            // experts in slot order: a fixed sum
        const int e = ids ? ids[s] : s;
        if (!worker || e < 0 || e >= n_experts) continue;
        const uint8_t* st = smem + s * room + ((size_t)(W + ((size_t)e * dim + r0) * rb) & 15);
        float hv[32], hs[2];
        moe_load_x(h + (size_t)s * ff + 32 * grp, hv);
        moe_half_sums(hv, hs);
#pragma unroll
        for (int i = 0; i < MOE_RPT; ++i) {
            const int r = rl + RL * i;
            if (r < nr) acc[i] += MoeFmt<F>::dot(st + (size_t)r * rb, grp, hv, hs, grid);
        }
    }
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem);                  // [nr][G], then tot [nr]
    float* tot = red + nr * G;
#pragma unroll
    for (int i = 0; i < MOE_RPT; ++i) {
        const int r = rl + RL * i;
        if (worker && r < nr) red[r * G + grp] = acc[i];
    }
    __syncthreads();
    moe_row_sums(red, tot, nr, G);
    for (int i = tid; i < nr; i += blockDim.x) {
        const int r = r0 + i;
        float y = bad ? __int_as_float(0x7fc00000) : tot[i];
        if (add) y += add[r];
        if (hc_post) {
            for (int k = 0; k < hc; ++k) {
                float mix = 0.0f;
                for (int j = 0; j < hc; ++j) mix += hc_comb[j * hc + k] * hc_x[(size_t)j * dim + r];
                out[(size_t)k * dim + r] = hc_post[k] * y + mix;
            }
        } else {
            out[r] = y;
        }
    }
}

// Several rows: block (x, n) is row n's moe_down_impl on ids + n * k, h + n * k * ff, add + n * dim, the mHC
// post / comb of mix + n * (2 + hc) * hc ([pre, post, comb] per row), hc_x + n * hc * dim and out + n * (hc ? hc : 1)
// * dim: each row reads its own k experts' rows (an expert two rows chose is read twice, from L2 when they run
// together), with exactly the single-token arithmetic. mix null: out = y.
template <int F>
__device__ __forceinline__ void moe_down_rows_impl(uint8_t* smem, const uint64_t* grid, const uint8_t* W,
                                                   const int* ids, const float* h, const float* add,
                                                   const float* mix, const float* hc_x, float* out, int n_slots,
                                                   int n_experts, int dim, int ff, int rows_per_block, int hc) {
    const size_t n = blockIdx.y, mrec = (size_t)(2 + hc) * hc;
    moe_down_impl<F>(smem, grid, W, ids ? ids + n * n_slots : nullptr, h + n * n_slots * ff,
                     add ? add + n * dim : nullptr, mix ? mix + n * mrec + hc : nullptr,
                     mix ? mix + n * mrec + 2 * hc : nullptr, mix ? hc_x + n * hc * dim : nullptr,
                     out + n * (mix ? hc : 1) * dim, n_slots, n_experts, dim, ff, rows_per_block, mix ? hc : 0);
}

// ---- exact dequantisation ---------------------------------------------------------------------------------------
template <int F>
__device__ __forceinline__ void moe_dequant_impl(const uint64_t* grid, const uint8_t* W, float* out, int n_groups) {
    const int gidx = blockIdx.x * blockDim.x + threadIdx.x;
    if (gidx >= n_groups) return;
    float w[32];
    MoeFmt<F>::dq(W, gidx, w, grid);
    float4* o = reinterpret_cast<float4*>(out + (size_t)gidx * 32);
#pragma unroll
    for (int v = 0; v < 8; ++v) o[v] = make_float4(w[4 * v], w[4 * v + 1], w[4 * v + 2], w[4 * v + 3]);
}

__device__ __forceinline__ void moe_load_grid(uint64_t* grid_s) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) grid_s[i] = moe_iq2xxs_grid[i];
}

// ---- entry points, one per format ---------------------------------------------------------------------------
// Common contracts. Wg / Wu [n_experts, ff, dim] and W [n_experts, dim, ff]: the raw GGUF bytes of a stacked expert
// tensor (or of one shared-expert matrix with n_experts = 1); cols % 256 == 0 for IQ2_XXS / Q2_K / Q4_K, % 32
// otherwise; x, h, add 16-byte aligned. ids [n_slots] int32 (null: slot s is expert s); an id outside
// [0, n_experts) gives NaN outputs. route_w [n_slots] (null: 1). clamp <= 0: no clamp.
// hc_post [hc] / hc_comb [hc, hc] (comb[j*hc + k]) / hc_x [hc, dim]: the mHC post mix of this sub-layer; with
// hc_post null the kernel writes y [dim], else out [hc, dim] = X'. Thread layout: G = cols / 32 column groups
// (cols = dim for gate/up, ff for down), RL = blockDim.x / G row lanes, rows_per_block <= 8 * RL; the dynamic
// shared memory is max(staged rows, partial sums), computed by ds4py/cuda/ops/experts.py (moe_smem_bytes).

// h[s, r] for rows r of expert ids[s]. Launch: grid (ceil(ff / rows_per_block), n_slots), block (32 * ceil(G * RL /
// 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_gate_up_iq2_xxs(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    __shared__ uint64_t grid_s[256];
    pdl_wait();
    pdl_launch_dependents();
    moe_load_grid(grid_s);
    moe_gate_up_impl<FMT_IQ2_XXS>(moe_smem, grid_s, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                clamp);
}

// y or X' rows [r0, r0 + rows_per_block) summed over the n_slots experts. Launch: grid (ceil(dim / rows_per_block)),
// block (32 * ceil(G * RL / 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_down_iq2_xxs(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* hc_post, const float* hc_comb, const float* hc_x, float* out,
                                 int n_slots, int n_experts, int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    __shared__ uint64_t grid_s[256];
    pdl_wait();
    pdl_launch_dependents();
    moe_load_grid(grid_s);
    moe_down_impl<FMT_IQ2_XXS>(moe_smem, grid_s, W, ids, h, add, hc_post, hc_comb, hc_x, out, n_slots, n_experts,
                             dim, ff, rows_per_block, hc);
}

// out[32g + j] = value j of column group g (n_groups groups of 32 from the start of W). Launch: grid
// (ceil(n_groups / 256)), block (256).
extern "C" __global__ void moe_dequant_iq2_xxs(const uint8_t* W, float* out, int n_groups) {
    pdl_wait();
    pdl_launch_dependents();
    moe_dequant_impl<FMT_IQ2_XXS>(moe_iq2xxs_grid, W, out, n_groups);
}

// h[s, r] for rows r of expert ids[s]. Launch: grid (ceil(ff / rows_per_block), n_slots), block (32 * ceil(G * RL /
// 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_gate_up_q2_k(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_gate_up_impl<FMT_Q2_K>(moe_smem, nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                clamp);
}

// y or X' rows [r0, r0 + rows_per_block) summed over the n_slots experts. Launch: grid (ceil(dim / rows_per_block)),
// block (32 * ceil(G * RL / 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_down_q2_k(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* hc_post, const float* hc_comb, const float* hc_x, float* out,
                                 int n_slots, int n_experts, int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_down_impl<FMT_Q2_K>(moe_smem, nullptr, W, ids, h, add, hc_post, hc_comb, hc_x, out, n_slots, n_experts,
                          dim, ff, rows_per_block, hc);
}

// out[32g + j] = value j of column group g (n_groups groups of 32 from the start of W). Launch: grid
// (ceil(n_groups / 256)), block (256).
extern "C" __global__ void moe_dequant_q2_k(const uint8_t* W, float* out, int n_groups) {
    pdl_wait();
    pdl_launch_dependents();
    moe_dequant_impl<FMT_Q2_K>(nullptr, W, out, n_groups);
}

// h[s, r] for rows r of expert ids[s]. Launch: grid (ceil(ff / rows_per_block), n_slots), block (32 * ceil(G * RL /
// 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_gate_up_q4_k(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_gate_up_impl<FMT_Q4_K>(moe_smem, nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                clamp);
}

// y or X' rows [r0, r0 + rows_per_block) summed over the n_slots experts. Launch: grid (ceil(dim / rows_per_block)),
// block (32 * ceil(G * RL / 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_down_q4_k(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* hc_post, const float* hc_comb, const float* hc_x, float* out,
                                 int n_slots, int n_experts, int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_down_impl<FMT_Q4_K>(moe_smem, nullptr, W, ids, h, add, hc_post, hc_comb, hc_x, out, n_slots, n_experts,
                          dim, ff, rows_per_block, hc);
}

// out[32g + j] = value j of column group g (n_groups groups of 32 from the start of W). Launch: grid
// (ceil(n_groups / 256)), block (256).
extern "C" __global__ void moe_dequant_q4_k(const uint8_t* W, float* out, int n_groups) {
    pdl_wait();
    pdl_launch_dependents();
    moe_dequant_impl<FMT_Q4_K>(nullptr, W, out, n_groups);
}

// h[s, r] for rows r of expert ids[s]. Launch: grid (ceil(ff / rows_per_block), n_slots), block (32 * ceil(G * RL /
// 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_gate_up_mxfp4(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_gate_up_impl<FMT_MXFP4>(moe_smem, nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                clamp);
}

// y or X' rows [r0, r0 + rows_per_block) summed over the n_slots experts. Launch: grid (ceil(dim / rows_per_block)),
// block (32 * ceil(G * RL / 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_down_mxfp4(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* hc_post, const float* hc_comb, const float* hc_x, float* out,
                                 int n_slots, int n_experts, int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_down_impl<FMT_MXFP4>(moe_smem, nullptr, W, ids, h, add, hc_post, hc_comb, hc_x, out, n_slots, n_experts,
                           dim, ff, rows_per_block, hc);
}

// out[32g + j] = value j of column group g (n_groups groups of 32 from the start of W). Launch: grid
// (ceil(n_groups / 256)), block (256).
extern "C" __global__ void moe_dequant_mxfp4(const uint8_t* W, float* out, int n_groups) {
    pdl_wait();
    pdl_launch_dependents();
    moe_dequant_impl<FMT_MXFP4>(nullptr, W, out, n_groups);
}

// h[s, r] for rows r of expert ids[s]. Launch: grid (ceil(ff / rows_per_block), n_slots), block (32 * ceil(G * RL /
// 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_gate_up_q8_0(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_gate_up_impl<FMT_Q8_0>(moe_smem, nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                clamp);
}

// y or X' rows [r0, r0 + rows_per_block) summed over the n_slots experts. Launch: grid (ceil(dim / rows_per_block)),
// block (32 * ceil(G * RL / 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_down_q8_0(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* hc_post, const float* hc_comb, const float* hc_x, float* out,
                                 int n_slots, int n_experts, int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_down_impl<FMT_Q8_0>(moe_smem, nullptr, W, ids, h, add, hc_post, hc_comb, hc_x, out, n_slots, n_experts,
                          dim, ff, rows_per_block, hc);
}

// out[32g + j] = value j of column group g (n_groups groups of 32 from the start of W). Launch: grid
// (ceil(n_groups / 256)), block (256).
extern "C" __global__ void moe_dequant_q8_0(const uint8_t* W, float* out, int n_groups) {
    pdl_wait();
    pdl_launch_dependents();
    moe_dequant_impl<FMT_Q8_0>(nullptr, W, out, n_groups);
}

// h[s, r] for rows r of expert ids[s]. Launch: grid (ceil(ff / rows_per_block), n_slots), block (32 * ceil(G * RL /
// 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_gate_up_f16(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_gate_up_impl<FMT_F16>(moe_smem, nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                clamp);
}

// y or X' rows [r0, r0 + rows_per_block) summed over the n_slots experts. Launch: grid (ceil(dim / rows_per_block)),
// block (32 * ceil(G * RL / 32)), dynamic shared memory moe_smem_bytes.
extern "C" __global__ void moe_down_f16(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* hc_post, const float* hc_comb, const float* hc_x, float* out,
                                 int n_slots, int n_experts, int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_down_impl<FMT_F16>(moe_smem, nullptr, W, ids, h, add, hc_post, hc_comb, hc_x, out, n_slots, n_experts,
                         dim, ff, rows_per_block, hc);
}

// out[32g + j] = value j of column group g (n_groups groups of 32 from the start of W). Launch: grid
// (ceil(n_groups / 256)), block (256).
extern "C" __global__ void moe_dequant_f16(const uint8_t* W, float* out, int n_groups) {
    pdl_wait();
    pdl_launch_dependents();
    moe_dequant_impl<FMT_F16>(nullptr, W, out, n_groups);
}

// ---- several rows (issue 17): the grouped gate + up and the per-row down, one launch each -------------------
// moe_gate_up_rows_<fmt>: grid (ceil(ff / rows_per_block), distinct experts at most: min(n_pairs, n_experts) or k
// with ids null), smem moe_smem_bytes with the stage and the partial sums side by side. moe_down_rows_<fmt>:
// grid (ceil(dim / rows_per_block), rows), smem as moe_down_<fmt>.

// Grouped gate + up of nx rows. Launch: grid (ceil(ff / rows_per_block), distinct experts at most), smem moe_rows_plan.
extern "C" __global__ void moe_gate_up_rows_iq2_xxs(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp, int n_pairs, int k,
                                    int x_stride) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    __shared__ int pick;
    __shared__ uint64_t grid_s[256];
    pdl_wait();
    pdl_launch_dependents();
    moe_load_grid(grid_s);
    moe_gate_up_rows_impl<FMT_IQ2_XXS>(moe_smem, grid_s, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                    clamp, n_pairs, k, x_stride, &pick);
}

// Per-row down of nx rows. Launch: grid (ceil(dim / rows_per_block), nx), smem as moe_down.
extern "C" __global__ void moe_down_rows_iq2_xxs(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* mix, const float* hc_x, float* out, int n_slots, int n_experts,
                                 int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    __shared__ uint64_t grid_s[256];
    pdl_wait();
    pdl_launch_dependents();
    moe_load_grid(grid_s);
    moe_down_rows_impl<FMT_IQ2_XXS>(moe_smem, grid_s, W, ids, h, add, mix, hc_x, out, n_slots, n_experts,
                             dim, ff, rows_per_block, hc);
}

// Grouped gate + up of nx rows. Launch: grid (ceil(ff / rows_per_block), distinct experts at most), smem moe_rows_plan.
extern "C" __global__ void moe_gate_up_rows_q2_k(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp, int n_pairs, int k,
                                    int x_stride) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    __shared__ int pick;
    pdl_wait();
    pdl_launch_dependents();
    moe_gate_up_rows_impl<FMT_Q2_K>(moe_smem, nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                    clamp, n_pairs, k, x_stride, &pick);
}

// Per-row down of nx rows. Launch: grid (ceil(dim / rows_per_block), nx), smem as moe_down.
extern "C" __global__ void moe_down_rows_q2_k(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* mix, const float* hc_x, float* out, int n_slots, int n_experts,
                                 int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_down_rows_impl<FMT_Q2_K>(moe_smem, nullptr, W, ids, h, add, mix, hc_x, out, n_slots, n_experts,
                          dim, ff, rows_per_block, hc);
}

// Grouped gate + up of nx rows. Launch: grid (ceil(ff / rows_per_block), distinct experts at most), smem moe_rows_plan.
extern "C" __global__ void moe_gate_up_rows_q4_k(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp, int n_pairs, int k,
                                    int x_stride) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    __shared__ int pick;
    pdl_wait();
    pdl_launch_dependents();
    moe_gate_up_rows_impl<FMT_Q4_K>(moe_smem, nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                    clamp, n_pairs, k, x_stride, &pick);
}

// Per-row down of nx rows. Launch: grid (ceil(dim / rows_per_block), nx), smem as moe_down.
extern "C" __global__ void moe_down_rows_q4_k(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* mix, const float* hc_x, float* out, int n_slots, int n_experts,
                                 int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_down_rows_impl<FMT_Q4_K>(moe_smem, nullptr, W, ids, h, add, mix, hc_x, out, n_slots, n_experts,
                          dim, ff, rows_per_block, hc);
}

// Grouped gate + up of nx rows. Launch: grid (ceil(ff / rows_per_block), distinct experts at most), smem moe_rows_plan.
extern "C" __global__ void moe_gate_up_rows_mxfp4(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp, int n_pairs, int k,
                                    int x_stride) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    __shared__ int pick;
    pdl_wait();
    pdl_launch_dependents();
    moe_gate_up_rows_impl<FMT_MXFP4>(moe_smem, nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                    clamp, n_pairs, k, x_stride, &pick);
}

// Per-row down of nx rows. Launch: grid (ceil(dim / rows_per_block), nx), smem as moe_down.
extern "C" __global__ void moe_down_rows_mxfp4(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* mix, const float* hc_x, float* out, int n_slots, int n_experts,
                                 int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_down_rows_impl<FMT_MXFP4>(moe_smem, nullptr, W, ids, h, add, mix, hc_x, out, n_slots, n_experts,
                           dim, ff, rows_per_block, hc);
}

// Grouped gate + up of nx rows. Launch: grid (ceil(ff / rows_per_block), distinct experts at most), smem moe_rows_plan.
extern "C" __global__ void moe_gate_up_rows_q8_0(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp, int n_pairs, int k,
                                    int x_stride) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    __shared__ int pick;
    pdl_wait();
    pdl_launch_dependents();
    moe_gate_up_rows_impl<FMT_Q8_0>(moe_smem, nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                    clamp, n_pairs, k, x_stride, &pick);
}

// Per-row down of nx rows. Launch: grid (ceil(dim / rows_per_block), nx), smem as moe_down.
extern "C" __global__ void moe_down_rows_q8_0(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* mix, const float* hc_x, float* out, int n_slots, int n_experts,
                                 int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_down_rows_impl<FMT_Q8_0>(moe_smem, nullptr, W, ids, h, add, mix, hc_x, out, n_slots, n_experts,
                          dim, ff, rows_per_block, hc);
}

// Grouped gate + up of nx rows. Launch: grid (ceil(ff / rows_per_block), distinct experts at most), smem moe_rows_plan.
extern "C" __global__ void moe_gate_up_rows_f16(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids,
                                    const float* route_w, float* h, int n_experts, int ff, int dim,
                                    int rows_per_block, float clamp, int n_pairs, int k,
                                    int x_stride) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    __shared__ int pick;
    pdl_wait();
    pdl_launch_dependents();
    moe_gate_up_rows_impl<FMT_F16>(moe_smem, nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block,
                                    clamp, n_pairs, k, x_stride, &pick);
}

// Per-row down of nx rows. Launch: grid (ceil(dim / rows_per_block), nx), smem as moe_down.
extern "C" __global__ void moe_down_rows_f16(const uint8_t* W, const int* ids, const float* h, const float* add,
                                 const float* mix, const float* hc_x, float* out, int n_slots, int n_experts,
                                 int dim, int ff, int rows_per_block, int hc) {
    extern __shared__ __align__(16) uint8_t moe_smem[];
    pdl_wait();
    pdl_launch_dependents();
    moe_down_rows_impl<FMT_F16>(moe_smem, nullptr, W, ids, h, add, mix, hc_x, out, n_slots, n_experts,
                         dim, ff, rows_per_block, hc);
}
