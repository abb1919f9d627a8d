// Checked copies of L3 pages: CRC-32C (Castagnoli, as the crc32c package and iSCSI compute it) over
// a batch of buffers and the copies that go with it, in one call that Python makes through ctypes
// with the GIL released, the buffers spread over an OpenMP team. See kernels/cpu_io.py.
#include <cstdint>
#include <cstring>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#elif defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#endif

namespace {

uint32_t crc_table[256];

struct TableInit {
  TableInit() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      crc_table[i] = c;
    }
  }
} table_init;

// The running CRC (pre- and post-inverted by the caller) over n bytes.
uint32_t crc_update(uint32_t crc, const uint8_t* p, int64_t n) {
#if defined(__SSE4_2__) || defined(__ARM_FEATURE_CRC32)
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
#if defined(__SSE4_2__)
    c = _mm_crc32_u64(c, v);
#else
    c = __crc32cd(static_cast<uint32_t>(c), v);
#endif
  }
  crc = static_cast<uint32_t>(c);
#endif
  for (; n > 0; --n, ++p) crc = (crc >> 8) ^ crc_table[(crc ^ *p) & 0xFFu];
  return crc;
}

// A page's destination: `runs` runs of `run_bytes` contiguous bytes, `stride` bytes apart.
struct Dst {
  uint8_t* base;
  int64_t runs, stride, run_bytes;
};

void scatter(const uint8_t* src, const Dst& d) {
  for (int64_t r = 0; r < d.runs; ++r) std::memcpy(d.base + r * d.stride, src + r * d.run_bytes, d.run_bytes);
}

void gather(const Dst& d, uint8_t* out) {
  for (int64_t r = 0; r < d.runs; ++r) std::memcpy(out + r * d.run_bytes, d.base + r * d.stride, d.run_bytes);
}

}  // namespace

extern "C" {

uint32_t hc_crc32c(const uint8_t* p, int64_t n) { return ~crc_update(~0u, p, n); }

// For each buffer i: when the CRC-32C of src[i] (runs[i] * run_bytes[i] bytes) is want[i], copies it
// into its destination and sets ok[i] = 1; otherwise writes nothing there and sets ok[i] = 0.
void hc_check_copy(int64_t n, const uint8_t* const* src, uint8_t* const* dst, const int64_t* runs,
                   const int64_t* stride, const int64_t* run_bytes, const uint32_t* want, uint8_t* ok,
                   int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    const Dst d{dst[i], runs[i], stride[i], run_bytes[i]};
    ok[i] = hc_crc32c(src[i], d.runs * d.run_bytes) == want[i];
    if (ok[i]) scatter(src[i], d);
  }
}

// Copies a source of `runs` runs of `run_bytes` bytes, `stride` bytes apart, into the contiguous
// `out` and returns the CRC-32C of those bytes.
uint32_t hc_copy_crc(uint8_t* src, int64_t runs, int64_t stride, int64_t run_bytes, uint8_t* out) {
  const Dst d{src, runs, stride, run_bytes};
  gather(d, out);
  return hc_crc32c(out, runs * run_bytes);
}

}  // extern "C"
