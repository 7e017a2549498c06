// Prefill attention of V4 Flash for a block of T query rows of one sequence at positions pos[0] .. pos[T-1]
// (consecutive, pos[t] = pos[0] + t; MODEL.md §2.3, ds4py/ref/forward.attention over a chunk):
//   prefill_kv_rows     kv rows of the block: RMSNorm(wkv x; kv_norm), RoPE at pos[t], FP8 fake-quant of the non-rope
//                       dims, optional F16 rounding -> blk [T, hd] (the same arithmetic as attn_kv_store)
//   attn_prefill        per (head group, query row): one pass over the query's keys with a running softmax (max,
//                       sum, weighted V in fp32), the sink in the denominator, then the inverse RoPE -> out [T, H, hd]
//   prefill_ring_store  the block's last min(T, ring) kv rows into the window ring (after every query read it)
// The keys of query t at p = pos[t] (block_keys: see attn_prefill): the window positions max(0, p-W+1) .. p -
// those before the block from the ring (slot position % ring, still holding them: the ring is written only after
// the attention), those inside it from blk - then the compressed rows: all (p+1)/ratio visible ones (ratio 128) or
// the indexer's selection sel[t, 0 .. min(topk, visible)) (ratio 4). Keys in a fixed order (window oldest first, then
// compressed), so the result is deterministic; K = V = the same row, so one staged row serves every head of the
// block for both products.
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"
#include "attention.cuh"

// Geometry (-D values from ds4py/cuda/ops/prefill_attn.py DEFINES): PFA_MAX_HD the largest head dim, PFA_TILE keys
// staged per tile, PFA_HPW heads per warp.
#ifndef PFA_MAX_HD
#error "PFA_MAX_HD comes from the DEFINES table of ds4py/cuda/ops/prefill_attn.py"
#endif
#ifndef PFA_TILE
#error "PFA_TILE comes from the DEFINES table of ds4py/cuda/ops/prefill_attn.py"
#endif
#ifndef PFA_HPW
#error "PFA_HPW comes from the DEFINES table of ds4py/cuda/ops/prefill_attn.py"
#endif

// kv_raw [T, hd] (the wkv GEMV rows) -> blk [T, hd]: row t as attn_kv_store computes it at pos[t].
// Launch: grid (T), block (32 * ceil(hd / 64)); thread i holds dims (2i, 2i+1) of row blockIdx.x.
extern "C" __global__ void prefill_kv_rows(const float* kv_raw, const float* norm_w, const float* freqs,
                                           const int* pos, float* blk, int hd, int rd, float eps, int fake_quant,
                                           int round_f16) {
    __shared__ float part[32];
    pdl_wait();
    pdl_launch_dependents();
    const int t = threadIdx.x, row = blockIdx.x, p = pos[row], nope = hd - rd;
    const bool live = 2 * t < hd;
    const size_t o = (size_t)row * hd;
    float2 v = live ? reinterpret_cast<const float2*>(kv_raw + o)[t] : make_float2(0.0f, 0.0f);
    const float r = rsqrtf(block_sum(v.x * v.x + v.y * v.y, part) / (float)hd + eps);
    if (live) {
        const float2 w = reinterpret_cast<const float2*>(norm_w)[t];
        v = make_float2(v.x * r * w.x, v.y * r * w.y);
        if (2 * t >= nope) v = ds4_rope_pair(v, p, freqs[t - nope / 2], false);
    }
    if (fake_quant && 64 * (t / 32 + 1) <= nope) v = ds4_fp8_block64(v);     // whole warps: uniform branch
    if (round_f16) v = make_float2(__half2float(__float2half_rn(v.x)), __half2float(__float2half_rn(v.y)));
    if (live) reinterpret_cast<float2*>(blk + o)[t] = v;
}

// ring[pos[j] % ring_rows] = blk[j] for the block's last min(T, ring_rows) rows j.
// Launch: grid (min(T, ring_rows)), block (any multiple of 32); block b copies row T - kept + b.
extern "C" __global__ void prefill_ring_store(const float* blk, int n_tok, const int* pos, float* ring, int ring_rows,
                                              int hd) {
    pdl_wait();
    pdl_launch_dependents();
    const int kept = min(n_tok, ring_rows);
    const int j = n_tok - kept + (int)blockIdx.x;
    const float2* src = reinterpret_cast<const float2*>(blk + (size_t)j * hd);
    float2* dst = reinterpret_cast<float2*>(ring + (size_t)(pos[j] % ring_rows) * hd);
    for (int i = threadIdx.x; i < hd / 2; i += blockDim.x) dst[i] = src[i];
}

#define PFA_PAIRS (PFA_MAX_HD / 64)
#define PFA_NEG_INF (-__int_as_float(0x7f800000))

// Key j of query row t (see the top): window rows, then compressed rows.
struct PfaKeys {
    const float* ring;
    const float* blk;
    const float* comp;
    const int* sel;
    int ring_rows, hd, n_win, first_pos, p0;

    __device__ __forceinline__ const float* row(int j) const {
        if (j < n_win) {
            const int q = first_pos + j;
            return q >= p0 ? blk + (size_t)(q - p0) * hd : ring + (size_t)(q % ring_rows) * hd;
        }
        const int c = j - n_win;
        return comp + (size_t)(sel ? max(sel[c], 0) : c) * hd;      // a dropped pick (-1) stages row 0, unused
    }

    // a selection entry -1 (V4.1: a pick outside the candidate blocks, v41_drop_masked) is no key
    __device__ __forceinline__ bool live(int j) const { return j < n_win || !sel || sel[j - n_win] >= 0; }
};

// q_raw [T, H, hd] (the wq_b GEMV rows): per head RMS (no weight), RoPE at pos[t], times `scale`; keys as above
// (ring [ring_rows, hd] the state's window ring, blk [T, hd] from prefill_kv_rows, comp [rows, hd], sel [T, topk] or
// null, ratio 0: window only); out [T, H, hd] = attention with sink, then the inverse RoPE on the last rd dims.
// Needs hd % 8 == 0, hd <= PFA_MAX_HD, hd - rd even; ring, blk, comp, q_raw 16-byte aligned.
// block_keys > 0 (V4.1's DSpark draft, pos[0] = t + 1): every query row instead sees the ring's positions
// max(0, t - window + 1) .. t, then blk's first block_keys rows (the whole block, no causal mask; ratio, comp and
// sel unused).
// Launch: grid (ceil(H / (PFA_HPW * warps)), T), block (32 * warps), dynamic shared memory
//   (PFA_TILE * (hd + 4) + warps * PFA_HPW * (hd + PFA_TILE)) * 4 bytes. Block (y, t): query row t, heads
//   (y * warps + warp) * PFA_HPW + 0..PFA_HPW-1; lanes split a tile's keys (lane & 15 = key, lane >> 4 = half of the
//   dims) for q.k and the dims for p.v.
extern "C" __global__ void attn_prefill(const float* q_raw, const float* freqs, const int* pos, const float* ring,
                                        int ring_rows, const float* blk, int window, const float* comp, int ratio,
                                        const int* sel, int topk, const float* sinks, float* out, int n_heads, int hd,
                                        int rd, float eps, float scale, int q_norm, int block_keys) {
    extern __shared__ __align__(16) float pfa_smem[];
    __shared__ float2 rope_cs[PFA_MAX_HD / 2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int stride = hd + 4, half = hd / 2, nope = hd - rd, t = blockIdx.y;
    float* ktile = pfa_smem;                                               // [PFA_TILE][hd + 4]
    float* qs = pfa_smem + PFA_TILE * stride + warp * PFA_HPW * hd;        // this warp's [PFA_HPW][hd]
    float* ps = pfa_smem + PFA_TILE * stride + warps * PFA_HPW * hd + warp * PFA_HPW * PFA_TILE;
    pdl_wait();
    pdl_launch_dependents();

    const int p = pos[t];
    PfaKeys keys;
    keys.ring = ring;
    keys.blk = blk;
    keys.comp = comp;
    keys.sel = sel ? sel + (size_t)t * topk : nullptr;
    keys.ring_rows = ring_rows;
    keys.hd = hd;
    keys.n_win = min(p + 1, window);
    keys.first_pos = p + 1 - keys.n_win;
    keys.p0 = pos[0];
    if (block_keys > 0) {        // DSpark: the ring's positions before the block, then all block keys (no mask)
        keys.n_win = min(keys.p0, window);
        keys.first_pos = keys.p0 - keys.n_win;
        keys.comp = blk;
        keys.sel = nullptr;
    }
    int n_comp = block_keys > 0 ? block_keys : ratio > 0 ? (p + 1) / ratio : 0;
    if (keys.sel) n_comp = min(n_comp, topk);
    const int n_keys = keys.n_win + n_comp;
    const int h0 = (blockIdx.x * warps + warp) * PFA_HPW;
    for (int i = threadIdx.x; i < rd / 2; i += blockDim.x) {
        float sn, cs;
        ds4_sincos((float)p * freqs[i], &sn, &cs);
        rope_cs[i] = make_float2(cs, sn);
    }
    __syncthreads();

#pragma unroll
    for (int i = 0; i < PFA_HPW; ++i) {
        const int h = h0 + i;
        float2* qd = reinterpret_cast<float2*>(qs + i * hd);
        if (h < n_heads) {                                                 // warp-uniform
            const float2* qr = reinterpret_cast<const float2*>(q_raw + ((size_t)t * n_heads + h) * hd);
            float ss = 0.0f;
            for (int pp = lane; pp < half; pp += 32) {
                const float2 v = qr[pp];
                ss += v.x * v.x + v.y * v.y;
            }
            const float r = q_norm ? rsqrtf(warp_sum(ss) / (float)hd + eps) : 1.0f;   // V4.1: no q norm
            for (int pp = lane; pp < half; pp += 32) {
                float2 v = qr[pp];
                v = make_float2(v.x * r, v.y * r);
                if (2 * pp >= nope) {
                    const float2 cs = rope_cs[pp - nope / 2];
                    v = ds4_rotate(v, cs.x, cs.y, false);
                }
                qd[pp] = make_float2(v.x * scale, v.y * scale);
            }
        } else {
            for (int pp = lane; pp < half; pp += 32) qd[pp] = make_float2(0.0f, 0.0f);
        }
    }
    __syncwarp();

    float2 o[PFA_HPW][PFA_PAIRS];
    float m_run[PFA_HPW], l_run[PFA_HPW];
#pragma unroll
    for (int i = 0; i < PFA_HPW; ++i) {
        m_run[i] = PFA_NEG_INF;
        l_run[i] = 0.0f;
#pragma unroll
        for (int pp = 0; pp < PFA_PAIRS; ++pp) o[i][pp] = make_float2(0.0f, 0.0f);
    }

    const int tpr = blockDim.x / PFA_TILE;           // staging threads per key row
    const int kl = lane & 15, kh = lane >> 4;
    for (int base = 0; base < n_keys; base += PFA_TILE) {
        __syncthreads();                             // the previous tile is no longer read
        attn_stage_tile(ktile, keys, base, n_keys, hd, stride, tpr);
        __syncthreads();

        float s[PFA_HPW];
        attn_half_scores<PFA_HPW>(s, ktile, qs, kl, kh, hd, stride);
        const bool valid = base + kl < n_keys && keys.live(base + kl);
#pragma unroll
        for (int i = 0; i < PFA_HPW; ++i) {
            s[i] += __shfl_xor_sync(DS4_FULL_MASK, s[i], 16);
            if (!valid) s[i] = PFA_NEG_INF;
            float mt = s[i];
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) mt = fmaxf(mt, __shfl_xor_sync(DS4_FULL_MASK, mt, off));
            const float mn = fmaxf(m_run[i], mt);    // every query has its own window row: mn is finite
            const float corr = expf(m_run[i] - mn);
            const float pr = expf(s[i] - mn);
            float lt = pr;
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) lt += __shfl_xor_sync(DS4_FULL_MASK, lt, off);
            l_run[i] = l_run[i] * corr + lt;
            m_run[i] = mn;
#pragma unroll
            for (int pp = 0; pp < PFA_PAIRS; ++pp) o[i][pp] = make_float2(o[i][pp].x * corr, o[i][pp].y * corr);
            if (lane < PFA_TILE) ps[i * PFA_TILE + lane] = pr;
        }
        __syncwarp();

        for (int j = 0; j < PFA_TILE; j += 4) {
            float4 pj[PFA_HPW];
#pragma unroll
            for (int i = 0; i < PFA_HPW; ++i) pj[i] = *reinterpret_cast<const float4*>(ps + i * PFA_TILE + j);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const float2* vr = reinterpret_cast<const float2*>(ktile + (j + jj) * stride);
#pragma unroll
                for (int pp = 0; pp < PFA_PAIRS; ++pp) {
                    const int d2 = lane + 32 * pp;
                    if (d2 < half) {
                        const float2 v = vr[d2];
#pragma unroll
                        for (int i = 0; i < PFA_HPW; ++i) {
                            const float w = jj == 0 ? pj[i].x : jj == 1 ? pj[i].y : jj == 2 ? pj[i].z : pj[i].w;
                            o[i][pp] = make_float2(o[i][pp].x + w * v.x, o[i][pp].y + w * v.y);
                        }
                    }
                }
            }
        }
        __syncwarp();                                // ps is rewritten by the next tile
    }

    // the sink joins the denominator; then the inverse RoPE of the rope dims (cos, sin of pos as for q)
#pragma unroll
    for (int i = 0; i < PFA_HPW; ++i) {
        const int h = h0 + i;
        if (h >= n_heads) continue;                  // warp-uniform
        const float L = l_run[i] + expf(sinks[h] - m_run[i]);
        float2* po = reinterpret_cast<float2*>(out + ((size_t)t * n_heads + h) * hd);
#pragma unroll
        for (int pp = 0; pp < PFA_PAIRS; ++pp) {
            const int d2 = lane + 32 * pp;
            if (d2 < half) {
                float2 v = make_float2(o[i][pp].x / L, o[i][pp].y / L);
                if (2 * d2 >= nope) {
                    const float2 cs = rope_cs[d2 - nope / 2];
                    v = ds4_rotate(v, cs.x, cs.y, true);
                }
                po[d2] = v;
            }
        }
    }
}

// h[i] = silu(min(g[i], c)) * clamp(u[i], -c, c) for n values (clamp <= 0: no clamp): the shared expert's SwiGLU
// between its tensor-core gate / up and down products (the same expression as cu/gemv.cu's SwiGLU epilogue).
// Launch: grid (ceil(n / 256)), block (256).
extern "C" __global__ void prefill_swiglu(const float* g, const float* u, float* h, int n, float clamp) {
    pdl_wait();
    pdl_launch_dependents();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gv = g[i], uv = u[i];
    if (clamp > 0.0f) {
        gv = fminf(gv, clamp);
        uv = fminf(fmaxf(uv, -clamp), clamp);
    }
    h[i] = gv / (1.0f + expf(-gv)) * uv;
}

// Round to the nearest bf16 (ties to even), kept as a float.
__device__ __forceinline__ float pf_bf16_round(float v) {
    const unsigned u = __float_as_uint(v);
    if ((u & 0x7f800000u) == 0x7f800000u) return v;                  // inf / NaN unchanged
    return __uint_as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

// x = p0 + p1 (+ p2) + r, each piece the bf16 rounding (to nearest even) of what the ones before leave: with
// three pieces every finite float32 whose pieces stay normal is exact (8 + 8 + 8 significant bits), with two
// |r| <= 2^-17 |x|. The tensor-core GEMM multiplies bf16 x exactly against exact weights, so a dense product
// accumulated over the pieces sees x to 24 (16) significant bits instead of 8. Inf / NaN go to p0 (others 0).
// Launch: grid (ceil(n / 256)), block (256).
extern "C" __global__ void prefill_split_bf16(const float* x, float* p0, float* p1, float* p2, int n, int pieces) {
    pdl_wait();
    pdl_launch_dependents();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float v = x[i], h = pf_bf16_round(v);
    const bool finite = h - h == 0.0f;
    const float r1 = finite ? v - h : 0.0f;                        // exact (Sterbenz)
    const float m = pf_bf16_round(r1);
    p0[i] = h;
    p1[i] = m;
    if (pieces > 2) p2[i] = pf_bf16_round(r1 - m);
}
