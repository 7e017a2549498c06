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

// bf16 round-to-nearest-even of a float, as its 16 bits (NaN stays NaN).
__device__ __forceinline__ unsigned tile_bf16(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float tile_bf16_value(unsigned bits) { return __uint_as_float(bits << 16); }
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

// Eight fp32 values -> eight bf16 patterns in one 16-byte shared store.
__device__ __forceinline__ void tile_store8(uint16_t* dst, const float* v) {
    uint4 p;
    p.x = tile_bf16(v[0]) | (tile_bf16(v[1]) << 16);
    p.y = tile_bf16(v[2]) | (tile_bf16(v[3]) << 16);
    p.z = tile_bf16(v[4]) | (tile_bf16(v[5]) << 16);
    p.w = tile_bf16(v[6]) | (tile_bf16(v[7]) << 16);
    *reinterpret_cast<uint4*>(dst) = p;
}

// Split exact fp32 values into NP bf16 pieces whose sum is the value (NP = 2 covers F16, 3 covers F32 normals):
// piece p of the 8 values goes to dst + p * piece.
template <int NP>
__device__ __forceinline__ void tile_split8(const float* v, uint16_t* dst, int piece) {
    float r[8];
#pragma unroll
    for (int i = 0; i < 8; i++) r[i] = v[i];
#pragma unroll
    for (int p = 0; p < NP; p++) {
        float b[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            b[i] = tile_bf16_value(tile_bf16(r[i]));
            r[i] = r[i] - b[i];                                  // exact: the remainder has the few bits left
        }
        tile_store8(dst + p * piece, b);                         // on the bf16 grid: stored as it is
    }
}

// Four fp32 values -> four bf16 patterns in one 8-byte shared store.
__device__ __forceinline__ void tile_store4(uint16_t* dst, const float* v) {
    uint2 p;
    p.x = tile_bf16(v[0]) | (tile_bf16(v[1]) << 16);
    p.y = tile_bf16(v[2]) | (tile_bf16(v[3]) << 16);
    *reinterpret_cast<uint2*>(dst) = p;
}

// tile_split8 for four values (8-byte stores).
template <int NP>
__device__ __forceinline__ void tile_split4(const float* v, uint16_t* dst, int piece) {
    float r[4];
#pragma unroll
    for (int i = 0; i < 4; i++) r[i] = v[i];
#pragma unroll
    for (int p = 0; p < NP; p++) {
        float b[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            b[i] = tile_bf16_value(tile_bf16(r[i]));
            r[i] = r[i] - b[i];
        }
        tile_store4(dst + p * piece, b);
    }
}
