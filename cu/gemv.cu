// Decode GEMV: y[r] = sum_c W[r, c] * x[c] for one activation vector, fp32 accumulate.
// Memory-bound: each weight byte is read once, with 16-byte loads coalesced across the warp and several loads
// in flight per lane; x (a few KB) stays in L1/L2. One warp owns one row at a time, so no shared-memory
// reduction is needed for F16 and the row loop works for any grid (persistent or one-block-per-few-rows).
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"

// F16 weights [rows, cols] row-major. Needs cols % 8 == 0 and W, x 16-byte aligned (the arena gives 256).
// Launch: block (32*warps, a multiple of 32), grid (any; ceil(rows / warps) covers every row once).
// Warp w of block b takes rows b*warps + w, stepping gridDim.x*warps.
extern "C" __global__ void gemv_f16(const __half* W, const float* x, float* y, int rows, int cols) {
    pdl_wait();
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int nvec = cols >> 3;                       // 8 halves per 16-byte load
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int row = blockIdx.x * warps + (threadIdx.x >> 5); row < rows; row += gridDim.x * warps) {
        const uint4* w4 = reinterpret_cast<const uint4*>(W + (size_t)row * cols);
        float acc = 0.0f;
#pragma unroll 4
        for (int v = lane; v < nvec; v += 32) {
            const uint4 p = w4[v];
            const __half* h = reinterpret_cast<const __half*>(&p);
            const float4 xa = x4[2 * v], xb = x4[2 * v + 1];
            acc += __half2float(h[0]) * xa.x + __half2float(h[1]) * xa.y
                 + __half2float(h[2]) * xa.z + __half2float(h[3]) * xa.w
                 + __half2float(h[4]) * xb.x + __half2float(h[5]) * xb.y
                 + __half2float(h[6]) * xb.z + __half2float(h[7]) * xb.w;
        }
        acc = warp_sum(acc);
        if (lane == 0) y[row] = acc;
    }
}

// Q8_0: each row is cols/32 blocks of 34 bytes (f16 scale d, then 32 int8 q); value = d * q.
// A block is 34 bytes, so rows are only 2-byte aligned and the quants cannot be read with 16-byte loads in place.
// Each warp therefore stages a chunk of its row into shared memory with 16-byte async copies (the unaligned head
// and tail bytes one by one), then decodes from shared memory: 8 lanes per block, 4 quants per lane, 4 blocks per step.
#define Q8_BLOCK_BYTES 34
#define Q8_CHUNK_BLOCKS 128                                    // 4352 bytes: a whole row of a 4096-wide matrix
#define Q8_STAGE_BYTES (Q8_CHUNK_BLOCKS * Q8_BLOCK_BYTES + 16)  // + room to keep the source's 16-byte phase

// Start copying n bytes from global src into shared dst + (src % 16), so 16-byte aligned words stay 16-byte
// aligned. The aligned words go by cp.async (global -> shared without registers, many in flight, L1 bypassed);
// the unaligned head and tail bytes by plain loads. Returns where the copy starts in dst. The whole warp calls
// it, then warp_stage_wait() before reading the stage.
__device__ __forceinline__ const uint8_t* warp_stage_issue(uint8_t* dst, const uint8_t* src, int n, int lane) {
    const int phase = (int)(reinterpret_cast<size_t>(src) & 15);
    int head = phase ? 16 - phase : 0;
    if (head > n) head = n;
    const int words = (n - head) >> 4;
    uint8_t* out = dst + phase;
    const uint8_t* s16 = src + head;
    uint8_t* d16 = out + head;
#pragma unroll 4
    for (int i = lane; i < words; i += 32) cp_async_16(d16 + 16 * i, s16 + 16 * i);
    cp_async_commit();
    for (int i = lane; i < head; i += 32) out[i] = src[i];
    for (int i = head + words * 16 + lane; i < n; i += 32) out[i] = src[i];
    return out;
}

__device__ __forceinline__ void warp_stage_wait() {
    cp_async_wait_all();
    __syncwarp();
}

// Q8_0 weights [rows, cols] (cols % 32 == 0), x 16-byte aligned. W must not be written by the kernel before this
// one in the stream: its first chunk is fetched before pdl_wait(), overlapping that kernel's tail under PDL.
// Launch: block (32*warps), dynamic shared memory warps * Q8_STAGE_BYTES (4368 B per warp), grid (any; ceil(rows /
// warps) covers every row once). Warp w of block b takes rows b*warps + w, stepping gridDim.x*warps.
extern "C" __global__ void gemv_q8_0(const uint8_t* W, const float* x, float* y, int rows, int cols) {
    extern __shared__ __align__(16) uint8_t q8_stage[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int nblocks = cols >> 5;
    const size_t row_bytes = (size_t)nblocks * Q8_BLOCK_BYTES;
    uint8_t* stage = q8_stage + warp * Q8_STAGE_BYTES;
    const int first_row = blockIdx.x * warps + warp;
    bool prefetched = first_row < rows;
    const uint8_t* s = prefetched
        ? warp_stage_issue(stage, W + (size_t)first_row * row_bytes, min(Q8_CHUNK_BLOCKS, nblocks) * Q8_BLOCK_BYTES,
                           lane)
        : stage;
    pdl_wait();                                        // from here on x (the previous kernel's output) is ready
    pdl_launch_dependents();
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const int sub = lane & 7;                          // which 4 quants of a block this lane takes
    for (int row = first_row; row < rows; row += gridDim.x * warps) {
        const uint8_t* wr = W + (size_t)row * row_bytes;
        float acc = 0.0f;
        for (int b0 = 0; b0 < nblocks; b0 += Q8_CHUNK_BLOCKS) {
            const int nb = min(Q8_CHUNK_BLOCKS, nblocks - b0);
            if (!prefetched) s = warp_stage_issue(stage, wr + (size_t)b0 * Q8_BLOCK_BYTES, nb * Q8_BLOCK_BYTES, lane);
            prefetched = false;
            warp_stage_wait();
            for (int b = lane >> 3; b < nb; b += 4) {
                const uint8_t* blk = s + b * Q8_BLOCK_BYTES;
                const float d = __half2float(*reinterpret_cast<const __half*>(blk));
                const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2 + 4 * sub);
                const float4 xv = x4[(b0 + b) * 8 + sub];
                acc += d * ((float)q[0] * xv.x + (float)q[1] * xv.y + (float)q[2] * xv.z + (float)q[3] * xv.w);
            }
            __syncwarp();                              // all lanes done reading before the next chunk lands
        }
        acc = warp_sum(acc);
        if (lane == 0) y[row] = acc;
    }
}
