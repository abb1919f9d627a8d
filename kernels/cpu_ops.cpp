// CPU kernels of the decoder layer, compiled at first use by kernels/cpu.py (g++ -O3 -march=native
// -fopenmp) and called through ctypes with raw pointers: no torch headers, so the build takes
// seconds. Each entry point takes the thread count of torch's pool and runs its OpenMP team with
// that many threads (the same libgomp as torch's: one pool, no oversubscription).
//
// Element types: 0 = float32, 1 = bfloat16 (math in float32, rounded to nearest even on store).
// Numerics follow the torch code of runtime/models/llama.py: RMSNorm normalises in float32,
// rounds to the dtype, then scales; RoPE computes in float32 and rounds once; SiLU rounds to the
// dtype before the product.
#include "cpu_vec.h"

namespace {

constexpr i64 SERIAL_ELEMENTS = 1 << 17;  // below this many elements a call runs on one thread

template <typename T>
void add_rmsnorm(const void* x, const void* delta, const void* w, void* sum_out, void* out, i64 n_rows,
                 i64 h, float eps, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (n_rows * h > SERIAL_ELEMENTS)
    for (i64 r = 0; r < n_rows; ++r) {
        const T* xr = static_cast<const T*>(x) + r * h;
        const T* dr = delta ? static_cast<const T*>(delta) + r * h : nullptr;
        T* sr = sum_out ? static_cast<T*>(sum_out) + r * h : nullptr;
        T* o = static_cast<T*>(out) + r * h;
        float ss = 0.0f;
        for (i64 e = 0; e < h; ++e) {
            float v = load<T>(xr, e);
            if (dr) {
                v = round_to<T>(v + load<T>(dr, e));
                store<T>(sr, e, v);
            }
            ss += v * v;
        }
        const float inv = 1.0f / std::sqrt(ss / float(h) + eps);
        for (i64 e = 0; e < h; ++e) {
            const float v = dr ? load<T>(sr, e) : load<T>(xr, e);
            store<T>(o, e, load<T>(static_cast<const T*>(w), e) * round_to<T>(v * inv));
        }
    }
}

template <typename T>
void rotate(const T* src, T* dst, const float* cs, i64 half) {
    for (i64 e = 0; e < half; ++e) {
        const float x1 = load<T>(src, e), x2 = load<T>(src, e + half);
        store<T>(dst, e, x1 * cs[e] - x2 * cs[half + e]);
        store<T>(dst, e + half, x2 * cs[e] + x1 * cs[half + e]);
    }
}

template <typename T>
void rope(const i64* positions, const void* q, const void* k, void* q_out, void* k_out, const float* cos_sin,
          i64 n_tokens, i64 hq, i64 hk, i64 d, i64 q_stride, i64 k_stride, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (n_tokens * (hq + hk) * d > SERIAL_ELEMENTS)
    for (i64 t = 0; t < n_tokens; ++t) {
        const float* cs = cos_sin + positions[t] * d;
        for (i64 hh = 0; hh < hq; ++hh)
            rotate<T>(static_cast<const T*>(q) + t * q_stride + hh * d, static_cast<T*>(q_out) + (t * hq + hh) * d,
                      cs, d / 2);
        for (i64 hh = 0; hh < hk; ++hh)
            rotate<T>(static_cast<const T*>(k) + t * k_stride + hh * d, static_cast<T*>(k_out) + (t * hk + hh) * d,
                      cs, d / 2);
    }
}

template <typename T>
void silu_mul(const void* x, void* out, i64 n_rows, i64 n, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) if (n_rows * n > SERIAL_ELEMENTS)
    for (i64 r = 0; r < n_rows; ++r) {
        const T* g = static_cast<const T*>(x) + r * 2 * n;
        T* o = static_cast<T*>(out) + r * n;
        i64 e = 0;
        for (; e + 16 <= n; e += 16) {
            v16 v, u;
            for (int i = 0; i < 16; ++i) { v[i] = load<T>(g, e + i); u[i] = load<T>(g, n + e + i); }
            const v16 act = v / (1.0f + exp_v(-v));
            for (int i = 0; i < 16; ++i) store<T>(o, e + i, round_to<T>(act[i]) * u[i]);
        }
        for (; e < n; ++e) {
            const float v = load<T>(g, e);
            store<T>(o, e, round_to<T>(v / (1.0f + std::exp(-v))) * load<T>(g, n + e));
        }
    }
}

}  // namespace

extern "C" {

void hc_add_rmsnorm(int dtype, const void* x, const void* delta, const void* w, void* sum_out, void* out,
                    i64 n_rows, i64 h, float eps, int nthreads) {
    if (dtype == 0) add_rmsnorm<float>(x, delta, w, sum_out, out, n_rows, h, eps, nthreads);
    else add_rmsnorm<uint16_t>(x, delta, w, sum_out, out, n_rows, h, eps, nthreads);
}

void hc_rope(int dtype, const i64* positions, const void* q, const void* k, void* q_out, void* k_out,
             const float* cos_sin, i64 n_tokens, i64 hq, i64 hk, i64 d, i64 q_stride, i64 k_stride, int nthreads) {
    if (dtype == 0) rope<float>(positions, q, k, q_out, k_out, cos_sin, n_tokens, hq, hk, d, q_stride, k_stride, nthreads);
    else rope<uint16_t>(positions, q, k, q_out, k_out, cos_sin, n_tokens, hq, hk, d, q_stride, k_stride, nthreads);
}

void hc_silu_mul(int dtype, const void* x, void* out, i64 n_rows, i64 n, int nthreads) {
    if (dtype == 0) silu_mul<float>(x, out, n_rows, n, nthreads);
    else silu_mul<uint16_t>(x, out, n_rows, n, nthreads);
}

}  // extern "C"

