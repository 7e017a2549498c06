// portable.cuh: the only place in cu/ with inline PTX. Each wrapper has a PTX path (guarded by the arch that
// has the instruction), a plain-CUDA fallback for older archs, and an exact CPU path for the emulator
// (DS4_EMU, cu/emu/cuda_emu.h). Kernels call these wrappers and never write asm() themselves.
//
//   pdl_wait(), pdl_launch_dependents()       programmatic dependent launch (griddepcontrol, sm_90+)
//   prefetch_l2(p)                            bring p's 128-byte line into L2, no register (prefetch, sm_70+)
//   cp_async_{4,8,16}, cp_async_commit(),     asynchronous global->shared copies (cp.async, sm_80+)
//   cp_async_wait<N>(), cp_async_wait_all()
//   fp8_{e4m3,e5m2}_to_float, fp8x2_*_to_half2, float_to_fp8_*, float2_to_fp8x2_*   (cvt, sm_89+)
//   mma_m16n8k16_f16_f32, mma_m16n8k16_bf16_f32   one warp-wide tensor-core tile, D += A*B (mma.sync, sm_80+)
//   ldsm_x4(r, row)                           four 8x8 16-bit matrices from shared memory into fragments (ldmatrix)
//
// FP8 is the OCP format: e4m3 "fn" (bias 7, no infinity, 0x7f/0xff NaN, max 448) and e5m2 (bias 15, IEEE-like,
// max 57344). Float -> FP8 rounds to nearest-even and saturates to the largest finite value (PTX .satfinite);
// NaN becomes 0x7f. FP8 -> half/float is exact.
#pragma once
#include <cuda_fp16.h>

#ifdef DS4_EMU
#define DS4_HD
#else
#define DS4_HD __host__ __device__
#endif

// ---------------------------------------------------------------------------------------------------------------
// Programmatic dependent launch. pdl_wait: block until the previous grid in the stream has finished (or called
// pdl_launch_dependents); every kernel calls it before reading its predecessor's output, and stores nothing to
// global memory and does not return before it. The emulator runs launches one after another; there pdl_wait
// only marks the thread as having waited, which its pdl check enforces (EmuRuntime(check_pdl=True)).
__device__ __forceinline__ void pdl_wait() {
#if defined(DS4_EMU)
    ::__emu::pdl_mark();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if !defined(DS4_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// L2 prefetch: a hint that p's line is read soon (the weights a kernel streams, issued before pdl_wait so DRAM
// works during the previous kernel's tail). No value, no register, nothing to wait for; p must be a valid global
// address. The emulator reads one byte of it (so a wild prefetch faults there, as a read would); older archs: none.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(DS4_EMU)
    (void)*(const volatile unsigned char*)p;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
#else
    (void)p;
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// cp.async: copy 4/8/16 bytes from global to shared memory without staging through registers. The data is only
// guaranteed to be in shared memory after cp_async_wait (then __syncthreads/__syncwarp for other threads to see it).
// The emulator defers each copy to the matching wait, so a missing wait reads stale shared memory there too.
#if defined(DS4_EMU)
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) { __emu::cp_async(smem, gmem, 4); }
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem) { __emu::cp_async(smem, gmem, 8); }
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) { __emu::cp_async(smem, gmem, 16); }
__device__ __forceinline__ void cp_async_commit() { __emu::cp_async_commit(); }
template <int N> __device__ __forceinline__ void cp_async_wait() { __emu::cp_async_wait(N); }
__device__ __forceinline__ void cp_async_wait_all() { __emu::cp_async_wait(0); }
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ unsigned ds4_smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(ds4_smem_addr(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(ds4_smem_addr(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(ds4_smem_addr(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
#else  // before sm_80: ordinary synchronous copies
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem) {
    *(unsigned*)smem = *(const unsigned*)gmem;
}
__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem) { *(uint2*)smem = *(const uint2*)gmem; }
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) { *(uint4*)smem = *(const uint4*)gmem; }
__device__ __forceinline__ void cp_async_commit() {}
template <int N> __device__ __forceinline__ void cp_async_wait() {}
__device__ __forceinline__ void cp_async_wait_all() {}
#endif

// ---------------------------------------------------------------------------------------------------------------
// FP8 <-> float/half. The software versions below are exact (integer rounding only) and serve the emulator and
// archs without the cvt instructions; sm_89+ uses the hardware conversion.
DS4_HD __forceinline__ unsigned ds4_f32_bits(float f) { union { float f; unsigned u; } c; c.f = f; return c.u; }
DS4_HD __forceinline__ float ds4_bits_f32(unsigned u) { union { float f; unsigned u; } c; c.u = u; return c.f; }

// Round-to-nearest-even of `m >> shift` (shift in 1..31).
DS4_HD __forceinline__ unsigned ds4_rne_shift(unsigned m, int shift) {
    const unsigned q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    return q + (rem > half || (rem == half && (q & 1u)));
}

// float -> FP8 with `mbits` mantissa bits, exponent bias `bias`, largest finite magnitude bits `maxcode` whose
// float value is `maxf` (bits). Shared by e4m3 and e5m2.
DS4_HD __forceinline__ unsigned char ds4_sw_float_to_fp8(float f, int mbits, int bias, unsigned maxcode,
                                                          unsigned maxf) {
    const unsigned x = ds4_f32_bits(f), sign = (x >> 24) & 0x80u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7f;                             // NaN
    if (ax >= maxf) return (unsigned char)(sign | maxcode);         // saturate (infinity included)
    const int e = (int)(ax >> 23) - 127;
    const int emin = 1 - bias;                                      // smallest normal exponent
    if (e >= emin) {
        const unsigned code = ((unsigned)(e + bias) << mbits) + ds4_rne_shift(ax & 0x7fffffu, 23 - mbits);
        return (unsigned char)(sign | (code > maxcode ? maxcode : code));
    }
    // Subnormal: count units of 2^(emin - mbits). Anything at or below half a unit rounds to zero.
    const unsigned half_unit = (unsigned)(127 + emin - mbits - 1) << 23;
    if (ax <= half_unit) return (unsigned char)sign;
    const unsigned m = (ax & 0x7fffffu) | 0x800000u;
    return (unsigned char)(sign | ds4_rne_shift(m, 23 - mbits - (e - emin)));
}

DS4_HD __forceinline__ unsigned char ds4_sw_float_to_fp8_e4m3(float f) {
    return ds4_sw_float_to_fp8(f, 3, 7, 0x7eu, 0x43e00000u);        // 448
}
DS4_HD __forceinline__ unsigned char ds4_sw_float_to_fp8_e5m2(float f) {
    return ds4_sw_float_to_fp8(f, 2, 15, 0x7bu, 0x47600000u);       // 57344
}

DS4_HD __forceinline__ float ds4_sw_fp8_e4m3_to_float(unsigned char v) {
    const unsigned s = (unsigned)(v & 0x80u) << 24, e = (v >> 3) & 15u, m = v & 7u;
    if (e == 15u && m == 7u) return ds4_bits_f32(s | 0x7fc00000u);
    if (e == 0u) {                                                   // m * 2^-9, exact in float
        const float mag = (float)m * 0.001953125f;
        return s ? -mag : mag;
    }
    return ds4_bits_f32(s | ((e + 120u) << 23) | (m << 20));
}

DS4_HD __forceinline__ float ds4_sw_fp8_e5m2_to_float(unsigned char v) {
    const unsigned s = (unsigned)(v & 0x80u) << 24, e = (v >> 2) & 31u, m = v & 3u;
    if (e == 31u) return ds4_bits_f32(s | 0x7f800000u | (m << 21));    // inf / NaN
    if (e == 0u) {                                                   // m * 2^-16
        const float mag = (float)m * 1.52587890625e-05f;
        return s ? -mag : mag;
    }
    return ds4_bits_f32(s | ((e + 112u) << 23) | (m << 21));
}

#if !defined(DS4_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define DS4_HW_FP8 1
#endif

// Two FP8 values packed in 16 bits (low byte first) <-> half2 (.x from the low byte); E5M2: e5m2, else e4m3 (the
// named wrappers below).
template <bool E5M2>
__device__ __forceinline__ __half2 fp8x2_to_half2(unsigned short v) {
#ifdef DS4_HW_FP8
    unsigned r;
    if constexpr (E5M2)
        asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"(v));
    else
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
    return __halves2half2(__ushort_as_half((unsigned short)(r & 0xffffu)), __ushort_as_half((unsigned short)(r >> 16)));
#else
    if constexpr (E5M2)                                // e5m2 is the top byte of an IEEE half
        return __halves2half2(__ushort_as_half((unsigned short)((v & 0xffu) << 8)),
                              __ushort_as_half((unsigned short)(v & 0xff00u)));
    else
        return __floats2half2_rn(ds4_sw_fp8_e4m3_to_float((unsigned char)(v & 0xffu)),
                                 ds4_sw_fp8_e4m3_to_float((unsigned char)(v >> 8)));
#endif
}

template <bool E5M2>
__device__ __forceinline__ float fp8_to_float(unsigned char v) {
#ifdef DS4_HW_FP8
    return __low2float(fp8x2_to_half2<E5M2>(v));
#else
    return E5M2 ? ds4_sw_fp8_e5m2_to_float(v) : ds4_sw_fp8_e4m3_to_float(v);
#endif
}

// (lo, hi) -> 16 bits with lo in the low byte. PTX packs its first source operand into the upper byte.
template <bool E5M2>
__device__ __forceinline__ unsigned short float2_to_fp8x2(float lo, float hi) {
#ifdef DS4_HW_FP8
    unsigned short r;
    if constexpr (E5M2)
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return E5M2 ? (unsigned short)(ds4_sw_float_to_fp8_e5m2(lo) | (ds4_sw_float_to_fp8_e5m2(hi) << 8))
                : (unsigned short)(ds4_sw_float_to_fp8_e4m3(lo) | (ds4_sw_float_to_fp8_e4m3(hi) << 8));
#endif
}

template <bool E5M2>
__device__ __forceinline__ unsigned char float_to_fp8(float f) {
    return (unsigned char)(float2_to_fp8x2<E5M2>(f, 0.0f) & 0xffu);
}

__device__ __forceinline__ __half2 fp8x2_e4m3_to_half2(unsigned short v) { return fp8x2_to_half2<false>(v); }
__device__ __forceinline__ __half2 fp8x2_e5m2_to_half2(unsigned short v) { return fp8x2_to_half2<true>(v); }
__device__ __forceinline__ float fp8_e4m3_to_float(unsigned char v) { return fp8_to_float<false>(v); }
__device__ __forceinline__ float fp8_e5m2_to_float(unsigned char v) { return fp8_to_float<true>(v); }
__device__ __forceinline__ unsigned short float2_to_fp8x2_e4m3(float lo, float hi) { return float2_to_fp8x2<false>(lo, hi); }
__device__ __forceinline__ unsigned short float2_to_fp8x2_e5m2(float lo, float hi) { return float2_to_fp8x2<true>(lo, hi); }
__device__ __forceinline__ unsigned char float_to_fp8_e4m3(float f) { return float_to_fp8<false>(f); }
__device__ __forceinline__ unsigned char float_to_fp8_e5m2(float f) { return float_to_fp8<true>(f); }

// ---------------------------------------------------------------------------------------------------------------
// One tensor-core tile, the whole warp together: D(16x8 f32) += A(16x16, row-major) * B(16x8, col-major), with
// f16 (mma_m16n8k16_f16_f32) or bf16 (mma_m16n8k16_bf16_f32) inputs; the layout is the same for both.
// Fragments per lane (g = lane / 4, t = lane % 4; two 16-bit values per register, lower k or column in the low half):
//   a[0]: A[g][2t..2t+1]   a[1]: A[g+8][2t..2t+1]   a[2]: A[g][2t+8..2t+9]   a[3]: A[g+8][2t+8..2t+9]
//   b[0]: B[2t..2t+1][g]   b[1]: B[2t+8..2t+9][g]
//   d[0], d[1]: D[g][2t], D[g][2t+1]                 d[2], d[3]: D[g+8][2t], D[g+8][2t+1]
// (ds4py/cuda/twins/mma.py packs and unpacks these.) sm_80+ only (no fallback: using it for an older arch does not
// compile). The emulator sums each element in double (C, then k ascending) and rounds once.
#if defined(DS4_EMU)
#define mma_m16n8k16_f16_f32(d, a, b) \
    ::__emu::mma_m16n8k16<::__emu::half_bits_to_float>(EMU_SITE("mma_m16n8k16_f16_f32"), (d), (a), (b))
#define mma_m16n8k16_bf16_f32(d, a, b) \
    ::__emu::mma_m16n8k16<::__emu::bf16_bits_to_float>(EMU_SITE("mma_m16n8k16_bf16_f32"), (d), (a), (b))
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void mma_m16n8k16_f16_f32(float* d, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_m16n8k16_bf16_f32(float* d, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// ldsm_x4(r, row): ldmatrix.sync.aligned.m8n8.x4.shared.b16, the whole warp together. Lane i gives `row`, the
// 16-byte aligned shared-memory address of row i % 8 of matrix i / 8 (8 consecutive 16-bit values); lane l receives
// in r[j] the two values at row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1 of matrix j (lower column in the low
// half): with the matrices chosen as the quadrants of a 16 x 16 A tile or two k halves of two 8-row B tiles, r holds
// the mma_m16n8k16 fragments above. The emulator exchanges the row addresses (one warp collective) and each lane
// reads its own 4 bytes of each matrix. sm_80+ only, as the MMA it feeds.
#if defined(DS4_EMU)
#define ldsm_x4(r, row) ::ds4_emu_ldsm_x4(EMU_SITE("ldsm_x4"), (r), (row))
inline void ds4_emu_ldsm_x4(::__emu::Site s, unsigned* r, const void* row) {
    const void* rows[4];
    ::__emu::ldsm_rows(s, row, rows);
    for (int j = 0; j < 4; j++) r[j] = *static_cast<const unsigned*>(rows[j]);
}
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(ds4_smem_addr(row)));
}
#endif
