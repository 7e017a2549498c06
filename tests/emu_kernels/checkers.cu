// Test-only kernels with planted bugs (and their correct twins) for the emulator's checker builds
// (tests/test_emu_checkers.py): each mode must report the bug it claims to find, and nothing in the twin.
#include "types.cuh"

// Launch: grid 1, block n <= 256. Every thread writes its slot, then reads its neighbour's: with `sync` the
// barrier orders them; without it, thread i's read races with thread i + 1's write.
extern "C" __global__ void neighbour_sum(const float* x, float* y, int sync) {
    __shared__ float s[256];
    const int t = threadIdx.x;
    s[t] = x[t];
    if (sync) __syncthreads();
    y[t] = s[t] + s[(t + 1) % blockDim.x];
}

// neighbour_sum with its shared array declared inside a function template (as cu/moe_prefill.cu's tiles are):
// g++ places such a static in its own COMDAT section, not in emu_shared, unless the build moves it there
// (ds4py/cuda/emu.py _move_template_shared); the race must be seen all the same.
template <int N> __device__ float tpl_neighbour(const float* x, int sync) {
    __shared__ float s[N];
    const int t = threadIdx.x;
    s[t] = x[t];
    if (sync) __syncthreads();
    return s[t] + s[(t + 1) % blockDim.x];
}
extern "C" __global__ void tpl_neighbour_sum(const float* x, float* y, int sync) {
    y[threadIdx.x] = tpl_neighbour<256>(x, sync);
}

// Launch: grid 1, block 64. All threads add into one shared counter atomically (no race), then read it after
// a barrier; with `plain`, thread 0 also overwrites it without an atomic inside the interval (a race).
extern "C" __global__ void shared_counter(int* out, int plain) {
    __shared__ int count;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    atomicAdd(&count, 1);
    if (plain && threadIdx.x == 0) count = 100;
    __syncthreads();
    out[threadIdx.x] = count;
}

// Launch: grid 1, block 32. Lanes exchange through shared memory; __syncwarp orders the write before the read
// (no race); without it (`sync` 0) lane i's read races with lane i ^ 1's write.
extern "C" __global__ void warp_swap(const float* x, float* y, int sync) {
    __shared__ float s[32];
    const int l = threadIdx.x;
    s[l] = x[l];
    if (sync) __syncwarp();
    y[l] = s[l ^ 1];
}

// Launch: grid 1, block 32. y[t] = x[t + off]: off = 1 reads one float past the end of x for the last thread
// (into x's alignment padding when x holds 5 floats: the guard page does not see it), off = -1 reads one float
// before its start.
extern "C" __global__ void shifted_copy(const float* x, float* y, int n, int off) {
    const int t = threadIdx.x;
    if (t < n) y[t] = x[t + off];
}

// Launch: grid 1, block 32. Reads a[i] for i < 32 + extra from a 32-float static __shared__ array: extra > 0 runs
// into the next static variable.
extern "C" __global__ void static_overrun(float* y, int extra) {
    __shared__ float a[32];
    __shared__ float b[32];
    a[threadIdx.x] = 1.0f;
    b[threadIdx.x] = 2.0f;
    __syncthreads();
    float acc = 0.0f;
    for (int i = 0; i < 32 + extra; i++) acc += a[i];
    y[threadIdx.x] = acc + b[threadIdx.x];
}

// Launch: grid 1, block 32, 32 * 4 bytes of dynamic shared memory. d[threadIdx.x + off]: off = -1 reads one float
// before the launch's dynamic shared memory.
extern "C" __global__ void dyn_underflow(float* y, int off) {
    extern __shared__ float d[];
    d[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    const int i = (int)threadIdx.x + off;
    y[threadIdx.x] = i >= 0 || off < 0 ? d[i] : 0.0f;
}

// Launch: grid 1, block 32. A signed overflow when `big` is INT_MAX (undefined behaviour).
extern "C" __global__ void add_overflow(int* y, int big) {
    y[threadIdx.x] = big + (int)threadIdx.x;
}
