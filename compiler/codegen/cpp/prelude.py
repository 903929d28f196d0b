"""The C++ helpers every generated kernel includes as ``kiln_prelude.h``.

Reduced-precision types are stored as ``uint16_t`` and converted with bit arithmetic
(branch-free, so loops that use them still vectorize): fp16 rounds to nearest even with
IEEE overflow, subnormals and NaN; bf16 rounds to nearest even and keeps NaN a NaN.
Float min/max propagate NaN as eager does. With ``KILN_HAVE_LIBMVEC`` (glibc 2.35 or
later), libm functions are declared with their vector variants so that ``#pragma omp
simd`` loops call glibc's vectorized ``expf``, ``erff``, ... instead of the scalar ones.
"""

from __future__ import annotations

PRELUDE_NAME = "kiln_prelude.h"

# libm functions kernels call, declared here rather than through <math.h>, whose C++
# wrapper costs more compile time than a whole kernel. Unary, then binary; each has a
# float ("f" suffix) and a double version.
_VECTOR_UNARY = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan",
                 "sinh", "cosh", "tanh", "asin", "acos", "atan", "asinh", "acosh", "atanh",
                 "erf", "erfc")
_SCALAR_UNARY = ("sqrt", "lgamma", "floor", "ceil", "nearbyint", "trunc", "fabs")
_VECTOR_BINARY = ("atan2", "hypot", "pow")
_SCALAR_BINARY = ("fmod", "copysign", "nextafter")


def _libm_declarations() -> str:
    """Declarations of the libm functions; with glibc's vector math library, the ones it
    has in vector form carry ``simd`` so that vectorized loops call those."""
    simd = ' KILN_SIMD'
    lines = ['extern "C" {']
    for names, params, vector in ((_VECTOR_UNARY, 1, True), (_SCALAR_UNARY, 1, False),
                                  (_VECTOR_BINARY, 2, True), (_SCALAR_BINARY, 2, False)):
        for fn in names:
            for ct, suffix in (("float", "f"), ("double", "")):
                args = ", ".join([ct] * params)
                lines.append(f"{ct} {fn}{suffix}({args}) noexcept{simd if vector else ''};")
    lines.append("}")
    return "\n".join(lines)


_HEAD = """// Kiln C++ kernel prelude: types, conversions and helpers for generated kernels.
#pragma once
#include <stdint.h>
#include <omp.h>

#ifdef KILN_HAVE_LIBMVEC
#define KILN_SIMD __attribute__((__simd__("notinbranch")))
#else
#define KILN_SIMD
#endif
%s

#define KILN_INLINE static inline __attribute__((always_inline))
#define KILN_MAX_THREADS 256
"""

_CONVERSIONS = r"""
KILN_INLINE float kiln_bits_to_f32(uint32_t u) { return __builtin_bit_cast(float, u); }
KILN_INLINE uint32_t kiln_f32_to_bits(float f) { return __builtin_bit_cast(uint32_t, f); }

// bf16 is the high half of a float; rounding adds half an ulp plus the tie-to-even bit.
KILN_INLINE float kiln_bf16_to_f32(uint16_t h) { return kiln_bits_to_f32((uint32_t)h << 16); }
KILN_INLINE uint16_t kiln_f32_to_bf16(float f) {
    uint32_t u = kiln_f32_to_bits(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7fc0u : (uint16_t)rounded;
}

// IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
KILN_INLINE float kiln_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    uint32_t normal = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    uint32_t special = sign | 0x7f800000u | (mantissa << 13);
    float subnormal = (float)mantissa * 5.9604644775390625e-08f;  // mantissa * 2^-24
    float signed_subnormal = sign ? -subnormal : subnormal;
    float wide = kiln_bits_to_f32(exponent == 31u ? special : normal);
    return exponent == 0u ? signed_subnormal : wide;
}
KILN_INLINE uint16_t kiln_f32_to_f16(float f) {
    uint32_t u = kiln_f32_to_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    // Normal results: rebias the exponent, round the 13 dropped bits to nearest even.
    uint32_t normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    // Subnormal results: adding 0.5 makes the FPU round |f| to a multiple of 2^-24.
    uint32_t subnormal = kiln_f32_to_bits(kiln_bits_to_f32(a) + 0.5f) - 0x3f000000u;
    uint32_t finite = a >= 0x477ff000u ? 0x7c00u : (a < 0x38800000u ? subnormal : normal);
    return (uint16_t)(sign | (a > 0x7f800000u ? 0x7e00u : finite));
}
"""

_ARITHMETIC = r"""
// Python-style division and remainder (eager's floor_divide / remainder semantics).
#define KILN_FLOAT_DIVMOD(T, SUFFIX)                                                    \
KILN_INLINE T kiln_floordiv_##SUFFIX(T a, T b) {                                        \
    if (b == 0) return a / b;                                                           \
    T mod = fmod##SUFFIX(a, b);                                                         \
    T div = (a - mod) / b;                                                              \
    if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1;                                   \
    if (div == 0) return copysign##SUFFIX(0, a / b);                                    \
    T floored = floor##SUFFIX(div);                                                     \
    return div - floored > (T)0.5 ? floored + 1 : floored;                              \
}                                                                                       \
KILN_INLINE T kiln_remainder_##SUFFIX(T a, T b) {                                       \
    T mod = fmod##SUFFIX(a, b);                                                         \
    return (mod != 0 && ((b < 0) != (mod < 0))) ? mod + b : mod;                        \
}
KILN_FLOAT_DIVMOD(float, f)
KILN_FLOAT_DIVMOD(double, )

template <typename T> KILN_INLINE T kiln_floordiv_int(T a, T b) {
    if (b == 0) return 0;
    T q = a / b;
    return ((a % b != 0) && ((a < 0) != (b < 0))) ? (T)(q - 1) : q;
}
template <typename T> KILN_INLINE T kiln_remainder_int(T a, T b) {
    if (b == 0) return 0;
    T r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? (T)(r + b) : r;
}
template <typename T> KILN_INLINE T kiln_truncdiv_int(T a, T b) { return b == 0 ? 0 : a / b; }
template <typename T> KILN_INLINE T kiln_fmod_int(T a, T b) { return b == 0 ? 0 : a % b; }

template <typename T> KILN_INLINE T kiln_pow_int(T base, T exponent) {
    if (exponent < 0) {
        if (base == 1) return 1;
        if (base == (T)-1) return (exponent & 1) ? (T)-1 : (T)1;
        return 0;
    }
    T result = 1;
    while (exponent) {
        if (exponent & 1) result = (T)(result * base);
        base = (T)(base * base);
        exponent >>= 1;
    }
    return result;
}

// Shifts by the width or more give 0 (or -1 for negative values shifted right).
template <typename T> KILN_INLINE T kiln_shift_left(T a, T b) {
    return (b < 0 || b >= (T)(8 * sizeof(T))) ? (T)0 : (T)((uint64_t)a << b);
}
template <typename T> KILN_INLINE T kiln_shift_right(T a, T b) {
    return (b < 0 || b >= (T)(8 * sizeof(T))) ? (T)(a < 0 ? -1 : 0) : (T)(a >> b);
}
"""

_SPECIAL = r"""
// erfinv: Giles' single-precision approximation, refined by Newton steps on erf.
#define KILN_ERFINV(T, SUFFIX, STEPS)                                                   \
KILN_INLINE T kiln_erfinv_##SUFFIX(T y) {                                               \
    if (y != y || y < -1 || y > 1) return (T)__builtin_nan("");                         \
    if (y == 1 || y == -1) return y * (T)__builtin_inf();                               \
    T w = -log##SUFFIX(((T)1 - y) * ((T)1 + y));                                        \
    T p;                                                                                \
    if (w < (T)5) {                                                                     \
        w = w - (T)2.5;                                                                 \
        p = (T)2.81022636e-08;                                                          \
        p = (T)3.43273939e-07 + p * w; p = (T)-3.5233877e-06 + p * w;                   \
        p = (T)-4.39150654e-06 + p * w; p = (T)0.00021858087 + p * w;                   \
        p = (T)-0.00125372503 + p * w; p = (T)-0.00417768164 + p * w;                   \
        p = (T)0.246640727 + p * w; p = (T)1.50140941 + p * w;                          \
    } else {                                                                            \
        w = sqrt##SUFFIX(w) - (T)3;                                                     \
        p = (T)-0.000200214257;                                                         \
        p = (T)0.000100950558 + p * w; p = (T)0.00134934322 + p * w;                    \
        p = (T)-0.00367342844 + p * w; p = (T)0.00573950773 + p * w;                    \
        p = (T)-0.0076224613 + p * w; p = (T)0.00943887047 + p * w;                     \
        p = (T)1.00167406 + p * w; p = (T)2.83297682 + p * w;                           \
    }                                                                                   \
    T x = p * y;                                                                        \
    for (int i = 0; i < STEPS; ++i)                                                     \
        x = x - (erf##SUFFIX(x) - y) / ((T)1.1283791670955126 * exp##SUFFIX(-x * x));   \
    return x;                                                                           \
}
KILN_ERFINV(float, f, 2)
KILN_ERFINV(double, , 4)

template <typename T> KILN_INLINE T kiln_maximum(T a, T b) { return (a != a || a > b) ? a : b; }
template <typename T> KILN_INLINE T kiln_minimum(T a, T b) { return (a != a || a < b) ? a : b; }

// (v, i) beats (best, bi) for argmax: larger, or NaN over a number; ties go to the
// lower index. An index of -1 marks an empty accumulator.
template <typename T> KILN_INLINE bool kiln_argmax_better(T v, int64_t i, T best, int64_t bi) {
    if (i < 0) return false;
    if (bi < 0) return true;
    bool vn = v != v, bn = best != best;
    if (vn || bn) return vn && (!bn || i < bi);
    return v > best || (v == best && i < bi);
}
template <typename T> KILN_INLINE bool kiln_argmin_better(T v, int64_t i, T best, int64_t bi) {
    if (i < 0) return false;
    if (bi < 0) return true;
    bool vn = v != v, bn = best != best;
    if (vn || bn) return vn && (!bn || i < bi);
    return v < best || (v == best && i < bi);
}

// Chan et al.'s combination of two Welford partials (mean, m2, weight).
template <typename T>
KILN_INLINE void kiln_welford_combine(T& mean, T& m2, T& weight, T mean_b, T m2_b, T weight_b) {
    T new_weight = weight + weight_b;
    T fraction = new_weight == 0 ? (T)0 : weight_b / new_weight;
    T delta = mean_b - mean;
    mean = mean + delta * fraction;
    m2 = m2 + m2_b + delta * delta * weight * fraction;
    weight = new_weight;
}
"""

# A scatter's combining stores: threads may hit the same element, so each update is a
# compare-and-swap loop (GCC's generic atomics work for float and double as well).
_ATOMICS = r"""
template <typename T, typename F> KILN_INLINE void kiln_atomic_update(T* p, T v, F combine) {
    T old;
    __atomic_load(p, &old, __ATOMIC_RELAXED);
    T desired = combine(old, v);
    while (!__atomic_compare_exchange(p, &old, &desired, true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
        desired = combine(old, v);
    }
}
template <typename T> KILN_INLINE void kiln_atomic_add(T* p, T v) {
    kiln_atomic_update(p, v, [](T a, T b) { return a + b; });
}
template <typename T> KILN_INLINE void kiln_atomic_max(T* p, T v) {
    kiln_atomic_update(p, v, [](T a, T b) { return kiln_maximum(a, b); });
}
template <typename T> KILN_INLINE void kiln_atomic_min(T* p, T v) {
    kiln_atomic_update(p, v, [](T a, T b) { return kiln_minimum(a, b); });
}
"""


def prelude_source() -> str:
    """The full text of ``kiln_prelude.h``."""
    return (_HEAD % _libm_declarations()) + _CONVERSIONS + _ARITHMETIC + _SPECIAL + _ATOMICS
