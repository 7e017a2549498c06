// Routed experts of V4 Flash for a block of T tokens (prefill, issue 17), grouped by expert on tensor cores:
//   moe_prefill_route          count the (token, slot) pairs per expert, exclusive scan, scatter the pairs into
//                              expert-sorted order (within an expert by pair index p = t*k + s: deterministic),
//                              and list the work items: (expert, first sorted row) per MOEP_BM rows of an expert;
//   moe_prefill_gate_up_<fmt>  per work item and GEMM_BN-wide feature tile: g = x Wg[e]^T, u = x Wu[e]^T on the
//                              tile's gathered token rows, H[row] = silu(min(g, c)) * clamp(u, -c, c) * route_w;
//   moe_prefill_down_<fmt>     per work item and feature tile: Yp[row] = H[row] W2[e]^T (one row per pair);
//   moe_prefill_combine        y[t] = sum_s Yp[pos[t*k + s]] (s ascending) (+ add[t]): no float atomics.
// Skew: an expert with many rows gets one work item per MOEP_BM of them; the grids are sized for the worst case
// (P / MOEP_BM + min(E + 1, P) items) and blocks past the real count exit. An id outside [0, n_experts) goes to a
// bucket of its own (index n_experts) whose rows come out NaN, nothing read for them.
//
// Numerics: x, the decoded expert weights (exact values from moe_formats.cuh, rounded to bf16) and H (before the
// down) are bf16; products accumulate in fp32 over k tiles of 32 in increasing order; SwiGLU in fp32 as
// experts.cu. A pair's result depends only on its own x row and expert (not on which rows share its tile).
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"
#include "mma_tile.cuh"
#include "moe_formats.cuh"

#ifndef MOEP_WARPS_M
#error "MOEP_WARPS_M comes from ds4py/cuda/ops/moe_prefill.py (DEFINES)"
#endif
#ifndef MOEP_WARPS_N
#error "MOEP_WARPS_N comes from ds4py/cuda/ops/moe_prefill.py (DEFINES)"
#endif
#ifndef MOEP_MAX_EXPERTS
#error "MOEP_MAX_EXPERTS comes from ds4py/cuda/ops/moe_prefill.py (DEFINES)"
#endif

#define MOEP_BM (32 * MOEP_WARPS_M)
#define MOEP_BN (32 * MOEP_WARPS_N)
#define MOEP_BK 32
#define MOEP_LDS (MOEP_BK + 8)
#define MOEP_THREADS (32 * MOEP_WARPS_M * MOEP_WARPS_N)
#define MOEP_ROUTE_WARPS 32
#define MOEP_MT 2
#define MOEP_NT 4
static_assert(MOEP_THREADS % MOEP_BM == 0, "every tile row has the same number of staging threads");

// ---- route: count, scan, scatter -----------------------------------------------------------------------------
// Bucket of pair p: its expert, or n_experts for an id outside [0, n_experts).
__device__ __forceinline__ int moep_bucket(int id, int n_experts) { return id >= 0 && id < n_experts ? id : n_experts; }

// Warp w owns pairs [w*chunk, (w+1)*chunk); cnt[w][b] counts its pairs of bucket b, then becomes where its next
// one goes. The lanes of one 32-pair step with the same bucket find each other with __match_any_sync.
// Outputs: offsets [n_experts + 2] (bucket b's sorted rows are [offsets[b], offsets[b+1])), sorted [P] (pair of
// each sorted row), pos [P] (sorted row of each pair), the work items tile_bucket / tile_row [max_tiles] (bucket,
// first sorted row), info[0] = number of work items. n_experts <= MOEP_MAX_EXPERTS. Launch: grid 1, block 1024.
extern "C" __global__ void __launch_bounds__(1024) moe_prefill_route(const int* ids, int* offsets, int* sorted,
        int* pos, int* tile_bucket, int* tile_row, int* info, int n_pairs, int n_experts, int max_tiles) {
    __shared__ int cnt[MOEP_ROUTE_WARPS][MOEP_MAX_EXPERTS + 1];
    __shared__ int start[MOEP_MAX_EXPERTS + 2], tstart[MOEP_MAX_EXPERTS + 2];
    pdl_wait();
    pdl_launch_dependents();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nb = n_experts + 1;
    for (int i = tid; i < MOEP_ROUTE_WARPS * (MOEP_MAX_EXPERTS + 1); i += blockDim.x) (&cnt[0][0])[i] = 0;
    __syncthreads();
    const int chunk = (n_pairs + MOEP_ROUTE_WARPS - 1) / MOEP_ROUTE_WARPS;
    const int p0 = warp * chunk, p1 = min(n_pairs, p0 + chunk);
    for (int base = p0; base < p0 + chunk; base += 32) {          // the same trip count in every warp's lanes
        const int p = base + lane;
        const int b = p < p1 ? moep_bucket(ids[p], n_experts) : -1;
        const unsigned same = __match_any_sync(DS4_FULL_MASK, b);
        if (b >= 0 && lane == __ffs(same) - 1) cnt[warp][b] += __popc(same);
        __syncwarp();
    }
    __syncthreads();
    // per bucket: the warps' exclusive prefix, the bucket's total
    for (int b = tid; b < nb; b += blockDim.x) {
        int s = 0;
        for (int w = 0; w < MOEP_ROUTE_WARPS; w++) {
            const int c = cnt[w][b];
            cnt[w][b] = s;
            s += c;
        }
        start[b] = s;
    }
    __syncthreads();
    // warp 0: exclusive scans over the buckets of the row counts and of the work items (ceil(count / MOEP_BM))
    if (warp == 0) {
        const int per = (nb + 31) / 32, b0 = lane * per;
        int rows = 0, items = 0;
        for (int i = 0; i < per; i++)
            if (b0 + i < nb) {
                rows += start[b0 + i];
                items += (start[b0 + i] + MOEP_BM - 1) / MOEP_BM;
            }
        int rx = rows, ix = items;                               // inclusive warp scans
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int r = __shfl_up_sync(DS4_FULL_MASK, rx, d);
            const int it = __shfl_up_sync(DS4_FULL_MASK, ix, d);
            if (lane >= d) {
                rx += r;
                ix += it;
            }
        }
        int r = rx - rows, it = ix - items;
        for (int i = 0; i < per; i++)
            if (b0 + i < nb) {
                const int c = start[b0 + i];
                tstart[b0 + i] = it;
                start[b0 + i] = r;                               // counts become starts
                offsets[b0 + i] = r;
                r += c;
                it += (c + MOEP_BM - 1) / MOEP_BM;
            }
        if (lane == 31) {
            offsets[nb] = rx;
            info[0] = min(ix, max_tiles);
        }
    }
    __syncthreads();
    // work items of each bucket
    for (int b = tid; b < nb; b += blockDim.x) {
        const int c = (b + 1 < nb ? start[b + 1] : n_pairs) - start[b];
        for (int j = 0; j * MOEP_BM < c; j++) {
            const int i = tstart[b] + j;
            if (i < max_tiles) {
                tile_bucket[i] = b;
                tile_row[i] = start[b] + j * MOEP_BM;
            }
        }
    }
    // scatter: the same walk as the count, each pair to its bucket's next row
    for (int base = p0; base < p0 + chunk; base += 32) {
        const int p = base + lane;
        const int b = p < p1 ? moep_bucket(ids[p], n_experts) : -1;
        const unsigned same = __match_any_sync(DS4_FULL_MASK, b);
        if (b >= 0) {
            const int row = start[b] + cnt[warp][b] + __popc(same & ((1u << lane) - 1u));
            sorted[row] = p;
            pos[p] = row;
        }
        __syncwarp();
        if (b >= 0 && lane == __ffs(same) - 1) cnt[warp][b] += __popc(same);
        __syncwarp();
    }
}

// ---- the grouped GEMMs ---------------------------------------------------------------------------------------
// The work item of blockIdx.y: bucket, rows [r0, r1) of the sorted order; false when the item does not exist.
__device__ __forceinline__ bool moep_item(const int* tile_bucket, const int* tile_row, const int* offsets,
                                          const int* info, int& b, int& r0, int& r1) {
    if ((int)blockIdx.y >= info[0]) return false;
    b = tile_bucket[blockIdx.y];
    r0 = tile_row[blockIdx.y];
    r1 = min(r0 + MOEP_BM, offsets[b + 1]);
    return true;
}

// Stage the tile's A rows (k columns [k, k + 32) of MOEP_BM rows; row i < nrows from src_i = a_row[i]) as bf16.
// Thread -> (row tid % BM, 32 / (THREADS / BM) columns).
constexpr int MOEP_A_SPLIT = MOEP_THREADS / MOEP_BM;              // threads per A row
constexpr int MOEP_A_COLS = MOEP_BK / MOEP_A_SPLIT;
static_assert(MOEP_A_COLS % 8 == 0, "A staging in 8-column pieces");
__device__ __forceinline__ void moep_stage_a(uint16_t* as, const float* arow, bool valid, int k) {
    const int r = threadIdx.x % MOEP_BM, c0 = (threadIdx.x / MOEP_BM) * MOEP_A_COLS;
#pragma unroll
    for (int c = 0; c < MOEP_A_COLS; c += 8) {
        float v[8];
        if (valid) {
            const float4 a = *reinterpret_cast<const float4*>(arow + k + c0 + c);
            const float4 b = *reinterpret_cast<const float4*>(arow + k + c0 + c + 4);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = 0.0f;
        }
        tile_store8(as + r * MOEP_LDS + c0 + c, v);
    }
}

// Decode column group kg of weight row `row` (of `rows`) of matrix W [n_experts][rows][cols] for expert e into
// the shared tile row as bf16 (zeros past the last row).
template <int F>
__device__ __forceinline__ void moep_stage_w(uint16_t* dst, const uint8_t* W, int e, int row, int rows, int cols,
                                             int kg, const uint64_t* grid) {
    float w[32];
    if (row < rows) {
        const uint8_t* base = W + ((size_t)e * rows + row) * (size_t)moe_row_bytes<F>(cols);
        MoeFmt<F>::dq(base, kg, w, grid);
    } else {
#pragma unroll
        for (int i = 0; i < 32; i++) w[i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 32; i += 8) tile_store8(dst + i, w + i);
}

__device__ __forceinline__ float moep_silu(float g) { return g * (1.0f / (1.0f + expf(-g))); }

template <int F>
__device__ __forceinline__ void moep_gate_up(const uint64_t* grid, const uint8_t* Wg, const uint8_t* Wu,
        const float* x, int ldx, const float* route_w, const int* sorted, const int* tile_bucket,
        const int* tile_row, const int* offsets, const int* info, float* H, int n_experts, int ff, int dim, int k,
        float clamp) {
    __shared__ __align__(16) uint16_t as[MOEP_BM * MOEP_LDS];
    __shared__ __align__(16) uint16_t ws[2 * MOEP_BN * MOEP_LDS];
    int b, r0, r1;
    if (!moep_item(tile_bucket, tile_row, offsets, info, b, r0, r1)) return;
    const int n0 = blockIdx.x * MOEP_BN, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp / MOEP_WARPS_N, wn = warp % MOEP_WARPS_N, g = lane >> 2, t = lane & 3;
    const bool bad = b == n_experts;
    if (!bad) {
        const int ar = r0 + tid % MOEP_BM;
        const bool avalid = ar < r1;
        const float* arow = x + (size_t)(avalid ? sorted[ar] / k : 0) * ldx;
        float accg[MOEP_MT][MOEP_NT][4], accu[MOEP_MT][MOEP_NT][4];
        tile_zero(accg);
        tile_zero(accu);
        for (int kt = 0; kt < dim / MOEP_BK; kt++) {
            __syncthreads();
            moep_stage_a(as, arow, avalid, kt * MOEP_BK);
            for (int j = tid; j < 2 * MOEP_BN; j += MOEP_THREADS)
                moep_stage_w<F>(ws + j * MOEP_LDS, j < MOEP_BN ? Wg : Wu, b, n0 + j % MOEP_BN, ff, dim, kt, grid);
            __syncthreads();
            const uint16_t* a = as + wm * 32 * MOEP_LDS;
            tile_mma<MOEP_MT, MOEP_NT, MOEP_BK, MOEP_LDS>(accg, a, ws + wn * 32 * MOEP_LDS);
            tile_mma<MOEP_MT, MOEP_NT, MOEP_BK, MOEP_LDS>(accu, a, ws + (MOEP_BN + wn * 32) * MOEP_LDS);
        }
#pragma unroll
        for (int mt = 0; mt < MOEP_MT; mt++)
#pragma unroll
            for (int nt = 0; nt < MOEP_NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int r = r0 + wm * 32 + mt * 16 + g + 8 * (i >> 1);
                    const int n = n0 + wn * 32 + nt * 8 + 2 * t + (i & 1);
                    if (r < r1 && n < ff) {
                        float gv = accg[mt][nt][i], uv = accu[mt][nt][i];
                        if (clamp > 0.0f) {
                            gv = fminf(gv, clamp);
                            uv = fminf(fmaxf(uv, -clamp), clamp);
                        }
                        const float rw = route_w ? route_w[sorted[r]] : 1.0f;
                        H[(size_t)r * ff + n] = moep_silu(gv) * uv * rw;
                    }
                }
    } else {
        for (int i = tid; i < MOEP_BM * MOEP_BN; i += MOEP_THREADS) {
            const int r = r0 + i / MOEP_BN, n = n0 + i % MOEP_BN;
            if (r < r1 && n < ff) H[(size_t)r * ff + n] = __int_as_float(0x7fc00000);
        }
    }
}

template <int F>
__device__ __forceinline__ void moep_down(const uint64_t* grid, const uint8_t* W, const float* H,
        const int* tile_bucket, const int* tile_row, const int* offsets, const int* info, float* Yp, int n_experts,
        int dim, int ff) {
    __shared__ __align__(16) uint16_t as[MOEP_BM * MOEP_LDS];
    __shared__ __align__(16) uint16_t ws[MOEP_BN * MOEP_LDS];
    int b, r0, r1;
    if (!moep_item(tile_bucket, tile_row, offsets, info, b, r0, r1)) return;
    const int n0 = blockIdx.x * MOEP_BN, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp / MOEP_WARPS_N, wn = warp % MOEP_WARPS_N, g = lane >> 2, t = lane & 3;
    const bool bad = b == n_experts;
    float acc[MOEP_MT][MOEP_NT][4];
    tile_zero(acc);
    if (!bad) {
        const int ar = r0 + tid % MOEP_BM;
        const bool avalid = ar < r1;
        const float* arow = H + (size_t)(avalid ? ar : 0) * ff;
        for (int kt = 0; kt < ff / MOEP_BK; kt++) {
            __syncthreads();
            moep_stage_a(as, arow, avalid, kt * MOEP_BK);
            for (int j = tid; j < MOEP_BN; j += MOEP_THREADS)
                moep_stage_w<F>(ws + j * MOEP_LDS, W, b, n0 + j, dim, ff, kt, grid);
            __syncthreads();
            tile_mma<MOEP_MT, MOEP_NT, MOEP_BK, MOEP_LDS>(acc, as + wm * 32 * MOEP_LDS, ws + wn * 32 * MOEP_LDS);
        }
    }
#pragma unroll
    for (int mt = 0; mt < MOEP_MT; mt++)
#pragma unroll
        for (int nt = 0; nt < MOEP_NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = r0 + wm * 32 + mt * 16 + g + 8 * (i >> 1);
                const int n = n0 + wn * 32 + nt * 8 + 2 * t + (i & 1);
                if (r < r1 && n < dim) Yp[(size_t)r * dim + n] = bad ? __int_as_float(0x7fc00000) : acc[mt][nt][i];
            }
}

// y[t, n] = sum_{s < k} Yp[pos[t*k + s], n] (+ add[t, n]), s ascending. Launch: grid (ceil(dim / 256), T),
// block 256.
extern "C" __global__ void moe_prefill_combine(const float* Yp, const int* pos, const float* add, float* y, int k,
                                               int dim, int ldy) {
    pdl_wait();
    pdl_launch_dependents();
    const int t = blockIdx.y, n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= dim) return;
    float s = Yp[(size_t)pos[(size_t)t * k] * dim + n];
    for (int j = 1; j < k; j++) s += Yp[(size_t)pos[(size_t)t * k + j] * dim + n];
    if (add) s += add[(size_t)t * dim + n];
    y[(size_t)t * ldy + n] = s;
}

// ---- entry points, one pair per format -------------------------------------------------------------------------
// Common contracts. Wg / Wu [n_experts, ff, dim], W [n_experts, dim, ff]: the stacked expert tensors' raw GGUF
// bytes; dim and ff multiples of 256 for IQ2_XXS / Q2_K / Q4_K, of 32 otherwise (and of 32 always). x [T, ldx]
// float32 (16-byte aligned, ldx % 4 == 0), route_w [T*k] (null: 1), H [P, ff] and Yp [P, dim] float32 in sorted
// order; sorted / tile_* / offsets / info from moe_prefill_route. clamp <= 0: no clamp.

// Gate + up + SwiGLU per work item (iq2_xxs). Launch: grid (ceil(ff / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_gate_up_iq2_xxs(const uint8_t* Wg,
        const uint8_t* Wu, const float* x, const float* route_w, const int* sorted, const int* tile_bucket,
        const int* tile_row, const int* offsets, const int* info, float* H, int n_experts, int ff, int dim, int k,
        int ldx, float clamp) {
    __shared__ uint64_t grid_s[256];
    pdl_wait();
    pdl_launch_dependents();
    moe_load_grid(grid_s);
    __syncthreads();
    moep_gate_up<FMT_IQ2_XXS>(grid_s, Wg, Wu, x, ldx, route_w, sorted, tile_bucket, tile_row, offsets, info, H, n_experts,
                         ff, dim, k, clamp);
}

// Down per work item (iq2_xxs). Launch: grid (ceil(dim / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_down_iq2_xxs(const uint8_t* W, const float* H,
        const int* tile_bucket, const int* tile_row, const int* offsets, const int* info, float* Yp, int n_experts,
        int dim, int ff) {
    __shared__ uint64_t grid_s[256];
    pdl_wait();
    pdl_launch_dependents();
    moe_load_grid(grid_s);
    __syncthreads();
    moep_down<FMT_IQ2_XXS>(grid_s, W, H, tile_bucket, tile_row, offsets, info, Yp, n_experts, dim, ff);
}

// Gate + up + SwiGLU per work item (q2_k). Launch: grid (ceil(ff / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_gate_up_q2_k(const uint8_t* Wg,
        const uint8_t* Wu, const float* x, const float* route_w, const int* sorted, const int* tile_bucket,
        const int* tile_row, const int* offsets, const int* info, float* H, int n_experts, int ff, int dim, int k,
        int ldx, float clamp) {
    pdl_wait();
    pdl_launch_dependents();
    moep_gate_up<FMT_Q2_K>(nullptr, Wg, Wu, x, ldx, route_w, sorted, tile_bucket, tile_row, offsets, info, H, n_experts,
                         ff, dim, k, clamp);
}

// Down per work item (q2_k). Launch: grid (ceil(dim / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_down_q2_k(const uint8_t* W, const float* H,
        const int* tile_bucket, const int* tile_row, const int* offsets, const int* info, float* Yp, int n_experts,
        int dim, int ff) {
    pdl_wait();
    pdl_launch_dependents();
    moep_down<FMT_Q2_K>(nullptr, W, H, tile_bucket, tile_row, offsets, info, Yp, n_experts, dim, ff);
}

// Gate + up + SwiGLU per work item (q4_k). Launch: grid (ceil(ff / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_gate_up_q4_k(const uint8_t* Wg,
        const uint8_t* Wu, const float* x, const float* route_w, const int* sorted, const int* tile_bucket,
        const int* tile_row, const int* offsets, const int* info, float* H, int n_experts, int ff, int dim, int k,
        int ldx, float clamp) {
    pdl_wait();
    pdl_launch_dependents();
    moep_gate_up<FMT_Q4_K>(nullptr, Wg, Wu, x, ldx, route_w, sorted, tile_bucket, tile_row, offsets, info, H, n_experts,
                         ff, dim, k, clamp);
}

// Down per work item (q4_k). Launch: grid (ceil(dim / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_down_q4_k(const uint8_t* W, const float* H,
        const int* tile_bucket, const int* tile_row, const int* offsets, const int* info, float* Yp, int n_experts,
        int dim, int ff) {
    pdl_wait();
    pdl_launch_dependents();
    moep_down<FMT_Q4_K>(nullptr, W, H, tile_bucket, tile_row, offsets, info, Yp, n_experts, dim, ff);
}

// Gate + up + SwiGLU per work item (mxfp4). Launch: grid (ceil(ff / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_gate_up_mxfp4(const uint8_t* Wg,
        const uint8_t* Wu, const float* x, const float* route_w, const int* sorted, const int* tile_bucket,
        const int* tile_row, const int* offsets, const int* info, float* H, int n_experts, int ff, int dim, int k,
        int ldx, float clamp) {
    pdl_wait();
    pdl_launch_dependents();
    moep_gate_up<FMT_MXFP4>(nullptr, Wg, Wu, x, ldx, route_w, sorted, tile_bucket, tile_row, offsets, info, H, n_experts,
                         ff, dim, k, clamp);
}

// Down per work item (mxfp4). Launch: grid (ceil(dim / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_down_mxfp4(const uint8_t* W, const float* H,
        const int* tile_bucket, const int* tile_row, const int* offsets, const int* info, float* Yp, int n_experts,
        int dim, int ff) {
    pdl_wait();
    pdl_launch_dependents();
    moep_down<FMT_MXFP4>(nullptr, W, H, tile_bucket, tile_row, offsets, info, Yp, n_experts, dim, ff);
}

// Gate + up + SwiGLU per work item (q8_0). Launch: grid (ceil(ff / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_gate_up_q8_0(const uint8_t* Wg,
        const uint8_t* Wu, const float* x, const float* route_w, const int* sorted, const int* tile_bucket,
        const int* tile_row, const int* offsets, const int* info, float* H, int n_experts, int ff, int dim, int k,
        int ldx, float clamp) {
    pdl_wait();
    pdl_launch_dependents();
    moep_gate_up<FMT_Q8_0>(nullptr, Wg, Wu, x, ldx, route_w, sorted, tile_bucket, tile_row, offsets, info, H, n_experts,
                         ff, dim, k, clamp);
}

// Down per work item (q8_0). Launch: grid (ceil(dim / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_down_q8_0(const uint8_t* W, const float* H,
        const int* tile_bucket, const int* tile_row, const int* offsets, const int* info, float* Yp, int n_experts,
        int dim, int ff) {
    pdl_wait();
    pdl_launch_dependents();
    moep_down<FMT_Q8_0>(nullptr, W, H, tile_bucket, tile_row, offsets, info, Yp, n_experts, dim, ff);
}

// Gate + up + SwiGLU per work item (f16). Launch: grid (ceil(ff / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_gate_up_f16(const uint8_t* Wg,
        const uint8_t* Wu, const float* x, const float* route_w, const int* sorted, const int* tile_bucket,
        const int* tile_row, const int* offsets, const int* info, float* H, int n_experts, int ff, int dim, int k,
        int ldx, float clamp) {
    pdl_wait();
    pdl_launch_dependents();
    moep_gate_up<FMT_F16>(nullptr, Wg, Wu, x, ldx, route_w, sorted, tile_bucket, tile_row, offsets, info, H, n_experts,
                         ff, dim, k, clamp);
}

// Down per work item (f16). Launch: grid (ceil(dim / MOEP_BN), max_tiles), block MOEP_THREADS.
extern "C" __global__ __launch_bounds__(MOEP_THREADS) void moe_prefill_down_f16(const uint8_t* W, const float* H,
        const int* tile_bucket, const int* tile_row, const int* offsets, const int* info, float* Yp, int n_experts,
        int dim, int ff) {
    pdl_wait();
    pdl_launch_dependents();
    moep_down<FMT_F16>(nullptr, W, H, tile_bucket, tile_row, offsets, info, Yp, n_experts, dim, ff);
}
