// int8-activation numerics (Numerics.act_quant): an activation rounded the way the reference's act_quant mode rounds
// the input of a quantised matmul (ds4py/ref/weights.py Weights.act), so the fp32 GEMVs / GEMMs that read it then
// compute the reference's products on the same rounded values:
//   act_round_q8_0 (Q8_0 / MXFP4 weights, ds4py.ref.ops.q8_0_round): blocks of 32, d = amax / 127,
//     q = rint(x / d) (d = 0: q = rint(x)), y = q * f16(d);
//   act_round_q8_k (K- and IQ-quants, ds4py.ref.ops.q8_k_round, ggml's Q8_K): blocks of 256, iscale = -127 / m
//     (m the signed value of largest magnitude; 0 when the block is zero), q = min(rint(x * iscale), 127),
//     d = 1 / iscale (0 when iscale is), y = q * d.
// The reference's fp32 operations, each correctly rounded (__fdiv_rn, __fmul_rn, rintf = round half to even), so
// y is its q8_*_round(x) bit for bit. Q8_K's sign: with |m| in place of m every q and d are negated when m < 0,
// and q * d is the same float (rint is odd; the clip at 127 never cuts: |x * iscale| <= 127 (1 + 2^-23)^2), so
// the maximum's sign needs no search (as experts.cu's MoeActI8).
#include "portable.cuh"
#include "reduce.cuh"
#include <cuda_fp16.h>

// Each thread rounds 8 consecutive floats of one row (two 16-byte loads): thread t of the grid takes row
// t / (width / 8), floats 8 (t % (width / 8)) .. + 8; LANES consecutive threads hold one block (Q8_0: 4 x 8 = 32,
// Q8_K: 32 x 8 = 256) and meet by shuffles (width % 32 / 256 == 0, so a block never straddles rows or warps).
template <int LANES>
__device__ __forceinline__ bool act_load8(const float* x, int n_rows, int width, int stride, float v[8],
                                          size_t& at, float& amax) {
    const size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t per_row = (size_t)(width >> 3);
    const bool live = t < (size_t)n_rows * per_row;
    const size_t r = live ? t / per_row : 0, c = live ? 8 * (t % per_row) : 0;
    at = r * (size_t)stride + c;
    amax = 0.0f;
    if (live) {
        const float4 a = *reinterpret_cast<const float4*>(x + at), b = *reinterpret_cast<const float4*>(x + at + 4);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
    }
#pragma unroll
    for (int off = 1; off < LANES; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(DS4_FULL_MASK, amax, off));
    return live;
}

__device__ __forceinline__ void act_store8(float* y, size_t at, const float o[8]) {
    *reinterpret_cast<float4*>(y + at) = make_float4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<float4*>(y + at + 4) = make_float4(o[4], o[5], o[6], o[7]);
}

// The two roundings of a thread's 8 floats v (o: the rounded values), amax the largest magnitude of their block
// (LANES threads).
struct ActQ8_0 {
    static constexpr int LANES = 4;
    __device__ static __forceinline__ void apply(const float v[8], float amax, float o[8]) {
        const float d = __fdiv_rn(amax, 127.0f);
        const float div = d > 0.0f ? d : 1.0f;
        const float d16 = __half2float(__float2half_rn(d));
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = __fmul_rn(rintf(__fdiv_rn(v[j], div)), d16);
    }
};
struct ActQ8_K {
    static constexpr int LANES = 32;
    __device__ static __forceinline__ void apply(const float v[8], float amax, float o[8]) {
        const float is = amax != 0.0f ? __fdiv_rn(-127.0f, amax) : 0.0f;
        const float d = is != 0.0f ? __fdiv_rn(1.0f, is) : 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = __fmul_rn(fminf(rintf(__fmul_rn(v[j], is)), 127.0f), d);
    }
};

// A kernel's body: load, round as Q, store.
template <class Q>
__device__ __forceinline__ void act_round(const float* x, float* y, int n_rows, int width, int stride) {
    pdl_wait();
    pdl_launch_dependents();
    float v[8], amax, o[8];
    size_t at;
    if (!act_load8<Q::LANES>(x, n_rows, width, stride, v, at, amax)) return;
    Q::apply(v, amax, o);
    act_store8(y, at, o);
}

// Common contract: x, y [n_rows rows of `width` floats, `stride` floats apart] (16-byte aligned, stride % 8 == 0);
// y may be x. Launch: grid (ceil(n_rows * width / 8 / threads)), block (threads, a multiple of 32).

// Q8_0 rounding, width % 32 == 0. Launch: as above.
extern "C" __global__ void act_round_q8_0(const float* x, float* y, int n_rows, int width, int stride) {
    act_round<ActQ8_0>(x, y, n_rows, width, stride);
}

// Q8_K rounding, width % 256 == 0. Launch: as above.
extern "C" __global__ void act_round_q8_k(const float* x, float* y, int n_rows, int width, int stride) {
    act_round<ActQ8_K>(x, y, n_rows, width, stride);
}
