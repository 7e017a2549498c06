// Decode GEMV: y[r] = sum_c W[r, c] * x[c] for one activation vector, weights straight from the GGUF (F32, F16,
// Q8_0), fp32 activations and fp32 accumulation. Memory-bound: every weight byte is read once.
//
// Shape of the work. A warp computes GEMV_ROWS (4) rows at a time - "slots" - so each x value it loads serves 4
// rows (x traffic through L1 is a quarter of the weight traffic instead of several times it). Warps take
// row groups grid-stride, so any grid covers every row once. Lanes stride the columns with 16-byte loads.
//
// Reduction order. A row's sum depends only on `cols`: every lane accumulates its columns in increasing order
// and warp_sum4 adds the 32 lane partials with a fixed tree; a row's slot is its index mod 4. So the result is
// bit-identical run to run and whatever the grid, the block size, the other matrices in the launch or how many
// rows a launch covers (batch invariance).
//
// Q8_0 (34-byte blocks: f16 scale d, 32 int8 q; rows only 2-byte aligned): each warp streams its slots' row
// pieces (Q8_CHUNK_BLOCKS blocks = 1024 columns each) into shared memory with 16-byte cp.async, a ring of
// Q8_STAGES buffers: the next Q8_STAGES - 1 pieces are in flight while the current one is decoded, and the first
// Q8_STAGES - 1 are issued before pdl_wait() (weights are never written by the kernel before this one).
// int8 -> float uses a byte permute into the mantissa of 2^23 and one exact subtraction (full-rate integer and
// fp32 ops) instead of I2F, which runs at a quarter of the fp32 rate and would cap the kernel below the memory
// roofline.
//
// Variants (the same body; see ops/gemv.py): plain (up to 4 matrices sharing x, each with its own y: q_a + kv),
// optional RMSNorm prologue on x (flags & GEMV_NORM; scale applied to each row's sum), optional accumulate
// (flags & GEMV_ADD: y += W x), input groups (x_group_rows > 0: rows [g*x_group_rows, ...) read
// x + g*cols; the grouped wo_a), an hc_post epilogue (X'_k = post_k * y + sum_j C[j,k] X_j in place) and a
// SwiGLU epilogue (out = silu(min(g, c)) * clamp(u, -c, c) of two matrices: the shared expert's gate and up).
//
// Several activation rows (the `_rows` entry points: nx <= GEMV_MAX_X vectors x_n = x + n * x_stride, outputs
// y_m + n * rows_m, hc_post on X + n * hc * D with mix + n * (2 + hc) * hc): one multi-row step (several sequences,
// or a verify chunk) reads each weight once for all rows. The body is the same template with NB = GEMV_MAX_X
// accumulator sets instead of 1; row n's arithmetic - the lane's column order, the warp_sum4 tree, the epilogue -
// is exactly that of a single-row launch, so a row's bits do not depend on which or how many other rows share the
// launch (batch invariance; tests/test_cu_emu_rows.py).
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"
#include "moe_formats.cuh"

#ifndef F32_CHUNK_PIECES
#error "F32_CHUNK_PIECES comes from ds4py/cuda/ops/gemv.py (DEFINES)"
#endif
#ifndef F16_CHUNK_PIECES
#error "F16_CHUNK_PIECES comes from ds4py/cuda/ops/gemv.py (DEFINES)"
#endif
#ifndef Q4_CHUNK_BLOCKS
#error "Q4_CHUNK_BLOCKS comes from ds4py/cuda/ops/gemv.py (DEFINES)"
#endif
#ifndef GEMV_ROWS
#error "GEMV_ROWS comes from ds4py/cuda/ops/gemv.py (DEFINES)"
#endif
#ifndef Q8_CHUNK_BLOCKS
#error "Q8_CHUNK_BLOCKS comes from ds4py/cuda/ops/gemv.py (DEFINES)"
#endif
#ifndef GEMV_MAX_X
#error "GEMV_MAX_X comes from ds4py/cuda/ops/gemv.py (DEFINES)"
#endif
#ifndef Q8_STAGES
#error "Q8_STAGES comes from ds4py/cuda/ops/gemv.py (DEFINES)"
#endif
#ifndef DS4_HC
#error "DS4_HC comes from ds4py/cuda/compiler.py (model defines)"
#endif
static_assert(GEMV_ROWS == 4, "warp_sum4 reduces exactly 4 slots");
static_assert(Q8_CHUNK_BLOCKS % 4 == 0, "4 Q8_0 blocks are decoded side by side");
static_assert(Q8_STAGES >= 2, "the Q8_0 ring keeps at least one piece in flight while one is decoded");

#define Q8_BLOCK_BYTES 34
#define Q8_PIECE_BYTES (Q8_CHUNK_BLOCKS * Q8_BLOCK_BYTES + 16)    // + room to keep the source's 16-byte phase
#define Q8_WARP_SMEM (Q8_STAGES * GEMV_ROWS * Q8_PIECE_BYTES)     // a ring of Q8_STAGES buffers of GEMV_ROWS pieces

#define GEMV_NORM 1
#define GEMV_ADD 2
#define EPI_STORE 0
#define EPI_HC_POST 1
#define EPI_SWIGLU 2
#define MAX_MATS 4

struct GemvJob {
    const void* W[MAX_MATS];
    float* y[MAX_MATS];
    int rows[MAX_MATS];
    int nmat;
    const float* x;
    int nx, x_stride;          // activation rows and the floats between them (1, 0 for the single-row kernels)
    int cols, x_group_rows;
    const float* norm_w;
    float norm_eps;
    int flags, epi;
    const float* mix;          // hc_post: [pre(hc), post(hc), comb(hc*hc)]
    float* hc_x;               // hc_post: X [hc, rows], updated in place
    float clamp;               // swiglu
};

// The job's arrays are only ever indexed with constants or through sel4, so they stay in registers (a runtime
// index into a local array would put it in local memory).
template <class T> __device__ __forceinline__ T sel4(int m, T a, T b, T c, T d) {
    return m == 0 ? a : m == 1 ? b : m == 2 ? c : d;
}
#define JOB_W(j, m) sel4((m), (j).W[0], (j).W[1], (j).W[2], (j).W[3])
#define JOB_Y(j, m) sel4((m), (j).y[0], (j).y[1], (j).y[2], (j).y[3])
#define JOB_ROWS(j, m) sel4((m), (j).rows[0], (j).rows[1], (j).rows[2], (j).rows[3])

// Row groups: matrix m has ceil(rows_m / 4) groups (SwiGLU: ceil(rows / 2) groups of 2 gate + 2 up rows).
__device__ __forceinline__ int group_count(const GemvJob& j) {
    if (j.epi == EPI_SWIGLU) return (j.rows[0] + 1) >> 1;
    int n = 0;
#pragma unroll
    for (int m = 0; m < MAX_MATS; m++)
        if (m < j.nmat) n += (j.rows[m] + GEMV_ROWS - 1) / GEMV_ROWS;
    return n;
}

// Slot s of group g: which matrix and row (row < 0: no such row, the slot idles).
__device__ __forceinline__ void slot_row(const GemvJob& j, int g, int s, int& m, int& row) {
    if (j.epi == EPI_SWIGLU) {
        m = s >> 1;
        row = 2 * g + (s & 1);
        if (row >= j.rows[0]) row = -1;
        return;
    }
    m = 0;
    int first = 0, rows = j.rows[0];
    bool found = false;
#pragma unroll
    for (int mm = 0; mm < MAX_MATS; mm++) {
        if (!found && mm < j.nmat) {
            const int gm = (j.rows[mm] + GEMV_ROWS - 1) / GEMV_ROWS;
            if (g < first + gm || mm == j.nmat - 1) {
                m = mm;
                rows = j.rows[mm];
                found = true;
            } else {
                first += gm;
            }
        }
    }
    row = (g - first) * GEMV_ROWS + s;
    if (row >= rows) row = -1;
}

__device__ __forceinline__ const float* slot_x(const GemvJob& j, int row, int n) {
    const float* x = j.x + (size_t)n * j.x_stride;
    return j.x_group_rows > 0 ? x + (size_t)(row / j.x_group_rows) * j.cols : x;
}

// RMSNorm scale of x, computed by each warp on its own (fixed order, so it is the same in every warp and block).
__device__ __forceinline__ float warp_norm_scale(const GemvJob& j, int n) {
    const int lane = threadIdx.x & 31;
    const float4* x4 = reinterpret_cast<const float4*>(j.x + (size_t)n * j.x_stride);
    float ss = 0.0f;
    for (int v = lane; v < (j.cols >> 2); v += 32) {
        const float4 a = x4[v];
        ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    }
    ss = warp_sum(ss);
    return rsqrtf(ss / (float)j.cols + j.norm_eps);
}

__device__ __forceinline__ float silu_f(float v) { return v / (1.0f + expf(-v)); }

// The 4 slot sums are in lanes 0, 8, 16, 24 (warp_sum4); lane 8*s finishes slot s, of activation row n.
__device__ __forceinline__ void epilogue(const GemvJob& j, int g, float t, float scale, int n) {
    const int lane = threadIdx.x & 31;
    t *= scale;
    if (j.epi == EPI_SWIGLU) {
        const float u = __shfl_down_sync(DS4_FULL_MASK, t, 16);    // up rows are slots 2, 3
        if (lane == 0 || lane == 8) {
            int m, row;
            slot_row(j, g, lane >> 3, m, row);
            if (row >= 0) {
                float gv = t, uv = u;
                if (j.clamp > 0.0f) {
                    gv = fminf(gv, j.clamp);
                    uv = fminf(fmaxf(uv, -j.clamp), j.clamp);
                }
                j.y[0][(size_t)n * j.rows[0] + row] = silu_f(gv) * uv;
            }
        }
        return;
    }
    if (lane & 7) return;
    int m, row;
    slot_row(j, g, lane >> 3, m, row);
    if (row < 0) return;
    if (j.epi == EPI_HC_POST) {
        const int D = j.rows[0];
        float* X = j.hc_x + (size_t)n * DS4_HC * D;
        const float* mix = j.mix + (size_t)n * (2 + DS4_HC) * DS4_HC;
        float xj[DS4_HC];
#pragma unroll
        for (int a = 0; a < DS4_HC; a++) xj[a] = X[(size_t)a * D + row];
#pragma unroll
        for (int k = 0; k < DS4_HC; k++) {
            float s = mix[2 * DS4_HC + k] * xj[0];                   // sum_j C[j, k] X_j, j ascending
#pragma unroll
            for (int a = 1; a < DS4_HC; a++) s += mix[2 * DS4_HC + a * DS4_HC + k] * xj[a];
            X[(size_t)k * D + row] = mix[DS4_HC + k] * t + s;
        }
        return;
    }
    float* y = JOB_Y(j, m) + (size_t)n * JOB_ROWS(j, m) + row;
    *y = (j.flags & GEMV_ADD) ? *y + t : t;
}

// ---- F32 / F16 / Q4_K pieces of 8 columns (decoded from the staged copy: gemv_staged) --------------------------
// x[8v .. 8v+8) (times the norm weight when there is one).
__device__ __forceinline__ void load_x8(const GemvJob& j, const float* x, int v, bool weighted, float xs[8]) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    const float4 a = x4[2 * v], b = x4[2 * v + 1];
    xs[0] = a.x; xs[1] = a.y; xs[2] = a.z; xs[3] = a.w; xs[4] = b.x; xs[5] = b.y; xs[6] = b.z; xs[7] = b.w;
    if (weighted) {
        const float4* w4 = reinterpret_cast<const float4*>(j.norm_w);
        const float4 c = w4[2 * v], d = w4[2 * v + 1];
        xs[0] *= c.x; xs[1] *= c.y; xs[2] *= c.z; xs[3] *= c.w; xs[4] *= d.x; xs[5] *= d.y; xs[6] *= d.z; xs[7] *= d.w;
    }
}

// W[8v .. 8v+8) as floats (exact): one 16-byte load of halves, or two of floats - once for all activation rows.
__device__ __forceinline__ void load_w8(const __half* row, int v, float wf[8]) {
    const uint4 p = reinterpret_cast<const uint4*>(row)[v];
    const __half2* h = reinterpret_cast<const __half2*>(&p);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __half22float2(h[i]);
        wf[2 * i] = f.x;
        wf[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void load_w8(const float* row, int v, float wf[8]) {
    const float4 a = reinterpret_cast<const float4*>(row)[2 * v], b = reinterpret_cast<const float4*>(row)[2 * v + 1];
    wf[0] = a.x; wf[1] = a.y; wf[2] = a.z; wf[3] = a.w; wf[4] = b.x; wf[5] = b.y; wf[6] = b.z; wf[7] = b.w;
}

// Q4_K (144-byte blocks of 256 columns: f16 d, f16 dmin, 12 bytes of 6-bit scales / mins, 128 bytes of nibbles;
// moe_formats.cuh): W[8v .. 8v+8) of one row, exact as ds4py.quant decodes them (q * fl(d * sc) - fl(dmin * m),
// explicit _rn operations). Piece v lies in block v / 32, sub-block (v / 4) % 8, and its 8 nibbles are 8
// consecutive bytes of that sub-block pair's 32 (low nibbles: the even sub-block) - one 8-byte load. A warp's 32
// lanes cover one whole block of each slot's row per step (144 contiguous bytes).
struct Q4K {};
__device__ __forceinline__ void load_w8(const Q4K* row, int v, float wf[8]) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(row) + (size_t)(v >> 5) * 144;
    const int gi = (v >> 2) & 7;
    // The block's 16 header bytes (f16 d, f16 dmin, 12 scale bytes) in two 8-byte loads, not byte by byte; the
    // 6-bit scale / min of sub-block gi (MoeFmt<FMT_Q4_K>::scales, same values) cut out of the words.
    const uint2 h0 = *reinterpret_cast<const uint2*>(b), h1 = *reinterpret_cast<const uint2*>(b + 8);
    const int sh8 = 8 * (gi & 3);
    const unsigned a = h0.y >> sh8, c = h1.x >> sh8, e = h1.y >> sh8;    // bytes 4+gi', 8+gi', 12+gi' (gi' = gi&3)
    const unsigned sc = gi < 4 ? a & 63u : (e & 15u) | ((a >> 6) & 3u) << 4;
    const unsigned mn = gi < 4 ? c & 63u : ((e >> 4) & 15u) | ((c >> 6) & 3u) << 4;
    const float dl = __fmul_rn(__half2float(__ushort_as_half((unsigned short)(h0.x & 0xffffu))), moe_u2f(sc));
    const float ml = __fmul_rn(__half2float(__ushort_as_half((unsigned short)(h0.x >> 16))), moe_u2f(mn));
    const uint2 q = *reinterpret_cast<const uint2*>(b + 16 + 32 * (gi >> 1) + 8 * (v & 3));
    // 4 nibbles at once into the low bytes, then each into the mantissa of 2^23 (= moe_u2f's bits)
    const int sh = 4 * (gi & 1);
    const unsigned lo = (q.x >> sh) & 0x0F0F0F0Fu, hi = (q.y >> sh) & 0x0F0F0F0Fu;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float n0 = __uint_as_float(__byte_perm(lo, 0x4B000000u, 0x7650 + i)) - 8388608.0f;
        const float n1 = __uint_as_float(__byte_perm(hi, 0x4B000000u, 0x7650 + i)) - 8388608.0f;
        wf[i] = __fsub_rn(__fmul_rn(n0, dl), ml);
        wf[4 + i] = __fsub_rn(__fmul_rn(n1, dl), ml);
    }
}

// sum_i wf[i] * xs[i], i ascending.
__device__ __forceinline__ float dot8(const float wf[8], const float* xs) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) s += wf[i] * xs[i];
    return s;
}

// ---- Q8_0: staged through shared memory ---------------------------------------------------------------------
// Start copying n bytes from global src into shared dst + (src % 16), so 16-byte aligned words stay 16-byte
// aligned: aligned words by cp.async (no registers, L1 bypassed), the unaligned head and tail bytes by plain
// loads. Returns the offset in dst where the bytes start. The whole warp calls it.
__device__ __forceinline__ int warp_stage_issue(uint8_t* dst, const uint8_t* src, int n, int lane) {
    const int phase = (int)(reinterpret_cast<size_t>(src) & 15);
    int head = phase ? 16 - phase : 0;
    if (head > n) head = n;
    const int words = (n - head) >> 4;
    uint8_t* out = dst + phase;
    const uint8_t* s16 = src + head;
    uint8_t* d16 = out + head;
    for (int i = lane; i < words; i += 32) cp_async_16(d16 + 16 * i, s16 + 16 * i);
    for (int i = lane; i < head; i += 32) out[i] = src[i];
    for (int i = head + words * 16 + lane; i < n; i += 32) out[i] = src[i];
    return phase;
}

// 4 int8 (as 4 bytes of w) -> 4 exact floats: the biased byte becomes the low mantissa of 2^23.
__device__ __forceinline__ void q8x4_to_float(unsigned w, float q[4]) {
    const unsigned u = w ^ 0x80808080u;
    q[0] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7650)) - 8388736.0f;
    q[1] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7651)) - 8388736.0f;
    q[2] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7652)) - 8388736.0f;
    q[3] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7653)) - 8388736.0f;
}

struct Q8Item {               // one piece of work: chunk c of group g
    int g, c;
};

__device__ __forceinline__ bool q8_next(int nchunks, int groups, int nwarps, Q8Item& it) {
    if (++it.c < nchunks) return true;
    it.c = 0;
    it.g += nwarps;
    return it.g < groups;
}

// Where slot s of an item starts in global memory (null: the slot has no row).
__device__ __forceinline__ const uint8_t* q8_src(const GemvJob& j, const Q8Item& it, int s, int nblocks) {
    int m, row;
    slot_row(j, it.g, s, m, row);
    if (row < 0) return nullptr;
    return reinterpret_cast<const uint8_t*>(JOB_W(j, m)) + (size_t)row * nblocks * Q8_BLOCK_BYTES +
           (size_t)it.c * Q8_CHUNK_BLOCKS * Q8_BLOCK_BYTES;
}

// Issue the copies of one item into buffer `buf` (slot s's bytes start at its piece + (src % 16)); the caller commits.
__device__ __forceinline__ void q8_issue(const GemvJob& j, uint8_t* stage, int buf, const Q8Item& it, int nblocks,
                                         int lane) {
    const int nb = min(Q8_CHUNK_BLOCKS, nblocks - it.c * Q8_CHUNK_BLOCKS);
#pragma unroll
    for (int s = 0; s < GEMV_ROWS; s++) {
        const uint8_t* src = q8_src(j, it, s, nblocks);
        if (src) warp_stage_issue(stage + (buf * GEMV_ROWS + s) * Q8_PIECE_BYTES, src, nb * Q8_BLOCK_BYTES, lane);
    }
}

// ---- the rings' shared pieces (gemv_q8, gemv_staged, and their int8-activation twins gemv_q8_i8, gemv_q4k_i8) ---
// The calling warp's items: grid-stride over the row groups (from group gwarp, step nwarps), or GROUPED a run of
// consecutive groups (the grouped int8 kernels: one quantisation of an x group serves the run's rows).
struct GemvItems {
    Q8Item first;
    int end, step;                                     // the groups before `end`, `step` apart
};
template <bool GROUPED>
__device__ __forceinline__ GemvItems gemv_items(int groups, int gwarp, int nwarps) {
    const int run = GROUPED ? (groups + nwarps - 1) / nwarps : 0;
    return {{GROUPED ? gwarp * run : gwarp, 0}, GROUPED ? min(groups, (gwarp + 1) * run) : groups,
            GROUPED ? 1 : nwarps};
}

// One step of the Q8_0 ring's issuing side: the copies of item `ahead` into buffer ibuf while there is one, one
// commit group either way (empty past the last item, so "the oldest group has landed" is always
// cp_async_wait<Q8_STAGES - 1>), then the next item and buffer.
__device__ __forceinline__ void q8_ring_issue(const GemvJob& j, uint8_t* stage, int nblocks, int nchunks,
                                              const GemvItems& items, int lane, Q8Item& ahead, bool& issuing,
                                              int& ibuf) {
    if (issuing) {
        q8_issue(j, stage, ibuf, ahead, nblocks, lane);
        issuing = q8_next(nchunks, items.end, items.step, ahead);
    }
    cp_async_commit();
    ibuf = ibuf + 1 == Q8_STAGES ? 0 : ibuf + 1;
}

// Where slot s's staged bytes start in buffer buf: its piece + the 16-byte phase of src, its source in global
// memory (null: no row). A slot without a row decodes slot 0's staged piece instead of branching in the loop: its
// sum is never stored (epilogue skips row < 0); slot 0 of a group always has a row.
__device__ __forceinline__ const uint8_t* ring_piece(uint8_t* stage, int buf, int piece_bytes, int s,
                                                     const uint8_t* src, const uint8_t* const* piece) {
    return src ? stage + (buf * GEMV_ROWS + s) * piece_bytes + ((size_t)src & 15) : s ? piece[0] : stage;
}

template <int NB> __device__ __forceinline__ void acc_zero(float (&acc)[NB][GEMV_ROWS]) {
#pragma unroll
    for (int n = 0; n < NB; n++)
#pragma unroll
        for (int s = 0; s < GEMV_ROWS; s++) acc[n][s] = 0.0f;
}

// After the last chunk of item `cur`'s group: each activation row's 4 slot sums reduced over the warp (warp_sum4)
// and stored by the epilogue, times scale[n] (the RMSNorm scale; null: 1, the norm is in x's codes), and the sums
// zeroed for the next group.
template <int NB>
__device__ __forceinline__ void gemv_group_done(const GemvJob& j, const Q8Item& cur, int nchunks,
                                                float (&acc)[NB][GEMV_ROWS], const float* scale) {
    if (cur.c == nchunks - 1) {
#pragma unroll
        for (int n = 0; n < NB; n++) {
            if (n < j.nx) epilogue(j, cur.g, warp_sum4(acc[n]), scale ? scale[n] : 1.0f, n);
#pragma unroll
            for (int s = 0; s < GEMV_ROWS; s++) acc[n][s] = 0.0f;
        }
    }
}

// GROUPED: the x group of item group g (x_group_rows divides: the item's 4 slots share one).
__device__ __forceinline__ int item_x_group(const GemvJob& j, int g) {
    int m0, row0;
    slot_row(j, g, 0, m0, row0);
    return (row0 < 0 ? 0 : row0) / j.x_group_rows;
}

// Q8_0 weights [rows, cols] (cols % 32 == 0), x 16-byte aligned, W 2-byte aligned; NB accumulator sets.
template <int NB>
__device__ __forceinline__ void gemv_q8(const GemvJob& j) {
    extern __shared__ __align__(16) uint8_t q8_stage[];
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int gwarp = blockIdx.x * warps + (threadIdx.x >> 5), nwarps = gridDim.x * warps;
    uint8_t* stage = q8_stage + (threadIdx.x >> 5) * Q8_WARP_SMEM;
    const int nblocks = j.cols >> 5;
    const int nchunks = (nblocks + Q8_CHUNK_BLOCKS - 1) / Q8_CHUNK_BLOCKS;
    const GemvItems items = gemv_items<false>(group_count(j), gwarp, nwarps);
    Q8Item cur = items.first;
    const bool any = cur.g < items.end;
    // The ring: item i lives in buffer i % Q8_STAGES; Q8_STAGES - 1 items are in flight while one is decoded.
    Q8Item ahead = cur;                                // the next item to issue
    bool issuing = any;
    int ibuf = 0;                                      // its buffer
#pragma unroll
    for (int k = 0; k < Q8_STAGES - 1; k++)            // before pdl_wait: weights only
        q8_ring_issue(j, stage, nblocks, nchunks, items, lane, ahead, issuing, ibuf);
    pdl_wait();                                        // from here on x (the previous kernel's output) is ready
    pdl_launch_dependents();
    float scale[NB];
#pragma unroll
    for (int n = 0; n < NB; n++) scale[n] = (n < j.nx && (j.flags & GEMV_NORM)) ? warp_norm_scale(j, n) : 1.0f;
    const bool weighted = (j.flags & GEMV_NORM) && j.norm_w;
    const int sub = lane & 7;                          // which 4 quants of a block this lane takes
    float acc[NB][GEMV_ROWS];
    acc_zero(acc);
    int buf = 0;
    bool more = any;
    while (more) {
        Q8Item nxt = cur;
        more = q8_next(nchunks, items.end, items.step, nxt);
        q8_ring_issue(j, stage, nblocks, nchunks, items, lane, ahead, issuing, ibuf);   // into the freed buffer
        cp_async_wait<Q8_STAGES - 1>();                // this item's copies have landed, the next ones fly
        __syncwarp();
        int m0, row0;
        slot_row(j, cur.g, 0, m0, row0);
        if (row0 < 0) row0 = 0;
        const int b0 = cur.c * Q8_CHUNK_BLOCKS;
        const int nb = min(Q8_CHUNK_BLOCKS, nblocks - b0);
        const float4* w4 = reinterpret_cast<const float4*>(j.norm_w);
        const uint8_t* piece[GEMV_ROWS];
#pragma unroll
        for (int s = 0; s < GEMV_ROWS; s++)
            piece[s] = ring_piece(stage, buf, Q8_PIECE_BYTES, s, q8_src(j, cur, s, nblocks), piece);
        const float* x0 = slot_x(j, row0, 0);         // found once per chunk (x_group_rows divides); row n is
                                                      // x0 + n * x_stride
#pragma unroll(NB == 1 ? 2 : 1)                   // the multi-row bodies are register-bound already
        for (int b = lane >> 3; b < nb; b += 4) {
            float d[GEMV_ROWS], q[GEMV_ROWS][4];       // the slots' weights, decoded once for all rows
#pragma unroll
            for (int s = 0; s < GEMV_ROWS; s++) {
                const uint8_t* blk = piece[s] + b * Q8_BLOCK_BYTES;
                d[s] = __half2float(*reinterpret_cast<const __half*>(blk));
                const uint16_t* q16 = reinterpret_cast<const uint16_t*>(blk + 2 + 4 * sub);
                q8x4_to_float((unsigned)q16[0] | ((unsigned)q16[1] << 16), q[s]);
            }
#pragma unroll
            for (int n = 0; n < NB; n++) {
                if (n >= j.nx) break;
                float4 xv = reinterpret_cast<const float4*>(x0 + (size_t)n * j.x_stride)[(b0 + b) * 8 + sub];
                if (weighted) {
                    const float4 nw = w4[(b0 + b) * 8 + sub];
                    xv.x *= nw.x; xv.y *= nw.y; xv.z *= nw.z; xv.w *= nw.w;
                }
#pragma unroll
                for (int s = 0; s < GEMV_ROWS; s++) {
                    acc[n][s] += d[s] * (q[s][0] * xv.x + q[s][1] * xv.y + q[s][2] * xv.z + q[s][3] * xv.w);
                }
            }
        }
        __syncwarp();                                  // all lanes done reading before the buffer is refilled
        gemv_group_done(j, cur, nchunks, acc, scale);
        cur = nxt;
        buf = buf + 1 == Q8_STAGES ? 0 : buf + 1;
    }
}

// ---- Q4_K, F16 and F32: staged through shared memory, as Q8_0 -----------------------------------------------------
// Each warp streams its slots' row pieces into shared memory with 16-byte cp.async, double-buffered (the next piece
// in flight while this one is decoded; the first issued before pdl_wait): every weight byte is read once, by one
// 16-byte request of consecutive lanes (whole sectors: rows of these types start on 16 bytes and are whole 16-byte
// words, no L2 prefetch of lines a warp only touches). A chunk is GemvStage<T>::PIECES pieces of 8 columns (Q4_K:
// Q4_CHUNK_BLOCKS blocks of 144 bytes; F16: F16_CHUNK_PIECES x 16 bytes; F32: F32_CHUNK_PIECES x 32 bytes), a
// multiple of 32 pieces, so lane `lane` takes the row's pieces v = lane, lane + 32, ... in increasing order across
// chunks as a direct loop over the row would; load_w8 decodes them from the staged copy, dot8, warp_sum4: a row's
// sum depends only on cols.
template <class T> struct GemvStage;
template <> struct GemvStage<__half> {
    static constexpr int PIECES = F16_CHUNK_PIECES;
    __device__ static __forceinline__ size_t bytes(int pieces) { return (size_t)pieces * 16; }
};
template <> struct GemvStage<Q4K> {
    static constexpr int PIECES = 32 * Q4_CHUNK_BLOCKS;
    __device__ static __forceinline__ size_t bytes(int pieces) { return (size_t)(pieces >> 5) * 144; }
};
template <> struct GemvStage<float> {
    static constexpr int PIECES = F32_CHUNK_PIECES;
    __device__ static __forceinline__ size_t bytes(int pieces) { return (size_t)pieces * 32; }
};
static_assert(F16_CHUNK_PIECES % 32 == 0 && F32_CHUNK_PIECES % 32 == 0, "a lane's pieces stay in row order");
#define GEMV_STAGE_PIECE(T) ((int)GemvStage<T>::bytes(GemvStage<T>::PIECES) + 16)
#define GEMV_STAGE_WARP(T) (2 * GEMV_ROWS * GEMV_STAGE_PIECE(T))

// Where slot s of an item starts in global memory (null: the slot has no row).
template <class T>
__device__ __forceinline__ const uint8_t* staged_src(const GemvJob& j, const Q8Item& it, int s, int nvec) {
    int m, row;
    slot_row(j, it.g, s, m, row);
    if (row < 0) return nullptr;
    return reinterpret_cast<const uint8_t*>(JOB_W(j, m)) + GemvStage<T>::bytes(nvec) * row +
           GemvStage<T>::bytes(it.c * GemvStage<T>::PIECES);
}

template <class T>
__device__ __forceinline__ void staged_issue(const GemvJob& j, uint8_t* stage, int buf, const Q8Item& it, int nvec,
                                             int lane) {
    const int nv = min(GemvStage<T>::PIECES, nvec - it.c * GemvStage<T>::PIECES);
#pragma unroll
    for (int s = 0; s < GEMV_ROWS; s++) {
        const uint8_t* src = staged_src<T>(j, it, s, nvec);
        if (src) warp_stage_issue(stage + (buf * GEMV_ROWS + s) * GEMV_STAGE_PIECE(T), src,
                                  (int)GemvStage<T>::bytes(nv), lane);
    }
    cp_async_commit();
}

// T = Q4K (cols % 256 == 0), __half or float (cols % 8 == 0), W and x 16-byte aligned; NB accumulator sets.
template <class T, int NB>
__device__ __forceinline__ void gemv_staged(const GemvJob& j) {
    extern __shared__ __align__(16) uint8_t gemv_stage[];
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int gwarp = blockIdx.x * warps + (threadIdx.x >> 5), nwarps = gridDim.x * warps;
    uint8_t* stage = gemv_stage + (threadIdx.x >> 5) * GEMV_STAGE_WARP(T);
    const int nvec = j.cols >> 3;
    const int nchunks = (nvec + GemvStage<T>::PIECES - 1) / GemvStage<T>::PIECES;
    const GemvItems items = gemv_items<false>(group_count(j), gwarp, nwarps);
    Q8Item cur = items.first;
    const bool any = cur.g < items.end;
    if (any) staged_issue<T>(j, stage, 0, cur, nvec, lane);    // before pdl_wait: weights only
    pdl_wait();
    pdl_launch_dependents();
    float scale[NB];
#pragma unroll
    for (int n = 0; n < NB; n++) scale[n] = (n < j.nx && (j.flags & GEMV_NORM)) ? warp_norm_scale(j, n) : 1.0f;
    const bool weighted = (j.flags & GEMV_NORM) && j.norm_w;
    float acc[NB][GEMV_ROWS];
    acc_zero(acc);
    int buf = 0;
    bool more = any;
    while (more) {
        Q8Item nxt = cur;
        more = q8_next(nchunks, items.end, items.step, nxt);
        if (more) {
            staged_issue<T>(j, stage, buf ^ 1, nxt, nvec, lane);
            cp_async_wait<1>();                        // this item's copies have landed, the next one's fly
        } else {
            cp_async_wait_all();
        }
        __syncwarp();
        int m0, row0;
        slot_row(j, cur.g, 0, m0, row0);
        if (row0 < 0) row0 = 0;
        const int v0 = cur.c * GemvStage<T>::PIECES;   // the chunk's first piece of 8 columns
        const int nv = min(GemvStage<T>::PIECES, nvec - v0);
        const uint8_t* piece[GEMV_ROWS];
#pragma unroll
        for (int s = 0; s < GEMV_ROWS; s++)
            piece[s] = ring_piece(stage, buf, GEMV_STAGE_PIECE(T), s, staged_src<T>(j, cur, s, nvec), piece);
        const float* x0 = slot_x(j, row0, 0);
#pragma unroll 2
        for (int v = lane; v < nv; v += 32) {
            float wf[GEMV_ROWS][8];
#pragma unroll
            for (int s = 0; s < GEMV_ROWS; s++) load_w8(reinterpret_cast<const T*>(piece[s]), v, wf[s]);
#pragma unroll
            for (int n = 0; n < NB; n++) {
                if (n >= j.nx) break;
                float xs[8];
                load_x8(j, x0 + (size_t)n * j.x_stride, v0 + v, weighted, xs);
#pragma unroll
                for (int s = 0; s < GEMV_ROWS; s++) acc[n][s] += dot8(wf[s], xs);
            }
        }
        __syncwarp();                                  // all lanes done reading before the buffer is refilled
        gemv_group_done(j, cur, nchunks, acc, scale);
        cur = nxt;
        buf ^= 1;
    }
}

// ---- Q8_0 with int8 activations (Numerics.act_quant): dp4a, as llama.cpp's mmvq ------------------------------------
// gemv_q8_0_i8[_hc_post | _swiglu][_rows]: the Q8_0 kernels' contracts, ring and row order, but x rounded as the
// reference's act_quant mode rounds it (ds4py.ref.ops.q8_0_round: blocks of 32, d = amax / 127, q = rint(x / d),
// f16(d)), after the RMSNorm prologue when there is one, once per block into shared
// memory behind the weight ring: codes int8 [nx][cols], then scales float [nx][cols / 32]. The RMSNorm in the
// reference's operations (x / sqrt(mean(x^2) + eps) * w, each correctly rounded; only the sum's order differs), so
// fewer values than with rsqrtf land on the other side of a code's half from it. A lane's 4 weights of a
// block against its 4 codes are one dp4a, exact in integers; the lane adds isum * (d_w * d_x) into its row sum
// (fmaf, in block order), then warp_sum4 as the fp32 kernels. So y equals the fp32 product on q8_0_round(x) up to
// fp32 rounding of the sums (tests/test_cu_emu_gemv_i8.py), and a row's bits do not depend on nx (the _rows kernels
// are the single-row arithmetic). x_group_rows must be 0, except in gemv_q8_0_i8_grouped[_rows] (the grouped wo_a:
// each warp's x group quantised into its own shared memory, see gemv_q8_i8's GROUPED).
// Launch: as the Q8_0 kernels, dynamic shared memory warps * Q8_WARP_SMEM + nx * (cols + cols / 8) (ops/gemv.py).

// sqrt(mean(x_n^2) + eps), correctly rounded (the divisor of ds4py.ref.ops.rmsnorm), x_n's sum as warp_norm_scale.
__device__ __forceinline__ float warp_norm_den(const GemvJob& j, int n) {
    const int lane = threadIdx.x & 31;
    const float4* x4 = reinterpret_cast<const float4*>(j.x + (size_t)n * j.x_stride);
    float ss = 0.0f;
    for (int v = lane; v < (j.cols >> 2); v += 32) {
        const float4 a = x4[v];
        ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
    }
    ss = warp_sum(ss);
    return __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)j.cols), j.norm_eps));
}

// RN(a / b) from rb = __frcp_rn(b), b in [2^-30, 2^30] (div_rcp_ok): a first quotient and two residual
// corrections (fmaf: exact residuals), the sequence of the hardware's own div.rn fast path, so the same correctly
// rounded quotient as __fdiv_rn for |a| >= 2^-60 (checked against exact rationals on 80,000 hard cases: quotients
// next to a half-integer, divisors with all-ones mantissas): 5 instructions where __fdiv_rn costs ~15 with its
// range check. A Q8_0 code needs no more: a value below 2^-60 has |a / b| < 2^-30, code 0 either way.
__device__ __forceinline__ bool div_rcp_ok(float b) { return b >= 0x1p-30f && b <= 0x1p30f; }
__device__ __forceinline__ float div_rn_rcp(float a, float b, float rb) {
    float q = __fmul_rn(a, rb);
    float r = fmaf(-b, q, a);
    q = fmaf(r, rb, q);
    r = fmaf(-b, q, a);
    return fmaf(r, rb, q);
}

// x[0 .. 32) RMS-normalised when den > 0 (x / den * w, w the block's norm weights or none).
__device__ __forceinline__ void q8_0_block_load(const float* xb, const float* wb, float den, float v[32]) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float4 a = reinterpret_cast<const float4*>(xb)[i];
        v[4 * i] = a.x; v[4 * i + 1] = a.y; v[4 * i + 2] = a.z; v[4 * i + 3] = a.w;
    }
    if (den > 0.0f) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float4 w = wb ? reinterpret_cast<const float4*>(wb)[i] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
            v[4 * i] = __fmul_rn(__fdiv_rn(v[4 * i], den), w.x);
            v[4 * i + 1] = __fmul_rn(__fdiv_rn(v[4 * i + 1], den), w.y);
            v[4 * i + 2] = __fmul_rn(__fdiv_rn(v[4 * i + 2], den), w.z);
            v[4 * i + 3] = __fmul_rn(__fdiv_rn(v[4 * i + 3], den), w.w);
        }
    }
}

// The 32 codes rint(v / div) packed 4 to a word into q (16-byte aligned): the 1.5 * 2^23 shift rounds to nearest
// even, as rint (|v / div| <= 127 (1 + 2^-23)); the code is the low byte of the sum's bits, 0x4B400000 + code.
// FAST: the quotients by div_rn_rcp, else by __fdiv_rn.
template <bool FAST>
__device__ __forceinline__ void q8_0_codes(const float v[32], float div, int8_t* q) {
    const float rdiv = FAST ? __frcp_rn(div) : 0.0f;
    int packed[8];
#pragma unroll
    for (int w = 0; w < 8; w++) {
        int b[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float t = FAST ? div_rn_rcp(v[4 * w + i], div, rdiv) : __fdiv_rn(v[4 * w + i], div);
            b[i] = __float_as_int(__fadd_rn(t, 12582912.0f));
        }
        packed[w] = (int)__byte_perm(__byte_perm(b[0], b[1], 0x0040u), __byte_perm(b[2], b[3], 0x0040u), 0x5410u);
    }
    int4* q4 = reinterpret_cast<int4*>(q);
    q4[0] = make_int4(packed[0], packed[1], packed[2], packed[3]);
    q4[1] = make_int4(packed[4], packed[5], packed[6], packed[7]);
}

// A block whose scale is outside div_rcp_ok's range (tiny, huge or non-finite values): everything again with
// __fdiv_rn, out of line (rare: it stays out of the quantisation loop's instructions).
__device__ __noinline__ void q8_0_block_slow(const float* xb, const float* wb, float den, float div, int8_t* q) {
    float v[32];
    q8_0_block_load(xb, wb, den, v);
    q8_0_codes<false>(v, div, q);
}

// One Q8_0 block of x (32 values at xb, 16-byte aligned), RMS-normalised first when den > 0, into 32 codes at q
// (16-byte aligned); returns its f16-rounded scale: ds4py.ref.ops.q8_0_round's operations in one lane (d = amax /
// 127, rint of the correctly rounded x / d, f16(d)). No shuffles: a lane quantises a whole block, so the per-block
// work (amax, d, the scale, the indexing) is paid once per 32 values.
__device__ __forceinline__ float q8_0_block_lane(const float* xb, const float* wb, float den, int8_t* q) {
    float v[32];
    q8_0_block_load(xb, wb, den, v);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float d = __fdiv_rn(amax, 127.0f);
    const float div = d > 0.0f ? d : 1.0f;
    if (div_rcp_ok(div))
        q8_0_codes<true>(v, div, q);
    else
        q8_0_block_slow(xb, wb, den, div, q);
    return __half2float(__float2half_rn(d));
}

// x rows [nx][cols] quantised into xq (codes) and xd (scales): one block of 32 per thread, then a barrier.
template <int NB>
__device__ __forceinline__ void gemv_i8_quantise(const GemvJob& j, const float den[NB], int8_t* xq, float* xd) {
    const int nbx = j.cols >> 5, total = j.nx * nbx;
    const float* nw = (j.flags & GEMV_NORM) ? j.norm_w : nullptr;
#pragma unroll 1
    for (int t = threadIdx.x; t < total; t += blockDim.x) {
        const int n = t / nbx, b = t - n * nbx;
        float r = den[0];
#pragma unroll
        for (int m = 1; m < NB; m++) r = n == m ? den[m] : r;           // no runtime index into den
        xd[t] = q8_0_block_lane(j.x + (size_t)n * j.x_stride + 32 * b, nw ? nw + 32 * b : nullptr,
                                (j.flags & GEMV_NORM) ? r : 0.0f, xq + (size_t)n * j.cols + 32 * b);
    }
    __syncthreads();
}

// GROUPED (input groups, x_group_rows > 0; no norm): a warp takes a run of consecutive row groups (not grid-stride)
// and quantises its x group - cols values of each row n - into its own part of shared memory whenever the group
// changes (gemv_i8_quantise_warp), so one quantisation serves the run's rows (the launch sizes the runs:
// ops/gemv.py I8_GROUP_RUN); the whole grouped x (32,768 values at V4 Flash's wo_a) never has to fit. The codes,
// scales and the accumulation order are the ungrouped kernel's, so each group's rows equal gemv_q8_0_i8 on that
// group's x bit for bit.
__device__ __forceinline__ void gemv_i8_quantise_warp(const GemvJob& j, int xgroup, int8_t* xq, float* xd) {
    const int lane = threadIdx.x & 31;
    const int nbx = j.cols >> 5, total = j.nx * nbx;
    __syncwarp();                                      // the previous group's codes are no longer read
#pragma unroll 1
    for (int t = lane; t < total; t += 32) {           // one block of 32 values per lane (q8_0_block_lane)
        const int n = t / nbx, b = t - n * nbx;
        xd[t] = q8_0_block_lane(j.x + (size_t)n * j.x_stride + (size_t)xgroup * j.cols + 32 * b, nullptr, 0.0f,
                                xq + (size_t)n * j.cols + 32 * b);
    }
    __syncwarp();
}

template <int NB, bool GROUPED = false>
__device__ __forceinline__ void gemv_q8_i8(const GemvJob& j) {
    extern __shared__ __align__(16) uint8_t q8_stage[];
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int gwarp = blockIdx.x * warps + (threadIdx.x >> 5), nwarps = gridDim.x * warps;
    uint8_t* stage = q8_stage + (threadIdx.x >> 5) * Q8_WARP_SMEM;
    // x's codes + scales: the block's (all of x), or GROUPED the warp's own (its current x group)
    const int xbytes = (j.nx * (j.cols + (j.cols >> 3)) + 15) & ~15;
    int8_t* xq = reinterpret_cast<int8_t*>(q8_stage + warps * Q8_WARP_SMEM + (GROUPED ? (threadIdx.x >> 5) * xbytes : 0));
    float* xd = reinterpret_cast<float*>(xq + (size_t)j.nx * j.cols);
    const int nblocks = j.cols >> 5;
    const int nchunks = (nblocks + Q8_CHUNK_BLOCKS - 1) / Q8_CHUNK_BLOCKS;
    const GemvItems items = gemv_items<GROUPED>(group_count(j), gwarp, nwarps);
    Q8Item cur = items.first;
    const bool any = cur.g < items.end;
    Q8Item ahead = cur;                                // the ring, as gemv_q8
    bool issuing = any;
    int ibuf = 0;
#pragma unroll
    for (int k = 0; k < Q8_STAGES - 1; k++)            // before pdl_wait: weights only
        q8_ring_issue(j, stage, nblocks, nchunks, items, lane, ahead, issuing, ibuf);
    pdl_wait();
    pdl_launch_dependents();
    if (!GROUPED) {
        float den[NB];
#pragma unroll
        for (int n = 0; n < NB; n++) den[n] = (n < j.nx && (j.flags & GEMV_NORM)) ? warp_norm_den(j, n) : 1.0f;
        gemv_i8_quantise<NB>(j, den, xq, xd);
    }
    const int sub = lane & 7;
    int xgroup = -1;                                   // GROUPED: the x group whose codes are in xq
    float acc[NB][GEMV_ROWS];
    acc_zero(acc);
    int buf = 0;
    bool more = any;
    while (more) {
        Q8Item nxt = cur;
        more = q8_next(nchunks, items.end, items.step, nxt);
        q8_ring_issue(j, stage, nblocks, nchunks, items, lane, ahead, issuing, ibuf);
        cp_async_wait<Q8_STAGES - 1>();
        __syncwarp();
        const int b0 = cur.c * Q8_CHUNK_BLOCKS;
        const int nb = min(Q8_CHUNK_BLOCKS, nblocks - b0);
        const uint8_t* piece[GEMV_ROWS];
#pragma unroll
        for (int s = 0; s < GEMV_ROWS; s++)
            piece[s] = ring_piece(stage, buf, Q8_PIECE_BYTES, s, q8_src(j, cur, s, nblocks), piece);
        if (GROUPED) {
            const int xg = item_x_group(j, cur.g);
            if (xg != xgroup) {
                gemv_i8_quantise_warp(j, xg, xq, xd);
                xgroup = xg;
            }
        }
#pragma unroll(NB == 1 ? 2 : 1)
        for (int b = lane >> 3; b < nb; b += 4) {
            float dw[GEMV_ROWS];
            int wq[GEMV_ROWS];                         // the slots' 4 codes of this lane, raw int8 bytes
#pragma unroll
            for (int s = 0; s < GEMV_ROWS; s++) {
                const uint8_t* blk = piece[s] + b * Q8_BLOCK_BYTES;
                dw[s] = __half2float(*reinterpret_cast<const __half*>(blk));
                const uint16_t* q16 = reinterpret_cast<const uint16_t*>(blk + 2 + 4 * sub);
                wq[s] = (int)((unsigned)q16[0] | ((unsigned)q16[1] << 16));
            }
#pragma unroll
            for (int n = 0; n < NB; n++) {
                if (n >= j.nx) break;
                const int xi = reinterpret_cast<const int*>(xq + (size_t)n * j.cols + 32 * (b0 + b))[sub];
                const float dx = xd[(size_t)n * nblocks + b0 + b];
#pragma unroll
                for (int s = 0; s < GEMV_ROWS; s++) {
                    const int isum = __dp4a(wq[s], xi, 0);
                    // isum exact as a float: |isum| <= 4 * 127 * 128 < 2^22, so 1.5 * 2^23 + isum is exact
                    const float f = __fsub_rn(__int_as_float(0x4B400000 + isum), 12582912.0f);
                    acc[n][s] = fmaf(f, __fmul_rn(dw[s], dx), acc[n][s]);
                }
            }
        }
        __syncwarp();
        gemv_group_done(j, cur, nchunks, acc, nullptr);                 // the norm is in x's codes
        cur = nxt;
        buf = buf + 1 == Q8_STAGES ? 0 : buf + 1;
    }
}

// ---- Q4_K with int8 activations (Numerics.act_quant): dp4a against Q8_K codes -----------------------------------
// gemv_q4_k_i8[_hc_post | _swiglu][_rows]: the Q4_K kernels' contracts and weight ring (gemv_staged<Q4K>'s pieces,
// staged_issue, the first piece issued before pdl_wait, slots and row groups as there), but x rounded as the
// reference's act_quant mode rounds the input of a K-quant product (ds4py.ref.ops.q8_k_round: blocks of 256, the
// signed value of largest magnitude m, iscale = -127 / m, q = rint(x * iscale), d = 1 / iscale, in fp32), after the
// RMSNorm prologue when there is one (warp_norm_den: the reference's operations), once per block into shared memory
// behind the ring: codes int8 [nx][cols], scales float [nx][cols / 256], code sums int [nx][cols / 32].
// The positive amax instead of m gives every code and d negated when m < 0 (MoeActI8's argument), so q * d and every
// dot * d are the same floats. A lane takes one sub-block of 32 weights (one 6-bit scale sc and min mn) per step:
// sum(nibble * code) in 8 dp4a, exact; the sub-block adds d_x * (d * (sc * sum) - dmin * (mn * code sum)) to the
// lane's row sum (fmaf, sub-blocks in increasing order), then warp_sum4 and the epilogue as every GEMV. So y equals
// the fp32 product on q8_k_round(x) up to the fp32 rounding of the sums (tests/test_cu_emu_gemv_i8.py), and a row's
// bits do not depend on nx (the _rows kernels run the single-row arithmetic). Input groups: gemv_q4_k_i8_grouped[_rows].
// Launch: as gemv_q4_k, dynamic shared memory warps * GEMV_STAGE_WARP(Q4K) + nx * (cols + cols / 64 + cols / 8)
// (ops/gemv.py i8_x_bytes).

// x rows [nx][cols] quantised as Q8_K: lane t of a pass takes the 32 values of group t (a 256-block's 8 groups on 8
// consecutive lanes: cols % 256 == 0), the block's amax over its 8 lanes; every lane runs the same passes (the
// shuffles), then a barrier.
// WARP (the grouped kernel): the calling warp alone quantises x group xgroup (x + n * x_stride + xgroup * cols) into
// its own codes, __syncwarp instead of the barrier.
template <int NB, bool WARP = false>
__device__ __forceinline__ void gemv_q8k_quantise(const GemvJob& j, const float den[NB], int8_t* xq, float* xd,
                                                  int* xs, int xgroup = 0) {
    const int lane = threadIdx.x & 31, warp = WARP ? 0 : threadIdx.x >> 5, warps = WARP ? 1 : blockDim.x >> 5;
    const int ngx = j.cols >> 5, total = j.nx * ngx;
    const bool weighted = (j.flags & GEMV_NORM) && j.norm_w;
    if (WARP) __syncwarp();                            // the previous group's codes are no longer read
#pragma unroll 1
    for (int base = 32 * warp; base < total; base += 32 * warps) {        // warp-uniform trip count
        const int t = base + lane;
        const bool live = t < total;                                      // a block's 8 lanes live together
        const int n = live ? t / ngx : 0, gx = live ? t - n * ngx : 0;
        float v[32];
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = 0.0f;
        if (live) {
            const float4* x4 = reinterpret_cast<const float4*>(j.x + (size_t)n * j.x_stride +
                                                               (WARP ? (size_t)xgroup * j.cols : 0)) + 8 * gx;
            float r = den[0];
#pragma unroll
            for (int m = 1; m < NB; m++) r = n == m ? den[m] : r;           // no runtime index into den
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float4 a = x4[i];
                v[4 * i] = a.x; v[4 * i + 1] = a.y; v[4 * i + 2] = a.z; v[4 * i + 3] = a.w;
                if (j.flags & GEMV_NORM) {
                    const float4 w = weighted ? reinterpret_cast<const float4*>(j.norm_w)[8 * gx + i]
                                              : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
                    v[4 * i] = __fmul_rn(__fdiv_rn(v[4 * i], r), w.x);
                    v[4 * i + 1] = __fmul_rn(__fdiv_rn(v[4 * i + 1], r), w.y);
                    v[4 * i + 2] = __fmul_rn(__fdiv_rn(v[4 * i + 2], r), w.z);
                    v[4 * i + 3] = __fmul_rn(__fdiv_rn(v[4 * i + 3], r), w.w);
                }
            }
        }
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(DS4_FULL_MASK, amax, off));
        if (!live) continue;
        const float is = amax != 0.0f ? __fdiv_rn(-127.0f, amax) : 0.0f;
        // rint(x * is) by the 1.5 * 2^23 shift (round to nearest even; |x * is| <= 127 (1 + 2^-23)^2, so the
        // reference's clip at 127 never cuts): the code is the low byte of the sum's bits, 0x4B400000 + code
        int packed[8], sum = 0;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            int b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                b[i] = __float_as_int(__fadd_rn(__fmul_rn(v[4 * w + i], is), 12582912.0f));
                sum += b[i] - 0x4B400000;
            }
            packed[w] = (int)__byte_perm(__byte_perm(b[0], b[1], 0x0040u), __byte_perm(b[2], b[3], 0x0040u), 0x5410u);
        }
        int4* q4 = reinterpret_cast<int4*>(xq + (size_t)n * j.cols + 32 * gx);
        q4[0] = make_int4(packed[0], packed[1], packed[2], packed[3]);
        q4[1] = make_int4(packed[4], packed[5], packed[6], packed[7]);
        xs[t] = sum;
        if ((lane & 7) == 0) xd[(size_t)n * (j.cols >> 8) + (gx >> 3)] = is != 0.0f ? __fdiv_rn(1.0f, is) : 0.0f;
    }
    if (WARP)
        __syncwarp();
    else
        __syncthreads();
}

// An int below 2^22 in magnitude as a float, exactly: 1.5 * 2^23 + v in the mantissa, less 1.5 * 2^23 (full-rate
// integer and fp32 ops instead of I2F).
__device__ __forceinline__ float i22_to_float(int v) {
    return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.0f);
}

// GROUPED (input groups, x_group_rows > 0, no norm; gemv_q4_k_i8_grouped): as gemv_q8_i8's GROUPED, a warp takes a
// run of consecutive row groups and quantises its x group (Q8_K, gemv_q8k_quantise<WARP>) into its own shared
// memory whenever the group changes, so each group's rows = gemv_q4_k_i8 on that group's x bit for bit.
template <int NB, bool GROUPED = false>
__device__ __forceinline__ void gemv_q4k_i8(const GemvJob& j) {
    extern __shared__ __align__(16) uint8_t gemv_stage[];
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int gwarp = blockIdx.x * warps + (threadIdx.x >> 5), nwarps = gridDim.x * warps;
    uint8_t* stage = gemv_stage + (threadIdx.x >> 5) * GEMV_STAGE_WARP(Q4K);
    const int ngx = j.cols >> 5, nbx = j.cols >> 8;
    // x's codes + scales + code sums: the block's (all of x), or GROUPED the warp's own (its current x group)
    const int xbytes = (j.nx * (j.cols + (j.cols >> 6) + (j.cols >> 3)) + 15) & ~15;
    int8_t* xq = reinterpret_cast<int8_t*>(gemv_stage + warps * GEMV_STAGE_WARP(Q4K) +
                                           (GROUPED ? (threadIdx.x >> 5) * xbytes : 0));
    float* xd = reinterpret_cast<float*>(xq + (size_t)j.nx * j.cols);
    int* xs = reinterpret_cast<int*>(xd + (size_t)j.nx * nbx);
    const int nvec = j.cols >> 3;
    const int nchunks = (nvec + GemvStage<Q4K>::PIECES - 1) / GemvStage<Q4K>::PIECES;
    const GemvItems items = gemv_items<GROUPED>(group_count(j), gwarp, nwarps);
    Q8Item cur = items.first;
    const bool any = cur.g < items.end;
    if (any) staged_issue<Q4K>(j, stage, 0, cur, nvec, lane);  // before pdl_wait: weights only
    pdl_wait();
    pdl_launch_dependents();
    float den[NB];
#pragma unroll
    for (int n = 0; n < NB; n++) den[n] = (n < j.nx && (j.flags & GEMV_NORM)) ? warp_norm_den(j, n) : 1.0f;
    if (!GROUPED) gemv_q8k_quantise<NB>(j, den, xq, xd, xs);
    int xgroup = -1;                                   // GROUPED: the x group whose codes are in xq
    // the lane's sub-block within a 256-block is fixed (lane & 7: the pieces hold whole blocks, 8 groups each)
    const int gi = lane & 7, sh = 4 * (gi & 1), sh8 = 8 * (gi & 3), qoff = 16 + 32 * (gi >> 1);
    float acc[NB][GEMV_ROWS];
    acc_zero(acc);
    int buf = 0;
    bool more = any;
    while (more) {
        Q8Item nxt = cur;
        more = q8_next(nchunks, items.end, items.step, nxt);
        if (more) staged_issue<Q4K>(j, stage, buf ^ 1, nxt, nvec, lane);
        if (GROUPED) {
            const int xg = item_x_group(j, cur.g);
            if (xg != xgroup) {                        // quantised while this item's and the next one's copies fly
                gemv_q8k_quantise<NB, true>(j, den, xq, xd, xs, xg);
                xgroup = xg;
            }
        }
        if (more)
            cp_async_wait<1>();                        // this item's copies have landed, the next one's fly
        else
            cp_async_wait_all();
        __syncwarp();
        const int g0 = cur.c * (GemvStage<Q4K>::PIECES >> 2);     // the chunk's first group of 32 columns
        const int ng = min(GemvStage<Q4K>::PIECES >> 2, ngx - g0);
        const uint8_t* piece[GEMV_ROWS];
#pragma unroll
        for (int s = 0; s < GEMV_ROWS; s++)
            piece[s] = ring_piece(stage, buf, GEMV_STAGE_PIECE(Q4K), s, staged_src<Q4K>(j, cur, s, nvec), piece);
        for (int v = lane; v < ng; v += 32) {
            const int boff = (v >> 3) * 144;
            float dw[GEMV_ROWS], dm[GEMV_ROWS];
            int sc[GEMV_ROWS], mn[GEMV_ROWS], wq[GEMV_ROWS][8];
#pragma unroll
            for (int s = 0; s < GEMV_ROWS; s++) {
                const uint8_t* b = piece[s] + boff;
                const uint2 h0 = *reinterpret_cast<const uint2*>(b), h1 = *reinterpret_cast<const uint2*>(b + 8);
                const unsigned a = h0.y >> sh8, c = h1.x >> sh8, e = h1.y >> sh8;
                sc[s] = (int)(gi < 4 ? a & 63u : (e & 15u) | ((a >> 6) & 3u) << 4);
                mn[s] = (int)(gi < 4 ? c & 63u : ((e >> 4) & 15u) | ((c >> 6) & 3u) << 4);
                dw[s] = __half2float(__ushort_as_half((unsigned short)(h0.x & 0xffffu)));
                dm[s] = __half2float(__ushort_as_half((unsigned short)(h0.x >> 16)));
                const uint4 q0 = *reinterpret_cast<const uint4*>(b + qoff);
                const uint4 q1 = *reinterpret_cast<const uint4*>(b + qoff + 16);
                wq[s][0] = (int)((q0.x >> sh) & 0x0F0F0F0Fu); wq[s][1] = (int)((q0.y >> sh) & 0x0F0F0F0Fu);
                wq[s][2] = (int)((q0.z >> sh) & 0x0F0F0F0Fu); wq[s][3] = (int)((q0.w >> sh) & 0x0F0F0F0Fu);
                wq[s][4] = (int)((q1.x >> sh) & 0x0F0F0F0Fu); wq[s][5] = (int)((q1.y >> sh) & 0x0F0F0F0Fu);
                wq[s][6] = (int)((q1.z >> sh) & 0x0F0F0F0Fu); wq[s][7] = (int)((q1.w >> sh) & 0x0F0F0F0Fu);
            }
#pragma unroll
            for (int n = 0; n < NB; n++) {
                if (n >= j.nx) break;
                const int gx = g0 + v;
                const int4* x4 = reinterpret_cast<const int4*>(xq + (size_t)n * j.cols + 32 * gx);
                const int4 xa = x4[0], xb = x4[1];
                const float dx = xd[(size_t)n * nbx + (gx >> 3)];
                const int xsum = xs[n * ngx + gx];
#pragma unroll
                for (int s = 0; s < GEMV_ROWS; s++) {
                    int isum = __dp4a(wq[s][0], xa.x, 0);
                    isum = __dp4a(wq[s][1], xa.y, isum); isum = __dp4a(wq[s][2], xa.z, isum);
                    isum = __dp4a(wq[s][3], xa.w, isum); isum = __dp4a(wq[s][4], xb.x, isum);
                    isum = __dp4a(wq[s][5], xb.y, isum); isum = __dp4a(wq[s][6], xb.z, isum);
                    isum = __dp4a(wq[s][7], xb.w, isum);
                    // |sc * isum| <= 63 * 15 * 127 * 32 < 2^22 and |mn * code sum| <= 63 * 127 * 32: exact floats
                    const float t = __fsub_rn(__fmul_rn(dw[s], i22_to_float(sc[s] * isum)),
                                              __fmul_rn(dm[s], i22_to_float(mn[s] * xsum)));
                    acc[n][s] = fmaf(t, dx, acc[n][s]);
                }
            }
        }
        __syncwarp();                                  // all lanes done reading before the buffer is refilled
        gemv_group_done(j, cur, nchunks, acc, nullptr);                 // the norm is in x's codes
        cur = nxt;
        buf ^= 1;
    }
}

// ---- entry points: gemv_<format>[_hc_post | _swiglu][_rows], one of each per entry of GEMV_FORMATS --------------
// X(name, W's element type, ring): the kernels named gemv_<name>... run ring<NB>(j), the format's body above, with
// NB = 1, or GEMV_MAX_X in the _rows twins (nx <= GEMV_MAX_X activation rows x + n * x_stride, see the top of the
// file; y / X / mix advance by one row's worth per n; same launch geometry and shared memory).
//   q8_0: cols % 32 == 0, W 2-byte aligned.
//   f16, f32: cols % 8 == 0, W and x 16-byte aligned.
//   q4_k: cols % 256 == 0, W 16-byte aligned.
//   q8_0_i8, q4_k_i8: as q8_0, q4_k with int8 activations (x_group_rows 0; input groups: GEMV_GROUPED_FORMATS).
// Dynamic shared memory: warps x the format's ring per warp (ops/gemv.py WARP_SMEM: Q8_0 13,248 B at 3 stages,
// F16 / F32 8,320 B, Q4_K 9,344 B), + for the int8 formats the block's x codes after the rings: nx * (cols +
// cols / 8) (Q8_0) or nx * (cols + cols / 64 + cols / 8) (Q4_K) rounded up to 16 (ops/gemv.py i8_x_bytes).
template <int NB> __device__ __forceinline__ void gemv_f16_ring(const GemvJob& j) { gemv_staged<__half, NB>(j); }
template <int NB> __device__ __forceinline__ void gemv_f32_ring(const GemvJob& j) { gemv_staged<float, NB>(j); }
template <int NB> __device__ __forceinline__ void gemv_q4k_ring(const GemvJob& j) { gemv_staged<Q4K, NB>(j); }
#define GEMV_FORMATS(X) \
    X(q8_0, uint8_t, gemv_q8) \
    X(f16, __half, gemv_f16_ring) \
    X(f32, float, gemv_f32_ring) \
    X(q4_k, uint8_t, gemv_q4k_ring) \
    X(q8_0_i8, uint8_t, gemv_q8_i8) \
    X(q4_k_i8, uint8_t, gemv_q4k_i8)
#define GEMV_GROUPED_FORMATS(X) \
    X(q8_0_i8, uint8_t, gemv_q8_i8) \
    X(q4_k_i8, uint8_t, gemv_q4k_i8)

#define GEMV_JOB(W0, W1, W2, W3, r0, r1, r2, r3, y0, y1, y2, y3)                                                     \
    GemvJob j;                                                                                                     \
    j.W[0] = W0; j.W[1] = W1; j.W[2] = W2; j.W[3] = W3;                                                            \
    j.rows[0] = r0; j.rows[1] = r1; j.rows[2] = r2; j.rows[3] = r3;                                                \
    j.y[0] = y0; j.y[1] = y1; j.y[2] = y2; j.y[3] = y3;                                                            \
    j.nmat = W3 ? 4 : W2 ? 3 : W1 ? 2 : 1;                                                                          \
    j.x = x; j.nx = 1; j.x_stride = 0; j.cols = cols; j.x_group_rows = x_group_rows;                             \
    j.norm_w = norm_w; j.norm_eps = norm_eps;                                                                      \
    j.flags = flags; j.epi = EPI_STORE; j.mix = nullptr; j.hc_x = nullptr; j.clamp = 0.0f;

// The job of the hc_post and SwiGLU kernels (one matrix; two, gate and up, sharing x).
#define GEMV_HC_POST_JOB \
    GEMV_JOB(W, nullptr, nullptr, nullptr, rows, 0, 0, 0, nullptr, nullptr, nullptr, nullptr) \
    j.epi = EPI_HC_POST; j.mix = mix; j.hc_x = X;
#define GEMV_SWIGLU_JOB \
    const int x_group_rows = 0; \
    GEMV_JOB(Wg, Wu, nullptr, nullptr, rows, rows, 0, 0, y, nullptr, nullptr, nullptr) \
    j.epi = EPI_SWIGLU; j.clamp = clamp;

// Plain: y_m = W_m x (+= with GEMV_ADD) for up to 4 matrices W_m [rows_m, cols] sharing x (unused W_m null).
// x_group_rows: a multiple of 4, or 0. Launch: block (32*warps), grid (any; ops/gemv.py picks min(groups / warps,
// what fits the SMs)), dynamic shared memory as GEMV_FORMATS says.
#define GEMV_PLAIN(name, WT, ring) \
extern "C" __global__ void gemv_##name(const WT* W0, const WT* W1, const WT* W2, const WT* W3, int rows0, int rows1, \
                                       int rows2, int rows3, float* y0, float* y1, float* y2, float* y3, \
                                       const float* x, int cols, int x_group_rows, const float* norm_w, \
                                       float norm_eps, int flags) { \
    GEMV_JOB(W0, W1, W2, W3, rows0, rows1, rows2, rows3, y0, y1, y2, y3) \
    ring<1>(j); \
}

// The plain kernel for nx activation rows. Launch: as the plain kernel.
#define GEMV_PLAIN_ROWS(name, WT, ring) \
extern "C" __global__ void gemv_##name##_rows(const WT* W0, const WT* W1, const WT* W2, const WT* W3, int rows0, \
                                              int rows1, int rows2, int rows3, float* y0, float* y1, float* y2, \
                                              float* y3, const float* x, int cols, int x_group_rows, \
                                              const float* norm_w, float norm_eps, int flags, int nx, int x_stride) { \
    GEMV_JOB(W0, W1, W2, W3, rows0, rows1, rows2, rows3, y0, y1, y2, y3) \
    j.nx = nx; j.x_stride = x_stride; \
    ring<GEMV_MAX_X>(j); \
}

// hc_post epilogue: f = W x (W [D, cols]), then X'_k[r] = post_k f[r] + sum_j C[j,k] X_j[r] in place, with
// mix = [pre, post, comb] of this sub-layer (hc_mix_*) and X [DS4_HC, D]. Launch: as the plain kernel.
#define GEMV_HC_POST(name, WT, ring) \
extern "C" __global__ void gemv_##name##_hc_post(const WT* W, int rows, const float* x, int cols, int x_group_rows, \
                                                 const float* norm_w, float norm_eps, int flags, const float* mix, \
                                                 float* X) { \
    GEMV_HC_POST_JOB \
    ring<1>(j); \
}

// The hc_post kernel for nx activation rows (X + n * DS4_HC * D, mix + n * (2 + DS4_HC) * DS4_HC). Launch: as the
// plain kernel.
#define GEMV_HC_POST_ROWS(name, WT, ring) \
extern "C" __global__ void gemv_##name##_hc_post_rows(const WT* W, int rows, const float* x, int cols, \
                                                      int x_group_rows, const float* norm_w, float norm_eps, \
                                                      int flags, const float* mix, float* X, int nx, int x_stride) { \
    GEMV_HC_POST_JOB \
    j.nx = nx; j.x_stride = x_stride; \
    ring<GEMV_MAX_X>(j); \
}

// SwiGLU epilogue: y[r] = silu(min(g[r], c)) * clamp(u[r], -c, c) with g = Wg x, u = Wu x (both [rows, cols]);
// clamp <= 0 turns the clamp off. Launch: as the plain kernel.
#define GEMV_SWIGLU(name, WT, ring) \
extern "C" __global__ void gemv_##name##_swiglu(const WT* Wg, const WT* Wu, int rows, float* y, const float* x, \
                                                int cols, const float* norm_w, float norm_eps, int flags, \
                                                float clamp) { \
    GEMV_SWIGLU_JOB \
    ring<1>(j); \
}

// The SwiGLU kernel for nx activation rows. Launch: as the plain kernel.
#define GEMV_SWIGLU_ROWS(name, WT, ring) \
extern "C" __global__ void gemv_##name##_swiglu_rows(const WT* Wg, const WT* Wu, int rows, float* y, const float* x, \
                                                     int cols, const float* norm_w, float norm_eps, int flags, \
                                                     float clamp, int nx, int x_stride) { \
    GEMV_SWIGLU_JOB \
    j.nx = nx; j.x_stride = x_stride; \
    ring<GEMV_MAX_X>(j); \
}

// The plain int8 kernel with input groups (x_group_rows > 0, no norm): a warp's runs of row groups, its x group
// quantised into its own shared memory (the ring's GROUPED), so each group's rows = the plain int8 kernel on
// x[g*cols:] bit for bit (V4.1 Flash's grouped wo_a under act_quant). Launch: as the plain kernel, dynamic shared
// memory warps * (the ring per warp + the x codes, i8_x_bytes) (ops/gemv.py).
#define GEMV_GROUPED(name, WT, ring) \
extern "C" __global__ void gemv_##name##_grouped(const WT* W0, const WT* W1, const WT* W2, const WT* W3, int rows0, \
                                                 int rows1, int rows2, int rows3, float* y0, float* y1, float* y2, \
                                                 float* y3, const float* x, int cols, int x_group_rows, \
                                                 const float* norm_w, float norm_eps, int flags) { \
    GEMV_JOB(W0, W1, W2, W3, rows0, rows1, rows2, rows3, y0, y1, y2, y3) \
    ring<1, true>(j); \
}

// The grouped kernel for nx activation rows x + n * x_stride (a multi-row step's wo_a). Launch: as it.
#define GEMV_GROUPED_ROWS(name, WT, ring) \
extern "C" __global__ void gemv_##name##_grouped_rows(const WT* W0, const WT* W1, const WT* W2, const WT* W3, \
                                                      int rows0, int rows1, int rows2, int rows3, float* y0, \
                                                      float* y1, float* y2, float* y3, const float* x, int cols, \
                                                      int x_group_rows, const float* norm_w, float norm_eps, \
                                                      int flags, int nx, int x_stride) { \
    GEMV_JOB(W0, W1, W2, W3, rows0, rows1, rows2, rows3, y0, y1, y2, y3) \
    j.nx = nx; j.x_stride = x_stride; \
    ring<GEMV_MAX_X, true>(j); \
}

GEMV_FORMATS(GEMV_PLAIN)
GEMV_FORMATS(GEMV_PLAIN_ROWS)
GEMV_FORMATS(GEMV_HC_POST)
GEMV_FORMATS(GEMV_HC_POST_ROWS)
GEMV_FORMATS(GEMV_SWIGLU)
GEMV_FORMATS(GEMV_SWIGLU_ROWS)
GEMV_GROUPED_FORMATS(GEMV_GROUPED)
GEMV_GROUPED_FORMATS(GEMV_GROUPED_ROWS)
