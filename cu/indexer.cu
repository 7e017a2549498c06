// The lightning indexer of V4 Flash's ratio-4 layers (MODEL.md §2.3, ds4py/ref/forward.indexer_scores), decode:
//   indexer_q_prep   qI = wq_b_idx(qr) [IH, ihd] -> RoPE on the last rd dims at pos, Hadamard (natural order,
//                    /sqrt(ihd)), FP4 e2m1 fake-quant in blocks of 32
//   indexer_scores   score[g] = sum_h (proj(x)_h * wscale) * relu(qI_h . K_I[g]) for the visible keys g < (pos+1)/4
// The keys K_I (Hadamard + FP4 rows of the indexer compressor, compressor.cu) are the idx_keys array of the
// device KV state; topk.cu then keeps the best index_topk of these scores.
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"
#include "attention.cuh"

// Geometry (-D values from ds4py/cuda/ops/indexer.py DEFINES): IDX_MAX_DIM the Hadamard buffer (V4: 128),
// IDX_MAX_HEADS the weight buffer, IDX_THREADS the block of indexer_scores (16 key lanes x IDX_THREADS/16 head
// groups of 4 heads).
#ifndef IDX_MAX_DIM
#error "IDX_MAX_DIM comes from the DEFINES table of ds4py/cuda/ops/indexer.py"
#endif
#ifndef IDX_MAX_HEADS
#error "IDX_MAX_HEADS comes from the DEFINES table of ds4py/cuda/ops/indexer.py"
#endif
#ifndef IDX_THREADS
#error "IDX_THREADS comes from the DEFINES table of ds4py/cuda/ops/indexer.py"
#endif
#define IDX_KT 64                         // keys per tile of indexer_scores: 16 key lanes x 4 keys (the
                                          // decode launch may take 16: one key per lane, 4x the blocks)

// One head (blockIdx.x) of indexer_q_prep at pos; every thread of the block calls it (Hadamard barriers).
__device__ __forceinline__ void idx_q_prep_head(const float* q_raw, const float* freqs, int pos, float* q, int ihd,
                                                int rd, int fake_quant, float* hbuf) {
    const int t = threadIdx.x, nope = ihd - rd;
    const bool live = 2 * t < ihd;
    const size_t row = (size_t)blockIdx.x * ihd;
    if (live) {
        float2 v = reinterpret_cast<const float2*>(q_raw + row)[t];
        if (2 * t >= nope) v = ds4_rope_pair(v, pos, freqs[t - nope / 2], false);
        hbuf[2 * t] = v.x;
        hbuf[2 * t + 1] = v.y;
    }
    ds4_hadamard_smem(hbuf, ihd);
    const float hs = 1.0f / sqrtf((float)ihd);
    float2 v = live ? make_float2(hbuf[2 * t] * hs, hbuf[2 * t + 1] * hs) : make_float2(0.0f, 0.0f);
    if (fake_quant) v = ds4_fp4_block32(v);
    if (live) reinterpret_cast<float2*>(q + row)[t] = v;
}

// q_raw [IH, ihd] -> q [IH, ihd]. freqs: the layer's rd/2 RoPE frequencies. ihd a power of two >= 32, rd even.
// Launch: grid (IH), block (32 * ceil(ihd / 64)); thread t holds dims (2t, 2t+1) of head blockIdx.x.
extern "C" __global__ void indexer_q_prep(const float* q_raw, const float* freqs, const int* pos_slot, float* q,
                                          int ihd, int rd, int fake_quant) {
    __shared__ float hbuf[IDX_MAX_DIM];
    pdl_wait();
    pdl_launch_dependents();
    idx_q_prep_head(q_raw, freqs, pos_slot[0], q, ihd, rd, fake_quant, hbuf);
}

// Prefill: indexer_q_prep of T rows, row r at pos[r]: q_raw, q [T, IH, ihd].
// Launch: grid (IH, T), block (32 * ceil(ihd / 64)); block (h, r) is head h of row r.
extern "C" __global__ void indexer_q_prep_rows(const float* q_raw, const float* freqs, const int* pos, float* q,
                                               int n_heads, int ihd, int rd, int fake_quant) {
    __shared__ float hbuf[IDX_MAX_DIM];
    pdl_wait();
    pdl_launch_dependents();
    const size_t off = (size_t)blockIdx.y * n_heads * ihd;
    idx_q_prep_head(q_raw + off, freqs, pos[blockIdx.y], q + off, ihd, rd, fake_quant, hbuf);
}

// The scores of one query (a block's share of the tiles of KT keys: blockIdx.x of gridDim.x). A key's score is
// the same sums in the same order whatever KT (16 or 64): only which block and lane computes it changes.
template <int KT>
__device__ void idx_scores_query(const float* q, const float* w_raw, float wscale, const float* keys,
                                  int n_vis, float* scores, int n_heads, int ihd) {
    constexpr int KJ = KT / 16;                          // keys per key lane
    extern __shared__ __align__(16) float idx_smem[];
    __shared__ float wts[IDX_MAX_HEADS];
    __shared__ float red[IDX_THREADS / 16][KT];
    const int tid = threadIdx.x, kl = tid & 15, hg = tid >> 4;
    const int n_tiles = (n_vis + KT - 1) / KT;
    if ((int)blockIdx.x >= n_tiles) return;              // block-uniform
    const int stride = ihd + 4;
    float* qs = idx_smem;                                // [IH][ihd]
    float* ks = idx_smem + n_heads * ihd;                // [KT][ihd + 4]
    for (int i = tid; i < n_heads * ihd / 4; i += blockDim.x) cp_async_16(qs + 4 * i, q + 4 * i);
    cp_async_commit();
    for (int h = tid; h < n_heads; h += blockDim.x) wts[h] = w_raw[h] * wscale;

    for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        const int base = tile * KT;
        __syncthreads();                                 // ks and red of the previous tile are consumed
        for (int i = tid; i < KT * ihd / 4; i += blockDim.x) {
            const int r = i / (ihd / 4), c = i % (ihd / 4);
            float* dst = ks + r * stride + 4 * c;
            if (base + r < n_vis) cp_async_16(dst, keys + (size_t)(base + r) * ihd + 4 * c);
            else *reinterpret_cast<float4*>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();

        float part[KJ];
#pragma unroll
        for (int j = 0; j < KJ; ++j) part[j] = 0.0f;
        for (int h0 = 4 * hg; h0 < n_heads; h0 += 4 * (IDX_THREADS / 16)) {
            float acc[4][KJ];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < KJ; ++j) acc[i][j] = 0.0f;
            for (int d = 0; d < ihd; d += 4) {
                float4 k4[KJ], q4[4];
#pragma unroll
                for (int j = 0; j < KJ; ++j) k4[j] = *reinterpret_cast<const float4*>(ks + (kl + 16 * j) * stride + d);
#pragma unroll
                for (int i = 0; i < 4; ++i) q4[i] = *reinterpret_cast<const float4*>(qs + (h0 + i) * ihd + d);
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < KJ; ++j)
                        acc[i][j] += q4[i].x * k4[j].x + q4[i].y * k4[j].y + q4[i].z * k4[j].z + q4[i].w * k4[j].w;
            }
#pragma unroll
            for (int j = 0; j < KJ; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) part[j] += fmaxf(acc[i][j], 0.0f) * wts[h0 + i];
        }
#pragma unroll
        for (int j = 0; j < KJ; ++j) red[hg][kl + 16 * j] = part[j];
        __syncthreads();
        if (tid < KT && base + tid < n_vis) {
            float s = 0.0f;
            for (int g = 0; g < IDX_THREADS / 16; ++g) s += red[g][tid];
            scores[base + tid] = s;
        }
    }
}

// Scores of the visible keys against the prepared q: keys [>= n_vis, ihd] with n_vis = (pos+1) / ratio; w_raw [IH]
// (the indexer.proj GEMV output) scaled by wscale = ihd^-0.5 * IH^-0.5 (as fp32, ops order). scores [>= n_vis].
// Needs IH % 4 == 0, IH <= 256, ihd % 4 == 0; q, keys 16-byte aligned.
// Launch: grid (any: tiles of `tile` keys (16 or 64) go round-robin to blocks; ceil(max keys / tile) or a couple
// per SM), block (256), dynamic shared memory (IH * ihd + tile * (ihd + 4)) * 4 bytes. Thread (hg = tid / 16,
// kl = tid % 16) accumulates heads 4hg + 64i .. +3 against keys kl + 16j (j < tile / 16) of the tile; the 16 head
// groups' partial scores are summed in a fixed order. The scores are bit-identical for either tile.
extern "C" __global__ void indexer_scores(const float* q, const float* w_raw, float wscale, const float* keys,
                                          const int* pos_slot, int ratio, float* scores, int n_heads, int ihd,
                                          int tile) {
    pdl_wait();
    pdl_launch_dependents();
    if (tile == 16) idx_scores_query<16>(q, w_raw, wscale, keys, (pos_slot[0] + 1) / ratio, scores, n_heads, ihd);
    else idx_scores_query<IDX_KT>(q, w_raw, wscale, keys, (pos_slot[0] + 1) / ratio, scores, n_heads, ihd);
}

// Prefill: indexer_scores of T queries, query r at pos[r]: q [T, IH, ihd], w_raw [T, IH], scores [T, score_stride]
// (row r's first (pos[r]+1)/ratio entries written). Each query's scores are bit-identical to its decode launch.
// Launch: grid (tile blocks, T), block (256), dynamic shared memory as indexer_scores; blocks (x, r) take the
// 64-key tiles of query r round-robin.
extern "C" __global__ void indexer_scores_rows(const float* q, const float* w_raw, float wscale, const float* keys,
                                               const int* pos, int ratio, float* scores, int score_stride,
                                               int n_heads, int ihd) {
    pdl_wait();
    pdl_launch_dependents();
    const int r = blockIdx.y;
    idx_scores_query<IDX_KT>(q + (size_t)r * n_heads * ihd, w_raw + (size_t)r * n_heads, wscale, keys,
                             (pos[r] + 1) / ratio, scores + (size_t)r * score_stride, n_heads, ihd);
}
