// Prefill GEMM on tensor cores: Y[T x N] = X[T x K] . W^T (or Y +=), for a block of T tokens (up to a few
// thousand) and a dense weight W [N rows, K] straight from the GGUF (Q8_0, F16, F32, Q4_K), fp32 activations in and
// fp32 results out. The decode path's GEMV is gemv.cu.
//
// Numerics. Activations are rounded to bf16 (round to nearest even) when staged; the weights stay exact:
//   Q8_0  the int8 codes q are bf16 integers (exact); each 32-column block's partial sum P = sum_k x_k q_k is
//         accumulated by the tensor cores in fp32 from zero, then acc += d * P (fp32) - one scale per block and row;
//   F16   w = hi + lo with hi = bf16(w), lo = bf16(w - hi) (exact: the remainder has at most 4 significant bits);
//         two mma per step into the same accumulators;
//   F32   w = hi + mid + lo, three bf16 pieces (exact for normal values), three mma per step;
//   Q4_K  the exact fp32 values q * fl(d * sc) - fl(dmin * m) of ds4py.quant's decode, as F32.
// So the product differs from an exact one only by the bf16 rounding of x (relative 2^-9 per element) and fp32
// accumulation; with GEMM_X_SPLIT x goes in as hi = bf16(x) plus lo = bf16(x - hi) (relative 2^-17, for the
// matrices whose outputs are compared or selected on - the router), at twice the tensor work.
// ds4py/cuda/twins/gemm.py is that model in float64.
//
// Tiles. A block computes GEMM_BM tokens x GEMM_BN output features (8 warps, 2 x 4, each 32 x 32: 2 x 4 mma tiles);
// K is walked in GEMM_BK = 32 column tiles in increasing order - the same order for every T, grid or tile
// position, so an output row's bits depend only on its own x row and W (not on T, nor on which rows share its
// tile: batch invariant). The next k-tile's raw bytes are loaded while the current one is multiplied (F16 / F32
// into registers, Q8_0 / Q4_K into a per-row ring of sectors in shared memory: GemmRing), then converted to bf16
// into shared memory; no split-K.
//
// Input groups (x_group_rows > 0: the grouped wo_a): output features [g*x_group_rows, (g+1)*x_group_rows) read x
// columns [g*K, (g+1)*K) of each row (X is [T, groups*K], ldx apart); grid.z = groups.
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"
#include "mma_tile.cuh"
#include "moe_formats.cuh"

#ifndef GEMM_BM
#error "GEMM_BM comes from ds4py/cuda/ops/gemm.py (DEFINES)"
#endif
#ifndef GEMM_BN
#error "GEMM_BN comes from ds4py/cuda/ops/gemm.py (DEFINES)"
#endif
#ifndef GEMM_WARPS_M
#error "GEMM_WARPS_M comes from ds4py/cuda/ops/gemm.py (DEFINES)"
#endif
#ifndef GEMM_WARPS_N
#error "GEMM_WARPS_N comes from ds4py/cuda/ops/gemm.py (DEFINES)"
#endif

#define GEMM_BK 32
#define GEMM_LDS (GEMM_BK + 8)
#define GEMM_THREADS (32 * GEMM_WARPS_M * GEMM_WARPS_N)
#define GEMM_Q8_BYTES 34

constexpr int GEMM_WM = GEMM_BM / GEMM_WARPS_M, GEMM_WN = GEMM_BN / GEMM_WARPS_N;
constexpr int GEMM_MT = GEMM_WM / 16, GEMM_NT = GEMM_WN / 8;
static_assert(GEMM_MT * 16 * GEMM_WARPS_M == GEMM_BM && GEMM_NT * 8 * GEMM_WARPS_N == GEMM_BN, "warp tiles");
static_assert(GEMM_BM * 4 == GEMM_THREADS, "each thread stages 8 x values of one row per k-tile");
static_assert(GEMM_BN * 2 == GEMM_THREADS, "each thread stages 16 weights of one row per k-tile");

#define GEMM_ACCUMULATE 1   // flags: Y += instead of Y =
#define GEMM_X_SPLIT 2      // flags: x as two bf16 pieces (hi + lo: ~16 significant bits), twice the tensor work

#define GEMM_FMT_Q8_0 0
#define GEMM_FMT_F16 1
#define GEMM_FMT_F32 2
#define GEMM_FMT_Q4_K 3
#define GEMM_Q4K_BYTES 144

// The weight formats: Raw = one thread's 16 weights of one row for one k-tile (loaded into registers ahead; the
// row's two threads are half = 0, 1), stage() writes them at their columns of the row's shared tile as bf16 pieces
// (and, Q8_0, the row's block scale).
template <int F> struct GemmFmt;

template <> struct GemmFmt<GEMM_FMT_F16> {
    static constexpr int NP = 2;
    static constexpr bool SCALED = false;
    struct Raw { uint4 v[2]; };
    // Load i of the row's two threads takes 16-byte pieces 2i and 2i + 1 of the row's 64 bytes: each warp request
    // reads whole 32-byte sectors (16 rows x 32 contiguous bytes) instead of half of 32.
    __device__ static __forceinline__ void load(const void* W, int n, int ncols, int K, int k, int half, Raw& r) {
        const __half* row = reinterpret_cast<const __half*>(W) + (size_t)n * K;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int c = k + 8 * (2 * i + half);
            r.v[i] = (n < ncols && c < K) ? *reinterpret_cast<const uint4*>(row + c) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
    __device__ static __forceinline__ void stage(const Raw& r, uint16_t* row, int half, int piece, float*) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const __half2* h = reinterpret_cast<const __half2*>(&r.v[i]);
            float v[8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float2 f = __half22float2(h[j]);
                v[2 * j] = f.x;
                v[2 * j + 1] = f.y;
            }
            tile_split8<NP>(v, row + 8 * (2 * i + half), piece);
        }
    }
};

template <> struct GemmFmt<GEMM_FMT_F32> {
    static constexpr int NP = 3;
    static constexpr bool SCALED = false;
    struct Raw { float4 v[4]; };
    // Load i of the row's two threads takes 16-byte pieces 2i and 2i + 1 of the row's 128 bytes (whole sectors per
    // warp request, as F16); the pieces are staged as 4 values each.
    __device__ static __forceinline__ void load(const void* W, int n, int ncols, int K, int k, int half, Raw& r) {
        const float* row = reinterpret_cast<const float*>(W) + (size_t)n * K;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int c = k + 4 * (2 * i + half);
            r.v[i] = (n < ncols && c < K) ? *reinterpret_cast<const float4*>(row + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    __device__ static __forceinline__ void stage(const Raw& r, uint16_t* row, int half, int piece, float*) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float v[4] = {r.v[i].x, r.v[i].y, r.v[i].z, r.v[i].w};
            tile_split4<NP>(v, row + 4 * (2 * i + half), piece);
        }
    }
};

// Q8_0: 34-byte blocks (f16 d, 32 int8 q), rows 2-byte aligned: 16-bit loads. k is a multiple of 16 here: this
// thread's half of block k / 32.
template <> struct GemmFmt<GEMM_FMT_Q8_0> {
    static constexpr int NP = 1;
    static constexpr bool SCALED = true;
    struct Raw { unsigned q[8]; unsigned d; };
    __device__ static __forceinline__ void load(const void* W, int n, int ncols, int K, int kt, int half, Raw& r) {
        const int k = kt + 16 * half;
        if (n >= ncols) {
#pragma unroll
            for (int i = 0; i < 8; i++) r.q[i] = 0u;
            r.d = 0u;
            return;
        }
        const uint8_t* b = reinterpret_cast<const uint8_t*>(W) + ((size_t)n * (K / 32) + k / 32) * GEMM_Q8_BYTES;
        const uint16_t* q = reinterpret_cast<const uint16_t*>(b + 2 + (k & 16));
#pragma unroll
        for (int i = 0; i < 8; i++) r.q[i] = q[i];
        r.d = *reinterpret_cast<const uint16_t*>(b);
    }
    __device__ static __forceinline__ void stage(const Raw& r, uint16_t* row, int half, int, float* scale) {
        uint16_t* dst = row + 16 * half;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const unsigned w = r.q[4 * i + j];
                v[2 * j] = (float)(int8_t)(w & 255u);           // |q| <= 128: exact in bf16
                v[2 * j + 1] = (float)(int8_t)(w >> 8);
            }
            tile_store8(dst + 8 * i, v);
        }
        if (half == 0) *scale = __half2float(__ushort_as_half((unsigned short)r.d));
    }
};

// Q4_K: 144-byte blocks of 256 columns (moe_formats.cuh). A thread's 16 weights are half of one 32-column
// sub-block: 16 nibble bytes (one 16-byte load) and the sub-block's scale and min. Staged as their exact fp32 values
// (q * fl(d * sc) - fl(dmin * m), as ds4py.quant decodes them) in three bf16 pieces, as F32.
template <> struct GemmFmt<GEMM_FMT_Q4_K> {
    static constexpr int NP = 3;
    static constexpr bool SCALED = false;
    struct Raw { uint4 q; float dl, ml; int sh; };
    __device__ static __forceinline__ void load(const void* W, int n, int ncols, int K, int kt, int half, Raw& r) {
        const int k = kt + 16 * half;
        if (n >= ncols) {
            r.q = make_uint4(0u, 0u, 0u, 0u);
            r.dl = r.ml = 0.0f;
            r.sh = 0;
            return;
        }
        const uint8_t* b = reinterpret_cast<const uint8_t*>(W) + ((size_t)n * (K / 256) + k / 256) * GEMM_Q4K_BYTES;
        const int gi = (k >> 5) & 7;
        unsigned sc, mn;
        MoeFmt<FMT_Q4_K>::scales(b, gi, sc, mn);
        r.dl = __fmul_rn(moe_f16(b), moe_u2f(sc));
        r.ml = __fmul_rn(moe_f16(b + 2), moe_u2f(mn));
        r.sh = 4 * (gi & 1);
        r.q = *reinterpret_cast<const uint4*>(b + 16 + 32 * (gi >> 1) + (k & 16));
    }
    __device__ static __forceinline__ void stage(const Raw& r, uint16_t* row, int half, int piece, float*) {
        uint16_t* dst = row + 16 * half;
        const unsigned w[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const unsigned q = (w[2 * i + (j >> 2)] >> (8 * (j & 3) + r.sh)) & 15u;
                v[j] = __fsub_rn(__fmul_rn(moe_u2f(q), r.dl), r.ml);
            }
            tile_split8<NP>(v, dst + 8 * i, piece);
        }
    }
};

// Q8_0 and Q4_K weights through shared memory. Loaded straight from the row, a k-tile's bytes (Q8_0: one 34-byte
// block; Q4_K: a 144-byte block's 32 quant bytes and its 16-byte header) sit across sector boundaries: a warp
// request of 16 rows reads 2-3 sectors per row for 34 bytes (Q8_0: 8% of the sectors' bytes used, 20% for Q4_K,
// whose headers every k-tile read again). Instead each row's bytes are copied into a ring of GEMM_RING 32-byte
// sectors (the row's two threads take the two 16-byte halves of a sector, so a warp request reads 16 whole
// sectors), in order, each byte once per block; a k-tile's words are then read from the ring (the same 16-bit words
// as the direct loads: the same Raw, the same bits). Sectors are counted in v = a + byte position, a = the row's
// start within its 32-byte sector, so the copies follow the device's sectors. 16-byte cp.async when the rows are
// 16-byte aligned (Q8_0: K % 256 == 0 and W 16-byte aligned: every model shape; Q4_K: always), 16-bit copies
// otherwise. A k-tile's bytes lie in at most 2 sectors (Q8_0: 34 bytes from an even offset; Q4_K: 32 quant bytes,
// or at a block's first k-tile the header too, from a 16-byte boundary), so a ring of 2 is enough when k-tile
// kt + 1's sectors are copied after every thread has staged kt (while the tensor cores multiply kt); Q4_K reads
// its header into registers at a block's first k-tile. 2 sectors per row keep 2 blocks per SM on GB10 (Q4_K's
// ring is dynamic shared memory: 40,960 static + 8,192).
#define GEMM_RING 2
template <int F>
struct GemmRing {
    static constexpr int LD = F == GEMM_FMT_Q8_0 ? GEMM_RING * 32 + 16 : GEMM_RING * 32;   // row stride (Q8_0
                                         // padded: fewer bank conflicts; Q4_K's must fit GB10's 2 blocks)
    const uint8_t* row;                  // the row's first byte; null: a row past ncols (nothing copied, zeros)
    uint8_t* ring;                       // the row's ring in shared memory
    int a, bytes, next;                  // start within its sector, row bytes, first sector not yet copied
    bool fast;                           // 16-byte cp.async copies
    unsigned hdr[4];                     // Q4_K: the current block's header (d, dmin, 12 scale bytes)
    __device__ __forceinline__ int last_byte(int kt) const {
        if constexpr (F == GEMM_FMT_Q8_0) return kt * GEMM_Q8_BYTES + GEMM_Q8_BYTES - 1;
        else return (kt >> 3) * GEMM_Q4K_BYTES + 16 + 32 * ((kt & 7) >> 1) + 31;
    }
    // copy half h of the sectors up to k-tile kt's last (this thread's share of the row)
    __device__ __forceinline__ void fetch(int kt, int h) {
        if (row == nullptr) return;
        const int upto = (a + last_byte(kt)) >> 5;
        for (; next <= upto; next++) {
            const int p0 = 32 * next + 16 * h - a;
            uint8_t* dst = ring + (next % GEMM_RING) * 32 + 16 * h;
            if (fast) {
                if (p0 >= 0 && p0 < bytes) cp_async_16(dst, row + p0);
            } else {
#pragma unroll
                for (int w = 0; w < 8; w++) {
                    const int p = p0 + 2 * w;
                    if (p >= 0 && p < bytes)
                        *reinterpret_cast<uint16_t*>(dst + 2 * w) = *reinterpret_cast<const uint16_t*>(row + p);
                }
            }
        }
    }
    __device__ __forceinline__ unsigned word(int p) const {     // the 16-bit word at row byte p (p even)
        const int v = a + p;
        return *reinterpret_cast<const uint16_t*>(ring + ((v >> 5) % GEMM_RING) * 32 + (v & 31));
    }
    __device__ __forceinline__ unsigned word32(int p) const { return word(p) | (word(p + 2) << 16); }
    __device__ __forceinline__ unsigned hbyte(int i) const {    // byte i of the Q4_K header
        const unsigned w = i < 4 ? hdr[0] : i < 8 ? hdr[1] : i < 12 ? hdr[2] : hdr[3];
        return (w >> (8 * (i & 3))) & 255u;
    }
    // half h of k-tile kt as GemmFmt<F>::load reads it from global memory
    __device__ __forceinline__ void read(int kt, int h, typename GemmFmt<F>::Raw& r) {
        if constexpr (F == GEMM_FMT_Q8_0) {
            if (row == nullptr) {
#pragma unroll
                for (int i = 0; i < 8; i++) r.q[i] = 0u;
                r.d = 0u;
                return;
            }
            const int p = kt * GEMM_Q8_BYTES;
#pragma unroll
            for (int i = 0; i < 8; i++) r.q[i] = word(p + 2 + 16 * h + 2 * i);
            r.d = word(p);
        } else {
            if (row == nullptr) {
                r.q = make_uint4(0u, 0u, 0u, 0u);
                r.dl = r.ml = 0.0f;
                r.sh = 0;
                return;
            }
            const int b = (kt >> 3) * GEMM_Q4K_BYTES, gi = kt & 7;
            if (gi == 0)
#pragma unroll
                for (int i = 0; i < 4; i++) hdr[i] = word32(b + 4 * i);
            unsigned sc, mn;                                    // MoeFmt<FMT_Q4_K>::scales on the header's bytes
            if (gi < 4) {
                sc = hbyte(4 + gi) & 63u;
                mn = hbyte(8 + gi) & 63u;
            } else {
                sc = (hbyte(8 + gi) & 15u) | ((hbyte(gi) >> 6) << 4);
                mn = (hbyte(8 + gi) >> 4) | ((hbyte(4 + gi) >> 6) << 4);
            }
            r.dl = __fmul_rn(__half2float(__ushort_as_half((unsigned short)(hdr[0] & 0xFFFFu))), moe_u2f(sc));
            r.ml = __fmul_rn(__half2float(__ushort_as_half((unsigned short)(hdr[0] >> 16))), moe_u2f(mn));
            r.sh = 4 * (gi & 1);
            const int q = b + 16 + 32 * (gi >> 1) + 16 * h;
            r.q = make_uint4(word32(q), word32(q + 4), word32(q + 8), word32(q + 12));
        }
    }
};

template <int F>
__device__ __forceinline__ void gemm_impl(const void* W, const float* X, float* Y, int T, int N, int K, int ldx,
                                          int ldy, int x_group_rows, int flags) {
    using Fmt = GemmFmt<F>;
    constexpr int NP = Fmt::NP, PIECE = GEMM_BN * GEMM_LDS, XPIECE = GEMM_BM * GEMM_LDS;
    __shared__ __align__(16) uint16_t xs[2 * XPIECE];
    __shared__ __align__(16) uint16_t ws[NP * PIECE];
    __shared__ float wscale[GEMM_BN];
    constexpr bool RING = F == GEMM_FMT_Q8_0 || F == GEMM_FMT_Q4_K;
    // the Q8_0 ring fits the static 48 KB beside the tiles, Q4_K's (three weight pieces) is dynamic (GEMM_RING_SMEM)
    __shared__ __align__(16) uint8_t wring_static[F == GEMM_FMT_Q8_0 ? GEMM_BN * GemmRing<F>::LD : 16];
    extern __shared__ __align__(16) uint8_t gemm_dyn[];
    uint8_t* wring = F == GEMM_FMT_Q8_0 ? wring_static : gemm_dyn;

    // this launch's input group
    int ncols = N;
    if (x_group_rows > 0) {
        const int nb = blockIdx.z * x_group_rows;
        ncols = min(x_group_rows, N - nb);
        X += (size_t)blockIdx.z * K;
        Y += nb;
        if (F == GEMM_FMT_Q8_0) W = reinterpret_cast<const uint8_t*>(W) + (size_t)nb * (K / 32) * GEMM_Q8_BYTES;
        else if (F == GEMM_FMT_Q4_K) W = reinterpret_cast<const uint8_t*>(W) + (size_t)nb * (K / 256) * GEMM_Q4K_BYTES;
        else if (F == GEMM_FMT_F16) W = reinterpret_cast<const __half*>(W) + (size_t)nb * K;
        else W = reinterpret_cast<const float*>(W) + (size_t)nb * K;
    }
    const int n0 = blockIdx.x * GEMM_BN, m0 = blockIdx.y * GEMM_BM;
    const int tid0 = threadIdx.x;
    GemmRing<F> q8{};
    if (RING && n0 < ncols) {                                   // the first k-tile's weights before pdl_wait
        const int n = n0 + (tid0 >> 1);
        const int bytes = F == GEMM_FMT_Q8_0 ? K / 32 * GEMM_Q8_BYTES : K / 256 * GEMM_Q4K_BYTES;
        const uint8_t* row = reinterpret_cast<const uint8_t*>(W) + (size_t)n * bytes;
        q8.row = n < ncols ? row : nullptr;
        q8.ring = wring + (tid0 >> 1) * GemmRing<F>::LD;
        q8.a = (int)(reinterpret_cast<size_t>(row) & 31);
        q8.bytes = bytes;
        q8.next = 0;
        q8.fast = (reinterpret_cast<size_t>(W) & 15) == 0 && (bytes & 15) == 0;
        q8.fetch(0, tid0 & 1);
        cp_async_commit();
    }
    pdl_wait();
    pdl_launch_dependents();
    if (n0 >= ncols) return;                                    // the whole block: a short last group

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp / GEMM_WARPS_N, wn = warp % GEMM_WARPS_N;
    const int xr = tid >> 2, xc = (tid & 3) * 8;                // staging: x row and columns
    const int wr = tid >> 1, wh = tid & 1;                      // staging: weight row and which of its 2 threads
    const int xm = m0 + xr, wnr = n0 + wr;
    const float* xrow = X + (size_t)(xm < T ? xm : 0) * ldx;
    const int nk = (K + GEMM_BK - 1) / GEMM_BK;
    const bool x_split = (flags & GEMM_X_SPLIT) != 0;
    const int nxp = x_split ? 2 : 1;

    float acc[GEMM_MT][GEMM_NT][4];
    tile_zero(acc);
    float xv[8];
    typename Fmt::Raw raw;
    auto load = [&](int kt) {
        const int k = kt * GEMM_BK;
        if (xm < T && k + xc < K) {
            const float4 a = *reinterpret_cast<const float4*>(xrow + k + xc);
            const float4 b = *reinterpret_cast<const float4*>(xrow + k + xc + 4);
            xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w; xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) xv[i] = 0.0f;
        }
        if constexpr (!RING) Fmt::load(W, wnr, ncols, K, k, wh, raw);
    };
    load(0);
    for (int kt = 0; kt < nk; kt++) {
        if constexpr (RING) cp_async_wait_all();                // this thread's copies of k-tile kt's sectors
        __syncthreads();                                        // the previous k-tile's fragments are read
        if (x_split) tile_split8<2>(xv, xs + xr * GEMM_LDS + xc, XPIECE);
        else tile_store8(xs + xr * GEMM_LDS + xc, xv);
        if constexpr (RING) q8.read(kt, wh, raw);
        Fmt::stage(raw, ws + wr * GEMM_LDS, wh, PIECE, wscale + wr);
        __syncthreads();
        if (RING && kt + 1 < nk) {                              // every thread is past k-tile kt's ring reads
            q8.fetch(kt + 1, wh);
            cp_async_commit();
        }
        if (kt + 1 < nk) load(kt + 1);                          // in flight while the tensor cores work
        const uint16_t* as = xs + wm * GEMM_WM * GEMM_LDS;
        const uint16_t* bs = ws + wn * GEMM_WN * GEMM_LDS;
        if constexpr (Fmt::SCALED) {
            float part[GEMM_MT][GEMM_NT][4];
            tile_zero(part);
            for (int xp = 0; xp < nxp; xp++) tile_mma<GEMM_MT, GEMM_NT, GEMM_BK, GEMM_LDS>(part, as + xp * XPIECE, bs);
            const int t = lane & 3;
#pragma unroll
            for (int nt = 0; nt < GEMM_NT; nt++) {
                const float d0 = wscale[wn * GEMM_WN + nt * 8 + 2 * t], d1 = wscale[wn * GEMM_WN + nt * 8 + 2 * t + 1];
#pragma unroll
                for (int mt = 0; mt < GEMM_MT; mt++) {
                    acc[mt][nt][0] = fmaf(d0, part[mt][nt][0], acc[mt][nt][0]);
                    acc[mt][nt][1] = fmaf(d1, part[mt][nt][1], acc[mt][nt][1]);
                    acc[mt][nt][2] = fmaf(d0, part[mt][nt][2], acc[mt][nt][2]);
                    acc[mt][nt][3] = fmaf(d1, part[mt][nt][3], acc[mt][nt][3]);
                }
            }
        } else {
            for (int xp = 0; xp < nxp; xp++)
#pragma unroll
                for (int p = 0; p < NP; p++)
                    tile_mma<GEMM_MT, GEMM_NT, GEMM_BK, GEMM_LDS>(acc, as + xp * XPIECE, bs + p * PIECE);
        }
    }

    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < GEMM_MT; mt++)
#pragma unroll
        for (int nt = 0; nt < GEMM_NT; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int m = m0 + wm * GEMM_WM + mt * 16 + g + 8 * (i >> 1);
                const int n = n0 + wn * GEMM_WN + nt * 8 + 2 * t + (i & 1);
                if (m < T && n < ncols) {
                    float* y = Y + (size_t)m * ldy + n;
                    *y = (flags & GEMM_ACCUMULATE) ? *y + acc[mt][nt][i] : acc[mt][nt][i];
                }
            }
}

// Y[m, n] (=, or += with flags & GEMM_ACCUMULATE) sum_k X[m, k] W[n, k], m < T, n < N (x_group_rows: see the top;
// flags & GEMM_X_SPLIT: x as hi + lo bf16 pieces). Launch: grid
// (ceil(cols / GEMM_BN), ceil(T / GEMM_BM), groups) with cols = x_group_rows or N and groups = ceil(N / cols),
// block GEMM_THREADS, no dynamic shared memory. K % 32 == 0; X 16-byte aligned, ldx % 4 == 0; W 2-byte aligned.
extern "C" __global__ __launch_bounds__(GEMM_THREADS) void gemm_q8_0(const uint8_t* W, const float* X, float* Y,
        int T, int N, int K, int ldx, int ldy, int x_group_rows, int flags) {
    gemm_impl<GEMM_FMT_Q8_0>(W, X, Y, T, N, K, ldx, ldy, x_group_rows, flags);
}

// As gemm_q8_0 for F16 weights. Launch: as gemm_q8_0. K % 8 == 0; W, X 16-byte aligned, ldx % 4 == 0.
extern "C" __global__ __launch_bounds__(GEMM_THREADS) void gemm_f16(const __half* W, const float* X, float* Y,
        int T, int N, int K, int ldx, int ldy, int x_group_rows, int flags) {
    gemm_impl<GEMM_FMT_F16>(W, X, Y, T, N, K, ldx, ldy, x_group_rows, flags);
}

// As gemm_q8_0 for F32 weights. Launch: as gemm_q8_0. K % 8 == 0; W, X 16-byte aligned, ldx % 4 == 0.
extern "C" __global__ __launch_bounds__(GEMM_THREADS) void gemm_f32(const float* W, const float* X, float* Y,
        int T, int N, int K, int ldx, int ldy, int x_group_rows, int flags) {
    gemm_impl<GEMM_FMT_F32>(W, X, Y, T, N, K, ldx, ldy, x_group_rows, flags);
}

// As gemm_q8_0 for Q4_K weights. Launch: as gemm_q8_0. K % 256 == 0; W, X 16-byte aligned, ldx % 4 == 0.
extern "C" __global__ __launch_bounds__(GEMM_THREADS) void gemm_q4_k(const uint8_t* W, const float* X, float* Y,
        int T, int N, int K, int ldx, int ldy, int x_group_rows, int flags) {
    gemm_impl<GEMM_FMT_Q4_K>(W, X, Y, T, N, K, ldx, ldy, x_group_rows, flags);
}

// ---- one mma tile from per-lane fragments (ds4py/cuda/twins/mma.py packs them): the fragment-layout check ----
// a [tiles, 32, 4], b [tiles, 32, 2], c / d [tiles, 32, 4] (lane-major): d = mma(a, b) + c for tile blockIdx.x, with
// f16 (BF16 false) or bf16 fragments.
template <bool BF16>
__device__ __forceinline__ void gemm_mma_tile(const unsigned* a, const unsigned* b, const float* c, float* d) {
    pdl_wait();
    const int lane = threadIdx.x, tile = blockIdx.x;
    const unsigned ra[4] = {a[(tile * 32 + lane) * 4], a[(tile * 32 + lane) * 4 + 1], a[(tile * 32 + lane) * 4 + 2],
                            a[(tile * 32 + lane) * 4 + 3]};
    const unsigned rb[2] = {b[(tile * 32 + lane) * 2], b[(tile * 32 + lane) * 2 + 1]};
    float acc[4];
#pragma unroll
    for (int i = 0; i < 4; i++) acc[i] = c[(tile * 32 + lane) * 4 + i];
    if constexpr (BF16)
        mma_m16n8k16_bf16_f32(acc, ra, rb);
    else
        mma_m16n8k16_f16_f32(acc, ra, rb);
#pragma unroll
    for (int i = 0; i < 4; i++) d[(tile * 32 + lane) * 4 + i] = acc[i];
}

// f16 fragments. Launch: grid (tiles), block 32.
extern "C" __global__ void gemm_mma_tile_f16(const unsigned* a, const unsigned* b, const float* c, float* d) {
    gemm_mma_tile<false>(a, b, c, d);
}

// bf16 fragments. Launch: grid (tiles), block 32.
extern "C" __global__ void gemm_mma_tile_bf16(const unsigned* a, const unsigned* b, const float* c, float* d) {
    gemm_mma_tile<true>(a, b, c, d);
}
