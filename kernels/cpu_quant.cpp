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
// One vector: 16 floats with AVX-512, else 8 (native on AVX2, where GCC splits wider vectors badly).
#if defined(__AVX512F__)
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

constexpr int QK = 32;  // weights of one block
constexpr int NV = QK / VW;  // vectors of one block
constexpr i64 PREFETCH = 8192;  // bytes ahead of the weight stream: decode is bound by memory latency

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

inline vf loadv(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }

// VW bytes widened to int32 lanes (zero- or sign-extended): one instruction with AVX-512 or AVX2,
// where GCC's generic conversion would go byte by byte.
template <bool SIGNED>
inline vi widen(const void* p) {
    vi v;
#if defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
    const __m512i w = SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    std::memcpy(&v, &w, sizeof v);
#elif defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(p));
    const __m256i w = SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    std::memcpy(&v, &w, sizeof v);
#else
    for (int i = 0; i < VW; ++i)
        v[i] = SIGNED ? int32_t(static_cast<const int8_t*>(p)[i]) : int32_t(static_cast<const uint8_t*>(p)[i]);
#endif
    return v;
}

// A block's 32 weights as NV vectors of float32, as the GGUF dequantiser computes them.
inline void decode(const BlockQ4_1& b, vf (&w)[NV]) {
#if defined(__AVX512F__)
    // the block's 16 possible values, looked up by nibble (the permutation reads an index's low 4 bits)
    const vf iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vf table = iota * b.d + b.m;
    const vi q = widen<false>(b.qs);
    __m512 t, lo, hi;
    __m512i qi;
    std::memcpy(&t, &table, 64);
    std::memcpy(&qi, &q, 64);
    lo = _mm512_permutexvar_ps(qi, t);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(qi, 4), t);
    std::memcpy(&w[0], &lo, 64);
    std::memcpy(&w[1], &hi, 64);
#else
    for (int j = 0; j < NV / 2; ++j) {  // low nibbles: weights 0-15, high: 16-31
        const vi q = widen<false>(b.qs + j * VW);
        w[j] = __builtin_convertvector(q & 15, vf) * b.d + b.m;
        w[j + NV / 2] = __builtin_convertvector(q >> 4, vf) * b.d + b.m;
    }
#endif
}

inline void decode(const BlockQ8_0& b, vf (&w)[NV]) {
    for (int j = 0; j < NV; ++j) w[j] = __builtin_convertvector(widen<true>(b.qs + j * VW), vf) * b.d;
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
// and used for every activation row; even and odd vectors summed apart (independent chains).
template <int R, int MT, typename B>
void rows_tile(const B* w, i64 nb, const float* x, i64 k, float* out, i64 n, i64 n0) {
    vf acc[R][MT][2] = {};
    for (i64 b = 0; b < nb; ++b) {
        for (int r = 0; r < R; ++r) {
            vf wv[NV];
            __builtin_prefetch(reinterpret_cast<const char*>(&w[(n0 + r) * nb + b]) + PREFETCH);
            decode(w[(n0 + r) * nb + b], wv);
            for (int t = 0; t < MT; ++t)
                for (int j = 0; j < NV; ++j) acc[r][t][j & 1] += wv[j] * loadv(x + t * k + b * QK + j * VW);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < MT; ++t) {
            const vf s = acc[r][t][0] + acc[r][t][1];
            float total = 0.0f;
            for (int i = 0; i < VW; ++i) total += s[i];
            out[t * n + n0 + r] = total;
        }
}

// Weight rows per tile for MT activation rows: what the vector registers hold (32 with AVX-512, else 16).
constexpr int tile_rows(int mt) { return VW == 16 ? (mt <= 2 ? 4 : mt <= 4 ? 2 : 1) : (mt == 1 ? 4 : mt == 2 ? 2 : 1); }

constexpr i64 GROUP = 4;  // weight rows of one task
// Below this many multiply-adds a call runs on one thread: it takes less than waking a sleeping
// team (the server's pool waits passively) would save.
constexpr i64 SERIAL_WORK = i64(1) << 22;

// The task's weight rows [n0, n0 + GROUP) against MT activation rows.
template <int MT, typename B>
void group(const B* w, i64 nb, const float* x, i64 k, float* out, i64 n, i64 n0) {
    constexpr int R = tile_rows(MT);
    for (i64 r = n0; r < std::min(n, n0 + GROUP); r += R) {
        if (r + R <= n) rows_tile<R, MT, B>(w, nb, x, k, out, n, r);
        else
            for (i64 rr = r; rr < n; ++rr) rows_tile<1, MT, B>(w, nb, x, k, out, n, rr);
    }
}

template <typename B>
void linear(const float* x, const B* w, float* out, i64 m, i64 n, i64 k, int nthreads) {
    const i64 nb = k / QK, groups = (n + GROUP - 1) / GROUP;
    #pragma omp parallel for num_threads(m * n * k < SERIAL_WORK ? 1 : nthreads) schedule(static)
    for (i64 g = 0; g < groups; ++g) {
        const i64 n0 = g * GROUP;
        i64 t = 0;
        if constexpr (VW == 16)
            for (; t + 8 <= m; t += 8) group<8, B>(w, nb, x + t * k, k, out + t * n, n, n0);
        for (; t + 4 <= m; t += 4) group<4, B>(w, nb, x + t * k, k, out + t * n, n, n0);
        switch (m - t) {
            case 3: group<3, B>(w, nb, x + t * k, k, out + t * n, n, n0); break;
            case 2: group<2, B>(w, nb, x + t * k, k, out + t * n, n, n0); break;
            case 1: group<1, B>(w, nb, x + t * k, k, out + t * n, n, n0); break;
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
