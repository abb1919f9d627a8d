// Linears on weights held in blocks of 32 as in GGUF's Q4_1 (value = d * q + m, q in 0..15) and
// Q8_0 (value = d * q, q in -128..127), whose d and m are float16 values, kept here as float32 so
// that the kernel broadcasts them straight from memory. Compiled with cpu_ops.cpp into one library
// (see kernels/cpu.py). `hc_quantize` encodes float32 weights in such blocks only where every
// block reproduces its 32 values exactly (weights dequantised from a GGUF file do), so
// `hc_linear_quant` multiplies by exactly the weights a float32 linear would: the outputs differ
// from it only by the order of the float32 sums. Activations and sums stay float32.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

typedef int64_t i64;
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

constexpr int QK = 32;  // weights of one block
#ifndef PREFETCH
#define PREFETCH 8192
#endif

struct BlockQ4_1 { float d, m; uint8_t qs[QK / 2]; };  // qs[i]: q[i] low nibble, q[i + 16] high
struct BlockQ8_0 { float d; int8_t qs[QK]; };
static_assert(sizeof(BlockQ4_1) == 24 && sizeof(BlockQ8_0) == 36, "block sizes (kernels/cpu.py QUANT_KINDS)");

inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 31, mant = h & 0x3ff;
    if (exp == 0) return std::copysign(std::ldexp(float(mant), -24), sign ? -1.0f : 1.0f);
    const uint32_t u = sign | (exp == 31 ? 0x7f800000u | (mant << 13) : ((exp + 112) << 23) | (mant << 13));
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
}

// A float16 within an ulp of x (callers try its neighbours and check exactly); x finite, |x| < 65504.
inline int half_near(float x) {
    const float a = std::fabs(x);
    int mag;
    if (a < 6.103515625e-05f) {
        mag = int(std::lrint(a * 16777216.0f));  // subnormal: units of 2^-24
    } else {
        uint32_t u;
        std::memcpy(&u, &a, 4);
        mag = int((((u >> 23) - 112) << 10) | ((u >> 13) & 0x3ff));
    }
    return (x < 0 ? 0x8000 : 0) | mag;
}

inline v16 load16(const float* p) { v16 v; std::memcpy(&v, p, 64); return v; }

// 16 bytes widened to int32 lanes (zero- or sign-extended): one instruction with AVX-512 (two
// with AVX2), where GCC's generic conversion would go byte by byte.
template <bool SIGNED>
inline v16i widen(const void* p) {
    v16i v;
#if defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
    const __m512i w = SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    std::memcpy(&v, &w, 64);
#elif defined(__AVX2__)
    const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
    const __m128i c = _mm_unpackhi_epi64(b, b);
    const __m256i w0 = SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    const __m256i w1 = SIGNED ? _mm256_cvtepi8_epi32(c) : _mm256_cvtepu8_epi32(c);
    std::memcpy(&v, &w0, 32);
    std::memcpy(reinterpret_cast<char*>(&v) + 32, &w1, 32);
#else
    for (int i = 0; i < 16; ++i)
        v[i] = SIGNED ? int32_t(static_cast<const int8_t*>(p)[i]) : int32_t(static_cast<const uint8_t*>(p)[i]);
#endif
    return v;
}

// The two halves (weights 0-15, 16-31) of a block as float32, as the GGUF dequantiser computes them.
inline void decode(const BlockQ4_1& b, v16& lo, v16& hi) {
    const float d = b.d, m = b.m;
    const v16i q = widen<false>(b.qs);
#if defined(__AVX512F__)
    // the block's 16 possible values, looked up by nibble (the permutation reads an index's low 4 bits)
    const v16 iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16 table = iota * d + m;
    __m512 t, l, h;
    __m512i qi;
    std::memcpy(&t, &table, 64);
    std::memcpy(&qi, &q, 64);
    l = _mm512_permutexvar_ps(qi, t);
    h = _mm512_permutexvar_ps(_mm512_srli_epi32(qi, 4), t);
    std::memcpy(&lo, &l, 64);
    std::memcpy(&hi, &h, 64);
#else
    lo = __builtin_convertvector(q & 15, v16) * d + m;
    hi = __builtin_convertvector(q >> 4, v16) * d + m;
#endif
}

inline void decode(const BlockQ8_0& b, v16& lo, v16& hi) {
    const float d = b.d;
    lo = __builtin_convertvector(widen<true>(b.qs), v16) * d;
    hi = __builtin_convertvector(widen<true>(b.qs + 16), v16) * d;
}

inline bool finite_range(const float* w, float& lo, float& hi) {
    lo = hi = w[0];
    for (int i = 0; i < QK; ++i) {
        if (!(std::fabs(w[i]) < 65504.0f)) return false;
        lo = std::min(lo, w[i]);
        hi = std::max(hi, w[i]);
    }
    return true;
}

// Encodes w[0:32] as `out` if some d reproduces every value exactly (m must be their minimum).
bool encode(const float* w, BlockQ4_1& out) {
    float mn, mx;
    if (!finite_range(w, mn, mx)) return false;
    const int hm = half_near(mn);
    if (half_to_float(uint16_t(hm)) != mn) return false;
    const int h0 = half_near((mx - mn) / 15.0f);
    for (int hd = std::max(0, h0 - 2); hd <= std::min(0x7bff, h0 + 2); ++hd) {
        const float d = half_to_float(uint16_t(hd));
        bool ok = true;
        for (int i = 0; i < QK && ok; ++i) {
            const long q = d > 0.0f ? std::lrint((w[i] - mn) / d) : 0;
            ok = q >= 0 && q <= 15 && float(q) * d + mn == w[i];
            if (i < QK / 2) out.qs[i] = uint8_t(q);
            else out.qs[i - QK / 2] |= uint8_t(q << 4);
        }
        if (ok) {
            out.d = d;
            out.m = mn;
            return true;
        }
    }
    return false;
}

bool encode(const float* w, BlockQ8_0& out) {
    float mn, mx;
    if (!finite_range(w, mn, mx)) return false;
    const int h0 = half_near(std::max(-mn, mx) / 127.0f);
    for (int hd = std::max(0, h0 - 2); hd <= std::min(0x7bff, h0 + 2); ++hd) {
        const float d = half_to_float(uint16_t(hd));
        bool ok = true;
        for (int i = 0; i < QK && ok; ++i) {
            const long q = d > 0.0f ? std::lrint(w[i] / d) : 0;
            ok = q >= -128 && q <= 127 && float(q) * d == w[i];
            out.qs[i] = int8_t(q);
        }
        if (ok) {
            out.d = d;
            return true;
        }
    }
    return false;
}

template <typename B>
bool quantize(const float* w, i64 n, i64 k, B* out, int nthreads) {
    const i64 nb = k / QK;
    bool ok = true;
    #pragma omp parallel for num_threads(nthreads) reduction(&& : ok) schedule(static)
    for (i64 r = 0; r < n; ++r)
        for (i64 b = 0; b < nb && ok; ++b) ok = encode(w + r * k + b * QK, out[r * nb + b]);
    return ok;
}

// out[t, n0 + r] for R weight rows from n0 and MT activation rows from x: each block decoded once
// and used for every activation row; lo and hi halves summed apart (independent chains).
template <int R, int MT, typename B>
void rows_tile(const B* w, i64 nb, const float* x, i64 k, float* out, i64 n, i64 n0) {
    v16 acc[R][MT][2] = {};
    for (i64 b = 0; b < nb; ++b) {
        for (int r = 0; r < R; ++r) {
            v16 lo, hi;
            __builtin_prefetch(reinterpret_cast<const char*>(&w[(n0 + r) * nb + b]) + PREFETCH);
            decode(w[(n0 + r) * nb + b], lo, hi);
            for (int t = 0; t < MT; ++t) {
                acc[r][t][0] += lo * load16(x + t * k + b * QK);
                acc[r][t][1] += hi * load16(x + t * k + b * QK + 16);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < MT; ++t) {
            const v16 s = acc[r][t][0] + acc[r][t][1];
            float total = 0.0f;
            for (int i = 0; i < 16; ++i) total += s[i];
            out[t * n + n0 + r] = total;
        }
}

template <int R, int MT, typename B>
void rows(const B* w, i64 nb, const float* x, i64 k, float* out, i64 n, i64 n0) {
    if (n0 + R <= n) rows_tile<R, MT, B>(w, nb, x, k, out, n, n0);
    else
        for (i64 r = n0; r < n; ++r) rows_tile<1, MT, B>(w, nb, x, k, out, n, r);
}

constexpr i64 GROUP = 4;  // weight rows of one task
// Below this many multiply-adds a call runs on one thread: it takes less than waking a sleeping
// team (the server's pool waits passively) would save.
#ifndef SERIAL_WORK
#define SERIAL_WORK (i64(1) << 40)
#endif

template <typename B>
void linear(const float* x, const B* w, float* out, i64 m, i64 n, i64 k, int nthreads) {
    const i64 nb = k / QK, groups = (n + GROUP - 1) / GROUP;
    #pragma omp parallel for num_threads(m * n * k < SERIAL_WORK ? 1 : nthreads) schedule(static)
    for (i64 g = 0; g < groups; ++g) {
        const i64 n0 = g * GROUP;
        i64 t = 0;
#if defined(__AVX512F__)  // 32 vector registers: 16 accumulators, each block decoded once for 8 rows of x
        for (; t + 8 <= m; t += 8)
            for (i64 r = n0; r < std::min(n, n0 + GROUP); ++r)
                rows_tile<1, 8, B>(w, nb, x + t * k, k, out + t * n, n, r);
#endif
        for (; t + 4 <= m; t += 4) {
            rows<2, 4, B>(w, nb, x + t * k, k, out + t * n, n, n0);
            rows<2, 4, B>(w, nb, x + t * k, k, out + t * n, n, n0 + 2);
        }
        switch (m - t) {
            case 3:
                rows<2, 3, B>(w, nb, x + t * k, k, out + t * n, n, n0);
                rows<2, 3, B>(w, nb, x + t * k, k, out + t * n, n, n0 + 2);
                break;
            case 2: rows<4, 2, B>(w, nb, x + t * k, k, out + t * n, n, n0); break;
            case 1: rows<4, 1, B>(w, nb, x + t * k, k, out + t * n, n, n0); break;
            default: break;
        }
    }
}

}  // namespace

extern "C" {

// qtype: 0 = Q4_1, 1 = Q8_0. Returns 1 where every block of w [n, k] (k a multiple of 32) encodes exactly.
int hc_quantize(int qtype, const float* w, i64 n, i64 k, void* out, int nthreads) {
    if (qtype == 0) return quantize(w, n, k, static_cast<BlockQ4_1*>(out), nthreads);
    return quantize(w, n, k, static_cast<BlockQ8_0*>(out), nthreads);
}

// out [m, n] = x [m, k] @ W.T, W [n, k] in blocks of `qtype`.
void hc_linear_quant(int qtype, const float* x, const void* w, float* out, i64 m, i64 n, i64 k, int nthreads) {
    if (qtype == 0) linear(x, static_cast<const BlockQ4_1*>(w), out, m, n, k, nthreads);
    else linear(x, static_cast<const BlockQ8_0*>(w), out, m, n, k, nthreads);
}

}  // extern "C"
