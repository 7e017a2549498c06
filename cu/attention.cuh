// attention.cuh: the per-element pieces of V4 Flash attention shared by attention.cu, compressor.cu and indexer.cu
// (MODEL.md §2.3; ds4py/ref/ops.py is the reference): RoPE on interleaved pairs, the FP8 e4m3 / FP4 e2m1 fake
// quantisers with power-of-two block scales, and an in-place Hadamard transform in shared memory.
//
// Layout convention of every kernel that uses these: thread t holds the pair of dims (2t, 2t+1) of a row, so a warp
// holds 64 consecutive dims (one FP8 block) and 16 lanes hold 32 dims (one FP4 block); RoPE pairs never straddle
// threads. The quantisers are exact: same value as ops.fp8_fake_quant / ops.fp4_fake_quant for the same input.
#pragma once
#include "portable.cuh"
#include "reduce.cuh"

#define DS4_FP8_AMAX_FLOOR 1e-4f                // ops.fp8_fake_quant: amax floored at 1e-4
#define DS4_FP4_AMAX_FLOOR 0x1.8p-124f          // ops.fp4_fake_quant: 6 * 2^-126

// 2^ceil(log2(x)) for a positive normal x (ops.pow2_scale): an exact power of two is kept, anything else rounds up.
__device__ __forceinline__ float ds4_pow2_ceil(float x) {
    const unsigned u = __float_as_uint(x);
    const unsigned e = ((u >> 23) & 0xffu) + ((u & 0x7fffffu) ? 1u : 0u);
    return __uint_as_float(e << 23);
}

// 1 / s for s = a power of two from ds4_pow2_ceil (exact).
__device__ __forceinline__ float ds4_pow2_inv(float s) {
    return __uint_as_float((254u - ((__float_as_uint(s) >> 23) & 0xffu)) << 23);
}

// Round to the FP8 e4m3 grid (nearest even, saturating at 448): the conversion instruction does exactly this.
__device__ __forceinline__ float ds4_round_e4m3(float y) {
    return fp8_e4m3_to_float(float_to_fp8_e4m3(y));
}

// Round to the FP4 e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (nearest even), after clipping to [-6, 6].
__device__ __forceinline__ float ds4_round_e2m1(float y) {
    y = fminf(fmaxf(y, -6.0f), 6.0f);
    const float a = fabsf(y);
    const float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
    const float inv = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);
    return copysignf(rintf(a * inv) * step, y);             // a / step and the product are exact
}

// Fake-quant of blocks held as a pair per lane, all 32 lanes calling: FP8 e4m3 over 64 dims (a whole warp, scale
// 2^ceil(log2(amax/448)), amax >= 1e-4) or FP4 e2m1 over 32 dims (aligned groups of 16 lanes, 2^ceil(log2(amax/6))).
template <bool FP8> __device__ __forceinline__ float2 ds4_fake_quant_block(float2 v) {
    float amax = fmaxf(fabsf(v.x), fabsf(v.y));
#pragma unroll
    for (int o = FP8 ? 16 : 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(DS4_FULL_MASK, amax, o));
    const float s = FP8 ? ds4_pow2_ceil(fmaxf(amax, DS4_FP8_AMAX_FLOOR) * (1.0f / 448.0f))
                        : ds4_pow2_ceil(fmaxf(amax, DS4_FP4_AMAX_FLOOR) * (1.0f / 6.0f));
    const float inv = ds4_pow2_inv(s);
    if (FP8) return make_float2(ds4_round_e4m3(v.x * inv) * s, ds4_round_e4m3(v.y * inv) * s);
    return make_float2(ds4_round_e2m1(v.x * inv) * s, ds4_round_e2m1(v.y * inv) * s);
}
__device__ __forceinline__ float2 ds4_fp8_block64(float2 v) { return ds4_fake_quant_block<true>(v); }
__device__ __forceinline__ float2 ds4_fp4_block32(float2 v) { return ds4_fake_quant_block<false>(v); }

// sin and cos of a float angle, accurate to about an ulp, without the local-memory slow path of sincosf
// (Payne-Hanek, which gives every kernel a stack frame). The reduction x - k*pi/2 is a float Cody-Waite with three
// fma terms for |x| <= 105615 (decode positions below ~100K: no double math, which is slow on GB10), and runs in
// double (pi/2 in two parts) above; then float minimax polynomials on [-pi/4, pi/4] (cephes).
__device__ __forceinline__ void ds4_sincos(float x, float* sp, float* cp) {
    float f;
    int q;
    if (fabsf(x) <= 105615.0f) {
        const float k = rintf(x * 0.636619747f);
        f = fmaf(k, -1.57079601e+00f, x);
        f = fmaf(k, -3.13916473e-07f, f);
        f = fmaf(k, -5.39030253e-15f, f);
        q = (int)k & 3;
    } else {
        const double xd = (double)x;
        const double k = rint(xd * 0.63661977236758134308);
        double r = fma(-k, 1.5707963267948966192, xd);
        r = fma(-k, 6.1232339957367658e-17, r);
        f = (float)r;
        q = (int)(((long long)k) & 3);
    }
    const float z = f * f;
    const float s = f + f * z * (-1.6666654611e-1f + z * (8.3321608736e-3f + z * -1.9515295891e-4f));
    const float c = 1.0f - 0.5f * z + z * z * (4.166664568298827e-2f + z * (-1.388731625493765e-3f +
                                                                           z * 2.443315711809948e-5f));
    *sp = q == 0 ? s : q == 1 ? c : q == 2 ? -s : -c;
    *cp = q == 0 ? c : q == 1 ? -s : q == 2 ? -c : s;
}

// The rotation of the pair (x[2i], x[2i+1]) by (cos, sin); inverse: the conjugate rotation.
__device__ __forceinline__ float2 ds4_rotate(float2 v, float c, float s, bool inverse) {
    if (inverse) s = -s;
    return make_float2(v.x * c - v.y * s, v.x * s + v.y * c);
}

// Rotate the pair (x[2i], x[2i+1]) by angle pos * freqs[i] (ops.rope; the angle is the fp32 product, like the
// reference). inverse: the conjugate rotation (sin -> -sin).
__device__ __forceinline__ float2 ds4_rope_pair(float2 v, int pos, float freq, bool inverse) {
    float s, c;
    ds4_sincos((float)pos * freq, &s, &c);
    return ds4_rotate(v, c, s, inverse);
}

// In-place Walsh-Hadamard transform of buf[0..n) (n a power of two), natural (Sylvester) order, unscaled:
// out_j = sum_i (-1)^popcount(i & j) x_i. Every thread of the block calls it (it has barriers); threads
// 0..n/2-1 do one butterfly per stage. The caller syncs before (buf written) and reads after it returns.
__device__ __forceinline__ void ds4_hadamard_smem(float* buf, int n) {
    const int t = threadIdx.x;
    for (int h = 1; h < n; h <<= 1) {
        __syncthreads();
        if (t < n / 2) {
            const int i = (t / h) * 2 * h + (t % h);
            const float a = buf[i], b = buf[i + h];
            buf[i] = a + b;
            buf[i + h] = a - b;
        }
    }
    __syncthreads();
}

// ---- the key tile of the split-key attention kernels (attention.cu decode, prefill_attn.cu prefill) ------------
// Stage key rows base .. base+tile-1 of `keys` (anything with row(j) -> const float*) into ktile [tile][stride];
// rows at or past `end` are zeros (their p is 0 and 0 * 0 stays 0). tpr threads per row, 16-byte copies.
template <class Keys>
__device__ __forceinline__ void attn_stage_tile(float* ktile, const Keys& keys, int base, int end, int hd, int stride,
                                                int tpr) {
    const int r = threadIdx.x / tpr, j = base + r;
    float* dst = ktile + r * stride;
    if (j < end) {
        const float* src = keys.row(j);
        for (int c = threadIdx.x % tpr; c < hd / 4; c += tpr) cp_async_16(dst + 4 * c, src + 4 * c);
    } else {
        for (int c = threadIdx.x % tpr; c < hd / 4; c += tpr)
            *reinterpret_cast<float4*>(dst + 4 * c) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    cp_async_commit();
    cp_async_wait_all();
}

// q.k of HPW heads against the staged key kl: lane (kl, kh) sums half kh of the dims (the caller adds the two
// halves with a shuffle by 16). qs holds the warp's HPW query rows [HPW][hd]; fixed order, 4 dims at a time.
template <int HPW>
__device__ __forceinline__ void attn_half_scores(float* s, const float* ktile, const float* qs, int kl, int kh, int hd,
                                                 int stride) {
    const int half = hd / 2;
#pragma unroll
    for (int i = 0; i < HPW; ++i) s[i] = 0.0f;
    const float* kr = ktile + kl * stride + kh * half;
    const float* qh = qs + kh * half;
    for (int d = 0; d < half; d += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(kr + d);
#pragma unroll
        for (int i = 0; i < HPW; ++i) {
            const float4 q4 = *reinterpret_cast<const float4*>(qh + i * hd + d);
            s[i] += q4.x * k4.x + q4.y * k4.y + q4.z * k4.z + q4.w * k4.w;
        }
    }
}
