// Decode attention of V4 Flash (MODEL.md §2.3, ds4py/ref/forward.attention for one token):
//   attn_kv_store        kv = RMSNorm(wkv x; kv_norm), RoPE, FP8 fake-quant of the non-rope dims -> window ring
//   attn_decode_partial  per head: q RMS (no weight; q_norm 0, V4.1: none) + RoPE; scores against window rows +
//                        compressed rows, one chunk of keys per block (flash-decoding partials: max, sum,
//                        unnormalised weighted V)
//   attn_decode_combine  merges the chunks with the sink in the denominator, then the inverse RoPE
// The key set of a decode step at position pos (read from the device slot, so a graph replays unchanged):
//   window rows of positions max(0, pos-W+1) .. pos (ring slot = p % ring), then the compressed rows:
//   all (pos+1)/ratio visible rows (ratio 128), or the indexer's selection sel[0 .. min(topk, visible)) (ratio 4);
//   a selection entry -1 (V4.1: a pick outside the candidate blocks, v41_drop_masked) is no key.
// K = V = the same 512-vector, so one staged row serves every head of the block for both products.
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"
#include "attention.cuh"

// Geometry (-D values from ds4py/cuda/ops/attention.py DEFINES): ATTN_MAX_HD the largest head dim (registers per
// lane are sized for it), ATTN_TILE keys staged in shared memory at a time, ATTN_HPW heads per warp (each staged
// key is read once per ATTN_HPW heads).
#ifndef ATTN_MAX_HD
#error "ATTN_MAX_HD comes from the DEFINES table of ds4py/cuda/ops/attention.py"
#endif
#ifndef ATTN_TILE
#error "ATTN_TILE comes from the DEFINES table of ds4py/cuda/ops/attention.py"
#endif
#ifndef ATTN_HPW
#error "ATTN_HPW comes from the DEFINES table of ds4py/cuda/ops/attention.py"
#endif
#ifndef ATTN_COMBINE_SPLITS
#error "ATTN_COMBINE_SPLITS comes from the DEFINES table of ds4py/cuda/ops/attention.py"
#endif
#define ATTN_PAIRS (ATTN_MAX_HD / 64)     // dim pairs per lane in the P.V product
#define ATTN_NEG_INF (-__int_as_float(0x7f800000))

// Window + compressed key rows of one decode step, as one list j = 0 .. n_keys-1.
struct AttnKeys {
    const float* win;
    const float* comp;
    const int* sel;
    int ring, hd, n_win, first_pos;

    __device__ __forceinline__ const float* row(int j) const {
        if (j < n_win) return win + (size_t)((first_pos + j) % ring) * hd;
        const int c = j - n_win;
        return comp + (size_t)(sel ? max(sel[c], 0) : c) * hd;      // a dropped pick (-1) stages row 0, unused
    }

    __device__ __forceinline__ bool live(int j) const { return j < n_win || !sel || sel[j - n_win] >= 0; }
};

// kv_raw [hd] (the wkv GEMV output) -> RMSNorm with norm_w -> RoPE on the last rd dims at pos -> FP8 e4m3
// fake-quant of the first hd-rd dims in blocks of 64 (fake_quant) -> optional F16 rounding (round_f16: ds4's F16
// KV numerics) -> win[pos % ring]. freqs: the layer's rd/2 RoPE frequencies (ops.layer_rope_freqs).
// Needs hd even, hd - rd a multiple of 64 (an FP8 block is one warp), kv_raw / norm_w / win 8-byte aligned.
// Launch: grid (1), block (32 * ceil(hd / 64)); thread t holds dims (2t, 2t+1).
extern "C" __global__ void attn_kv_store(const float* kv_raw, const float* norm_w, const float* freqs,
                                         const int* pos_slot, float* win, int ring, int hd, int rd, float eps,
                                         int fake_quant, int round_f16) {
    __shared__ float part[32];
    const int t = threadIdx.x, nope = hd - rd;
    const bool live = 2 * t < hd;
    // norm_w is a weight: loaded before the wait, under the previous kernel's tail
    const float2 w = live ? reinterpret_cast<const float2*>(norm_w)[t] : make_float2(0.0f, 0.0f);
    pdl_wait();
    pdl_launch_dependents();
    const int pos = pos_slot[0];
    float2 v = live ? reinterpret_cast<const float2*>(kv_raw)[t] : make_float2(0.0f, 0.0f);
    const float r = rsqrtf(block_sum(v.x * v.x + v.y * v.y, part) / (float)hd + eps);
    if (live) {
        v = make_float2(v.x * r * w.x, v.y * r * w.y);
        if (2 * t >= nope) v = ds4_rope_pair(v, pos, freqs[t - nope / 2], false);
    }
    if (fake_quant && 64 * (t / 32 + 1) <= nope) v = ds4_fp8_block64(v);     // whole warps: uniform branch
    if (round_f16) v = make_float2(__half2float(__float2half_rn(v.x)), __half2float(__float2half_rn(v.y)));
    if (live) reinterpret_cast<float2*>(win + (size_t)(pos % ring) * hd)[t] = v;
}

// Decode attention, pass 1. q_raw [H, hd] (the wq_b GEMV output): per head RMS (no weight), RoPE, times `scale`
// (hd^-0.5). Keys as described at the top; comp [rows, hd]; sel null (ratio 128: every visible row) or the
// indexer's indices (ratio 4); ratio 0: window only. Writes, per head h and split s = blockIdx.x:
//   part_ml[(h*splits + s)*2 + {0,1}] = (max score m, sum of exp(score - m)),  part_o[(h*splits + s)*hd + d] =
//   sum exp(score - m) * key[d]; an empty split writes (-inf, 0) and zeros.
// Needs hd % 8 == 0, hd <= ATTN_MAX_HD, hd - rd even; win, comp, q_raw, part_o 16-byte aligned.
// Launch: grid (splits, ceil(H / (4 * warps))), block (32 * warps), dynamic shared memory
//   (16 * (hd + 4) + warps * 4 * (hd + 16)) * 4 bytes. Block (s, y) takes keys [s, s+1) * keys_per_split (a
//   multiple of 16) and heads (y * warps + warp) * 4 + 0..3: warp w holds 4 heads, lanes split the keys of a tile
//   (lane & 15 = key, lane >> 4 = half of the dims) for q.k and the dims for p.v.
extern "C" __global__ void attn_decode_partial(const float* q_raw, const float* freqs, const int* pos_slot,
                                               const float* win, int ring, int window, const float* comp, int ratio,
                                               const int* sel, int topk, float* part_o, float* part_ml,
                                               int n_heads, int hd, int rd, int keys_per_split, float eps,
                                               float scale, int q_norm) {
    extern __shared__ __align__(16) float attn_smem[];
    __shared__ float2 rope_cs[ATTN_MAX_HD / 2];                           // (cos, sin) of pos * freqs[i]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int stride = hd + 4, half = hd / 2, nope = hd - rd;
    float* ktile = attn_smem;                                              // [ATTN_TILE][hd + 4]
    float* qs = attn_smem + ATTN_TILE * stride + warp * ATTN_HPW * hd;     // this warp's [ATTN_HPW][hd]
    float* ps = attn_smem + ATTN_TILE * stride + warps * ATTN_HPW * hd + warp * ATTN_HPW * ATTN_TILE;
    pdl_wait();
    pdl_launch_dependents();

    const int pos = pos_slot[0];
    AttnKeys keys;
    keys.win = win;
    keys.comp = comp;
    keys.sel = sel;
    keys.ring = ring;
    keys.hd = hd;
    keys.n_win = min(pos + 1, window);
    keys.first_pos = pos + 1 - keys.n_win;
    int n_comp = ratio > 0 ? (pos + 1) / ratio : 0;
    if (sel) n_comp = min(n_comp, topk);
    const int n_keys = keys.n_win + n_comp;
    const int k0 = blockIdx.x * keys_per_split, k1 = min(n_keys, k0 + keys_per_split);
    const int h0 = (blockIdx.y * warps + warp) * ATTN_HPW;
    for (int i = threadIdx.x; i < rd / 2; i += blockDim.x) {             // once per block, not per head
        float sn, cs;
        ds4_sincos((float)pos * freqs[i], &sn, &cs);
        rope_cs[i] = make_float2(cs, sn);
    }
    __syncthreads();

    // q for this warp's heads: RMS over the head, RoPE on the last rd dims, times the score scale.
#pragma unroll
    for (int i = 0; i < ATTN_HPW; ++i) {
        const int h = h0 + i;
        float2* qd = reinterpret_cast<float2*>(qs + i * hd);
        if (h < n_heads) {                                                 // warp-uniform
            const float2* qr = reinterpret_cast<const float2*>(q_raw + (size_t)h * hd);
            float ss = 0.0f;
            for (int p = lane; p < half; p += 32) {
                const float2 v = qr[p];
                ss += v.x * v.x + v.y * v.y;
            }
            const float r = q_norm ? rsqrtf(warp_sum(ss) / (float)hd + eps) : 1.0f;   // V4.1: no q norm
            for (int p = lane; p < half; p += 32) {
                float2 v = qr[p];
                v = make_float2(v.x * r, v.y * r);
                if (2 * p >= nope) {
                    const float2 cs = rope_cs[p - nope / 2];
                    v = ds4_rotate(v, cs.x, cs.y, false);
                }
                qd[p] = make_float2(v.x * scale, v.y * scale);
            }
        } else {
            for (int p = lane; p < half; p += 32) qd[p] = make_float2(0.0f, 0.0f);
        }
    }
    __syncwarp();

    float2 o[ATTN_HPW][ATTN_PAIRS];
    float m_run[ATTN_HPW], l_run[ATTN_HPW];
#pragma unroll
    for (int i = 0; i < ATTN_HPW; ++i) {
        m_run[i] = ATTN_NEG_INF;
        l_run[i] = 0.0f;
#pragma unroll
        for (int pp = 0; pp < ATTN_PAIRS; ++pp) o[i][pp] = make_float2(0.0f, 0.0f);
    }

    const int tpr = blockDim.x / ATTN_TILE;          // staging threads per key row
    const int kl = lane & 15, kh = lane >> 4;
    for (int base = k0; base < k1; base += ATTN_TILE) {
        __syncthreads();                             // the previous tile is no longer read
        attn_stage_tile(ktile, keys, base, k1, hd, stride, tpr);     // keys base .. base+15 (past k1: zeros)
        __syncthreads();

        // q.k: lane (kl, kh) sums its half of the dims for key kl, then the two halves are added.
        float s[ATTN_HPW];
        attn_half_scores<ATTN_HPW>(s, ktile, qs, kl, kh, hd, stride);
        const bool valid = base + kl < k1 && keys.live(base + kl);
#pragma unroll
        for (int i = 0; i < ATTN_HPW; ++i) {
            s[i] += __shfl_xor_sync(DS4_FULL_MASK, s[i], 16);
            if (!valid) s[i] = ATTN_NEG_INF;
            // online softmax over the 16 keys (lanes 16..31 mirror lanes 0..15)
            float mt = s[i];
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) mt = fmaxf(mt, __shfl_xor_sync(DS4_FULL_MASK, mt, off));
            const float mn = fmaxf(m_run[i], mt);
            // 0 on the first tile (m_run = -inf); a tile of dropped picks only (V4.1) keeps mn at -inf: no NaN
            const float corr = mn == ATTN_NEG_INF ? 1.0f : expf(m_run[i] - mn);
            const float p = mn == ATTN_NEG_INF ? 0.0f : expf(s[i] - mn);          // 0 for rows past the end
            float lt = p;
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) lt += __shfl_xor_sync(DS4_FULL_MASK, lt, off);
            l_run[i] = l_run[i] * corr + lt;
            m_run[i] = mn;
#pragma unroll
            for (int pp = 0; pp < ATTN_PAIRS; ++pp) o[i][pp] = make_float2(o[i][pp].x * corr, o[i][pp].y * corr);
            if (lane < ATTN_TILE) ps[i * ATTN_TILE + lane] = p;
        }
        __syncwarp();

        // p.v: lane holds dim pairs lane + 32*pp; the weights of 4 keys come as one broadcast float4 per head.
        for (int j = 0; j < ATTN_TILE; j += 4) {
            float4 pj[ATTN_HPW];
#pragma unroll
            for (int i = 0; i < ATTN_HPW; ++i) pj[i] = *reinterpret_cast<const float4*>(ps + i * ATTN_TILE + j);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const float2* vr = reinterpret_cast<const float2*>(ktile + (j + jj) * stride);
#pragma unroll
                for (int pp = 0; pp < ATTN_PAIRS; ++pp) {
                    const int p = lane + 32 * pp;
                    if (p < half) {
                        const float2 v = vr[p];
#pragma unroll
                        for (int i = 0; i < ATTN_HPW; ++i) {
                            const float w = jj == 0 ? pj[i].x : jj == 1 ? pj[i].y : jj == 2 ? pj[i].z : pj[i].w;
                            o[i][pp] = make_float2(o[i][pp].x + w * v.x, o[i][pp].y + w * v.y);
                        }
                    }
                }
            }
        }
        __syncwarp();                                // ps is rewritten by the next tile
    }

    const int splits = gridDim.x;
#pragma unroll
    for (int i = 0; i < ATTN_HPW; ++i) {
        const int h = h0 + i;
        if (h >= n_heads) continue;
        float2* po = reinterpret_cast<float2*>(part_o + ((size_t)h * splits + blockIdx.x) * hd);
#pragma unroll
        for (int pp = 0; pp < ATTN_PAIRS; ++pp) {
            const int p = lane + 32 * pp;
            if (p < half) po[p] = o[i][pp];
        }
        if (lane == 0) {
            part_ml[((size_t)h * splits + blockIdx.x) * 2] = m_run[i];
            part_ml[((size_t)h * splits + blockIdx.x) * 2 + 1] = l_run[i];
        }
    }
}

// Decode attention, pass 2: out[h] = sum_s e^(m_s - M) o_s / (sum_s e^(m_s - M) l_s + e^(sink_h - M)), M = max_s m_s
// (empty splits skipped), then the inverse RoPE on the last rd dims at pos. out [H, hd] feeds the wo_a GEMV.
// Launch: grid (H), block (32 * ceil(hd / 64)); thread t holds dims (2t, 2t+1); splits = partial_o's split count.
extern "C" __global__ void attn_decode_combine(const float* part_o, const float* part_ml, const float* sinks,
                                               const float* freqs, const int* pos_slot, float* out, int hd, int rd,
                                               int splits) {
    const int h = blockIdx.x, t = threadIdx.x, nope = hd - rd;
    const float sink = sinks[h];                     // a weight: before the wait
    pdl_wait();
    pdl_launch_dependents();
    const int pos = pos_slot[0];
    const float* ml = part_ml + (size_t)h * splits * 2;
    float M = ATTN_NEG_INF;
    for (int s = 0; s < splits; ++s) M = fmaxf(M, ml[2 * s]);
    const bool live = 2 * t < hd;
    float L = 0.0f;
    float2 acc = make_float2(0.0f, 0.0f);
    const float2* po = reinterpret_cast<const float2*>(part_o + (size_t)h * splits * hd) + t;
    for (int s0 = 0; s0 < splits; s0 += ATTN_COMBINE_SPLITS) {
        // ATTN_COMBINE_SPLITS splits' rows loaded before any is used (an empty split's row is zeros, written by the
        // partial), so the loads do not wait one by one behind the empty-split test and a block keeps its head's
        // rows in flight; the sums keep split order (the batch size never changes the arithmetic)
        float2 v[ATTN_COMBINE_SPLITS];
#pragma unroll
        for (int i = 0; i < ATTN_COMBINE_SPLITS; ++i)
            v[i] = live && s0 + i < splits ? po[(size_t)(s0 + i) * (hd / 2)] : make_float2(0.0f, 0.0f);
#pragma unroll
        for (int i = 0; i < ATTN_COMBINE_SPLITS; ++i) {
            const int s = s0 + i;
            if (s >= splits) break;
            const float m = ml[2 * s];
            if (m == ATTN_NEG_INF) continue;         // an empty split
            const float w = expf(m - M);
            L += w * ml[2 * s + 1];
            if (live) acc = make_float2(acc.x + w * v[i].x, acc.y + w * v[i].y);
        }
    }
    L += expf(sink - M);
    if (!live) return;
    float2 v = make_float2(acc.x / L, acc.y / L);
    if (2 * t >= nope) v = ds4_rope_pair(v, pos, freqs[t - nope / 2], true);
    reinterpret_cast<float2*>(out + (size_t)h * hd)[t] = v;
}
