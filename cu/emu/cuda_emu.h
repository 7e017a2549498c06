// cuda_emu.h: run cu/*.cu kernels on the CPU for tests. Force-included ahead of a kernel source by
// ds4py/cuda/emu.py (g++ -DDS4_EMU -include cu/emu/cuda_emu.h); provides what NVRTC would: qualifiers, vector
// types, built-in variables, __half/bf16, math and integer intrinsics, warp intrinsics, barriers and atomics.
// Test infrastructure, not a backend: see cu/README.md for how it works and what it cannot show.
#pragma once
#ifndef DS4_EMU
#define DS4_EMU 1
#endif

#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <type_traits>
#include <utility>

// ---- qualifiers ------------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
#define __constant__
#define __managed__
// Static shared memory: one instance per kernel (blocks run one at a time), kept in its own section so each
// block can start with it poisoned. `extern __shared__` (dynamic) is rewritten by emu.py (see rewrite_source).
// g++ ignores this section attribute on a function template's static local (own COMDAT .bss section instead):
// emu.py moves those into emu_shared after compiling (_move_template_shared), or no checker would see them.
#define __shared__ static __attribute__((section("emu_shared")))

// ---- vector types ----------------------------------------------------------------------------------------------
#define EMU_VEC2(T, N, A) struct __attribute__((aligned(A))) N##2 { T x, y; }; \
    inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }
#define EMU_VEC3(T, N) struct N##3 { T x, y, z; }; \
    inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }
#define EMU_VEC4(T, N, A) struct __attribute__((aligned(A))) N##4 { T x, y, z, w; }; \
    inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
#define EMU_VEC1(T, N) struct N##1 { T x; }; inline N##1 make_##N##1(T x) { return N##1{x}; }
#define EMU_VECS(T, N, A2, A4) EMU_VEC1(T, N) EMU_VEC2(T, N, A2) EMU_VEC3(T, N) EMU_VEC4(T, N, A4)
EMU_VECS(signed char, char, 2, 4)
EMU_VECS(unsigned char, uchar, 2, 4)
EMU_VECS(short, short, 4, 8)
EMU_VECS(unsigned short, ushort, 4, 8)
EMU_VECS(int, int, 8, 16)
EMU_VECS(long long, longlong, 16, 16)
EMU_VECS(unsigned long long, ulonglong, 16, 16)
EMU_VECS(float, float, 8, 16)
EMU_VECS(double, double, 16, 16)
EMU_VEC1(unsigned, uint) EMU_VEC2(unsigned, uint, 8) EMU_VEC4(unsigned, uint, 16)
struct uint3 { unsigned x, y, z; };
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

#include "emu_half.h"
#include "emu_runtime.h"

// ---- barriers and warp intrinsics (each names its call site so divergence reports point at the source) -----
#define EMU_SITE(name) (::__emu::Site{name, __FILE__, __LINE__})
#define __syncthreads() ((void)::__emu::barrier(EMU_SITE("__syncthreads"), ::__emu::BAR_PLAIN, 0))
#define __syncthreads_count(p) ::__emu::barrier(EMU_SITE("__syncthreads_count"), ::__emu::BAR_COUNT, (p))
#define __syncthreads_and(p) ::__emu::barrier(EMU_SITE("__syncthreads_and"), ::__emu::BAR_AND, (p))
#define __syncthreads_or(p) ::__emu::barrier(EMU_SITE("__syncthreads_or"), ::__emu::BAR_OR, (p))
#define __syncwarp(...) ::__emu::syncwarp(EMU_SITE("__syncwarp"), ::__emu::mask_or_full(__VA_ARGS__))
#define __shfl_sync(m, v, ...) ::__emu::shfl_idx(EMU_SITE("__shfl_sync"), (m), (v), EMU_SHFL_ARGS(__VA_ARGS__))
#define __shfl_up_sync(m, v, ...) ::__emu::shfl_up(EMU_SITE("__shfl_up_sync"), (m), (v), EMU_SHFL_ARGS(__VA_ARGS__))
#define __shfl_down_sync(m, v, ...) ::__emu::shfl_down(EMU_SITE("__shfl_down_sync"), (m), (v), EMU_SHFL_ARGS(__VA_ARGS__))
#define __shfl_xor_sync(m, v, ...) ::__emu::shfl_xor(EMU_SITE("__shfl_xor_sync"), (m), (v), EMU_SHFL_ARGS(__VA_ARGS__))
#define EMU_SHFL_ARGS(...) EMU_SHFL_PICK(__VA_ARGS__, 32)
#define EMU_SHFL_PICK(a, w, ...) (a), (w)
#define __ballot_sync(m, p) ::__emu::ballot(EMU_SITE("__ballot_sync"), (m), (p))
#define __any_sync(m, p) (::__emu::ballot(EMU_SITE("__any_sync"), (m), (p)) != 0u)
#define __all_sync(m, p) (::__emu::ballot(EMU_SITE("__all_sync"), (m), (p)) == (unsigned)(m))
#define __match_any_sync(m, v) ::__emu::match_any(EMU_SITE("__match_any_sync"), (m), (v))
#define __reduce_add_sync(m, v) ::__emu::reduce<decltype(+(v)), 0>(EMU_SITE("__reduce_add_sync"), (m), (v))
#define __reduce_min_sync(m, v) ::__emu::reduce<decltype(+(v)), 1>(EMU_SITE("__reduce_min_sync"), (m), (v))
#define __reduce_max_sync(m, v) ::__emu::reduce<decltype(+(v)), 2>(EMU_SITE("__reduce_max_sync"), (m), (v))
#define __reduce_and_sync(m, v) ::__emu::reduce<unsigned, 3>(EMU_SITE("__reduce_and_sync"), (m), (unsigned)(v))
#define __reduce_or_sync(m, v) ::__emu::reduce<unsigned, 4>(EMU_SITE("__reduce_or_sync"), (m), (unsigned)(v))
#define __reduce_xor_sync(m, v) ::__emu::reduce<unsigned, 5>(EMU_SITE("__reduce_xor_sync"), (m), (unsigned)(v))
namespace __emu { inline unsigned mask_or_full(unsigned m = 0xffffffffu) { return m; } }

// Memory fences order nothing here: one fiber runs at a time, so every store is visible at once.
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
inline void __nanosleep(unsigned) {}
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }
inline int __isGlobal(const void*) { return 1; }
#define __trap() ::__emu::fail("__trap() called")
#define __brkpt() ::__emu::fail("__brkpt() called")

// ---- atomics: a fiber is never interrupted between its own instructions, so a plain read-modify-write is atomic
// (The race build records each as one atomic access: two atomics to one address are no race.)
#define EMU_ATOMIC(name, expr) \
    template <class T, class U> EMU_NO_TSAN inline T name(T* p, U v_) { \
        EMU_RACE(::__emu::race::access(p, sizeof(T), 1, 1);) \
        EMU_TRAFFIC(::__emu::traffic::atomic_access(p, sizeof(T));) const T v = (T)v_; T old = *p; *p = (expr); return old; }
EMU_ATOMIC(atomicAdd, old + v)
EMU_ATOMIC(atomicSub, old - v)
EMU_ATOMIC(atomicExch, v)
EMU_ATOMIC(atomicMax, v > old ? v : old)
EMU_ATOMIC(atomicMin, v < old ? v : old)
EMU_ATOMIC(atomicAnd, old & v)
EMU_ATOMIC(atomicOr, old | v)
EMU_ATOMIC(atomicXor, old ^ v)
EMU_NO_TSAN inline unsigned atomicInc(unsigned* p, unsigned lim) { EMU_RACE(::__emu::race::access(p, 4, 1, 1);) EMU_TRAFFIC(::__emu::traffic::atomic_access(p, 4);) unsigned o = *p; *p = o >= lim ? 0 : o + 1; return o; }
EMU_NO_TSAN inline unsigned atomicDec(unsigned* p, unsigned lim) { EMU_RACE(::__emu::race::access(p, 4, 1, 1);) EMU_TRAFFIC(::__emu::traffic::atomic_access(p, 4);) unsigned o = *p; *p = (o == 0 || o > lim) ? lim : o - 1; return o; }
template <class T, class U, class V> EMU_NO_TSAN inline T atomicCAS(T* p, U cmp, V val) {
    EMU_RACE(::__emu::race::access(p, sizeof(T), 1, 1);)
    EMU_TRAFFIC(::__emu::traffic::atomic_access(p, sizeof(T));)
    T old = *p;
    if (old == (T)cmp) *p = (T)val;
    return old;
}
#define atomicAdd_block atomicAdd
#define atomicAdd_system atomicAdd
#define atomicMax_block atomicMax
#define atomicCAS_block atomicCAS

// ---- math and bit intrinsics -----------------------------------------------------------------------------------
// libm in float: the GPU's fast approximations (__expf, rsqrtf, ...) are within a few ulp of these.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __log10f(float x) { return log10f(x); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanf(float x) { return tanf(x); }
inline void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
inline float exp10f(float x) { return powf(10.0f, x); }
inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
inline long long __double_as_longlong(double d) { long long i; memcpy(&i, &d, 8); return i; }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline int __float2int_rd(float x) { return (int)floorf(x); }
inline int __float2int_ru(float x) { return (int)ceilf(x); }
inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
inline unsigned __float2uint_rz(float x) { return (unsigned)x; }
inline float __int2float_rn(int x) { return (float)x; }
inline float __uint2float_rn(unsigned x) { return (float)x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)(((((uint64_t)hi << 32) | lo) << (s & 31)) >> 32);
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)((((uint64_t)hi << 32) | lo) >> (s & 31));
}
inline int __mul24(int a, int b) { return (int)(((int64_t)(a << 8 >> 8)) * (b << 8 >> 8)); }
inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }
inline int __mulhi(int a, int b) { return (int)(((int64_t)a * b) >> 32); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((uint64_t)a * b) >> 32); }
inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}
inline unsigned __dp4a(unsigned a, unsigned b, unsigned c) {
    for (int i = 0; i < 4; i++) c += ((a >> (8 * i)) & 0xffu) * ((b >> (8 * i)) & 0xffu);
    return c;
}
inline int __sad(int a, int b, unsigned c) { return (int)(c + (unsigned)(a > b ? a - b : b - a)); }
inline int __hadd(int a, int b) { return (int)(((int64_t)a + b) >> 1); }

// CUDA's global min/max overloads (mixed signed/unsigned picks the unsigned one, like the CUDA headers).
#define EMU_MINMAX(T) inline T min(T a, T b) { return a < b ? a : b; } inline T max(T a, T b) { return a > b ? a : b; }
EMU_MINMAX(int) EMU_MINMAX(unsigned) EMU_MINMAX(long) EMU_MINMAX(unsigned long) EMU_MINMAX(long long)
EMU_MINMAX(unsigned long long)
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
inline unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
inline unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }
inline double min(float a, double b) { return fmin(a, b); }
inline double min(double a, float b) { return fmin(a, b); }
inline double max(float a, double b) { return fmax(a, b); }
inline double max(double a, float b) { return fmax(a, b); }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a > b ? a : b; }
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }

// ---- the C interface used by ds4py/cuda/emu.py ---------------------------------------------------------------
#define EMU_API extern "C" __attribute__((visibility("default")))

EMU_API const char* emu_message() { return __emu::L.msg; }
// The pdl check for the next launches: n writable argument buffers [starts[i], +lens[i]) (page-aligned bodies)
// read-only until the storing thread has called pdl_wait(); n = -1 turns the check off. The caller restores
// the buffers' protection after each launch.
EMU_API int emu_pdl_check(int n, void** starts, const size_t* lens) {
    if (n < 0 || n > 32) { __emu::L.pdl_check = 0; __emu::L.nwatch = 0; return n < 0 ? 0 : -1; }
    __emu::L.pdl_check = 1;
    __emu::L.nwatch = n;
    for (int i = 0; i < n; i++) { __emu::L.watch_lo[i] = (char*)starts[i]; __emu::L.watch_len[i] = lens[i]; }
    return 0;
}
EMU_API void* emu_fault_address() { return __emu::L.fault_addr; }
EMU_API size_t emu_static_smem_bytes() {
    return __start_emu_shared && __stop_emu_shared ? (size_t)(__stop_emu_shared - __start_emu_shared) : 0;
}

#if defined(DS4_EMU_RACE) || defined(DS4_EMU_ASAN) || defined(DS4_EMU_TRAFFIC)
#include "emu_check.h"
#endif
