// The kernels only V4.1 Flash needs (MODEL.md §3; ds4py/ref/forward.py and ds4py/ref/v41.py are the reference,
// ds4py/cuda/twins/v41.py the numpy twins). Every kernel takes its rows' positions from an int32 array (the row
// set's slot), so one recording serves decode (one row), multi-row steps (one launch per row) and prefill blocks.
//   v41_kv_rows         kv = RMSNorm(wkv x; kv_norm), RoPE, FP8 fake-quant over the whole row in blocks of 32
//                       -> the window ring (ring > 0) or row r of a block buffer (ring 0)
//   v41_index_q         indexer queries: RoPE, FP4 fake-quant in blocks of 32 (no Hadamard)
//   v41_compress        a kv source's compressor, no ape or overlap: ratio r > 1 pools group g = (pos+1)/r - 1
//                       through the gate's per-channel softmax (ratio 1: the row itself), RMSNorm, then the
//                       pre-RoPE latent out (index-key owners) and RoPE at g*r + NVFP4-like fake-quant -> rows[g]
//   v41_comp_ring_store the compressor's inputs into its rings (after v41_compress: a block pools first)
//   v41_index_keys      an owner's indexer keys from wk . latent: RMSNorm(k_norm), RoPE at g*r, FP4 -> keys[g]
//   v41_candidates      the candidate source's blocks (best row per block, the newest block pinned, the top n kept
//                       by radix select over the block scores: O(visible rows) per pass)
//                       -> cand[0..n) (1 inside), or (mask) scores outside cand set to -inf
//   v41_drop_masked     after the top-k of masked scores: a pick whose score is -inf (outside the candidates, taken
//                       only when they hold fewer rows than k) becomes -1, which the attention kernels skip
//   v41_engram_rows     Engram's table rows as staged (FP8 e4m3 codes + one e8m0 scale per 32) -> f32, rounded to
//                       bf16 as the official lookup returns them
//   v41_engram          Engram's gate: X[t, j] += sigmoid(signed sqrt(dot_j)) * value[t] (in place)
// Layout of the row kernels: thread t holds the pair of dims (2t, 2t+1) (attention.cuh's convention), so 8 lanes
// hold an NVFP4 block of 16, 16 lanes an FP8 / FP4 block of 32.
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"
#include "attention.cuh"

#define V41_NEG_INF (-__int_as_float(0x7f800000))
#define V41_POS_INF (__int_as_float(0x7f800000))
#define V41_NVFP4_AMAX_FLOOR 0x1.8p-7f          // ops.nvfp4_fake_quant: amax floored at 6 * 2^-9

// Max of |v| over aligned groups of `lanes` lanes (a power of two <= 32), all 32 lanes calling.
__device__ __forceinline__ float v41_group_amax(float2 v, int lanes) {
    float amax = fmaxf(fabsf(v.x), fabsf(v.y));
    for (int o = lanes / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(DS4_FULL_MASK, amax, o));
    return amax;
}

// FP8 e4m3 fake-quant in blocks of 32 dims (16 lanes), scale 2^ceil(log2(amax/448)) (ops.fp8_fake_quant(x, 32)).
__device__ __forceinline__ float2 v41_fp8_block32(float2 v) {
    const float s = ds4_pow2_ceil(fmaxf(v41_group_amax(v, 16), DS4_FP8_AMAX_FLOOR) * (1.0f / 448.0f));
    const float inv = ds4_pow2_inv(s);
    return make_float2(ds4_round_e4m3(v.x * inv) * s, ds4_round_e4m3(v.y * inv) * s);
}

// FP4 e2m1 in blocks of 16 dims (8 lanes) with an e4m3 scale e4m3(amax/6) (ops.nvfp4_fake_quant(x, 16)).
__device__ __forceinline__ float2 v41_nvfp4_block16(float2 v) {
    const float amax = fmaxf(v41_group_amax(v, 8), V41_NVFP4_AMAX_FLOOR);
    const float s = ds4_round_e4m3(fminf(amax / 6.0f, 448.0f));
    return make_float2(ds4_round_e2m1(v.x / s) * s, ds4_round_e2m1(v.y / s) * s);
}

__device__ __forceinline__ float2 v41_f16(float2 v) {
    return make_float2(__half2float(__float2half_rn(v.x)), __half2float(__float2half_rn(v.y)));
}

// RMSNorm (weight w) of the pair held by every thread of the block over d dims, then RoPE at `rope_pos` on the
// last rd dims. Threads with 2t >= d hold zeros and return them.
__device__ __forceinline__ float2 v41_norm_rope(float2 v, const float* w, const float* freqs, int rope_pos, int d,
                                                int rd, float eps, float* part) {
    const int t = threadIdx.x, nope = d - rd;
    const bool live = 2 * t < d;
    const float r = rsqrtf(block_sum(live ? v.x * v.x + v.y * v.y : 0.0f, part) / (float)d + eps);
    if (!live) return make_float2(0.0f, 0.0f);
    const float2 g = reinterpret_cast<const float2*>(w)[t];
    v = make_float2(v.x * r * g.x, v.y * r * g.y);
    if (2 * t >= nope) v = ds4_rope_pair(v, rope_pos, freqs[t - nope / 2], false);
    return v;
}

// Launch: grid (n_rows), block (32 * ceil(hd / 64)). kv_raw [n_rows, hd]; row r at pos[r]; out: the ring
// [ring, hd] (slot pos % ring) or, ring == 0, a block buffer [n_rows, hd].
extern "C" __global__ void v41_kv_rows(const float* kv_raw, const float* norm_w, const float* freqs, const int* pos,
                                       float* out, int ring, int hd, int rd, float eps, int fake_quant,
                                       int round_f16) {
    __shared__ float part[32];
    pdl_wait();
    pdl_launch_dependents();
    const int t = threadIdx.x, r = blockIdx.x, p = pos[r];
    const bool live = 2 * t < hd;
    float2 v = live ? reinterpret_cast<const float2*>(kv_raw + (size_t)r * hd)[t] : make_float2(0.0f, 0.0f);
    v = v41_norm_rope(v, norm_w, freqs, p, hd, rd, eps, part);
    if (fake_quant) v = v41_fp8_block32(v);
    if (round_f16) v = v41_f16(v);
    float* dst = out + (size_t)(ring > 0 ? p % ring : r) * hd;
    if (live) reinterpret_cast<float2*>(dst)[t] = v;
}

// Launch: grid (n_heads, n_rows), block (32 * ceil(ihd / 64)). q_raw, q [n_rows, n_heads, ihd]; row r at pos[r].
extern "C" __global__ void v41_index_q(const float* q_raw, const float* freqs, const int* pos, float* q, int n_heads,
                                       int ihd, int rd, int fake_quant) {
    pdl_wait();
    pdl_launch_dependents();
    const int t = threadIdx.x, nope = ihd - rd, p = pos[blockIdx.y];
    const bool live = 2 * t < ihd;
    const size_t row = ((size_t)blockIdx.y * n_heads + blockIdx.x) * ihd;
    float2 v = live ? reinterpret_cast<const float2*>(q_raw + row)[t] : make_float2(0.0f, 0.0f);
    if (live && 2 * t >= nope) v = ds4_rope_pair(v, p, freqs[t - nope / 2], false);
    if (fake_quant) v = ds4_fp4_block32(v);
    if (live) reinterpret_cast<float2*>(q + row)[t] = v;
}

// Launch: grid (n_rows), block (32 * ceil(d / 64)). The rows are one sequence's consecutive positions pos[0..n);
// kv_in / sc_in [n_rows, d] (sc_in null: ratio 1, no gate); a position before pos[0] is read from the rings
// ring_kv / ring_sc [cap, d] (slot p % cap). Row r completing group g = (pos[r] + 1) / ratio - 1 writes rows[g]
// (g < rows_cap) and, lat not null, its normalised pre-RoPE latent into lat[r]; other rows write nothing.
extern "C" __global__ void v41_compress(const float* kv_in, const float* sc_in, const float* ring_kv,
                                        const float* ring_sc, const float* norm_w, const float* freqs, const int* pos,
                                        float* rows, int rows_cap, float* lat, int ratio, int cap, int d, int rd,
                                        float eps, int fake_quant, int round_f16) {
    __shared__ float part[32];
    pdl_wait();
    pdl_launch_dependents();
    const int t = threadIdx.x, r = blockIdx.x, p = pos[r], p0 = pos[0];
    if ((p + 1) % ratio != 0) return;                   // block-uniform: no group completes at this row
    const int g = (p + 1) / ratio - 1;
    const bool live = 2 * t < d;
    float2 c = make_float2(0.0f, 0.0f);
    if (live) {
        auto load = [&](int q, const float* chunk, const float* ring) {
            const float* src = q >= p0 ? chunk + (size_t)(q - p0) * d : ring + (size_t)(q % cap) * d;
            return reinterpret_cast<const float2*>(src)[t];
        };
        if (sc_in == nullptr) {
            c = load(p, kv_in, ring_kv);
        } else {                                          // per-channel softmax over the group's slots
            float2 m = make_float2(V41_NEG_INF, V41_NEG_INF);
            for (int v = 0; v < ratio; ++v) {
                const float2 s = load(g * ratio + v, sc_in, ring_sc);
                m = make_float2(fmaxf(m.x, s.x), fmaxf(m.y, s.y));
            }
            float2 l = make_float2(0.0f, 0.0f), a = make_float2(0.0f, 0.0f);
            for (int v = 0; v < ratio; ++v) {
                const float2 s = load(g * ratio + v, sc_in, ring_sc), k = load(g * ratio + v, kv_in, ring_kv);
                const float ex = expf(s.x - m.x), ey = expf(s.y - m.y);
                l = make_float2(l.x + ex, l.y + ey);
                a = make_float2(a.x + ex * k.x, a.y + ey * k.y);
            }
            c = make_float2(a.x / l.x, a.y / l.y);
        }
    }
    const float rs = rsqrtf(block_sum(live ? c.x * c.x + c.y * c.y : 0.0f, part) / (float)d + eps);
    if (live) {
        const float2 w = reinterpret_cast<const float2*>(norm_w)[t];
        c = make_float2(c.x * rs * w.x, c.y * rs * w.y);
        if (lat) reinterpret_cast<float2*>(lat + (size_t)r * d)[t] = c;
        if (2 * t >= d - rd) c = ds4_rope_pair(c, g * ratio, freqs[t - (d - rd) / 2], false);
    }
    if (fake_quant) c = v41_nvfp4_block16(c);
    if (round_f16) c = v41_f16(c);
    if (live && g < rows_cap) reinterpret_cast<float2*>(rows + (size_t)g * d)[t] = c;
}

// Launch: grid (any), block (any multiple of 32). The last min(n_rows, cap) rows of kv_in / sc_in [n_rows, d] at
// pos[r] into ring slot pos[r] % cap.
extern "C" __global__ void v41_comp_ring_store(const float* kv_in, const float* sc_in, const int* pos,
                                               float* ring_kv, float* ring_sc, int n_rows, int cap, int d) {
    pdl_wait();
    pdl_launch_dependents();
    const int first = n_rows > cap ? n_rows - cap : 0;
    const size_t n = (size_t)(n_rows - first) * d;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const int r = first + (int)(i / d), ch = (int)(i % d);
        const size_t slot = (size_t)(pos[r] % cap) * d + ch;
        ring_kv[slot] = kv_in[(size_t)r * d + ch];
        ring_sc[slot] = sc_in[(size_t)r * d + ch];
    }
}

// Launch: grid (n_rows), block (32 * ceil(ihd / 64)). k_raw [n_rows, ihd] = wk . latent of row r; a row that
// completes group g = (pos[r] + 1) / ratio - 1 writes keys[g] (g < keys_cap), the others nothing.
extern "C" __global__ void v41_index_keys(const float* k_raw, const float* k_norm, const float* freqs,
                                          const int* pos, float* keys, int keys_cap, int ratio, int ihd, int rd,
                                          float eps, int fake_quant, int round_f16) {
    __shared__ float part[32];
    pdl_wait();
    pdl_launch_dependents();
    const int t = threadIdx.x, r = blockIdx.x, p = pos[r];
    if ((p + 1) % ratio != 0) return;                   // block-uniform
    const int g = (p + 1) / ratio - 1;
    const bool live = 2 * t < ihd;
    float2 v = live ? reinterpret_cast<const float2*>(k_raw + (size_t)r * ihd)[t] : make_float2(0.0f, 0.0f);
    v = v41_norm_rope(v, k_norm, freqs, g * ratio, ihd, rd, eps, part);
    if (fake_quant) v = ds4_fp4_block32(v);
    if (round_f16) v = v41_f16(v);
    if (live && g < keys_cap) reinterpret_cast<float2*>(keys + (size_t)g * ihd)[t] = v;
}

// Block k's score: its best visible row, +inf for the block holding the newest row (`last`).
__device__ __forceinline__ float v41_block_score(const float* s, int k, int n, int block, int last) {
    if (k == last) return V41_POS_INF;
    float m = V41_NEG_INF;
    for (int i = k * block; i < min(n, (k + 1) * block); ++i) m = fmaxf(m, s[i]);
    return m;
}

// Launch: grid (n_rows), block (256). scores [n_rows, stride] (row r at pos[r]: (pos+1)/ratio visible rows).
// mask == 0 (the candidate source): cand[r, i] = 1 for the rows of the n_blocks best blocks of `block` rows (a
// block scored by its best visible row; the block holding the newest row always kept; ties: the lower block
// first), else 0. mask == 1 (an indexer after it): scores[r, i] = -inf where cand[r, i] == 0.
// The n_blocks-th best block score T is found by radix select (four passes of 8-bit histograms over the blocks'
// order-preserving keys, each block's score recomputed from its rows: O(visible rows) a pass, no scratch), then
// one pass in block order keeps the blocks above T and the first of those at T, as cu/topk.cu selects rows.
extern "C" __global__ void v41_candidates(float* scores, int* cand, const int* pos, int stride, int ratio,
                                          int n_blocks, int block, int mask) {
    __shared__ int hist[256];
    __shared__ int wsum[32];
    __shared__ unsigned s_prefix;
    __shared__ int s_remaining;
    pdl_wait();
    pdl_launch_dependents();
    const int r = blockIdx.x, n = (pos[r] + 1) / ratio, tid = threadIdx.x, bd = blockDim.x;
    float* s = scores + (size_t)r * stride;
    int* c = cand + (size_t)r * stride;
    if (mask) {
        for (int i = tid; i < n; i += bd)
            if (!c[i]) s[i] = V41_NEG_INF;
        return;
    }
    const int nb = (n + block - 1) / block, last = n > 0 ? (n - 1) / block : -1;
    const bool take_all = nb <= n_blocks;            // every block with a visible score is kept
    unsigned prefix = 0u, digits = 0u;
    int remaining = n_blocks;                        // blocks still to take at or below the current prefix
    for (int shift = 24; shift >= 0 && !take_all; shift -= 8) {
        for (int i = tid; i < 256; i += bd) hist[i] = 0;
        __syncthreads();
        for (int b = tid; b < nb; b += bd) {
            const unsigned key = order_key(v41_block_score(s, b, n, block, last));
            if ((key & digits) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        if (tid == 0) {                              // the digit holding the remaining-th largest key
            int acc = 0;
            for (int d = 255; d >= 0; --d) {
                if (acc + hist[d] >= remaining) {
                    s_prefix = prefix | ((unsigned)d << shift);
                    s_remaining = remaining - acc;
                    break;
                }
                acc += hist[d];
            }
        }
        __syncthreads();
        prefix = s_prefix;
        remaining = s_remaining;
        digits |= 255u << shift;
    }
    int eq_before = 0;
    for (int base = 0; base < nb; base += bd) {      // uniform trip count: every thread runs every scan
        const int b = base + tid;
        const float mine = b < nb ? v41_block_score(s, b, n, block, last) : V41_NEG_INF;
        const unsigned key = order_key(mine);
        const int eq = !take_all && b < nb && key == prefix;
        int total;
        const int e_ex = eq_before + block_exclusive_scan(eq, wsum, &total);
        eq_before += total;
        if (b < nb) {
            const int keep = mine > V41_NEG_INF && (take_all || key > prefix || (eq && e_ex < remaining));
            for (int i = b * block; i < min(n, (b + 1) * block); ++i) c[i] = keep;
        }
    }
}

// Launch: grid (n_rows), block (32). scores [n_rows, stride], sel [n_rows, k] (topk's picks: the first
// min(k, (pos[r] + 1) / ratio) of each row are read): sel[r, c] = -1 where scores[r, sel[r, c]] is -inf.
extern "C" __global__ void v41_drop_masked(const float* scores, int* sel, const int* pos, int stride, int ratio,
                                           int k) {
    pdl_wait();
    pdl_launch_dependents();
    const int r = blockIdx.x, n = min(k, (pos[r] + 1) / ratio);
    const float* s = scores + (size_t)r * stride;
    int* c = sel + (size_t)r * k;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (s[c[i]] == V41_NEG_INF) c[i] = -1;
}

// Launch: grid (n_rows, hc), block (256). X [n_rows, hc, D] in place; kv [n_rows, (hc + 1) * D] = wkv . rows:
// hc keys then the value; weight [hc, D] = q_w * k_w. Block (r, j):
//   dot = sum(X_j * weight_j * key_j) * rstd(X_j) * rstd(key_j) / sqrt(D), X_j += sigmoid(sign(dot) sqrt(max(|dot|,
//   1e-6))) * value.
extern "C" __global__ void v41_engram(float* X, const float* kv, const float* weight, int D, float eps) {
    __shared__ float part[32];
    pdl_wait();
    pdl_launch_dependents();
    const int r = blockIdx.x, j = blockIdx.y, hc = gridDim.y;
    float* x = X + ((size_t)r * hc + j) * D;
    const float* key = kv + (size_t)r * (hc + 1) * D + (size_t)j * D;
    const float* value = kv + (size_t)r * (hc + 1) * D + (size_t)hc * D;
    const float* w = weight + (size_t)j * D;
    float xx = 0.0f, kk = 0.0f, dt = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        const float a = x[i], k = key[i];
        xx += a * a;
        kk += k * k;
        dt += a * w[i] * k;
    }
    xx = block_sum(xx, part);
    kk = block_sum(kk, part);
    dt = block_sum(dt, part);
    const float rstd = (1.0f / sqrtf(xx / (float)D + eps)) * (1.0f / sqrtf(kk / (float)D + eps));
    const float dot = dt * rstd * (1.0f / sqrtf((float)D));
    const float gate = 1.0f / (1.0f + expf(-copysignf(sqrtf(fmaxf(fabsf(dot), 1e-6f)), dot)));
    __syncthreads();                                     // every thread has read x before any writes it
    for (int i = threadIdx.x; i < D; i += blockDim.x) x[i] += gate * value[i];
}

// Launch: grid (any), block (any multiple of 32). codes [n], scales [n / 32] (e8m0: 2^(s - 127), 255 NaN) ->
// rows [n] = bf16(e4m3(code) * scale) (round to nearest even; engram._bf16).
extern "C" __global__ void v41_engram_rows(const unsigned char* codes, const unsigned char* scales, float* rows,
                                           int n) {
    pdl_wait();
    pdl_launch_dependents();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const unsigned s = scales[i / 32];
        const float scale = s == 255u ? __int_as_float(0x7fc00000)
                                      : (s == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23));
        const unsigned u = __float_as_uint(fp8_e4m3_to_float(codes[i]) * scale);
        rows[i] = __uint_as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
    }
}
