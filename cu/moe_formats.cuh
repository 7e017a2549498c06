// moe_formats.cuh: the routed / shared expert weight formats of V4 Flash GGUFs (ggml block layouts; ds4py/quant/),
// as device decoders shared by experts.cu (decode: dot products on the integer codes) and moe_prefill.cu (prefill:
// exact values staged as bf16 for the tensor cores). IQ2_XXS, Q2_K, Q4_K, MXFP4, Q8_0, F16.
#pragma once
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"
#define FMT_IQ2_XXS 0
#define FMT_Q2_K 1
#define FMT_Q4_K 2
#define FMT_MXFP4 3
#define FMT_Q8_0 4
#define FMT_F16 5
// VQ-8 at b bits is FMT_VQ_BASE + b (MoeVqBits, and experts.cu / moe_prefill.cu pick their VQ paths by it).
#define FMT_VQ_BASE 100
#define FMT_VQ6 106
#define FMT_VQ7 107
#define FMT_VQ8 108
#define FMT_VQ9 109
#define FMT_VQ10 110
#define FMT_VQ11 111
#define FMT_VQ12 112
#define FMT_VQ13 113

// The expert weight formats, one entry each: X(kernel suffix, FMT_ id, weights per block, bytes per block,
// table), table = 1 when the decoder reads the IQ2 grid (staged in shared memory per block). Every expert entry
// point of experts.cu and moe_prefill.cu is generated from this list (MOE_FORMATS(template)), and the host reads
// it too (ds4py/cuda/signature.py expands the entry points, ds4py/cuda/ops/experts.py's FORMATS is this list):
// a new format is one entry here plus its decoder below.
#define MOE_FORMATS(X) \
    X(iq2_xxs, FMT_IQ2_XXS, 256, 66, 1) \
    X(q2_k, FMT_Q2_K, 256, 84, 0) \
    X(q4_k, FMT_Q4_K, 256, 144, 0) \
    X(mxfp4, FMT_MXFP4, 32, 17, 0) \
    X(q8_0, FMT_Q8_0, 32, 34, 0) \
    X(f16, FMT_F16, 32, 64, 0)

// VQ-8 routed experts (ds4py/quant/vq.py, docs/vq.md) in their device layout (ds4py/cuda/vq_layout.py: the file's
// streams, hi planes and gains repacked at upload, the file unchanged): X(suffix, FMT_ id, weights per block, bytes
// per block = the index width, codewords). experts.cu reads them (decode and the grouped rows kernels) and
// moe_prefill.cu (the prefill blocks on tensor cores); the codebook travels at the head of each matrix's device
// copy. Every width `quantize-vq` writes (ds4py/quant/vq.py MIN_BITS .. MAX_BITS) has an entry.
#define MOE_VQ_FORMATS(X) \
    X(vq6, FMT_VQ6, 64, 6, 64) \
    X(vq7, FMT_VQ7, 64, 7, 128) \
    X(vq8, FMT_VQ8, 64, 8, 256) \
    X(vq9, FMT_VQ9, 64, 9, 512) \
    X(vq10, FMT_VQ10, 64, 10, 1024) \
    X(vq11, FMT_VQ11, 64, 11, 2048) \
    X(vq12, FMT_VQ12, 64, 12, 4096) \
    X(vq13, FMT_VQ13, 64, 13, 8192)

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
// Byte j of w as a float, exactly: one PRMT builds the bits of 2^23 + byte (the same bits as moe_u2f(byte)), one
// FADD takes 2^23 off. The dot products use it where w's bytes hold the codes (after one mask per 4 codes).
__device__ __forceinline__ float moe_b2f(unsigned w, int j, unsigned k = 0x4B000000u) {
    return __uint_as_float(__byte_perm(w, k, 0x7440u | (unsigned)j)) - 8388608.0f;
}
// x with its sign flipped when bit j of bits is set: fmaf(v, moe_flip(x, bits, j), s) has the bits of
// fmaf(bit ? -v : v, x, s) (-v * x and v * -x are the same exact product), for a shift and one LOP3.
__device__ __forceinline__ float moe_flip(float x, unsigned bits, int j) {
    return __uint_as_float(__float_as_uint(x) ^ ((bits << (31 - j)) & 0x80000000u));
}
__device__ __forceinline__ float moe_i8f(unsigned byte) {                 // the int8 in the low byte
    return __uint_as_float(0x4B000000u | ((byte & 255u) ^ 0x80u)) - 8388736.0f;
}

// How a format's 32 values of a column group decompose for the tensor cores (cq): integer codes c_j (exact in
// bf16) with w_j = s_h c_j - o_h per half h of 16 values: SCALED one scale per 32, no offset (IQ2_XXS, MXFP4,
// Q8_0); AFFINE32 scale and min per 32 (Q4_K); AFFINE16 per 16 (Q2_K); NONE: no codes (F16, the values).
#define MOE_CODES_SCALED 0
#define MOE_CODES_AFFINE32 1
#define MOE_CODES_AFFINE16 2
#define MOE_CODES_NONE 3

template <int F> struct MoeFmt;

// IQ2_XXS (66 B / 256): f16 d, then per 32 weights aux0 (4 grid indices) and aux1 (4 x 7 sign bits, 4-bit scale).
// value = d * (0.5 + ls) * 0.25 * grid[idx][j] * sign. 2-byte aligned: read in 16-bit halves.
template <> struct MoeFmt<FMT_IQ2_XXS> {
    static constexpr int QK = 256, BYTES = 66;
    static constexpr int CODES = MOE_CODES_SCALED;
    // cq: the integer codes of the group (exact in bf16) and w = s[h] * c - o[h] for half h (o = 0 here)
    __device__ static __forceinline__ void cq(const uint8_t* base, int grp, float* c, float* s, float* o,
                                              const uint64_t* grid) {
        float db;
        values<false>(base, grp, c, db, grid);
        s[0] = s[1] = db;
        o[0] = o[1] = 0.0f;
    }
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
        float db;
        values<true>(base, grp, w, db, grid);
    }
    // The group's 32 signed grid magnitudes into out, times db (its scale) where SCALED: cq's codes or dq's weights.
    template <bool SCALED>
    __device__ static __forceinline__ void values(const uint8_t* base, int grp, float* out, float& db,
                                                  const uint64_t* grid) {
        unsigned a0, a1;
        aux(base, grp, a0, a1, db);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint64_t g = grid[(a0 >> (8 * k)) & 255u];
            const unsigned sg = signs(a1, k);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                float v = moe_u2f((unsigned)(g >> (8 * j)) & 255u);
                if (SCALED) v = __fmul_rn(v, db);
                out[8 * k + j] = (sg >> j) & 1u ? -v : v;
            }
        }
    }
    // grid: moe_load_grid16's table (the magnitudes as bf16 halves of 4 words per entry), not moe_iq2xxs_grid.
    // The products and sums of fmaf(byte_j, x_j with sign bit j flipped, s) over j, in that order (moe_prefill.cu's
    // tile dot keeps it; its tests compare the bits): a magnitude's float is its word shifted or masked (no byte
    // permute and subtraction), and the sign bits reach x by rotations of a1, one per two weights: the bit rotated
    // to 31 goes on by a LOP3 with 0x80000000, the bit at 0 by one IMAD x + (r << 31) (it flips bit 31 the same).
    __device__ static __forceinline__ float dot(const uint8_t* base, int grp, const float* x, const float*,
                                                const uint64_t* grid) {
        const uint4* g16 = reinterpret_cast<const uint4*>(grid);
        unsigned a0, a1;
        float db;
        aux(base, grp, a0, a1, db);
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint4 g = g16[(a0 >> (8 * k)) & 255u];
            // sign j of the group: bit 7k + j of a1 (j < 7), bit 7 the parity of the 7 (ksigns_iq2xs)
            const unsigned r1 = __funnelshift_r(a1, a1, 7 * k + 1);    // bit 0: sign 1, bit 31: sign 0
            const unsigned r3 = __funnelshift_r(a1, a1, 7 * k + 3);    // signs 3, 2
            const unsigned r5 = __funnelshift_r(a1, a1, 7 * k + 5);    // signs 5, 4
            const unsigned r7 = __funnelshift_r(a1, a1, 7 * k + 7);    // bit 31: sign 6
            const unsigned par = (unsigned)__popc(a1 & (127u << (7 * k)));   // bit 0: sign 7
            const unsigned w[8] = {g.x << 16, g.x & 0xFFFF0000u, g.y << 16, g.y & 0xFFFF0000u,
                                   g.z << 16, g.z & 0xFFFF0000u, g.w << 16, g.w & 0xFFFF0000u};
            const unsigned xs[8] = {__float_as_uint(x[8 * k]) ^ (r1 & 0x80000000u),
                                    __float_as_uint(x[8 * k + 1]) + (r1 << 31),
                                    __float_as_uint(x[8 * k + 2]) ^ (r3 & 0x80000000u),
                                    __float_as_uint(x[8 * k + 3]) + (r3 << 31),
                                    __float_as_uint(x[8 * k + 4]) ^ (r5 & 0x80000000u),
                                    __float_as_uint(x[8 * k + 5]) + (r5 << 31),
                                    __float_as_uint(x[8 * k + 6]) ^ (r7 & 0x80000000u),
                                    __float_as_uint(x[8 * k + 7]) + (par << 31)};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                s0 = fmaf(__uint_as_float(w[j]), __uint_as_float(xs[j]), s0);
                s1 = fmaf(__uint_as_float(w[j + 4]), __uint_as_float(xs[j + 4]), s1);
            }
        }
        return (s0 + s1) * db;
    }
};

// Q2_K (84 B / 256): 16 scale bytes (low nibble scale, high nibble min, per 16 weights), 64 bytes of 2-bit q
// (weight 128h + 32j + l = bits 2j of qs[32h + l]), f16 d, f16 dmin. value = d*sc*q - dmin*m. 4-byte aligned.
template <> struct MoeFmt<FMT_Q2_K> {
    static constexpr int QK = 256, BYTES = 84;
    static constexpr int CODES = MOE_CODES_AFFINE16;
    __device__ static __forceinline__ void cq(const uint8_t* base, int grp, float* c, float* s, float* o,
                                              const uint64_t*) {
        const uint8_t* b = base + (size_t)(grp >> 3) * BYTES;
        const int cw = (grp & 7) * 32, sh = 2 * ((cw >> 5) & 3);
        const float d = moe_f16(b + 80), dmin = moe_f16(b + 82);
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
            const unsigned sc = b[(cw >> 4) + sub];
            s[sub] = __fmul_rn(d, moe_u2f(sc & 15u));
            o[sub] = __fmul_rn(dmin, moe_u2f(sc >> 4));
            const uint8_t* qs = b + 16 + 32 * (cw >> 7) + 16 * sub;
#pragma unroll
            for (int word = 0; word < 4; ++word) {
                const unsigned u = moe_u32(qs + 4 * word);
#pragma unroll
                for (int by = 0; by < 4; ++by) c[16 * sub + 4 * word + by] = moe_u2f((u >> (8 * by + sh)) & 3u);
            }
        }
    }
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
                const unsigned u = (moe_u32(qs + 4 * word) >> sh) & 0x03030303u;
                s0 = fmaf(moe_b2f(u, 0), x[16 * sub + 4 * word], s0);
                s1 = fmaf(moe_b2f(u, 1), x[16 * sub + 4 * word + 1], s1);
                s0 = fmaf(moe_b2f(u, 2), x[16 * sub + 4 * word + 2], s0);
                s1 = fmaf(moe_b2f(u, 3), x[16 * sub + 4 * word + 3], s1);
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
    static constexpr int CODES = MOE_CODES_AFFINE32;
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
    __device__ static __forceinline__ void cq(const uint8_t* base, int grp, float* c, float* s, float* o,
                                              const uint64_t*) {
        const uint8_t* b = base + (size_t)(grp >> 3) * BYTES;
        const int gi = grp & 7;
        unsigned sc, mn;
        scales(b, gi, sc, mn);
        s[0] = s[1] = __fmul_rn(moe_f16(b), moe_u2f(sc));
        o[0] = o[1] = __fmul_rn(moe_f16(b + 2), moe_u2f(mn));
        const uint8_t* qs = b + 16 + 32 * (gi >> 1);
        const int sh = 4 * (gi & 1);
#pragma unroll
        for (int word = 0; word < 8; ++word) {
            const unsigned u = moe_u32(qs + 4 * word);
#pragma unroll
            for (int by = 0; by < 4; ++by) c[4 * word + by] = moe_u2f((u >> (8 * by + sh)) & 15u);
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
            const unsigned u = (moe_u32(qs + 4 * word) >> sh) & 0x0F0F0F0Fu;
            s0 = fmaf(moe_b2f(u, 0), x[4 * word], s0);
            s1 = fmaf(moe_b2f(u, 1), x[4 * word + 1], s1);
            s0 = fmaf(moe_b2f(u, 2), x[4 * word + 2], s0);
            s1 = fmaf(moe_b2f(u, 3), x[4 * word + 3], s1);
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
    static constexpr int CODES = MOE_CODES_SCALED;
    __device__ static __forceinline__ float scale(const uint8_t* b) {
        const unsigned e = b[0];
        return __uint_as_float(e < 2u ? 0x00200000u << e : (e - 1u) << 23);
    }
    __device__ static __forceinline__ void cq(const uint8_t* base, int grp, float* c, float* s, float* o,
                                              const uint64_t*) {
        const uint8_t* b = base + (size_t)grp * BYTES;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const unsigned q = b[1 + j];
            c[j] = moe_mxfp4_code(q & 15u);
            c[j + 16] = moe_mxfp4_code(q >> 4);
        }
        s[0] = s[1] = scale(b);
        o[0] = o[1] = 0.0f;
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
    static constexpr int CODES = MOE_CODES_SCALED;
    __device__ static __forceinline__ void cq(const uint8_t* base, int grp, float* c, float* s, float* o,
                                              const uint64_t*) {
        const uint8_t* b = base + (size_t)grp * BYTES;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const unsigned u = moe_u16(b + 2 + 2 * j);
            c[2 * j] = moe_i8f(u);
            c[2 * j + 1] = moe_i8f(u >> 8);
        }
        s[0] = s[1] = moe_f16(b);
        o[0] = o[1] = 0.0f;
    }
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
    static constexpr int CODES = MOE_CODES_NONE;     // no codes: the values themselves (split into bf16 pieces)
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

// VQ-8 in its device layout (ds4py/cuda/vq_layout.py): a matrix of X experts x rows x cols is [codebook: K
// codewords x 8 E4M3 bytes] [X expert streams] [X * rows hi rows (13 bits)] [X * rows f32 gains]. An expert's
// stream is its rows' SB-bit fields back to back (SB = BITS, 12 at 13 bits), unchanged from the file (SB bytes per
// run of 8 indices = 64 weights, LSB first), padded to a multiple of 128 bytes, so with the matrix 128-byte
// aligned every expert's stream starts on a line; a hi row is bit 12 of the row's indices (one byte per run, the
// file's hi plane); the gain is the row's effective one (the file's f16 gain times any sidecar scales).
// w[8j + i] = g * C[idx_j][i] exactly (fl32(g * c): E4M3 x f16 fits f32); the staged rows are read through
// MoeSpan (experts.cu).
template <int BITS> struct MoeVq {
    static_assert(BITS >= 6 && BITS <= 13, "VQ-8 widths are 6 .. 13 bits");
    static constexpr int QK = 64, SB = BITS == 13 ? 12 : BITS, BYTES = SB, K = 1 << BITS;
    static constexpr int CODES = MOE_CODES_SCALED;
    __device__ static __forceinline__ int stream_bytes(int cols) { return (cols / 64) * SB; }
    __device__ static __forceinline__ int hi_bytes(int cols) { return BITS == 13 ? cols / 64 : 0; }
    // bytes of one expert's stream: its rows back to back, padded to whole 128-byte lines
    __device__ static __forceinline__ size_t expert_bytes(int rows, int cols) {
        return ((size_t)rows * stream_bytes(cols) + 127) & ~(size_t)127;
    }
    // the 4 indices of column group grp (32 weights) of the stream row s (hi row h at 13 bits): bits
    // [4 SB grp, 4 SB (grp + 1)) of the row, i.e. (SB + 1) / 2 whole bytes from byte 4 SB grp / 8, shifted by 0 or
    // 4 (odd SB, odd grp)
    __device__ static __forceinline__ void indices(const uint8_t* s, const uint8_t* h, int grp, unsigned* idx) {
        if (SB == 12) {                                           // two 24-bit halves of 6 bytes
            const uint8_t* b = s + 6 * grp;
            const unsigned lo = b[0] | ((unsigned)b[1] << 8) | ((unsigned)b[2] << 16);
            const unsigned hi = b[3] | ((unsigned)b[4] << 8) | ((unsigned)b[5] << 16);
            idx[0] = lo & 4095u;
            idx[1] = lo >> 12;
            idx[2] = hi & 4095u;
            idx[3] = hi >> 12;
        } else if (SB == 8) {                                     // a byte each
            const uint8_t* b = s + 4 * grp;
            const unsigned w = b[0] | ((unsigned)b[1] << 8) | ((unsigned)b[2] << 16) | ((unsigned)b[3] << 24);
#pragma unroll
            for (int i = 0; i < 4; ++i) idx[i] = (w >> (8 * i)) & 255u;
        } else {                                                  // (SB + 1) / 2 <= 6 bytes, shifted by 0 or 4
            constexpr int NBY = (SB + 1) / 2;
            const int bit = 4 * SB * grp;
            const uint8_t* b = s + (bit >> 3);
            uint64_t v = 0;
#pragma unroll
            for (int i = 0; i < NBY; ++i) v |= (uint64_t)b[i] << (8 * i);
            v >>= (bit & 7);
#pragma unroll
            for (int i = 0; i < 4; ++i) idx[i] = (unsigned)(v >> (SB * i)) & ((1u << SB) - 1u);
        }
        if (BITS == 13) {
            const unsigned t = (h[grp >> 1] >> (4 * (grp & 1))) & 15u;
#pragma unroll
            for (int i = 0; i < 4; ++i) idx[i] |= ((t >> i) & 1u) << 12;
        }
    }
    // sum over the group of c_j x_j (the codewords from the shared-memory codebook cb, 8 bytes each), unscaled
    __device__ static __forceinline__ float dot(const uint8_t* s, const uint8_t* h, int grp, const float* x,
                                                const uint64_t* cb) {
        unsigned idx[4];
        indices(s, h, grp, idx);
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint64_t c = cb[idx[i]];
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                const float2 v = __half22float2(fp8x2_e4m3_to_half2((unsigned short)(c >> (8 * j))));
                s0 = fmaf(v.x, x[8 * i + j], s0);
                s1 = fmaf(v.y, x[8 * i + j + 1], s1);
            }
        }
        return s0 + s1;
    }
};

// A ggml format's row bytes (its blocks back to back).
template <int F> struct MoeRow {
    __device__ static __forceinline__ int bytes(int cols) { return cols / MoeFmt<F>::QK * MoeFmt<F>::BYTES; }
};

template <int F> __device__ __forceinline__ int moe_row_bytes(int cols) { return MoeRow<F>::bytes(cols); }

// The IQ2_XXS grid into shared memory (a block-wide copy; __syncthreads before use).
__device__ __forceinline__ void moe_load_grid(uint64_t* grid_s) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) grid_s[i] = moe_iq2xxs_grid[i];
}

// The IQ2_XXS grid as MoeFmt<FMT_IQ2_XXS>::dot reads it, 256 x 16 bytes (at, 16-byte aligned, has 512 words): entry
// i's word p = the bf16 bits of magnitude 2p + 1 (high half) and 2p (low half), exact (8, 25, 43 need 6 significant
// bits), so `word << 16` and `word & 0xFFFF0000` are their floats. A block-wide fill; __syncthreads before use.
__device__ __forceinline__ void moe_load_grid16(uint64_t* at) {
    uint4* t = reinterpret_cast<uint4*>(at);
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        const uint64_t g = moe_iq2xxs_grid[i];
        unsigned w[4];
#pragma unroll
        for (int p = 0; p < 4; ++p)
            w[p] = (__float_as_uint(moe_u2f((unsigned)(g >> (16 * p + 8)) & 255u)) & 0xFFFF0000u) |
                   (__float_as_uint(moe_u2f((unsigned)(g >> (16 * p)) & 255u)) >> 16);
        t[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

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
