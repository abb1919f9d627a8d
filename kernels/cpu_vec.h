// What the CPU kernels share (kernels/cpu_ops.cpp, cpu_attention.cpp): element types, their loads and
// stores, and 16-float vectors through GCC's vector extensions.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>

namespace {

typedef int64_t i64;

inline float bf16_to_float(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}

template <typename T> inline float load(const T* p, i64 i);
template <> inline float load<float>(const float* p, i64 i) { return p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, i64 i) { return bf16_to_float(p[i]); }

template <typename T> inline void store(T* p, i64 i, float x);
template <> inline void store<float>(float* p, i64 i, float x) { p[i] = x; }
template <> inline void store<uint16_t>(uint16_t* p, i64 i, float x) { p[i] = float_to_bf16(x); }

template <typename T> inline float round_to(float x);
template <> inline float round_to<float>(float x) { return x; }
template <> inline float round_to<uint16_t>(float x) { return bf16_to_float(float_to_bf16(x)); }

// 16 floats: GCC's vector extensions, lowered to AVX-512, AVX2 or SSE by -march=native.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 loadv(const float* p) { v16 v; std::memcpy(&v, p, 64); return v; }
inline void storev(float* p, v16 v) { std::memcpy(p, &v, 64); }
inline float hmax(v16 v) { float m = v[0]; for (int i = 1; i < 16; ++i) m = std::max(m, v[i]); return m; }
inline float hsum(v16 v) { float s = 0.0f; for (int i = 0; i < 16; ++i) s += v[i]; return s; }

typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

// 16 elements from p, as floats.
template <typename T> inline v16 load16(const T* p);
template <> inline v16 load16<float>(const float* p) { return loadv(p); }
template <> inline v16 load16<uint16_t>(const uint16_t* p) {
    v16h h;
    std::memcpy(&h, p, 32);
    return (v16)(__builtin_convertvector(h, v16u) << 16);
}

// Transposes the 16 x 16 floats of r in place: four rounds of interleaving rows i and i + 8.
inline void transpose16(v16 r[16]) {
    const v16i lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const v16i hi = lo + 8;
    for (int round = 0; round < 4; ++round) {
        v16 n[16];
        for (int i = 0; i < 8; ++i) {
            n[2 * i] = __builtin_shuffle(r[i], r[i + 8], lo);
            n[2 * i + 1] = __builtin_shuffle(r[i], r[i + 8], hi);
        }
        for (int i = 0; i < 16; ++i) r[i] = n[i];
    }
}

// exp(x), relative error ~2e-7; 0 below -87, finite above 88 (the callers need no more).
inline v16 exp_v(v16 x) {
    x = x < -87.0f ? v16{} - 87.0f : x;
    x = x > 88.0f ? v16{} + 88.0f : x;
    const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
    const v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16)bits;
}

}  // namespace
