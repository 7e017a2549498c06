// mma_tile.cuh: the tensor-core block tile shared by gemm.cu and moe_prefill.cu. A block computes a BM x BN tile of
// D = A * B^T (A: rows = tokens, k; B: rows = output features, k - a weight matrix row by row) from bf16 operands
// staged in shared memory as 16-bit patterns, k-tile by k-tile, with mma.sync m16n8k16 (bf16 in, fp32 accumulate).
// Warps are laid out WARPS_M x WARPS_N; each owns a (MT*16) x (NT*8) piece of the tile; lane (g = lane/4,
// t = lane%4) holds, for m-tile mt and n-tile nt, acc[mt][nt][0..3] = D[mt*16 + g + 8*(i>>1)][nt*8 + 2t + (i&1)]
// (the fragment layout of portable.cuh). Shared rows are TILE_LDS 16-bit values apart (BK + 8: the 32-bit fragment
// loads of 8 rows x 4 lanes hit 32 distinct banks).
#pragma once
#include <cuda_bf16.h>
#include "types.cuh"
#include "portable.cuh"

__device__ __forceinline__ unsigned tile_ld32(const uint16_t* p) { return *reinterpret_cast<const unsigned*>(p); }

// One k-tile: acc += A[warp rows][k0 .. k0+BK) * B[warp cols][k0 .. k0+BK)^T, k16 steps in increasing order.
// As: the warp's first A row in shared memory; Bs: its first B row; both LDS apart.
template <int MT, int NT, int BK, int LDS>
__device__ __forceinline__ void tile_mma(float (&acc)[MT][NT][4], const uint16_t* As, const uint16_t* Bs) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < BK; ks += 16) {
        unsigned a[MT][4], b[NT][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const uint16_t* p = As + (mt * 16 + g) * LDS + ks + 2 * t;
            a[mt][0] = tile_ld32(p);
            a[mt][1] = tile_ld32(p + 8 * LDS);
            a[mt][2] = tile_ld32(p + 8);
            a[mt][3] = tile_ld32(p + 8 * LDS + 8);
        }
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const uint16_t* q = Bs + (nt * 8 + g) * LDS + ks + 2 * t;
            b[nt][0] = tile_ld32(q);
            b[nt][1] = tile_ld32(q + 8);
        }
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) mma_m16n8k16_bf16_f32(acc[mt][nt], a[mt], b[nt]);
    }
}

template <int MT, int NT>
__device__ __forceinline__ void tile_zero(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[mt][nt][i] = 0.0f;
}

// Split N (8 or 4) fp32 values into NP bf16 pieces whose sum is the value (NP = 1: the values rounded; 2 covers
// F16, 3 covers F32 normals): each piece the round-to-nearest-even bf16 of what the pieces before it left, piece p
// in one 16-byte (N = 8) or 8-byte (N = 4) shared store at dst + p * piece; sum (optional) += the first piece's
// values in order. Two values per conversion: one cvt of a pair gives the 32-bit word the store takes, and the
// rounded values come back from its halves (no 16-bit halves to re-pack).
template <int N, int NP>
__device__ __forceinline__ void tile_split(const float* v, uint16_t* dst, int piece, float* sum = nullptr) {
    static_assert(N == 8 || N == 4, "one 16-byte or 8-byte store a piece");
    float r[N];
#pragma unroll
    for (int i = 0; i < N; i++) r[i] = v[i];
#pragma unroll
    for (int p = 0; p < NP; p++) {
        unsigned w[N / 2];
#pragma unroll
        for (int i = 0; i < N / 2; i++) {
            const __nv_bfloat162 h = __floats2bfloat162_rn(r[2 * i], r[2 * i + 1]);
            w[i] = *reinterpret_cast<const unsigned*>(&h);
            const float b0 = __uint_as_float(w[i] << 16), b1 = __uint_as_float(w[i] & 0xffff0000u);
            if (p == 0 && sum) {
                *sum += b0;
                *sum += b1;
            }
            if (p + 1 < NP) {
                r[2 * i] = r[2 * i] - b0;                        // exact: the remainder has the few bits left
                r[2 * i + 1] = r[2 * i + 1] - b1;
            }
        }
        if constexpr (N == 8)
            *reinterpret_cast<uint4*>(dst + p * piece) = make_uint4(w[0], w[1], w[2], w[3]);
        else
            *reinterpret_cast<uint2*>(dst + p * piece) = make_uint2(w[0], w[1]);
    }
}
template <int NP>
__device__ __forceinline__ void tile_split8(const float* v, uint16_t* dst, int piece, float* sum = nullptr) {
    tile_split<8, NP>(v, dst, piece, sum);
}
template <int NP>
__device__ __forceinline__ void tile_split4(const float* v, uint16_t* dst, int piece) { tile_split<4, NP>(v, dst, piece); }

// Eight (four) fp32 values -> eight (four) bf16 patterns in one 16-byte (8-byte) shared store.
__device__ __forceinline__ void tile_store8(uint16_t* dst, const float* v) { tile_split<8, 1>(v, dst, 0); }
__device__ __forceinline__ void tile_store4(uint16_t* dst, const float* v) { tile_split<4, 1>(v, dst, 0); }
