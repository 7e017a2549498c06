// Exact top-k of a score vector on the device (the indexer's row selection, MODEL.md §2.3), by radix select:
// four passes of 8-bit histograms over order-preserving integer keys find the k-th largest key T exactly; then one
// pass in index order writes every index with key > T and, of those with key == T, the lowest-indexed ones until
// k are taken. The output is the selected set in ascending index order: deterministic, no float atomics (the
// histograms count with integer shared-memory atomics, whose totals do not depend on the order).
// Ties at the k-th value therefore go to the lowest indices. (ds4py/ref/forward.topk_mask takes numpy's
// argpartition choice among tied entries, which is unspecified; without ties at the threshold both pick the same
// set.)
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"

// Geometry (-D value from ds4py/cuda/ops/topk.py DEFINES): TOPK_REG keys kept in registers per thread (with the
// block of 1024, n <= 1024 * TOPK_REG scores are read from memory once).
#ifndef TOPK_REG
#error "TOPK_REG comes from the DEFINES table of ds4py/cuda/ops/topk.py"
#endif


// The selection of one score vector by the whole block (every thread calls it).
__device__ void topk_select(const float* scores, int n, int k, int* out) {
    __shared__ int hist[256];
    __shared__ int wsum[32];
    __shared__ unsigned s_prefix;
    __shared__ int s_remaining;
    const int tid = threadIdx.x, bd = blockDim.x;
    if (n <= k) {
        for (int i = tid; i < n; i += bd) out[i] = i;
        return;
    }
    unsigned reg[TOPK_REG];
#pragma unroll
    for (int r = 0; r < TOPK_REG; ++r) {
        const int i = tid + r * bd;
        reg[r] = i < n ? order_key(scores[i]) : 0u;
    }

    unsigned prefix = 0u, mask = 0u;
    int remaining = k;                                   // how many still to take at or below the current prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
        if (tid < 256) hist[tid] = 0;
        __syncthreads();
#pragma unroll
        for (int r = 0; r < TOPK_REG; ++r) {
            const int i = tid + r * bd;
            if (i < n && (reg[r] & mask) == prefix) atomicAdd(&hist[(reg[r] >> shift) & 255u], 1);
        }
        for (int i = tid + TOPK_REG * bd; i < n; i += bd) {
            const unsigned key = order_key(scores[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        if (tid < 32) {                                  // warp 0: the digit holding the remaining-th largest
            const int hi = 255 - 8 * tid;                // lane l scans digits hi .. hi-7 (descending)
            int cnt = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) cnt += hist[hi - j];
            int incl = cnt;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(DS4_FULL_MASK, incl, o);
                if (tid >= o) incl += y;
            }
            const int excl = incl - cnt;
            if (excl < remaining && remaining <= incl) {   // exactly one lane
                int acc = excl;
                for (int j = 0; j < 8; ++j) {
                    const int c = hist[hi - j];
                    if (acc + c >= remaining) {
                        s_prefix = prefix | ((unsigned)(hi - j) << shift);
                        s_remaining = remaining - acc;
                        break;
                    }
                    acc += c;
                }
            }
        }
        __syncthreads();
        prefix = s_prefix;
        remaining = s_remaining;
        mask |= 255u << shift;
    }

    // T = prefix; take all keys > T and the first `remaining` keys == T, in index order.
    const unsigned T = prefix;
    int gt_before = 0, eq_before = 0;
    const int chunks = (n + bd - 1) / bd;
    for (int r = 0; r < chunks; ++r) {                   // uniform trip count: every thread runs every scan
        const int i = tid + r * bd;
        unsigned key = 0u;
        if (i < n) {
            key = 0u;
#pragma unroll
            for (int rr = 0; rr < TOPK_REG; ++rr)
                if (rr == r) key = reg[rr];
            if (r >= TOPK_REG) key = order_key(scores[i]);
        }
        const int gt = i < n && key > T, eq = i < n && key == T;
        int total;
        const int packed = block_exclusive_scan((gt << 16) | eq, wsum, &total);
        const int g_ex = gt_before + (packed >> 16), e_ex = eq_before + (packed & 0xffff);
        if (gt || (eq && e_ex < remaining)) out[g_ex + min(e_ex, remaining)] = i;
        gt_before += total >> 16;
        eq_before += total & 0xffff;
    }
}

// out[0 .. min(n, k)) = indices of the k largest scores[0 .. n), ascending. n = (pos_slot[0] + 1) / ratio when
// pos_slot is given (the visible compressed rows of a decode step), else n_static. n <= k: out = 0 .. n-1.
// NaN scores order above +inf (positive NaN) or below -inf (negative NaN).
// Launch: grid (1), block (1024).
extern "C" __global__ __launch_bounds__(1024) void topk_radix_select(const float* scores, const int* pos_slot,
                                                                     int ratio, int n_static, int k, int* out) {
    pdl_wait();
    pdl_launch_dependents();
    topk_select(scores, pos_slot ? (pos_slot[0] + 1) / ratio : n_static, k, out);
}

// Prefill: the selection of T score rows, row r's n = (pos[r] + 1) / ratio scores at scores + r * score_stride into
// out + r * k; each row's selection is exactly topk_radix_select's for that query.
// Launch: grid (T), block (1024).
extern "C" __global__ __launch_bounds__(1024) void topk_radix_select_rows(const float* scores, int score_stride,
                                                                          const int* pos, int ratio, int k, int* out) {
    pdl_wait();
    pdl_launch_dependents();
    const int r = blockIdx.x;
    topk_select(scores + (size_t)r * score_stride, (pos[r] + 1) / ratio, k, out + (size_t)r * k);
}
