// __half, __half2, __nv_bfloat16 for the CPU emulator: storage types with bit-exact round-to-nearest-even
// conversions and the cuda_fp16.h / cuda_bf16.h functions kernels use. Arithmetic goes through float and rounds
// once, like the device's half instructions for + - * (fma rounds once too).
#pragma once

namespace __emu {
inline unsigned f32_bits(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float bits_f32(unsigned u) { float f; memcpy(&f, &u, 4); return f; }

inline unsigned short float_to_half_bits(float f) {
    const unsigned x = f32_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return 0x7fffu;                          // NaN: CUDA's canonical half NaN
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 rounds to infinity
    if (ax < 0x38800000u) {                                          // below 2^-14: half subnormal or zero
        if (ax <= 0x33000000u) return (unsigned short)sign;          // <= 2^-25: rounds to zero (tie to even)
        const unsigned e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, shift = 126 - e;
        unsigned q = m >> shift;
        const unsigned rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
        q += rem > half || (rem == half && (q & 1u));
        return (unsigned short)(sign | q);
    }
    const unsigned r = ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u;
    return (unsigned short)(sign | (r >> 13));
}

inline float half_bits_to_float(unsigned short h) {
    const unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    if (e == 31u) return bits_f32(sign | 0x7f800000u | (m << 13));
    if (e == 0u) {
        const float mag = (float)m * 5.9604644775390625e-08f;       // m * 2^-24, exact
        return sign ? -mag : mag;
    }
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

inline unsigned short float_to_bf16_bits(float f) {
    const unsigned x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float bf16_bits_to_float(unsigned short b) { return bits_f32((unsigned)b << 16); }
}  // namespace __emu

struct __half_raw { unsigned short x; };
struct __half2_raw { unsigned short x, y; };

struct __attribute__((aligned(2))) __half {
    unsigned short __x;
    __half() = default;
    __half(__half_raw r) : __x(r.x) {}
    __half(float f) : __x(__emu::float_to_half_bits(f)) {}
    __half(double f) : __x(__emu::float_to_half_bits((float)f)) {}
    __half(int i) : __x(__emu::float_to_half_bits((float)i)) {}
    __half(unsigned i) : __x(__emu::float_to_half_bits((float)i)) {}
    __half(long long i) : __x(__emu::float_to_half_bits((float)i)) {}
    __half(unsigned long long i) : __x(__emu::float_to_half_bits((float)i)) {}
    __half(short i) : __x(__emu::float_to_half_bits((float)i)) {}
    __half(unsigned short i) : __x(__emu::float_to_half_bits((float)i)) {}
    operator float() const { return __emu::half_bits_to_float(__x); }
    operator __half_raw() const { return __half_raw{__x}; }
    __half& operator=(float f) { __x = __emu::float_to_half_bits(f); return *this; }
    __half& operator+=(const __half& o) { *this = __half(float(*this) + float(o)); return *this; }
    __half& operator-=(const __half& o) { *this = __half(float(*this) - float(o)); return *this; }
    __half& operator*=(const __half& o) { *this = __half(float(*this) * float(o)); return *this; }
    __half& operator/=(const __half& o) { *this = __half(float(*this) / float(o)); return *this; }
};
typedef __half half;

inline __half operator+(const __half& a, const __half& b) { return __half(float(a) + float(b)); }
inline __half operator-(const __half& a, const __half& b) { return __half(float(a) - float(b)); }
inline __half operator*(const __half& a, const __half& b) { return __half(float(a) * float(b)); }
inline __half operator/(const __half& a, const __half& b) { return __half(float(a) / float(b)); }
inline __half operator-(const __half& a) { __half r = a; r.__x ^= 0x8000u; return r; }
inline __half operator+(const __half& a) { return a; }
inline bool operator==(const __half& a, const __half& b) { return float(a) == float(b); }
inline bool operator!=(const __half& a, const __half& b) { return float(a) != float(b); }
inline bool operator<(const __half& a, const __half& b) { return float(a) < float(b); }
inline bool operator>(const __half& a, const __half& b) { return float(a) > float(b); }
inline bool operator<=(const __half& a, const __half& b) { return float(a) <= float(b); }
inline bool operator>=(const __half& a, const __half& b) { return float(a) >= float(b); }

struct __attribute__((aligned(4))) __half2 {
    __half x, y;
    __half2() = default;
    __half2(__half a, __half b) : x(a), y(b) {}
    __half2(__half2_raw r) { x.__x = r.x; y.__x = r.y; }
    operator __half2_raw() const { return __half2_raw{x.__x, y.__x}; }
};
typedef __half2 half2;
inline __half2 operator+(const __half2& a, const __half2& b) { return __half2(a.x + b.x, a.y + b.y); }
inline __half2 operator-(const __half2& a, const __half2& b) { return __half2(a.x - b.x, a.y - b.y); }
inline __half2 operator*(const __half2& a, const __half2& b) { return __half2(a.x * b.x, a.y * b.y); }
inline __half2 operator/(const __half2& a, const __half2& b) { return __half2(a.x / b.x, a.y / b.y); }
inline __half2& operator+=(__half2& a, const __half2& b) { a = a + b; return a; }
inline __half2& operator*=(__half2& a, const __half2& b) { a = a * b; return a; }

inline float __half2float(__half h) { return float(h); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __double2half(double d) { return __half((float)d); }  // (double rounding; fine for tests)
inline __half2 __float2half2_rn(float f) { return __half2(__half(f), __half(f)); }
inline __half2 __floats2half2_rn(float a, float b) { return __half2(__half(a), __half(b)); }
inline __half2 __halves2half2(__half a, __half b) { return __half2(a, b); }
inline __half2 __half2half2(__half a) { return __half2(a, a); }
inline __half2 make_half2(__half a, __half b) { return __half2(a, b); }
inline float __low2float(__half2 h) { return float(h.x); }
inline float __high2float(__half2 h) { return float(h.y); }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline __half2 __lows2half2(__half2 a, __half2 b) { return __half2(a.x, b.x); }
inline __half2 __highs2half2(__half2 a, __half2 b) { return __half2(a.y, b.y); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline short __half_as_short(__half h) { return (short)h.__x; }
inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
inline __half __short_as_half(short u) { __half h; h.__x = (unsigned short)u; return h; }
inline __half __hadd(__half a, __half b) { return a + b; }
inline __half __hsub(__half a, __half b) { return a - b; }
inline __half __hmul(__half a, __half b) { return a * b; }
inline __half __hdiv(__half a, __half b) { return a / b; }
inline __half __hneg(__half a) { return -a; }
inline __half __habs(__half a) { a.__x &= 0x7fffu; return a; }
inline __half __hfma(__half a, __half b, __half c) { return __half((float)((double)float(a) * float(b) + float(c))); }
inline __half __hmax(__half a, __half b) { return float(a) >= float(b) || float(b) != float(b) ? a : b; }
inline __half __hmin(__half a, __half b) { return float(a) <= float(b) || float(b) != float(b) ? a : b; }
inline bool __hisnan(__half a) { return (a.__x & 0x7fffu) > 0x7c00u; }
inline int __hisinf(__half a) { return (a.__x & 0x7fffu) == 0x7c00u ? ((a.__x & 0x8000u) ? -1 : 1) : 0; }
inline __half2 __hadd2(__half2 a, __half2 b) { return a + b; }
inline __half2 __hsub2(__half2 a, __half2 b) { return a - b; }
inline __half2 __hmul2(__half2 a, __half2 b) { return a * b; }
inline __half2 __hfma2(__half2 a, __half2 b, __half2 c) { return __half2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }
inline float2 __half22float2(__half2 h) { return float2{float(h.x), float(h.y)}; }
inline __half2 __float22half2_rn(float2 f) { return __half2(__half(f.x), __half(f.y)); }
inline __half hsqrt(__half a) { return __half(sqrtf(float(a))); }
inline __half hexp(__half a) { return __half(expf(float(a))); }

struct __nv_bfloat16_raw { unsigned short x; };
struct __attribute__((aligned(2))) __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(__nv_bfloat16_raw r) : __x(r.x) {}
    __nv_bfloat16(float f) : __x(__emu::float_to_bf16_bits(f)) {}
    __nv_bfloat16(double f) : __x(__emu::float_to_bf16_bits((float)f)) {}
    __nv_bfloat16(int i) : __x(__emu::float_to_bf16_bits((float)i)) {}
    operator float() const { return __emu::bf16_bits_to_float(__x); }
};
typedef __nv_bfloat16 nv_bfloat16;
struct __attribute__((aligned(4))) __nv_bfloat162 {
    __nv_bfloat16 x, y;
    __nv_bfloat162() = default;
    __nv_bfloat162(__nv_bfloat16 a, __nv_bfloat16 b) : x(a), y(b) {}
};
typedef __nv_bfloat162 nv_bfloat162;
inline float __bfloat162float(__nv_bfloat16 b) { return float(b); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __low2float(__nv_bfloat162 h) { return float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return float(h.y); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162(a, b); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 b; b.__x = u; return b; }
