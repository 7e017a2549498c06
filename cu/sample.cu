// Sampling on the device: temperature, top-k, top-p, min-p and one seeded draw, as ds4py/sampling.py defines them,
// with the token id written to a device slot (the next step's embedding reads it) - the host reads 4 bytes.
//
// Order and truncation (exact, no sort): tokens ranked by logit descending, ties by lower id. Each rule keeps a
// prefix of that ranking: top-k its first k; top-p (measured after top-k) the tokens whose preceding mass is
// below p; min-p those with p_i >= min_p * p_max. The prefixes are found by radix select over 32-bit order keys
// of the logits, SAMPLE_RADIX_BITS per pass (histograms in shared memory, warp-aggregated): counts for top-k,
// masses for top-p, and - only when the cut falls inside a run of equal logits - the ids of that run.
// Masses are fixed point, p_i * 2^32 with p_i = exp((l_i - max) / T) <= 1, summed as 64-bit integers, so every
// sum is exact and independent of the order of the threads: the same logits give the same decisions every run.
// The draw: u = Philox4x32-10(seed, position) as 64 bits, target = floor(u * Z / 2^64) of the kept mass Z, and
// the token whose cumulative mass passes it (a fixed order: threads from the top, each its indices ascending).
// The distribution is the CPU sampler's; the stream of draws is Philox's, not numpy's.
//
// One block per row of logits (grid = rows): a decode step has one row; rows > 1 with row_stride 0 draw
// independent samples of one distribution at positions pos..pos+rows-1 (the distribution test does that).
#include "types.cuh"
#include "portable.cuh"
#include "reduce.cuh"
#include "philox.cuh"

#ifndef SAMPLE_RADIX_BITS
#error "SAMPLE_RADIX_BITS comes from ds4py/cuda/ops/sample.py (DEFINES)"
#endif
#define BINS (1 << SAMPLE_RADIX_BITS)
#define NO_TIES 0x7fffffff

typedef unsigned long long u64;

// The inverse of reduce.cuh's order_key (NaN excluded beforehand).
__device__ __forceinline__ float key_value(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ float rel_prob(float l, float m, float inv_t) { return expf((l - m) * inv_t); }
__device__ __forceinline__ u64 mass_of(float p) { return (u64)(p * 4294967296.0f); }   // truncation, p <= 1

struct SampleSmem {
    u64 hist[BINS];
    u64 part[32];
    float fpart[32];
    int ipart[32];
    int sel;
    u64 above;
};

__device__ __forceinline__ float block_max(float v, float* part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(DS4_FULL_MASK, v, o));
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < nwarps ? part[lane] : -__int_as_float(0x7f800000);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(DS4_FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ u64 block_total(u64 v, u64* part) {
    u64 total;
    block_suffix_exclusive<u64>(v, part, total);
    return total;
}

// hist[bin] += val for the lanes that take part; lanes with the same bin are combined first (one atomic per bin
// and warp instead of up to 32 on one address). val <= 2^32.
__device__ __forceinline__ void hist_add(u64* hist, bool take, unsigned bin, u64 val, bool mass) {
    const unsigned peers = __match_any_sync(DS4_FULL_MASK, take ? bin : 0xffffffffu);
    if (!take) return;
    const bool leader = (threadIdx.x & 31) == __ffs(peers) - 1;
    if (!mass) {
        if (leader) atomicAdd(hist + bin, (u64)__popc(peers));
        return;
    }
    const unsigned lo = __reduce_add_sync(peers, (unsigned)(val & 0xffffu));      // <= 32 * 2^16 each
    const unsigned hi = __reduce_add_sync(peers, (unsigned)(val >> 16));
    if (leader) atomicAdd(hist + bin, ((u64)hi << 16) + lo);
}

// What a radix select ranks: the logit keys, or (SEL_ID) the ids of the tokens whose key is tie_key, as ~id so
// that a lower id ranks higher.
#define SEL_KEY 0
#define SEL_ID 1

__device__ __forceinline__ void pass_hist(SampleSmem& sm, const float* x, int n, int sel, unsigned tie_key,
                                          unsigned prefix, unsigned pmask, int shift, int width, bool mass,
                                          float m, float inv_t) {
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) sm.hist[b] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += blockDim.x) {           // whole warps every round (collectives)
        const int i = base + threadIdx.x;
        const bool valid = i < n;
        const float l = valid ? x[i] : 0.0f;
        const unsigned k = order_key(l);
        const unsigned dk = sel == SEL_KEY ? k : ~(unsigned)i;
        const bool take = valid && (sel == SEL_KEY || k == tie_key) && (dk & pmask) == prefix;
        const unsigned bin = (dk >> shift) & ((1u << width) - 1u);
        hist_add(sm.hist, take, bin, take && mass ? mass_of(rel_prob(l, m, inv_t)) : 1ull, mass);
    }
    __syncthreads();
}

// The largest bin b with above + sum(hist[b..]) >= target, or -1; sm.above <- above + sum(hist[b+1..]).
// Each thread owns BINS / blockDim.x consecutive bins.
__device__ __forceinline__ int find_top(SampleSmem& sm, u64 above, u64 target, u64& new_above) {
    const int per = BINS / blockDim.x, lo = threadIdx.x * per;
    u64 local = 0;
    for (int b = lo; b < lo + per; b++) local += sm.hist[b];
    if (threadIdx.x == 0) sm.sel = -1;
    u64 total;
    const u64 e = block_suffix_exclusive<u64>(local, sm.part, total);   // bins above this thread's
    if (above + e < target && above + e + local >= target) {
        u64 run = above + e;
        for (int b = lo + per - 1; b >= lo; b--) {
            if (run + sm.hist[b] >= target) {
                sm.sel = b;
                sm.above = run;
                break;
            }
            run += sm.hist[b];
        }
    }
    __syncthreads();
    const int b = sm.sel;
    new_above = b >= 0 ? sm.above : above;
    return b;
}

// The target-th element from the top (by count, or by mass), over the elements `sel` ranks. Returns its full
// 32-bit key; above = count / mass of the elements ranked strictly higher. found = false when the total falls
// short of the target.
__device__ __forceinline__ unsigned radix_select(SampleSmem& sm, const float* x, int n, int sel, unsigned tie_key,
                                                 bool mass, u64 target, float m, float inv_t, u64& above,
                                                 bool& found) {
    unsigned prefix = 0u, pmask = 0u;
    above = 0;
    for (int hi = 32; hi > 0; hi -= SAMPLE_RADIX_BITS) {
        const int lo = hi > SAMPLE_RADIX_BITS ? hi - SAMPLE_RADIX_BITS : 0, width = hi - lo;
        pass_hist(sm, x, n, sel, tie_key, prefix, pmask, lo, width, mass, m, inv_t);
        const int b = find_top(sm, above, target, above);
        if (b < 0) {
            found = false;
            return 0u;
        }
        prefix |= (unsigned)b << lo;
        pmask |= ((1u << width) - 1u) << lo;
    }
    found = true;
    return prefix;
}

// Launch: grid (rows), block (threads: a power of two, 32..1024). Row r reads logits + r * row_stride (n values)
// and writes out[r]; its draw uses position (pos_slot ? *pos_slot : 0) + pos_offset + r. temperature <= 0 or
// top_k == 1: greedy (lowest id among the largest). top_k 0 / top_p 1 / min_p 0: off. kept (may be null):
// [rows, n] bytes, 1 for every token the truncation keeps (for tests). A NaN or +inf logit, or all -inf, gives
// out[r] = -1 (the host reports it).
extern "C" __global__ void sample_f32(const float* logits, int n, int row_stride, float temperature, int top_k,
                                      double top_p, double min_p, unsigned long long seed, const int* pos_slot,
                                      int pos_offset, int* out, unsigned char* kept) {
    __shared__ SampleSmem sm;
    pdl_wait();
    pdl_launch_dependents();
    const float* x = logits + (size_t)blockIdx.x * row_stride;
    unsigned char* kp = kept ? kept + (size_t)blockIdx.x * n : nullptr;

    // the largest logit, and whether the row is a distribution at all
    float m = -__int_as_float(0x7f800000);
    int bad = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = x[i];
        bad |= (v != v) || v == __int_as_float(0x7f800000);
        m = fmaxf(m, v);
    }
    m = block_max(m, sm.fpart);
    bad = __syncthreads_or(bad);
    if (bad || !(m > -__int_as_float(0x7f800000))) {
        if (threadIdx.x == 0) out[blockIdx.x] = -1;
        return;
    }
    if (temperature <= 0.0f || top_k == 1) {           // greedy: the first index holding the maximum
        int best = 0x7fffffff;
        for (int i = threadIdx.x; i < n; i += blockDim.x)
            if (x[i] == m && i < best) best = i;
        float bv = m;
        block_argmax(bv, best, sm.fpart, sm.ipart);
        if (kp)
            for (int i = threadIdx.x; i < n; i += blockDim.x) kp[i] = i == best;
        if (threadIdx.x == 0) out[blockIdx.x] = best;
        return;
    }
    const float inv_t = 1.0f / temperature;

    // the kept prefix: keys above cut_key, and the first cut_ties tokens (by id) with key == cut_key
    unsigned cut_key = 0u;                             // below every real key: nothing cut
    int cut_ties = NO_TIES;
    bool found;
    u64 above;
    if (top_k > 0 && top_k < n) {
        cut_key = radix_select(sm, x, n, SEL_KEY, 0u, false, (u64)top_k, m, inv_t, above, found);
        cut_ties = top_k - (int)above;
    }
    if (top_p < 1.0) {
        // the mass of what top-k kept; top-p measures against it
        u64 s = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float l = x[i];
            if (order_key(l) > cut_key) s += mass_of(rel_prob(l, m, inv_t));
        }
        u64 zk = block_total(s, sm.part);
        if (cut_ties != NO_TIES) zk += (u64)cut_ties * mass_of(rel_prob(key_value(cut_key), m, inv_t));
        const double p = top_p * (double)zk;
        u64 target = (u64)ceil(p);
        if (target < 1) target = 1;
        u64 mass_gt;
        const unsigned vp = radix_select(sm, x, n, SEL_KEY, 0u, true, target, m, inv_t, mass_gt, found);
        if (found) {
            u64 c = 0;
            for (int i = threadIdx.x; i < n; i += blockDim.x) c += order_key(x[i]) == vp;
            const u64 ties = block_total(c, sm.part);
            const u64 w = mass_of(rel_prob(key_value(vp), m, inv_t));
            u64 tp = ties;
            if (w > 0) {                               // ties c kept while mass_gt + c * w < p
                const double need = ceil((p - (double)mass_gt) / (double)w);
                if (need < (double)ties) tp = (u64)need;
            }
            if (vp > cut_key || (vp == cut_key && (int)tp < cut_ties)) {
                cut_key = vp;
                cut_ties = (int)tp;
            }
        }
    }
    // which of the tied tokens at the cut are kept: the lowest ids
    int max_tie_id = 0x7fffffff;
    if (cut_ties != NO_TIES) {
        u64 c = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) c += order_key(x[i]) == cut_key;
        if ((int)block_total(c, sm.part) > cut_ties) {
            const unsigned dk = radix_select(sm, x, n, SEL_ID, cut_key, false, (u64)cut_ties, m, inv_t, above, found);
            max_tie_id = (int)~dk;
        }
    }

    // the kept mass per thread, the draw, and the token it lands on
    u64 s = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float l = x[i];
        const unsigned k = order_key(l);
        const float pr = rel_prob(l, m, inv_t);
        const bool keep = (k > cut_key || (k == cut_key && i <= max_tie_id)) && !(min_p > 0.0 && (double)pr < min_p);
        if (keep) s += mass_of(pr);
        if (kp) kp[i] = keep;
    }
    u64 z;
    const u64 e = block_suffix_exclusive<u64>(s, sm.part, z);
    const int pos = (pos_slot ? pos_slot[0] : 0) + pos_offset + (int)blockIdx.x;
    const u64 target = __umul64hi(z, philox_u64(seed, (u64)(unsigned)pos));
    if (e <= target && target < e + s) {
        u64 run = e;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float l = x[i];
            const unsigned k = order_key(l);
            const float pr = rel_prob(l, m, inv_t);
            const bool keep = (k > cut_key || (k == cut_key && i <= max_tie_id)) &&
                              !(min_p > 0.0 && (double)pr < min_p);
            if (!keep) continue;
            run += mass_of(pr);
            if (run > target) {
                out[blockIdx.x] = i;
                break;
            }
        }
    }
}
