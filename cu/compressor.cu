// KV compressors of V4 Flash (MODEL.md §2.3, ds4py/ref/forward.compressor; ops.compress_pool is the math).
// A compressor turns every `ratio` tokens into one row: per channel, a softmax over the group's slots of the gate
// scores weighs the slots' kv, then RMSNorm, RoPE at g*ratio, and FP8 fake-quant of the non-rope dims (attention
// compressor) or Hadamard + FP4 fake-quant (indexer keys). The overlapping ratio-4 compressor (overlap = 1) has
// 2d input channels: group g pools its own `ratio` tokens through half B ([d, 2d)) and group g-1's through half A
// ([0, d)); group -1 is kv 0, score -inf.
// Device state (KV_LAYOUT): rings ring_kv / ring_sc [cap, (1+overlap)*d], slot = position % cap (scores already
// include ape[position % ratio]); rows [>= groups, d]. The position is read from the device slot, so the decode
// kernel decides on the device whether the step completes a group (no host round trip).
// Block layout (all kernels but the store): P = 32*ceil(d/64) threads per "sub", thread t of a sub holds the
// channel pair (2t, 2t+1); `subs` = blockDim.x / P subs split the group's slots and merge in a fixed order.
#include <cuda_fp16.h>
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"
#include "attention.cuh"

// Geometry (-D values from ds4py/cuda/ops/compressor.py DEFINES): COMP_MAX_THREADS block size limit (merge
// buffers), COMP_MAX_D largest rotated row (Hadamard buffer; indexer keys: 128).
#ifndef COMP_MAX_THREADS
#error "COMP_MAX_THREADS comes from the DEFINES table of ds4py/cuda/ops/compressor.py"
#endif
#ifndef COMP_MAX_D
#error "COMP_MAX_D comes from the DEFINES table of ds4py/cuda/ops/compressor.py"
#endif

#define COMP_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float2 comp_ape(const void* ape, int ape_f32, size_t i) {
    if (ape_f32) return *reinterpret_cast<const float2*>(reinterpret_cast<const float*>(ape) + i);
    return __half22float2(*reinterpret_cast<const __half2*>(reinterpret_cast<const __half*>(ape) + i));
}

// Where the kv / score of a position live: the rings, or (prefill) this chunk's own rows from position p0 on,
// whose scores still lack ape.
struct CompSource {
    const float* ring_kv;
    const float* ring_sc;
    const float* chunk_kv;            // null in decode
    const float* chunk_sc;
    const void* ape;
    int ape_f32, cap, width, ratio, p0;

    // kv and score of channels (ch, ch+1) at position p
    __device__ __forceinline__ void load(int p, int ch, float2& kv, float2& sc) const {
        if (chunk_kv && p >= p0) {
            const size_t o = (size_t)(p - p0) * width + ch;
            kv = *reinterpret_cast<const float2*>(chunk_kv + o);
            sc = *reinterpret_cast<const float2*>(chunk_sc + o);
            const float2 a = comp_ape(ape, ape_f32, (size_t)(p % ratio) * width + ch);
            sc = make_float2(sc.x + a.x, sc.y + a.y);
        } else {
            const size_t o = (size_t)(p % cap) * width + ch;
            kv = *reinterpret_cast<const float2*>(ring_kv + o);
            sc = *reinterpret_cast<const float2*>(ring_sc + o);
        }
    }
};

__device__ __forceinline__ CompSource comp_source(const float* ring_kv, const float* ring_sc, const float* chunk_kv,
                                                  const float* chunk_sc, const void* ape, int ape_f32, int cap,
                                                  int width, int ratio, int p0) {
    CompSource s;
    s.ring_kv = ring_kv;
    s.ring_sc = ring_sc;
    s.chunk_kv = chunk_kv;
    s.chunk_sc = chunk_sc;
    s.ape = ape;
    s.ape_f32 = ape_f32;
    s.cap = cap;
    s.width = width;
    s.ratio = ratio;
    s.p0 = p0;
    return s;
}

// Ring slot p % cap <- (kv, score + ape[p % ratio]), the whole block striding over the width.
__device__ __forceinline__ void comp_store(const float* kv, const float* sc, const void* ape, int ape_f32, int p,
                                           int ratio, int cap, int width, float* ring_kv, float* ring_sc) {
    const size_t slot = (size_t)(p % cap) * width;
    for (int i = 2 * threadIdx.x; i < width; i += 2 * blockDim.x) {
        const float2 a = comp_ape(ape, ape_f32, (size_t)(p % ratio) * width + i);
        const float2 s = *reinterpret_cast<const float2*>(sc + i);
        *reinterpret_cast<float2*>(ring_kv + slot + i) = *reinterpret_cast<const float2*>(kv + i);
        *reinterpret_cast<float2*>(ring_sc + slot + i) = make_float2(s.x + a.x, s.y + a.y);
    }
}

// Pool group g, then RMSNorm, RoPE at g*ratio, quantise, and write rows[g]. Every thread of the block calls it.
__device__ void comp_emit(const CompSource& src, int g, int overlap, const float* norm_w, const float* freqs,
                          float* rows, int rows_cap, int d, int rd, float eps, int rotate, int fake_quant,
                          int round_f16) {
    __shared__ float2 red_m[COMP_MAX_THREADS], red_l[COMP_MAX_THREADS], red_a[COMP_MAX_THREADS];
    __shared__ float part[32];
    __shared__ float hbuf[COMP_MAX_D];
    const int P = ((d + 63) / 64) * 32, subs = blockDim.x / P;
    const int sub = threadIdx.x / P, t = threadIdx.x % P, ratio = src.ratio;
    const bool live = sub < subs && 2 * t < d;
    const int nslots = ratio * (1 + overlap);
    // slot v: overlap and v < ratio -> previous group's token through half A, else this group's through half B
    auto slot_pos = [&](int v, int& ch) {
        if (overlap && v < ratio) { ch = 2 * t; return (g - 1) * ratio + v; }
        ch = (overlap ? d : 0) + 2 * t;
        return g * ratio + v - (overlap ? ratio : 0);
    };

    // pass 1: per-channel max of the scores over this sub's slots, then over the subs
    float2 m = make_float2(COMP_NEG_INF, COMP_NEG_INF);
    if (live) {
        for (int v = sub; v < nslots; v += subs) {
            int ch;
            const int p = slot_pos(v, ch);
            if (p < 0) continue;                         // group -1: score -inf
            float2 kv, sc;
            src.load(p, ch, kv, sc);
            m = make_float2(fmaxf(m.x, sc.x), fmaxf(m.y, sc.y));
        }
    }
    red_m[threadIdx.x] = m;
    __syncthreads();
    if (live) {
        m = red_m[t];
        for (int s = 1; s < subs; ++s) m = make_float2(fmaxf(m.x, red_m[s * P + t].x), fmaxf(m.y, red_m[s * P + t].y));
    }
    // pass 2: sums of e^(score - max) and of e^(score - max) * kv, merged over the subs in order
    float2 l = make_float2(0.0f, 0.0f), a = make_float2(0.0f, 0.0f);
    if (live) {
        for (int v = sub; v < nslots; v += subs) {
            int ch;
            const int p = slot_pos(v, ch);
            if (p < 0) continue;
            float2 kv, sc;
            src.load(p, ch, kv, sc);
            const float ex = expf(sc.x - m.x), ey = expf(sc.y - m.y);
            l = make_float2(l.x + ex, l.y + ey);
            a = make_float2(a.x + ex * kv.x, a.y + ey * kv.y);
        }
    }
    red_l[threadIdx.x] = l;
    red_a[threadIdx.x] = a;
    __syncthreads();
    float2 c = make_float2(0.0f, 0.0f);
    if (sub == 0 && live) {
        for (int s = 1; s < subs; ++s) {
            l = make_float2(l.x + red_l[s * P + t].x, l.y + red_l[s * P + t].y);
            a = make_float2(a.x + red_a[s * P + t].x, a.y + red_a[s * P + t].y);
        }
        c = make_float2(a.x / l.x, a.y / l.y);
    }

    // RMSNorm over the d channels (sub 0 holds them), RoPE at g*ratio on the last rd dims
    const float ss = block_sum(sub == 0 ? c.x * c.x + c.y * c.y : 0.0f, part);
    const float r = rsqrtf(ss / (float)d + eps);
    const int nope = d - rd;
    if (sub == 0 && live) {
        const float2 w = reinterpret_cast<const float2*>(norm_w)[t];
        c = make_float2(c.x * r * w.x, c.y * r * w.y);
        if (2 * t >= nope) c = ds4_rope_pair(c, g * ratio, freqs[t - nope / 2], false);
    }
    if (rotate) {                                        // indexer keys: Hadamard, then FP4 in blocks of 32
        if (sub == 0 && live) {
            hbuf[2 * t] = c.x;
            hbuf[2 * t + 1] = c.y;
        }
        ds4_hadamard_smem(hbuf, d);
        const float hs = 1.0f / sqrtf((float)d);
        if (sub == 0 && live) c = make_float2(hbuf[2 * t] * hs, hbuf[2 * t + 1] * hs);
        if (fake_quant && sub == 0) c = ds4_fp4_block32(c);            // sub 0 is whole warps
    } else if (fake_quant && sub == 0 && 64 * (t / 32 + 1) <= nope) {
        c = ds4_fp8_block64(c);                                       // a whole warp of non-rope dims
    }
    if (round_f16) c = make_float2(__half2float(__float2half_rn(c.x)), __half2float(__float2half_rn(c.y)));
    if (sub == 0 && live && g < rows_cap) reinterpret_cast<float2*>(rows + (size_t)g * d)[t] = c;
}

// Decode step at pos = *pos_slot: store kv_in / sc_in + ape[pos % ratio] ([(1+overlap)*d] each, the wkv / wgate
// GEMV outputs) into ring slot pos % cap, then, when (pos+1) % ratio == 0, emit row g = pos / ratio.
// ape [ratio, (1+overlap)*d], F16 (ape_f32 = 0) or F32; norm_w [d]; freqs [rd/2] (compressed-layer RoPE).
// rotate = 1: indexer keys (Hadamard over d, a power of two; FP4 when fake_quant); else FP8 on the first d-rd dims.
// rows [rows_cap, d]: a row past rows_cap is not written (the state grows between steps; this only keeps a
// too-small array from being overrun). Needs d even, (d - rd) % 64 == 0 unless rotate, d % 32 == 0 when rotating;
// arrays 8-byte aligned.
// Launch: grid (1), block (subs * 32*ceil(d/64)) threads, at most 1024; subs > 1 splits long groups (ratio 128).
extern "C" __global__ void compressor_decode(const float* kv_in, const float* sc_in, const void* ape, int ape_f32,
                                             const float* norm_w, const float* freqs, const int* pos_slot,
                                             float* ring_kv, float* ring_sc, float* rows, int rows_cap,
                                             int ratio, int overlap, int cap, int d, int rd, float eps, int rotate,
                                             int fake_quant, int round_f16) {
    pdl_wait();
    pdl_launch_dependents();
    const int pos = pos_slot[0], width = (1 + overlap) * d;
    comp_store(kv_in, sc_in, ape, ape_f32, pos, ratio, cap, width, ring_kv, ring_sc);
    if ((pos + 1) % ratio != 0) return;                  // block-uniform: the group is not complete yet
    __syncthreads();                                     // this position's slot is read by other threads
    const CompSource src = comp_source(ring_kv, ring_sc, nullptr, nullptr, ape, ape_f32, cap, width, ratio, pos);
    comp_emit(src, pos / ratio, overlap, norm_w, freqs, rows, rows_cap, d, rd, eps, rotate, fake_quant,
              round_f16);
}

// Prefill: emit every group that the chunk of n_tok tokens at positions p0 = *pos_slot .. p0+n_tok-1 completes.
// Positions before p0 come from the rings, the chunk's own from chunk_kv / chunk_sc [n_tok, (1+overlap)*d]
// (scores without ape). Run compressor_prefill_store after it (it overwrites ring slots this kernel reads).
// Launch: grid (n_tok / ratio + 1) (block b takes group p0/ratio + b, if the chunk completes it), block as
// compressor_decode.
extern "C" __global__ void compressor_prefill_pool(const float* chunk_kv, const float* chunk_sc, int n_tok,
                                                   const void* ape, int ape_f32, const float* norm_w,
                                                   const float* freqs, const int* pos_slot, const float* ring_kv,
                                                   const float* ring_sc, float* rows, int rows_cap, int ratio,
                                                   int overlap, int cap, int d, int rd, float eps, int rotate,
                                                   int fake_quant, int round_f16) {
    pdl_wait();
    pdl_launch_dependents();
    const int p0 = pos_slot[0];
    const int g = p0 / ratio + (int)blockIdx.x;
    if (g >= (p0 + n_tok) / ratio) return;               // block-uniform
    const CompSource src = comp_source(ring_kv, ring_sc, chunk_kv, chunk_sc, ape, ape_f32, cap, (1 + overlap) * d,
                                       ratio, p0);
    comp_emit(src, g, overlap, norm_w, freqs, rows, rows_cap, d, rd, eps, rotate, fake_quant, round_f16);
}

// Prefill: store the chunk's last min(n_tok, cap) positions into the rings (scores + ape), after the pooling.
// width = (1+overlap)*d, even.
// Launch: grid (min(n_tok, cap)), block (any multiple of 32); block b stores position p0 + n_tok - rows + b.
extern "C" __global__ void compressor_prefill_store(const float* chunk_kv, const float* chunk_sc, int n_tok,
                                                    const void* ape, int ape_f32, const int* pos_slot,
                                                    float* ring_kv, float* ring_sc, int ratio, int cap, int width) {
    pdl_wait();
    pdl_launch_dependents();
    const int kept = min(n_tok, cap);
    const int j = n_tok - kept + (int)blockIdx.x;        // row in the chunk
    comp_store(chunk_kv + (size_t)j * width, chunk_sc + (size_t)j * width, ape, ape_f32, pos_slot[0] + j, ratio, cap,
               width, ring_kv, ring_sc);
}
