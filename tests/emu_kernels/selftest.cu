// Kernels that exercise the CPU emulator itself (tests/test_cu_emu.py); each has a numpy twin in the test.
#include <cuda_fp16.h>
#include "portable.cuh"

// Global index of every thread, for 3-D grids and blocks: out[g] = (block linear, thread linear).
extern "C" __global__ void index3d(int* block_lin, int* thread_lin) {
    const int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int g = b * blockDim.x * blockDim.y * blockDim.z + t;
    block_lin[g] = b;
    thread_lin[g] = t;
}

// Reverse each block's slice through shared memory; `sync` = 0 drops the barrier (a race the emulator shows).
extern "C" __global__ void reverse_block(const int* in, int* out, int sync) {
    __shared__ int s[1024];
    const int t = threadIdx.x, base = blockIdx.x * blockDim.x;
    s[t] = in[base + t];
    if (sync) __syncthreads();
    out[base + t] = s[blockDim.x - 1 - t];
}

// The same through dynamic shared memory, n ints per block staged in two halves.
extern "C" __global__ void reverse_dynamic(const int* in, int* out, int n) {
    extern __shared__ int buf[];
    const int base = blockIdx.x * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = in[base + i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[base + i] = buf[n - 1 - i];
}

extern "C" __global__ void shuffles(const int* in, int* idx, int* up, int* down, int* bfly, int src, int delta,
                                    int width) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    const int v = in[g];
    idx[g] = __shfl_sync(0xffffffffu, v, src, width);
    up[g] = __shfl_up_sync(0xffffffffu, v, delta, width);
    down[g] = __shfl_down_sync(0xffffffffu, v, delta, width);
    bfly[g] = __shfl_xor_sync(0xffffffffu, v, delta, width);
}

// Float and 64-bit payloads; lanes >= active leave the warp first, the rest shuffle within `mask`.
extern "C" __global__ void shuffle_types(const float* f, const double* d, float* fo, double* dout, unsigned mask) {
    const int lane = threadIdx.x & 31;
    if (!(mask & (1u << lane))) return;
    fo[threadIdx.x] = __shfl_down_sync(mask, f[threadIdx.x], 1);
    dout[threadIdx.x] = __shfl_xor_sync(mask, d[threadIdx.x], 1);
}

extern "C" __global__ void votes(const int* pred, unsigned* ballot, int* any, int* all, unsigned* match,
                                 int* count) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    const int p = pred[g];
    ballot[g] = __ballot_sync(0xffffffffu, p);
    any[g] = __any_sync(0xffffffffu, p);
    all[g] = __all_sync(0xffffffffu, p);
    match[g] = __match_any_sync(0xffffffffu, p);
    count[g] = __syncthreads_count(p);
}

extern "C" __global__ void warp_reduce(const unsigned* in, unsigned* add, unsigned* mn, unsigned* mx,
                                       unsigned* x) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned v = in[g];
    add[g] = __reduce_add_sync(0xffffffffu, v);
    mn[g] = __reduce_min_sync(0xffffffffu, v);
    mx[g] = __reduce_max_sync(0xffffffffu, v);
    x[g] = __reduce_xor_sync(0xffffffffu, v);
}

// Histogram with atomicAdd, global max with atomicMax, slot claiming with atomicCAS, and a float sum.
extern "C" __global__ void atomics(const int* vals, int n, int* hist, int* vmax, int* slots, int* claimed,
                                   float* fsum) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n) return;
    const int v = vals[g];
    atomicAdd(&hist[v & 15], 1);
    atomicMax(vmax, v);
    atomicAdd(fsum, 0.5f);
    if (atomicCAS(&slots[v & 7], -1, g) == -1) atomicAdd(claimed, 1);
}

// Bugs the emulator must report.
extern "C" __global__ void bad_barrier(int* out) {
    if (threadIdx.x < 16) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1;
}

extern "C" __global__ void bad_shuffle(int* out) {
    int v = threadIdx.x;
    if (threadIdx.x & 1) v = __shfl_xor_sync(0xffffffffu, v, 1);
    else v = __shfl_xor_sync(0xffffffffu, v, 2);
    out[threadIdx.x] = v;
}

extern "C" __global__ void deadlock(int* out) {
    int v = threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
    else __syncthreads();
    out[threadIdx.x] = v;
}

extern "C" __global__ void exited_lane(int* out) {
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

extern "C" __global__ void read_past_end(const float* x, float* y, int n) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g < n) y[g] = x[g + 1];
}

extern "C" __global__ void write_const(const float* x, float* y) {
    const_cast<float*>(x)[threadIdx.x] = 1.0f;
    y[threadIdx.x] = x[threadIdx.x];
}

extern "C" __global__ void write_padding(float* y, int n) {
    y[threadIdx.x] = (float)threadIdx.x;   // launched with more threads than n: spills into the alignment pad
}

__device__ __noinline__ int recurse(int depth) {
    volatile char frame[2048];
    frame[0] = (char)depth;
    return depth ? recurse(depth - 1) + frame[0] : 0;
}
extern "C" __global__ void stack_overflow(int* out, int depth) { out[threadIdx.x] = recurse(depth); }

// half <-> float and the portable.cuh FP8 conversions, elementwise.
extern "C" __global__ void conversions(const float* f, int n, __half* h, float* hf, unsigned char* e4,
                                       unsigned char* e5, const unsigned char* codes, float* d4, float* d5,
                                       __half2* h4, __half2* h5) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        h[i] = __float2half_rn(f[i]);
        hf[i] = __half2float(h[i]);
        e4[i] = float_to_fp8_e4m3(f[i]);
        e5[i] = float_to_fp8_e5m2(f[i]);
    }
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < 256; c += gridDim.x * blockDim.x) {
        d4[c] = fp8_e4m3_to_float(codes[c]);
        d5[c] = fp8_e5m2_to_float(codes[c]);
        const unsigned short pair = (unsigned short)(codes[c] | (codes[255 - c] << 8));
        h4[c] = fp8x2_e4m3_to_half2(pair);
        h5[c] = fp8x2_e5m2_to_half2(pair);
    }
}

// Stage a tile with cp.async; `wait` = 0 forgets cp_async_wait_all, so the tile is still garbage when read.
extern "C" __global__ void cp_async_tile(const float* in, float* out, int wait) {
    __shared__ __align__(16) float tile[256];
    const int t = threadIdx.x;                          // blockDim.x = 64: 4 floats per thread
    cp_async_16(&tile[4 * t], &in[blockIdx.x * 256 + 4 * t]);
    cp_async_commit();
    if (wait) cp_async_wait_all();
    __syncthreads();
    for (int i = t; i < 256; i += blockDim.x) out[blockIdx.x * 256 + i] = tile[255 - i];
}

// One m16n8k16 tile per warp: A [16][16] row-major, B [16][8] row-major (k, n), C/D [16][8] row-major.
__device__ __forceinline__ unsigned pack2(const __half* p0, const __half* p1) {
    return (unsigned)__half_as_ushort(*p0) | ((unsigned)__half_as_ushort(*p1) << 16);
}
extern "C" __global__ void mma_tile(const __half* A, const __half* B, const float* C, float* D) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    A += tile * 256; B += tile * 128; C += tile * 128; D += tile * 128;
    unsigned a[4], b[2];
    a[0] = pack2(&A[g * 16 + 2 * t], &A[g * 16 + 2 * t + 1]);
    a[1] = pack2(&A[(g + 8) * 16 + 2 * t], &A[(g + 8) * 16 + 2 * t + 1]);
    a[2] = pack2(&A[g * 16 + 2 * t + 8], &A[g * 16 + 2 * t + 9]);
    a[3] = pack2(&A[(g + 8) * 16 + 2 * t + 8], &A[(g + 8) * 16 + 2 * t + 9]);
    b[0] = pack2(&B[(2 * t) * 8 + g], &B[(2 * t + 1) * 8 + g]);
    b[1] = pack2(&B[(2 * t + 8) * 8 + g], &B[(2 * t + 9) * 8 + g]);
    float d[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
    mma_m16n8k16_f16_f32(d, a, b);
    D[g * 8 + 2 * t] = d[0];
    D[g * 8 + 2 * t + 1] = d[1];
    D[(g + 8) * 8 + 2 * t] = d[2];
    D[(g + 8) * 8 + 2 * t + 1] = d[3];
}

// ldmatrix x4 per warp: a 16 x 16 tile of 16-bit values (in, row-major) staged in shared rows 24 values apart, each
// lane giving the row of quadrant i / 8 (rows 8 ((i / 8) & 1), columns 8 (i / 8 / 2)) at `shift` values past it (0:
// aligned; else a misaligned row address); out[tile][lane][j] = r[j] (the mma A fragment of portable.cuh).
extern "C" __global__ void ldsm_tile(const unsigned short* in, unsigned* out, int shift) {
    __shared__ __align__(16) unsigned short s[2][16 * 24 + 8];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, tile = blockIdx.x * (blockDim.x >> 5) + w;
    for (int i = lane; i < 256; i += 32) s[w][(i / 16) * 24 + i % 16] = in[tile * 256 + i];
    __syncwarp();
    const int q = lane >> 3;
    unsigned r[4];
    ldsm_x4(r, &s[w][((lane & 7) + 8 * (q & 1)) * 24 + 8 * (q >> 1) + shift]);
    for (int j = 0; j < 4; j++) out[(tile * 32 + lane) * 4 + j] = r[j];
}

extern "C" __global__ void __launch_bounds__(64) bounded(int* out, int d) { out[threadIdx.x] = 100 / d; }

// Two half-warps shuffle independently with disjoint masks at different call sites, then rejoin at __syncwarp.
extern "C" __global__ void half_warps(const int* in, int* out) {
    const int lane = threadIdx.x & 31;
    int v = in[threadIdx.x];
    if (lane < 16) v += __shfl_down_sync(0x0000ffffu, v, 1, 16);
    else v += __shfl_up_sync(0xffff0000u, v, 1, 16);
    __syncwarp();
    out[threadIdx.x] = v;
}

// The PDL rule the emulator's pdl check enforces: nothing stored to global memory and no return before
// pdl_wait(). Reads before it are fine (weights prefetched while the previous kernel finishes).
extern "C" __global__ void pdl_ok(const float* x, float* y) {
    __shared__ float s[64];
    prefetch_l2(x + threadIdx.x);
    s[threadIdx.x] = x[threadIdx.x];
    pdl_wait();
    __syncthreads();
    y[threadIdx.x] = s[blockDim.x - 1 - threadIdx.x];
}

extern "C" __global__ void pdl_store_first(float* y, int late) {
    if (threadIdx.x == (unsigned)late) y[threadIdx.x] = 1.0f;
    pdl_wait();
    y[threadIdx.x] += 1.0f;
}

extern "C" __global__ void pdl_return_first(float* y, int n) {
    if ((int)threadIdx.x >= n) return;
    pdl_wait();
    y[threadIdx.x] = 2.0f;
}
