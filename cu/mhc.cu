// Hyper-connections (mHC, MODEL.md §2.2 and the head collapse of §2.1): the residual state is hc copies X_j of
// the hidden vector; before each sub-layer a 24-row mix of flatten(X) gives pre / post weights and a Sinkhorn-
// normalised hc x hc matrix C; the sub-layer sees sum_j pre_j X_j, and its output f goes back as
// X'_k = post_k f + sum_j C[j,k] X_j (here, or fused into the GEMV that produces f: cu/gemv.cu).
//
//   hc_mix_f16 / hc_mix_f32   m = fn @ flatten(X) and sum(flatten(X)^2), split over column chunks of
//                              MIX_COLS; the last block to finish (an atomic ticket, never a spin-wait) adds
//                              the chunks' partials in chunk order, applies the RMS scale and computes
//                              pre / post / C (20 Sinkhorn rounds on one warp). With hc rows (the head's fn)
//                              it computes pre only. With y given, that last block then does
//                              hc_collapse_norm's work too (one launch and one gap fewer per sub-layer): the
//                              same loop, bit for bit the separate kernel's at the same block size.
//   hc_collapse_norm           y = RMSNorm(sum_j pre_j X_j; w)
//   hc_post_f32                X'_k = post_k f + sum_j C[j,k] X_j in place
// Mix record per token: MIX = (2 + hc) * hc floats: pre[hc], post[hc], C[hc][hc] (row j, column k).
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"

#ifndef MIX_COLS
#error "MIX_COLS comes from ds4py/cuda/ops/mhc.py (DEFINES)"
#endif
#ifndef DS4_HC
#error "DS4_HC comes from ds4py/cuda/compiler.py (model defines)"
#endif
#define HC DS4_HC
#define MIX ((2 + HC) * HC)
static_assert((HC & (HC - 1)) == 0 && HC * HC <= 32, "the Sinkhorn warp holds the hc x hc matrix, hc a power of 2");
static_assert(MIX_COLS % 256 == 0, "a warp covers 256 columns per step");
#define MIX_ITERS (MIX_COLS / 256)        // 8-column steps of one lane in a chunk
#define MIX_GROUPS ((MIX + 3) / 4)        // 4-row groups of a sub-layer's fn

__device__ __forceinline__ float sigmoid_f(float v) { return 1.0f / (1.0f + expf(-v)); }

__device__ __forceinline__ void load8(const __half* p, float* o) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __half22float2(h[i]);
        o[2 * i] = f.x;
        o[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void load8(const float* p, float* o) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}

// The hc x hc matrix is held one entry per lane (lane & (hc*hc - 1)). The Sinkhorn warp's sums and max over a row
// (over k: hc lanes 1 apart) or a column (over j: hc lanes hc apart): the xor
// butterfly's values in its exact operand order ((v_0 + v_1) + (v_2 + v_3) at hc 4, v_k the lane at xor k * step),
// but every partner's value shuffled at once, so a round waits for one shuffle latency per sum instead of
// log2(hc) of them (the last block's tail: 20 rounds of a row and a column sum each).
template <int STEP, class Op>
__device__ __forceinline__ float xor_tree(float v, Op op) {
    float t[HC];
    t[0] = v;
#pragma unroll
    for (int k = 1; k < HC; k++) t[k] = __shfl_xor_sync(DS4_FULL_MASK, v, k * STEP);
#pragma unroll
    for (int o = 1; o < HC; o <<= 1)
#pragma unroll
        for (int k = 0; k < HC; k += 2 * o) t[k] = op(t[k], t[k + o]);
    return t[0];
}
struct AddOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
__device__ __forceinline__ float row_sum(float v) { return xor_tree<1>(v, AddOp()); }
__device__ __forceinline__ float row_max(float v) { return xor_tree<1>(v, MaxOp()); }
__device__ __forceinline__ float col_sum(float v) { return xor_tree<HC>(v, AddOp()); }

// One thread's 4 columns (cb, cb + blockDim.x, ...) of a collapse pass: x (hc rows) and w, loaded together so a
// thread keeps 4 * (hc + 1) loads in flight. hc_mix's last block loads its first pass before the Sinkhorn.
struct CollapseCols {
    float xv[4][HC], wk[4];
    __device__ __forceinline__ void load(const float* x, int D, const float* w, int cb) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int c = cb + k * (int)blockDim.x;
#pragma unroll
            for (int j = 0; j < HC; j++) xv[k][j] = c < D ? x[(size_t)j * D + c] : 0.0f;
            wk[k] = c < D && w ? w[c] : 1.0f;
        }
    }
};

// y = RMSNorm(sum_j p_j x_j; w) of one token by the whole block (blockDim.x a multiple of 32): thread t owns
// columns t, t + blockDim.x, ...; PRELOADED: cols holds its first pass, loaded by the caller (cols.load(x, D, w,
// t)), else the loop loads every pass. Where
// 4 columns a thread cover D (every real width at the default block) the sums stay in registers for the normalise
// (one round trip in all, not three). The sums (over j, then the squares over the thread's columns in ascending
// order, then block_sum) do not depend on that batching: the bits are those of the one-column loop.
template <bool PRELOADED>
__device__ __forceinline__ void collapse_norm_row(const float* x, const float* p, int D, const float* w, float eps,
                                                  float* yr, float* part, CollapseCols& cols) {
    const int nt = blockDim.x;
    const bool one_pass = D <= 4 * nt;
    float ss = 0.0f, keep[4];
    for (int cb = threadIdx.x; cb < D; cb += 4 * nt) {
        if (!PRELOADED || cb != (int)threadIdx.x) cols.load(x, D, w, cb);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int c = cb + k * nt;
            float v = p[0] * cols.xv[k][0];            // sum over j in ascending order
#pragma unroll
            for (int j = 1; j < HC; j++) v += p[j] * cols.xv[k][j];
            keep[k] = v;
            if (c < D) {
                if (!one_pass) yr[c] = v;
                ss += v * v;
            }
        }
    }
    ss = block_sum(ss, part);
    const float r = rsqrtf(ss / (float)D + eps);
    if (one_pass) {
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int c = threadIdx.x + k * nt;
            if (c < D) yr[c] = w ? keep[k] * r * cols.wk[k] : keep[k] * r;
        }
        return;
    }
    for (int c = threadIdx.x; c < D; c += nt) yr[c] = w ? yr[c] * r * w[c] : yr[c] * r;
}

// The collapse that hc_mix's last block does (y null: none): pre from this launch's mix record, or (pre given:
// V4.1's lagged mHC) from pre[tok * pre_stride ...]; w optional; y [T, D].
struct MixCollapse {
    const float* pre;
    int pre_stride;
    const float* w;
    float eps;
    float* y;
};

template <class T>
__device__ __forceinline__ void hc_mix_body(const T* fn, int nrows, const float* X, int n, const float* scale,
                                            const float* base, float* partial, unsigned* ticket, float* mix,
                                            float norm_eps, float hc_eps, int iters, MixCollapse col) {
    __shared__ float acc[MIX + 1];
    __shared__ float dpart[MIX_GROUPS][MIX_ITERS][4][32];   // one lane's 8-column dot products, per step
    __shared__ float cpart[32];
    __shared__ int last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int tok = blockIdx.y, nblk = gridDim.x;
    const int c0 = blockIdx.x * MIX_COLS, c1 = min(n, c0 + MIX_COLS);
    const int groups = (nrows + 3) >> 2;
    constexpr int per_line = 128 / (int)sizeof(T);     // fn is a weight: its chunk's 128-byte lines head for
    for (int r = threadIdx.x; r < nrows * (MIX_COLS / per_line); r += blockDim.x) {   // L2 before the wait
        const int row = r / (MIX_COLS / per_line), c = c0 + (r % (MIX_COLS / per_line)) * per_line;
        if (c < c1) prefetch_l2(fn + (size_t)row * n + c);
    }
    pdl_wait();
    pdl_launch_dependents();
    const float* x = X + (size_t)tok * n;
    float* part = partial + ((size_t)tok * nblk + blockIdx.x) * (nrows + 1);
    // Products: (4-row group, 8-column step) items spread over the warps but the last (every item's loads in
    // flight at once; one warp: it does them all); lanes over 8-column vectors.
    const int item_warps = warps > 1 ? warps - 1 : 1;
    if (warp < item_warps) {
        for (int item = warp; item < groups * MIX_ITERS; item += item_warps) {
            const int g = item / MIX_ITERS, it = item % MIX_ITERS, c = c0 + 8 * lane + 256 * it;
            if (c >= c1) continue;
            float xv[8], wv[8];
            load8(x + c, xv);
#pragma unroll
            for (int s = 0; s < 4; s++) {
                const int r = 4 * g + s;
                if (r >= nrows) continue;
                load8(fn + (size_t)r * n + c, wv);
                float d = wv[0] * xv[0];
#pragma unroll
                for (int i = 1; i < 8; i++) d += wv[i] * xv[i];
                dpart[g][it][s][lane] = d;
            }
        }
    }
    if (warp == warps - 1) {                           // and the sum of squares of this chunk
        float ss = 0.0f;
        for (int c = c0 + 8 * lane; c < c1; c += 256) {
            float xv[8];
            load8(x + c, xv);
#pragma unroll
            for (int i = 0; i < 8; i++) ss += xv[i] * xv[i];
        }
        ss = warp_sum(ss);
        if (lane == 0) part[nrows] = ss;
    }
    __syncthreads();
    // each group's sums: a lane adds its steps in column order, as one warp looping over the chunk would (so the
    // bits never depend on the warp count), then warp_sum4
    for (int g = warp; g < groups; g += warps) {
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int it = 0; it < MIX_ITERS && c0 + 8 * lane + 256 * it < c1; it++) {
#pragma unroll
            for (int s = 0; s < 4; s++)
                if (4 * g + s < nrows) a[s] += dpart[g][it][s][lane];
        }
        const float t = warp_sum4(a);
        const int r = 4 * g + (lane >> 3);
        if ((lane & 7) == 0 && r < nrows) part[r] = t;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();                               // the partials are visible before the ticket says so
        last = atomicAdd(ticket + tok, 1u) == (unsigned)nblk - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int D = n / HC;
    CollapseCols cols;
    if (col.y) cols.load(x, D, col.w, threadIdx.x);    // in flight while the partials and the Sinkhorn run
    const float* all = partial + (size_t)tok * nblk * (nrows + 1);
    const int n_part = nblk * (nrows + 1);
    float* staged = &dpart[0][0][0][0];                // free again: the chunk partials in one round trip
    const bool stage = n_part <= MIX_GROUPS * MIX_ITERS * 4 * 32;
    if (stage) {
        for (int i = threadIdx.x; i < n_part; i += blockDim.x) staged[i] = __ldcg(all + i);
        __syncthreads();
    }
    for (int r = threadIdx.x; r <= nrows; r += blockDim.x) {
        float s = 0.0f;
        for (int b = 0; b < nblk; b++)                 // chunk order
            s += stage ? staged[b * (nrows + 1) + r] : __ldcg(all + (size_t)b * (nrows + 1) + r);
        acc[r] = s;
    }
    __syncthreads();
    const float rs = rsqrtf(acc[nrows] / (float)n + norm_eps);
    float* out = mix + (size_t)tok * MIX;
    const int r = threadIdx.x;
    if (r < HC) out[r] = sigmoid_f(acc[r] * rs * scale[0] + base[r]) + hc_eps;
    if (nrows == MIX) {
        if (r >= HC && r < 2 * HC) out[r] = 2.0f * sigmoid_f(acc[r] * rs * scale[1] + base[r]);
        if (warp == 0) {                               // Sinkhorn: lane holds C[j][k], e = lane mod hc*hc
            const int e = lane & (HC * HC - 1);
            float c = acc[2 * HC + e] * rs * scale[2] + base[2 * HC + e];
            c = expf(c - row_max(c));
            c = c / row_sum(c) + hc_eps;
            c = c / (col_sum(c) + hc_eps);
            for (int it = 1; it < iters; it++) {
                c = c / (row_sum(c) + hc_eps);
                c = c / (col_sum(c) + hc_eps);
            }
            if (lane < HC * HC) out[2 * HC + e] = c;
        }
    }
    if (threadIdx.x == 0) ticket[tok] = 0u;            // ready for the next launch (graph replays)
    if (!col.y) return;
    __syncthreads();                                   // this record's pre is written (block-visible)
    const float* pre = col.pre ? col.pre + (size_t)tok * col.pre_stride : out;
    float p[HC];
#pragma unroll
    for (int j = 0; j < HC; j++) p[j] = pre[j];
    collapse_norm_row<true>(x, p, D, col.w, col.eps, col.y + (size_t)tok * D, cpart, cols);
}

// Launch: grid (ceil(n / MIX_COLS), T tokens), block (32 * warps, warps >= 1). fn [nrows, n] with n = hc * D
// (n % 8 == 0, fn and X 16-byte aligned); nrows = (2 + hc) * hc (a sub-layer's mix) or hc (the head's: pre
// only). partial: T * gridDim.x * (nrows + 1) floats of scratch; ticket: T zeroed uints, left zeroed; mix:
// T records of MIX floats. scale: [3] (head: [1]), base: [nrows]. y null: the mix only; y [T, D] given: the last
// block of token t also writes y[t] = RMSNorm(sum_j pre_j X[t, j]; w) (w null: no weight) with pre = pre_mix
// [t * pre_stride ...] (pre_mix null: this launch's record), as hc_collapse_norm at the same block size would.
#define HC_MIX(name, T) \
extern "C" __global__ __launch_bounds__(1024) void name(const T* fn, int nrows, const float* X, int n, \
                                                        const float* scale, const float* base, float* partial, \
                                                        unsigned* ticket, float* mix, float norm_eps, float hc_eps, \
                                                        int iters, const float* pre_mix, int pre_stride, \
                                                        const float* w, float eps, float* y) { \
    hc_mix_body(fn, nrows, X, n, scale, base, partial, ticket, mix, norm_eps, hc_eps, iters, \
                MixCollapse{pre_mix, pre_stride, w, eps, y}); \
}
HC_MIX(hc_mix_f16, __half)
// As hc_mix_f16 with F32 fn. Launch: as hc_mix_f16.
HC_MIX(hc_mix_f32, float)

// y[t] = RMSNorm(sum_j pre_j X[t, j]; w) with pre = mix[t * mix_stride ...] and w optional (null: no weight).
// Launch: grid (T), block (threads, a multiple of 32, <= 1024). X [T, hc, D], y [T, D].
extern "C" __global__ __launch_bounds__(1024) void hc_collapse_norm(const float* X, const float* mix, int mix_stride,
                                                                      int D, const float* w, float eps, float* y) {
    __shared__ float part[32];
    pdl_wait();
    pdl_launch_dependents();
    const float* pre = mix + (size_t)blockIdx.x * mix_stride;
    float p[HC];
#pragma unroll
    for (int j = 0; j < HC; j++) p[j] = pre[j];
    CollapseCols cols;
    collapse_norm_row<false>(X + (size_t)blockIdx.x * HC * D, p, D, w, eps, y + (size_t)blockIdx.x * D, part, cols);
}

// X'_k = post_k f + sum_j C[j,k] X_j for every column, in place (each thread owns its columns for all k).
// Launch: grid (ceil(D / threads), T), block (threads, a multiple of 32). X [T, hc, D], f [T, D].
extern "C" __global__ void hc_post_f32(const float* f, const float* mix, int mix_stride, float* X, int D) {
    pdl_wait();
    pdl_launch_dependents();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D) return;
    const float* m = mix + (size_t)blockIdx.y * mix_stride;
    float* x = X + (size_t)blockIdx.y * HC * D;
    const float fv = f[(size_t)blockIdx.y * D + c];
    float xj[HC];
#pragma unroll
    for (int j = 0; j < HC; j++) xj[j] = x[(size_t)j * D + c];
#pragma unroll
    for (int k = 0; k < HC; k++) {
        float s = m[2 * HC + k] * xj[0];
#pragma unroll
        for (int j = 1; j < HC; j++) s += m[2 * HC + j * HC + k] * xj[j];
        x[(size_t)k * D + c] = m[HC + k] * fv + s;
    }
}
