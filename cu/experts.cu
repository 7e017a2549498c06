// Routed and shared experts of V4 Flash (MODEL.md §2.4, ds4py/ref/forward.moe), decode (one token), reading the
// GGUF blocks directly and only the chosen experts' rows:
//   moe_gate_up_<fmt>   h[s] = silu(min(w1 x, c)) * clamp(w3 x, -c, c) * route_w[s] for the slots s (expert ids[s])
//   moe_down_<fmt>      y = sum_s w2[ids[s]] h[s] (+ add: the shared expert's output), in a fixed order, with the
//                       hc_post epilogue X'_k = post_k y + sum_j comb[j,k] X_j, or y itself
//   moe_dequant_<fmt>   the format's exact values (bit-identical to ds4py.quant), for tests and tools
// Formats: IQ2_XXS, Q2_K, Q4_K, MXFP4, Q8_0, F16 (ggml block layouts; see ds4py/quant/). The shared expert runs
// through the same kernels with ids = null (slot s is expert s) and route_w = null (weight 1).
//
// Geometry: a block owns `rows_per_block` consecutive rows of one matrix; those rows are one contiguous span of
// bytes, staged into shared memory with 16-byte cp.async (the blocks of most formats are not 16-byte aligned in
// place: 66, 84, 17, 34 bytes). Thread (grp = tid % G, rl = tid / G), G = cols / 32, holds the 32 activations of
// column group grp in registers for all its rows (rl, rl + RL, ...; RL = blockDim.x / G), takes the dot of that
// group of each row straight from the staged bytes (an fma per weight on its integer code, the block scales once
// per 16 or 32 weights), and the G partial sums of a row are added by 8 lanes in a fixed order: no float atomics,
// bit-identical results run to run.
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"

// Geometry (-D value from ds4py/cuda/ops/experts.py DEFINES): MOE_RPT rows per thread (accumulators per matrix),
// so rows_per_block <= MOE_RPT * (blockDim.x / G).
#ifndef MOE_RPT
#error "MOE_RPT comes from the DEFINES table of ds4py/cuda/ops/experts.py"
#endif


#include "moe_formats.cuh"

// ---- block helpers (moe_stage / moe_room: cu/moe_formats.cuh) ---------------------------------------------
// A staged span of nr consecutive rows of one matrix in shared memory: row r at rows + r * rb; VQ-8 also its hi
// rows at hi + r * hb (13 bits) and its gains at gain[r].
struct MoeSpan {
    const uint8_t* rows;
    const uint8_t* hi;
    const float* gain;
    int rb, hb;
};

// How a format's rows are staged and read. room: shared bytes for nr staged rows; stage: rows [r0, r0 + nr) of
// expert e of a matrix of n_experts x rows (copy false: only the span where an earlier stage of the same rows put
// them); dot: the scaled dot of column group grp of staged row r. The ggml formats: the rows are one contiguous
// span.
template <int F, bool IS_VQ = (F >= FMT_VQ_BASE)> struct MoeStage {
    __device__ static __forceinline__ int room(int nr, int cols) { return moe_room(nr * MoeRow<F>::bytes(cols)); }
    __device__ static __forceinline__ MoeSpan stage(uint8_t* dst, const uint8_t* W, int e, int r0, int nr, int,
                                                    int rows, int cols, bool copy) {
        const int rb = MoeRow<F>::bytes(cols);
        const uint8_t* src = W + ((size_t)e * rows + r0) * rb;
        const uint8_t* p = copy ? moe_stage(dst, src, nr * rb) : dst + ((size_t)src & 15);
        return MoeSpan{p, nullptr, nullptr, rb, 0};
    }
    __device__ static __forceinline__ float dot(const MoeSpan& s, int r, int grp, const float* x, const float* xs,
                                                const uint64_t* grid) {
        return MoeFmt<F>::dot(s.rows + (size_t)r * s.rb, grp, x, xs, grid);
    }
};

// VQ-8 (moe_formats.cuh MoeVq): the stream rows, hi rows and gains are three spans, each staged at once; `grid` is
// the shared-memory codebook.
template <int BITS> struct MoeStageVq {
    using V = MoeVq<BITS>;
    __device__ static __forceinline__ int room(int nr, int cols) {
        return moe_room(nr * V::stream_bytes(cols)) + (BITS == 13 ? moe_room(nr * V::hi_bytes(cols)) : 0) +
               moe_room(4 * nr);
    }
    __device__ static __forceinline__ MoeSpan stage(uint8_t* dst, const uint8_t* W, int e, int r0, int nr,
                                                    int n_experts, int rows, int cols, bool copy) {
        const int sb = V::stream_bytes(cols), hb = V::hi_bytes(cols);
        const size_t es = V::expert_bytes(rows, cols), row = (size_t)e * rows + r0, all = (size_t)n_experts * rows;
        const uint8_t* hi = W + (size_t)n_experts * es;
        const uint8_t* src[3] = {W + (size_t)e * es + (size_t)r0 * sb, hi + row * hb, hi + all * hb + row * 4};
        const int n[3] = {nr * sb, nr * hb, 4 * nr};
        const uint8_t* at[3] = {nullptr, nullptr, nullptr};
        for (int i = 0; i < 3; ++i) {
            if (n[i] == 0) continue;
            at[i] = copy ? moe_stage(dst, src[i], n[i]) : dst + ((size_t)src[i] & 15);
            dst += moe_room(n[i]);
        }
        return MoeSpan{at[0], at[1], reinterpret_cast<const float*>(at[2]), sb, hb};
    }
    __device__ static __forceinline__ float dot(const MoeSpan& s, int r, int grp, const float* x, const float*,
                                                const uint64_t* cb) {
        return V::dot(s.rows + (size_t)r * s.rb, s.hi + (size_t)r * s.hb, grp, x, cb) * s.gain[r];
    }
};
template <int F> struct MoeStage<F, true> : MoeStageVq<F - FMT_VQ_BASE> {};        // VQ-8 at F - 100 bits

__device__ __forceinline__ void moe_load_x(const float* x, float* xv) {
    const float4* p = reinterpret_cast<const float4*>(x);
#pragma unroll
    for (int v = 0; v < 8; ++v) {
        const float4 f = p[v];
        xv[4 * v] = f.x;
        xv[4 * v + 1] = f.y;
        xv[4 * v + 2] = f.z;
        xv[4 * v + 3] = f.w;
    }
}

// The sums of x over the two halves of a column group (the K-quants' mins multiply them).
__device__ __forceinline__ void moe_half_sums(const float* xv, float* xs) {
    float a = 0.0f, b = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        a += xv[j];
        b += xv[j + 16];
    }
    xs[0] = a;
    xs[1] = b;
}

// tot[row] = sum over g < G of red[row * G + g] for rows < n_rows: 8 lanes per row, each a strided partial sum,
// then a fixed butterfly. Every thread calls it (it has barriers); blockDim.x a multiple of 32.
__device__ __forceinline__ void moe_row_sums(const float* red, float* tot, int n_rows, int G) {
    const int per_pass = blockDim.x / 8, part = threadIdx.x & 7;
    for (int base = 0; base < n_rows; base += per_pass) {
        const int row = base + (int)threadIdx.x / 8;
        float s = 0.0f;
        if (row < n_rows)
            for (int g = part; g < G; g += 8) s += red[row * G + g];
        s += __shfl_xor_sync(DS4_FULL_MASK, s, 4);
        s += __shfl_xor_sync(DS4_FULL_MASK, s, 2);
        s += __shfl_xor_sync(DS4_FULL_MASK, s, 1);
        if (part == 0 && row < n_rows) tot[row] = s;
    }
    __syncthreads();
}

// The formats with int8-activation kernels (moe_gate_up_i8_<fmt> / moe_down_i8_<fmt>, below): those whose
// activations the reference rounds as Q8_K (ds4py/ref/weights.py Q8_K_ACT) and that have an int8 dot (MoeActI8).
// X(kernel suffix, FMT_ id, weights per block, bytes per block, table); ds4py/cuda/ops/experts.py reads it.
#define MOE_I8_FORMATS(X) \
    X(iq2_xxs, FMT_IQ2_XXS, 256, 66, 1) \
    X(q2_k, FMT_Q2_K, 256, 84, 0) \
    X(q4_k, FMT_Q4_K, 256, 144, 0)

// ---- the activation side of a dot: fp32 (exact, the default) or int8 (Numerics.act_quant) -------------------------
// A thread's 32 activations of column group grp: load(x + 32 * grp), then dot<F>(span, r, grp, grid) per row.
// LANES: load() shuffles with the other lanes of its 256-block (every lane of the warp must call it).
struct MoeActF {                                  // the fp32 activations and their half sums (the K-quants' mins)
    static constexpr bool LANES = false;
    float v[32], s[2];
    __device__ __forceinline__ void load(const float* x) {
        moe_load_x(x, v);
        moe_half_sums(v, s);
    }
    template <int F>
    __device__ __forceinline__ float dot(const MoeSpan& sp, int r, int grp, const uint64_t* grid) const {
        return MoeStage<F>::dot(sp, r, grp, v, s, grid);
    }
};

// int8 activations: x rounded as ggml's Q8_K (ds4py.ref.ops.q8_k_round, the reference's act_quant mode): per
// block of 256 (8 lanes of 32: column groups 8b .. 8b + 7 sit on 8 consecutive lanes, as G % 8 == 0), the largest
// magnitude, iscale = -127 / max, q = rint(x * iscale), d = 1 / iscale, in the reference's fp32 operations: the
// rounded values q * d are the reference's (its codes, or all of them negated: see load). A group's dot is then exact
// in integers (dp4a) and scaled once: it equals the reference's fp32 product on the rounded x up to the fp32
// rounding of the reference's sum (tests/test_cu_emu_experts_i8.py states the bound).
struct MoeActI8 {
    static constexpr bool LANES = true;
    int q[8];                                     // codes 4w .. 4w + 3 in the bytes of q[w]
    int qs[2];                                    // the sums of the codes of each half (16) of the group
    float d;
    __device__ __forceinline__ void load(const float* x) {
        float v[32];
        moe_load_x(x, v);
        // The reference scales by the signed max m (iscale = -127 / m); the positive amax = |m| gives every code
        // and d negated when m < 0, so q * d (and a dot's sum * d) are the same floats: the sign needs no search.
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
        for (int off = 1; off < 8; off <<= 1) amax = fmaxf(amax, __shfl_xor_sync(DS4_FULL_MASK, amax, off));
        const float is = amax != 0.0f ? __fdiv_rn(-127.0f, amax) : 0.0f;
        d = is != 0.0f ? __fdiv_rn(1.0f, is) : 0.0f;
        // rint(x * is) by the 1.5 * 2^23 shift (round to nearest even, as rint; |x * is| <= 127 (1 + 2^-23)^2, so
        // the reference's clip at 127 never cuts): the code is the low byte of the sum's bits, 0x4B400000 + c
        int bits[32];
#pragma unroll
        for (int j = 0; j < 32; ++j) bits[j] = __float_as_int(__fadd_rn(__fmul_rn(v[j], is), 12582912.0f));
#pragma unroll
        for (int w = 0; w < 8; ++w)
            q[w] = (int)__byte_perm(__byte_perm(bits[4 * w], bits[4 * w + 1], 0x0040u),
                                    __byte_perm(bits[4 * w + 2], bits[4 * w + 3], 0x0040u), 0x5410u);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int sum = 0;
#pragma unroll
            for (int j = 0; j < 16; ++j) sum += bits[16 * h + j] - 0x4B400000;
            qs[h] = sum;
        }
    }
    template <int F>
    __device__ __forceinline__ float dot(const MoeSpan& sp, int r, int grp, const uint64_t* grid) const;
};

// IQ2_XXS: per 8 weights the grid's 8 magnitudes (bytes) and a sign table entry (moe_i8_signs: the bytes' -1 masks
// m and m & 0x01010101), the signed bytes (g ^ m) + (m & 1) (no carry: g >= 8), two dp4a.
template <>
__device__ __forceinline__ float MoeActI8::dot<FMT_IQ2_XXS>(const MoeSpan& sp, int r, int grp,
                                                           const uint64_t* grid) const {
    using Fm = MoeFmt<FMT_IQ2_XXS>;
    const uint4* signs = reinterpret_cast<const uint4*>(grid + 256);
    unsigned a0, a1;
    float db;
    Fm::aux(sp.rows + (size_t)r * sp.rb, grp, a0, a1, db);
    int sum = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const uint64_t g = grid[(a0 >> (8 * k)) & 255u];
        const uint4 m = signs[(a1 >> (7 * k)) & 127u];
        sum = __dp4a((int)(((unsigned)g ^ m.x) + m.z), q[2 * k], sum);
        sum = __dp4a((int)(((unsigned)(g >> 32) ^ m.y) + m.w), q[2 * k + 1], sum);
    }
    return __int2float_rn(sum) * db * d;
}

// Q2_K: the 2-bit codes of 4 weights are the bytes of (word >> sh) & 0x03030303: one dp4a per 4 weights; the
// sub-block scales and mins in integers (ggml's order: d * sum(sc * dot) - dmin * sum(m * code sums)).
template <>
__device__ __forceinline__ float MoeActI8::dot<FMT_Q2_K>(const MoeSpan& sp, int r, int grp, const uint64_t*) const {
    const uint8_t* b = sp.rows + (size_t)r * sp.rb + (size_t)(grp >> 3) * MoeFmt<FMT_Q2_K>::BYTES;
    const int cw = (grp & 7) * 32, sh = 2 * ((cw >> 5) & 3);
    int isc = 0, imn = 0;
#pragma unroll
    for (int sub = 0; sub < 2; ++sub) {
        const unsigned sc = b[(cw >> 4) + sub];
        const uint8_t* qs8 = b + 16 + 32 * (cw >> 7) + 16 * sub;
        int s = 0;
#pragma unroll
        for (int word = 0; word < 4; ++word)
            s = __dp4a((int)((moe_u32(qs8 + 4 * word) >> sh) & 0x03030303u), q[4 * sub + word], s);
        isc += (int)(sc & 15u) * s;
        imn += (int)(sc >> 4) * qs[sub];
    }
    return d * (moe_f16(b + 80) * __int2float_rn(isc) - moe_f16(b + 82) * __int2float_rn(imn));
}

// Q4_K: one sub-block (scale, min) per group, the 4-bit codes of 4 weights the bytes of (word >> sh) & 0x0F0F0F0F.
template <>
__device__ __forceinline__ float MoeActI8::dot<FMT_Q4_K>(const MoeSpan& sp, int r, int grp, const uint64_t*) const {
    const uint8_t* b = sp.rows + (size_t)r * sp.rb + (size_t)(grp >> 3) * MoeFmt<FMT_Q4_K>::BYTES;
    const int gi = grp & 7, sh = 4 * (gi & 1);
    unsigned sc, mn;
    MoeFmt<FMT_Q4_K>::scales(b, gi, sc, mn);
    const uint8_t* qs8 = b + 16 + 32 * (gi >> 1);
    int s = 0;
#pragma unroll
    for (int word = 0; word < 8; ++word)
        s = __dp4a((int)((moe_u32(qs8 + 4 * word) >> sh) & 0x0F0F0F0Fu), q[word], s);
    return d * (moe_f16(b) * __int2float_rn((int)sc * s) - moe_f16(b + 2) * __int2float_rn((int)mn * (qs[0] + qs[1])));
}

// The IQ2_XXS sign table of the int8 dots, at grid_s + 256 (128 x 16 bytes): entry i (7 sign bits, the 8th their
// parity, ksigns_iq2xs) = {m_lo, m_hi, m_lo & 0x01010101, m_hi & 0x01010101}, m: 0xFF in each negative byte.
// A block-wide fill; __syncthreads before use.
__device__ __forceinline__ void moe_i8_signs(uint64_t* at) {
    uint4* t = reinterpret_cast<uint4*>(at);
    for (int i = threadIdx.x; i < 128; i += blockDim.x) {
        const unsigned sg = (unsigned)i | ((unsigned)(__popc(i) & 1) << 7);
        unsigned m[2] = {0u, 0u};
        for (int j = 0; j < 8; ++j)
            if ((sg >> j) & 1u) m[j >> 2] |= 0xFFu << (8 * (j & 3));
        t[i] = make_uint4(m[0], m[1], m[0] & 0x01010101u, m[1] & 0x01010101u);
    }
}

// How an impl call stages its rows: MOE_WAIT, it owns the kernel's pdl_wait (a shared expert's rows, ids null,
// are staged before it) and stages then waits; MOE_WAITED, the caller has waited, it stages then waits;
// MOE_STAGED, the caller issued this tile's rows into smem (the same positions) and waited for them with a barrier.
#define MOE_WAIT 0
#define MOE_WAITED 1
#define MOE_STAGED 2

// ---- gate + up + clamped SwiGLU -----------------------------------------------------------------------------------
// One (x, slot) pair against the block's staged gate / up rows sg / su: hout[i] = silu(min(g, c)) * clamp(u) * rw.
// Both entry points (one token; several rows grouped by expert) run exactly this, so a pair's bits do not depend
// on which other pairs share its block or launch. red: partial-sum room (may alias the stage: a barrier comes
// before it is written).
template <int F, class A = MoeActF>
__device__ __forceinline__ void moe_gate_up_pair(const uint64_t* grid, const MoeSpan& sg, const MoeSpan& su,
                                                 int nr, const float* x, float rw, float* hout, float clamp,
                                                 float* red, int dim) {
    const int G = dim / 32, RL = blockDim.x / G, tid = threadIdx.x;
    const int grp = tid % G, rl = tid / G;
    const bool worker = rl < RL;
    A act;
    if (A::LANES || worker) act.load(x + 32 * grp);
    float ag[MOE_RPT], au[MOE_RPT];
#pragma unroll
    for (int i = 0; i < MOE_RPT; ++i) {
        const int r = rl + RL * i;
        ag[i] = au[i] = 0.0f;
        if (worker && r < nr) {
            ag[i] = act.template dot<F>(sg, r, grp, grid);
            au[i] = act.template dot<F>(su, r, grp, grid);
        }
    }
    __syncthreads();                                              // the stage is read (when red aliases it)
    float* tot = red + 2 * nr * G;                                // red [2][nr][G], then tot [2][nr]
#pragma unroll
    for (int i = 0; i < MOE_RPT; ++i) {
        const int r = rl + RL * i;
        if (worker && r < nr) {
            red[r * G + grp] = ag[i];
            red[(nr + r) * G + grp] = au[i];
        }
    }
    __syncthreads();
    moe_row_sums(red, tot, 2 * nr, G);
    for (int i = tid; i < nr; i += blockDim.x) {
        float g = tot[i], u = tot[nr + i];
        if (clamp > 0.0f) {
            g = fminf(g, clamp);
            u = fminf(fmaxf(u, -clamp), clamp);
        }
        const float silu = g * (1.0f / (1.0f + expf(-g)));
        hout[i] = silu * u * rw;
    }
}

template <int F, class A = MoeActF>
__device__ __forceinline__ void moe_gate_up_impl(uint8_t* smem, const uint64_t* grid, const uint8_t* Wg,
                                                 const uint8_t* Wu, const float* x, const int* ids,
                                                 const float* route_w, float* h, int n_experts, int ff, int dim,
                                                 int rows_per_block, float clamp, int bx, int mode) {
    const int tid = threadIdx.x;
    const int slot = blockIdx.y, r0 = bx * rows_per_block;
    const int nr = min(rows_per_block, ff - r0);
    const int room = MoeStage<F>::room(nr, dim);
    // the shared expert (ids null): its rows do not depend on the previous kernel, so with `wait` (this call owns
    // the kernel's pdl_wait) they are staged before it and stream in during the previous kernel's tail
    const bool wait = mode == MOE_WAIT;
    const bool early = wait && !ids && slot < n_experts && nr > 0;
    if (early) {
        MoeStage<F>::stage(smem, Wg, slot, r0, nr, n_experts, ff, dim, true);
        MoeStage<F>::stage(smem + room, Wu, slot, r0, nr, n_experts, ff, dim, true);
    }
    if (wait) {
        pdl_wait();
        pdl_launch_dependents();
    }
    if (nr <= 0) return;                                          // block-uniform
    const int e = ids ? ids[slot] : slot;
    const float rw = route_w ? route_w[slot] : 1.0f;
    float* hout = h + (size_t)slot * ff + r0;
    if (e < 0 || e >= n_experts) {                                // a bad id: NaN rows, nothing read
        for (int i = tid; i < nr; i += blockDim.x) hout[i] = __int_as_float(0x7fc00000);
        return;
    }
    const bool copy = !early && mode != MOE_STAGED;
    const MoeSpan sg = MoeStage<F>::stage(smem, Wg, e, r0, nr, n_experts, ff, dim, copy);
    const MoeSpan su = MoeStage<F>::stage(smem + room, Wu, e, r0, nr, n_experts, ff, dim, copy);
    if (mode != MOE_STAGED) {
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
    }
    moe_gate_up_pair<F, A>(grid, sg, su, nr, x, rw, hout, clamp, reinterpret_cast<float*>(smem), dim);
}

// An expert id, every id outside [0, n_experts) as -1 (so the distinct ids are at most n_experts + 1).
__device__ __forceinline__ int moe_canon(int v, int n_experts) { return v >= 0 && v < n_experts ? v : -1; }

// The u-th distinct expert (moe_canon) of ids[0 .. n) in ascending order (INT_MAX when there are fewer); every
// thread gets it. n <= 1024 (ops/experts.py MAX_PAIRS); `pick` is a __shared__ int the caller owns.
__device__ __forceinline__ int moe_unique_id(const int* ids, int n, int n_experts, int u, int* pick) {
    if (threadIdx.x == 0) *pick = 0x7fffffff;
    __syncthreads();
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        const int v = moe_canon(ids[p], n_experts);
        bool first = true;
        int below = 0;                                            // distinct values < v
        for (int q = 0; q < n; ++q) {
            const int w = moe_canon(ids[q], n_experts);
            if (w == v && q < p) first = false;
            if (w < v) {
                bool seen = false;                                // count w once: at its first occurrence
                for (int t = 0; t < q && !seen; ++t) seen = moe_canon(ids[t], n_experts) == w;
                below += !seen;
            }
        }
        if (first && below == u) *pick = v;
    }
    __syncthreads();
    return *pick;
}

// Several rows: the pairs p = (row n, slot s), p = n * k + s, of ids [nx * k] (null: pair p is expert
// p % k) grouped by expert: block (x, u) stages rows [r0, r0 + rows_per_block) of the u-th distinct expert's gate
// and up once, then runs every pair that chose it (ascending p) with x + n * x_stride, writing h[p]. A bad id's
// pairs get NaN rows (nothing read). The stage stays while the pairs run: red sits after it.
template <int F, class A = MoeActF>
__device__ __forceinline__ void moe_gate_up_rows_impl(uint8_t* smem, const uint64_t* grid, const uint8_t* Wg,
                                                      const uint8_t* Wu, const float* x, const int* ids,
                                                      const float* route_w, float* h, int n_experts, int ff,
                                                      int dim, int rows_per_block, float clamp, int n_pairs, int k,
                                                      int x_stride, int* pick, int bx) {
    const int tid = threadIdx.x;
    const int r0 = bx * rows_per_block;
    const int nr = min(rows_per_block, ff - r0);
    if (nr <= 0) return;                                          // block-uniform
    int e;
    if (ids) {
        e = moe_unique_id(ids, n_pairs, n_experts, blockIdx.y, pick);
        if (e == 0x7fffffff) return;                              // fewer distinct experts than blocks
    } else {
        if ((int)blockIdx.y >= k) return;
        e = moe_canon(blockIdx.y, n_experts);
    }
    if (e < 0) {                                                  // the bad ids' group: NaN pairs
        for (int p = 0; p < n_pairs; ++p)
            if (moe_canon(ids ? ids[p] : p % k, n_experts) < 0)
                for (int i = tid; i < nr; i += blockDim.x) h[(size_t)p * ff + r0 + i] = __int_as_float(0x7fc00000);
        return;
    }
    const int room = MoeStage<F>::room(nr, dim);
    const MoeSpan sg = MoeStage<F>::stage(smem, Wg, e, r0, nr, n_experts, ff, dim, true);
    const MoeSpan su = MoeStage<F>::stage(smem + room, Wu, e, r0, nr, n_experts, ff, dim, true);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem + 2 * room);
    for (int p = 0; p < n_pairs; ++p) {                           // block-uniform loop
        if (moe_canon(ids ? ids[p] : p % k, n_experts) != e) continue;
        moe_gate_up_pair<F, A>(grid, sg, su, nr, x + (size_t)(p / k) * x_stride, route_w ? route_w[p] : 1.0f,
                            h + (size_t)p * ff + r0, clamp, red, dim);
    }
}

// ---- down (+ shared expert's output, + hc_post) -----------------------------------------------------------------
template <int F, class A = MoeActF>
__device__ __forceinline__ void moe_down_impl(uint8_t* smem, const uint64_t* grid, const uint8_t* W, const int* ids,
                                              const float* h, const float* add, const float* hc_post,
                                              const float* hc_comb, const float* hc_x, float* out, int n_slots,
                                              int n_experts, int dim, int ff, int rows_per_block, int hc, int bx,
                                              int mode) {
    const int G = ff / 32, RL = blockDim.x / G, tid = threadIdx.x;
    const int grp = tid % G, rl = tid / G;
    const bool worker = rl < RL;
    const int r0 = bx * rows_per_block, nr = min(rows_per_block, dim - r0);
    const int room = MoeStage<F>::room(nr, ff);
    const bool wait = mode == MOE_WAIT;
    const bool early = wait && !ids;                              // the shared expert: staged before pdl_wait
    if (early && nr > 0)
        for (int s = 0; s < n_slots && s < n_experts; ++s)
            MoeStage<F>::stage(smem + s * room, W, s, r0, nr, n_experts, dim, ff, true);
    if (wait) {
        pdl_wait();
        pdl_launch_dependents();
    }
    if (nr <= 0) return;                                          // block-uniform
    bool bad = false;
    for (int s = 0; s < n_slots; ++s) {
        const int e = ids ? ids[s] : s;
        if (e < 0 || e >= n_experts) bad = true;
        else if (!early && mode != MOE_STAGED) MoeStage<F>::stage(smem + s * room, W, e, r0, nr, n_experts, dim, ff, true);
    }
    if (mode != MOE_STAGED) {
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
    }

    float acc[MOE_RPT];
#pragma unroll
    for (int i = 0; i < MOE_RPT; ++i) acc[i] = 0.0f;
    for (int s = 0; s < n_slots; ++s) {                            // experts in slot order: a fixed sum
        const int e = ids ? ids[s] : s;
        if ((!A::LANES && !worker) || e < 0 || e >= n_experts) continue;     // e: block-uniform
        A act;
        act.load(h + (size_t)s * ff + 32 * grp);
        if (!worker) continue;
        const MoeSpan st = MoeStage<F>::stage(smem + s * room, W, e, r0, nr, n_experts, dim, ff, false);
#pragma unroll
        for (int i = 0; i < MOE_RPT; ++i) {
            const int r = rl + RL * i;
            if (r < nr) acc[i] += act.template dot<F>(st, r, grp, grid);
        }
    }
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem);                  // [nr][G], then tot [nr]
    float* tot = red + nr * G;
#pragma unroll
    for (int i = 0; i < MOE_RPT; ++i) {
        const int r = rl + RL * i;
        if (worker && r < nr) red[r * G + grp] = acc[i];
    }
    __syncthreads();
    moe_row_sums(red, tot, nr, G);
    for (int i = tid; i < nr; i += blockDim.x) {
        const int r = r0 + i;
        float y = bad ? __int_as_float(0x7fc00000) : tot[i];
        if (add) y += add[r];
        if (hc_post) {
            for (int k = 0; k < hc; ++k) {
                float mix = 0.0f;
                for (int j = 0; j < hc; ++j) mix += hc_comb[j * hc + k] * hc_x[(size_t)j * dim + r];
                out[(size_t)k * dim + r] = hc_post[k] * y + mix;
            }
        } else {
            out[r] = y;
        }
    }
}

// Several rows: block (x, n) is row n's moe_down_impl on ids + n * k, h + n * k * ff, add + n * dim, the mHC
// post / comb of mix + n * (2 + hc) * hc ([pre, post, comb] per row), hc_x + n * hc * dim and out + n * (hc ? hc : 1)
// * dim: each row reads its own k experts' rows (an expert two rows chose is read twice, from L2 when they run
// together), with exactly the single-token arithmetic. mix null: out = y.
template <int F, class A = MoeActF>
__device__ __forceinline__ void moe_down_rows_impl(uint8_t* smem, const uint64_t* grid, const uint8_t* W,
                                                   const int* ids, const float* h, const float* add,
                                                   const float* mix, const float* hc_x, float* out, int n_slots,
                                                   int n_experts, int dim, int ff, int rows_per_block, int hc,
                                                   int bx) {
    const size_t n = blockIdx.y, mrec = (size_t)(2 + hc) * hc;
    moe_down_impl<F, A>(smem, grid, W, ids ? ids + n * n_slots : nullptr, h + n * n_slots * ff,
                     add ? add + n * dim : nullptr, mix ? mix + n * mrec + hc : nullptr,
                     mix ? mix + n * mrec + 2 * hc : nullptr, mix ? hc_x + n * hc * dim : nullptr,
                     out + n * (mix ? hc : 1) * dim, n_slots, n_experts, dim, ff, rows_per_block, mix ? hc : 0,
                     bx, MOE_WAITED);
}

// ---- exact dequantisation ---------------------------------------------------------------------------------------
template <int F>
__device__ __forceinline__ void moe_dequant_impl(const uint64_t* grid, const uint8_t* W, float* out, int n_groups) {
    const int gidx = blockIdx.x * blockDim.x + threadIdx.x;
    if (gidx >= n_groups) return;
    float w[32];
    MoeFmt<F>::dq(W, gidx, w, grid);
    float4* o = reinterpret_cast<float4*>(out + (size_t)gidx * 32);
#pragma unroll
    for (int v = 0; v < 8; ++v) o[v] = make_float4(w[4 * v], w[4 * v + 1], w[4 * v + 2], w[4 * v + 3]);
}


// ---- entry points: one of each per format of MOE_FORMATS (moe_formats.cuh) -------------------------------------
// Common contracts. Wg / Wu [n_experts, ff, dim] and W [n_experts, dim, ff]: the raw GGUF bytes of a stacked expert
// tensor (or of one shared-expert matrix with n_experts = 1); cols % 256 == 0 for IQ2_XXS / Q2_K / Q4_K, % 32
// otherwise; x, h, add 16-byte aligned. ids [n_slots] int32 (null: slot s is expert s); an id outside
// [0, n_experts) gives NaN outputs. route_w [n_slots] (null: 1). clamp <= 0: no clamp.
// hc_post [hc] / hc_comb [hc, hc] (comb[j*hc + k]) / hc_x [hc, dim]: the mHC post mix of this sub-layer; with
// hc_post null the kernel writes y [dim], else out [hc, dim] = X'. Thread layout: G = cols / 32 column groups
// (cols = dim for gate/up, ff for down), RL = blockDim.x / G row lanes, rows_per_block <= 8 * RL; the dynamic
// shared memory is max(staged rows, partial sums), computed by ds4py/cuda/ops/experts.py (moe_smem_bytes).

// The constant tables of activations A in grid_s (512 words; a block-wide fill, the impl syncs before reading):
// fp32, the IQ2_XXS magnitudes as bf16 halves (moe_load_grid16); int8, the grid and its sign masks (moe_i8_signs).
template <class A> __device__ __forceinline__ void moe_load_tables(uint64_t* grid_s) { moe_load_grid16(grid_s); }
template <> __device__ __forceinline__ void moe_load_tables<MoeActI8>(uint64_t* grid_s) {
    moe_load_grid(grid_s);
    moe_i8_signs(grid_s + 256);
}

// The bodies of the four decode entry points of format F with activations ACT (MoeActF, MoeActI8), each kernel
// named kname: the per-list templates below (MOE_GATE_UP, MOE_GATE_UP_I8, ...) name one each, with its contract.
#define MOE_GATE_UP_KERNEL(kname, F, TABLE, ACT) \
extern "C" __global__ void kname(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids, \
                                 const float* route_w, float* h, int n_experts, int ff, int dim, int rows_per_block, \
                                 float clamp) { \
    extern __shared__ __align__(16) uint8_t moe_smem[]; \
    __shared__ __align__(16) uint64_t grid_s[TABLE ? 512 : 1]; \
    if (TABLE) moe_load_tables<ACT>(grid_s); \
    moe_gate_up_impl<F, ACT>(moe_smem, TABLE ? grid_s : nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, dim, \
                             rows_per_block, clamp, blockIdx.x, MOE_WAIT);  /* pdl_wait inside */ \
}
#define MOE_DOWN_KERNEL(kname, F, TABLE, ACT) \
extern "C" __global__ void kname(const uint8_t* W, const int* ids, const float* h, const float* add, \
                                 const float* hc_post, const float* hc_comb, const float* hc_x, float* out, \
                                 int n_slots, int n_experts, int dim, int ff, int rows_per_block, int hc) { \
    extern __shared__ __align__(16) uint8_t moe_smem[]; \
    __shared__ __align__(16) uint64_t grid_s[TABLE ? 512 : 1]; \
    if (TABLE) moe_load_tables<ACT>(grid_s); \
    moe_down_impl<F, ACT>(moe_smem, TABLE ? grid_s : nullptr, W, ids, h, add, hc_post, hc_comb, hc_x, out, n_slots, \
                          n_experts, dim, ff, rows_per_block, hc, blockIdx.x, MOE_WAIT);  /* pdl_wait inside */ \
}
#define MOE_GATE_UP_ROWS_KERNEL(kname, F, TABLE, ACT) \
extern "C" __global__ void kname(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids, \
                                 const float* route_w, float* h, int n_experts, int ff, int dim, int rows_per_block, \
                                 float clamp, int n_pairs, int k, int x_stride) { \
    extern __shared__ __align__(16) uint8_t moe_smem[]; \
    __shared__ int pick; \
    __shared__ __align__(16) uint64_t grid_s[TABLE ? 512 : 1]; \
    pdl_wait(); \
    pdl_launch_dependents(); \
    if (TABLE) moe_load_tables<ACT>(grid_s); \
    moe_gate_up_rows_impl<F, ACT>(moe_smem, TABLE ? grid_s : nullptr, Wg, Wu, x, ids, route_w, h, n_experts, ff, \
                                  dim, rows_per_block, clamp, n_pairs, k, x_stride, &pick, blockIdx.x); \
}
#define MOE_DOWN_ROWS_KERNEL(kname, F, TABLE, ACT) \
extern "C" __global__ void kname(const uint8_t* W, const int* ids, const float* h, const float* add, \
                                 const float* mix, const float* hc_x, float* out, int n_slots, int n_experts, \
                                 int dim, int ff, int rows_per_block, int hc) { \
    extern __shared__ __align__(16) uint8_t moe_smem[]; \
    __shared__ __align__(16) uint64_t grid_s[TABLE ? 512 : 1]; \
    pdl_wait(); \
    pdl_launch_dependents(); \
    if (TABLE) moe_load_tables<ACT>(grid_s); \
    moe_down_rows_impl<F, ACT>(moe_smem, TABLE ? grid_s : nullptr, W, ids, h, add, mix, hc_x, out, n_slots, \
                               n_experts, dim, ff, rows_per_block, hc, blockIdx.x); \
}

// h[s, r] for rows r of expert ids[s]. Launch: grid (ceil(ff / rows_per_block), n_slots), block (32 * ceil(G * RL /
// 32)), dynamic shared memory moe_smem_bytes.
#define MOE_GATE_UP(name, F, QK, NB, TABLE) \
    MOE_GATE_UP_KERNEL(moe_gate_up_##name, F, TABLE, MoeActF)

// y or X' rows [r0, r0 + rows_per_block) summed over the n_slots experts. Launch: grid (ceil(dim / rows_per_block)),
// block (32 * ceil(G * RL / 32)), dynamic shared memory moe_smem_bytes.
#define MOE_DOWN(name, F, QK, NB, TABLE) \
    MOE_DOWN_KERNEL(moe_down_##name, F, TABLE, MoeActF)

// out[32g + j] = value j of column group g (n_groups groups of 32 from the start of W). Launch: grid
// (ceil(n_groups / 256)), block (256).
#define MOE_DEQUANT(name, F, QK, NB, TABLE) \
extern "C" __global__ void moe_dequant_##name(const uint8_t* W, float* out, int n_groups) { \
    pdl_wait(); \
    pdl_launch_dependents(); \
    moe_dequant_impl<F>(TABLE ? moe_iq2xxs_grid : nullptr, W, out, n_groups); \
}

MOE_FORMATS(MOE_GATE_UP)
MOE_FORMATS(MOE_DOWN)
MOE_FORMATS(MOE_DEQUANT)

// ---- int8 activations (Numerics.act_quant): moe_gate_up_i8_<fmt> / moe_down_i8_<fmt> (MOE_I8_FORMATS, with
// the activation structs above) take the decode kernels' contracts, launches and geometry exactly, x / h rounded
// inside (MoeActI8::load), so the engine needs no other buffer.
// As moe_gate_up_<fmt>, x rounded as Q8_K. Launch: as moe_gate_up_<fmt>.
#define MOE_GATE_UP_I8(name, F, QK, NB, TABLE) \
    MOE_GATE_UP_KERNEL(moe_gate_up_i8_##name, F, TABLE, MoeActI8)

// As moe_down_<fmt>, each slot's h rounded as Q8_K. Launch: as moe_down_<fmt>.
#define MOE_DOWN_I8(name, F, QK, NB, TABLE) \
    MOE_DOWN_KERNEL(moe_down_i8_##name, F, TABLE, MoeActI8)

MOE_I8_FORMATS(MOE_GATE_UP_I8)
MOE_I8_FORMATS(MOE_DOWN_I8)

// ---- several rows: the grouped gate + up and the per-row down, one launch each -------------------
// moe_gate_up_rows_<fmt>: grid (ceil(ff / rows_per_block), distinct experts at most: min(n_pairs, n_experts) or k
// with ids null), smem moe_smem_bytes with the stage and the partial sums side by side. moe_down_rows_<fmt>:
// grid (ceil(dim / rows_per_block), rows), smem as moe_down_<fmt>.

// Grouped gate + up of nx rows. Launch: grid (ceil(ff / rows_per_block), distinct experts at most), smem moe_rows_plan.
#define MOE_GATE_UP_ROWS(name, F, QK, NB, TABLE) \
    MOE_GATE_UP_ROWS_KERNEL(moe_gate_up_rows_##name, F, TABLE, MoeActF)

// Per-row down of nx rows. Launch: grid (ceil(dim / rows_per_block), nx), smem as moe_down.
#define MOE_DOWN_ROWS(name, F, QK, NB, TABLE) \
    MOE_DOWN_ROWS_KERNEL(moe_down_rows_##name, F, TABLE, MoeActF)

MOE_FORMATS(MOE_GATE_UP_ROWS)
MOE_FORMATS(MOE_DOWN_ROWS)

// int8 activations, several rows: moe_gate_up_rows_i8_<fmt> / moe_down_rows_i8_<fmt> (MOE_I8_FORMATS) are the
// grouped / per-row kernels above with each pair's x / each slot's h rounded as Q8_K (MoeActI8): a (row, slot)
// pair runs exactly moe_gate_up_i8_<fmt>'s / moe_down_i8_<fmt>'s arithmetic, so a row of a multi-row step is
// bit-identical to its single step (tests/test_cu_emu_act_quant.py). Launch: as the fp32 rows kernels.
#define MOE_GATE_UP_ROWS_I8(name, F, QK, NB, TABLE) \
    MOE_GATE_UP_ROWS_KERNEL(moe_gate_up_rows_i8_##name, F, TABLE, MoeActI8)

// As moe_down_rows_<fmt>, each slot's h rounded as Q8_K. Launch: as moe_down_rows_<fmt>.
#define MOE_DOWN_ROWS_I8(name, F, QK, NB, TABLE) \
    MOE_DOWN_ROWS_KERNEL(moe_down_rows_i8_##name, F, TABLE, MoeActI8)

MOE_I8_FORMATS(MOE_GATE_UP_ROWS_I8)
MOE_I8_FORMATS(MOE_DOWN_ROWS_I8)

// ---- VQ-8 (MOE_VQ_FORMATS): the same four kernels, persistent; each matrix's device copy starts with the layer's
// codebook (KC codewords x 8 E4M3 bytes), copied once per block into the first KC * 8 bytes of the dynamic shared
// memory (cp.async, before pdl_wait: weights), the stage follows it (ds4py/cuda/ops/experts.py adds them in
// launch_smem). A block then loops over row tiles bx = blockIdx.x, blockIdx.x + gridDim.x, ... < tiles (the
// grid is one wave: ops/experts.py sizes gridDim.x from the device), so a launch reads the codebook from L2 once
// per resident block, not once per tile; a tile's arithmetic is the one-block-per-tile kernel's exactly (the same
// impl), so the bits do not depend on the grid. A group's dot reads its 4 codewords from there; the row gain
// scales each group's sum (MoeStageVq). Every width 6 .. 13 bits; at 13 the codebook is 64 KiB and the stage
// budget is what is left of GB10's 101,376 B per block (ops/experts.py vq_budget).
__device__ __forceinline__ const uint64_t* moe_load_codebook(uint8_t* smem, const uint8_t* W, int kc) {
    for (int i = threadIdx.x; i < kc / 2; i += blockDim.x) cp_async_16(smem + 16 * i, W + 16 * i);
    cp_async_commit();                            // complete at the first tile's cp_async_wait_all + barrier
    return reinterpret_cast<const uint64_t*>(smem);
}

// The row tiles of block blockIdx.x: fn(bx) for bx = blockIdx.x, + gridDim.x, ... < tiles, a barrier between two
// (the next stage overwrites what the previous tile's epilogue reads); every thread runs the same tiles.
template <typename Fn> __device__ __forceinline__ void moe_tiles(int tiles, Fn fn) {
    for (int bx = blockIdx.x; bx < tiles; bx += gridDim.x) {
        if (bx != (int)blockIdx.x) __syncthreads();
        fn(bx);
    }
    cp_async_wait_all();                          // no copy outlives the block (every tile may have had a bad id)
}

// The decode pair's ring: two stage buffers of `buf` bytes at smem; tile i's rows are issued into buffer i % 2
// while tile i - 1 is computed from the other (cp_async_wait<1> leaves only the newest tile's copies in flight),
// so the loads of tile i + 1 overlap the math of tile i. issue(bx, dst) starts tile bx's copies (nothing for a bad
// id); run(bx, src) computes it from its buffer (MOE_STAGED). Every thread runs the same tiles.
template <typename Issue, typename Run>
__device__ __forceinline__ void moe_ring(uint8_t* smem, int buf, int tiles, Issue issue, Run run) {
    int i = 0;
    if ((int)blockIdx.x < tiles) issue((int)blockIdx.x, smem);
    cp_async_commit();
    for (int bx = blockIdx.x; bx < tiles; bx += gridDim.x, ++i) {
        if (bx + (int)gridDim.x < tiles) issue(bx + (int)gridDim.x, smem + ((i + 1) & 1) * buf);
        cp_async_commit();
        cp_async_wait<1>();                       // tile bx's copies (and the codebook's) have landed
        __syncthreads();
        run(bx, smem + (i & 1) * buf);
        __syncthreads();                          // its buffer is issued into again two tiles on
    }
    cp_async_wait_all();
}

// One ring buffer: the stage of `spans` row spans or the partial sums (sums rows per block row), 16-byte rounded
// (ops/experts.py ring_bytes).
template <int F> __device__ __forceinline__ int moe_ring_bytes(int rows_per_block, int cols, int spans, int sums) {
    const int stage = spans * MoeStage<F>::room(rows_per_block, cols);
    const int partial = 4 * sums * rows_per_block * (cols / 32 + 1);
    return ((stage > partial ? stage : partial) + 15) & ~15;
}

// As moe_gate_up_<fmt>, Wg / Wu the VQ device copies. Launch: grid (persistent: min(ceil(ff / rows_per_block),
// one wave / n_slots), n_slots), block as moe_gate_up_<fmt>, dynamic shared memory KC * 8 + 2 ring buffers.
#define MOE_VQ_GATE_UP(name, F, QK, NB, KC) \
extern "C" __global__ void moe_gate_up_##name(const uint8_t* Wg, const uint8_t* Wu, const float* x, const int* ids, \
                                              const float* route_w, float* h, int n_experts, int ff, int dim, \
                                              int rows_per_block, float clamp) { \
    extern __shared__ __align__(16) uint8_t moe_smem[]; \
    const uint64_t* cb = moe_load_codebook(moe_smem, Wg, KC); \
    pdl_wait(); \
    pdl_launch_dependents(); \
    const uint8_t* wg = Wg + 8 * KC; \
    const uint8_t* wu = Wu + 8 * KC; \
    const int e = ids ? ids[blockIdx.y] : (int)blockIdx.y; \
    moe_ring(moe_smem + 8 * KC, moe_ring_bytes<F>(rows_per_block, dim, 2, 2), \
        (ff + rows_per_block - 1) / rows_per_block, \
        [&](int bx, uint8_t* dst) { \
            const int r0 = bx * rows_per_block, nr = min(rows_per_block, ff - r0); \
            if (e < 0 || e >= n_experts) return; \
            MoeStage<F>::stage(dst, wg, e, r0, nr, n_experts, ff, dim, true); \
            MoeStage<F>::stage(dst + MoeStage<F>::room(nr, dim), wu, e, r0, nr, n_experts, ff, dim, true); \
        }, \
        [&](int bx, uint8_t* src) { \
            moe_gate_up_impl<F>(src, cb, wg, wu, x, ids, route_w, h, n_experts, ff, dim, rows_per_block, clamp, bx, \
                                MOE_STAGED); \
        }); \
}

// As moe_down_<fmt>, W the VQ device copy. Launch: grid (persistent: min(ceil(dim / rows_per_block), one wave)),
// block as moe_down_<fmt>, dynamic shared memory KC * 8 + 2 ring buffers.
#define MOE_VQ_DOWN(name, F, QK, NB, KC) \
extern "C" __global__ void moe_down_##name(const uint8_t* W, const int* ids, const float* h, const float* add, \
                                           const float* hc_post, const float* hc_comb, const float* hc_x, \
                                           float* out, int n_slots, int n_experts, int dim, int ff, \
                                           int rows_per_block, int hc) { \
    extern __shared__ __align__(16) uint8_t moe_smem[]; \
    const uint64_t* cb = moe_load_codebook(moe_smem, W, KC); \
    pdl_wait(); \
    pdl_launch_dependents(); \
    const uint8_t* w = W + 8 * KC; \
    moe_ring(moe_smem + 8 * KC, moe_ring_bytes<F>(rows_per_block, ff, n_slots, 1), \
        (dim + rows_per_block - 1) / rows_per_block, \
        [&](int bx, uint8_t* dst) { \
            const int r0 = bx * rows_per_block, nr = min(rows_per_block, dim - r0); \
            const int room = MoeStage<F>::room(nr, ff); \
            for (int s = 0; s < n_slots; ++s) { \
                const int e = ids ? ids[s] : s; \
                if (e >= 0 && e < n_experts) \
                    MoeStage<F>::stage(dst + s * room, w, e, r0, nr, n_experts, dim, ff, true); \
            } \
        }, \
        [&](int bx, uint8_t* src) { \
            moe_down_impl<F>(src, cb, w, ids, h, add, hc_post, hc_comb, hc_x, out, n_slots, n_experts, dim, ff, \
                             rows_per_block, hc, bx, MOE_STAGED); \
        }); \
}

// As moe_gate_up_rows_<fmt>. Launch: grid (persistent: min(ceil(ff / rows_per_block), one wave / groups), groups
// as moe_gate_up_rows_<fmt>), dynamic shared memory KC * 8 + moe_rows_plan.
#define MOE_VQ_GATE_UP_ROWS(name, F, QK, NB, KC) \
extern "C" __global__ void moe_gate_up_rows_##name(const uint8_t* Wg, const uint8_t* Wu, const float* x, \
                                                   const int* ids, const float* route_w, float* h, int n_experts, \
                                                   int ff, int dim, int rows_per_block, float clamp, int n_pairs, \
                                                   int k, int x_stride) { \
    extern __shared__ __align__(16) uint8_t moe_smem[]; \
    __shared__ int pick; \
    const uint64_t* cb = moe_load_codebook(moe_smem, Wg, KC); \
    pdl_wait(); \
    pdl_launch_dependents(); \
    moe_tiles((ff + rows_per_block - 1) / rows_per_block, [&](int bx) { \
        moe_gate_up_rows_impl<F>(moe_smem + 8 * KC, cb, Wg + 8 * KC, Wu + 8 * KC, x, ids, route_w, h, n_experts, \
                                 ff, dim, rows_per_block, clamp, n_pairs, k, x_stride, &pick, bx); \
    }); \
}

// As moe_down_rows_<fmt>. Launch: grid (persistent: min(ceil(dim / rows_per_block), one wave / nx), nx), dynamic
// shared memory as moe_down_<vq>.
#define MOE_VQ_DOWN_ROWS(name, F, QK, NB, KC) \
extern "C" __global__ void moe_down_rows_##name(const uint8_t* W, const int* ids, const float* h, const float* add, \
                                                const float* mix, const float* hc_x, float* out, int n_slots, \
                                                int n_experts, int dim, int ff, int rows_per_block, int hc) { \
    extern __shared__ __align__(16) uint8_t moe_smem[]; \
    const uint64_t* cb = moe_load_codebook(moe_smem, W, KC); \
    pdl_wait(); \
    pdl_launch_dependents(); \
    moe_tiles((dim + rows_per_block - 1) / rows_per_block, [&](int bx) { \
        moe_down_rows_impl<F>(moe_smem + 8 * KC, cb, W + 8 * KC, ids, h, add, mix, hc_x, out, n_slots, n_experts, \
                              dim, ff, rows_per_block, hc, bx); \
    }); \
}

MOE_VQ_FORMATS(MOE_VQ_GATE_UP)
MOE_VQ_FORMATS(MOE_VQ_DOWN)
MOE_VQ_FORMATS(MOE_VQ_GATE_UP_ROWS)
MOE_VQ_FORMATS(MOE_VQ_DOWN_ROWS)
