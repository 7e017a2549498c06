// MoE routing of one token (MODEL.md §2.4, ds4py/ref/forward.route): s = sqrt(softplus(logits)) from the
// ffn_gate_inp GEMV; the experts are the top k of s + bias (the bias picks, never weighs), or tid2eid[token] on
// the hash-routed layers (token id read from the device, so the graph needs no host value); weights s[id] /
// sum s[id] * route_scale (route_norm) or s[id] * route_scale. V4.1: the logits divided by gate_temp first, the sum
// plus norm_eps (1e-20; V4: 1 and 0, which change no bit). One warp, no shared memory, no atomics.
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"

// Geometry (-D value from ds4py/cuda/ops/router.py DEFINES): ROUTE_PER_LANE experts per lane of the one warp
// (32 * ROUTE_PER_LANE experts at most).
#ifndef ROUTE_PER_LANE
#error "ROUTE_PER_LANE comes from the DEFINES table of ds4py/cuda/ops/router.py"
#endif


__device__ __forceinline__ float route_score(float x) {     // sqrt(logaddexp(0, x)), computed like numpy's
    return sqrtf(x == 0.0f ? 0.69314718055994530942f : fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))));
}

// The lane's bias values (a weight: loaded before pdl_wait, under the previous kernel's tail).
__device__ __forceinline__ void route_bias(const float* bias, int n_experts, float* bb) {
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const int e = threadIdx.x + 32 * i;
        bb[i] = bias && e < n_experts ? bias[e] : 0.0f;
    }
}

// One token's routing by one warp (every lane calls it); bb: route_bias's values.
__device__ __forceinline__ void route_one(const float* logits, const float* bias, const float* bb, const int* tid2eid,
                                          const int* token, int n_experts, int k, int vocab, float route_scale,
                                          int route_norm, float gate_temp, float norm_eps, int* ids, float* weights) {
    const int lane = threadIdx.x;
    const float nan = __int_as_float(0x7fc00000);
    float s[ROUTE_PER_LANE], b[ROUTE_PER_LANE];
    // every logit the lane needs loaded first, then scored: one round trip, not one per expert (route_score's
    // branches between the loads kept ptxas from hoisting them); the same values, so the same bits
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        s[i] = e < n_experts ? logits[e] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        s[i] = e < n_experts ? route_score(s[i] / gate_temp) : 0.0f;
        b[i] = e < n_experts ? (bias ? s[i] + bb[i] : s[i]) : -__int_as_float(0x7f800000);
    }
    int my_id = -1;                                      // lane j < k ends with the j-th expert
    float my_s = nan;
    if (tid2eid) {
        const int tok = token[0];
        if (lane < k) {
            const int e = (tok >= 0 && tok < vocab) ? tid2eid[(size_t)tok * k + lane] : -1;
            if (e >= 0 && e < n_experts) {
                my_id = e;
                const float se = route_score(logits[e] / gate_temp);
                my_s = se;
            }
        }
    } else {
        unsigned taken = 0u;                             // bit i: expert lane + 32i already chosen
        for (int j = 0; j < k; ++j) {
            float bv = -__int_as_float(0x7f800000);
            int bi = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < ROUTE_PER_LANE; ++i) {
                const int e = lane + 32 * i;
                if (e < n_experts && !(taken >> i & 1u) && (b[i] > bv || (bi == 0x7fffffff && b[i] == b[i]))) {
                    bv = b[i];
                    bi = e;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(DS4_FULL_MASK, bv, o);
                const int oi = __shfl_xor_sync(DS4_FULL_MASK, bi, o);
                if (oi != 0x7fffffff && (bi == 0x7fffffff || ov > bv || (ov == bv && oi < bi))) {
                    bv = ov;
                    bi = oi;
                }
            }
            if (bi != 0x7fffffff && (bi & 31) == lane) taken |= 1u << (bi >> 5);
            if (lane == j && bi != 0x7fffffff) my_id = bi;
        }
        if (lane < k && my_id >= 0) my_s = route_score(logits[my_id] / gate_temp);
    }
    // sum over the k picks in order (numpy's sequential sum of a short row)
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += __shfl_sync(DS4_FULL_MASK, my_s, j);
    if (lane < k) {
        ids[lane] = my_id;
        weights[lane] = (route_norm ? my_s / (sum + norm_eps) : my_s) * route_scale;
    }
}

// logits [n_experts]; bias [n_experts] or null; tid2eid [vocab, k] int32 or null (then the biased top k);
// token: the device token id (read only with tid2eid). ids [k] int32, weights [k] f32. An out-of-range token or
// table entry gives id -1 and a NaN weight (visible downstream instead of a wild read). Ties in the top k go to the
// lower expert index (numpy's stable argsort), NaN scores are never picked before numbers.
// Launch: grid (1), block (32).
extern "C" __global__ void moe_route(const float* logits, const float* bias, const int* tid2eid, const int* token,
                                     int n_experts, int k, int vocab, float route_scale, int route_norm,
                                     float gate_temp, float norm_eps, int* ids, float* weights) {
    float bb[ROUTE_PER_LANE];
    route_bias(bias, n_experts, bb);
    pdl_wait();
    pdl_launch_dependents();
    route_one(logits, bias, bb, tid2eid, token, n_experts, k, vocab, route_scale, route_norm, gate_temp, norm_eps,
              ids, weights);
}

// Prefill: moe_route of T tokens, row r: logits [T, n_experts], token [T], ids / weights [T, k].
// Launch: grid (T), block (32).
extern "C" __global__ void moe_route_rows(const float* logits, const float* bias, const int* tid2eid,
                                          const int* token, int n_experts, int k, int vocab, float route_scale,
                                          int route_norm, float gate_temp, float norm_eps, int* ids, float* weights) {
    float bb[ROUTE_PER_LANE];
    route_bias(bias, n_experts, bb);
    pdl_wait();
    pdl_launch_dependents();
    const size_t r = blockIdx.x;
    route_one(logits + r * n_experts, bias, bb, tid2eid, token + r, n_experts, k, vocab, route_scale, route_norm,
              gate_temp, norm_eps, ids + r * k, weights + r * k);
}
