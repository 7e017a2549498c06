// Routed experts of V4 Flash for a block of T tokens (prefill), grouped by expert on tensor cores:
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
// Numerics: x and H (before the down) are rounded to bf16; the weights stay exact: each format's integer codes
// (moe_formats.cuh cq: bf16 integers) go through the tensor cores from zero per scale group and the group's
// scale and min are applied in fp32 (acc += s * P - m * sum(x of the group)), F16 as two bf16 pieces. Products
// accumulate in fp32 over k tiles of 32 in increasing order; SwiGLU in fp32 as experts.cu. A pair's result
// depends only on its own x row and expert (not on which rows share its tile).
// VQ-8 (MOE_VQ_FORMATS): the weight fl32(g * c) is staged as its E4M3 codeword c (exact in bf16) and the row gain
// g is the group's scale (acc += g * P), and x and H go in as three bf16 pieces (hi + mid + lo = the fp32 value:
// three mma per step into the same P), so the products see the exact fp32 operands and the result differs from
// the fp32 reference by the summation order only (fp32 noise), as the decode and rows kernels of experts.cu. The
// layer's codebook (32 / 64 KiB, at the head of each matrix's device copy) is copied into the dynamic shared
// memory of every block.
// Weight loads: each block streams its tile's weight rows through a double-buffered ring of whole 32-byte sectors
// in shared memory (MoepRing below; each weight byte read once per block, whole sectors per warp request) and
// decodes them from there (VQ-8 at 13 bits: no room for it, a window of whole sectors per tile row, MoepWin).
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
#ifndef MOEP_ROUTE_WARPS
#error "MOEP_ROUTE_WARPS comes from ds4py/cuda/ops/moe_prefill.py (DEFINES)"
#endif
#ifndef MOEP_WIN_S
#error "MOEP_WIN_S comes from ds4py/cuda/ops/moe_prefill.py (DEFINES)"
#endif
#ifndef MOEP_WIN_H
#error "MOEP_WIN_H comes from ds4py/cuda/ops/moe_prefill.py (DEFINES)"
#endif

#define MOEP_BM (32 * MOEP_WARPS_M)
#define MOEP_BN (32 * MOEP_WARPS_N)
#define MOEP_BK 32
// __launch_bounds__(MOEP_THREADS, MOEP_MIN_BLOCKS) on the grouped GEMMs: without the minimum, ptxas for sm_90 held
// several of them at 80 / 96 / 128 registers with spills once the sector ring came in; with it, none spills on
// either arch (their occupancy is set by the ring's shared memory and the codebook anyway).
#define MOEP_MIN_BLOCKS 2
#define MOEP_LDS (MOEP_BK + 8)
#define MOEP_THREADS (32 * MOEP_WARPS_M * MOEP_WARPS_N)
#define MOEP_ROUTE_THREADS (32 * MOEP_ROUTE_WARPS)
// A warp's piece of the BM x BN tile: MOEP_MT m tiles of 16 rows by MOEP_NT n tiles of 8 features, the warps stacked
// along the rows (BM / 16 warps of 16 rows x all BN features): each B fragment feeds every piece of its warp's rows,
// and a warp whose 16 rows are all the work item's padding (past its last row) skips its MMAs whole (one warp-
// uniform branch: no m tile loop to break the MMA schedule).
#define MOEP_MT 1
#define MOEP_NT 8
#define MOEP_WTM (16 * MOEP_MT)
#define MOEP_WTN (8 * MOEP_NT)
#define MOEP_WGN (MOEP_BN / MOEP_WTN)
static_assert((MOEP_BM / MOEP_WTM) * MOEP_WGN * 32 == MOEP_THREADS, "the warps cover the tile once");
static_assert(MOEP_THREADS % MOEP_BM == 0, "every tile row has the same number of staging threads");

// ---- route: count, scan, scatter -----------------------------------------------------------------------------
// Bucket of pair p: its expert, or n_experts for an id outside [0, n_experts).
__device__ __forceinline__ int moep_bucket(int id, int n_experts) { return id >= 0 && id < n_experts ? id : n_experts; }

// Warp w owns pairs [w*chunk, (w+1)*chunk); cnt[w][b] counts its pairs of bucket b, then becomes where its next
// one goes. The lanes of one 32-pair step with the same bucket find each other with __match_any_sync.
// Outputs: offsets [n_experts + 2] (bucket b's sorted rows are [offsets[b], offsets[b+1])), sorted [P] (pair of
// each sorted row), pos [P] (sorted row of each pair), the work items tile_bucket / tile_row [max_tiles] (bucket,
// first sorted row), info[0] = number of work items. n_experts <= MOEP_MAX_EXPERTS. Launch: grid 1, block
// 32 * MOEP_ROUTE_WARPS (the counters, ROUTE_WARPS x (MAX_EXPERTS + 1) ints, stay in static shared memory).
extern "C" __global__ __launch_bounds__(MOEP_ROUTE_THREADS) void moe_prefill_route(const int* ids, int* offsets, int* sorted,
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
// Work item `by` (blockIdx.y, or a persistent block's current item): bucket, rows [r0, r1) of the sorted order;
// false when the item does not exist.
__device__ __forceinline__ bool moep_item(const int* tile_bucket, const int* tile_row, const int* offsets,
                                          const int* info, int& b, int& r0, int& r1, int by = -1) {
    if (by < 0) by = blockIdx.y;
    if (by >= info[0]) return false;
    b = tile_bucket[by];
    r0 = tile_row[by];
    r1 = min(r0 + MOEP_BM, offsets[b + 1]);
    return true;
}

// A format's decomposition for the tensor cores (T: moe_formats.cuh's MoeFmt<F>, or MoeVq<bits> for VQ-8) and the
// bf16 pieces its activations go in as (XP: 1, x and H rounded to bf16; 3, exact).
template <int F, bool IS_VQ = (F >= FMT_VQ_BASE)> struct MoepF {
    using T = MoeFmt<F>;
    static constexpr int XP = 1;
    static constexpr bool VQ = false;
};
template <int F> struct MoepF<F, true> {                           // VQ-8 at F - FMT_VQ_BASE bits
    using T = MoeVq<F - FMT_VQ_BASE>;
    static constexpr int XP = 3;
    static constexpr bool VQ = true;
};
#define MOEP_APIECE (MOEP_BM * MOEP_LDS)

// The shared tiles' layout: rows MOEP_LDS 16-bit values apart (mma_tile.cuh: BK + 8). VQ-8 at 13 bits packs them
// (three A pieces beside the B tiles, and the 64 KiB codebook): rows of BK = 32 values (64 bytes), their four 16-byte
// chunks XOR-swizzled by (row >> 1) & 3, so the fragment loads of 8 rows x 4 lanes and the 16-byte stores of 8 rows
// still hit 32 distinct banks; 5,120 bytes less in gate + up, room for its windows (MoepWin). (Only there: the
// swizzle's address arithmetic costs the down ~40 SASS instructions a k tile.)
// at(row, col): the value's offset (col even; the 8 values of an aligned chunk stay together).
template <int F> struct MoepL {
    static constexpr bool SW = MoepF<F>::VQ && F - FMT_VQ_BASE == 13;
    static constexpr int LDS = SW ? MOEP_BK : MOEP_LDS, APIECE = MOEP_BM * LDS, PIECE = MOEP_BN * LDS;
    __device__ static __forceinline__ int at(int row, int col) {
        return row * LDS + (SW ? ((((col >> 3) ^ (row >> 1)) & 3) << 3 | (col & 7)) : col);
    }
};

// Stage the tile's A rows (k columns [k, k + 32) of MOEP_BM rows from arow, zeros for a missing row) as XP bf16
// pieces (MoepL<F>'s layout, piece p at as + p * L::APIECE; XP = 1: the values rounded to bf16), and
// sx[h * BM + r] = the fp32 sum of row r's 16 staged values of half h (the K-quants' mins multiply it).
// Thread -> (row tid % BM, half tid / BM).
static_assert(MOEP_THREADS == 2 * MOEP_BM, "two threads, one per 16 columns, stage each A row");
template <int F>
__device__ __forceinline__ void moep_stage_a(uint16_t* as, float* sx, const float* arow, bool valid, int k) {
    using L = MoepL<F>;
    constexpr int XP = MoepF<F>::XP;
    const int r = threadIdx.x % MOEP_BM, h = threadIdx.x / MOEP_BM;
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < 16; c += 8) {
        float v[8];
        if (valid) {
            const float4 a = *reinterpret_cast<const float4*>(arow + k + 16 * h + c);
            const float4 b = *reinterpret_cast<const float4*>(arow + k + 16 * h + c + 4);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = 0.0f;
        }
        if constexpr (XP == 1) {
            tile_split8<1>(v, as + L::at(r, 16 * h + c), L::APIECE, &sum);   // the sum of the rounded values
        } else {
            tile_split8<XP>(v, as + L::at(r, 16 * h + c), L::APIECE);
        }
    }
    if constexpr (XP == 1) sx[h * MOEP_BM + r] = sum;                // (VQ-8's scaled codes need no sums of x)
}

// Weight pieces per matrix in shared memory: the codes (one piece), or for F16 the values as two bf16 pieces.
template <int F> struct MoepW {
    static constexpr int NP = MoepF<F>::T::CODES == MOE_CODES_NONE ? 2 : 1;
};
#define MOEP_PIECE (MOEP_BN * MOEP_LDS)

// VQ-8: a column group of tile row r (its 4 codeword indices idx) into the B tile ws (MoepL's layout) as its 32
// codeword values (exact in bf16; the row gain, the group's scale, is read from the gains in shared memory by
// moep_tile), cb: the shared-memory codebook; valid false: zeros.
template <int F>
__device__ __forceinline__ void moep_stage_vq(uint16_t* ws, int r, const unsigned (&idx)[4], bool valid,
                                              const uint64_t* cb) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint64_t c = valid ? cb[idx[i]] : 0ull;
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            const float2 f = __half22float2(fp8x2_e4m3_to_half2((unsigned short)(c >> (8 * j))));
            v[j] = f.x;
            v[j + 1] = f.y;
        }
        tile_store8(ws + MoepL<F>::at(r, 8 * i), v);
    }
}

// Column group kg of a GGML weight row into the shared tile: its codes (exact bf16) and per half its scale
// sc[h * BN] and min mn[h * BN] (dst / sc / mn point at the row), or for F16 its exact values as two bf16 pieces.
// base: the row's bytes from column group 0 (the ring's copy of the row's chunk, kg counted from the chunk); valid
// false (past the last row): zeros. grid: the IQ2_XXS grid.
template <int F>
__device__ __forceinline__ void moep_stage_w(uint16_t* dst, float* sc, float* mn, const uint8_t* base, bool valid,
                                             int kg, const uint64_t* grid) {
    float s[2] = {0.0f, 0.0f}, o[2] = {0.0f, 0.0f};
    if constexpr (F == FMT_IQ2_XXS) {            // 8 codes at a time (fewer live registers beside the accumulators)
        unsigned a0 = 0u, a1 = 0u;
        float db = 0.0f;
        if (valid) MoeFmt<F>::aux(base, kg, a0, a1, db);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const uint64_t gq = grid[(a0 >> (8 * q)) & 255u];
            const unsigned sg = MoeFmt<F>::signs(a1, q);
            float c[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float v = valid ? moe_u2f((unsigned)(gq >> (8 * j)) & 255u) : 0.0f;
                c[j] = (sg >> j) & 1u ? -v : v;
            }
            tile_store8(dst + 8 * q, c);
        }
        sc[0] = sc[MOEP_BN] = db;
        mn[0] = mn[MOEP_BN] = 0.0f;
        return;
    }
    float w[32];
    if (valid) {
        if constexpr (MoeFmt<F>::CODES == MOE_CODES_NONE) MoeFmt<F>::dq(base, kg, w, grid);
        else MoeFmt<F>::cq(base, kg, w, s, o, grid);
    } else {
#pragma unroll
        for (int i = 0; i < 32; i++) w[i] = 0.0f;
    }
    if constexpr (MoeFmt<F>::CODES == MOE_CODES_NONE) {
#pragma unroll
        for (int i = 0; i < 32; i += 8) tile_split8<2>(w + i, dst + i, MOEP_PIECE);
    } else {
#pragma unroll
        for (int i = 0; i < 32; i += 8) tile_store8(dst + i, w + i);
        sc[0] = s[0];
        sc[MOEP_BN] = s[1];
        mn[0] = o[0];
        mn[MOEP_BN] = o[1];
    }
}

// acc += sum over the XP pieces of A (hi first, L::APIECE apart) of A_p B^T over BK columns, k16 step by k16 step:
// the fragments by ldmatrix (ldsm_x4: one A quadrant set per m tile and piece, two n tiles of B per load, each B
// fragment loaded once for all the pieces and m tiles), the MMAs in tile_mma's order (per k16 step: piece, m tile,
// n tile), so every accumulator sees the same sequence of MMAs as with 32-bit fragment loads.
// Lane i's ldmatrix row: matrix j = i / 8, row i % 8; A: the quadrant (rows 8 (j & 1), columns 8 (j >> 1)),
// B: n tile 2 q + (j >> 1), k half j & 1 (the fragment layout of portable.cuh). Its address through MoepL<F>::at:
// As / Bs are the warp's first rows (a multiple of 8 rows into the tile) and the lane's rows differ from row i % 8 by
// multiples of 8, which MoepL's swizzle ((row >> 1) & 3) does not see; a column multiple of 8 keeps the 16-byte
// chunk whole (ldmatrix's row). BK = 16 with As / Bs moved 16 columns (the affine K-quants' halves) only unswizzled.
template <int F, int BK>
__device__ __forceinline__ void moep_mma(float (&acc)[MOEP_MT][MOEP_NT][4], const uint16_t* As, const uint16_t* Bs) {
    using L = MoepL<F>;
    constexpr int XP = MoepF<F>::XP;
    static_assert(MOEP_NT % 2 == 0, "B fragments come two n tiles per ldmatrix");
    static_assert(BK == MOEP_BK || !L::SW, "a swizzled tile is multiplied whole");
    const int lane = threadIdx.x & 31, j = lane >> 3, r = lane & 7;
    const int ar = r + 8 * (j & 1), ac = 8 * (j >> 1), br = r + 8 * (j >> 1), bc = 8 * (j & 1);
#pragma unroll
    for (int ks = 0; ks < BK; ks += 16) {
        const uint16_t* arow = As + L::at(ar, ks + ac);
        const uint16_t* brow = Bs + L::at(br, ks + bc);
        unsigned b[MOEP_NT][2];
#pragma unroll
        for (int nt = 0; nt < MOEP_NT; nt += 2) {
            unsigned q[4];
            ldsm_x4(q, brow + nt * 8 * L::LDS);
            b[nt][0] = q[0];
            b[nt][1] = q[1];
            b[nt + 1][0] = q[2];
            b[nt + 1][1] = q[3];
        }
#pragma unroll
        for (int p = 0; p < XP; p++)
#pragma unroll
            for (int mt = 0; mt < MOEP_MT; mt++) {
                unsigned a[4];
                ldsm_x4(a, arow + p * L::APIECE + mt * 16 * L::LDS);
#pragma unroll
                for (int nt = 0; nt < MOEP_NT; nt++) mma_m16n8k16_bf16_f32(acc[mt][nt], a, b[nt]);
            }
    }
}

// acc += this k tile's A (the warp's rows, XP pieces) x the staged weights (the warp's columns) of one matrix, in
// the format's decomposition: codes P = A c (tensor cores, from zero; the A pieces hi first), then acc += s P - o sx
// per scale group.
template <int F>
__device__ __forceinline__ void moep_tile(float (&acc)[MOEP_MT][MOEP_NT][4], const uint16_t* a, const uint16_t* b,
                                          const float* sc, const float* mn, const float* sx, int wm, int wn) {
    constexpr int KIND = MoepF<F>::T::CODES;
    if constexpr (KIND == MOE_CODES_NONE) {
        moep_mma<F, MOEP_BK>(acc, a, b);
        moep_mma<F, MOEP_BK>(acc, a, b + MOEP_PIECE);
    } else {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        constexpr int HALVES = KIND == MOE_CODES_AFFINE16 ? 2 : 1;
#pragma unroll
        for (int h = 0; h < HALVES; h++) {
            float P[MOEP_MT][MOEP_NT][4];
            tile_zero(P);
            if constexpr (HALVES == 2) moep_mma<F, 16>(P, a + 16 * h, b + 16 * h);
            else moep_mma<F, MOEP_BK>(P, a, b);
#pragma unroll
            for (int nt = 0; nt < MOEP_NT; nt++) {
                const int n = wn * MOEP_WTN + nt * 8 + 2 * t;
                const float s0 = sc[h * MOEP_BN + n], s1 = sc[h * MOEP_BN + n + 1];
                const float o0 = mn[h * MOEP_BN + n], o1 = mn[h * MOEP_BN + n + 1];
#pragma unroll
                for (int mt = 0; mt < MOEP_MT; mt++) {
                    const int m = wm * MOEP_WTM + mt * 16 + g;
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const float s_ = (i & 1) ? s1 : s0;
                        float v = fmaf(s_, P[mt][nt][i], acc[mt][nt][i]);
                        if constexpr (KIND != MOE_CODES_SCALED) {
                            const int r = m + 8 * (i >> 1);
                            const float xs = HALVES == 2 ? sx[h * MOEP_BM + r] : sx[r] + sx[MOEP_BM + r];
                            v = fmaf(-((i & 1) ? o1 : o0), xs, v);
                        }
                        acc[mt][nt][i] = v;
                    }
                }
            }
        }
    }
}

// The k-tile loop's two forms (moep_gate_up / moep_down): with the warp's MMAs, or without them for a warp whose
// 16 rows are all its work item's padding (past the item's last row: nothing of them is stored). Both stage their
// share of the tiles and meet every barrier; the choice is one warp-uniform branch before the loop, so the MMA
// loop itself has no branch around its MMAs.
template <bool ON> struct MoepMmaOn {
    static constexpr bool on = ON;
};

__device__ __forceinline__ float moep_silu(float g) { return g * (1.0f / (1.0f + expf(-g))); }

// ---- the weight rows' sector ring (issue 34: whole sectors, each weight byte read once per block) ----------------
// A tile's weight rows are streamed through shared memory in chunks of KT k tiles (whole blocks of the format: one
// K-quant block, 2-4 Q8_0 / MXFP4 blocks, 8-16 VQ runs; >= 48 bytes of a row). Chunk c of a row is the byte range
// [c CB, min((c + 1) CB, row bytes)); its 32-byte sectors, counted from the real address, go into ring buffer c % 2
// (PITCH bytes per row: the most sectors a chunk can span, its start at a multiple of G = the row and chunk
// starts' alignment when the matrix is 16-byte aligned): the sectors the previous chunk did not copy come from
// global memory by cp.async, both 16-byte halves of a sector from adjacent threads (one request reads whole
// sectors), the one sector the chunks share from the previous buffer. Chunk c + 1 is copied while the tensor
// cores multiply chunk c (after the barrier that ends chunk c - 1's reads), and the decoders read chunk c's bytes
// from shared memory at the same offsets (mod 16) as in global memory: the staged tiles are the same bits.
// VQ-8 at 13 bits has no room for it beside its 64 KiB codebook at GB10's 101,376 bytes: MoepWin below.
template <int F> struct MoepRing {
    using T = typename MoepF<F>::T;
    static constexpr bool ON = !(MoepF<F>::VQ && F - FMT_VQ_BASE == 13);
    static constexpr int QK = T::QK, BYTES = T::BYTES;
    DS4_HD static constexpr int chunk_tiles() {
        int kt = QK / 32;
        while (kt * 32 / QK * BYTES < 48) kt *= 2;
        return kt;
    }
    static constexpr int KT = chunk_tiles(), CB = KT * 32 / QK * BYTES;
    static constexpr int G = (BYTES & -BYTES) < 16 ? (BYTES & -BYTES) : 16;
    static constexpr int SECT = (32 - G + CB + 31) / 32, PITCH = 32 * SECT;
};

// The tile's rows of MATS (1, 2) matrices: row r of matrix m starts at row(m) + r * rb, rows < nrows are real.
// Named pointers, not an array: a runtime index would put the struct in local memory. The ring's arithmetic is in
// 32-bit offsets from the tile's first sector (base(m) = row(m) rounded down to 32 bytes, phase(m) = the rest).
// VQ-8 at 13 bits (MoepWin) also: the hi rows, hi row r of matrix m at hrow(m) + r * hb, and the phases (mod 32, as
// bit masks) of the tile rows' first stream / hi bytes.
template <int MATS> struct MoepRows {
    const uint8_t* r0;
    const uint8_t* r1;
    const uint8_t* h0;
    const uint8_t* h1;
    int rb, nrows, hb;
    unsigned smask, hmask;
    __device__ __forceinline__ const uint8_t* row(int m) const { return MATS > 1 && m ? r1 : r0; }
    __device__ __forceinline__ int phase(int m) const { return (int)(reinterpret_cast<size_t>(row(m)) & 31); }
    __device__ __forceinline__ const uint8_t* base(int m) const { return row(m) - phase(m); }
    __device__ __forceinline__ const uint8_t* hrow(int m) const { return MATS > 1 && m ? h1 : h0; }
    __device__ __forceinline__ int hphase(int m) const { return (int)(reinterpret_cast<size_t>(hrow(m)) & 31); }
    __device__ __forceinline__ const uint8_t* hbase(int m) const { return hrow(m) - hphase(m); }
};

// Copy chunk c of every tile row into ring buffer c % 2 (cp.async; the caller commits). Nothing outside the tile's
// rows (from the 16-byte piece of its first byte) is copied: a piece across its end is copied byte by byte, one
// past it not at all (the decoders never read either). Block-uniform.
template <int F, int MATS>
__device__ __forceinline__ void moep_ring_fill(uint8_t* ring, const MoepRows<MATS>& w, int c) {
    using R = MoepRing<F>;
    constexpr int SLOTS = 2 * R::SECT, BUF = MATS * MOEP_BN * R::PITCH;
    uint8_t* buf = ring + (c & 1) * BUF;
    const uint8_t* prev = ring + ((c + 1) & 1) * BUF;
    const int lo = c * R::CB, hi = min(lo + R::CB, w.rb);
#pragma unroll 1                                                      // (unrolled: registers beside the accumulators)
    for (int i = threadIdx.x; i < MATS * MOEP_BN * SLOTS; i += MOEP_THREADS) {
        const int rr = i / SLOTS, j = i - rr * SLOTS, m = MATS > 1 && rr >= MOEP_BN ? 1 : 0, r = rr - m * MOEP_BN;
        if (r >= w.nrows) continue;
        const int t32 = w.phase(m), a0 = t32 + r * w.rb + lo;         // offsets from base(m)
        const int s_lo = a0 >> 5, s_hi = (t32 + r * w.rb + hi - 1) >> 5;
        const bool carry = c > 0 && ((a0 - 1) >> 5) == s_lo;          // the previous chunk copied this sector
        uint8_t* slot = buf + rr * R::PITCH;
        if (carry && j < 2)                                           // from the previous buffer's last sector
            *reinterpret_cast<uint4*>(slot + 16 * j) =
                *reinterpret_cast<const uint4*>(prev + rr * R::PITCH + (s_lo - ((a0 - R::CB) >> 5)) * 32 + 16 * j);
        const int sector = s_lo + (carry ? 1 : 0) + (j >> 1), pos = 32 * sector + 16 * (j & 1);
        const int end = t32 + w.nrows * w.rb;
        if (sector > s_hi || pos < (t32 & 16) || pos >= end) continue;
        uint8_t* dst = slot + 32 * (sector - s_lo) + 16 * (j & 1);
        const uint8_t* src = w.base(m) + pos;
        if (pos + 16 <= end) cp_async_16(dst, src);
        else
            for (int q = 0; pos + q < end; ++q) dst[q] = src[q];
    }
}

// Chunk c's copy of tile row r of matrix m in the ring, from the chunk's first byte (the row's group c * KT).
template <int F, int MATS>
__device__ __forceinline__ const uint8_t* moep_ring_row(const uint8_t* ring, const MoepRows<MATS>& w, int m, int r,
                                                        int c) {
    using R = MoepRing<F>;
    const int off = (w.phase(m) + r * w.rb + c * R::CB) & 31;
    return ring + (c & 1) * MATS * MOEP_BN * R::PITCH + (m * MOEP_BN + r) * R::PITCH + off;
}

// The tile rows [n0, n0 + BN) of expert e of matrix W [n_experts][rows][cols] (GGML raw rows, or a VQ-8 device
// copy past its codebook: the stream rows, and at 13 bits the hi rows after the n_experts streams).
template <int F, int MATS>
__device__ __forceinline__ void moep_rows_at(MoepRows<MATS>& w, int m, const uint8_t* W, int e, int n0, int rows,
                                             int cols, int n_experts) {
    if constexpr (MoepF<F>::VQ) {
        using V = typename MoepF<F>::T;
        const size_t es = V::expert_bytes(rows, cols);
        w.rb = V::stream_bytes(cols);
        w.hb = V::hi_bytes(cols);
        (m ? w.r1 : w.r0) = W + (size_t)e * es + (size_t)n0 * w.rb;
        (m ? w.h1 : w.h0) = W + (size_t)n_experts * es + ((size_t)e * rows + n0) * w.hb;
    } else {
        w.rb = moe_row_bytes<F>(cols);
        (m ? w.r1 : w.r0) = W + ((size_t)e * rows + n0) * w.rb;
    }
    w.nrows = min(MOEP_BN, rows - n0);
}

// VQ-8: the gain of tile row r of matrix W (0 past the last row), read from global memory: 4-byte aligned below
// 13 bits (the gains follow the 128-byte padded streams), byte by byte at 13 bits (they follow the hi rows).
template <int F>
__device__ __forceinline__ float moep_vq_gain(const uint8_t* W, int e, int row, int n_experts, int rows, int cols) {
    using V = typename MoepF<F>::T;
    if (row >= rows) return 0.0f;
    const size_t es = V::expert_bytes(rows, cols), r = (size_t)e * rows + row;
    const int hb = V::hi_bytes(cols);
    const uint8_t* gp = W + (size_t)n_experts * es + (size_t)n_experts * rows * hb + 4 * r;
    if (hb == 0) return *reinterpret_cast<const float*>(gp);
    return __uint_as_float(gp[0] | ((unsigned)gp[1] << 8) | ((unsigned)gp[2] << 16) | ((unsigned)gp[3] << 24));
}

// ---- VQ-8 at 13 bits: a window per tile row ----------------------------------------------------------------------
// The 64 KiB codebook leaves ~14.8 KB of GB10's 101,376 bytes per block (gate + up; the down more): not enough for
// MoepRing's two chunk buffers of 128 rows plus the hi rows. So each tile row has windows of its own in the dynamic
// shared memory after the codebook: MOEP_WIN_S 32-byte slots of its stream row, MOEP_WIN_H of its hi row (a byte
// per 64 columns); the row's sector s (counted from base(m) / hbase(m), whole sectors from the real address) lives
// in slot s % N, so byte q of the row's offsets is at (q mod 32 N) of its window. When k tile kt's group starts in
// a new sector, the slot of the one before it (read by k tile kt - 1 last: after the barrier) takes the sector
// N - 1 ahead, both 16-byte halves from adjacent threads (whole sectors per warp request); each weight byte is read
// once (a sector two rows share: once per row). A group is 6 stream bytes: from the first group starting in
// sector s to the first reaching s + 1 are >= 4 k tiles, so with two slots k tile kt's copies must be complete by
// kt + 4 (cp.async.wait_group MOEP_WIN_LEAD - 1 at the top of a k tile). The hi row crosses a sector every 64 k tiles:
// one slot, refilled at the k tile that first reads the new sector, and waited for at once (a block-uniform test
// from the rows' phases: at V4 shapes once per work item of the gate + up, never in the down).
#define MOEP_WIN_LEAD 4
static_assert(MOEP_WIN_S == 2 && MOEP_WIN_H == 1, "the lead and the hi refill assume two stream slots, one hi slot");

// One 16-byte half j of sector s (offsets from bp) into a window of wb bytes: only bytes of the tile's range
// [first, end) (from the 16-byte piece of its first byte; a piece across the end byte by byte, none past it).
__device__ __forceinline__ void moep_win_piece(uint8_t* win, int wb, const uint8_t* bp, int s, int j, int first,
                                               int end) {
    const int pos = 32 * s + 16 * j;
    if (pos < (first & ~15) || pos >= end) return;
    uint8_t* dst = win + (pos & (wb - 1));
    if (pos + 16 <= end) cp_async_16(dst, bp + pos);
    else
        for (int q = 0; pos + q < end; ++q) dst[q] = bp[pos + q];
}

// The phases (mod 32) of the first bytes of rows 0 .. nrows - 1 starting at p0 + r * rb, as a bit mask (they repeat
// within 32 rows).
__device__ __forceinline__ unsigned moep_phases(int p0, int rb, int nrows) {
    unsigned m = 0u;
    for (int r = 0; r < nrows && r < 32; ++r) m |= 1u << ((p0 + r * rb) & 31);
    return m;
}

// Whether some tile row's group kt starts in a new stream sector (kt >= 1): a phase p with (p + 6 kt) mod 32 < 6.
__device__ __forceinline__ bool moep_win_moves(unsigned smask, int kt) {
    return (__funnelshift_r(smask, smask, (unsigned)(-6 * kt) & 31u) & 63u) != 0u;
}
// Whether some tile row's hi nibble of k tile kt starts a new hi sector (kt >= 1): kt even, (p + kt / 2) mod 32 == 0.
__device__ __forceinline__ bool moep_win_hi_moves(unsigned hmask, int kt) {
    return (kt & 1) == 0 && ((hmask >> ((unsigned)(-(kt >> 1)) & 31u)) & 1u) != 0u;
}

// Copy the windows' sectors for k tile kt (block-uniform; the caller commits): kt == 0 every row's first
// MOEP_WIN_S stream sectors and first hi sector; kt > 0 the sector MOEP_WIN_S - 1 past the new one of each row whose
// group kt starts a new stream sector, and the new hi sector of each row whose nibble kt starts one.
template <int MATS>
__device__ __forceinline__ void moep_win_fill(uint8_t* win, const MoepRows<MATS>& w, int kt) {
    constexpr int ROWS = MATS * MOEP_BN, SB = 32 * MOEP_WIN_S, HB = 32 * MOEP_WIN_H;
    uint8_t* hwin = win + ROWS * SB;
    const bool s_all = kt == 0, s_new = s_all || moep_win_moves(w.smask, kt);
    const bool h_new = kt == 0 || moep_win_hi_moves(w.hmask, kt);
    if (s_new)
#pragma unroll 1
        for (int i = threadIdx.x; i < ROWS * 2 * (s_all ? MOEP_WIN_S : 1); i += MOEP_THREADS) {
            const int n = i / (2 * ROWS), rr = (i >> 1) % ROWS, m = MATS > 1 && rr >= MOEP_BN ? 1 : 0;
            const int r = rr - m * MOEP_BN, first = w.phase(m), a = first + r * w.rb, q = a + 6 * kt;
            if (r >= w.nrows || (!s_all && (q >> 5) == ((q - 6) >> 5))) continue;
            const int sec = (q >> 5) + (s_all ? n : MOEP_WIN_S - 1);
            if (32 * sec < a + w.rb)                                  // the row has bytes there
                moep_win_piece(win + rr * SB, SB, w.base(m), sec, i & 1, first, first + w.nrows * w.rb);
        }
    if (h_new)
#pragma unroll 1
        for (int i = threadIdx.x; i < ROWS * 2; i += MOEP_THREADS) {
            const int rr = i >> 1, m = MATS > 1 && rr >= MOEP_BN ? 1 : 0, r = rr - m * MOEP_BN;
            const int first = w.hphase(m), a = first + r * w.hb, q = a + (kt >> 1);
            if (r >= w.nrows || (kt > 0 && (q >> 5) == ((q - 1) >> 5))) continue;
            moep_win_piece(hwin + rr * HB, HB, w.hbase(m), q >> 5, i & 1, first, first + w.nrows * w.hb);
        }
}

// The 4 codeword indices of k tile kt of tile row (m, r) from its windows (MoeVq<13>::indices' bits: the group's 6
// stream bytes as three aligned 16-bit halves, each within one slot, and the hi nibble).
template <int MATS>
__device__ __forceinline__ void moep_win_indices(const uint8_t* win, const MoepRows<MATS>& w, int m, int r, int kt,
                                                 unsigned (&idx)[4]) {
    constexpr int ROWS = MATS * MOEP_BN, SB = 32 * MOEP_WIN_S, HB = 32 * MOEP_WIN_H;
    const int rr = m * MOEP_BN + r, q = w.phase(m) + r * w.rb + 6 * kt;  // even: rows and groups 2-byte aligned
    const uint8_t* sw = win + rr * SB;
    const unsigned lo = *reinterpret_cast<const uint16_t*>(sw + (q & (SB - 1))) |
                        (unsigned)*reinterpret_cast<const uint16_t*>(sw + ((q + 2) & (SB - 1))) << 16;
    const unsigned hi = *reinterpret_cast<const uint16_t*>(sw + ((q + 4) & (SB - 1)));
    const unsigned h0 = lo & 0xFFFFFFu, h1 = (lo >> 24) | (hi << 8);
    idx[0] = h0 & 4095u;
    idx[1] = h0 >> 12;
    idx[2] = h1 & 4095u;
    idx[3] = (h1 >> 12) & 4095u;
    const int hq = w.hphase(m) + r * w.hb + (kt >> 1);
    const unsigned t = (win[ROWS * SB + rr * HB + (hq & (HB - 1))] >> (4 * (kt & 1))) & 15u;
#pragma unroll
    for (int i = 0; i < 4; ++i) idx[i] |= ((t >> i) & 1u) << 12;
}

// Stage k tile kt of tile row (m, r) into the tiles: ws_m / sc_m / mn_m the matrix's B tile and its scales and
// mins (GGML), from the ring (chunk kt / KT) or the windows (VQ-8 at 13 bits); VQ-8's scales are its gains.
template <int F, int MATS>
__device__ __forceinline__ void moep_stage_row(uint16_t* ws_m, float* sc_m, float* mn_m, const uint8_t* ring,
                                               const MoepRows<MATS>& w, int m, int r, int kt, const uint64_t* grid) {
    using R = MoepRing<F>;
    const bool valid = r < w.nrows;
    if constexpr (MoepF<F>::VQ) {
        unsigned idx[4] = {0u, 0u, 0u, 0u};
        if constexpr (R::ON) {
            const int c = kt / R::KT;
            if (valid) MoepF<F>::T::indices(moep_ring_row<F, MATS>(ring, w, m, r, c), nullptr, kt - c * R::KT, idx);
        } else {
            if (valid) moep_win_indices<MATS>(ring, w, m, r, kt, idx);
        }
        moep_stage_vq<F>(ws_m, r, idx, valid, grid);
    } else {
        const int c = kt / R::KT;
        moep_stage_w<F>(ws_m + r * MOEP_LDS, sc_m + r, mn_m + r, moep_ring_row<F, MATS>(ring, w, m, r, c), valid,
                        kt - c * R::KT, grid);
    }
}

// Before the k-tile loop (after the barrier that publishes w): the ring's chunk 0, or the windows' first sectors.
template <int F, int MATS>
__device__ __forceinline__ void moep_ring_start(uint8_t* ring, const MoepRows<MATS>& w) {
    if constexpr (MoepRing<F>::ON) moep_ring_fill<F, MATS>(ring, w, 0);
    else moep_win_fill<MATS>(ring, w, 0);
    cp_async_commit();
}

// The k-tile loop's top. Ring: at a chunk's first k tile wait for its copy, then (after the barrier: every thread is
// done with chunk c - 1's buffer and the last tile's MMA) start chunk c + 1's; other k tiles: the barrier only.
// Windows (VQ-8 at 13 bits): k tile 0 waits for the first sectors; then the copies of k tile kt - MOEP_WIN_LEAD and
// before are waited for, the barrier frees the slots k tile kt - 1 read, k tile kt's copies start, and a new hi
// sector is waited for at once.
template <int F, int MATS>
__device__ __forceinline__ void moep_ring_step(uint8_t* ring, const MoepRows<MATS>& w, int kt, int nkt) {
    using R = MoepRing<F>;
    if constexpr (R::ON) {
        if (kt % R::KT == 0) {
            cp_async_wait_all();
            __syncthreads();
            if (kt + R::KT < nkt) moep_ring_fill<F, MATS>(ring, w, kt / R::KT + 1);
            cp_async_commit();
            return;
        }
        __syncthreads();
    } else {
        if (kt == 0) {
            cp_async_wait_all();
            __syncthreads();
            return;
        }
        cp_async_wait<MOEP_WIN_LEAD - 1>();
        __syncthreads();
        moep_win_fill<MATS>(ring, w, kt);
        cp_async_commit();
        if (moep_win_hi_moves(w.hmask, kt)) {
            cp_async_wait_all();
            __syncthreads();
        }
    }
}

// Thread 0, after moep_rows_at for every matrix: the windows' phase masks (VQ-8 at 13 bits).
template <int F, int MATS>
__device__ __forceinline__ void moep_rows_done(MoepRows<MATS>& w) {
    if constexpr (!MoepRing<F>::ON) {
        w.smask = w.hmask = 0u;
        for (int m = 0; m < MATS; ++m) {
            w.smask |= moep_phases(w.phase(m), w.rb, w.nrows);
            w.hmask |= moep_phases(w.hphase(m), w.hb, w.nrows);
        }
    }
}

template <int F>
__device__ __forceinline__ void moep_gate_up(const uint64_t* grid, uint8_t* ring, const uint8_t* Wg, const uint8_t* Wu,
        const float* x, int ldx, const float* route_w, const int* sorted, const int* tile_bucket,
        const int* tile_row, const int* offsets, const int* info, float* H, int n_experts, int ff, int dim, int k,
        float clamp, int bx, int by) {
    using L = MoepL<F>;
    constexpr int NP = MoepW<F>::NP, XP = MoepF<F>::XP;
    constexpr bool VQ = MoepF<F>::VQ;                                 // scales: the gains; no mins, no sums of x
    __shared__ __align__(16) uint16_t as[XP * L::APIECE];
    __shared__ __align__(16) uint16_t ws[2 * NP * L::PIECE];
    __shared__ float wsc[VQ ? 1 : 2 * 2 * MOEP_BN], wmn[VQ ? 1 : 2 * 2 * MOEP_BN], sx[VQ ? 1 : 2 * MOEP_BM];
    __shared__ float gain[VQ ? 2 * MOEP_BN : 1];
    __shared__ MoepRows<2> w;
    int b, r0, r1;
    if (!moep_item(tile_bucket, tile_row, offsets, info, b, r0, r1, by)) return;
    const int n0 = bx * MOEP_BN, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp / MOEP_WGN, wn = warp % MOEP_WGN, g = lane >> 2, t = lane & 3;
    const bool bad = b == n_experts;
    if (!bad) {
        if (tid == 0) {                            // block-uniform, in shared memory: no registers beside the tiles
            moep_rows_at<F, 2>(w, 0, Wg, b, n0, ff, dim, n_experts);
            moep_rows_at<F, 2>(w, 1, Wu, b, n0, ff, dim, n_experts);
            moep_rows_done<F, 2>(w);
        }
        if constexpr (VQ)
            for (int j = tid; j < 2 * MOEP_BN; j += MOEP_THREADS)
                gain[j] = moep_vq_gain<F>(j < MOEP_BN ? Wg : Wu, b, n0 + j % MOEP_BN, n_experts, ff, dim);
        __syncthreads();                                              // w
        moep_ring_start<F, 2>(ring, w);
        const int ar = r0 + tid % MOEP_BM;
        const bool avalid = ar < r1;
        const float* arow = x + (size_t)(avalid ? sorted[ar] / k : 0) * ldx;
        float accg[MOEP_MT][MOEP_NT][4], accu[MOEP_MT][MOEP_NT][4];
        tile_zero(accg);
        tile_zero(accu);
        const int nkt = dim / MOEP_BK;
        auto k_loop = [&](auto mma) {
        for (int kt = 0; kt < nkt; kt++) {
            moep_ring_step<F, 2>(ring, w, kt, nkt);
            moep_stage_a<F>(as, sx, arow, avalid, kt * MOEP_BK);
            for (int j = tid; j < 2 * MOEP_BN; j += MOEP_THREADS) {
                const int mat = j / MOEP_BN, r = j % MOEP_BN;
                moep_stage_row<F, 2>(ws + mat * NP * L::PIECE, wsc + (VQ ? 0 : mat * 2 * MOEP_BN),
                                     wmn + (VQ ? 0 : mat * 2 * MOEP_BN), ring, w, mat, r, kt, grid);
            }
            __syncthreads();
            if constexpr (decltype(mma)::on) {
                const uint16_t* a = as + wm * MOEP_WTM * L::LDS;
                moep_tile<F>(accg, a, ws + wn * MOEP_WTN * L::LDS, VQ ? gain : wsc, wmn, sx, wm, wn);
                moep_tile<F>(accu, a, ws + NP * L::PIECE + wn * MOEP_WTN * L::LDS,
                             VQ ? gain + MOEP_BN : wsc + 2 * MOEP_BN, wmn + (VQ ? 0 : 2 * MOEP_BN), sx, wm, wn);
            }
        }
        };
        if (r1 - r0 > wm * MOEP_WTM) k_loop(MoepMmaOn<true>{});        // the warp has rows that exist
        else k_loop(MoepMmaOn<false>{});
#pragma unroll
        for (int mt = 0; mt < MOEP_MT; mt++)
#pragma unroll
            for (int nt = 0; nt < MOEP_NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int r = r0 + wm * MOEP_WTM + mt * 16 + g + 8 * (i >> 1);
                    const int n = n0 + wn * MOEP_WTN + nt * 8 + 2 * t + (i & 1);
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
__device__ __forceinline__ void moep_down(const uint64_t* grid, uint8_t* ring, const uint8_t* W, const float* H,
        const int* tile_bucket, const int* tile_row, const int* offsets, const int* info, float* Yp, int n_experts,
        int dim, int ff, int bx, int by) {
    using L = MoepL<F>;
    constexpr int NP = MoepW<F>::NP, XP = MoepF<F>::XP;
    constexpr bool VQ = MoepF<F>::VQ;
    __shared__ __align__(16) uint16_t as[XP * L::APIECE];
    __shared__ __align__(16) uint16_t ws[NP * L::PIECE];
    __shared__ float wsc[VQ ? 1 : 2 * MOEP_BN], wmn[VQ ? 1 : 2 * MOEP_BN], sx[VQ ? 1 : 2 * MOEP_BM];
    __shared__ float gain[VQ ? MOEP_BN : 1];
    __shared__ MoepRows<1> w;
    int b, r0, r1;
    if (!moep_item(tile_bucket, tile_row, offsets, info, b, r0, r1, by)) return;
    const int n0 = bx * MOEP_BN, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp / MOEP_WGN, wn = warp % MOEP_WGN, g = lane >> 2, t = lane & 3;
    const bool bad = b == n_experts;
    float acc[MOEP_MT][MOEP_NT][4];
    tile_zero(acc);
    if (!bad) {
        if (tid == 0) {
            moep_rows_at<F, 1>(w, 0, W, b, n0, dim, ff, n_experts);
            w.r1 = w.h1 = nullptr;
            moep_rows_done<F, 1>(w);
        }
        if constexpr (VQ) {
            __syncthreads();                       // the persistent grid: the previous tile's MMAs read the gains
            for (int j = tid; j < MOEP_BN; j += MOEP_THREADS)
                gain[j] = moep_vq_gain<F>(W, b, n0 + j, n_experts, dim, ff);
        }
        __syncthreads();                                              // w
        moep_ring_start<F, 1>(ring, w);
        const int ar = r0 + tid % MOEP_BM;
        const bool avalid = ar < r1;
        const float* arow = H + (size_t)(avalid ? ar : 0) * ff;
        const int nkt = ff / MOEP_BK;
        auto k_loop = [&](auto mma) {
        for (int kt = 0; kt < nkt; kt++) {
            moep_ring_step<F, 1>(ring, w, kt, nkt);
            moep_stage_a<F>(as, sx, arow, avalid, kt * MOEP_BK);
            for (int j = tid; j < MOEP_BN; j += MOEP_THREADS)
                moep_stage_row<F, 1>(ws, wsc, wmn, ring, w, 0, j, kt, grid);
            __syncthreads();
            if constexpr (decltype(mma)::on)
                moep_tile<F>(acc, as + wm * MOEP_WTM * L::LDS, ws + wn * MOEP_WTN * L::LDS, VQ ? gain : wsc, wmn, sx,
                             wm, wn);
        }
        };
        if (r1 - r0 > wm * MOEP_WTM) k_loop(MoepMmaOn<true>{});
        else k_loop(MoepMmaOn<false>{});
    }
#pragma unroll
    for (int mt = 0; mt < MOEP_MT; mt++)
#pragma unroll
        for (int nt = 0; nt < MOEP_NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = r0 + wm * MOEP_WTM + mt * 16 + g + 8 * (i >> 1);
                const int n = n0 + wn * MOEP_WTN + nt * 8 + 2 * t + (i & 1);
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

// ---- entry points: one pair per format of MOE_FORMATS and of MOE_VQ_FORMATS (moe_formats.cuh) ------------------
// Common contracts. Wg / Wu [n_experts, ff, dim], W [n_experts, dim, ff]: the stacked expert tensors' raw GGUF
// bytes; dim and ff multiples of 256 for IQ2_XXS / Q2_K / Q4_K, of 32 otherwise (and of 32 always). x [T, ldx]
// float32 (16-byte aligned, ldx % 4 == 0), route_w [T*k] (null: 1), H [P, ff] and Yp [P, dim] float32 in sorted
// order; sorted / tile_* / offsets / info from moe_prefill_route. clamp <= 0: no clamp.
// VQ-8: Wg / Wu / W the VQ device copies (ds4py/cuda/vq_layout.py: the layer's codebook of KC codewords x 8 E4M3
// bytes at the head of each, the same in all three); dim and ff multiples of 64. The VQ-8 down is persistent: the
// grid is one wave (ds4py/cuda/ops/moe_prefill.py), block i takes the (feature tile, work item) pairs t = i,
// i + gridDim.x, ... < feature tiles x info[0] (feature tile t % tiles, item t / tiles), so the codebook is copied
// into the dynamic shared memory once per resident block, not once per tile; it is visible after the first k
// tile's barrier, and every tile starts with a barrier before it stages. A tile's arithmetic is the
// one-block-per-tile kernel's: the bits do not depend on the grid. The VQ-8 gate + up is not persistent: the tile
// loop costs the 13-bit kernel a spill on sm_121 (168 registers), so each block copies the codebook.
__device__ __forceinline__ const uint64_t* moep_load_codebook(uint8_t* smem, const uint8_t* W, int kc) {
    uint64_t* cb = reinterpret_cast<uint64_t*>(smem);
    const uint64_t* src = reinterpret_cast<const uint64_t*>(W);
    for (int i = threadIdx.x; i < kc; i += blockDim.x) cb[i] = src[i];
    return cb;
}

// The block's decode table, pdl_wait and pdl_launch_dependents called. TK: the list entry's last field, TABLE for
// a ggml format (1: the IQ2_XXS grid, staged into grid_s after pdl_wait), KC for VQ-8 (the codebook, copied from
// W's head into the head of the dynamic shared memory before pdl_wait: the weights do not depend on the previous
// kernel; the ring and the weights then start 8 * KC bytes on, moep_skip).
template <int F, int TK>
__device__ __forceinline__ const uint64_t* moep_table(uint8_t* smem, uint64_t* grid_s, const uint8_t* W) {
    if constexpr (MoepF<F>::VQ) {
        const uint64_t* cb = moep_load_codebook(smem, W, TK);
        pdl_wait();
        pdl_launch_dependents();
        return cb;
    } else {
        pdl_wait();
        pdl_launch_dependents();
        if (TK) {
            moe_load_grid(grid_s);
            __syncthreads();
        }
        return TK ? grid_s : nullptr;
    }
}
template <int F, int TK> constexpr int moep_skip = MoepF<F>::VQ ? 8 * TK : 0;
template <int F, int TK> constexpr int moep_grid_len = !MoepF<F>::VQ && TK ? 256 : 1;

// Gate + up + SwiGLU per work item. Launch: grid (ceil(ff / MOEP_BN), max_tiles), block MOEP_THREADS, dynamic
// shared memory: (VQ-8: KC * 8 +) the sector ring, 2 x 2 x MOEP_BN x MoepRing<F>::PITCH, or at VQ-8 13 bits the
// windows (ops/moe_prefill.py launch_smem).
#define MOEP_GATE_UP(name, F, QK, NB, TK) \
extern "C" __global__ __launch_bounds__(MOEP_THREADS, MOEP_MIN_BLOCKS) void moe_prefill_gate_up_##name(const uint8_t* Wg, \
        const uint8_t* Wu, const float* x, const float* route_w, const int* sorted, const int* tile_bucket, \
        const int* tile_row, const int* offsets, const int* info, float* H, int n_experts, int ff, int dim, int k, \
        int ldx, float clamp) { \
    extern __shared__ __align__(16) uint8_t moep_smem[]; \
    __shared__ uint64_t grid_s[moep_grid_len<F, TK>]; \
    const uint64_t* table = moep_table<F, TK>(moep_smem, grid_s, Wg); \
    constexpr int skip = moep_skip<F, TK>; \
    moep_gate_up<F>(table, moep_smem + skip, Wg + skip, Wu + skip, x, ldx, route_w, sorted, tile_bucket, tile_row, \
                    offsets, info, H, n_experts, ff, dim, k, clamp, blockIdx.x, blockIdx.y); \
}

// Down per work item. Launch: grid (ceil(dim / MOEP_BN), max_tiles; VQ-8 persistent: min(that many blocks, one
// wave)), block MOEP_THREADS, dynamic shared memory (VQ-8: KC * 8 +) the ring, 2 x MOEP_BN x MoepRing<F>::PITCH,
// or at VQ-8 13 bits the windows.
#define MOEP_DOWN(name, F, QK, NB, TK) \
extern "C" __global__ __launch_bounds__(MOEP_THREADS, MOEP_MIN_BLOCKS) void moe_prefill_down_##name(const uint8_t* W, \
        const float* H, const int* tile_bucket, const int* tile_row, const int* offsets, const int* info, \
        float* Yp, int n_experts, int dim, int ff) { \
    extern __shared__ __align__(16) uint8_t moep_smem[]; \
    __shared__ uint64_t grid_s[moep_grid_len<F, TK>]; \
    const uint64_t* table = moep_table<F, TK>(moep_smem, grid_s, W); \
    constexpr int skip = moep_skip<F, TK>; \
    if constexpr (MoepF<F>::VQ) {                     /* persistent: t = (feature tile, work item) */ \
        const int tiles = (dim + MOEP_BN - 1) / MOEP_BN; \
        for (int t = blockIdx.x; t < tiles * info[0]; t += gridDim.x) \
            moep_down<F>(table, moep_smem + skip, W + skip, H, tile_bucket, tile_row, offsets, info, Yp, n_experts, \
                         dim, ff, t % tiles, t / tiles); \
    } else { \
        moep_down<F>(table, moep_smem, W, H, tile_bucket, tile_row, offsets, info, Yp, n_experts, dim, ff, blockIdx.x, \
                     blockIdx.y); \
    } \
}

MOE_FORMATS(MOEP_GATE_UP)
MOE_FORMATS(MOEP_DOWN)
MOE_VQ_FORMATS(MOEP_GATE_UP)
MOE_VQ_FORMATS(MOEP_DOWN)

// ---- exact fp32 token tiles (the default prefill experts of the GGML formats) ----------------------------------
//   moe_gate_up_tile_<fmt>  per work item (the route's tile of up to MOEP_BM sorted rows of one expert) and
//                           rows_per_block gate / up rows: the rows staged once (cp.async), then every sorted row
//                           of the item against them, MOET_NT at a time: H[row] as moe_gate_up_rows_<fmt> computes
//                           that pair's h (bit for bit);
//   moe_down_tile_<fmt>     the same tiling of the down: Yp[row] = that pair's expert row dots, as moe_down_<fmt>
//                           with the one slot (bit for bit); moe_prefill_combine then sums the k slots in order.
// So an expert's weights are read once per work item (once per block of tokens for all but the busiest experts),
// and each thread decodes a group of 32 weights once for MOET_NT tokens (the integer codes and scales stay in
// registers). Thread (row = tid / 8, part = tid % 8) owns one weight row and the column groups g = part, part + 8,
// ...: it sums their dots in that order and three xor shuffles add the 8 parts, which is moe_row_sums' order
// (experts.cu), so the bits are the decode kernels' (twins: ds4py/cuda/twins/experts.py).
#ifndef MOET_NT
#error "MOET_NT comes from ds4py/cuda/ops/moe_prefill.py (DEFINES)"
#endif

// A column group's 32 weights decoded once (integer codes as floats, the scales), and their dot with x in exactly
// the operation order of moe_formats.cuh MoeFmt<F>::dot. XS: the dot needs the half sums of x.
template <int F> struct MoetDec;
template <> struct MoetDec<FMT_IQ2_XXS> {
    static constexpr bool XS = false;
    float c[32], db;
    __device__ __forceinline__ void load(const uint8_t* base, int grp, const uint64_t* grid) {
        unsigned a0, a1;
        MoeFmt<FMT_IQ2_XXS>::aux(base, grp, a0, a1, db);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const uint64_t g = grid[(a0 >> (8 * k)) & 255u];
            const unsigned sg = MoeFmt<FMT_IQ2_XXS>::signs(a1, k), lo = (unsigned)g, hi = (unsigned)(g >> 32);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float v0 = moe_u2f((lo >> (8 * j)) & 255u), v1 = moe_u2f((hi >> (8 * j)) & 255u);
                c[8 * k + j] = (sg >> j) & 1u ? -v0 : v0;
                c[8 * k + j + 4] = (sg >> (j + 4)) & 1u ? -v1 : v1;
            }
        }
    }
    __device__ __forceinline__ float dot(const float* x, const float*) const {
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                s0 = fmaf(c[8 * k + j], x[8 * k + j], s0);
                s1 = fmaf(c[8 * k + j + 4], x[8 * k + j + 4], s1);
            }
        return (s0 + s1) * db;
    }
};
template <> struct MoetDec<FMT_Q2_K> {
    static constexpr bool XS = true;
    float c[32], sc[2], mn[2];
    __device__ __forceinline__ void load(const uint8_t* base, int grp, const uint64_t*) {
        const uint8_t* b = base + (size_t)(grp >> 3) * MoeFmt<FMT_Q2_K>::BYTES;
        const int cw = (grp & 7) * 32, sh = 2 * ((cw >> 5) & 3);
        const float d = moe_f16(b + 80), dmin = moe_f16(b + 82);
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
            const unsigned s = b[(cw >> 4) + sub];
            const uint8_t* qs = b + 16 + 32 * (cw >> 7) + 16 * sub;
            sc[sub] = d * moe_u2f(s & 15u);
            mn[sub] = -dmin * moe_u2f(s >> 4);
#pragma unroll
            for (int word = 0; word < 4; ++word) {
                const unsigned u = moe_u32(qs + 4 * word) >> sh;
#pragma unroll
                for (int by = 0; by < 4; ++by) c[16 * sub + 4 * word + by] = moe_u2f((u >> (8 * by)) & 3u);
            }
        }
    }
    __device__ __forceinline__ float dot(const float* x, const float* xs) const {
        float acc = 0.0f;
#pragma unroll
        for (int sub = 0; sub < 2; ++sub) {
            float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
            for (int j = 0; j < 16; j += 2) {
                s0 = fmaf(c[16 * sub + j], x[16 * sub + j], s0);
                s1 = fmaf(c[16 * sub + j + 1], x[16 * sub + j + 1], s1);
            }
            acc = fmaf(sc[sub], s0 + s1, acc);
            acc = fmaf(mn[sub], xs[sub], acc);
        }
        return acc;
    }
};
template <> struct MoetDec<FMT_Q4_K> {
    static constexpr bool XS = true;
    float c[32], sc, mn;
    __device__ __forceinline__ void load(const uint8_t* base, int grp, const uint64_t*) {
        const uint8_t* b = base + (size_t)(grp >> 3) * MoeFmt<FMT_Q4_K>::BYTES;
        const int gi = grp & 7;
        unsigned s, m;
        MoeFmt<FMT_Q4_K>::scales(b, gi, s, m);
        const uint8_t* qs = b + 16 + 32 * (gi >> 1);
        const int sh = 4 * (gi & 1);
#pragma unroll
        for (int word = 0; word < 8; ++word) {
            const unsigned u = moe_u32(qs + 4 * word) >> sh;
#pragma unroll
            for (int by = 0; by < 4; ++by) c[4 * word + by] = moe_u2f((u >> (8 * by)) & 15u);
        }
        sc = moe_f16(b) * moe_u2f(s);
        mn = -(moe_f16(b + 2) * moe_u2f(m));
    }
    __device__ __forceinline__ float dot(const float* x, const float* xs) const {
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int j = 0; j < 32; j += 2) {
            s0 = fmaf(c[j], x[j], s0);
            s1 = fmaf(c[j + 1], x[j + 1], s1);
        }
        return fmaf(sc, s0 + s1, mn * (xs[0] + xs[1]));
    }
};
template <> struct MoetDec<FMT_MXFP4> {
    static constexpr bool XS = false;
    float c[32], d;
    __device__ __forceinline__ void load(const uint8_t* base, int grp, const uint64_t*) {
        const uint8_t* b = base + (size_t)grp * MoeFmt<FMT_MXFP4>::BYTES;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const unsigned q = b[1 + j];
            c[j] = moe_mxfp4_code(q & 15u);
            c[j + 16] = moe_mxfp4_code(q >> 4);
        }
        d = MoeFmt<FMT_MXFP4>::scale(b);
    }
    __device__ __forceinline__ float dot(const float* x, const float*) const {
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            s0 = fmaf(c[j], x[j], s0);
            s1 = fmaf(c[j + 16], x[j + 16], s1);
        }
        return (s0 + s1) * d;
    }
};
template <> struct MoetDec<FMT_Q8_0> {
    static constexpr bool XS = false;
    float c[32], d;
    __device__ __forceinline__ void load(const uint8_t* base, int grp, const uint64_t*) {
        const uint8_t* b = base + (size_t)grp * MoeFmt<FMT_Q8_0>::BYTES;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const unsigned u = moe_u16(b + 2 + 2 * j);
            c[2 * j] = moe_i8f(u);
            c[2 * j + 1] = moe_i8f(u >> 8);
        }
        d = moe_f16(b);
    }
    __device__ __forceinline__ float dot(const float* x, const float*) const {
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int j = 0; j < 32; j += 2) {
            s0 = fmaf(c[j], x[j], s0);
            s1 = fmaf(c[j + 1], x[j + 1], s1);
        }
        return (s0 + s1) * d;
    }
};
template <> struct MoetDec<FMT_F16> {
    static constexpr bool XS = false;
    float c[32];
    __device__ __forceinline__ void load(const uint8_t* base, int grp, const uint64_t*) {
        const uint4* p = reinterpret_cast<const uint4*>(base + (size_t)grp * MoeFmt<FMT_F16>::BYTES);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            const uint4 u = p[v];
            const __half* hh = reinterpret_cast<const __half*>(&u);
#pragma unroll
            for (int j = 0; j < 8; ++j) c[8 * v + j] = __half2float(hh[j]);
        }
    }
    __device__ __forceinline__ float dot(const float* x, const float*) const {
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int j = 0; j < 32; j += 2) {
            s0 = fmaf(c[j], x[j], s0);
            s1 = fmaf(c[j + 1], x[j + 1], s1);
        }
        return s0 + s1;
    }
};

// The 32 activations of column group g (16-byte loads).
__device__ __forceinline__ void moet_x(const float* row, int g, float* xv) {
    const float4* p = reinterpret_cast<const float4*>(row + 32 * g);
#pragma unroll
    for (int v = 0; v < 8; ++v) {
        const float4 f = p[v];
        xv[4 * v] = f.x;
        xv[4 * v + 1] = f.y;
        xv[4 * v + 2] = f.z;
        xv[4 * v + 3] = f.w;
    }
}

// The K-quants' half sums of x (experts.cu moe_half_sums' order) for the chunk's nt token rows and every column
// group, once per chunk for all the block's weight rows: xs[(j * G + g) * 2 + h]. Barriers on both sides (the
// previous chunk's readers are done; this chunk's sums are visible). Block-uniform.
template <bool XS>
__device__ __forceinline__ void moet_half_sums(float* xs, const float* base, const int* off, int nt, int G) {
    if (!XS) return;
    __syncthreads();
    for (int i = threadIdx.x; i < nt * G; i += blockDim.x) {
        const int j = i / G, g = i - j * G;
        const float* v = base + off[j] + 32 * g;
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int q = 0; q < 16; ++q) {
            a += v[q];
            b += v[q + 16];
        }
        xs[2 * i] = a;
        xs[2 * i + 1] = b;
    }
    __syncthreads();
}

// The 8 parts of a row (lanes 8q .. 8q + 7) added as moe_row_sums does; lane part 0 holds the row's sum.
__device__ __forceinline__ float moet_parts(float s) {
    s += __shfl_xor_sync(DS4_FULL_MASK, s, 4);
    s += __shfl_xor_sync(DS4_FULL_MASK, s, 2);
    s += __shfl_xor_sync(DS4_FULL_MASK, s, 1);
    return s;
}

// Rows [r0, r0 + nr) of expert e of a stacked matrix [n_experts, rows, cols] into dst (moe_stage, cu/moe_formats.cuh);
// the block commits, waits and syncs.
template <int F>
__device__ __forceinline__ const uint8_t* moet_stage(uint8_t* dst, const uint8_t* W, int e, int r0, int nr,
                                                     int rows, int cols) {
    const int rb = MoeRow<F>::bytes(cols);
    return moe_stage(dst, W + ((size_t)e * rows + r0) * rb, nr * rb);
}

template <int F>
__device__ __forceinline__ void moet_gate_up(uint8_t* smem, const uint64_t* grid, const uint8_t* Wg,
        const uint8_t* Wu, const float* x, int ldx, const float* route_w, const int* sorted, const int* tile_bucket,
        const int* tile_row, const int* offsets, const int* info, float* H, int n_experts, int ff, int dim, int k,
        int rows_per_block, float clamp) {
    using D = MoetDec<F>;
    int b, r0, r1;
    if (!moep_item(tile_bucket, tile_row, offsets, info, b, r0, r1)) return;
    const int f0 = blockIdx.x * rows_per_block, nr = min(rows_per_block, ff - f0);
    if (nr <= 0) return;                                              // block-uniform
    const int tid = threadIdx.x, row = tid >> 3, part = tid & 7, G = dim / 32;
    if (b >= n_experts) {                                             // the bad ids' bucket: NaN rows
        for (int i = tid; i < (r1 - r0) * nr; i += blockDim.x)
            H[(size_t)(r0 + i / nr) * ff + f0 + i % nr] = __int_as_float(0x7fc00000);
        return;
    }
    const int rb = MoeRow<F>::bytes(dim);
    const uint8_t* sg = moet_stage<F>(smem, Wg, b, f0, nr, ff, dim);
    const uint8_t* su = moet_stage<F>(smem + moe_room(nr * rb), Wu, b, f0, nr, ff, dim);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    const bool worker = row < nr;
    float* xs_s = reinterpret_cast<float*>(smem + 2 * moe_room(nr * rb));
    __shared__ int off[MOET_NT];                                      // the chunk's x rows (offsets into x)
    for (int c0 = r0; c0 < r1; c0 += MOET_NT) {                      // block-uniform
        const int nt = min(MOET_NT, r1 - c0);
        if (D::XS) {
            if (tid < nt) off[tid] = (sorted[c0 + tid] / k) * ldx;
            moet_half_sums<D::XS>(xs_s, x, off, nt, G);
        }
        float ag[MOET_NT], au[MOET_NT];
        int xo[MOET_NT];
#pragma unroll
        for (int j = 0; j < MOET_NT; ++j) {
            ag[j] = au[j] = 0.0f;
            xo[j] = (sorted[c0 + (j < nt ? j : 0)] / k) * ldx;
        }
        if (worker)
            for (int g = part; g < G; g += 8) {
                D dg, du;
                dg.load(sg + (size_t)row * rb, g, grid);
                du.load(su + (size_t)row * rb, g, grid);
#pragma unroll
                for (int j = 0; j < MOET_NT; ++j) {
                    if (j >= nt) break;
                    float xv[32];
                    moet_x(x + xo[j], g, xv);
                    const float* xs = xs_s + 2 * (j * G + g);
                    ag[j] += dg.dot(xv, xs);
                    au[j] += du.dot(xv, xs);
                }
            }
#pragma unroll
        for (int j = 0; j < MOET_NT; ++j) {
            float g = moet_parts(ag[j]), u = moet_parts(au[j]);
            if (worker && part == 0 && j < nt) {
                if (clamp > 0.0f) {
                    g = fminf(g, clamp);
                    u = fminf(fmaxf(u, -clamp), clamp);
                }
                const float silu = g * (1.0f / (1.0f + expf(-g)));
                const float rw = route_w ? route_w[sorted[c0 + j]] : 1.0f;
                H[(size_t)(c0 + j) * ff + f0 + row] = silu * u * rw;
            }
        }
    }
}

template <int F>
__device__ __forceinline__ void moet_down(uint8_t* smem, const uint64_t* grid, const uint8_t* W, const float* H,
        const int* tile_bucket, const int* tile_row, const int* offsets, const int* info, float* Yp, int n_experts,
        int dim, int ff, int rows_per_block) {
    using D = MoetDec<F>;
    int b, r0, r1;
    if (!moep_item(tile_bucket, tile_row, offsets, info, b, r0, r1)) return;
    const int d0 = blockIdx.x * rows_per_block, nr = min(rows_per_block, dim - d0);
    if (nr <= 0) return;                                              // block-uniform
    const int tid = threadIdx.x, row = tid >> 3, part = tid & 7, G = ff / 32;
    if (b >= n_experts) {
        for (int i = tid; i < (r1 - r0) * nr; i += blockDim.x)
            Yp[(size_t)(r0 + i / nr) * dim + d0 + i % nr] = __int_as_float(0x7fc00000);
        return;
    }
    const int rb = MoeRow<F>::bytes(ff);
    const uint8_t* sw = moet_stage<F>(smem, W, b, d0, nr, dim, ff);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    const bool worker = row < nr;
    float* hs_s = reinterpret_cast<float*>(smem + moe_room(nr * rb));
    __shared__ int off[MOET_NT];                                      // the chunk's H rows
    for (int c0 = r0; c0 < r1; c0 += MOET_NT) {                      // block-uniform
        const int nt = min(MOET_NT, r1 - c0);
        if (D::XS) {
            if (tid < nt) off[tid] = (c0 + tid) * ff;
            moet_half_sums<D::XS>(hs_s, H, off, nt, G);
        }
        float acc[MOET_NT];
#pragma unroll
        for (int j = 0; j < MOET_NT; ++j) acc[j] = 0.0f;
        if (worker)
            for (int g = part; g < G; g += 8) {
                D dw;
                dw.load(sw + (size_t)row * rb, g, grid);
#pragma unroll
                for (int j = 0; j < MOET_NT; ++j) {
                    if (j >= nt) break;
                    float hv[32];
                    moet_x(H + (size_t)(c0 + j) * ff, g, hv);
                    acc[j] += dw.dot(hv, hs_s + 2 * (j * G + g));
                }
            }
#pragma unroll
        for (int j = 0; j < MOET_NT; ++j) {
            const float y = moet_parts(acc[j]);
            if (worker && part == 0 && j < nt) Yp[(size_t)(c0 + j) * dim + d0 + row] = y;
        }
    }
}

// Contracts as moe_prefill_gate_up / _down above (the GGML formats), plus rows_per_block (<= 32: one weight row
// per 8 threads). Launch: grid (ceil(ff / rows_per_block), max_tiles), block 32 * ceil(8 * rows_per_block / 32),
// dynamic shared memory 2 x moe_room(rows_per_block x row bytes) + (Q2_K, Q4_K: the half sums) 8 x MOET_NT x
// dim / 32 (ds4py/cuda/ops/moe_prefill.py tile_smem).
#define MOET_GATE_UP(name, F, QK, NB, TABLE) \
extern "C" __global__ void moe_gate_up_tile_##name(const uint8_t* Wg, const uint8_t* Wu, const float* x, \
        const float* route_w, const int* sorted, const int* tile_bucket, const int* tile_row, const int* offsets, \
        const int* info, float* H, int n_experts, int ff, int dim, int k, int ldx, int rows_per_block, \
        float clamp) { \
    extern __shared__ __align__(16) uint8_t moet_smem[]; \
    __shared__ uint64_t grid_s[TABLE ? 256 : 1]; \
    pdl_wait(); \
    pdl_launch_dependents(); \
    if (TABLE) moe_load_grid(grid_s);                 /* visible after the stage's barrier */ \
    moet_gate_up<F>(moet_smem, TABLE ? grid_s : nullptr, Wg, Wu, x, ldx, route_w, sorted, tile_bucket, tile_row, \
                    offsets, info, H, n_experts, ff, dim, k, rows_per_block, clamp); \
}

// Launch: grid (ceil(dim / rows_per_block), max_tiles), block as above, dynamic shared memory moe_room(
// rows_per_block x row bytes) + (Q2_K, Q4_K) 8 x MOET_NT x ff / 32.
#define MOET_DOWN(name, F, QK, NB, TABLE) \
extern "C" __global__ void moe_down_tile_##name(const uint8_t* W, const float* H, const int* tile_bucket, \
        const int* tile_row, const int* offsets, const int* info, float* Yp, int n_experts, int dim, int ff, \
        int rows_per_block) { \
    extern __shared__ __align__(16) uint8_t moet_smem[]; \
    __shared__ uint64_t grid_s[TABLE ? 256 : 1]; \
    pdl_wait(); \
    pdl_launch_dependents(); \
    if (TABLE) moe_load_grid(grid_s); \
    moet_down<F>(moet_smem, TABLE ? grid_s : nullptr, W, H, tile_bucket, tile_row, offsets, info, Yp, n_experts, \
                 dim, ff, rows_per_block); \
}

MOE_FORMATS(MOET_GATE_UP)
MOE_FORMATS(MOET_DOWN)
